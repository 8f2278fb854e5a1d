"""The next layer's input projection inside the one-row MoE launch, without a GPU: which
layers hand their input step to the layer before (DecoderLayer.input_step, CausalLM.hidden),
when MoE takes it (MoE._next_projection), and that a Projected flows through the next layer
to the same logits. The launch itself is emulated in torch with the functions the unfused
path calls, so the whole decode must be bitwise the same; the launch's own arithmetic is
tests/test_gluon_moe.py's (CPU replay, sm_90 compile) and tests/test_gluon_moe_gpu.py's."""

from __future__ import annotations

import torch

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.layers import gluon_moe
from helix.layers.attention_input import Projected
from helix.layers.moe import MoE
from helix.layers.skinny_gemm import add_norm_linear


def _emulated_routed_row(calls):
    """MoE._routed_row on CPU: the router's add + norm, the experts, and where the real
    _next_projection takes the next layer's projection, add_norm_linear of the output."""
    def routed_row(self, a, residual, norm, then=None):
        if a.shape[0] != 1:
            return None
        proj = self._next_projection(a, then)
        calls.append(proj is not None)

        def run():
            x, res, w, ids = self.gate.add_norm_forward(a, residual, norm)
            out = self._experts(x, w, ids, None)
            if proj is None:
                return out, res
            return add_norm_linear(out, res, *proj)
        return run, proj is not None
    return routed_row


def _decode(model, monkeypatch=None, calls=None):
    if monkeypatch is not None:
        monkeypatch.setattr(MoE, "_routed_row", _emulated_routed_row(calls))
    rt = RuntimeConfig(device="cpu", dtype="float32", seed=0, max_batch=1, max_context=128,
                       page_size=16)
    with LLM(model, Layout(), rt) as llm:
        llm.add_request([5, 17, 42, 3], SamplingParams(max_new_tokens=4, ignore_eos=True))
        logits = []
        while llm.has_unfinished():
            llm.step()
            logits.append(llm.engine.last_logits.clone())
        return logits


def test_projected_decode_is_the_unfused_decode(monkeypatch):
    """tiny-deepseek-v3 (layer 0 dense, 1-3 MoE): at one row layers 1 and 2 hand their output
    as the next layer's projection, layer 3 (the last) does not; the prompt step (4 rows)
    never runs the launch. Every step's logits are bitwise those of the unfused path."""
    plain = _decode("tiny-deepseek-v3")
    calls = []
    fused = _decode("tiny-deepseek-v3", monkeypatch, calls)
    runs = len(calls) // 3              # the decode steps, and the engine's warm-up at one row
    assert runs >= len(fused) - 1 and calls == [True, True, False] * runs, calls
    assert len(plain) == len(fused)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


class _Comm:
    def __init__(self, world):
        self.world = world

    def size(self, axis):
        return self.world


class _Norm:
    def __init__(self, dim, dtype=torch.float32):
        self.weight, self.eps = torch.ones(dim, dtype=dtype), 1e-6


class _Lin:
    def __init__(self, rows, dim, bias=False, dtype=torch.float32):
        self.weight = torch.zeros(rows, dim, dtype=dtype)
        self.bias = torch.zeros(rows, dtype=dtype) if bias else None


def test_next_projection_rules(monkeypatch):
    """MoE takes the next layer's projection only with a next layer, the module flag on, one
    rank (its output would need the all-reduce first), no bias, and what the launch accepts."""
    moe = MoE.__new__(MoE)
    bf = torch.bfloat16
    a = torch.zeros(1, 256, dtype=bf)
    then = (_Norm(256, bf), _Lin(72, 256, dtype=bf))
    object.__setattr__(moe, "comm", _Comm(1))
    got = moe._next_projection(a, then)
    assert got is not None and got[2] is then[1].weight and got[0] is then[0].weight
    assert moe._next_projection(a, None) is None
    assert moe._next_projection(a, (then[0], _Lin(72, 256, bias=True, dtype=bf))) is None
    assert moe._next_projection(a, (then[0], _Lin(72, 256))) is None          # fp32 weight
    monkeypatch.setattr(gluon_moe, "PROJ", False)
    assert moe._next_projection(a, then) is None
    monkeypatch.setattr(gluon_moe, "PROJ", True)
    object.__setattr__(moe, "comm", _Comm(2))
    assert moe._next_projection(a, then) is None


def test_hidden_hands_each_layer_the_next_input_step(monkeypatch):
    """CausalLM.hidden passes layer i + 1's (input norm, input projection) to layer i, none to
    the last layer, and none at all under a pass-KV plan (meta.cp)."""
    from types import SimpleNamespace

    from helix.models.base import CausalLM, DecoderLayer
    seen = []

    def forward(self, h, pos, meta, cache, backend, ctx=None, residual=None, then=None):
        seen.append(then)
        return h, residual
    rt = RuntimeConfig(device="cpu", dtype="float32", seed=0, max_batch=1, max_context=64,
                       page_size=16)
    with LLM("tiny-deepseek-v3", Layout(), rt) as llm:
        monkeypatch.setattr(DecoderLayer, "forward", forward)
        model = llm.engine.model
        layers = model.model.layers
        ids = torch.tensor([3])
        for cp, want in ((None, [(layers[i].input_layernorm, layers[i].self_attn.in_proj)
                                 for i in range(1, len(layers))] + [None]),
                         (object(), [None] * len(layers))):
            seen.clear()
            CausalLM.hidden(model, ids, ids, SimpleNamespace(cp=cp), [None] * len(layers),
                            None)
            assert seen == want


def test_attention_takes_a_projected_input():
    """NormedInput.add_norm_forward with a Projected goes straight to attend_projected with
    its rows and hands the residual through."""
    from helix.layers.attention_input import NormedInput
    got = {}

    class Attn(NormedInput):
        def attend_projected(self, y, pos, T, meta, cache, backend, ctx=None):
            got.update(y=y, T=T)
            return "out"

    y, res = torch.ones(1, 10), torch.zeros(1, 4)
    out, r = Attn().add_norm_forward(Projected(y), res, None, None, None, None, None)
    assert out == "out" and r is res and got["y"] is y and got["T"] == 1
