"""Decode attention kernels against the roofline of the GPU they run on (one GPU, one rank).

Shapes per rank:
  gqa: Llama-3.1-70B, 64 query heads / 8 KV heads, d 128, bf16, paged KV [P, page, 8, 128] x 2
  mla: DeepSeek-V3 absorbed, 128 heads, Dl 512 + Dr 64, bf16, paged KV [P, page, 576]: the
       Triton kernel, and on sm_90 also the Gluon kernel the backend runs there (gluon-mla)
for batch x per-rank context, skipping combos whose KV exceeds --mem-cap-gb. Each config is first
checked against a torch fp32 computation (rows 0 and B-1, loose bf16 tolerance), then timed as a
CUDA-graph replay with L2 flushed. The copy bandwidth and bf16 matmul rate are measured in the same
run; floor = max(bytes / copy_bw, flops / matmul_rate), bytes = KV read once + Q + O, flops = QK
and PV. GQA also times torch SDPA (enable_gqa) over the same KV, seen contiguously.

    python profiling/bench_attention.py --out profiling/results/attention_h200.json [--quick]

GQA split counts side by side in one run (one record per split count, `num_splits` field; SDPA
timed once per config), forced or left to the heuristic:

    python profiling/bench_attention.py --kernels gqa --batches 1,2,4,8 \\
        --contexts 4096,16384,65536 --gqa-splits auto,8,16,32 --out gqa_splits.json

The KV cache's storage (`--kv-dtypes bf16,fp8`; records' `kv_dtype`): fp8 pools hold the bf16
pool's values rounded to e4m3 (helix/kv/quant.py), queries stay bf16, the reference reads the
same stored values, and the floor counts one byte a cached element (SDPA and the Gluon MLA
kernel take 16-bit KV only: timed for bf16 pools).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention import gluon_mla, triton_backend  # noqa: E402
from helix.attention.triton_decode import gqa_decode, gqa_num_splits  # noqa: E402
from helix.attention.triton_mla import mla_decode, mla_plan  # noqa: E402
from helix.attention.triton_splits import sm_count_of  # noqa: E402
from helix.kv.quant import to_cache  # noqa: E402
from profiling.roofline import L2Flush, copy_bandwidth, graph_time_us, matmul_rate  # noqa: E402

GQA = dict(hq=64, hkv=8, d=128)
MLA = dict(h=128, dl=512, dr=64)
BATCHES = [1, 2, 4, 8, 16, 32, 64]
CONTEXTS = [4096, 16384, 65536, 131072, 262144, 524288]
BF16 = 2
DEVICE = "cuda"
KV_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def kv_bytes_per_token(kernel: str, elem: int = BF16) -> int:
    return GQA["hkv"] * GQA["d"] * 2 * elem if kernel == "gqa" else (MLA["dl"] + MLA["dr"]) * elem


def cost(kernel: str, B: int, ctx: int, kv_elem: int = BF16) -> tuple[int, int]:
    """(bytes, flops) of one decode step: KV read once (kv_elem bytes an element), Q and O
    once; QK and PV products."""
    kv = B * ctx * kv_bytes_per_token(kernel, kv_elem)
    if kernel == "gqa":
        hq, d = GQA["hq"], GQA["d"]
        return kv + 2 * B * hq * d * BF16, 2 * 2 * B * hq * ctx * d
    h, dl, dr = MLA["h"], MLA["dl"], MLA["dr"]
    return kv + B * h * (dl + dr + dl) * BF16, 2 * B * h * ctx * (dl + dr + dl)


def random_pool(shape, dtype=torch.bfloat16, gen_chunk=2**28) -> torch.Tensor:
    """Normal bf16 values, stored in `dtype` (fp8: rounded as the cache rounds them)."""
    pool = torch.empty(shape, dtype=dtype, device=DEVICE)
    flat = pool.view(-1)
    for i in range(0, flat.numel(), gen_chunk):
        part = flat[i:i + gen_chunk]
        part.copy_(to_cache(torch.empty(part.shape, dtype=torch.bfloat16,
                                        device=DEVICE).normal_(), dtype))
    return pool


def reference(q, k_seq, v_seq, scale, chunk=65536):
    """q [hkv, g, dk] (query heads grouped by KV head), k_seq [n, hkv, dk], v_seq [n, hkv, dv]
    -> (o [hkv * g, dv] fp32, lse [hkv * g]). Chunked over tokens to bound memory."""
    scores = torch.cat([torch.einsum("kgd,nkd->kgn", q.float(), k_seq[i:i + chunk].float())
                        for i in range(0, k_seq.shape[0], chunk)], dim=2) * scale
    lse = torch.logsumexp(scores, dim=2)                          # [hkv, g]
    p = torch.exp(scores - lse[..., None])
    o = sum(torch.einsum("kgn,nkd->kgd", p[..., i:i + chunk], v_seq[i:i + chunk].float())
            for i in range(0, v_seq.shape[0], chunk))
    return o.flatten(0, 1), lse.flatten()


def check(o, lse, ref_o, ref_lse, what):
    err_o = (o.float() - ref_o).abs().max().item()
    err_l = (lse - ref_lse).abs().max().item()
    if not (err_o < 2e-2 + 2e-2 * ref_o.abs().max().item() and err_l < 2e-2):
        raise AssertionError(f"{what}: max |o err| {err_o:.3g}, max |lse err| {err_l:.3g}")
    return max(err_o, err_l)


def gqa_splits(args) -> list[int | None]:
    """Split counts to time per config (None: the heuristic's choice)."""
    return [None if x == "auto" else int(x) for x in args.gqa_splits.split(",")]


def bench_config(kernel, B, ctx, page, pools, flush, args) -> list[dict]:
    """The records of one (batch, context): one per GQA variant x split count, one for MLA."""
    pages = B * ctx // page
    bt = torch.arange(pages, dtype=torch.int32, device=DEVICE).view(B, ctx // page)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEVICE)
    if kernel == "gqa":
        hq, hkv, d = GQA["hq"], GQA["hkv"], GQA["d"]
        k_pool, v_pool = pools
        q = torch.randn(B, hq, d, device=DEVICE, dtype=torch.bfloat16)
        scale = d ** -0.5
        k_seq = k_pool[:pages].view(B, ctx, hkv, d)          # identity block table: contiguous
        v_seq = v_pool[:pages].view(B, ctx, hkv, d)
        refs = {b: reference(q[b].view(hkv, hq // hkv, d), k_seq[b], v_seq[b], scale)
                for b in {0, B - 1}}
        sdpa_us = (None if args.no_sdpa or k_pool.dtype != torch.bfloat16
                   else sdpa_time(q, k_seq, v_seq, scale, flush))
        records = []
        for forced in gqa_splits(args):
            splits = forced or gqa_num_splits(B, hkv, bt.shape[1] * page, q.device,
                                              args.gqa_min_tokens)
            fn = lambda n=splits: gqa_decode(q, k_pool, v_pool, bt, lens,  # noqa: E731
                                             scale, num_splits=n)
            o, lse = fn()
            errs = [check(o[b], lse[b], *refs[b], f"gqa B{B} ctx{ctx} splits {splits} row {b}")
                    for b in refs]
            records.append(dict(kernel="triton-gqa", batch=B, context=ctx, sdpa_us=sdpa_us,
                                kv_dtype=kv_name(k_pool),
                                shape="llama-3.1-70b rank: 64q/8kv d128 bf16",
                                num_splits=splits, splits_forced=forced is not None,
                                max_err=max(errs),
                                time_us=graph_time_us(fn, args.iters, flush)))
        return records
    h, dl, dr = MLA["h"], MLA["dl"], MLA["dr"]
    (kv_pool,) = pools
    ql = torch.randn(B, h, dl, device=DEVICE, dtype=torch.bfloat16)
    qr = torch.randn(B, h, dr, device=DEVICE, dtype=torch.bfloat16)
    scale = 192 ** -0.5                                   # DeepSeek qk head dim 128 + 64
    seq = kv_pool[:pages].view(B, ctx, 1, dl + dr)
    refs = {b: reference(torch.cat((ql[b], qr[b]), -1)[None], seq[b], seq[b, :, :, :dl], scale)
            for b in {0, B - 1}}
    records = []
    for forced in [None if x == "auto" else int(x) for x in args.mla_splits.split(",")]:
        splits = forced or mla_plan(B, h, dl, dr, kv_pool.dtype, bt.shape[1] * page,
                                    ql.device)[1]
        fn = lambda n=splits: mla_decode(ql, qr, kv_pool, bt, lens, scale,  # noqa: E731
                                         num_splits=n)
        o, lse = fn()
        errs = [check(o[b], lse[b], *refs[b], f"mla B{B} ctx{ctx} splits {splits} row {b}")
                for b in refs]
        records.append(dict(kernel="triton-mla", batch=B, context=ctx, sdpa_us=None,
                            kv_dtype=kv_name(kv_pool),
                            shape="deepseek-v3 rank: 128h Dl512 Dr64 bf16", max_err=max(errs),
                            num_splits=splits, splits_forced=forced is not None,
                            time_us=graph_time_us(fn, args.iters, flush)))
        if kv_pool.dtype == torch.bfloat16 and gluon_runs():
            splits = forced or gluon_mla.plan(B, h, bt.shape[1] * page,
                                              sm_count_of(ql.device), page).num_splits
            fn = lambda n=splits: gluon_mla.mla_decode_gluon(  # noqa: E731
                ql, qr, kv_pool, bt, lens, scale, num_splits=n,
                variant=triton_backend.GLUON_VARIANT)
            o, lse = fn()
            errs = [check(o[b], lse[b], *refs[b], f"gluon B{B} ctx{ctx} splits {splits} row {b}")
                    for b in refs]
            records.append(dict(kernel="gluon-mla", variant=triton_backend.GLUON_VARIANT,
                                kv_dtype="bf16",
                                batch=B, context=ctx, sdpa_us=None,
                                shape="deepseek-v3 rank: 128h Dl512 Dr64 bf16, sm_90",
                                max_err=max(errs), num_splits=splits,
                                splits_forced=forced is not None,
                                time_us=graph_time_us(fn, args.iters, flush)))
    return records


def kv_name(pool: torch.Tensor) -> str:
    return next(k for k, v in KV_DTYPES.items() if v == pool.dtype)


@functools.lru_cache(maxsize=None)
def gluon_runs() -> bool:
    """The sm_90 Gluon MLA kernel (the one the backend runs there) compiles and passes its
    self-check on this GPU; it is then timed beside triton-mla."""
    ok = gluon_mla.gluon_available(DEVICE, triton_backend.GLUON_VARIANT)
    if not ok:
        print(f"  gluon MLA not timed: "
              f"{gluon_mla.why_unavailable(DEVICE, triton_backend.GLUON_VARIANT)[:200]}",
              flush=True)
    return ok


def sdpa_time(q, k_seq, v_seq, scale, flush, repeat_cap_gb=16.0):
    """torch SDPA over the same KV viewed [B, Hkv, ctx, d] (no copy) with enable_gqa; if that
    fails, over KV repeated to every query head (when that copy stays under repeat_cap_gb)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qs = q.unsqueeze(2)                                       # [B, Hq, 1, d]
    ks, vs = k_seq.transpose(1, 2), v_seq.transpose(1, 2)     # [B, Hkv, ctx, d]
    try:
        return graph_time_us(lambda: sdpa(qs, ks, vs, scale=scale, enable_gqa=True), 10, flush)
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking the kernel
        print(f"  sdpa enable_gqa failed: {type(e).__name__}: {e}", flush=True)
    group = q.shape[1] // ks.shape[1]
    if 2 * ks.numel() * group * ks.element_size() > repeat_cap_gb * 1e9:
        return None
    kr, vr = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
    try:
        return graph_time_us(lambda: sdpa(qs, kr, vr, scale=scale), 10, flush)
    except Exception as e:  # noqa: BLE001
        print(f"  sdpa failed: {type(e).__name__}: {e}", flush=True)
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file for the records")
    p.add_argument("--quick", action="store_true", help="batch {1, 8} x context {4K, 64K}")
    p.add_argument("--kernels", default="gqa,mla", help="comma list of gqa, mla")
    p.add_argument("--batches", default=None, help="comma list (default 1..64)")
    p.add_argument("--contexts", default=None, help="comma list of tokens per rank")
    p.add_argument("--mem-cap-gb", type=float, default=60.0, help="skip configs with more KV")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--gqa-splits", default="auto",
                   help="comma list of split counts to force, or auto (choose_num_splits)")
    p.add_argument("--mla-splits", default="auto",
                   help="comma list of MLA split counts to force, or auto (mla_plan's choice)")
    p.add_argument("--gqa-min-tokens", type=int, default=None,
                   help="choose_num_splits' shortest split for auto (default: the library's)")
    p.add_argument("--kv-dtypes", default="bf16",
                   help="comma list of KV cache storages: bf16, fp8 (e4m3)")
    args = p.parse_args()
    kv_dtypes = args.kv_dtypes.split(",")
    if not set(kv_dtypes) <= set(KV_DTYPES):
        p.error(f"--kv-dtypes: choose among {', '.join(KV_DTYPES)}")
    batches = [int(x) for x in args.batches.split(",")] if args.batches else (
        [1, 8] if args.quick else BATCHES)
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else (
        [4096, 65536] if args.quick else CONTEXTS)

    copy_bw, mm = copy_bandwidth(), matmul_rate()
    print(f"copy {copy_bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    flush = L2Flush()
    records = []
    for kernel, kv_dtype in [(k, d) for k in args.kernels.split(",") for d in kv_dtypes]:
        elem = KV_DTYPES[kv_dtype].itemsize
        cap_tokens = int(args.mem_cap_gb * 1e9) // kv_bytes_per_token(kernel, elem)
        configs = [(B, c) for B in batches for c in contexts if B * c <= cap_tokens]
        if not configs:
            continue
        pages = max(B * c for B, c in configs) // args.page_size
        inner = (GQA["hkv"], GQA["d"]) if kernel == "gqa" else (MLA["dl"] + MLA["dr"],)
        pools = [random_pool((pages, args.page_size, *inner), KV_DTYPES[kv_dtype])
                 for _ in range(2 if kernel == "gqa" else 1)]
        for B, ctx in configs:
            nbytes, flops = cost(kernel, B, ctx, elem)
            floor = max(nbytes / copy_bw, flops / mm) * 1e6
            for rec in bench_config(kernel, B, ctx, args.page_size, pools, flush, args):
                rec.update(floor_us=floor, roofline_fraction=floor / rec["time_us"],
                           achieved_GBps=nbytes / rec["time_us"] / 1e3,
                           copy_GBps=copy_bw / 1e9, matmul_TFLOPs=mm / 1e12, bytes=nbytes,
                           flops=flops, page_size=args.page_size,
                           device=torch.cuda.get_device_name())
                records.append(rec)
                sdpa = f"{rec['sdpa_us']:.1f}" if rec["sdpa_us"] else "-"
                vs = (f"  {rec['sdpa_us'] / rec['time_us']:.3f}x sdpa speed"
                      if rec["sdpa_us"] else "")
                what = f" s{rec['num_splits']:<3}" if "num_splits" in rec else ""
                print(f"{rec['kernel']} {kv_dtype} B{B:<3} ctx {ctx:>7}{what}: "
                      f"{rec['time_us']:9.1f} us  "
                      f"floor {floor:9.1f} us  {100 * rec['roofline_fraction']:5.1f}% roofline  "
                      f"{rec['achieved_GBps']:6.0f} GB/s  sdpa {sdpa} us{vs}", flush=True)
                with open(args.out, "w") as f:                # after every record: a kill
                    json.dump(records, f, indent=1)           # keeps what was measured
        del pools
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
