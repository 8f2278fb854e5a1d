"""Compile the Gluon MLA kernel for Hopper (sm_90) on any machine (no GPU needed) and report its
registers, spills, shared memory, wgmma / TMA / setmaxnreg counts; or, on failure, the full
compiler error. The launch is recorded from gluon_mla.mla_decode_gluon on small CPU tensors
(shapes and strides are what specialise the kernel), then compiled with triton.compile for
GPUTarget("cuda", 90, 32) as the JIT would.

    python profiling/gluon_resources.py [--variants seesaw,simple,few] [--heads 128,16]
        [--pages 64,16] [--json f]

Needs the ptxas / cuobjdump that ship in Triton's wheel, and TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention import gluon_mla  # noqa: E402


class _Recorded(Exception):
    """Stops mla_decode_gluon right after the kernel launch was recorded."""


def record_launch(heads: int, page: int, variant: str, num_splits: int, batch: int = 2,
                  dtype=torch.bfloat16):
    """(kernel, args, meta) of one mla_decode_gluon launch on CPU tensors."""
    width = gluon_mla.D_LATENT + gluon_mla.D_ROPE
    pages = 8 * max(1, 64 // page)
    kv = torch.zeros(pages, page, width, dtype=dtype)
    q = torch.zeros(batch, heads, width, dtype=dtype)
    bt = torch.zeros(batch, pages // batch, dtype=torch.int32)
    lens = torch.zeros(batch, dtype=torch.int32)
    got = []

    def record(kernel, grid, *args, **meta):
        got.append((kernel, args, meta))
        raise _Recorded

    with mock.patch.object(gluon_mla, "launch", record):
        try:
            gluon_mla.mla_decode_gluon(q[..., :512], q[..., 512:], kv, bt, lens, 0.07,
                                       num_splits=num_splits, variant=variant)
        except _Recorded:
            pass
    return got[0]


def record_moe_launch(topk: int = 6, experts: int = 64, inter: int = 1408, dim: int = 2048,
                      shared: int = 2816, dtype=torch.bfloat16, route: dict | None = None,
                      fp8: bool = False):
    """(kernel, args, meta) of one gluon_moe.moe_row launch on CPU tensors (DeepSeek-V2-Lite's
    MoE layer by default; shared 0: no shared experts). route: the launch with its router
    (moe_row_routed) instead, of triton_router.RouteSpec fields {k, sigmoid, groups,
    topk_group, group_rule, norm, scaling} plus `experts` (all of them: the router's rows) and
    `router_dtype`. fp8: the weights in block fp8 with their scales (helix.layers.fp8)."""
    from helix import triton_util
    from helix.layers import gluon_moe
    got = []

    def record(kernel, grid, *args, **meta):
        got.append((kernel, args, meta))
        raise _Recorded

    from helix.layers import fp8 as f8
    wdt = f8.DTYPE if fp8 else dtype
    x = torch.zeros(1, dim, dtype=dtype)
    gate = torch.zeros(experts, inter, dim, dtype=wdt)
    down = torch.zeros(experts, dim, inter, dtype=wdt)
    sh = ((torch.zeros(shared, dim, dtype=wdt), torch.zeros(shared, dim, dtype=wdt),
           torch.zeros(dim, shared, dtype=wdt)) if shared else None)
    grid = lambda w: torch.ones(*w.shape[:-2], *(f8.blocks(d) for d in w.shape[-2:]))  # noqa: E731
    sc = {} if not fp8 else dict(
        scales=(grid(gate), grid(gate), grid(down)),
        shared_scales=tuple(grid(w) for w in sh) if sh else None)
    ids = torch.arange(topk, dtype=torch.int32).view(1, topk)
    w = torch.ones(1, topk)
    with mock.patch.object(triton_util, "run_kernel", record), \
            mock.patch.object(triton_util, "arrival_counters",
                              lambda d, n: torch.zeros(n, dtype=torch.int32)), \
            mock.patch.object(gluon_moe, "unsupported", lambda *a, **k: None):
        try:
            if route is None:
                gluon_moe.moe_row(x, gate, gate, down, w, ids, 0, sh, **sc)
            else:
                _record_routed(gluon_moe, x, gate, down, sh, dict(route), sc)
        except _Recorded:
            pass
    return got[0]


def _record_routed(gluon_moe, x, gate, down, sh, route, sc):
    from helix.layers.triton_router import RouteSpec
    n_all = route.pop("experts")
    rdt = route.pop("router_dtype", torch.float32)
    spec = RouteSpec(**route)
    rw = torch.zeros(n_all, x.shape[1], dtype=rdt)
    bias = torch.zeros(n_all) if spec.sigmoid else None
    with mock.patch.object(gluon_moe, "route_unsupported", lambda *a, **k: None):
        gluon_moe.moe_row_routed(x, x, x[0], 1e-6, rw, bias, spec, gate, gate, down, 0, sh,
                                 **sc)


def check_moe(pdl: int = 1, **shape) -> dict:
    """gluon_moe's launch compiled for sm_90: its resources, or its full error text."""
    return _checked(dict(variant="moe_row", pdl=pdl, **shape),
                    lambda: record_moe_launch(**shape), pdl)


def _checked(rec: dict, record, pdl: int) -> dict:
    """rec with the resources of the launch `record()` returns, compiled for sm_90 with the
    kernel's PDL value `pdl`, or with its full error text."""
    try:
        kernel, args, meta = record()
        meta["PDL"] = pdl
        rec.update(ok=True, **compile_sm90(kernel, args, meta))
    except Exception:  # noqa: BLE001 - the point is to report any failure in full
        rec.update(ok=False, error=traceback.format_exc())
    return rec


def compile_sm90(kernel, args, meta) -> dict:
    """triton.compile of one recorded Gluon launch for sm_90, with the JIT's specialisation."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig, consts, attrs = {}, {}, {}
    options = {k: meta[k] for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
    for i, name in enumerate(kernel.arg_names):
        if name in meta or kernel.params[i].is_constexpr:
            value = meta[name] if name in meta else kernel.params[i].default   # the default
            sig[name], consts[name] = "constexpr", value
            continue
        v = args[i]
        if isinstance(v, float):
            sig[name] = "fp32"
            continue
        ty, key = native_specialize_impl(BaseBackend, v, False, True, True)
        if ty == "constexpr":                   # an int equal to 1
            sig[name], consts[name] = "constexpr", v
            continue
        sig[name] = ty
        if key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options(options)
    cc = triton.compile(src, target=target, options=opts.__dict__)
    return resources(cc)


def resources(cc) -> dict:
    """Registers, spills, shared memory and instruction counts of a compiled kernel."""
    import triton
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cc.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage",
                                f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    ptx = cc.asm.get("ptx", "")
    shapes: dict[str, int] = {}
    for shape in re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass):
        shapes[shape] = shapes.get(shape, 0) + 1
    return dict(registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                stack_bytes=int(re.search(r"STACK:(\d+)", usage).group(1)),
                shared_bytes=cc.metadata.shared, hgmma=sass.count("HGMMA"), hgmma_shapes=shapes,
                local_loads=sass.count("LDL"), local_stores=sass.count("STL"),
                setmaxnreg=[" ".join(m.split()) for m in
                            re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+\d+", ptx)],
                tma_loads=ptx.count("cp.async.bulk.tensor"),
                gdc_waits=ptx.count("griddepcontrol.wait"),
                gdc_launches=ptx.count("griddepcontrol.launch_dependents"),
                tensordesc_meta=getattr(cc.metadata, "tensordesc_meta", None),
                num_warps=cc.metadata.num_warps)


def check(variant: str, page: int, heads: int = 128, num_splits: int = 2, pdl: int = 0) -> dict:
    """One compile (`pdl`: the kernel's PDL value, as run_kernel passes it on an sm_90 device):
    its resources, or its full error text."""
    return _checked(dict(variant=variant, page=page, heads=heads, num_splits=num_splits,
                         pdl=pdl), lambda: record_launch(heads, page, variant, num_splits), pdl)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default="seesaw,simple")
    p.add_argument("--pages", default="64")
    p.add_argument("--splits", default="2", help="1 writes bf16 O directly, >1 fp32 partials")
    p.add_argument("--pdl", default="0", help="comma list of PDL values (0 off, 1 on, 9 on "
                                                "with every KV tile after the wait)")
    p.add_argument("--heads", default="128", help="comma list of query heads per launch")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    recs = [check(v, int(pg), heads=int(h), num_splits=int(s), pdl=int(d))
            for v in args.variants.split(",") for h in args.heads.split(",")
            for pg in args.pages.split(",") for s in args.splits.split(",")
            for d in args.pdl.split(",")]
    for r in recs:
        if r["ok"]:
            print(f"{r['variant']:7} {r['heads']:3} heads page {r['page']:3} splits "
                  f"{r['num_splits']} pdl {r['pdl']}: "
                  f"{r['gdc_waits']} / {r['gdc_launches']} gdc wait / launch, "
                  f"{r['registers']} regs, stack {r['stack_bytes']}, smem {r['shared_bytes']}, "
                  f"{r['hgmma']} HGMMA {r['hgmma_shapes']}, {r['tma_loads']} TMA, "
                  f"setmaxnreg {r['setmaxnreg']}")
        else:
            print(f"{r['variant']:7} page {r['page']:3} splits {r['num_splits']}: FAILED\n"
                  f"{r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(recs, f, indent=1, default=str)


if __name__ == "__main__":
    main()
