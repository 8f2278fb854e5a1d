"""Compile the production Triton launches for Hopper (sm_90) on any machine, no GPU needed, and
report each kernel's registers, spills, shared memory and tensor-core instructions.

The Helix launchers run on "meta" tensors (shapes, strides and dtypes, no data) with their one
launch point (`run_kernel`) swapped for a recorder; each recorded launch is then compiled with
triton.compile for GPUTarget("cuda", 90, 32), specialised as the JIT would (ints equal to 1
become constants, ints divisible by 16 get the divisibility hint), and its cubin is read with
the cuobjdump that ships in Triton's wheel. It catches what the interpreter cannot: kernels that
do not compile, shared memory over the 227 KB a block may use, register spills, and wgmma
(HGMMA) missing where the MLA kernel relies on it. Must run with TRITON_INTERPRET unset.

    python profiling/kernel_resources.py [--json out.json] [--mla-candidates]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from helix.attention import (triton_append, triton_decode, triton_merge, triton_mla,  # noqa: E402
                             triton_mla_few, triton_prefill, triton_splits)
from helix.kv.manager import LocalKVMeta  # noqa: E402
from helix.layers import fp8, fused_mla, fused_moe, fused_qk_norm, skinny_gemm  # noqa: E402

SM90_SMEM_LIMIT = 232448            # bytes of shared memory one block may use on H100 / H200
_MODULES = (triton_splits, triton_decode, triton_mla, triton_mla_few, triton_append,
            triton_merge, triton_prefill, fused_qk_norm, fused_mla, fp8, fused_moe, skinny_gemm)
_PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
        torch.int32: "*i32", torch.int64: "*i64", torch.int16: "*i16", torch.int8: "*i8",
        torch.float8_e4m3fn: "*fp8e4nv"}


@contextlib.contextmanager
def recorded_launches():
    """Within: every Helix launch is recorded as (kernel, args, meta) instead of run."""
    launches = []

    def record(kernel, grid, *args, **meta):
        launches.append((kernel, args, meta))

    with contextlib.ExitStack() as stack:
        for mod in _MODULES:
            stack.enter_context(mock.patch.object(mod, "run_kernel", record))
        yield launches


def _signature(kernel, args, meta):
    """The JIT's specialisation of one launch: (signature, constexprs, attrs)."""
    sig, consts, attrs = {}, {}, {}
    options = {k: meta[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in meta}
    for i, name in enumerate(kernel.arg_names):
        if name in meta:
            v = meta[name]
        elif i < len(args):
            v = args[i]
        else:                                    # a defaulted constexpr (PDL): its default
            v = kernel.params[i].default
            sig[name], consts[name] = "constexpr", v
            continue
        if name in meta or kernel.params[i].is_constexpr:
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = _PTR[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]         # allocations are 16-byte aligned
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:
                sig[name], consts[name] = "constexpr", 1
                continue
            sig[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot specialise {name}={v!r}")
    return sig, consts, attrs, options


def compile_sm90(kernel, args, meta) -> dict:
    sig, consts, attrs, options = _signature(kernel, args, meta)
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    opts = triton.compiler.make_backend(target).parse_options(options)
    cc = triton.compile(src, target=target, options=opts.__dict__)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cc.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage",
                                f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    shapes: dict[str, int] = {}
    for shape in re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass):
        shapes[shape] = shapes.get(shape, 0) + 1
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    return dict(kernel=kernel.fn.__name__, num_warps=opts.num_warps, num_stages=opts.num_stages,
                constexprs={k: v for k, v in consts.items() if k.isupper()},
                registers=regs, stack_bytes=stack, shared_bytes=cc.metadata.shared,
                hgmma=sass.count("HGMMA"), hgmma_shapes=shapes, hmma=sass.count("HMMA"),
                local_loads=sass.count("LDL"), cp_async=sass.count("LDGSTS"),
                fp_fusion=opts.enable_fp_fusion, ffma=sass.count("FFMA"))


def production_launches(name: str):
    """The launches of one named production case, recorded on meta tensors."""
    m = dict(device="meta")
    bf = torch.bfloat16
    with recorded_launches() as launches:
        if name == "gqa-llama70b":             # 64 q / 8 kv heads, d 128, bf16, 4 splits: the
            q = torch.empty(4, 64, 128, dtype=bf, **m)           # splits merged in the launch
            kv = torch.empty(1024, 64, 8, 128, dtype=bf, **m)
            triton_decode.gqa_decode(q, kv, kv, torch.empty(4, 64, dtype=torch.int32, **m),
                                     torch.empty(4, dtype=torch.int32, **m), 0.088, num_splits=4)
        elif name == "gqa-mqa-d256-fp16":      # 32 q / 1 kv head, d 256
            q = torch.empty(2, 32, 256, dtype=torch.float16, **m)
            kv = torch.empty(256, 16, 1, 256, dtype=torch.float16, **m)
            triton_decode.gqa_decode(q, kv, kv, torch.empty(2, 9, dtype=torch.int32, **m),
                                     torch.empty(2, dtype=torch.int32, **m), 0.06, num_splits=4)
        elif name == "gqa-fp32":
            q = torch.empty(2, 32, 128, dtype=torch.float32, **m)
            kv = torch.empty(256, 16, 8, 128, dtype=torch.float32, **m)
            triton_decode.gqa_decode(q, kv, kv, torch.empty(2, 9, dtype=torch.int32, **m),
                                     torch.empty(2, dtype=torch.int32, **m), 0.06, num_splits=1)
        elif name in ("mla-deepseek-v3", "mla-deepseek-fp32"):   # 128 heads, Dl 512, Dr 64
            dt = bf if name == "mla-deepseek-v3" else torch.float32
            ql = torch.empty(4, 128, 512, dtype=dt, **m)
            qr = torch.empty(4, 128, 64, dtype=dt, **m)
            kv = torch.empty(1024, 64, 576, dtype=dt, **m)
            triton_mla.mla_decode(ql, qr, kv, torch.empty(4, 64, dtype=torch.int32, **m),
                                  torch.empty(4, dtype=torch.int32, **m), 0.072, num_splits=8)
        elif name.startswith("mla-candidate:"):      # profiling/tune_mla.py's configs
            from profiling.tune_mla import CANDIDATES
            ql = torch.empty(4, 128, 512, dtype=bf, **m)
            qr = torch.empty(4, 128, 64, dtype=bf, **m)
            kv = torch.empty(1024, 64, 576, dtype=bf, **m)
            triton_mla.mla_decode(ql, qr, kv, torch.empty(4, 64, dtype=torch.int32, **m),
                                  torch.empty(4, dtype=torch.int32, **m), 0.072, num_splits=8,
                                  config=dict(CANDIDATES)[name.split(":", 1)[1]])
        elif name == "append-and-exchange":
            for cache, rows in (((1024, 64, 8, 128), (4, 8, 128)), ((1024, 64, 576), (4, 576))):
                triton_append.append_kv(torch.empty(cache, dtype=bf, **m),
                                        torch.empty(rows, dtype=bf, **m),
                                        torch.empty(4, dtype=torch.int64, **m))
            for dt in (bf, torch.float32):
                o = torch.empty(8, 64, 128, dtype=dt, **m)
                send = triton_merge.pack_partials(o, torch.empty(8, 64, **m), 2)
                triton_merge.merge_received(send, 128)
        elif name == "fp8-kv":                 # bf16 queries over fp8 (e4m3) caches: the readers
            f8, i32, i64 = torch.float8_e4m3fn, torch.int32, torch.int64   # and the writers
            q = torch.empty(4, 64, 128, dtype=bf, **m)
            kv = torch.empty(1024, 64, 8, 128, dtype=f8, **m)
            triton_decode.gqa_decode(q, kv, kv, torch.empty(4, 64, dtype=i32, **m),
                                     torch.empty(4, dtype=i32, **m), 0.088, num_splits=4)
            for heads, decode in ((128, triton_mla.mla_decode),
                                  (16, triton_mla_few.mla_decode_few)):
                ql = torch.empty(4, heads, 512, dtype=bf, **m)
                qr = torch.empty(4, heads, 64, dtype=bf, **m)
                lat = torch.empty(1024, 64, 576, dtype=f8, **m)
                decode(ql, qr, lat, torch.empty(4, 64, dtype=i32, **m),
                       torch.empty(4, dtype=i32, **m), 0.072, num_splits=8)
            rows = torch.empty(4, 8, 128, dtype=bf, **m)
            triton_append.append_kv(kv, rows, torch.empty(4, dtype=i64, **m))
            triton_append.append_kv_pair(kv, kv, rows, rows, torch.empty(4, dtype=i64, **m))
            qkv = torch.empty(4, 48 * 128, dtype=bf, **m)              # Llama-3.1-8B: 32 q, 8 kv
            qh, kh, vh = (t.view(4, -1, 128) for t in qkv.split([4096, 1024, 1024], 1))
            rope = torch.empty(8192, 64, **m)
            fused_qk_norm.rope_append(qh, kh, vh, None, None, 1e-6, rope, rope,
                                      torch.empty(4, dtype=i64, **m), False, kv[:64], kv[:64],
                                      torch.empty(4, dtype=i64, **m))
            pre = LocalKVMeta(slots=torch.empty(512, dtype=i64, **m),        # 2 prompts' chunks
                              block_tables=torch.empty(2, 64, dtype=i32, **m),
                              kv_lens=torch.empty(2, dtype=i32, **m),
                              cu_q=torch.empty(3, dtype=i32, **m),
                              q_pos=torch.empty(512, dtype=i64, **m), kvp_rank=0, kvp=1,
                              interleave=1, page_size=64, num_decode=0, max_q=512)
            triton_prefill.gqa_prefill(torch.empty(512, 64, 128, dtype=bf, **m), kv, kv, pre,
                                       0.088)
            triton_prefill.mla_prefill(torch.empty(512, 16, 512, dtype=bf, **m),
                                       torch.empty(512, 16, 64, dtype=bf, **m), lat, 512, pre,
                                       0.072)
            fused_mla.mla_kv_row_triton(torch.empty(4, 576, dtype=bf, **m),
                                        torch.empty(512, dtype=bf, **m), 1e-6,
                                        torch.empty(8192, 32, **m), torch.empty(8192, 32, **m),
                                        torch.empty(4, dtype=i64, **m), True, cache=lat,
                                        slots=torch.empty(4, dtype=i64, **m))
        elif name == "prefill-short-chunk":      # 5 query rows over 128K keys (speculative
            i32, i64 = torch.int32, torch.int64   # guesses, a follow-up turn): KV splits
            pre = LocalKVMeta(slots=torch.empty(5, dtype=i64, **m),
                              block_tables=torch.empty(1, 2048, dtype=i32, **m),
                              kv_lens=torch.empty(1, dtype=i32, **m),
                              cu_q=torch.empty(2, dtype=i32, **m),
                              q_pos=torch.empty(5, dtype=i64, **m), kvp_rank=0, kvp=1,
                              interleave=1, page_size=64, num_decode=0, max_q=5)
            with mock.patch.object(triton_prefill, "sm_count_of", lambda device: 132):
                triton_prefill.gqa_prefill(torch.empty(5, 32, 128, dtype=bf, **m),
                                           torch.empty(2048, 64, 8, 128, dtype=bf, **m),
                                           torch.empty(2048, 64, 8, 128, dtype=bf, **m), pre,
                                           0.088)
        elif name == "fp8-weights":             # block-fp8 projections (DeepSeek-V3's x projection:
            f8 = torch.float8_e4m3fn               # q_a + kv_a, 2112 x 7168) and experts
            w = torch.empty(2112, 7168, dtype=f8, **m)
            s = torch.empty(fp8.blocks(2112), fp8.blocks(7168), **m)
            for rows in (1, 8, 512):               # decode tiles, prefill tiles
                fp8.linear_triton(torch.empty(rows, 7168, dtype=bf, **m), w, s)
            fp8.dequantize_triton(w, s, bf)        # prefill chunks: dequantize, then cuBLAS
            with mock.patch.object(triton_splits, "sm_count_of", lambda device: 132):
                for rows in (1, 2):                # the one-tile GEMV (K in 2 ranges of 3584)
                    skinny_gemm.gemv_scaled(torch.empty(rows, 7168, dtype=bf, **m), w, s)
                xw = torch.empty(3648, 2048, dtype=f8, **m)     # DeepSeek-V2-Lite's x projection
                xs = torch.empty(fp8.blocks(3648), fp8.blocks(2048), **m)   # with the add + norm
                a = torch.empty(1, 2048, dtype=bf, **m)
                skinny_gemm.add_norm_linear_triton(a, a, torch.empty(2048, dtype=bf, **m), 1e-6,
                                                   xw, scale=xs)
            e, inter, dim = 8, 256, 7168            # 8 local experts, a tpf = 8 shard
            gate = torch.empty(e, inter, dim, dtype=f8, **m)
            down = torch.empty(e, dim, inter, dtype=f8, **m)
            gs = torch.empty(e, fp8.blocks(inter), fp8.blocks(dim), **m)
            ds = torch.empty(e, fp8.blocks(dim), fp8.blocks(inter), **m)
            from helix.layers import moe_decode     # the sorted v1 kernels, then the decode
            with mock.patch.object(moe_decode, "run_kernel", fused_moe.run_kernel), \
                    mock.patch.object(moe_decode, "sm_count_of", lambda device: 132):
                for rows, variant in ((4, "v1"), (1, "decode"), (4, "decode")):   # kernels'
                    fused_moe.fused_moe(         # default launches (132 SMs: H100 / H200)
                        torch.empty(rows, dim, dtype=bf, **m), gate, gate, down,
                        torch.empty(rows, 8, **m),
                        torch.zeros(rows, 8, dtype=torch.int64, **m), 0, variant=variant,
                        scales=(gs, gs, ds))
        else:
            raise ValueError(name)
    return launches


CASES = ["gqa-llama70b", "gqa-mqa-d256-fp16", "gqa-fp32", "mla-deepseek-v3", "mla-deepseek-fp32",
         "append-and-exchange", "fp8-kv", "prefill-short-chunk", "fp8-weights"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--mla-candidates", action="store_true",
                   help="instead: the MLA kernel of every config of profiling/tune_mla.py")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter has no compiler to ask")
    cases = args.cases.split(",")
    if args.mla_candidates:
        from profiling.tune_mla import CANDIDATES
        cases = [f"mla-candidate:{name}" for name, _ in CANDIDATES]
    records = []
    for case in cases:
        for kernel, a, meta in production_launches(case):
            if case.startswith("mla-candidate:") and kernel is not triton_mla._mla_split_kernel:
                continue
            rec = dict(case=case, **compile_sm90(kernel, a, meta))
            records.append(rec)
            print(json.dumps(rec), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
