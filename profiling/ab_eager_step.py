"""Eager decode step time (host-bound), gqa_decode's host cost per call and a cProfile of eager
steps, for an A/B between two source trees on one GPU (run it once from each tree's root):

    PYTHONPATH=. python profiling/ab_eager_step.py new llama-3.1-8b
    (cd /path/to/old/tree && PYTHONPATH=. python /path/to/ab_eager_step.py old llama-3.1-8b)
"""
import statistics
import sys
import time

import torch
from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.attention.triton_decode import gqa_decode

tag = sys.argv[1]
kw = dict(device="cuda", dtype="bfloat16", layers=4, max_batch=1, max_context=1200,
          graph_buckets=(1,), attention_backend="triton", cuda_graphs=False)
if "overlap" in RuntimeConfig.__dataclass_fields__:
    kw["overlap"] = False
g = torch.Generator().manual_seed(0)
with LLM(sys.argv[2], Layout(), RuntimeConfig(**kw)) as llm:
    llm.add_request(torch.randint(0, 1000, (1024,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=150, ignore_eos=True))
    llm.step()
    for _ in range(10):
        llm.step()
    t = [llm.step().seconds * 1e3 for _ in range(60)]
    print(f"{tag} {sys.argv[2]} eager step median {statistics.median(t):.3f} ms "
          f"min {min(t):.3f}", flush=True)
    # host cost of one gqa_decode call (launches only, no sync)
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    bt = torch.arange(64, dtype=torch.int32, device="cuda").view(1, 64)
    lens = torch.tensor([1000], dtype=torch.int32, device="cuda")
    for _ in range(20):
        gqa_decode(q, k, k, bt, lens, 0.1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(500):
        gqa_decode(q, k, k, bt, lens, 0.1)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{tag} gqa_decode host {1e6 * (t1 - t0) / 500:.1f} us/call", flush=True)
    # profile one eager step's host time by function
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        llm.step()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    print(tag, "cProfile top (20 steps):\n" + "\n".join(s.getvalue().splitlines()[6:26]),
          flush=True)
