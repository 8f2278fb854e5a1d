"""Host-side logic of the Gluon MLA kernel (helix/attention/gluon_mla.py), on CPU: launch plans
(grid, splits, head padding), shared-memory and register budgets, the shapes a launch accepts,
TMA descriptor views, the recorded launch (argument order against the kernel's signature), the
float32 oracle the GPU checks use, and an sm_90 compile of both variants (no GPU needed)."""

import os
import subprocess

import pytest
import torch

import sm90_compile
from helix.attention import gluon_mla
from helix.attention.triton_splits import fill_num_splits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("heads,blocks", [(128, 2), (64, 1), (16, 1), (1, 1), (65, 2)])
def test_plan_pads_heads_to_64_row_blocks(heads, blocks):
    p = gluon_mla.plan(4, heads, 65536, 132)
    assert p.head_blocks == blocks and p.grid == (blocks, p.num_splits, 4)


@pytest.mark.parametrize("batch,ctx", [(1, 65536), (8, 65536), (32, 524288), (132, 8192),
                                       (3, 4096), (1, 64)])
def test_plan_splits_follow_fill_policy(batch, ctx):
    p = gluon_mla.plan(batch, 128, ctx, 132)
    assert p.num_splits == fill_num_splits(batch, 2, ctx, 132, min_tokens=128,
                                           max_splits=gluon_mla.MAX_SPLITS)
    programs = batch * 2 * p.num_splits
    if ctx >= 128 * 64:         # enough tokens for the splits a wave wants: >= 90 % full
        assert programs / (-(-programs // 132) * 132) >= 0.9 or p.num_splits == 64
    # a seesaw split holds a pair of tiles (one per warpgroup) where the context allows
    assert p.num_splits & (p.num_splits - 1) == 0 and ctx // p.num_splits >= min(ctx, 128)
    assert gluon_mla.plan(1, 128, 4096, 132).num_splits == 32
    assert gluon_mla.plan(1, 128, 4096, 132, variant="simple").num_splits == 64


@pytest.mark.parametrize("ctx,splits", [(131072, 128), (32768, 128), (8192, 64), (1024, 8)])
def test_plan_one_head_block_fills_the_gpu_at_batch_1(ctx, splits):
    """16 heads (one head block) at batch 1: up to 128 splits, so 128 of 132 SMs hold a
    program (at most 64 had left half of them idle), each split a pair of tiles at least."""
    assert gluon_mla.plan(1, 16, ctx, 132).num_splits == splits


def _recorded_meta(monkeypatch, pdl_on: bool) -> dict:
    """The meta gluon_mla.launch hands run_kernel, and what run_kernel adds on a device
    where PDL is (or is not) enabled."""
    from helix import triton_util
    got = {}
    monkeypatch.setattr(triton_util, "pdl_enabled", lambda device: pdl_on)
    monkeypatch.setattr(triton_util, "_takes_pdl", lambda kernel: True)
    monkeypatch.setattr(triton_util, "PDL", True)

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: got.update(meta)
    gluon_mla.launch(Kernel(), (1, 1, 1), torch.zeros(1), num_warps=4)
    return got


@pytest.mark.parametrize("pdl,kv_early,pdl_on,want", [
    (True, True, True, "flags"), (True, False, True, "late"), (False, True, True, 0),
    (True, True, False, 0), (True, False, False, 0)])
def test_launch_takes_pdl_and_the_kv_late_bit(monkeypatch, pdl, kv_early, pdl_on, want):
    """gluon_mla.launch goes through run_kernel: PDL = triton_util.FLAGS where the device
    takes it, with PDL_KV_LATE (every KV tile after the wait) when KV_EARLY is off; 0 and no
    launch_pdl with the module flag PDL off or on a device without PDL."""
    from helix import triton_util
    monkeypatch.setattr(gluon_mla, "PDL", pdl)
    monkeypatch.setattr(gluon_mla, "KV_EARLY", kv_early)
    meta = _recorded_meta(monkeypatch, pdl_on)
    expect = {"flags": triton_util.FLAGS, "late": triton_util.FLAGS | gluon_mla.PDL_KV_LATE,
              0: 0}[want]
    assert meta["PDL"] == expect and bool(meta.get("launch_pdl")) == (expect != 0)
    assert meta["num_warps"] == 4


def test_plan_forced_splits_variant_and_boxes():
    assert gluon_mla.plan(2, 128, 4096, 132, num_splits=5).num_splits == 5
    assert gluon_mla.plan(2, 128, 4096, 132, page_size=16).box_rows == 16
    assert gluon_mla.plan(2, 128, 4096, 132, page_size=256).box_rows == 64
    meta = gluon_mla.plan(2, 128, 4096, 132, variant="simple").meta(64)
    assert meta["SEESAW"] is False and meta["num_warps"] == 8
    # empty splits write nothing only where a merge follows that skips them (seesaw, > 1 split)
    assert meta["SKIP_EMPTY"] is False
    assert gluon_mla.plan(2, 128, 4096, 132, num_splits=4).meta(64)["SKIP_EMPTY"] is True
    assert gluon_mla.plan(2, 128, 4096, 132, num_splits=1).meta(64)["SKIP_EMPTY"] is False
    with pytest.raises(ValueError, match="variant"):
        gluon_mla.plan(2, 128, 4096, 132, variant="fast")


@pytest.mark.parametrize("heads,block_h,blocks", [(16, 16, 1), (8, 16, 1), (17, 32, 1),
                                                   (32, 32, 1), (128, 32, 4)])
def test_few_plan_blocks_heads_without_padding_to_64(heads, block_h, blocks):
    """"few": the heads are the wgmma's N, so a head block is the fewest of 16 / 32 that hold
    them; a split keeps one tile (no warpgroup pair), so a 1K sequence takes 16 splits."""
    p = gluon_mla.plan(1, heads, 1024, 132, variant="few")
    assert (p.block_h, p.head_blocks, p.grid) == (block_h, blocks, (blocks, p.num_splits, 1))
    assert p.num_splits == fill_num_splits(1, blocks, 1024, 132, min_tokens=64,
                                           max_splits=gluon_mla.MAX_SPLITS)
    assert gluon_mla.plan(1, 16, 1024, 132, variant="few").num_splits == 16
    assert gluon_mla.plan(1, 16, 32768, 132, variant="few").num_splits == 128
    meta = p.meta(64)
    assert meta["BLOCK_H"] == block_h and meta["STAGES"] == gluon_mla.FEW_STAGES
    assert meta["MIN_CHUNK"] == gluon_mla.BLOCK_N and "SEESAW" not in meta
    assert meta["SKIP_EMPTY"] is True and meta["num_warps"] == 4
    assert gluon_mla.plan(1, 16, 1024, 132, variant="few", num_splits=1).meta(64)[
        "SKIP_EMPTY"] is False


@pytest.mark.parametrize("variant", gluon_mla.VARIANTS)
def test_shared_memory_fits_one_block(variant):
    # simple: Q [64, 576] + 2 tiles of [64, 576] bf16 = 216 KB; seesaw: Q's rope columns in
    # registers free the 8 KB of a second P tile: Q [64, 512] + 2 tiles + 2 P [64, 64]
    assert gluon_mla.smem_bytes(variant) <= gluon_mla.SM90_SMEM_LIMIT
    q_rope = 64 * 64 * 2
    assert gluon_mla.smem_bytes("seesaw") - gluon_mla.smem_bytes("simple") > 2 * 8192 - q_rope
    assert gluon_mla.smem_bytes("seesaw") + q_rope > gluon_mla.SM90_SMEM_LIMIT   # why in regs


@pytest.mark.parametrize("variant", gluon_mla.VARIANTS)
def test_register_budget_fits_the_register_file(variant):
    """warp_specialize pads the kernel to whole warpgroups and launches maxnreg registers for
    every thread; the consumers' setmaxnreg budgets must come out of that same 64K file."""
    r = gluon_mla.REGS[variant]
    warps = r["num_warps"] + (8 if variant == "seesaw" else 1)       # default + workers
    threads = -(-warps // 4) * 4 * 32
    if "maxnreg" not in r:      # few: 8 warps at most 255 registers, one block an SM
        assert variant == "few" and threads * 255 <= 2 * 65536 and r["PRODUCER_REGS"] >= 24
        return
    assert r["maxnreg"] * threads <= 65536 and r["maxnreg"] % 8 == 0
    if variant == "seesaw":     # producer (default, 4 warps) gets what the consumers leave
        left = (r["maxnreg"] * threads - 2 * r["WG_REGS"] * 128) // 128
        assert left >= 24 and r["WG_REGS"] == 240


@pytest.mark.parametrize("page,ok", [(64, True), (128, True), (256, True), (32, True),
                                     (16, True), (8, True), (4, False), (24, False), (96, False)])
def test_supported_page_sizes(page, ok):
    why = gluon_mla.unsupported_reason(128, 512, 64, page, torch.bfloat16, 1000 * page)
    assert (why is None) == ok, why


def test_unsupported_shapes_name_the_reason():
    assert "16-bit" in gluon_mla.unsupported_reason(128, 512, 64, 64, torch.float32, 64)
    assert "512/64" in gluon_mla.unsupported_reason(128, 256, 64, 64, torch.bfloat16, 64)
    assert "int32" in gluon_mla.unsupported_reason(128, 512, 64, 64, torch.bfloat16, 2**31)
    assert gluon_mla.unsupported_reason(16, 512, 64, 64, torch.float16, 64) is None


def test_descriptor_views_and_tma_readiness():
    kv = torch.zeros(6, 64, 576, dtype=torch.bfloat16)
    lat, rope = gluon_mla.descriptor_views(kv)
    assert lat.shape == (384, 512) and rope.shape == (384, 64)
    assert lat.stride() == (576, 1) and rope.stride() == (576, 1)
    assert rope.data_ptr() - kv.data_ptr() == 512 * 2
    assert gluon_mla.tma_ready(kv) is None
    strided = torch.zeros(6, 65, 576, dtype=torch.bfloat16)[:, :64]       # padded pages
    assert "contiguous" in gluon_mla.tma_ready(strided)
    with pytest.raises(ValueError, match="contiguous"):
        gluon_mla.mla_decode_gluon(torch.zeros(1, 16, 512, dtype=torch.bfloat16),
                                   torch.zeros(1, 16, 64, dtype=torch.bfloat16), strided,
                                   torch.zeros(1, 2, dtype=torch.int32),
                                   torch.zeros(1, dtype=torch.int32), 0.1)


@pytest.mark.parametrize("page", [64, 16])
def test_descriptors_box_one_tile_or_one_page(page):
    kv = torch.zeros(8, page, 576, dtype=torch.bfloat16)
    p = gluon_mla.plan(1, 128, 512, 132, page_size=page)
    d_lat, d_rope = gluon_mla.make_descriptors(kv, p)
    assert list(d_lat.block_shape) == [min(page, 64), 256]       # seesaw: half tiles
    simple = gluon_mla.plan(1, 128, 512, 132, page_size=page, variant="simple")
    assert list(gluon_mla.make_descriptors(kv, simple)[0].block_shape) == [min(page, 64), 512]
    few = gluon_mla.plan(1, 16, 512, 132, page_size=page, variant="few")   # whole tiles
    assert list(gluon_mla.make_descriptors(kv, few)[0].block_shape) == [min(page, 64), 512]
    assert list(d_rope.block_shape) == [min(page, 64), 64]
    assert list(d_lat.shape) == [8 * page, 512] and list(d_lat.strides) == [576, 1]
    assert d_lat.layout.swizzle_byte_width == 128 and d_rope.layout.swizzle_byte_width == 128


def _record(monkeypatch, B, H, splits, variant="seesaw", ctx=256, page=64):
    calls = {}

    def launch(kernel, grid, *args, **meta):
        calls["launch"] = (kernel, grid, args, meta)

    def reduce(o_ws, lse_ws, o, lse, kv_lens=None, block_n=0, min_chunk=0):
        calls["reduce"] = (o_ws.shape, lse_ws.shape, o.shape, lse.shape)
        calls["reduce_live"] = (kv_lens, block_n, min_chunk)

    monkeypatch.setattr(gluon_mla, "launch", launch)
    monkeypatch.setattr(gluon_mla, "reduce_splits", reduce)
    kv = torch.zeros(B * ctx // page, page, 576, dtype=torch.bfloat16)
    q = torch.zeros(B, H, 576, dtype=torch.bfloat16)
    bt = torch.arange(B * ctx // page, dtype=torch.int32).view(B, -1)
    o, lse = gluon_mla.mla_decode_gluon(q[..., :512], q[..., 512:], kv, bt,
                                        torch.full((B,), ctx, dtype=torch.int32), 0.1,
                                        num_splits=splits, variant=variant)
    return calls, o, lse


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("variant", ["seesaw", "few"])
def test_launch_arguments_match_the_kernel_signature(monkeypatch, splits, variant):
    from helix.attention.gluon_mla_few_kernel import mla_decode_few_kernel
    from helix.attention.gluon_mla_kernel import mla_decode_kernel
    calls, o, lse = _record(monkeypatch, 3, 128, splits, variant)
    kernel, grid, args, meta = calls["launch"]
    if variant == "few":       # 32-head blocks
        assert kernel is mla_decode_few_kernel and grid == (4, splits, 3)
    else:
        assert kernel is mla_decode_kernel and grid == (2, splits, 3)
    runtime = [n for i, n in enumerate(kernel.arg_names) if not kernel.params[i].is_constexpr]
    assert len(args) == len(runtime)
    named = dict(zip(runtime, args))
    assert named["HEADS"] == 128 and named["num_splits"] == splits
    assert abs(named["scale_log2"] - 0.1 * 1.4426950408889634) < 1e-12
    consts = {n for i, n in enumerate(kernel.arg_names) if kernel.params[i].is_constexpr}
    # PDL: below; CLUSTER: set by run_kernel's cluster launch only
    assert consts - {"num_warps", "PDL", "CLUSTER"} <= set(meta) and meta["PAGE_SIZE"] == 64
    assert o.shape == (3, 128, 512) and o.dtype == torch.bfloat16 and lse.shape == (3, 128)
    if splits == 1:        # O and LSE written directly: no split stride, no merge
        assert named["o_ptr"] is o and named["stride_os"] == 0 and "reduce" not in calls
    else:                  # fp32 partials [B, H, S, 512], merged by reduce_splits
        ows = named["o_ptr"]
        assert ows.shape == (3, 128, splits, 512) and ows.dtype == torch.float32
        assert named["stride_os"] == 512 and named["stride_oh"] == splits * 512
        assert calls["reduce"] == ((3, 128, splits, 512), (3, 128, splits), (3, 128, 512),
                                   (3, 128))
        kv_lens, block_n, min_chunk = calls["reduce_live"]   # empty splits write nothing
        assert kv_lens is named["lens_ptr"] and block_n == gluon_mla.BLOCK_N
        assert min_chunk == meta["MIN_CHUNK"] == gluon_mla.MIN_SPLIT_TOKENS[variant]


def test_empty_batch_launches_nothing(monkeypatch):
    monkeypatch.setattr(gluon_mla, "launch", lambda *a, **k: pytest.fail("launched"))
    o, lse = gluon_mla.mla_decode_gluon(torch.zeros(0, 16, 512, dtype=torch.bfloat16),
                                        torch.zeros(0, 16, 64, dtype=torch.bfloat16),
                                        torch.zeros(2, 64, 576, dtype=torch.bfloat16),
                                        torch.zeros(0, 2, dtype=torch.int32),
                                        torch.zeros(0, dtype=torch.int32), 0.1)
    assert o.shape == (0, 16, 512) and lse.shape == (0, 16)


def test_gluon_unavailable_off_sm90():
    assert gluon_mla.gluon_available("cpu") is False
    assert "CUDA" in gluon_mla.why_unavailable("cpu")


def test_reference_matches_torch_attention():
    """The oracle of the GPU checks (gluon_mla.reference) equals TorchAttention.attend_mla on
    ragged lengths, empty sequences and a shuffled block table."""
    from helix.attention.torch_ref import TorchAttention
    from helix.kv.manager import LocalKVMeta
    gen = torch.Generator().manual_seed(3)
    lens, page, H = [0, 5, 64, 130], 16, 4
    kv = torch.randn(40, page, 576, generator=gen)
    bt = torch.randperm(40, generator=gen)[:4 * 10].view(4, 10).int()
    q = torch.randn(4, H, 576, generator=gen)
    kl = torch.tensor(lens, dtype=torch.int32)
    o, lse = gluon_mla.reference(q[..., :512], q[..., 512:], kv, bt, kl, 0.05)
    meta = LocalKVMeta(slots=torch.full((4,), -1), block_tables=bt, kv_lens=kl,
                       cu_q=torch.arange(5, dtype=torch.int32),
                       q_pos=torch.tensor([max(n - 1, 0) for n in lens]), kvp_rank=0, kvp=1,
                       interleave=1, page_size=page, num_decode=len(lens))
    ro, rl = TorchAttention().attend_mla(q[..., :512], q[..., 512:], kv, 512, meta, 0.05)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(rl))
    torch.testing.assert_close(lse[1:], rl[1:], atol=1e-5, rtol=1e-5)


@pytest.mark.sm90
def test_few_variant_compiles_for_sm90(tmp_path):
    """"few" compiles for sm_90 at 16 and 32 heads: the swapped products are m64nHk16 wgmmas
    with H the head block (36 for S^T, 32 for O^T: no padding of the heads to 64 rows), TMA
    boxes of 64 x 64, no spills, shared memory under the block limit; under PDL it waits in
    the consumer (Q) and in the producer (the last tiles), and lets the next kernel launch
    once."""
    import json
    recs = _compile_report(tmp_path, "few", "16,32")
    assert [r["heads"] for r in recs] == [16, 32]
    for r in recs:
        assert r["ok"], r.get("error", "")[-3000:]
        assert r["hgmma_shapes"] == {f"64x{r['heads']}x16": 36 + 32}, r["hgmma_shapes"]
        assert r["shared_bytes"] <= gluon_mla.SM90_SMEM_LIMIT
        assert r["stack_bytes"] == 0 and r["local_loads"] == r["local_stores"] == 0
        assert [m["block_size"] for m in r["tensordesc_meta"]] == [[64, 64], [64, 64]]
        assert (r["gdc_waits"], r["gdc_launches"]) == (2, 1), json.dumps(r)[:300]


def _compile_report(tmp_path, variants: str, heads: str = "128") -> list[dict]:
    """gluon_resources.py's records of an sm_90 compile (PDL on) in a subprocess."""
    import json
    out = tmp_path / "res.json"
    sm90_compile.run(tmp_path, [os.path.join(ROOT, "profiling", "gluon_resources.py"),
                                "--variants", variants, "--heads", heads, "--pages", "64",
                                "--pdl", "1", "--json", str(out)], fp_fusion=True)
    return json.loads(out.read_text())


@pytest.mark.sm90
def test_both_variants_compile_for_sm90(tmp_path):
    """Both variants compile for sm_90 with this machine's triton (no GPU): shared memory under
    the block limit, the wgmma shapes of the design (seesaw: each warpgroup's QK^T of its own
    tiles as 36 m64n64k16, issued before the loop and in it, and 2 x 4 m64n256k16 PV; simple:
    36 m64n32k16 + 4 m64n256k16), register reallocation, compiled as launched on sm_90 (PDL
    on): seesaw waits for the previous kernel in the producer (the last tiles) and in both
    consumers (Q), which also let the next kernel launch; simple once, before Q."""
    recs = {r["variant"]: r for r in _compile_report(tmp_path, "seesaw,simple")}
    for r in recs.values():
        assert r["ok"], r.get("error", "")[-3000:]
        assert r["shared_bytes"] <= gluon_mla.SM90_SMEM_LIMIT, r
        assert any("setmaxnreg.inc" in s for s in r["setmaxnreg"]), r["setmaxnreg"]
        assert [m["block_size"] for m in r["tensordesc_meta"]] == [[64, 64], [64, 64]]
    assert recs["seesaw"]["hgmma_shapes"] == {"64x64x16": 4 * 36, "64x256x16": 4 * 4}
    assert recs["simple"]["hgmma_shapes"] == {"64x32x16": 36, "64x256x16": 4}
    assert recs["simple"]["stack_bytes"] == 0
    assert (recs["seesaw"]["gdc_waits"], recs["seesaw"]["gdc_launches"]) == (3, 2)
    assert (recs["simple"]["gdc_waits"], recs["simple"]["gdc_launches"]) == (1, 1)


def test_bench_cases_poison_only_stale_slots():
    """profiling/bench_mla_gluon.py's ragged cases: NaN only where no sequence reads, so the
    oracle stays finite; compare() flags NaN, wrong values and non-empty rows of empty
    sequences."""
    from profiling.bench_mla_gluon import SCALE, compare, ragged_case
    case = ragged_case(3, 16, [0, 5, 70], 128, 16, seed=0, device="cpu")
    ql, qr, kv, bt, lens = case
    assert torch.isnan(kv).any()
    o, lse = gluon_mla.reference(*case, SCALE)
    assert torch.isfinite(o).all() and torch.isinf(lse[0]).all() and torch.isfinite(lse[1:]).all()
    good = compare(o.bfloat16(), lse, o, lse)
    assert good["ok"], good
    bad = o.clone()
    bad[2, 3, 7] += 0.5
    assert not compare(bad, lse, o, lse)["ok"]
    nan = lse.clone()
    nan[1, 0] = float("nan")
    assert not compare(o, nan, o, lse)["ok"]
    leak = o.clone()
    leak[0, 0, 0] = 1.0                           # an empty sequence must give O = 0
    assert not compare(leak, lse, o, lse)["ok"]


def test_bench_summary_and_child_timeout(tmp_path, monkeypatch):
    import json
    from profiling import bench_mla_gluon as bench
    recs = [dict(kernel=k, batch=8, context=65536, ok=True, time_us=t, matmul_fraction=f)
            for k, t, f in (("triton", 500.0, 0.45), ("gluon-seesaw", 300.0, 0.75))]
    recs.append(dict(kernel="gluon-simple", batch=8, context=65536, ok=False, error="boom"))
    (tmp_path / "timings.json").write_text(json.dumps(recs))
    bench.summarize(str(tmp_path), {"seesaw": "done, all PASS"}, 12.0)
    text = (tmp_path / "summary.txt").read_text()
    assert "seesaw: done, all PASS" in text and "75.0%" in text and "45.0%" in text

    def hang(*a, **k):
        raise subprocess.TimeoutExpired(a[0], k["timeout"])
    monkeypatch.setattr(bench.subprocess, "run", hang)
    assert bench.sub("check", str(tmp_path), 5, variant="seesaw").startswith("TIMEOUT")


@pytest.mark.parametrize("heads,batch,threshold,gluon", [
    (16, 1, 2, False), (16, 2, 2, True), (16, 8, 2, True), (128, 1, 2, True),
    (16, 1, None, True), (128, 1, None, True)])
def test_backend_routes_few_heads_by_batch(monkeypatch, heads, batch, threshold, gluon):
    """On sm_90 the backend runs Gluon for a launch unless it has few heads (triton_mla_few.routes)
    and a batch under GLUON_FEW_HEADS_FROM_BATCH; the default (None) sends every batch to Gluon
    (measured as the step runs it, profiling/results/mla_small.md)."""
    from helix.attention import triton_backend
    if threshold is not None:
        monkeypatch.setattr(triton_backend, "GLUON_FEW_HEADS_FROM_BATCH", threshold)
    kv = torch.zeros(6, 64, 576, dtype=torch.bfloat16)
    fits = triton_backend.TritonAttention._gluon_fits(
        torch.zeros(batch, heads, 512, dtype=torch.bfloat16),
        torch.zeros(batch, heads, 64, dtype=torch.bfloat16), kv)
    assert fits is gluon


@pytest.mark.parametrize("heads,few_ok,flag,want", [
    (16, True, "few", "few"), (32, True, "few", "few"), (64, True, "few", "seesaw"),
    (16, False, "few", "seesaw"), (16, True, None, "seesaw")])
def test_backend_runs_the_few_variant_for_few_heads(monkeypatch, heads, few_ok, flag, want):
    """Launches of <= FEW_MAX_HEADS heads run "few" where prepare() found it working (its own
    self-check) and GLUON_FEW_VARIANT names it; the rest run GLUON_VARIANT."""
    from helix.attention import triton_backend
    monkeypatch.setattr(triton_backend, "GLUON_FEW_VARIANT", flag)
    be = triton_backend.TritonAttention()
    be.gluon_mla, be.gluon_few = True, few_ok
    assert be.gluon_variant(heads) == want
