"""Programmatic dependent launch (helix.triton_util): which launches get it, and (on a GPU of
compute capability >= 9) that whole captured decode steps with it give bitwise the logits
without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from triton_mode import ON_GPU  # first: chooses the interpreter before triton loads

import sm90_compile  # noqa: E402

from gpu_decode import captured_decode  # noqa: E402
from helix import triton_util  # noqa: E402
from helix.attention import triton_splits  # noqa: E402
from helix.layers import fused_ops  # noqa: E402

needs_sm90 = pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9,
                                reason="PDL needs a GPU of compute capability >= 9")


class _Kernel:
    """Stands in for a JIT kernel: records the launch options run_kernel passes."""

    def __init__(self, fn):
        self.fn, self.meta = fn, None

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.meta = meta
        return launch


def _with_pdl(x, PDL=False):
    pass


def _without_pdl(x, BLOCK=16):
    pass


def test_run_kernel_adds_pdl_only_to_kernels_that_take_it(monkeypatch):
    cpu = torch.zeros(1)
    k = _Kernel(_with_pdl)
    triton_util.run_kernel(k, (1,), cpu)
    assert k.meta == {"PDL": 0}                      # off CUDA: an ordinary launch
    monkeypatch.setattr(triton_util, "pdl_enabled", lambda device: True)
    triton_util.run_kernel(k, (1,), cpu, BLOCK=4)
    assert k.meta == {"BLOCK": 4, "PDL": triton_util.FLAGS, "launch_pdl": True}
    monkeypatch.setattr(triton_util, "FLAGS", triton_util.PDL_ON)
    triton_util.run_kernel(k, (1,), cpu)
    assert k.meta == {"PDL": triton_util.PDL_ON, "launch_pdl": True}   # the mode bits pass on
    triton_util.run_kernel(k, (1,), cpu, PDL=False)  # an explicit choice wins
    assert k.meta == {"PDL": False}
    plain = _Kernel(_without_pdl)
    triton_util.run_kernel(plain, (1,), cpu, BLOCK=4)
    assert plain.meta == {"BLOCK": 4}                # no wait in its code: never PDL


class _Compiled:
    packed_metadata = (4, 1, 1024)


class _ClusterKernel(_Kernel):
    """Records the grid and meta of launches and of warmup (the compile without a launch)."""

    def __init__(self, fn):
        super().__init__(fn)
        self.compiled, self.grid, self.warm = _Compiled(), None, None

    def __getitem__(self, grid):
        self.grid = grid
        return super().__getitem__(grid)

    def warmup(self, *args, grid, **meta):
        self.warm = (grid, dict(meta))
        return self.compiled


def test_run_kernel_cluster_launch_sets_the_binary_metadata():
    """cluster=2: the binary compiled for one CTA (its CLUSTER constexpr set) gets the cluster
    size in its packed launch metadata, and the grid's axis 0 is given in clusters."""
    cpu = torch.zeros(1)
    k = _ClusterKernel(_with_pdl)
    triton_util.run_kernel(k, (4, 3, 2), cpu, cluster=2, BLOCK=8)
    assert k.grid == (2, 3, 2) and k.meta == {"PDL": 0, "CLUSTER": 2, "BLOCK": 8}
    assert k.warm == ((2, 3, 2), k.meta)                 # the same binary as the launch's
    assert k.compiled.packed_metadata == (4, 2, 1024)
    with pytest.raises(AssertionError):
        triton_util.run_kernel(k, (3, 1, 1), cpu, cluster=2)   # axis 0 not whole clusters
    plain = _ClusterKernel(_with_pdl)
    triton_util.run_kernel(plain, (4, 1, 1), cpu)
    assert plain.grid == (4, 1, 1) and plain.warm is None and "CLUSTER" not in plain.meta


def test_pdl_enabled_needs_cuda_and_the_switch(monkeypatch):
    assert not triton_util.pdl_enabled(torch.device("cpu"))
    assert not triton_util.pdl_enabled(None)
    monkeypatch.setattr(triton_util, "PDL", False)
    assert not triton_util.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setattr(triton_util, "PDL", True)
    monkeypatch.setattr(triton_util, "_INTERPRETED", True)
    assert not triton_util.pdl_enabled(torch.device("cuda", 0))   # the interpreter: never


def test_pdl_modes_from_the_environment():
    # one interpreter: the module re-read (importlib.reload) under each value of HELIX_PDL
    code = textwrap.dedent("""
        import importlib, json, os
        from helix import triton_util as t
        got = {}
        for v in ("0", "1", "wait", "auto", "early", "full", None):
            if v is None:
                os.environ.pop("HELIX_PDL")
            else:
                os.environ["HELIX_PDL"] = v
            importlib.reload(t)
            got[str(v)] = [str(t.FLAGS), str(t.PDL), str(t.EARLY_ONE_ROW)]
        print(json.dumps(got))
    """)

    def env(v):
        return dict(os.environ, HELIX_PDL=v)
    run = subprocess.run([sys.executable, "-c", code], env=env("1"), capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    code = "from helix import triton_util as t; print(t.FLAGS, t.PDL)"
    on, early, pre = triton_util.PDL_ON, triton_util.PDL_EARLY, triton_util.PDL_PREFETCH
    assert got == {"0": ["0", "False", "False"], "1": [str(on), "True", "False"],
                   "wait": [str(on), "True", "False"], "auto": [str(on), "True", "True"],
                   "early": [str(on | early), "True", "False"],
                   "full": [str(on | early | pre), "True", "False"],
                   "None": [str(on), "True", "True"]}            # unset: "auto"
    bad = subprocess.run([sys.executable, "-c", code], env=env("fast"), capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "HELIX_PDL='fast': use one of" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_decode_step_kernels_take_pdl():
    """The kernels of a decode step opt in (a wait before their first access)."""
    from helix.attention import triton_append, triton_mla_few
    from helix.layers import fused_mla, moe_decode, skinny_gemm, triton_router
    for k in (fused_ops._rms_norm_kernel, fused_mla._kv_row_kernel, skinny_gemm._skinny_kernel,
              skinny_gemm._gemv_kernel,
              triton_append._append_kernel, triton_mla_few._mla_few_kernel,
              triton_splits._reduce_splits_kernel, triton_router._route_fused_kernel,
              moe_decode._gate_up_kernel, moe_decode._down_kernel,
              fused_mla._absorb_kv_row_kernel):
        assert triton_util._takes_pdl(k), k


def _decode(model, flags):
    triton_util.PDL, triton_util.FLAGS = flags != 0, flags
    return captured_decode(model)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_captured_steps_with_pdl_equal_steps_without(model, monkeypatch):
    """Every PDL mode (wait first; launch the next kernel first; and prefetching weights
    before the wait) gives bitwise the tokens and logits of plain launches."""
    monkeypatch.setattr(triton_util, "PDL", True)
    monkeypatch.setattr(triton_util, "FLAGS", triton_util.FLAGS)
    assert triton_util.pdl_enabled(torch.device("cuda"))     # the launches below do use PDL
    off_tokens, off_logits = _decode(model, 0)
    full = triton_util.PDL_ON | triton_util.PDL_EARLY | triton_util.PDL_PREFETCH
    for flags in (triton_util.PDL_ON, full):
        on_tokens, on_logits = _decode(model, flags)
        assert on_tokens == off_tokens, flags
        assert len(on_logits) == len(off_logits)
        for a, b in zip(on_logits, off_logits):
            assert torch.equal(a, b), flags


@pytest.mark.gpu
@needs_sm90
def test_pdl_chain_of_norms_equals_plain_launches(monkeypatch):
    """A captured chain of 200 dependent norm launches: bitwise the result without PDL."""
    assert triton_util.pdl_enabled(torch.device("cuda"))
    x0 = torch.randn(3, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16) + 0.5
    outs = []
    for pdl in (False, True):
        monkeypatch.setattr(triton_util, "PDL", pdl)
        y = x0
        for _ in range(2):                                 # compile outside the capture
            fused_ops.rms_norm(y, w, 1e-6)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x0
            for _ in range(200):
                y = fused_ops.rms_norm(y * 1.5, w, 1e-6)
        graph.replay()
        torch.cuda.synchronize()
        outs.append(y.clone())
    assert torch.equal(outs[0], outs[1])


_PTX_SCRIPT = textwrap.dedent("""
    import json, re, sys
    from unittest import mock
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from helix.layers import moe_decode as md, skinny_gemm as sg
    from profiling.kernel_resources import _signature
    m = dict(device="meta")
    e = lambda *s, dt=torch.bfloat16: torch.empty(*s, dtype=dt, **m)
    launches = []
    rec = lambda k, g, *a, **kw: launches.append((k, a, kw))
    cnt = lambda device, n: torch.empty(4096, dtype=torch.int32, **m)
    with mock.patch.object(sg, "run_kernel", rec), mock.patch.object(md, "run_kernel", rec), \\
            mock.patch.object(sg, "arrival_counters", cnt), \\
            mock.patch.object(md, "arrival_counters", cnt), \\
            mock.patch.object(md, "sm_count_of", lambda d: 132), \\
            mock.patch("helix.attention.triton_splits.sm_count_of", lambda d: 132):
        sg.linear_triton(e(1, 2048), e(3072, 2048), None, {})     # rows along N (not the GEMV)
        sg.absorb_q_triton(e(1, 16, 128), e(16, 128, 512))          # rows along K
        D, I = 2048, 1408
        md.moe_decode(e(1, D), e(64, I, D), e(64, I, D), e(64, D, I), e(1, 6),
                      e(1, 6, dt=torch.int64), 0, shared=(e(2816, D), e(2816, D), e(D, 2816)))
    target = GPUTarget("cuda", 90, 32)
    out = []
    for k, a, kw in launches:
        for flags in (1, 7):
            sig, consts, attrs, options = _signature(k, a, dict(kw, PDL=flags))
            src = triton.compiler.ASTSource(fn=k, signature=sig, constexprs=consts, attrs=attrs)
            opts = triton.compiler.make_backend(target).parse_options(options)
            ptx = triton.compile(src, target=target, options=opts.__dict__).asm["ptx"]
            order = re.findall(r"cp\\.async\\.bulk\\.prefetch|griddepcontrol\\.\\w+", ptx)
            out.append(dict(kernel=k.fn.__name__, flags=flags, order=order))
    json.dump(out, open(sys.argv[1], "w"))
""")


@pytest.mark.sm90
def test_pdl_modes_compile_to_their_instruction_order(tmp_path):
    """PDL_ON: wait, then launch the next kernel; with PDL_EARLY and PDL_PREFETCH the weight
    prefetches come first, then the next kernel's launch, then the wait (sm_90 PTX)."""
    out = tmp_path / "order.json"
    sm90_compile.run(tmp_path, ["-c", _PTX_SCRIPT, str(out)])
    records = json.loads(out.read_text())
    assert [r["kernel"] for r in records] == (["_skinny_kernel"] * 4 + ["_gate_up_kernel"] * 2
                                              + ["_down_kernel"] * 2)
    wait, launch, pre = ("griddepcontrol.wait", "griddepcontrol.launch_dependents",
                         "cp.async.bulk.prefetch")
    for r in records:
        if r["flags"] == 1:
            assert r["order"] == [wait, launch], r
        else:
            n = r["order"].count(pre)
            assert n >= 1 and r["order"] == [pre] * n + [launch, wait], r


def test_decode_flags_add_early_launches_at_one_row_of_mla(monkeypatch):
    """HELIX_PDL=auto: PDL_EARLY in one-row decode steps of MLA models only; the other modes
    (EARLY_ONE_ROW off) or PDL off keep FLAGS at every batch."""
    on, early = triton_util.PDL_ON, triton_util.PDL_EARLY
    monkeypatch.setattr(triton_util, "FLAGS", on)
    monkeypatch.setattr(triton_util, "EARLY_ONE_ROW", True)
    assert [triton_util.decode_flags(r, True) for r in (1, 2, 8)] == [on | early, on, on]
    assert triton_util.decode_flags(1, False) == on
    monkeypatch.setattr(triton_util, "EARLY_ONE_ROW", False)
    assert triton_util.decode_flags(1, True) == on
    monkeypatch.setattr(triton_util, "EARLY_ONE_ROW", True)
    monkeypatch.setattr(triton_util, "FLAGS", 0)
    assert triton_util.decode_flags(1, True) == 0
    with triton_util.launch_flags(on | early):
        assert triton_util.FLAGS == on | early
    assert triton_util.FLAGS == 0


@pytest.mark.parametrize("model,mla", [("tiny-deepseek-v3", True), ("tiny-llama", False)])
def test_decode_steps_launch_with_their_bucket_flags(model, mla, monkeypatch):
    """A decode step runs its model under decode_flags(bucket, mla): the early bit in the
    one-row steps of an MLA model, not in its two-row ones nor in a GQA model's, FLAGS again
    outside (CPU engine: the flags are what run_kernel would read)."""
    from helix import LLM, Layout, RuntimeConfig, SamplingParams
    from helix.models.base import CausalLM
    monkeypatch.setattr(triton_util, "FLAGS", triton_util.PDL_ON)
    monkeypatch.setattr(triton_util, "EARLY_ONE_ROW", True)
    seen = []
    real = CausalLM.forward

    def forward(self, ids, *a, **kw):
        seen.append((ids.shape[0], triton_util.FLAGS))
        return real(self, ids, *a, **kw)
    monkeypatch.setattr(CausalLM, "forward", forward)
    rt = RuntimeConfig(device="cpu", dtype="float32", seed=0, max_batch=2, max_context=64,
                       page_size=16)
    with LLM(model, Layout(), rt) as llm:
        seen.clear()
        llm.add_request([5, 17, 42], SamplingParams(max_new_tokens=3, ignore_eos=True))
        while llm.has_unfinished():
            llm.step()
        one = list(seen)
        seen.clear()
        for p in ([5, 17], [9, 4, 2]):
            llm.add_request(p, SamplingParams(max_new_tokens=3, ignore_eos=True))
        while llm.has_unfinished():
            llm.step()
    on, early = triton_util.PDL_ON, triton_util.PDL_EARLY
    assert (1, on | early if mla else on) in one and all(f == on for r, f in one if r != 1)
    assert (2, on) in seen
    assert triton_util.FLAGS == on


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_one_row_steps_with_pdl_early_equal_steps_without(model, monkeypatch):
    """One request alone (every decode step one row: the one-row MoE launch with its router,
    the one-tile GEMVs), captured and eager, with PDL_EARLY at every step and with the auto
    rule: bitwise the tokens and logits of plain launches. (PDL_EARLY let the next MoE
    launch's router partition read the route counter before the previous launch had reset it:
    gluon_route.choose now waits first under PDL_EARLY.)"""
    from gpu_decode import captured_decode
    monkeypatch.setattr(triton_util, "PDL", True)
    monkeypatch.setattr(triton_util, "FLAGS", triton_util.FLAGS)
    monkeypatch.setattr(triton_util, "EARLY_ONE_ROW", False)
    prompts = ([5, 17, 42, 3, 9, 11, 2],)
    triton_util.FLAGS = 0
    want_tokens, want_logits = captured_decode(model, 8, prompts)
    early = triton_util.PDL_ON | triton_util.PDL_EARLY
    for flags, auto in ((early, False), (triton_util.PDL_ON, True)):
        triton_util.FLAGS = flags
        monkeypatch.setattr(triton_util, "EARLY_ONE_ROW", auto)
        for graph_eager in (False, True):
            tokens, logits = captured_decode(model, 8, prompts, graph_eager)
            assert tokens == want_tokens, (flags, auto, graph_eager)
            for a, b in zip(logits, want_logits):
                assert torch.equal(a, b), (flags, auto, graph_eager)
