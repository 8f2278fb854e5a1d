"""Prefill on one GPU: the prefill attention paths against torch SDPA, whole-model time to first
token against Hugging Face transformers, and decode latency while a long prompt joins. The matmul
rate is measured in the same run (helix.perf.rates); every floor uses it (prefill_floor.py).

  (a) attention (profiling/prefill_kernels.py): GQA, Llama-3.1-8B shape (32 q / 8 KV heads,
      d 128, bf16) at --contexts: the whole prompt (records with sdpa_ratio = SDPA's time / ours)
      and its last --chunk queries over the rest cached; the Triton kernel, its tile variants,
      torch's FA2 and cuDNN over the gathered pages; the fastest correct path (`choice`) and the
      TORCH_PREFILL entry for helix/attention/triton_backend.py. MLA (DeepSeek-V2-Lite / V3
      ranks): the absorbed kernel and the decompressed form, fraction of the matmul rate.
  (b) Llama-3.1-8B, all layers, bf16: TTFT of --ttft-prompts through helix.LLM (256K: Helix
      only, it must complete) and one forward of the same prompt through transformers
      (random-weight LlamaForCausalLM, sdpa, logits of the last row) in the same run, each with
      its FLOP floor. The preset's max_position is raised to the longest prompt (random weights).
  (c) DeepSeek-V2-Lite, all layers: TTFT of a 128K-token prompt, floor fraction.
  (d) Llama-3.1-8B: 8 requests decoding (1K-token prompts) while a 128K-token prompt joins:
      their time per token (step time; p50 / p99) during the join for max_prefill_tokens 2K /
      8K / 32K, next to their time per token alone. One engine, built for the largest chunk;
      each join sets its scheduler's max_prefill_tokens (the long request ends with its first
      token).

    python profiling/bench_prefill.py --parts a --out profiling/results/prefill.json
    python profiling/bench_prefill.py --parts b --out profiling/results/prefill.json --append
    python profiling/bench_prefill.py --parts c,d --out profiling/results/prefill.json --append
    python profiling/bench_prefill.py --smoke --out /tmp/prefill_smoke.json        # tiny, CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

if "--smoke" in sys.argv:          # CPU: the kernels run in Triton's interpreter, chosen before
    os.environ.setdefault("TRITON_INTERPRET", "1")       # triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix import LLM, Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix.attention.triton_backend import PREFILL_IMPLS  # noqa: E402
from helix.layers import mla_prefill  # noqa: E402
from helix.layers.mla_prefill import MLADims  # noqa: E402
from helix.loader import preset_path, read_model_config  # noqa: E402
from helix.perf.rates import event_median, measure  # noqa: E402
from helix.yamlio import load_yaml  # noqa: E402
from profiling import prefill_floor, prefill_kernels  # noqa: E402

K = 1024
GPU = dict(device="cuda", dtype="bfloat16", page=64, gqa=(32, 8, 128),
           mla=[("deepseek-v2-lite", 16, [4 * K, 16 * K, 64 * K]),
                ("deepseek-v3", 128, [4 * K, 16 * K])],
           mla_dims=MLADims(512, 64, 128, 128), contexts=[4 * K, 16 * K, 64 * K, 128 * K],
           ttft_model="llama-3.1-8b", ttft_prompts=[32 * K, 128 * K, 256 * K], hf_max=128 * K,
           mla_model="deepseek-v2-lite", mla_prompt=128 * K, join_model="llama-3.1-8b",
           join_prompt=128 * K, join_chunks=[2 * K, 8 * K, 32 * K], decoders=8,
           decoder_prompt=K, alone_steps=32, warm=2 * K, layers=0, chunk=8 * K)
SMOKE = dict(device="cpu", dtype="float32", page=16, gqa=(4, 2, 16),
             mla=[("tiny", 2, [32])], mla_dims=MLADims(32, 16, 16, 16), contexts=[32],
             ttft_model="tiny-llama", ttft_prompts=[24, 40], hf_max=24,
             mla_model="tiny-deepseek-v3", mla_prompt=24, join_model="tiny-llama",
             join_prompt=40, join_chunks=[8, 16], decoders=2, decoder_prompt=4, alone_steps=2,
             warm=8, layers=1, chunk=16)


class Bench:
    def __init__(self, args):
        self.args = args
        self.s = SMOKE if args.smoke else GPU
        self.dev = torch.device(self.s["device"])
        self.dtype = getattr(torch, self.s["dtype"])
        self.rates = measure(self.s["device"], self.s["dtype"])
        self.matmul = self.rates.matmul_flops
        self.name = self.rates.device
        self.records: list[dict] = []

    def time_s(self, fn, iters: int | None = None) -> float:
        """Median seconds of fn() after one warm-up call (compiles)."""
        iters = iters or self.args.iters
        fn()
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
            return event_median(fn, iters)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def sync(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def free(self):
        if self.dev.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def add(self, **rec):
        """One record (with the device and this run's matmul rate, which its floor used)."""
        rec.setdefault("device", self.name)
        rec.setdefault("matmul_tflops", round(self.matmul / 1e12, 3))
        self.records.append(rec)
        print(json.dumps(rec), flush=True)

    # -- (a) kernels: profiling/prefill_kernels.py ---------------------------------------------
    def iters_for(self, T: int) -> int:
        return max(2, self.args.iters // 2) if T >= 64 * K else self.args.iters

    def sdpa_ms(self, q, k, v, iters: int, gqa: bool = False, cudnn: bool = False):
        """torch SDPA, causal: default dispatch, or cuDNN's kernel only."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def run():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if not cudnn:
            return self.try_ms(run, iters)
        if self.dev.type != "cuda":
            return None
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return self.try_ms(run, iters)

    def try_ms(self, fn, iters: int):
        """Milliseconds of fn, or None where it cannot run here (unsupported, out of memory)."""
        try:
            return self.time_s(fn, iters) * 1e3
        except (RuntimeError, ValueError) as e:        # OutOfMemoryError is a RuntimeError
            print(f"  skipped: {str(e).splitlines()[0][:160]}", flush=True)
            self.free()
            return None

    # -- (b), (c) time to first token ---------------------------------------------------------
    def model_path(self, name: str, positions: int) -> str:
        """A preset, or a copy of it whose max_position covers `positions` (random weights)."""
        spec = load_yaml(preset_path(name))
        if spec["hf_config"]["max_position_embeddings"] >= positions:
            return name
        spec["hf_config"]["max_position_embeddings"] = positions
        path = os.path.join(tempfile.mkdtemp(), f"{name}-{positions}.yaml")
        with open(path, "w") as f:       # YAML, not JSON: PyYAML reads JSON's 1e-05 as a string
            yaml.safe_dump(spec, f)
        return path

    def runtime(self, context: int, **kw) -> RuntimeConfig:
        kw.setdefault("max_prefill_tokens", self.args.chunk)
        kw.setdefault("idle_prefill_tokens", self.args.idle_chunk)
        return RuntimeConfig(device=self.s["device"], dtype=self.s["dtype"],
                             page_size=self.s["page"], max_context=context + self.s["page"],
                             layers=self.s["layers"], prefix_caching=False, **kw)

    def ttft(self, llm: LLM, n: int) -> float:
        """Seconds from adding an n-token prompt to reading back its first token (other
        requests may be running)."""
        ids = torch.randint(llm.cfg.vocab_size, (n,)).tolist()
        self.sync()
        t0 = time.perf_counter()
        rid = llm.add_request(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
        while not llm.outputs.get(rid) and rid not in llm.errors:
            llm.step()
        self.sync()
        assert llm.outputs.get(rid), llm.errors
        return time.perf_counter() - t0

    def helix_ttft(self, part: str, name: str, prompts: list[int]):
        model = self.model_path(name, max(prompts) + 2 * self.s["page"])
        cfg = read_model_config(model, self.s["layers"])[0]
        with LLM(model, Layout(), self.runtime(max(prompts), max_batch=1)) as llm:
            chunk = llm.runtime.resolved_max_prefill_tokens
            idle = llm.runtime.resolved_idle_prefill_tokens      # alone: its chunks are these
            self.ttft(llm, min(idle + 5, max(prompts)))          # compiles; two chunks
            for n in prompts:
                t = self.ttft(llm, n)
                floor = prefill_floor.floor_s(cfg, n, self.matmul)
                self.add(part=part, engine="helix", model=name, prompt_tokens=n, ttft_s=t,
                         floor_s=floor, floor_fraction=floor / t, max_prefill_tokens=chunk,
                         idle_prefill_tokens=idle,
                         prefill=getattr(llm.engine.backend, "prefill", "torch"),
                         mla_prefill_form=mla_prefill.FORM if cfg.is_mla else None)
        self.free()

    def hf_ttft(self, name: str, prompts: list[int]):
        if not prompts:                    # every prompt past hf_max: Helix only
            return
        import transformers
        spec = dict(load_yaml(preset_path(name))["hf_config"])
        spec["max_position_embeddings"] = max(spec["max_position_embeddings"], max(prompts) + 1)
        cfg = read_model_config(name, self.s["layers"])[0]
        spec["num_hidden_layers"] = cfg.num_layers
        hf_cfg = transformers.LlamaConfig(**spec)
        with torch.device(self.dev):
            model = transformers.LlamaForCausalLM._from_config(
                hf_cfg, attn_implementation="sdpa", dtype=self.dtype).eval()
        self.hf_forward(model, self.s["warm"])
        for n in prompts:
            t = self.hf_forward(model, n)
            floor = prefill_floor.floor_s(cfg, n, self.matmul)
            self.add(part="b", engine="transformers", model=name, prompt_tokens=n, ttft_s=t,
                     floor_s=floor, floor_fraction=floor / t,
                     transformers=transformers.__version__)
        del model
        self.free()

    @torch.inference_mode()
    def hf_forward(self, model, n: int) -> float:
        """Seconds of one forward of an n-token prompt (no KV cache kept, last row's logits)."""
        ids = torch.randint(model.config.vocab_size, (1, n), device=self.dev)
        self.sync()
        t0 = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        self.sync()
        return time.perf_counter() - t0

    # -- (d) decoding while a long prompt joins ---------------------------------------------------
    def join(self):
        s = self.s
        chunks = s["join_chunks"][1:2] if self.args.quick else s["join_chunks"]
        model = self.model_path(s["join_model"], s["join_prompt"] + 2 * s["page"])
        rt = self.runtime(s["join_prompt"], max_batch=s["decoders"] + 1,
                          max_prefill_tokens=max(chunks))
        vocab = read_model_config(model)[0].vocab_size
        with LLM(model, Layout(), rt) as llm:
            params = SamplingParams(max_new_tokens=rt.max_context - s["decoder_prompt"] - 1,
                                    ignore_eos=True)
            ids = [llm.add_request(torch.randint(vocab, (s["decoder_prompt"],)).tolist(),
                                   params) for _ in range(s["decoders"])]
            while not all(llm.outputs.get(r) for r in ids):
                llm.step()                                    # every decoder past its prefill
            self.ttft(llm, s["warm"] + 5)                     # compiles the mixed step
            alone = self._step_times(llm, s["alone_steps"])
            self.add(part="d", model=s["join_model"], mode="alone", decoders=s["decoders"],
                     tpot_p50_ms=_pct(alone, 50), tpot_p99_ms=_pct(alone, 99), steps=len(alone))
            for c in chunks:
                llm.engine.scheduler.max_prefill_tokens = c
                rid = llm.add_request(torch.randint(vocab, (s["join_prompt"],)).tolist(),
                                      SamplingParams(max_new_tokens=1, ignore_eos=True))
                t0 = time.perf_counter()
                times = self._step_times(llm, None, until=lambda: bool(llm.outputs.get(rid)))
                ttft = time.perf_counter() - t0
                self.add(part="d", model=s["join_model"], mode="join", decoders=s["decoders"],
                         prompt_tokens=s["join_prompt"], max_prefill_tokens=c,
                         tpot_p50_ms=_pct(times, 50), tpot_p99_ms=_pct(times, 99),
                         steps=len(times), ttft_s=ttft, alone_p50_ms=_pct(alone, 50),
                         alone_p99_ms=_pct(alone, 99))
        self.free()

    def _step_times(self, llm: LLM, n: int | None, until=None) -> list[float]:
        """Wall times of n steps (or until until() holds): with overlap, one step apart."""
        times, last = [], time.perf_counter()
        while (until is None and len(times) < n) or (until is not None and not until()):
            llm.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times

    def run(self):
        parts = self.args.parts.split(",")
        if self.args.prefill:
            os.environ["HELIX_PREFILL"] = self.args.prefill     # read by TritonAttention()
        if self.args.mla_form:
            mla_prefill.FORM = self.args.mla_form
        if "a" in parts:
            prefill_kernels.gqa(self)
            prefill_kernels.mla(self)
        if "b" in parts:
            prompts = self.args.ttft_prompts or self.s["ttft_prompts"]
            if self.args.quick:
                prompts = prompts[:2]
            self.hf_ttft(self.s["ttft_model"], [n for n in prompts if n <= self.s["hf_max"]])
            self.helix_ttft("b", self.s["ttft_model"], prompts)
        if "c" in parts:
            self.helix_ttft("c", self.s["mla_model"], [self.s["mla_prompt"]])
        if "d" in parts:
            self.join()
        return parts


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return 1e3 * xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


def _f(x, fmt: str) -> str:
    """x in fmt ("9.2f"), or a dash as wide."""
    return "-".rjust(int(fmt.split(".")[0])) if x is None else format(x, fmt)


def summary(records: list[dict]) -> str:
    lines = ["(a) GQA: scenario, keys, queries, triton / flash / cudnn ms, choice, SDPA ms, "
             "sdpa_ratio, ours TFLOP/s"]
    for r in records:
        if r.get("kernel") in ("gqa", "gqa-chunk"):
            lines.append(f"  {r['scenario']:6} {r['prompt_tokens']:>7} {r['queries']:>7} "
                         f"{_f(r['triton_ms'], '9.2f')} {_f(r['flash_ms'], '9.2f')} "
                         f"{_f(r['cudnn_ms'], '9.2f')} {r['choice'] or 'none':6} "
                         f"{_f(r.get('sdpa_ms'), '9.2f')} {_f(r.get('sdpa_ratio'), '6.3f')} "
                         f"{_f(r['tflops'], '7.1f')}")
        elif r.get("kernel") == "gqa-choice":
            entry = (f"({r['torch_kernel']!r}, {r['torch_from_queries']})" if r["torch_kernel"]
                     else "none: the Triton kernel everywhere")
            lines.append(f"  TORCH_PREFILL[{r['device']!r}] = {entry}")
        elif r.get("kernel", "").startswith("mla-"):
            lines.append(f"  {r['kernel']:16} {r['model']:22} {r['prompt_tokens']:>7} "
                         f"{r['ms']:9.2f} ms  {100 * r['floor_fraction']:5.1f} % of matmul "
                         f"(useful {100 * r['useful_fraction']:5.1f} %)")
    lines.append("(b, c) TTFT: engine, model, tokens, seconds, floor s, floor fraction")
    for r in records:
        if r["part"] in ("b", "c"):
            lines.append(f"  {r['engine']:12} {r['model']:18} {r['prompt_tokens']:>7} "
                         f"{r['ttft_s']:8.2f} {r['floor_s']:8.2f} {r['floor_fraction']:6.3f}")
    lines.append("(d) decoders' time per token: mode, max_prefill_tokens, p50 ms, p99 ms, steps")
    for r in records:
        if r["part"] == "d":
            lines.append(f"  {r['mode']:6} {r.get('max_prefill_tokens') or '-':>7} "
                         f"{r['tpot_p50_ms']:8.2f} {r['tpot_p99_ms']:8.2f} {r['steps']:5}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the records")
    ap.add_argument("--append", action="store_true",
                    help="keep the records of other parts already in --out")
    ap.add_argument("--parts", default="a,b,c,d", help="comma list of a, b, c, d")
    ap.add_argument("--quick", action="store_true", help="fewer points and variants")
    ap.add_argument("--smoke", action="store_true", help="tiny presets on CPU (a test)")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--contexts", type=ints, default=None, help="part (a) GQA tokens")
    ap.add_argument("--ttft-prompts", type=ints, default=None, help="part (b) prompt tokens")
    ap.add_argument("--chunk", type=int, default=0,
                    help="max_prefill_tokens of parts (b), (c) and part (a)'s chunk queries "
                         "(0: the runtime default, 8K on CUDA)")
    ap.add_argument("--idle-chunk", type=int, default=0,
                    help="idle_prefill_tokens of parts (b), (c): a prompt alone runs in chunks "
                         "of this size (0: the runtime default, 32K on CUDA)")
    ap.add_argument("--prefill", choices=PREFILL_IMPLS, default=None,
                    help="GQA prefill path of the engine runs (HELIX_PREFILL)")
    ap.add_argument("--mla-form", choices=mla_prefill.FORMS, default=None,
                    help="MLA prefill form of the engine runs (HELIX_MLA_PREFILL)")
    args = ap.parse_args(argv)
    bench = Bench(args)
    parts = bench.run()
    records = bench.records
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)["records"]
        records = [r for r in old if r["part"] not in parts] + records
    with open(args.out, "w") as f:
        json.dump({"rates": bench.rates.as_record(), "records": records,
                   "argv": sys.argv[1:] if argv is None else argv}, f, indent=1)
    print(summary(records))


if __name__ == "__main__":
    main()
