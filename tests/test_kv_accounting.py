"""KV accounting: which rank stores which KV positions.

Per sequence the KVP ranks partition its positions (each stored once per KV head, on the owner
(p // I) % kvp), so their local lengths differ by at most one interleave block I; per rank the
totals are the ownership rule's sums, times tpa over all ranks. Helix layouts hold no duplicate
(position, KV head); the TP baseline with tpa > KV heads holds tpa / Hkv copies.

Checked three ways: the KV manager of every KVP rank driven through the scenario in one process
(slots, block tables, lengths), the multi-process runs of the layout matrix (kv_tokens_per_rank,
shared with test_parallel_layouts), and the `helix generate --json` CLI on an odd world.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helix import LLM, Layout, SamplingParams
from helix.kv import KVManager, kv_owner, local_index, local_len
from helix.layers.attention_gqa import kv_head_range
from helix.loader import read_model_config
from parallel_helpers import CASES, INITIAL, JOIN_AT, JOINER, PAGE, RUNTIME, Case, cached_run


def _kv_heads(case: Case) -> tuple[list[int], int]:
    """(KV heads each rank stores per position, KV heads of the model); MLA's latent row is one."""
    cfg = read_model_config(case.model)[0]
    if cfg.is_mla:
        return [1] * case.world, 1
    ranges = [kv_head_range(cfg, case.tpa, r % case.tpa) for r in range(case.world)]
    return [b - a for a, b in ranges], cfg.num_kv_heads


# -- one process: the KV manager of every KVP rank ----------------------------------------------

@pytest.mark.parametrize("interleave", [1, 3, 4, PAGE, 2 * PAGE])
@pytest.mark.parametrize("kvp", [1, 2, 3, 4])
def test_kvp_ranks_partition_every_sequence(kvp, interleave):
    """The scenario's schedule (mixed prefill, decode, a join, an early leave) through one KV
    manager per KVP rank: every position gets exactly one slot, on its owner, at its local index;
    no two live positions of a rank share a slot; local lengths differ by at most I."""
    mgrs = [KVManager(64, PAGE, k, kvp, interleave) for k in range(kvp)]
    todo = {sid: (n, new) for sid, (n, new) in enumerate(INITIAL)}
    lengths: dict[int, int] = {}                 # seq -> positions written
    generated: dict[int, int] = {}
    live_slots = [dict() for _ in range(kvp)]     # rank -> slot -> (seq, position)
    step = 0
    while todo:
        if step == JOIN_AT:
            todo[len(INITIAL)] = JOINER
        batch = [(sid, lengths.get(sid, 0), n if sid not in lengths else 1)
                 for sid, (n, _) in todo.items()]
        for k, mgr in enumerate(mgrs):
            meta = mgr.prepare(batch, "cpu")
            pos, slots = meta.q_pos.tolist(), meta.slots.tolist()
            seqs = [sid for sid, _, n in batch for _ in range(n)]
            for sid, p, slot in zip(seqs, pos, slots):
                assert (slot >= 0) == (kv_owner(p, kvp, interleave) == k), (sid, p, k)
                if slot < 0:
                    continue
                page, off = divmod(slot, PAGE)
                assert mgr.pages[sid].index(page) * PAGE + off == local_index(p, kvp, interleave)
                assert live_slots[k].setdefault(slot, (sid, p)) == (sid, p), "slot shared"
            for (sid, start, n), kv_len in zip(batch, meta.kv_lens.tolist()):
                assert kv_len == local_len(start + n, k, kvp, interleave)
        for sid, start, n in batch:
            lengths[sid] = start + n
            held = [m.local_tokens(sid) for m in mgrs]
            assert sum(held) == lengths[sid]
            assert max(held) - min(held) <= interleave and held[0] == max(held)
            generated[sid] = generated.get(sid, 0) + 1
            if generated[sid] == todo[sid][1]:
                del todo[sid]
                for k, m in enumerate(mgrs):
                    m.free(sid)
                    live_slots[k] = {s: v for s, v in live_slots[k].items() if v[0] != sid}
        step += 1
    assert all(m.alloc.num_free == 64 for m in mgrs)


# -- the multi-process runs of the layout matrix --------------------------------------------------

@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_kv_positions_per_rank(case: Case):
    run = cached_run(case.model, case.layout)
    lens = [run.seq_len(rid) for rid in run.prompts]
    kv = run.kv_tokens
    assert len(kv) == case.world
    # rank r = kvp_rank * tpa + tpa_rank holds the positions its KVP rank owns, of its KV heads
    want = [sum(local_len(n, r // case.tpa, case.kvp, case.interleave) for n in lens)
            for r in range(case.world)]
    assert kv == want
    assert sum(kv) == sum(lens) * case.tpa
    for a in range(case.tpa):                      # each head slice: the KVP ranks split the tokens
        assert sum(kv[a::case.tpa]) == sum(lens)
    heads, hkv = _kv_heads(case)
    entries = sum(n * h for n, h in zip(kv, heads))       # stored (position, KV head) pairs
    if case.kvp == 1 and case.tpa > hkv:           # TP baseline, N > KV heads: tpa / hkv copies
        assert entries == sum(lens) * case.tpa
    else:                                          # Helix (and TP without replication): no
                                                   # duplicate
        assert entries == sum(lens) * hkv

def test_cli_reports_kv_per_rank_on_an_odd_world():
    """`helix generate --json`, one request on 3 KVP ranks: tokens as on one rank, and the local
    lengths of the sequence differ by at most one interleave block."""
    model, prompt, new, kvp, interleave = "tiny-llama-h6", list(range(5, 28)), 34, 3, 4
    cmd = [sys.executable, "-m", "helix.cli", "generate", "--model", model,
           "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(new), "--ignore-eos",
           "--kvp", str(kvp), "--kv-interleave", str(interleave), "--device", "cpu",
           "--page-size", str(PAGE), "--max-context", str(RUNTIME.max_context), "--max-batch", "4",
           "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["layout"]["kvp"] == kvp and out["layout"]["kv_interleave"] == interleave
    with LLM(model, Layout(), RUNTIME) as ref:
        want = ref.generate([prompt], SamplingParams(max_new_tokens=new, ignore_eos=True))
    assert out["tokens"] == want
    n = len(prompt) + new - 1
    kv = out["kv_tokens_per_rank"]
    assert kv == [local_len(n, k, kvp, interleave) for k in range(kvp)]
    assert sum(kv) == n and max(kv) - min(kv) <= interleave
