"""The decode step's kernels on one GPU: router, MoE experts, few-heads MLA, and whole
DeepSeek-V2-Lite steps, old kernels against new, with the copy rate measured in the same run.

  (a) router: the previous torch router (cast, GEMM, softmax / sigmoid, top-k: ~7 launches),
      route_torch (the lowest-id tie rule in torch), GEMM + the Triton selection kernel, and
      the fused kernel (GEMM + selection in one launch), for DeepSeek-V2-Lite (64 experts,
      fp32 router), DeepSeek-V3 (256, sigmoid, groups) and Qwen3-235B (128, bf16) at batch 1, 8.
  (b) MoE experts: fused_moe's v1 (sorted, two kernels + torch routing) against the decode
      kernels' variants (helix.layers.moe_decode tunables), DeepSeek-V2-Lite (64 x 1408 x 2048,
      top-6) and Qwen3-235B (128 x 1536 x 4096, top-8) layers, batch 1/2/4/8: time, bytes read
      (the hit experts' weights), fraction of the copy rate.
  (c) MLA, 16 heads (DeepSeek-V2-Lite rank) at 1K / 32K / 128K, batch 1 and 8 (--mla-batches):
      triton_mla's own kernel and, on sm_90, the Gluon kernel the backend runs there, against
      triton_mla_few's variants; fraction of the KV-read floor.
  (d) whole DeepSeek-V2-Lite decode steps (27 layers, bf16, graphs, synthetic prefix), batch 1
      x 1K / 32K / 128K and 8 x 32K: step time, kernels per step, the top kernels, the
      step's roofline floor (helix.sweep.floor_fields: helix.perf.cost at rates measured in
      the same run, the floor `helix sweep` records); "before" (previous router, MoE v1,
      triton_mla), "after" (the new kernels' defaults) and the other modes of set_kernels.
  (e) the greedy token: torch.argmax against sampling_ops' chunked kernel, [B, V] fp32 logits
      of DeepSeek-V2-Lite's and Llama-3's vocabularies.

Times are CUDA-graph replays with L2 flushed (a)-(c), or the engine's step (d).

    python profiling/bench_step_kernels.py --out profiling/results/step_kernels_h200.json
    python profiling/bench_step_kernels.py --parts b --quick --out moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix import triton_util  # noqa: E402
from helix.attention import (gluon_mla, triton_backend, triton_decode, triton_mla,  # noqa: E402
                             triton_mla_few)
from helix.layers import fused_mla  # noqa: E402
from helix.layers import fused_moe as fm  # noqa: E402
from helix.layers import fused_qk_norm  # noqa: E402
from helix.layers import gluon_moe  # noqa: E402
from helix.layers import moe_decode as md  # noqa: E402
from helix.layers import router as rt  # noqa: E402
from helix.layers import skinny_gemm  # noqa: E402
from helix.layers import triton_router as tr  # noqa: E402
from helix.runtime import sampling_ops  # noqa: E402
from profiling.roofline import L2Flush, copy_bandwidth, graph_time_us  # noqa: E402

DEVICE = "cuda"
ROUTERS = {  # name: (spec, experts, hidden, router weight dtype)
    "deepseek-v2-lite": (tr.RouteSpec(6, False, 1, 1, "none", False, 1.0), 64, 2048, torch.float32),
    "deepseek-v3": (tr.RouteSpec(8, True, 8, 4, "top2", True, 2.5), 256, 7168, torch.float32),
    "qwen3-235b": (tr.RouteSpec(8, False, 1, 1, "none", True, 1.0), 128, 4096, torch.bfloat16),
}
EXPERTS = {  # name: (experts, moe width, hidden, top-k)
    "deepseek-v2-lite": (64, 1408, 2048, 6),
    "qwen3-235b": (128, 1536, 4096, 8),
}
MOE_VARIANTS = [  # (name, fused_moe variant, moe_decode config)
    ("v1", "v1", None),
    ("dot", "decode", dict(mode="dot")),
    ("dot-bn32", "decode", dict(mode="dot", up_BLOCK_N=32, down_BLOCK_N=32)),
    ("dot-bk128-s4", "decode", dict(mode="dot", up_BLOCK_K=128, down_BLOCK_K=128, num_stages=4)),
    ("dot-ks2", "decode", dict(mode="dot", K_SPLITS=2)),
    ("dot-2launch", "decode", dict(mode="dot", FUSED_COMBINE=False)),
    ("fma", "decode", dict(mode="fma")),
    ("fma-m2", "decode", dict(mode="fma", BLOCK_M=2)),
    # one weight tile over the whole K range a program (gate/up: D; down: half of I)
    ("fma-tile-n1", "decode", dict(mode="fma", BLOCK_M=1, up_BLOCK_N=1, up_BLOCK_K=2048,
                                   down_BLOCK_N=2, down_BLOCK_K=1024, K_SPLITS=2)),
    ("fma-tile-n2", "decode", dict(mode="fma", BLOCK_M=1, up_BLOCK_N=2, up_BLOCK_K=2048,
                                   down_BLOCK_N=4, down_BLOCK_K=1024, K_SPLITS=2)),
    ("fma-tile-n4", "decode", dict(mode="fma", BLOCK_M=1, up_BLOCK_N=4, up_BLOCK_K=2048,
                                   down_BLOCK_N=8, down_BLOCK_K=1024, K_SPLITS=2)),
    ("fma-tile-n2-w8", "decode", dict(mode="fma", BLOCK_M=1, up_BLOCK_N=2, up_BLOCK_K=2048,
                                      down_BLOCK_N=4, down_BLOCK_K=1024, K_SPLITS=2,
                                      num_warps=8)),
]
MLA_VARIANTS = [  # (name, kernel, config)
    ("triton_mla", "mla", None),
    ("few-swap", "few", dict(SWAP=True)),
    ("few-plain", "few", dict(SWAP=False)),
    ("few-plain-bn32-s3", "few", dict(SWAP=False, BLOCK_N=32, num_stages=3)),
    ("few-swap-2waves", "few", dict(SWAP=True, split_policy="2waves")),
    ("few-swap-w8", "few", dict(SWAP=True, num_warps=8)),
]


def legacy_router(x, weight, bias, spec):
    """The router's torch code before the Triton router (helix.layers.router at 9783d9b)."""
    logits = F.linear(x.to(weight.dtype), weight).float()
    k = spec.k
    if spec.sigmoid:
        scores = logits.sigmoid()
        choice = scores + bias.float()
        if spec.groups > 1:
            T, E = choice.shape
            grouped = choice.view(T, spec.groups, E // spec.groups)
            gs = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(gs, dtype=torch.bool)
            keep.scatter_(1, gs.topk(spec.topk_group, dim=-1).indices, True)
            keep = keep.unsqueeze(-1).expand(T, spec.groups, E // spec.groups).reshape(T, E)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        w = scores.gather(1, ids)
        if spec.norm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
    else:
        w, ids = logits.softmax(dim=-1).topk(k, dim=-1)
        if spec.norm:
            w = w / w.sum(-1, keepdim=True)
    return (w * spec.scaling).to(x.dtype), ids


def bench_router(args, flush) -> list[dict]:
    recs = []
    for name, (spec, E, D, wdt) in ROUTERS.items():
        g = torch.Generator(device=DEVICE).manual_seed(0)
        weight = (torch.randn(E, D, generator=g, device=DEVICE) / D ** 0.5).to(wdt)
        bias = torch.randn(E, generator=g, device=DEVICE) * 0.1 if spec.sigmoid else None
        for T in (1, 8):
            x = torch.randn(T, D, generator=g, device=DEVICE).bfloat16()
            logits = F.linear(x.to(wdt), weight).float()
            ref_w, ref_ids = rt.route_torch(logits, bias, spec)
            paths = {
                "torch-legacy": lambda: legacy_router(x, weight, bias, spec),
                "torch-tie-rule": lambda: rt.route_torch(
                    F.linear(x.to(wdt), weight).float(), bias, spec),
                "gemm+select": lambda: tr.route_select_triton(
                    F.linear(x.to(wdt), weight).float(), bias, spec, x.dtype),
                "fused": lambda: tr.route_fused_triton(x, weight, bias, spec),
            }
            for path, fn in paths.items():
                w, ids = fn()
                same = (ids == ref_ids).all(-1).float().mean().item()
                recs.append(dict(part="router", model=name, batch=T, path=path,
                                 ids_equal_rows=same,
                                 w_err=(w.float() - ref_w).abs().max().item(),
                                 time_us=graph_time_us(fn, args.iters, flush)))
                print(json.dumps(recs[-1]), flush=True)
    return recs


def _routing(T, E, k, gen):
    """ids [T, k]: k distinct experts per token, uniform; weights [T, k] bf16."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEVICE)
    return torch.rand(T, k, generator=gen).bfloat16().to(DEVICE), ids


def bench_moe(args, flush, copy_bw) -> list[dict]:
    recs = []
    variants = MOE_VARIANTS[:4] if args.quick else MOE_VARIANTS
    if args.moe_variants:
        variants = [v for v in MOE_VARIANTS if v[0] in args.moe_variants]
    for name, (E, I, D, k) in EXPERTS.items():
        g = torch.Generator(device=DEVICE).manual_seed(1)
        gate = (torch.randn(E, I, D, generator=g, device=DEVICE, dtype=torch.bfloat16) / D ** .5)
        up = (torch.randn(E, I, D, generator=g, device=DEVICE, dtype=torch.bfloat16) / D ** .5)
        down = (torch.randn(E, D, I, generator=g, device=DEVICE, dtype=torch.bfloat16) / I ** .5)
        for T in args.moe_batches:
            cpu = torch.Generator().manual_seed(T)
            w, ids = _routing(T, E, k, cpu)
            x = torch.randn(T, D, generator=cpu).bfloat16().to(DEVICE)
            hit = int(torch.unique(ids).numel())
            nbytes = hit * 3 * I * D * 2
            ref = fm.fused_moe_torch(x, gate, up, down, w, ids, 0).float()
            for vname, variant, cfg in variants:
                def fn(v=variant, c=cfg):
                    return fm.fused_moe(x, gate, up, down, w, ids, 0, variant=v, config=c)
                err = (fn().float() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
                us = graph_time_us(fn, args.iters, flush)
                recs.append(dict(part="moe", shape=name, batch=T, variant=vname, config=cfg,
                                 experts_hit=hit, bytes=nbytes, time_us=us, rel_err=err,
                                 copy_rate_frac=nbytes / (us * 1e-6) / copy_bw))
                print(json.dumps(recs[-1]), flush=True)
        gate = up = down = None       # free the weights (not del: the closures above use them)
        torch.cuda.empty_cache()
    return recs


VOCABS = {"deepseek-v2-lite": 102400, "llama-3.1-8b": 128256}


def bench_greedy(args, copy_bw) -> list[dict]:
    """(e) the greedy token: torch.argmax against the chunked kernel on [B, V] fp32 logits."""
    recs = []
    for name, V in VOCABS.items():
        for B in args.greedy_batches:
            x = torch.randn(B, V, device=DEVICE)
            x[:, V // 2] = 1e4                                  # a known answer
            paths = [("torch", lambda: torch.argmax(x, -1))] + [
                (f"kernel-{b}", lambda b=b: _greedy(x, b)) for b in (1024, 2048, 4096, 8192)]
            for path, fn in paths:
                ok = bool((fn() == V // 2).all())
                us = graph_time_us(fn, args.iters, None)
                recs.append(dict(part="greedy", vocab=name, batch=B, path=path, time_us=us,
                                 correct=ok, copy_rate_frac=x.numel() * 4 / (us * 1e-6) / copy_bw))
                print(json.dumps(recs[-1]), flush=True)
    return recs


def _greedy(x, block):
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    sampling_ops.greedy_argmax_triton(x, out, block)
    return out


MLA_SHAPE = (16, 512, 64, 64)            # heads, latent, rope, page: DeepSeek-V2-Lite's rank


def _gluon_runs() -> bool:
    """The Gluon MLA kernel compiles and passes its self-check here (sm_90)."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        return False
    try:
        return gluon_mla.self_check(torch.device(DEVICE), triton_backend.GLUON_VARIANT)[0]
    except Exception as e:                            # no Gluon, not sm_90: not timed
        print(f"  gluon MLA not timed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return False


def bench_mla(args, flush, copy_bw) -> list[dict]:
    recs = []
    H, Dl, Dr, page = MLA_SHAPE
    variants = MLA_VARIANTS[:3] if args.quick else MLA_VARIANTS
    if _gluon_runs():
        variants = variants + [("gluon", "gluon", None)]
    for B in args.mla_batches:
        for ctx in args.mla_contexts:
            pages = B * ctx // page
            g = torch.Generator(device=DEVICE).manual_seed(2)
            kv = torch.randn(pages, page, Dl + Dr, generator=g, device=DEVICE).bfloat16()
            bt = torch.arange(pages, dtype=torch.int32, device=DEVICE).view(B, ctx // page)
            lens = torch.full((B,), ctx, dtype=torch.int32, device=DEVICE)
            ql = torch.randn(B, H, Dl, generator=g, device=DEVICE).bfloat16()
            qr = torch.randn(B, H, Dr, generator=g, device=DEVICE).bfloat16()
            scale = 192 ** -0.5
            nbytes = kv.numel() * 2
            ref = None
            for vname, kern, cfg in variants:
                if kern == "mla":   # config={}: triton_mla's own kernel, not the few-heads
                    # routing (records before this fix timed the few-heads kernel twice)
                    fn = lambda: triton_mla.mla_decode(  # noqa: E731
                        ql, qr, kv, bt, lens, scale, config={})
                elif kern == "gluon":             # the sm_90 kernel the backend runs instead
                    fn = lambda: gluon_mla.mla_decode_gluon(  # noqa: E731
                        ql, qr, kv, bt, lens, scale, variant=triton_backend.GLUON_VARIANT)
                else:
                    fn = lambda c=cfg: triton_mla_few.mla_decode_few(  # noqa: E731
                        ql, qr, kv, bt, lens, scale, config=c)
                o, _ = fn()
                ref = o.float() if ref is None else ref
                us = graph_time_us(fn, args.iters, flush)
                recs.append(dict(part="mla", batch=B, context=ctx, heads=H, variant=vname,
                                 config=cfg, time_us=us, bytes=nbytes,
                                 max_err_vs_triton_mla=(o.float() - ref).abs().max().item(),
                                 floor_frac=nbytes / copy_bw / (us * 1e-6)))
                print(json.dumps(recs[-1]), flush=True)
            kv = None                     # free the cache (not del: the closures above use it)
            torch.cuda.empty_cache()
    return recs


STEP_MODES = ("before", "after", "after-nofew", "after-v1moe", "after-nofold",
              "after-gluon-simple", "after-nopdl", "after-cublas", "after-nopdl-cublas",
              "after-pdl-wait", "after-pdl-early", "after-pdl-prefetch", "after-noabsorbrow",
              "after-nogemv", "after-gemv-late", "after-router-chunked", "after-nonormgemv",
              "after-noonetile", "after-nogluon", "after-gluon-nopdl", "after-gluon-kv-late",
              "after-few-batch1", "after-attn-7a34bf8", "after-torch-argmax",
              "after-gemv-nosplit", "after-ffd0c4b", "after-gluon-nofew", "after-skinny-big",
              "after-noqknorm", "after-gqa-twolaunch", "after-gqa-waves1", "after-gqa-waves05",
              "after-gqa-merge8192", "after-router-onetile8k", "after-noropeappend",
              "after-nomoerow", "after-moerow-stages6", "after-moerow-stages4",
              "after-noroute", "after-noearlyrow", "after-fp8", "after-fp8-nomoerow",
              "after-fp8-w8", "after-few-min2", "after-few-min4")


def set_kernels(mode: str) -> None:
    """'before': the previous router, MoE v1, triton_mla; 'after': the new defaults with the
    few-heads MLA kernel on; 'after-nofew': the same with triton_mla; 'after-v1moe': the new
    defaults with MoE v1 (step_kernels.md: v1 measured faster inside the batch-1 step);
    'after-nofold': without the shared experts in the MoE kernels; 'after-gluon-simple': the
    previous Gluon MLA variant (one 8-warp consumer); 'after-nopdl': the defaults launched
    without programmatic dependent launch (helix.triton_util.PDL); 'after-cublas': the
    projections in cuBLAS (F.linear / einsum, not helix.layers.skinny_gemm);
    'after-nopdl-cublas': both (the defaults before either); 'after-pdl-wait' / '-early' /
    '-prefetch': PDL in one mode of helix.triton_util (HELIX_PDL=wait / early / prefetch);
    'after-noabsorbrow': W_UK's absorption and the kv row as two launches
    (fused_mla.FUSE_ABSORB off); 'after-nogemv': the projections of <= 4 rows in the split-K
    skinny kernel, not the one-tile GEMV (skinny_gemm.GEMV off); 'after-gemv-late': the GEMV
    loading its weights after the PDL wait (skinny_gemm.GEMV_EARLY off); 'after-router-chunked':
    the fused router over D in chunks, its weight read after the wait (triton_router.ONE_TILE
    off); 'after-nonormgemv': the input norms as their own launches, not in the GEMV's
    (skinny_gemm.NORM_IN_GEMV off); 'after-noonetile': none of the one-tile kernels that load
    their weights before the wait (the GEMV, so the norm in it too, and the one-tile router
    off: the kernels of 6f0a1b1); 'after-nogluon': absorbed MLA decode on triton_mla, not the
    Gluon kernel (HELIX_MLA_GLUON=0 for the engines built in this mode); 'after-gluon-nopdl':
    the Gluon kernel launched without PDL (gluon_mla.PDL off); 'after-gluon-kv-late': with PDL
    but every KV tile loaded after the wait (gluon_mla.KV_EARLY off); 'after-few-batch1': the
    few-heads kernel at batch 1 (triton_backend.GLUON_FEW_HEADS_FROM_BATCH = 2);
    'after-attn-7a34bf8': all three, Gluon's 64-split cap and its empty splits written and
    merged (gluon_mla.SKIP_EMPTY off): the MLA decode of 7a34bf8;
    'after-torch-argmax': greedy tokens by torch.argmax (sampling_ops.GREEDY_KERNEL off);
    'after-gemv-nosplit': projections with K past one GEMV tile on the skinny kernel
    (skinny_gemm.GEMV_SPLIT off); 'after-ffd0c4b': both (the step of ffd0c4b);
    'after-gluon-nofew': few-heads launches on the seesaw Gluon variant, not "few"
    (triton_backend.GLUON_FEW_VARIANT None); 'after-skinny-big': the skinny kernel for weights of
    any size past the GEMV's rows (skinny_gemm.SKINNY_MAX_WEIGHT_ELEMENTS at the 64M bound);
    'after-noqknorm': Qwen3's q / k norms and ropes as four launches (fused_qk_norm.FUSE off);
    'after-gqa-twolaunch': GQA decode splits always merged by a second launch
    (triton_decode.FUSED_MERGE off: the GQA decode of b840cd1); 'after-gqa-waves1' /
    'after-gqa-waves05': GQA split counts aimed at 1 / 0.5 waves of programs, not 2
    (triton_decode.GQA_WAVES); 'after-gqa-merge8192': the one-launch GQA merge up to 8192
    partial elements (triton_decode.FUSED_MERGE_ELEMENTS of 1efc800; now 4096);
    'after-router-onetile8k': the fused router's one-tile path only up to 8192 elements
    (triton_router.ONE_TILE_ELEMENTS of 009a278; now 16384: 8 x 2048 rows of DeepSeek-V2-Lite
    at batch 8 in one tile); 'after-noropeappend': GQA's KV append as a launch of its own
    after the rotation (fused_qk_norm.FUSE_APPEND off); 'after-nomoerow': one row's MoE on
    moe_decode's two Triton launches, not gluon_moe's one launch (gluon_moe.ENABLED off);
    'after-moerow-stages6' / '-stages4': gluon_moe's weight ring 6 / 4 stages deep, not 8 (less
    shared memory held beside the next kernel); 'after-noroute': one row's MoE launch without
    the router in it (the router's own launch before it: gluon_moe.ROUTED off);
    'after-noearlyrow': one-row steps with
    PDL_ON alone, not PDL_EARLY (triton_util.EARLY_ONE_ROW off: HELIX_PDL=wait); 'after-fp8':
    the weights in block fp8, quantized at load (RuntimeConfig.quantization "fp8"; bench_steps
    reads the mode); 'after-fp8-nomoerow': the same with one row's fp8 experts on moe_decode's
    two launches, not gluon_moe's one (gluon_moe.FP8 off); 'after-fp8-w8': fp8 with 8
    consumer warps in the one-row MoE launch (gluon_moe.NUM_WARPS_FP8); 'after-few-min2' /
    'after-few-min4': the Gluon "few" MLA variant's splits hold at least 2 / 4 KV tiles, not 1
    (gluon_mla.MIN_SPLIT_TOKENS: a short sequence takes fewer, longer splits and a smaller
    merge)."""
    if mode not in STEP_MODES:
        raise SystemExit(f"--step-modes: {mode!r} is not one of {', '.join(STEP_MODES)}")
    after = mode != "before"
    rt.Router.forward = _NEW_FORWARD if after else _legacy_forward
    fm.VARIANT = "v1" if mode in ("before", "after-v1moe") else "auto"
    triton_mla_few.MODE = "0" if mode in ("before", "after-nofew") else ""
    fm.FOLD_SHARED = mode not in ("before", "after-nofold")
    triton_backend.GLUON_VARIANT = "simple" if mode == "after-gluon-simple" else _GLUON_VARIANT
    triton_backend.GLUON_FEW_VARIANT = None if mode == "after-gluon-nofew" else _GLUON_FEW
    fused_qk_norm.FUSE = mode != "after-noqknorm"
    triton_decode.FUSED_MERGE = mode != "after-gqa-twolaunch"
    triton_decode.GQA_WAVES = {"after-gqa-waves1": 1.0,
                               "after-gqa-waves05": 0.5}.get(mode, _GQA_WAVES)
    triton_decode.FUSED_MERGE_ELEMENTS = 8192 if mode == "after-gqa-merge8192" else _GQA_FUSED
    skinny_gemm.SKINNY_MAX_WEIGHT_ELEMENTS = (skinny_gemm.MAX_WEIGHT_ELEMENTS
                                              if mode == "after-skinny-big" else _SKINNY_BOUND)
    triton_util.PDL = _PDL and mode not in ("after-nopdl", "after-nopdl-cublas")
    pdl_mode = mode.removeprefix("after-pdl-") if mode.startswith("after-pdl-") else None
    triton_util.FLAGS = triton_util.PDL_MODES[pdl_mode] if pdl_mode else _FLAGS
    triton_util.EARLY_ONE_ROW = _EARLY_ONE_ROW and mode != "after-noearlyrow"
    skinny_gemm.ENABLED = _SKINNY and mode not in ("after-cublas", "after-nopdl-cublas")
    fused_mla.FUSE_ABSORB = mode not in ("before", "after-noabsorbrow")
    skinny_gemm.GEMV = _GEMV and mode not in ("before", "after-nogemv", "after-noonetile")
    skinny_gemm.GEMV_EARLY = mode != "after-gemv-late"
    tr.ONE_TILE = mode not in ("before", "after-router-chunked", "after-noonetile")
    tr.ONE_TILE_ELEMENTS = 8192 if mode == "after-router-onetile8k" else _ONE_TILE_ELEMENTS
    fused_qk_norm.FUSE_APPEND = mode not in ("before", "after-noropeappend")
    skinny_gemm.NORM_IN_GEMV = mode not in ("before", "after-nonormgemv")
    gluon_moe.ENABLED = mode not in ("before", "after-nomoerow")
    gluon_moe.FP8 = mode != "after-fp8-nomoerow"
    gluon_moe.NUM_WARPS_FP8 = 8 if mode == "after-fp8-w8" else _MOE_WARPS_FP8
    gluon_moe.ROUTED = mode not in ("before", "after-nomoerow", "after-noroute")
    gluon_moe.STAGES = {"after-moerow-stages6": 6, "after-moerow-stages4": 4}.get(mode,
                                                                                  _MOE_STAGES)
    start = mode == "after-attn-7a34bf8"
    gluon_mla.PDL = mode != "after-gluon-nopdl" and not start
    gluon_mla.KV_EARLY = mode != "after-gluon-kv-late"
    gluon_mla.MAX_SPLITS = 64 if start else _GLUON_MAX_SPLITS
    gluon_mla.SKIP_EMPTY = not start
    few_tiles = {"after-few-min2": 2, "after-few-min4": 4}.get(mode)
    gluon_mla.MIN_SPLIT_TOKENS = ({**_MIN_SPLIT, "few": few_tiles * gluon_mla.BLOCK_N}
                                  if few_tiles else _MIN_SPLIT)
    triton_backend.GLUON_FEW_HEADS_FROM_BATCH = (2 if start or mode == "after-few-batch1"
                                                 else _FEW_FROM_BATCH)
    sampling_ops.GREEDY_KERNEL = mode not in ("after-torch-argmax", "after-ffd0c4b")
    skinny_gemm.GEMV_SPLIT = mode not in ("after-gemv-nosplit", "after-ffd0c4b")
    if mode == "after-nogluon":
        os.environ["HELIX_MLA_GLUON"] = "0"
    elif _MLA_GLUON is None:
        os.environ.pop("HELIX_MLA_GLUON", None)
    else:
        os.environ["HELIX_MLA_GLUON"] = _MLA_GLUON


_NEW_FORWARD = rt.Router.forward
_MOE_STAGES = gluon_moe.STAGES
_MIN_SPLIT = gluon_mla.MIN_SPLIT_TOKENS
_MOE_WARPS_FP8 = gluon_moe.NUM_WARPS_FP8
_GLUON_VARIANT = triton_backend.GLUON_VARIANT
_GLUON_FEW = triton_backend.GLUON_FEW_VARIANT
_SKINNY_BOUND = skinny_gemm.SKINNY_MAX_WEIGHT_ELEMENTS
_PDL = triton_util.PDL
_FLAGS = triton_util.FLAGS
_EARLY_ONE_ROW = triton_util.EARLY_ONE_ROW
_SKINNY = skinny_gemm.ENABLED
_GEMV = skinny_gemm.GEMV
_ONE_TILE_ELEMENTS = tr.ONE_TILE_ELEMENTS          # the library default (16384)
_MLA_GLUON = os.environ.get("HELIX_MLA_GLUON")
_GLUON_MAX_SPLITS = gluon_mla.MAX_SPLITS
_GQA_WAVES = triton_decode.GQA_WAVES
_GQA_FUSED = triton_decode.FUSED_MERGE_ELEMENTS
_FEW_FROM_BATCH = triton_backend.GLUON_FEW_HEADS_FROM_BATCH


def _legacy_forward(self, x):
    return legacy_router(x, self.weight, self.e_score_correction_bias, self.spec)


def _replay_ms(llm, n: int = 20) -> float | None:
    """The step's graph alone: n back-to-back replays of the bucket the engine ran last (its
    static inputs as that step left them: the same rows again, no host work, no input copies,
    no token read-back), ms a replay. step_ms - replay_ms is what a step costs outside its
    graph."""
    graphs = getattr(llm.engine, "graphs", None)
    runner = graphs.runner if graphs is not None else None
    if runner is None or not runner.use_graphs or runner.last_bucket is None:
        return None
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        runner.replay(runner.last_bucket)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def bench_steps(args) -> list[dict]:
    from helix.commands import profile as prof_cmd
    from helix.commands import trace_tables as tt
    from helix.config import Layout
    from helix.perf.rates import measure
    from helix.runtime.sampling import SamplingParams
    from helix.sweep import Sweep, floor_fields, open_llm
    recs = []
    mid = args.step_contexts[len(args.step_contexts) // 2]
    points = [(1, c) for c in args.step_contexts] + [(b, mid) for b in args.step_batches]
    steps = args.step_steps
    cuda = DEVICE == "cuda"
    sweep = Sweep(name="step", models=(args.step_model,), layouts=(Layout(),),
                  batches=tuple(dict.fromkeys((1, *args.step_batches))),
                  contexts=tuple(args.step_contexts),
                  runtime=dict(device=DEVICE, dtype="bfloat16" if cuda else "float32",
                               layers=args.step_layers, cuda_graphs=True,
                               attention_backend="triton" if cuda else "torch", page_size=64,
                               seed=0),
                  decode_steps=2 * steps + 4, warmup_steps=3,
                  max_batch_tokens=max(b * c for b, c in points))
    rates = measure(DEVICE, sweep.runtime["dtype"])     # the sweep's floor at this run's rates
    runs = [(mode, moe) for mode in args.step_modes for moe in args.step_moe_configs]
    for mode, moe in runs:
        set_kernels(mode)
        gluon_moe.TRACE = args.step_trace
        gluon_moe.TRACES.clear()
        overrides(moe)
        t0 = time.perf_counter()
        quant = "fp8" if mode.startswith("after-fp8") else "none"
        run_sweep = dataclasses.replace(sweep, runtime={**sweep.runtime, "quantization": quant})
        with open_llm(run_sweep, args.step_model, Layout()) as llm:
            build_s = time.perf_counter() - t0
            for batch, context in points:
                g = torch.Generator().manual_seed(0)
                params = SamplingParams(max_new_tokens=3 + 2 * steps + 4, ignore_eos=True)
                for _ in range(batch):
                    llm.add_request(torch.randint(0, llm.cfg.vocab_size, (1,), generator=g)
                                    .tolist(), params, synthetic_prefix=context - 1)
                for _ in range(4):
                    llm.step()
                walls = [llm.step().seconds for _ in range(steps)]
                replay_ms = _replay_ms(llm) if cuda else None
                events = prof_cmd._profiled(llm, 3, cuda, None)
                ops, per_step = prof_cmd._ops_of_steps(events, 3)
                table = tt.kernel_table(ops, 3)
                critical = tt.critical_table(per_step)
                while llm.has_unfinished():
                    llm.step()
                step_ms = 1e3 * statistics.median(walls)
                moe_trace = step_trace(step_ms) if args.step_trace else None
                floor = floor_fields(llm, Layout(), batch, context, step_ms, rates)
                recs.append(dict(part="step", model=args.step_model, mode=mode, moe_config=moe,
                                 batch=batch,
                                 context=context,
                                 step_ms=step_ms, floor_ms=floor["floor_ms"],
                                 vs_floor=floor["floor_ratio"], rates=floor["rates"],
                                 replay_ms=replay_ms,
                                 kernel_ms=sum(o.dur for o in ops) / 3e3,
                                 kernels_per_step=len(ops) / 3, engine_build_s=build_s,
                                 top_kernels=_rounded(table), critical_kernels=_rounded(critical),
                                 **({"moe_trace": moe_trace} if moe_trace else {})))
                print(json.dumps(recs[-1]), flush=True)
        del llm
        gc.collect()              # cycles that hold an engine's tensors (an 80 GB card ran out
        if cuda:                  # of memory at the fifth engine of one process)
            torch.cuda.empty_cache()
    set_kernels("after")
    overrides({})
    gluon_moe.TRACE = False
    gluon_moe.TRACES.clear()
    return recs


def step_trace(step_ms: float) -> dict | None:
    """--step-trace: the one-row MoE launches of the step's last graph replay (gluon_moe.TRACES
    whose stamps fall in its last step_ms; a captured graph's buffers are rewritten at every
    replay, so they stay listed), in order; per stamp (gluon_moe.STAMPS) the median
    over layers of its median and max over programs, in us from the previous MoE launch's end
    (its last program's; the first launch is left out), and the median launch-to-launch time."""
    bufs = [t.double().cpu() for t in gluon_moe.TRACES]
    if not bufs:
        return None
    last = max(t[:, 6].max().item() for t in bufs)
    bufs = sorted((t for t in bufs if t[:, 6].max().item() > last - 0.95e6 * step_ms),
                  key=lambda t: t[:, 0].min().item())
    out = {name: [[], []] for name in gluon_moe.STAMPS}
    layer = []
    for prev, t in zip(bufs, bufs[1:]):
        end = prev[:, 6].max()
        layer.append((t[:, 6].max() - end).item() / 1e3)
        for i, name in enumerate(gluon_moe.STAMPS):
            col = (t[:, i] - end) / 1e3
            out[name][0].append(col.median().item())
            out[name][1].append(col.max().item())
    if not layer:
        return None
    res = {name: [round(statistics.median(a), 2), round(statistics.median(b), 2)]
           for name, (a, b) in out.items()}
    res.update(launches=len(bufs), layer_us=round(statistics.median(layer), 2))
    return res


def _rounded(rows: list[dict], top: int = 25) -> list[dict]:
    """A kernel table's first rows, floats to two decimals (the records' tables)."""
    return [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
            for r in rows[:top]]


_MOE_CONFIG = md.moe_decode_config


def overrides(moe: dict) -> None:
    """Every moe_decode launch of the engine takes these tunables over its defaults (the
    --step-moe-configs sweep: tiles measured inside whole steps); {} restores the defaults."""
    def patched(T, k, n_local, inter, dim, dtype, sm_count=132, config=None, shared=0):
        return _MOE_CONFIG(T, k, n_local, inter, dim, dtype, sm_count,
                           {**moe, **(config or {})}, shared)
    md.moe_decode_config = patched if moe else _MOE_CONFIG


def summary(records: list[dict]) -> str:
    lines = []
    router = [r for r in records if r["part"] == "router"]
    if router:
        lines.append("(a) router us (graph replay): model batch | " + " | ".join(
            dict.fromkeys(r["path"] for r in router)))
        for key in dict.fromkeys((r["model"], r["batch"]) for r in router):
            row = [r for r in router if (r["model"], r["batch"]) == key]
            lines.append(f"  {key[0]:>17} {key[1]:>2} | " + " | ".join(
                f"{r['time_us']:6.1f}{'' if r['ids_equal_rows'] == 1 else '*'}" for r in row))
    moe = [r for r in records if r["part"] == "moe"]
    if moe:
        lines.append("(b) MoE us / copy-rate fraction: shape batch | " + " | ".join(
            dict.fromkeys(r["variant"] for r in moe)))
        for key in dict.fromkeys((r["shape"], r["batch"]) for r in moe):
            row = [r for r in moe if (r["shape"], r["batch"]) == key]
            lines.append(f"  {key[0]:>17} {key[1]:>2} | " + " | ".join(
                f"{r['time_us']:6.1f} {r['copy_rate_frac']:.2f}" for r in row))
    mla = [r for r in records if r["part"] == "mla"]
    if mla:
        lines.append("(c) MLA 16 heads us / floor fraction: batch context | " + " | ".join(
            dict.fromkeys(r["variant"] for r in mla)))
        for key in dict.fromkeys((r["batch"], r["context"]) for r in mla):
            row = [r for r in mla if (r["batch"], r["context"]) == key]
            lines.append(f"  {key[0]:>2} {key[1]:>7} | " + " | ".join(
                f"{r['time_us']:7.1f} {r['floor_frac']:.2f}" for r in row))
    steps = [r for r in records if r["part"] == "step"]
    if steps:
        models = ", ".join(dict.fromkeys(r.get("model", "deepseek-v2-lite") for r in steps))
        lines.append(f"(d) {models} step: mode batch context | step ms, floor ms, x floor,"
                     " kernels/step, graph replay ms")
        for r in steps:
            moe = r.get("moe_config")
            label = r["mode"] + (" " + json.dumps(moe, separators=(",", ":")) if moe else "")
            replay = r.get("replay_ms")
            lines.append(f"  {label:>6} {r['batch']:>2} {r['context']:>7} | "
                         f"{r['step_ms']:7.3f} {r['floor_ms']:7.3f} {r['vs_floor']:5.2f}x "
                         f"{r['kernels_per_step']:7.0f} "
                         + (f"{replay:7.3f}" if replay is not None else "      -"))
    for r in (r for r in records if r["part"] == "greedy"):
        lines.append(f"(e) greedy {r['vocab']} batch {r['batch']} {r['path']}: "
                     f"{r['time_us']:.1f} us{'' if r['correct'] else ' WRONG'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the records")
    ap.add_argument("--parts", default="a,b,c,d", help="comma list of a, b, c, d, e")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--moe-variants", type=lambda s: s.split(","), default=None,
                    help="part (b): only these MOE_VARIANTS (comma list of names)")
    ap.add_argument("--greedy-batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 8], help="part (e) batches")
    ap.add_argument("--moe-batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 4, 8])
    ap.add_argument("--mla-batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 8], help="part (c) batches")
    ap.add_argument("--mla-contexts", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1024, 32768, 131072])
    ap.add_argument("--step-contexts", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1024, 32768, 131072])
    ap.add_argument("--step-modes", type=lambda s: s.split(","), default=["before", "after"],
                    help=f"comma list of {', '.join(STEP_MODES)}")
    ap.add_argument("--step-batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[8], help="part (d) batches beside 1, at the middle context")
    ap.add_argument("--step-moe-configs", type=json.loads, default=[{}],
                    help="part (d): a JSON list of moe_decode tunables dicts, each run with "
                         "every mode ({}: the defaults)")
    ap.add_argument("--step-steps", type=int, default=10)
    ap.add_argument("--step-trace", action="store_true",
                    help="phase stamps of the one-row MoE launches (gluon_moe.TRACE) in the "
                         "records (moe_trace)")
    ap.add_argument("--step-model", default="deepseek-v2-lite")
    ap.add_argument("--step-layers", type=int, default=0, help="first n layers (0: all)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    t0 = time.perf_counter()
    copy_bw = copy_bandwidth()
    flush = L2Flush()
    print(f"copy rate {copy_bw / 1e9:.0f} GB/s", flush=True)
    records = []
    for part, fn in (("a", lambda: bench_router(args, flush)),
                     ("b", lambda: bench_moe(args, flush, copy_bw)),
                     ("c", lambda: bench_mla(args, flush, copy_bw)),
                     ("d", lambda: bench_steps(args)),
                     ("e", lambda: bench_greedy(args, copy_bw))):
        if part in parts:
            t = time.perf_counter()
            records += fn()
            print(f"# part {part}: {time.perf_counter() - t:.0f} s", flush=True)
            meta = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
                    "torch": torch.__version__,
                    "copy_bw": copy_bw, "args": vars(args),
                    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                             capture_output=True, text=True).stdout.strip()}
            with open(args.out, "w") as f:               # after every part: a kill keeps data
                json.dump({"meta": meta, "records": records}, f, indent=1)
    print(f"# total {time.perf_counter() - t0:.0f} s")
    print(summary(records))


if __name__ == "__main__":
    main()
