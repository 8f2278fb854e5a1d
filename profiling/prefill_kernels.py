"""Part (a) of profiling/bench_prefill.py: prefill attention paths on one sequence, pages shuffled.

GQA (the Llama-3.1-8B shape: 32 q / 8 KV heads, d 128), per length T of --contexts:
- "prompt": T queries over their own T keys, the whole prompt in one chunk. Against torch SDPA
  (default dispatch with enable_gqa, with repeated KV, and cuDNN's): sdpa_ratio = SDPA's time /
  ours, ours = the fastest Helix path whose output matches SDPA's.
- "chunk": the last `chunk` queries over T keys (T - chunk cached): what chunked prefill runs.
  Helix paths only (errors against the Triton kernel's output).
Helix paths: the Triton kernel (default tiles, and the CONFIGS variants: `triton_ms` is the best,
`triton_default_ms` the default), torch's FA2 ("flash") and cuDNN ("cudnn") over the gathered
pages (helix.attention.torch_prefill). `choice` is the fastest correct one; `crossover` turns the
records into the TORCH_PREFILL entry of helix/attention/triton_backend.py.

MLA, DeepSeek-V2-Lite and DeepSeek-V3 ranks (16 / 128 heads), prompt scenario: the absorbed
kernel and the decompressed form (page copy + expansion GEMM + kernel); `floor_fraction` is the
fraction of the matmul rate for the form's own FLOPs, `useful_fraction` for the decompressed
form's (the cheaper count: the same work measured the same way for both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helix.attention import torch_prefill, triton_prefill
from helix.attention.triton_backend import TritonAttention
from helix.kv.manager import LocalKVMeta
from helix.layers import mla_prefill

# Triton prefill tile variants timed beside the default (prefill_config's TUNABLES)
CONFIGS = {"bn128-s2": dict(BLOCK_N=128, num_stages=2), "bn32-s4": dict(BLOCK_N=32, num_stages=4),
           "s2": dict(num_stages=2), "s4": dict(num_stages=4),
           "m64-w4": dict(BLOCK_Q=16, num_warps=4)}
O_TOL, LSE_TOL = 2e-2, 1e-2          # bf16 outputs of N(0, 1) data; a path off by more is wrong


def sequence_meta(keys: int, queries: int, page: int, device) -> LocalKVMeta:
    """One sequence of `keys` local keys (kvp 1) whose last `queries` positions are the chunk;
    its pages a random permutation of the pool's; its lengths known on the host, as in the
    engine's steps (run e timed torch's kernels without them: one sync a call)."""
    pages = -(-keys // page)
    gen = torch.Generator().manual_seed(keys)
    return LocalKVMeta(
        slots=torch.full((queries,), -1, dtype=torch.int64, device=device),
        block_tables=torch.randperm(pages, generator=gen).int().view(1, pages).to(device),
        kv_lens=torch.tensor([keys], dtype=torch.int32, device=device),
        cu_q=torch.tensor([0, queries], dtype=torch.int32, device=device),
        q_pos=torch.arange(keys - queries, keys, device=device), kvp_rank=0, kvp=1,
        interleave=1, page_size=page, num_decode=0, max_q=queries, max_kv=keys,
        host_lens=([keys], [queries]))        # as the engine's steps carry them: no sync


def _err(o: torch.Tensor, want: torch.Tensor) -> float:
    return (o.float() - want.float()).abs().max().item()


def _paths(bench, q, kc, vc, meta, scale, iters, configs) -> tuple[dict, dict]:
    """Milliseconds and (o, lse) of every Helix path that runs here."""
    times = {"triton_default_ms": bench.try_ms(lambda: triton_prefill.gqa_prefill(
        q, kc, vc, meta, scale), iters)}
    tiles = {"default": times["triton_default_ms"]}
    for name, cfg in configs.items():
        tiles[name] = bench.try_ms(lambda c=cfg: triton_prefill.gqa_prefill(
            q, kc, vc, meta, scale, config=c), iters)
    done = {k: v for k, v in tiles.items() if v is not None}
    times["triton_ms"] = min(done.values())
    times["triton_best"] = min(done, key=done.get)
    times["triton_configs"] = tiles
    outs = {"triton": triton_prefill.gqa_prefill(q, kc, vc, meta, scale)}
    for kernel in torch_prefill.KERNELS:
        times[f"{kernel}_ms"] = None
        if torch_prefill.usable(kernel, q, kc, vc, meta):
            times[f"{kernel}_ms"] = bench.try_ms(lambda k=kernel: torch_prefill.prefill_gqa(
                k, q, kc, vc, meta, scale), iters)
            if times[f"{kernel}_ms"] is not None:
                outs[kernel] = torch_prefill.prefill_gqa(kernel, q, kc, vc, meta, scale)
    return times, outs


def _ratio(a, b):
    return None if a is None or b is None else a / b


def _rates(flops: float, ms: float | None, matmul: float) -> dict:
    """flops, TFLOP/s and fraction of the matmul rate of a path that took ms."""
    return dict(flops=flops, tflops=_ratio(flops / 1e9, ms),
                floor_fraction=_ratio(flops * 1e3 / matmul, ms))


def _choose(rec: dict, outs: dict, want: torch.Tensor) -> None:
    """Errors of every path against `want` (LSE against the Triton kernel's), and the fastest
    correct path as rec["choice"] / rec["ours_ms"]."""
    lse_t = outs["triton"][1]
    best = None
    for path, (o, lse) in outs.items():
        rec[f"err_{path}"] = _err(o, want)
        ok = rec[f"err_{path}"] < O_TOL
        if path != "triton":
            rec[f"lse_err_{path}"] = (lse - lse_t).abs().max().item()
            ok = ok and rec[f"lse_err_{path}"] < LSE_TOL
        ms = rec[f"{path}_ms"]
        if ok and (best is None or ms < rec[f"{best}_ms"]):
            best = path
    rec["choice"] = best
    rec["ours_ms"] = rec[f"{best}_ms"] if best else None


def gqa(bench) -> None:
    for T in bench.args.contexts or bench.s["contexts"]:
        _gqa_point(bench, T)
        bench.free()
    kernel, start = crossover([r for r in bench.records if r["kernel"] in ("gqa", "gqa-chunk")])
    bench.add(part="a", kernel="gqa-choice", torch_kernel=kernel, torch_from_queries=start)


def _gqa_point(bench, T: int) -> None:
    """The prompt record of length T, then (T > chunk) its chunk record."""
    hq, hkv, d = bench.s["gqa"]
    scale, page, dev, dt = d ** -0.5, bench.s["page"], bench.dev, bench.dtype
    configs = {} if bench.args.quick else CONFIGS
    chunk = bench.args.chunk or bench.s["chunk"]
    it = bench.iters_for(T)
    meta = sequence_meta(T, T, page, dev)
    q = torch.randn(T, hq, d, device=dev, dtype=dt)
    kc = torch.randn(meta.block_tables.shape[1], page, hkv, d, device=dev, dtype=dt)
    vc = torch.randn_like(kc)
    want, sdpa = _sdpa_prompt(bench, q, kc, vc, meta, it)
    times, outs = _paths(bench, q, kc, vc, meta, scale, it, configs)
    rec = dict(part="a", kernel="gqa", scenario="prompt", model="llama-3.1-8b-shape",
               prompt_tokens=T, queries=T, heads=[hq, hkv, d], page_size=page, **times, **sdpa)
    _choose(rec, outs, want)
    del want, outs
    best_sdpa = min(v for v in sdpa.values() if v is not None)
    flops = 4.0 * hq * d * T * (T + 1) / 2
    rec.update(sdpa_ms=best_sdpa, sdpa_ratio=_ratio(best_sdpa, rec["ours_ms"]),
               sdpa_ratio_triton=best_sdpa / rec["triton_ms"], sdpa_tflops=flops / best_sdpa
               / 1e9, **_rates(flops, rec["ours_ms"], bench.matmul))
    bench.add(**rec)
    if T <= chunk:
        return
    meta = sequence_meta(T, chunk, page, dev)
    best = rec["triton_best"]
    times, outs = _paths(bench, q[T - chunk:], kc, vc, meta, scale, it,
                         {} if best == "default" else {best: configs[best]})
    rec = dict(part="a", kernel="gqa-chunk", scenario="chunk", model="llama-3.1-8b-shape",
               prompt_tokens=T, queries=chunk, heads=[hq, hkv, d], page_size=page, **times)
    _choose(rec, outs, outs["triton"][0])
    pairs = chunk * (T - chunk) + chunk * (chunk + 1) / 2
    rec.update(_rates(4.0 * hq * d * pairs, rec["ours_ms"], bench.matmul))
    bench.add(**rec)


def _sdpa_prompt(bench, q, kc, vc, meta, iters) -> tuple[torch.Tensor, dict]:
    """SDPA's output [T, Hq, d] (repeated KV) and its times: default dispatch with enable_gqa,
    with repeated KV, cuDNN's kernel."""
    T, hq, _ = q.shape
    order = meta.block_tables[0].long()
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()                          # [1, Hq, T, d]
    ks, vs = (c[order].flatten(0, 1)[:T].transpose(0, 1).unsqueeze(0).contiguous()
              for c in (kc, vc))                                              # [1, Hkv, T, d]
    sdpa = {"sdpa_gqa_ms": bench.sdpa_ms(qs, ks, vs, iters, gqa=True)}
    group = hq // kc.shape[2]
    kr, vr = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
    sdpa["sdpa_repeat_ms"] = bench.sdpa_ms(qs, kr, vr, iters)
    sdpa["sdpa_cudnn_ms"] = bench.sdpa_ms(qs, kr, vr, iters, cudnn=True)
    want = F.scaled_dot_product_attention(qs, kr, vr, is_causal=True)[0].transpose(0, 1)
    return want, sdpa


def crossover(recs: list[dict]) -> tuple[str | None, int | None]:
    """(torch kernel, fewest keys) for TORCH_PREFILL: the kernel chosen in every record (whole
    prompts and chunks) from that many keys (prompt_tokens) on; (None, None) where no kernel
    wins the longest."""
    by_keys = sorted(recs, key=lambda r: -r["prompt_tokens"])
    best = (None, None)
    for kernel in torch_prefill.KERNELS:
        start = None
        for keys in sorted({r["prompt_tokens"] for r in by_keys}, reverse=True):
            if not all(r["choice"] == kernel for r in by_keys if r["prompt_tokens"] == keys):
                break
            start = keys
        if start is not None and (best[1] is None or start < best[1]):
            best = (kernel, start)
    return best


def mla(bench) -> None:
    for model, heads, contexts in bench.s["mla"]:
        for T in (contexts[1:2] if bench.args.quick and len(contexts) > 1 else contexts):
            _mla_point(bench, model, heads, T)
            bench.free()


def _mla_point(bench, model: str, H: int, T: int) -> None:
    """The absorbed and the decompressed record of an H-head rank, prompt of T tokens."""
    dims = bench.s["mla_dims"]
    dl, dr, dn, dv = dims.latent, dims.rope, dims.nope, dims.value
    scale, page = (dn + dr) ** -0.5, bench.s["page"]
    backend = TritonAttention("triton")
    meta = sequence_meta(T, T, page, bench.dev)
    gen = dict(device=bench.dev, dtype=bench.dtype)
    kv = torch.randn(meta.block_tables.shape[1], page, dl + dr, **gen)
    q_nope, q_rope = torch.randn(T, H, dn, **gen), torch.randn(T, H, dr, **gen)
    w_kv = torch.randn(H, dn + dv, dl, **gen) * dl ** -0.5
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_kv[:, :dn])
    it = bench.iters_for(T)
    t_abs = bench.time_s(lambda: triton_prefill.mla_prefill(q_lat, q_rope, kv, dl, meta, scale),
                         it)
    t_dec = bench.time_s(lambda: mla_prefill.decompressed_attention(
        q_nope, q_rope, kv, w_kv, meta, [T], backend, scale), it)
    o_abs, lse_abs = triton_prefill.mla_prefill(q_lat, q_rope, kv, dl, meta, scale)
    o_dec, lse_dec = mla_prefill.decompressed_attention(q_nope, q_rope, kv, w_kv, meta, [T],
                                                        backend, scale)
    err = _err(o_dec, torch.einsum("thc,hvc->thv", o_abs, w_kv[:, dn:]))
    pairs = T * (T + 1) // 2
    useful = mla_prefill.prefill_flops("decompressed", pairs, T, T, H, dims)
    own = {"mla-absorbed": 2.0 * H * (2 * dl + dr) * pairs, "mla-decompressed": useful}
    for kernel, t in (("mla-absorbed", t_abs), ("mla-decompressed", t_dec)):
        bench.add(part="a", kernel=kernel, scenario="prompt", model=f"{model}-rank", heads=H,
                  prompt_tokens=T, ms=t * 1e3, tflops=own[kernel] / t / 1e12,
                  floor_fraction=own[kernel] / t / bench.matmul,
                  useful_fraction=useful / t / bench.matmul, err_forms=err,
                  lse_err_forms=(lse_dec - lse_abs).abs().max().item())
