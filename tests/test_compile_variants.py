"""After a server's warm-up (helix/serving/warmup.py), a random serving pattern (prompts of any
length joining while others decode, some starting like earlier ones so their chunks begin after
prefix-cache hits, contexts up to max_context) launches no Triton kernel variant the warm-up did
not: on a GPU each new variant is a compilation (~1 s) in the middle of serving. Triton compiles
one variant per specialisation of a launch's arguments: integers equal to 1 or divisible by 16
(unless the kernel names them in do_not_specialize), integers past 32 bits, pointers aligned to
16 bytes, every constexpr value. This test records that key for every launch through the
interpreter on the CPU (the attention kernels: the fused norm / RoPE ops run their torch
fallbacks off CUDA).

Before the mixed step's prefill metadata was aligned (helix/kv/manager.py: _aligned), this found
three new variants of the prefill kernel after the warm-up (block tables, lengths and positions
starting at odd offsets), and the block-table width (a stride that changes every step) made two
more in the prefill and decode kernels (now unspecialised): the mechanism of the ~1.2 s step seen
once per server process on the H200 (profiling/results/serve.md)."""

from __future__ import annotations

import random

import pytest
import torch
from triton_mode import ON_GPU  # first: chooses the interpreter before triton loads

from triton.runtime import interpreter  # noqa: E402

from helix import LLM, Layout, RuntimeConfig, SamplingParams  # noqa: E402
from helix.serving.warmup import warm_up  # noqa: E402

pytestmark = pytest.mark.skipif(ON_GPU, reason="records launches through the interpreter")


def _key(fn, args, kwargs) -> tuple:
    """What Triton specialises a launch on (its compile cache key, up to the source)."""
    plain = set(fn.kwargs.get("do_not_specialize") or ())
    parts = []
    for name, a in zip(fn.arg_names, args):
        if isinstance(a, torch.Tensor):
            parts.append((name, str(a.dtype), a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            parts.append((name, a))
        elif isinstance(a, int):
            wide = abs(a) >= 2**31
            cls = None if name in plain else ("1" if a == 1 else "16" if a % 16 == 0 else "")
            parts.append((name, cls, wide))
        else:
            parts.append((name, "float" if isinstance(a, float) else repr(a)))
    return fn.__name__, tuple(parts), tuple(sorted((k, repr(v)) for k, v in kwargs.items()))


@pytest.fixture
def launches(monkeypatch):
    seen: set = set()
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        seen.add(_key(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording)
    return seen


# layers: every layer launches the same kernels on the same shapes, so the fewest that hold each
# kind (tiny-deepseek-v3: a dense layer, then a MoE one); all 4 of tiny-llama's took ~120 s
@pytest.mark.parametrize("model,layers", [("tiny-llama", 1), ("tiny-deepseek-v3", 2)])
def test_serving_after_warm_up_compiles_nothing_new(launches, model, layers):
    # short contexts: the interpreter runs every tile (the warm-up's ladder of long contexts,
    # from 512, is not reached here)
    rt = RuntimeConfig(max_batch=24, attention_backend="triton", max_context=200, layers=layers)
    rnd = random.Random(0)
    with LLM(model, Layout(), rt) as llm:
        warm_up(llm)
        warm = set(launches)
        assert warm, "no kernel launched: the test would prove nothing"
        vocab = llm.cfg.vocab_size
        sent = []                          # earlier prompts: some later ones start the same way
        for _ in range(16):                # (prefix-cache hits: chunks after cached blocks)
            for _ in range(rnd.choice([0, 0, 1, 2, 3])):
                prefix = rnd.choice([0, 0, 0, rnd.randint(1, 150)])
                n = rnd.randint(1, min(40, 190 - prefix))
                ids = [rnd.randint(1, vocab - 1) for _ in range(n)]
                if sent and not prefix and rnd.random() < 0.4:
                    ids = rnd.choice(sent)[:rnd.randint(16, 60)] + ids[:20]
                sent.append(ids)
                llm.add_request(ids, SamplingParams(max_new_tokens=rnd.randint(1, 6),
                                                    ignore_eos=True), synthetic_prefix=prefix)
            if llm.has_unfinished():
                llm.step()
        while llm.has_unfinished():
            llm.step()
        assert llm.stats()["prefix_cache_hits"] > 0
    new = launches - warm
    assert not new, [(name, args) for name, args, _ in new]
