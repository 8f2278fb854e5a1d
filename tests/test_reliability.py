"""Every mistake a clear error, every failure confined to its request, no hang (issue 11): request
and config.json validation, failures injected inside steps, dead / stopped / killed workers,
signals, the LLM's lifecycle, and the KV pool sized to the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from proc_helpers import alive, descendants

from helix import LLM, Layout, RuntimeConfig, SamplingParams
from helix.errors import CapacityError, CheckpointError, ConfigError, EngineDeadError, HelixError
from helix.errors import RequestError
from helix.hf_config import model_config_from_hf
from helix.loader import read_model_config

RT = RuntimeConfig(page_size=4, max_context=128, max_batch=8)
A, B, C = [5, 17, 42], list(range(3, 63)), [9, 8, 7, 6]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def run_to_end(llm) -> None:
    while llm.has_unfinished():
        llm.step()


def alone(prompt, n, runtime=RT) -> list[int]:
    with LLM("tiny-llama", Layout(), runtime) as llm:
        return llm.generate([prompt], greedy(n))[0]


# -- request fields ----------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(top_k=2**63), "top_k must be in"),
    (dict(seed=2**64), "seed must be in"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids, got 5"),
    (dict(max_new_tokens=float("nan")), "max_new_tokens must be an integer"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
    (dict(top_k=2.5), "top_k must be an integer"),
])
def test_bad_sampling_fields_are_refused_when_made(kw, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kw)


def test_bad_requests_are_refused_and_leave_the_engine_serving():
    with LLM("tiny-llama", Layout(), RT) as llm:
        vocab = llm.cfg.vocab_size
        a = llm.add_request(A, greedy(6))
        llm.step()
        for prompt, params, match in (
                (A, SamplingParams(forced_tokens=(1, vocab)), "forced_tokens holds"),
                (A, SamplingParams(stop_token_ids=(vocab + 5,)), "stop_token_ids holds"),
                (A, {"max_new_tokens": 3}, "params must be a helix.SamplingParams"),
                ([1.5, 2], None, "prompt ids must be integers, got 1.5"),
                (["7"], None, "prompt ids must be integers"),
                ([True], None, "prompt ids must be integers"),
                (5, None, "prompt ids must be a list of integers"),
                ([], None, "empty prompt")):
            with pytest.raises(RequestError, match=match):
                llm.add_request(prompt, params)
        run_to_end(llm)
        assert llm.outputs[a] == alone(A, 6) and list(llm.outputs) == [a]


# -- config.json -------------------------------------------------------------------------------

def _hf(**changes):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "eos_token_id": 2}
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("cfg,match", [
    (_hf(num_attention_heads="four"),
     "num_attention_heads = 'four' is invalid: it must be an integer"),
    (_hf(num_attention_heads=4.7), "num_attention_heads = 4.7 is invalid"),
    (_hf(hidden_size="64"), "hidden_size = '64' is invalid"),
    (_hf(eos_token_id="x"), "eos_token_id = 'x' is invalid: it must be a token id"),
    (_hf(rms_norm_eps="tiny"), "rms_norm_eps = 'tiny' is invalid: it must be a finite positive"),
    (_hf(rope_scaling="yarn"), "rope_scaling = 'yarn' is invalid: it must be a mapping"),
    (_hf(num_hidden_layers=0), "num_hidden_layers = 0 is invalid: it must be an integer >= 1"),
    (_hf(vocab_size=-1), "vocab_size = -1 is invalid"),
    (_hf(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
    ([1, 2], "config.json must hold a JSON object, got list"),
    (None, "config.json must hold a JSON object, got NoneType"),
])
def test_config_json_fields_are_typed_and_checked(cfg, match):
    with pytest.raises(CheckpointError, match=match):
        model_config_from_hf(cfg)


def test_bad_config_json_is_one_line_from_the_cli(tmp_path, capsys):
    from helix.cli import main
    (tmp_path / "config.json").write_text(json.dumps(_hf(num_attention_heads="four")))
    code = main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("helix: error: config.json")


# -- failures inside a step stay with their request ------------------------------------------

def _fail_when(llm, predicate, exc):
    """Make the model's layers raise `exc` on eager steps whose token count satisfies
    predicate."""
    real = llm.engine.model.hidden

    def hidden(ids, *args, **kw):
        if predicate(ids.shape[0]):
            raise exc
        return real(ids, *args, **kw)
    llm.engine.model.hidden = hidden


def test_oom_in_a_prefill_fails_that_request_only():
    """A long prompt joins while others decode and its step runs out of memory: it ends with
    finish reason "error" and the message; the others keep their exact tokens; the engine keeps
    serving new requests; no page leaks."""
    with LLM("tiny-llama", Layout(), RT) as llm:
        _fail_when(llm, lambda t: t > 40, torch.OutOfMemoryError("CUDA out of memory. Tried to "
                                                                 "allocate 32.00 GiB"))
        a, c = llm.add_request(A, greedy(8)), llm.add_request(C, greedy(8))
        llm.step()
        llm.step()
        b = llm.add_request(B, greedy(4))
        out = llm.step()                      # B's prefill fails; A and C decode in a retry
        assert out.finished == {b: "error"} and "Tried to allocate" in out.errors[b]
        assert set(out.tokens) == {a, c}
        run_to_end(llm)
        assert llm.finish_reasons[b] == "error" and llm.outputs[b] == []
        assert "OutOfMemoryError" in llm.errors[b]
        assert llm.outputs[a] == alone(A, 8) and llm.outputs[c] == alone(C, 8)
        d = llm.add_request(C, greedy(3))      # the engine is still good
        run_to_end(llm)
        assert llm.outputs[d] == alone(C, 3)
        assert llm.engine.kv_pages_free() == llm.engine.num_pages   # cached blocks idle


def test_a_failing_decode_step_fails_its_rows_and_a_second_in_a_row_ends_the_engine():
    with LLM("tiny-llama", Layout(), RT) as llm:
        a = llm.add_request(A, greedy(8))
        llm.step()
        fail = [True]
        _fail_when(llm, lambda t: fail[0], RuntimeError("device fault"))
        out = llm.step()
        assert out.finished == {a: "error"} and "device fault" in llm.errors[a]
        b = llm.add_request(C, greedy(3))
        with pytest.raises(EngineDeadError, match="two steps in a row failed"):
            llm.step()                         # persistent: the engine says so once
        assert llm.finish_reasons[b] == "error"
        with pytest.raises(EngineDeadError, match="stopped earlier"):
            llm.add_request(A, greedy(2))


# -- several ranks: dead, failing, stopped workers ---------------------------------------------

def test_a_worker_failing_inside_a_step_ends_the_run_with_one_error(monkeypatch):
    monkeypatch.setenv("HELIX_INJECT_FAULT", "1:2")
    with LLM("tiny-llama", Layout(kvp=2), RuntimeConfig(page_size=4, max_context=64,
                                                         timeout_s=30)) as llm:
        a = llm.add_request(A, greedy(10))
        t0 = time.perf_counter()
        with pytest.raises(EngineDeadError, match=r"rank 1 exited with code 1"):
            for _ in range(5):
                llm.step()
        assert time.perf_counter() - t0 < 15
        assert llm.finish_reasons[a] == "error"
        with pytest.raises(EngineDeadError):
            llm.step()
    assert not any(p.is_alive() for p in llm._procs)


def test_a_killed_worker_is_reported_by_rank_and_exit_code():
    with LLM("tiny-llama", Layout(kvp=2), RuntimeConfig(page_size=4, max_context=64)) as llm:
        llm.add_request(A, greedy(20))
        llm.step()
        os.kill(llm._procs[0].pid, signal.SIGKILL)
        t0 = time.perf_counter()
        with pytest.raises(EngineDeadError, match="rank 1 exited with code -9"):
            for _ in range(5):
                llm.step()
        assert time.perf_counter() - t0 < 10


def test_a_stopped_worker_ends_the_run_within_the_timeout_and_close_completes():
    llm = LLM("tiny-llama", Layout(kvp=2), RuntimeConfig(page_size=4, max_context=64,
                                                         timeout_s=4))
    llm.add_request(A, greedy(20))
    llm.step()
    pid = llm._procs[0].pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.perf_counter()
    try:
        with pytest.raises(EngineDeadError, match="rank 1 is stopped|collective"):
            for _ in range(3):
                llm.step()
        assert time.perf_counter() - t0 < 4 + 15
    finally:
        t1 = time.perf_counter()
        llm.close()
        assert time.perf_counter() - t1 < 10
    assert not llm._procs[0].is_alive()


# -- lifecycle ---------------------------------------------------------------------------------

def test_failed_multi_rank_constructor_raises_and_the_caller_lives_on(hf_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    src, _ = hf_checkpoint("llama")
    bad = tmp_path / "missing"
    shutil.copytree(src, bad)
    weights = load_file(str(bad / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(HelixError,
                       match="lacks tensor 'model.layers.1.mlp.down_proj.weight'|rank 1"):
        LLM(str(bad), Layout(kvp=2), RuntimeConfig(page_size=4, max_context=64))
    time.sleep(1.0)                           # nothing kills this process afterwards
    with LLM("tiny-llama", Layout(kvp=2), RuntimeConfig(page_size=4, max_context=64)) as llm:
        assert llm.generate([A], greedy(3))[0] == alone(A, 3)


def test_second_multi_rank_llm_and_use_after_close_are_errors():
    rt = RuntimeConfig(page_size=4, max_context=64)
    llm = LLM("tiny-llama", Layout(kvp=2), rt)
    try:
        with pytest.raises(HelixError, match="another multi-rank LLM is open"):
            LLM("tiny-llama", Layout(kvp=2), rt)
        with LLM("tiny-llama", Layout(), rt) as one:    # one rank needs no process group
            assert len(one.generate([A], greedy(2))[0]) == 2
    finally:
        llm.close()
    for call in (lambda: llm.step(), lambda: llm.add_request(A), lambda: llm.stats()):
        with pytest.raises(HelixError, match="this LLM is closed"):
            call()
    llm.close()                                         # idempotent
    with LLM("tiny-llama", Layout(kvp=2), rt) as again:  # the world can be opened again
        assert again.generate([A], greedy(2))[0] == alone(A, 2)


def test_step_from_two_threads_is_refused_not_corrupted():
    with LLM("tiny-llama", Layout(), RT) as llm:
        ids = [llm.add_request(p, greedy(6)) for p in (A, B, C)]
        inside, release, errors = threading.Event(), threading.Event(), []
        real = llm.engine.step

        def slow_step(commands):
            inside.set()
            release.wait(5)
            return real(commands)
        llm.engine.step = slow_step
        t = threading.Thread(target=llm.step)
        t.start()
        inside.wait(5)
        try:
            llm.step()
        except HelixError as e:
            errors.append(str(e))
        release.set()
        t.join()
        llm.engine.step = real
        assert errors and "already running in another thread" in errors[0]
        run_to_end(llm)
        assert [llm.outputs[i] for i in ids] == [alone(p, 6) for p in (A, B, C)]
        assert llm.engine.kv_pages_free() == llm.engine.num_pages   # cached blocks idle


def test_torchrun_world_must_match_the_layout(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun started 2 ranks but the layout needs 1"):
        LLM("tiny-llama", Layout(), RT)


# -- the KV pool sized to the machine ----------------------------------------------------------

def test_pool_is_sized_from_memory_and_too_large_requests_are_refused(caplog, monkeypatch):
    from helix.runtime import memory
    from helix.runtime.memory import activation_reserve, available_bytes
    # the machine's available RAM held still: other test workers allocate while this one runs
    monkeypatch.setattr(memory, "_mem_available", lambda: 16 << 30)
    cfg, _ = read_model_config("tiny-llama")
    runtime = RuntimeConfig(page_size=16, max_context=8192, max_batch=64)
    free = available_bytes(torch.device("cpu"), 1.0, 1)
    per_page = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    # a utilization that leaves room for ~100 pages after the activation reserve
    util = (activation_reserve(cfg, Layout(), runtime) + 100.5 * per_page) / free
    rt = RuntimeConfig(page_size=16, max_context=8192, max_batch=64, memory_utilization=util)
    with caplog.at_level("INFO", logger="helix"):
        with LLM("tiny-llama", Layout(), rt) as llm:
            pool = llm.engine.pool
            assert 90 <= pool.num_pages <= 100 and pool.needed_pages == 64 * 512
            with pytest.raises(CapacityError, match="the pool has"):
                llm.add_request([5] * 1995, greedy(8))               # 2003 positions: 126 pages
            assert llm.generate([A], greedy(3))[0] == alone(A, 3, RuntimeConfig(page_size=16))
    assert any("KV pool:" in r.message for r in caplog.records)


def test_close_releases_the_weights_and_the_kv_cache():
    """A closed LLM still referenced (the name of a `with` block lives on) holds no weights and
    no KV cache, so the next engine of the process has their memory; it refuses more work."""
    import gc
    import weakref
    with LLM("tiny-llama", Layout(), RT) as llm:
        assert llm.generate([A], greedy(3))[0] == alone(A, 3)
        refs = [weakref.ref(next(llm.engine.model.parameters())),
                weakref.ref(llm.engine.caches[0][0])]
    gc.collect()
    assert [r() for r in refs] == [None, None]
    with pytest.raises(HelixError, match="closed"):
        llm.generate([A], greedy(3))


def test_cuda_memory_cached_by_the_allocator_counts_as_free(monkeypatch):
    """An engine built after another was closed in the same process: the blocks the caching
    allocator kept (reserved, not allocated) are the new engine's to take, though the driver
    counts them in use."""
    from helix.runtime.memory import available_bytes
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (10 * gib, 100 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 70 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 30 * gib)
    # 90 % of 100 GiB, less what is in use: 90 used by the driver's count, 40 of it cached
    assert available_bytes(torch.device("cuda", 0), 0.9, 1) == 90 * gib - (90 - 40) * gib
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 30 * gib)   # nothing cached
    assert available_bytes(torch.device("cuda", 0), 0.9, 1) == 0


def test_no_room_for_the_kv_cache_is_a_clear_error():
    with pytest.raises(ConfigError, match="no memory left for the KV cache"):
        LLM("tiny-llama", Layout(), RuntimeConfig(memory_utilization=1e-9))


# -- signals -----------------------------------------------------------------------------------

@pytest.mark.parametrize("sig,code,line", [(signal.SIGINT, 130, "helix: interrupted"),
                                           (signal.SIGTERM, 143, "helix: terminated")])
def test_signal_ends_a_two_rank_run_promptly(sig, code, line):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "helix.cli", "generate", "--model", "tiny-llama",
                             "--kvp", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", "100000",
                             "--max-context", "2048", "--ignore-eos", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        started = time.time()                  # the pool line is logged once every rank is built
        while time.time() - started < 60 and not any("KV pool" in ln for ln in err_lines):
            time.sleep(0.2)
        workers = {c for c in descendants(proc.pid) if alive(c)}
        time.sleep(1)                          # into the decode loop
        proc.send_signal(sig)
        t0 = time.time()
        proc.wait(timeout=30)
        reader.join(timeout=5)
        assert time.time() - t0 < 10
    finally:
        proc.kill()
    err = "".join(err_lines)
    assert proc.returncode == code
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("helix: KV pool")]
    assert lines == [line], err
    time.sleep(0.5)
    assert workers and not any(alive(w) for w in workers)
