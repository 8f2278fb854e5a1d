"""CPU unit tests of the pieces under the runtime: the KV ownership rule, the page allocator, the
slot mapping, the exact LSE merge and its one-message packing, RoPE frequency schedules against
`transformers`, config parsing and validation, and sampling."""

from __future__ import annotations

import pytest
import torch

from helix.attention.merge import merge_partials, pack_partials, unpack_partials
from helix.attention.torch_ref import TorchAttention
from helix.config import Layout, ModelConfig, RuntimeConfig
from helix.errors import CapacityError, ConfigError, RequestError
from helix.hf_config import model_config_from_hf
from helix.kv import KVManager, PageAllocator, kv_owner, local_index, local_len, local_to_global
from helix.layers.rope import inv_frequencies
from helix.runtime.sampling import SamplingParams

LAYOUTS = [(kvp, i) for kvp in (1, 2, 3, 4) for i in (1, 2, 3, 16)]


# -- ownership rule --------------------------------------------------------------------------------
@pytest.mark.parametrize("kvp,interleave", LAYOUTS)
def test_ownership_partitions_positions(kvp, interleave):
    n = 5 * kvp * interleave + 7                       # a ragged tail
    owners = [kv_owner(p, kvp, interleave) for p in range(n)]
    for r in range(kvp):
        mine = [p for p in range(n) if owners[p] == r]
        # local indices of a rank's positions are 0, 1, 2, ... in position order
        assert [local_index(p, kvp, interleave) for p in mine] == list(range(len(mine)))
        assert [local_to_global(j, r, kvp, interleave) for j in range(len(mine))] == mine
        for length in range(n + 1):
            assert local_len(length, r, kvp, interleave) == sum(1 for p in mine if p < length)
    # position p -> rank (p // I) % kvp, in runs of I; rank 0 always owns the most
    assert owners[:2 * kvp * interleave] == [(p // interleave) % kvp
                                             for p in range(2 * kvp * interleave)]
    for length in range(n + 1):
        counts = [local_len(length, r, kvp, interleave) for r in range(kvp)]
        assert counts[0] == max(counts) and sum(counts) == length


def test_ownership_examples_and_tensors():
    # token round-robin over 2 ranks: position 5 is rank 1's local 2
    assert (kv_owner(5, 2, 1), local_index(5, 2, 1)) == (1, 2)
    # page round-robin (TensorRT-LLM), page 4, 2 ranks: positions 8..11 are rank 0's 4..7
    assert [kv_owner(p, 2, 4) for p in range(12)] == [0] * 4 + [1] * 4 + [0] * 4
    assert [local_index(p, 2, 4) for p in range(8, 12)] == [4, 5, 6, 7]
    p = torch.arange(40)
    assert kv_owner(p, 3, 2).tolist() == [kv_owner(int(x), 3, 2) for x in p]
    assert local_index(p, 3, 2).tolist() == [local_index(int(x), 3, 2) for x in p]
    j = torch.arange(10)
    assert local_to_global(j, 1, 3, 2).tolist() == [local_to_global(int(x), 1, 3, 2) for x in j]


# -- page allocator --------------------------------------------------------------------------------
def test_page_allocator():
    a = PageAllocator(6)
    assert a.num_free == 6
    x = a.allocate(2)
    assert x == [0, 1]
    y = a.allocate(3)
    assert y == [2, 3, 4] and a.num_free == 1
    with pytest.raises(CapacityError, match="need 2 pages, 1 free"):
        a.allocate(2)
    assert a.num_free == 1                             # a refused request takes nothing
    a.free(x)
    assert a.num_free == 3
    z = a.allocate(3)
    assert sorted(z) == [0, 1, 5] and not set(z) & set(y)
    a.free(y)
    a.free(z)
    assert sorted(a.allocate(6)) == list(range(6))
    assert a.allocate(0) == []


# -- KV manager: slot mapping ----------------------------------------------------------------------
def test_slot_mapping_single_rank():
    kv = KVManager(num_pages=10, page_size=4, kvp_rank=0, kvp=1, interleave=1)
    meta = kv.prepare([(7, 0, 6), (9, 0, 3)], "cpu")       # two prefills
    p7, p9 = kv.pages[7], kv.pages[9]
    assert len(p7) == 2 and len(p9) == 1 and not set(p7) & set(p9)
    want = [p7[i // 4] * 4 + i % 4 for i in range(6)] + [p9[0] * 4 + i for i in range(3)]
    assert meta.slots.tolist() == want
    assert meta.q_pos.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert meta.cu_q.tolist() == [0, 6, 9] and meta.kv_lens.tolist() == [6, 3]
    assert meta.block_tables.tolist() == [p7, p9 + [0]] and not meta.is_decode
    meta = kv.prepare([(7, 6, 1), (9, 3, 1)], "cpu")       # decode: position 6 in page 1, 3 in
                                                           # page 0
    assert meta.slots.tolist() == [p7[1] * 4 + 2, p9[0] * 4 + 3] and meta.is_decode
    meta = kv.prepare([(9, 4, 1)], "cpu")                  # crosses into a new page
    assert len(kv.pages[9]) == 2 and meta.slots.tolist() == [kv.pages[9][1] * 4]
    with pytest.raises(RuntimeError, match="KV cache holds 5"):
        kv.prepare([(9, 2, 1)], "cpu")                     # positions must continue the sequence
    kv.free(7)
    kv.free(9)
    assert kv.alloc.num_free == 10 and not kv.pages and not kv.lengths


@pytest.mark.parametrize("kvp,interleave", [(2, 1), (3, 2), (4, 4)])
def test_slot_mapping_splits_positions_across_ranks(kvp, interleave):
    page = 4
    mgrs = [KVManager(16, page, r, kvp, interleave) for r in range(kvp)]
    steps = [[(0, 0, 11), (1, 0, 5)], [(0, 11, 1), (1, 5, 1)], [(0, 12, 1)]]
    for batch in steps:
        metas = [m.prepare(batch, "cpu") for m in mgrs]
        T = sum(n for _, _, n in batch)
        owned = torch.stack([mt.slots >= 0 for mt in metas])            # [kvp, T]
        assert owned.sum(0).tolist() == [1] * T                           # exactly one owner each
        pos = metas[0].q_pos
        for r, (m, mt) in enumerate(zip(mgrs, metas)):
            assert torch.equal(owned[r], kv_owner(pos, kvp, interleave) == r)
            # an owned slot is the local index's page and offset
            seqs = torch.repeat_interleave(torch.tensor([s for s, _, _ in batch]),
                                           torch.tensor([n for _, _, n in batch]))
            for t in torch.nonzero(owned[r]).flatten().tolist():
                j = local_index(int(pos[t]), kvp, interleave)
                assert int(mt.slots[t]) == m.pages[int(seqs[t])][j // page] * page + j % page
            assert mt.kv_lens.tolist() == [local_len(s + n, r, kvp, interleave)
                                           for _, s, n in batch]


# -- exact merge of partial attention --------------------------------------------------------------
def _attend(q, k, v, scale):
    """q [T, h, d], k/v [K, h, d] -> o [T, h, d], lse [T, h]; K == 0 gives o = 0, lse = -inf."""
    s = torch.einsum("thd,khd->thk", q, k) * scale
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full(q.shape[:2], float("-inf"))
    return torch.einsum("thk,khd->thd", s.softmax(-1), v), torch.logsumexp(s, -1)


@pytest.mark.parametrize("sizes", [(5, 9, 2), (0, 7, 0, 3), (13,), (0, 0, 4)])
def test_merge_partials_is_exact(sizes):
    g = torch.Generator().manual_seed(len(sizes))
    T, h, d, K = 3, 4, 8, sum(sizes)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((T, h, d), (K, h, d), (K, h, d)))
    perm = torch.randperm(K, generator=g)              # shards are arbitrary subsets of the keys
    parts, start = [], 0
    for n in sizes:
        idx = perm[start:start + n]
        parts.append(_attend(q, k[idx], v[idx], 0.3))
        start += n
    o, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    want_o, want_lse = _attend(q, k, v, 0.3)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-6)


def _partials_with_empty_rows():
    """o [3 shards, T=2, 4 heads, 8], lse: token 0 has one non-empty shard (plus a NaN and a +inf
    that a backend may produce, which count as empty); token 1 is empty on every shard."""
    o = torch.zeros(3, 2, 4, 8)
    lse = torch.full((3, 2, 4), float("-inf"))
    lse[1, 0], o[1, 0] = 0.5, 2.0
    lse[2, 0, 1] = float("nan")
    lse[0, 0, 2] = float("inf")
    return o, lse


def test_merge_empty_rows_give_zero_not_nan():
    out, total = merge_partials(*_partials_with_empty_rows())
    assert not torch.isnan(out).any() and not torch.isnan(total).any()
    assert torch.equal(out[1], torch.zeros(4, 8)) and torch.equal(out[0], torch.full((4, 8), 2.0))
    assert total[0].tolist() == [0.5] * 4


def test_merge_all_empty_rows_keep_lse_minus_inf():
    _, total = merge_partials(*_partials_with_empty_rows())
    assert torch.isinf(total[1]).all() and (total[1] < 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pack_unpack_roundtrip(dtype):
    g = torch.Generator().manual_seed(0)
    T, H, d, n = 3, 8, 16, 4
    o = torch.randn(T, H, d, generator=g).to(dtype)
    lse = torch.randn(T, H, generator=g) * 30           # fp32 values that bf16 cannot hold
    lse[0, 3] = float("-inf")
    send = pack_partials(o, lse, n)
    assert send.dtype == dtype and send.shape[:3] == (n, T, H // n)
    back_o, back_lse = unpack_partials(send, d)
    # chunk j carries heads [j*H/n, (j+1)*H/n); the LSE's fp32 bits survive exactly
    for j in range(n):
        assert torch.equal(back_o[j], o[:, j * 2:(j + 1) * 2])
        assert torch.equal(back_lse[j], lse[:, j * 2:(j + 1) * 2])
    assert back_lse.dtype == torch.float32


@pytest.mark.parametrize("kvp,interleave", [(2, 1), (3, 2), (4, 4)])
def test_kvp_sharded_attention_merges_to_single_rank(kvp, interleave):
    """The Helix attention step simulated in one process: each KVP rank appends the positions it
    owns and attends over its shard; a hand-made all-to-all plus the merge must equal kvp = 1."""
    g = torch.Generator().manual_seed(kvp)
    page, hq, hkv, d = 4, 12, 2, 8
    batch = [(0, 0, 9), (1, 0, 2), (2, 0, 1)]                # prefill (ragged lengths)
    T = sum(n for _, _, n in batch)
    q, k, v = torch.randn(T, hq, d, generator=g), *torch.randn(2, T, hkv, d, generator=g)
    be = TorchAttention()

    def rank_attention(r, world):
        m = KVManager(16, page, r, world, interleave)
        meta = m.prepare(batch, "cpu")
        kc, vc = torch.zeros(16, page, hkv, d), torch.zeros(16, page, hkv, d)
        be.append_kv(kc, k, meta.slots)
        be.append_kv(vc, v, meta.slots)
        return be.attend_gqa(q, kc, vc, meta, 0.35)

    want, want_lse = rank_attention(0, 1)
    partials = [rank_attention(r, kvp) for r in range(kvp)]
    # sequence 2 has one token: only rank 0 holds it, the others return lse = -inf, o = 0
    assert all(torch.isinf(lse[-1]).all() and not o[-1].any() for o, lse in partials[1:])
    sends = [be.pack_partials(o, lse, kvp) for o, lse in partials]
    hm = hq // kvp
    for j in range(kvp):                               # chunk j of every rank's send -> rank j
        recv = torch.stack([sends[r][j] for r in range(kvp)])
        got = be.merge_received(recv, d)
        torch.testing.assert_close(got, want[:, j * hm:(j + 1) * hm], rtol=1e-5, atol=1e-6)
    assert torch.isfinite(want_lse).all()


# -- RoPE against transformers ---------------------------------------------------------------------
def _hf_rope(config, rope_type):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


ROPES = {
    "llama3": dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=256),
    "llama3-405b": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                 original_max_position_embeddings=256),
    "yarn-mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707,
                        original_max_position_embeddings=4096),
    "yarn-no-truncate": dict(rope_type="yarn", rope_theta=50000.0, factor=8.0, truncate=False,
                             original_max_position_embeddings=512),
    "yarn-attention-factor": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  attention_factor=0.8, original_max_position_embeddings=256),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
}


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("dim", [16, 64])
def test_rope_inv_freq_matches_transformers(name, dim):
    from transformers import LlamaConfig
    params = ROPES[name]
    config = LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, head_dim=dim,
                         max_position_embeddings=65536, rope_parameters=dict(params))
    want_inv, want_attn = _hf_rope(config, params["rope_type"])
    cfg = model_config_from_hf({**config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    inv, attn = inv_frequencies(cfg.rope, dim)
    torch.testing.assert_close(inv, want_inv.float(), rtol=1e-6, atol=0)
    assert attn == pytest.approx(want_attn, rel=1e-6)


def test_rope_legacy_rope_scaling_format():
    """transformers 4.x checkpoints: rope_scaling {type: ...} and a top-level rope_theta."""
    new = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                               "original_max_position_embeddings": 256, "mscale": 1.0,
                               "mscale_all_dim": 1.0}}
    old = {"rope_theta": 5000.0, "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                  "original_max_position_embeddings": 256,
                                                  "mscale_all_dim": 1.0}}
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=16,
                num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    a, b = model_config_from_hf({**base, **new}).rope, model_config_from_hf({**base, **old}).rope
    assert a == b and a.rope_type == "yarn" and a.theta == 5000.0 and a.factor == 4.0


def test_mla_softmax_scale_matches_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    for rope in (dict(rope_type="yarn", rope_theta=1e4, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                      original_max_position_embeddings=4096),
                 dict(rope_type="default", rope_theta=1e4)):
        config = DeepseekV3Config(hidden_size=64, num_attention_heads=4, q_lora_rank=None,
                                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                  v_head_dim=16, rope_parameters=rope,
                                  max_position_embeddings=163840)
        cfg = model_config_from_hf({**config.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
        assert cfg.softmax_scale == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-9)
        assert cfg.rope.adjacent_pairs


# -- config parsing -------------------------------------------------------------------------------
def test_moe_layer_pattern_from_hf():
    base = dict(vocab_size=8, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                intermediate_size=32, moe_intermediate_size=8, num_experts_per_tok=2)
    q = model_config_from_hf({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                              "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert q.moe_layers == (False, True, False, False) and q.qk_norm and q.num_experts == 4
    d = model_config_from_hf({**base, "architectures": ["DeepseekV3ForCausalLM"],
                              "n_routed_experts": 4, "first_k_dense_replace": 1,
                              "kv_lora_rank": 8, "qk_nope_head_dim": 4,
                              "qk_rope_head_dim": 4, "v_head_dim": 4})
    assert d.moe_layers == (False, True, True, True) and d.is_mla and d.scoring == "sigmoid"
    assert d.topk_method == "noaux_tc" and d.q_lora_rank is None


# -- layout and runtime validation -----------------------------------------------------------------
def _model(**kw) -> ModelConfig:
    base = dict(arch="llama", vocab_size=100, hidden_size=64, num_layers=2, num_heads=8,
                num_kv_heads=2, head_dim=8, intermediate_size=128)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw,match", [
    (dict(kvp=0), "kvp must be a positive integer"),
    (dict(tpa=-1), "tpa must be a positive integer"),
    (dict(kv_interleave=0), "kv_interleave must be a positive integer"),
    (dict(kvp=2, tpa=2, ep=3), "ep=3 does not divide the world size kvp\\*tpa=4: choose ep among"),
    (dict(kvp=2, tpa=2, tpf=3), "tpf\\*ep = 3\\*1 must equal kvp\\*tpa = 4: set --tpf 4"),
])
def test_layout_rejects_bad_degrees(kw, match):
    with pytest.raises(ConfigError, match=match):
        Layout(**kw)


def test_layout_defaults():
    lay = Layout(kvp=4, tpa=2, ep=2)
    assert (lay.world_size, lay.tpf, lay.is_tp_baseline) == (8, 4, False)
    assert Layout(kvp=1, tpa=4).is_tp_baseline


MLA = dict(arch="deepseek_v3", num_kv_heads=1, head_dim=0, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=8)
MOE = dict(arch="qwen3_moe", num_experts=6, experts_per_token=2, moe_intermediate_size=10,
           moe_layers=(True, True))


@pytest.mark.parametrize("layout,model,match", [
    (Layout(kvp=3), {}, "world size kvp\\*tpa=3 does not fit this model \\(8 query heads"),
    (Layout(kvp=2, tpa=4), {}, "tpa=4 must divide the 2 KV heads: choose tpa among the divisors"),
    (Layout(kvp=1, tpa=8, ep=1), dict(num_kv_heads=3, num_heads=24, intermediate_size=96),
     "tpa=8 and 3 KV heads: one must divide the other"),
    (Layout(kvp=2, tpa=2), MLA, "MLA has one latent KV head: use tpa=1"),
    (Layout(kvp=4, ep=4), MOE, "6 experts are not divisible by ep=4"),
    (Layout(kvp=2, tpa=2, ep=1), MOE, "expert width 10 is not divisible by tpf=4"),
    (Layout(kvp=8), dict(intermediate_size=100), "FFN width 100\\): use one of 1, 2, 4"),
])
def test_layout_validation_names_the_fix(layout, model, match):
    with pytest.raises(ConfigError, match=match):
        layout.validate(_model(**model))


@pytest.mark.parametrize("layout,model", [
    (Layout(kvp=4, tpa=2), {}),                    # Helix: KVP x TP_A = 8
    (Layout(kvp=1, tpa=8), {}),                    # TP baseline, KV replicated 4x
    (Layout(kvp=8), MLA),
    (Layout(kvp=1, tpa=2), MLA),                   # MLA TP baseline
    (Layout(kvp=2, ep=2), MOE),
])
def test_layout_validation_accepts(layout, model):
    layout.validate(_model(**model))


@pytest.mark.parametrize("kw,match", [
    (dict(device="tpu"), "device must be cpu or cuda"),
    (dict(dtype="float64"), "unknown dtype 'float64'"),
    (dict(page_size=0), "page_size must be an integer >= 1, got 0"),
    (dict(max_context=-1), "max_context must be an integer >= 0"),
    (dict(max_batch=2.5), "max_batch must be an integer >= 1, got 2.5"),
    (dict(timeout_s=float("nan")), "timeout_s must be a finite number"),
    (dict(memory_utilization=1.5), "memory_utilization is a fraction"),
    (dict(attention_backend="xformers"),
     "attention backend must be one of auto, torch, triton, flash-attn"),
    (dict(graph_breaks=("mlp",)), "unknown graph break\\(s\\) mlp: use attention, moe"),
    (dict(graph_buckets=(1, 0)), "graph buckets must be positive"),
])
def test_runtime_config_validation(kw, match):
    with pytest.raises(ConfigError, match=match):
        RuntimeConfig(**kw)


def test_page_table_rows_follow_the_pages():
    """PageTable: rows written as pages are added, grown past its start size (rows and
    columns), zero padded to the widest sequence asked for, zeroed and reused when dropped; a
    sequence without pages reads as a zero row."""
    from helix.kv.page_table import PageTable
    t = PageTable(rows=2, cols=2)
    t.set(7, [3, 4, 5])                         # wider than the table
    t.set(8, [9])
    t.set(9, [1, 2])                            # a third row
    assert t.rows([7, 8, 9]).tolist() == [[3, 4, 5], [9, 0, 0], [1, 2, 0]]
    t.set(7, [3, 4, 5, 6, 10])                  # appended
    t.set(9, [1])                               # truncated: its tail zeroed
    assert t.rows([9, 7]).tolist() == [[1, 0, 0, 0, 0], [3, 4, 5, 6, 10]]
    t.drop(7)
    t.set(11, [8])                              # reuses 7's row, which reads clean
    assert t.rows([11, 12]).tolist() == [[8], [0]]
    assert t.rows([8, 11]).dtype == torch.int32


def test_mixed_step_prefill_metadata_is_aligned():
    """A mixed step's prefill part starts its metadata on 16-byte boundaries whatever the number
    of decode rows before it (Triton compiles one variant per pointer alignment), with the same
    values as the slices."""
    kv = KVManager(64, 4, 0, 1, 1)
    for d in range(1, 6):
        ids = list(range(10 * d, 10 * d + d + 1))
        kv.prepare([(s, 0, 3) for s in ids], "cpu")
        meta = kv.prepare([(s, 3, 1) for s in ids[:d]] + [(ids[d], 3, 5)], "cpu")
        _, pre = meta.split()
        for name in ("slots", "block_tables", "kv_lens", "q_pos", "cu_q"):
            t = getattr(pre, name)
            assert t.data_ptr() % 16 == 0, (d, name)
        assert pre.slots.tolist() == meta.slots[d:].tolist()
        assert pre.block_tables.tolist() == meta.block_tables[d:].tolist()
        assert pre.host_lens == (meta.host_lens[0][d:], meta.host_lens[1][d:])
        for s in ids:
            kv.free(s)


def test_idle_steps_prefill_longer_chunks():
    """A step with no request decoding prefills up to idle_prefill_tokens, one with decode rows
    up to max_prefill_tokens (plus its decode rows); the tokens do not depend on the chunking."""
    from helix import LLM

    def run(idle):
        rt = RuntimeConfig(max_prefill_tokens=8, idle_prefill_tokens=idle, max_batch=4)
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        with LLM("tiny-llama", runtime=rt) as llm:
            a = llm.add_request(list(range(1, 41)), params)
            fed = [llm.step().num_tokens]                 # alone: an idle step
            while not llm.outputs[a]:
                fed.append(llm.step().num_tokens)
            b = llm.add_request(list(range(3, 30)), params)
            while not llm.outputs[b]:
                fed.append(llm.step().num_tokens)         # a decodes beside b's chunks
            while llm.has_unfinished():
                llm.step()
            return fed, llm.outputs[a], llm.outputs[b]
    fed, out_a, out_b = run(32)
    assert fed[:2] == [32, 8] and max(fed[2:]) <= 8 + 1
    small = RuntimeConfig(max_prefill_tokens=8, idle_prefill_tokens=4)
    assert small.resolved_idle_prefill_tokens == 8                  # never below the other
    fed8, out_a8, out_b8 = run(8)
    assert fed8[:5] == [8] * 5 and (out_a8, out_b8) == (out_a, out_b)


def test_kv_pool_is_capped_by_what_max_batch_contexts_need():
    """With plenty of memory the pool holds max_batch full contexts on KVP rank 0, no more."""
    from helix.runtime.memory import KVPool, plan_kv_pool

    class Model:
        def kv_cache_shapes(self, pages, page):
            return [[(pages, page, 2, 8)] * 2]

    m = _model(max_position=1000)
    rt = RuntimeConfig(page_size=16, max_batch=4, memory_utilization=1.0)
    assert rt.resolved_max_context(m) == 1000
    for lay in (Layout(), Layout(kvp=3), Layout(kvp=2, kv_interleave=16)):
        need = -(-local_len(1000, 0, lay.kvp, lay.kv_interleave) // 16)
        pool = plan_kv_pool(Model(), m, lay, rt, torch.device("cpu"), 1)
        assert isinstance(pool, KVPool) and pool.num_pages == 4 * need
        assert pool.page_bytes == 2 * 16 * 2 * 8 * 4


# -- sampling --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_k=-1), "top_k must be in \\[0, 2147483648\\), got -1"),
    (dict(top_k=2**63), "top_k must be in"),
    (dict(top_k=2.5), "top_k must be an integer, got 2.5"),
    (dict(seed=2**64), "seed must be in \\[0, 9223372036854775808\\)"),
    (dict(seed="x"), "seed must be an integer, got 'x'"),
    (dict(max_new_tokens=float("nan")), "max_new_tokens must be an integer, got nan"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer, got 2.5"),
    (dict(temperature=float("nan")), "temperature must be a finite number, got nan"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of token ids, got 5"),
    (dict(stop_token_ids=[1, "a"]), "stop_token_ids entry must be an integer"),
    (dict(forced_tokens=[-1]), "forced_tokens entry must be >= 0"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p must be in \\(0, 1\\]"),
])
def test_sampling_params_validation(kw, match):
    with pytest.raises(RequestError, match=match):
        SamplingParams(**kw)


def test_kv_sharding_pages_follow_the_interleave():
    """kvp 4, I 256, page 16, 512 positions: rank 0 and 1 own 256 each (16 pages), ranks 2-3
    none. A rule that ignored the interleave (512 / 4 = 128 -> 8 pages) under-reserves."""
    from helix.kv import KVSharding
    s = KVSharding(kvp=4, interleave=256, page_size=16)
    assert s.pages_per_rank(512) == [16, 16, 0, 0]
    assert s.max_pages(512) == 16
    for kvp, I, page in ((1, 1, 16), (3, 4, 8), (4, 16, 16), (2, 1, 5)):
        s = KVSharding(kvp, I, page)
        for n in (0, 1, 7, 63, 64, 65, 1000):
            held = [sum(1 for p in range(n) if kv_owner(p, kvp, I) == r) for r in range(kvp)]
            assert s.pages_per_rank(n) == [-(-h // page) for h in held]
            assert s.max_pages(n) == max(s.pages_per_rank(n))


def test_sweep_reserves_the_pages_the_scheduler_needs():
    """The sweep's KV pool holds every point's requests at once (the kvp 4, I 256 case)."""
    from helix.kv import KVSharding
    from helix.sweep import Sweep, _pool_pages
    lay = Layout(kvp=4, tpa=1, kv_interleave=256)
    sw = Sweep(name="t", models=("tiny-llama",), layouts=(lay,), batches=(2,), contexts=(512,),
               runtime={"page_size": 16}, decode_steps=2, warmup_steps=1)
    steps = sw.decode_steps + sw.warmup_steps
    need = KVSharding(4, 256, 16).max_pages(512 + steps + 2)
    assert _pool_pages(sw, lay) >= 2 * need
