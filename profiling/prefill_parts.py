"""Where a torch-kernel GQA prefill call spends its time, piece by piece, against SDPA's own
kernels on contiguous tensors (one H200: why `cudnn` was 0.86 x SDPA at 16K).

One sequence (the whole prompt in one chunk, pages shuffled), Llama-3.1-8B shape (32 q / 8 KV
heads, d 128), bf16, per --contexts length. Timed (CUDA events, median of --iters):
- sdpa_flash / sdpa_cudnn: F.scaled_dot_product_attention (enable_gqa) restricted to one
  backend, on contiguous [1, H, T, d] tensors: the baseline of bench_prefill part (a).
- slots, slots_host, gather: torch_prefill.gather_slots from the device key counts and from
  the host's (what the engine's steps use), and K and V gathered with those slots.
- kernel_cudnn / kernel_flash_varlen / kernel_flash_dense: each torch kernel alone on the
  gathered keys, in the layouts torch_prefill gives them (q [T, Hq, d] viewed as [1, Hq, T, d];
  FA2 varlen on [T, H, d]; FA2 dense, aten._scaled_dot_product_flash_attention, on the same
  views as cuDNN).
- call_cudnn / call_flash: torch_prefill.prefill_gqa as the engine calls it (host lengths).

    python profiling/prefill_parts.py --contexts 16384,65536 --out parts.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention import torch_prefill  # noqa: E402
from profiling.prefill_kernels import sequence_meta  # noqa: E402


def ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def point(T: int, iters: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, page = 32, 8, 128, 64
    scale = d ** -0.5
    meta = sequence_meta(T, T, page, dev)
    P = meta.block_tables.shape[1]
    kc, vc = (torch.randn(P, page, hkv, d, device=dev, dtype=dt) for _ in range(2))
    q = torch.randn(T, hq, d, device=dev, dtype=dt)
    order = meta.block_tables[0].long()
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()
    ks, vs = (c[order].flatten(0, 1)[:T].transpose(0, 1).unsqueeze(0).contiguous()
              for c in (kc, vc))
    rec = {"tokens": T, "heads": [hq, hkv, d]}

    def sdpa(backend):
        with sdpa_kernel([backend]):
            return ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                             enable_gqa=True), iters)
    for name, be in (("sdpa_flash_ms", SDPBackend.FLASH_ATTENTION),
                     ("sdpa_cudnn_ms", SDPBackend.CUDNN_ATTENTION)):
        try:
            rec[name] = sdpa(be)
        except RuntimeError as e:
            rec[name] = None
            rec[name + "_error"] = str(e).splitlines()[0][:200]
    slots = torch_prefill.gather_slots(meta, T, dev)
    rec["slots_ms"] = ms(lambda: torch_prefill.gather_slots(meta, T, dev), iters)
    rec["slots_host_ms"] = ms(lambda: torch_prefill.gather_slots(meta, T, dev, [T]), iters)
    rec["gather_ms"] = ms(lambda: (kc.flatten(0, 1)[slots], vc.flatten(0, 1)[slots]), iters)
    k, v = kc.flatten(0, 1)[slots], vc.flatten(0, 1)[slots]
    qv = q.transpose(0, 1).unsqueeze(0)
    kv_, vv_ = (x.transpose(0, 1).unsqueeze(0) for x in (k, v))
    rec["kernel_cudnn_ms"] = ms(lambda: torch_prefill._cudnn_op(qv, kv_, vv_, True, scale), iters)
    cu = torch.tensor([0, T], dtype=torch.int32, device=dev)
    rec["kernel_flash_varlen_ms"] = ms(lambda: torch_prefill.flash_varlen(
        q, k, v, cu, cu, T, T, scale), iters)
    try:
        dense = torch.ops.aten._scaled_dot_product_flash_attention
        rec["kernel_flash_dense_ms"] = ms(lambda: dense(qv, kv_, vv_, 0.0, True, False,
                                                        scale=scale), iters)
    except RuntimeError as e:
        rec["kernel_flash_dense_ms"] = None
        rec["kernel_flash_dense_error"] = str(e).splitlines()[0][:200]
    for kernel in torch_prefill.KERNELS:
        rec[f"call_{kernel}_ms"] = ms(lambda k_=kernel: torch_prefill.prefill_gqa(
            k_, q, kc, vc, meta, scale), iters)
    return rec


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="16384,65536")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    recs = []
    for T in (int(x) for x in args.contexts.split(",")):
        recs.append(point(T, args.iters))
        print(json.dumps(recs[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "records": recs}, f, indent=1)
    for r in recs:
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in r.items()))
    return recs


if __name__ == "__main__":
    main()
