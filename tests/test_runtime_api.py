"""The Python API in one process: continuous batching (requests joining and leaving), stop ids and
eos, abort, KV capacity, sampling, and the errors a user's bad input must give."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from hf_fixtures import SMALL, VOCAB, hf_greedy

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.errors import CapacityError, CheckpointError, ConfigError, HelixError, RequestError

A, B, C = [5, 17, 42, 9, 88, 3, 61], list(range(10, 50)), [77]


def make_llm(path: str, **runtime) -> LLM:
    return LLM(path, Layout(), RuntimeConfig(**{**SMALL, **runtime}))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)


def run_to_end(llm: LLM) -> list:
    outs = []
    while llm.has_unfinished():
        outs.append(llm.step())
    return outs


def alone(path: str, prompt, params: SamplingParams, **runtime) -> list[int]:
    with make_llm(path, **runtime) as llm:
        return llm.generate([prompt], params)[0]


def first_new_index(tokens: list[int]) -> int:
    """An index k >= 2 whose token did not occur before it (a stop id that fires exactly there)."""
    return next(k for k in range(2, len(tokens)) if tokens[k] not in tokens[:k])


# -- continuous batching ---------------------------------------------------------------------------
def test_request_added_mid_run_matches_alone(hf_checkpoint):
    path, hf = hf_checkpoint("llama")
    with make_llm(path) as llm:
        a = llm.add_request(A, greedy(20))
        for _ in range(5):
            llm.step()
        b = llm.add_request(B, greedy(16))
        llm.step()
        llm.step()
        c = llm.add_request(C, greedy(16))
        run_to_end(llm)
        got = {r: llm.outputs[r] for r in (a, b, c)}
    assert got[a] == alone(path, A, greedy(20))
    assert got[b] == alone(path, B, greedy(16))
    assert got[c] == alone(path, C, greedy(16))
    assert got[b] == hf_greedy(hf, B, 16)[0]        # and "alone" is right, not just consistent


def test_requests_of_different_lengths_leave_the_batch(llama_ckpt):
    with make_llm(llama_ckpt) as llm:
        ids = [llm.add_request(p, greedy(n)) for p, n in ((A, 3), (B, 12), (C, 6))]
        steps = run_to_end(llm)
        got = [llm.outputs[i] for i in ids]
        assert [len(o) for o in got] == [3, 12, 6]
        assert all(llm.finish_reasons[i] == "length" for i in ids)
        assert [len(s.tokens) for s in steps] == [3] * 3 + [2] * 3 + [1] * 6
        # every finished request released its pages and its reservation
        assert llm.engine.kv_pages_free() == llm.engine.num_pages   # cached blocks idle
        assert not llm.engine.scheduler.pages and not llm.engine.scheduler.running
        assert not llm.engine.seeds and not llm.engine.kv.pages
        # KV positions written: prompt + generated - 1 (the last token is never fed back)
        assert llm.kv_tokens_per_rank() == [len(A) + 2 + len(B) + 11 + len(C) + 5]
    # greedy: a shorter run is a prefix of a longer one
    assert got[0] == alone(llama_ckpt, A, greedy(12))[:3]
    assert got[2] == alone(llama_ckpt, C, greedy(12))[:6]


def test_max_batch_queues_requests(llama_ckpt):
    with make_llm(llama_ckpt, max_batch=1) as llm:
        ids = [llm.add_request(p, greedy(5)) for p in (A, B, C)]
        steps = run_to_end(llm)
        assert all(len(s.tokens) <= 1 for s in steps) and len(steps) == 15
        got = [llm.outputs[i] for i in ids]
    assert got == [alone(llama_ckpt, p, greedy(5)) for p in (A, B, C)]


def test_tight_pool_preempts_and_recomputes_with_the_same_tokens(llama_ckpt):
    """A pool for about one request at a time: pages are taken as sequences grow, so both are
    admitted; when a decode row finds the pool full the newest request is preempted and later
    recomputed. Tokens equal each request run alone; every page comes back."""
    # A needs ceil((7 + 9) / 4) = 4 pages; B (40 + 8 = 48) needs 12; the pool has 12
    with make_llm(llama_ckpt, num_pages=12) as llm:
        a, b = llm.add_request(A, greedy(9)), llm.add_request(B, greedy(8))
        reqs = {}
        while llm.has_unfinished():
            llm.step()
            reqs.update({r.id: r for r in llm.engine.scheduler.running})
        got = llm.outputs[a], llm.outputs[b]
        assert reqs[b].preemptions >= 1                  # B gave its pages back at least once
        assert llm.stats()["preemptions"] == sum(r.preemptions for r in reqs.values())
        assert llm.engine.kv_pages_free() == llm.engine.num_pages   # cached blocks idle
    assert got == (alone(llama_ckpt, A, greedy(9)), alone(llama_ckpt, B, greedy(8)))


def test_longest_request_is_what_the_pool_holds(llama_ckpt):
    with make_llm(llama_ckpt, num_pages=6) as llm:
        sched = llm.engine.scheduler
        n = llm.longest_request
        assert sched.pages_for(n) <= 6 < sched.pages_for(n + 1) and n == 24
    with make_llm(llama_ckpt) as llm:                    # the pool holds a whole context
        assert llm.longest_request == llm.max_context


def test_request_that_never_fits_gives_capacity_error(llama_ckpt):
    with make_llm(llama_ckpt, num_pages=6) as llm:
        a = llm.add_request(A, greedy(10))             # 17 positions: 5 pages
        llm.step()
        with pytest.raises(CapacityError, match="KV pages"):
            llm.add_request(B, greedy(10))             # 50 positions: 13 pages > 6
        run_to_end(llm)
        assert llm.finish_reasons[a] == "length"
        assert llm.outputs[a] == alone(llama_ckpt, A, greedy(10))
        assert len(llm.outputs) == 1                   # the refused request left no trace
        c = llm.add_request(C, greedy(4))              # and the runtime keeps serving
        run_to_end(llm)
        assert llm.outputs[c] == alone(llama_ckpt, C, greedy(4))


def test_generate_and_last_logits(llama_ckpt):
    with make_llm(llama_ckpt) as llm:
        outs = llm.generate([A, B, C], [greedy(4), greedy(6), greedy(2)])
        assert [len(o) for o in outs] == [4, 6, 2]
        assert outs[1] == llm.generate([B], greedy(6))[0]
        with pytest.raises(RequestError, match="3 prompts but 2 sampling params"):
            llm.generate([A, B, C], [greedy(4), greedy(6)])
        assert not llm.has_unfinished()                # nothing was queued
    with make_llm(llama_ckpt) as llm:
        ids = [llm.add_request(p, greedy(3)) for p in (A, B, C)]
        out = llm.step()
        logits = llm.engine.last_logits
        assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32
        # rows in admission order; greedy picks each row's argmax
        assert [out.tokens[i] for i in ids] == logits.argmax(-1).tolist()
        assert out.num_tokens == len(A) + len(B) + len(C)
        out = llm.step()
        assert out.num_tokens == 3                     # decode: one token per request
        assert [out.tokens[i] for i in ids] == llm.engine.last_logits.argmax(-1).tolist()
        run_to_end(llm)
        got = [llm.outputs[i] for i in ids]
        assert (got[0], got[1], got[2][:2]) == (outs[0][:3], outs[1][:3], outs[2])


def test_context_cap_ends_with_length(llama_ckpt):
    prompt = list(range(1, 30))
    with make_llm(llama_ckpt, max_context=32) as llm:
        rid = llm.add_request(prompt, greedy(10))
        run_to_end(llm)
        assert len(llm.outputs[rid]) == 32 - len(prompt)
        assert llm.finish_reasons[rid] == "length"


# -- stop ids, eos, abort --------------------------------------------------------------------------
def test_stop_id_ends_request(llama_ckpt):
    full = alone(llama_ckpt, B, greedy(16))
    k = first_new_index(full)
    with make_llm(llama_ckpt) as llm:
        s = llm.add_request(B, greedy(16, stop_token_ids=(full[k],)))
        o = llm.add_request(A, greedy(16))
        run_to_end(llm)
        assert llm.outputs[s] == full[:k + 1]
        assert llm.finish_reasons[s] == "stop"
        assert llm.finish_reasons[o] == "length"
        assert llm.outputs[o] == alone(llama_ckpt, A, greedy(16))


def test_model_eos_ends_request_unless_ignored(llama_ckpt, tmp_path):
    full = alone(llama_ckpt, B, greedy(16))
    k = first_new_index(full)
    path = str(tmp_path / "eos")
    shutil.copytree(llama_ckpt, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    unused = next(t for t in range(VOCAB) if t not in full)
    cfg["eos_token_id"] = [unused, full[k]]             # a list, as Llama 3 checkpoints have
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with make_llm(path) as llm:
        e = llm.add_request(B, SamplingParams(max_new_tokens=16))
        i = llm.add_request(B, greedy(16))
        run_to_end(llm)
        assert (llm.outputs[e], llm.finish_reasons[e]) == (full[:k + 1], "stop")
        assert (llm.outputs[i], llm.finish_reasons[i]) == (full, "length")


def test_abort_running_request(llama_ckpt):
    with make_llm(llama_ckpt) as llm:
        a, b = llm.add_request(A, greedy(12)), llm.add_request(B, greedy(12))
        for _ in range(3):
            llm.step()
        llm.abort(a)
        out = llm.step()
        assert out.finished.get(a) == "abort" and a not in out.tokens
        assert llm.finish_reasons[a] == "abort" and len(llm.outputs[a]) == 3
        assert a not in llm.engine.kv.pages and a not in llm.engine.scheduler.pages
        run_to_end(llm)
        assert len(llm.outputs[a]) == 3
        assert llm.outputs[b] == alone(llama_ckpt, B, greedy(12))
        assert llm.engine.kv_pages_free() == llm.engine.num_pages   # cached blocks idle
        llm.abort(b)                                   # a finished request: no effect
        with pytest.raises(RequestError, match="no request"):
            llm.abort(12345)                           # one that never existed: an error
        run_to_end(llm)
        assert llm.finish_reasons[b] == "length"


def test_abort_waiting_request(llama_ckpt):
    with make_llm(llama_ckpt, max_batch=1) as llm:
        a, b = llm.add_request(A, greedy(4)), llm.add_request(B, greedy(4))
        llm.abort(b)                                   # before it was ever scheduled
        run_to_end(llm)
        assert llm.finish_reasons[b] == "abort" and llm.outputs[b] == []
        assert llm.outputs[a] == alone(llama_ckpt, A, greedy(4))
        assert not llm.has_unfinished()


# -- sampling --------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible(llama_ckpt):
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    with make_llm(llama_ckpt) as llm:
        x, y = llm.add_request(B, p), llm.add_request(B, p)
        llm.add_request(A, greedy(5))                   # a greedy neighbour in the batch
        run_to_end(llm)
        assert llm.outputs[x] == llm.outputs[y]
        batched = llm.outputs[x]
    assert alone(llama_ckpt, B, p) == batched          # independent of the batch around it


def test_top_k_1_and_tiny_top_p_equal_greedy(llama_ckpt):
    want = alone(llama_ckpt, B, greedy(12))
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        p = SamplingParams(max_new_tokens=12, temperature=2.0, seed=3, ignore_eos=True, **kw)
        assert alone(llama_ckpt, B, p) == want, kw


def test_temperature_sampling_differs_from_greedy(llama_ckpt):
    want = alone(llama_ckpt, B, greedy(12))
    with make_llm(llama_ckpt) as llm:
        outs = llm.generate([B] * 4, [SamplingParams(max_new_tokens=12, temperature=1.5, seed=s,
                                                     ignore_eos=True) for s in range(4)])
    assert any(o != want for o in outs)
    assert len({tuple(o) for o in outs}) > 1           # different seeds, different samples
    assert all(0 <= t < VOCAB for o in outs for t in o)


# -- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt,match", [
    ([1, VOCAB, 2], f"token id {VOCAB} is outside the vocabulary"),
    ([1, -1], "token id -1 is outside"),
    ([], "empty prompt"),
    (list(range(1, 65)), "does not fit the maximum context of 64"),
    ([1, 2] * 40, "does not fit the maximum context of 64"),
    (["a", 2], "must be integers"),
    ([3, 1.5], "must be integers"),                    # not silently truncated to 1
    (["7"], "must be integers"),
])
def test_bad_prompt(llama_ckpt, prompt, match):
    with make_llm(llama_ckpt, max_context=64) as llm:
        with pytest.raises(RequestError, match=match):
            llm.add_request(prompt, greedy(2))
        assert not llm.has_unfinished()
        assert len(llm.generate([A], greedy(2))[0]) == 2   # still serving


def _copy_with(src: str, dst: str, edit_config=None, edit_tensors=None) -> str:
    """Copy a checkpoint dir, optionally editing config.json and the tensor dict."""
    from safetensors.torch import load_file, save_file
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(llama_ckpt, tmp_path):
    def gpt2(cfg):
        cfg["architectures"] = ["GPT2LMHeadModel"]
    path = _copy_with(llama_ckpt, str(tmp_path / "gpt2"), gpt2)
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(path)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(hidden_act="gelu"), "unsupported activation"),
    (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "unsupported rope type 'dynamic'"),
    (lambda c: c.pop("num_attention_heads"), "lacks 'num_attention_heads'"),
])
def test_unsupported_config(llama_ckpt, tmp_path, edit, match):
    path = _copy_with(llama_ckpt, str(tmp_path / "cfg"), edit)
    with pytest.raises(CheckpointError, match=match):
        LLM(path)


def test_missing_tensor_is_named(llama_ckpt, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _copy_with(llama_ckpt, str(tmp_path / "missing"), edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"lacks tensor '{name}'"):
        LLM(path)


def test_misshaped_tensor_is_named(llama_ckpt, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"

    def cut(t):
        t[name] = t[name][:-1].clone()
    path = _copy_with(llama_ckpt, str(tmp_path / "shape"), edit_tensors=cut)
    with pytest.raises(CheckpointError,
                       match=rf"'{name}' has shape \(31, 64\), expected \(32, 64\)"):
        LLM(path)


def test_misshaped_expert_tensor_is_named(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("qwen3_moe")
    name = "model.layers.1.mlp.experts.5.down_proj.weight"

    def cut(t):
        t[name] = t[name][:, :-2].clone()
    path = _copy_with(src, str(tmp_path / "expert"), edit_tensors=cut)
    with pytest.raises(CheckpointError, match=f"'{name}' has shape"):
        LLM(path)


@pytest.mark.parametrize("how", ["garbage", "truncated", "no_weights", "bad_json"])
def test_unreadable_checkpoint(llama_ckpt, tmp_path, how):
    path = str(tmp_path / how)
    shutil.copytree(llama_ckpt, path)
    st = os.path.join(path, "model.safetensors")
    if how == "garbage":
        with open(st, "wb") as f:
            f.write(b"not a safetensors file")
    elif how == "truncated":
        data = open(st, "rb").read()
        with open(st, "wb") as f:
            f.write(data[:len(data) // 2])
    elif how == "no_weights":
        os.remove(st)
    else:
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{ not json")
    with pytest.raises(CheckpointError):
        LLM(path)


def test_missing_shard(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("llama", max_shard_size="40KB")
    path = str(tmp_path / "shards")
    shutil.copytree(src, path)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError, match="missing"):
        LLM(path)


def test_bad_runtime_settings(llama_ckpt):
    with pytest.raises(ConfigError, match="exceeds the model's 2048 positions"):
        LLM(llama_ckpt, Layout(), RuntimeConfig(max_context=4096))
    with pytest.raises(ConfigError, match="world size"):
        LLM(llama_ckpt, Layout(kvp=3))                 # 4 query heads; fails before spawning
    with pytest.raises(ConfigError, match="dtype"):
        RuntimeConfig(dtype="float64")
    with pytest.raises(ConfigError, match="attention backend"):
        RuntimeConfig(attention_backend="cudnn")


def test_errors_are_helix_errors():
    for cls in (CapacityError, CheckpointError, ConfigError, RequestError):
        assert issubclass(cls, HelixError)


# -- presets (random weights) ----------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_preset_runs_deterministically(preset):
    rt = RuntimeConfig(max_context=64, max_batch=2)
    outs = []
    for _ in range(2):
        with LLM(preset, Layout(), rt) as llm:
            outs.append(llm.generate([[5, 17, 42], [7] * 20], greedy(4)))
            vocab = llm.cfg.vocab_size
    assert outs[0] == outs[1]
    assert all(0 <= t < vocab for o in outs[0] for t in o)
    with pytest.raises(CheckpointError, match="not found"):
        LLM(preset + "-nope")
