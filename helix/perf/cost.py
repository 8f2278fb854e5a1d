"""What one decode step asks of the busiest rank: HBM bytes read, FLOPs, kernels and collectives,
per phase, for a model in a layout with `batch` requests of `context` tokens each.

The busiest rank is rank 0: KVP rank 0 owns at least as many positions as any other KVP rank
(ownership rule), and every rank reads the same weight shards. Phases, in step order:

  embed      token ids -> h: embedding rows (+ all-reduce over the world)
  attn_proj  input norm, q/k/v (GQA) or q_a/q_b/kv_a and the W_UK absorption (MLA), rope and
             the KV append (in the rope launch; MLA: the latent-row launch)            x layers
  attention  partial attention over the local KV shard (+ the KVP all-to-all)          x layers
  o_proj     (MLA: W_UV of the merged heads) row-parallel o_proj (+ all-reduce)            x layers
  ffn        dense FFN shard (+ all-reduce)                                          x dense layers
  moe        router, the local experts the step's tokens hit, shared experts (+ all-reduce)
  lm_head    final norm, vocab-parallel LM head (+ all-gather of fp32 logits), argmax

Weights counted are those a step reads. MoE: under uniform routing a token's top-k picks k of the E
experts, so an expert is missed by all B tokens with probability (1 - k/E)^B and a rank owning
E/ep experts reads E/ep * (1 - (1 - k/E)^B) of them (expected). KV: the positions KVP rank 0 owns
(`KVSharding.local_len`); the TP baseline reads every position, and with tpa > KV heads each
rank holds a copy of one KV head (`kv_head_range`); MLA has one latent head, so with kvp = 1
every rank holds the whole latent cache.

Kernels: the launches of the decode step on the GPU path (Triton / Gluon kernels, graphs),
checked against the profiled steps of `profiling/results/step_small/` (tests/test_perf_cost.py).
A layer's input add + norm rides in its first GEMM's launch where skinny_gemm.norm_in_gemv says
so (at one or two rows), except layer 0's (no residual yet: counted in `embed`); the MoE
router's launch does the post-attention add + norm; the shared experts and the top-k sum ride
in the two expert launches (moe_decode) up to its pair count, and at one row the experts are one
launch (helix.layers.gluon_moe, where its shape rule holds: the H200's path) with the router,
its add + norm included, inside it (where gluon_moe.route_fits).

The roofline floor of a step is sum over phases of max(bytes / read rate, FLOPs / matmul rate)
(a per-phase max: within a phase the kernels overlap neither with each other nor across phases,
so the slower resource of each phase bounds it). Collectives are not in the floor: they are
the planner's business (helix.perf.planner), which reuses these counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helix.attention.triton_decode import gqa_launches
from helix.config import Layout, ModelConfig
from helix.kv.ownership import KVSharding
from helix.layers.attention_gqa import kv_head_range
from helix.layers.fused_moe import decode_kernels
from helix.layers.gluon_moe import layer_unfit, route_fits
from helix.layers.router import route_spec
from helix.layers.skinny_gemm import norm_in_gemv

LSE_BYTES = 4              # the exchange packs one fp32 LSE per head next to O
SM_COUNT = 132             # the GEMV's tiles depend on it only for small weights (the H200's)


def _norm_alone(B: int, N: int, K: int) -> int:
    """Kernels of a layer's add + norm before a GEMM with weight [N, K]: 0 where the GEMM's
    launch does it (the runtime's rule), 1 otherwise."""
    return 0 if norm_in_gemv(B, N, K, SM_COUNT) else 1


@dataclass(frozen=True)
class Collective:
    kind: str              # all_to_all | all_reduce | all_gather
    ranks: int             # group size
    nbytes: float          # bytes this rank contributes (its send buffer / its input)


@dataclass(frozen=True)
class Phase:
    name: str
    count: int             # occurrences per step (layers of that kind)
    nbytes: float          # HBM bytes read, per occurrence
    flops: float           # per occurrence
    kernels: int           # kernels launched, per occurrence (collectives excluded)
    comms: tuple[Collective, ...] = ()

    def roofline_s(self, read_bps: float, flops_per_s: float) -> float:
        """One occurrence: the slower of reading its bytes and doing its FLOPs."""
        return max(self.nbytes / read_bps, self.flops / flops_per_s)


@dataclass(frozen=True)
class StepCost:
    phases: tuple[Phase, ...]
    weight_bytes: float = 0.0         # weights held by the rank (all of them, read or not)
    kv_bytes_per_position: float = 0.0  # per local position, all layers
    meta: dict = field(default_factory=dict)

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    @property
    def nbytes(self) -> float:
        return sum(p.count * p.nbytes for p in self.phases)

    @property
    def flops(self) -> float:
        return sum(p.count * p.flops for p in self.phases)

    @property
    def kernels(self) -> int:
        return sum(p.count * p.kernels for p in self.phases)

    def floor_s(self, read_bps: float, flops_per_s: float) -> float:
        """The roofline floor: per phase the slower resource, summed over phases."""
        return sum(p.count * p.roofline_s(read_bps, flops_per_s) for p in self.phases)

    def by_phase(self) -> dict[str, dict]:
        return {p.name: {"count": p.count, "bytes": p.nbytes, "flops": p.flops,
                         "kernels": p.kernels} for p in self.phases}


def expected_experts_hit(num_experts: int, top_k: int, tokens: int, local: int) -> float:
    """Expected distinct experts among `local` of `num_experts` that `tokens` tokens, each picking
    `top_k` distinct experts uniformly, reach."""
    if tokens <= 0:
        return 0.0
    return local * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _world_comm(kind: str, n: int, nbytes: float) -> tuple[Collective, ...]:
    return (Collective(kind, n, nbytes),) if n > 1 else ()


def _attention(cfg: ModelConfig, lay: Layout, B: int, T: int, es: int, page_size: int,
               kv_es: float, w_es: float):
    """-> (attn_proj, attention, o_proj) phases of one layer, KV bytes per local position and
    the kernels of a layer's input add + norm (0: in the x projection's launch). kv_es: bytes
    of a cached KV element; w_es: of a projection's weight element (fp8: ~1)."""
    n, D, H = lay.world_size, cfg.hidden_size, cfg.num_heads
    hq, hm = H // lay.tpa, H // n                       # local query heads, merged heads
    t_local = KVSharding(lay.kvp, lay.kv_interleave, page_size).local_len(T, 0)
    norm = D * es
    if cfg.is_mla:
        lora, rope, nope, v = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                               cfg.v_head_dim)
        qk = nope + rope
        ql = cfg.q_lora_rank or 0
        # GEMM weights: q_a (replicated) + q_b shard, or q shard; W_UK absorbs q_nope into the
        # latent space; kv_a (replicated) makes the new latent row and rope key
        projs = (D * ql + ql * hq * qk if ql else D * hq * qk) + D * (lora + rope)
        gemm = projs + hq * nope * lora                  # W_UK: kv_b_proj, never fp8
        norms = ql + lora                                # q_a and latent RMSNorm weights
        # (add + norm), the x projection (q or q_a, and kv_a: one GEMM), (q_a norm, q_b), the
        # latent row (kv_a norm, rope k, the append) with W_UK's absorption and rope q
        norm_kernels = _norm_alone(B, (ql or hq * qk) + lora + rope, D)
        proj = Phase("attn_proj", cfg.num_layers,
                     (D + norms + hq * nope * lora) * es + projs * w_es, 2 * B * gemm,
                     norm_kernels + 1 + (2 if ql else 0) + 1)
        pos_bytes = (lora + rope) * kv_es
        att_flops = 2 * B * hq * t_local * ((lora + rope) + lora)  # QK over lora+rope, PV over lora
        o_dim = lora
        o_w = hm * v * lora + hm * v * D                 # W_UV of the merged heads, o_proj shard
        o_bytes = hm * v * lora * es + hm * v * D * w_es
        o_kern = 2                                       # W_UV absorption, GEMM
        att_kern = 2                                     # splits, merge
    else:
        d = cfg.head_dim
        kv0, kv1 = kv_head_range(cfg, lay.tpa, 0)
        hkv = kv1 - kv0
        proj_w = D * (hq + 2 * hkv) * d
        extra = 2 * d if cfg.qk_norm else 0
        norm_kernels = _norm_alone(B, (hq + 2 * hkv) * d, D)
        proj = Phase("attn_proj", cfg.num_layers, norm + proj_w * w_es + extra * es,
                     2 * B * proj_w, norm_kernels + 2)
        # (add + norm), QKV GEMM, rope and the KV append (Qwen3: the q / k norms in the same
        # launch, helix.layers.fused_qk_norm.rope_append)
        pos_bytes = 2 * hkv * d * kv_es
        att_flops = 2 * B * hq * t_local * (d + d)
        o_dim = d
        o_w = hm * d * D
        o_bytes = o_w * w_es
        o_kern = 1                                       # GEMM (split-K summed in it)
        att_kern = gqa_launches(B, hq, hkv, d, t_local, SM_COUNT)   # splits (+ their merge)
    exchange = ((Collective("all_to_all", lay.kvp, B * hq * (o_dim * es + LSE_BYTES)),)
                if lay.kvp > 1 else ())
    # split-KV attention and its reduction (the append rides in an earlier launch: MLA's
    # latent-row launch, GQA's rotation); Helix adds the pack and the merge. The split count:
    # a block table as wide as the context (the benches' engines)
    att = Phase("attention", cfg.num_layers, B * t_local * pos_bytes, att_flops,
                att_kern + (2 if lay.kvp > 1 else 0), exchange)
    o_proj = Phase("o_proj", cfg.num_layers, o_bytes, 2 * B * o_w, o_kern,
                   _world_comm("all_reduce", n, B * D * es))
    return (proj, att, o_proj), pos_bytes, norm_kernels


def _ffn_phases(cfg: ModelConfig, lay: Layout, B: int, es: int, w_es: float) -> list[Phase]:
    n, D = lay.world_size, cfg.hidden_size
    moe_layers = sum(cfg.moe_layers) if cfg.is_moe else 0
    dense_layers = cfg.num_layers - moe_layers
    reduce = _world_comm("all_reduce", n, B * D * es)
    out = []
    if dense_layers:
        w = 3 * D * (cfg.intermediate_size // n)
        # (post-attention add + norm), gate_up GEMM, silu_mul, down GEMM
        kernels = _norm_alone(B, 2 * (cfg.intermediate_size // n), D) + 3
        out.append(Phase("ffn", dense_layers, D * es + w * w_es, 2 * B * w, kernels, reduce))
    if moe_layers:
        E, k = cfg.num_experts, cfg.experts_per_token
        router_es = 4 if cfg.arch.startswith("deepseek") else es     # DeepSeek's router is fp32
        expert_w = 3 * D * (cfg.moe_intermediate_size // lay.tpf)
        hit = expected_experts_hit(E, k, B, E // lay.ep)
        pairs = B * k / lay.ep                                       # expected (token, expert)
                                                                     # pairs
        shared_w = 3 * D * (cfg.moe_intermediate_size * cfg.num_shared_experts // n)
        nbytes = D * es + E * D * router_es + (hit * expert_w + shared_w) * w_es
        flops = 2 * B * D * E + 2 * pairs * expert_w + 2 * B * shared_w
        # decode (moe_decode): the router with the add + norm, gate/up, down (the shared
        # experts and the top-k sum in them); at one row all of it in one launch (gluon_moe,
        # its router in it where the routing fits); more pairs: the router, sort / align, two
        # grouped GEMMs, silu, sum, the shared MLP and its add
        one_row = (B == 1 and layer_unfit(
            k, D, cfg.moe_intermediate_size // lay.tpf,
            cfg.moe_intermediate_size * cfg.num_shared_experts // n, round(w_es), es) is None)
        kernels = (((1 if route_fits(E, route_spec(cfg).groups) else 2) if one_row else 3)
                   if decode_kernels(B * k) else 1 + 6 + (4 if shared_w else 0))
        out.append(Phase("moe", moe_layers, nbytes, flops, kernels, reduce))
    return out


def step_cost(cfg: ModelConfig, layout: Layout, batch: int, context: int, dtype_bytes: int = 2,
              page_size: int = 16, kv_bytes: int | None = None,
              weight_es: float | None = None) -> StepCost:
    """Per-phase cost of one decode step on the busiest rank. `context`: KV positions each
    request attends over; `page_size` only rounds capacity (bytes read are positions);
    `kv_bytes`: bytes of a cached KV element (None: dtype_bytes; 1 for an fp8 cache);
    `weight_es`: of a projection's or expert's weight element (None: dtype_bytes; fp8 weights:
    helix.layers.fp8.element_bytes)."""
    es, n, D, V = dtype_bytes, layout.world_size, cfg.hidden_size, cfg.vocab_size
    w_es = weight_es or es
    B = batch
    (proj, att, o_proj), pos_bytes, norm_kernels = _attention(cfg, layout, B, context, es,
                                                             page_size, kv_bytes or es, w_es)
    shard = -(-V // n)                                   # vocab rows per rank
    # token select, embedding rows (+ vocab-parallel mask and add), layer 0's input norm where
    # the other layers' ride in their GEMMs (attn_proj counts one a layer otherwise)
    first_norm = 1 - norm_kernels
    embed = Phase("embed", 1, B * D * es, 0, (2 if n == 1 else 4) + first_norm,
                  _world_comm("all_reduce", n, B * D * es))
    # final norm, LM-head GEMM, fp32 cast, (all-gather re-layout), argmax over B x V fp32 logits
    lm = Phase("lm_head", 1, D * es + shard * D * es + B * V * 4, 2 * B * D * shard,
               4 if n == 1 else 5, _world_comm("all_gather", n, B * shard * 4))
    phases = (embed, proj, att, o_proj, *_ffn_phases(cfg, layout, B, es, w_es), lm)
    return StepCost(phases=phases, weight_bytes=weight_bytes(cfg, layout, es, w_es),
                    kv_bytes_per_position=cfg.num_layers * pos_bytes,
                    meta={"batch": B, "context": context, "dtype_bytes": es,
                          "kv_bytes": kv_bytes or es, "weight_bytes": w_es,
                          "layout": layout.as_dict()})


def weight_bytes(cfg: ModelConfig, layout: Layout, dtype_bytes: int = 2,
                 weight_es: float | None = None) -> float:
    """Bytes of weights one rank holds (every expert it owns, read by a step or not). Biases
    other than the QKV bias (o_proj, MLP: a few KB, in no preset) are left out. weight_es: bytes
    of a projection's or expert's element (step_cost's)."""
    es, n, D, H = dtype_bytes, layout.world_size, cfg.hidden_size, cfg.num_heads
    w_es = weight_es or es
    hq = H // layout.tpa
    if cfg.is_mla:
        lora, rope, nope, v = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                               cfg.v_head_dim)
        qk = nope + rope
        ql = cfg.q_lora_rank or 0
        projs = ((D * ql + ql * hq * qk if ql else D * hq * qk) + D * (lora + rope)
                 + (H // n) * v * D)
        attn = (ql + lora + hq * (nope + v) * lora) * es + projs * w_es
    else:
        d = cfg.head_dim
        kv0, kv1 = kv_head_range(cfg, layout.tpa, 0)
        qkv_cols = (hq + 2 * (kv1 - kv0)) * d
        attn = ((D * qkv_cols + (H // n) * d * D) * w_es
                + ((2 * d if cfg.qk_norm else 0) + (qkv_cols if cfg.qkv_bias else 0)) * es)
    attn += 2 * D * es                                   # input and post-attention norms
    moe_layers = sum(cfg.moe_layers) if cfg.is_moe else 0
    dense = 3 * D * (cfg.intermediate_size // n)
    total_bytes = cfg.num_layers * attn + (cfg.num_layers - moe_layers) * dense * w_es
    if moe_layers:
        E = cfg.num_experts
        experts = (E // layout.ep) * 3 * D * (cfg.moe_intermediate_size // layout.tpf)
        shared = 3 * D * (cfg.moe_intermediate_size * cfg.num_shared_experts // n)
        router = E * D * (4 if cfg.arch.startswith("deepseek") else es)
        router += E * 4 if cfg.scoring == "sigmoid" else 0   # fp32 correction bias
        total_bytes += moe_layers * ((experts + shared) * w_es + router)
    shard = -(-cfg.vocab_size // n)
    heads = 1 if cfg.tie_embeddings else 2
    return total_bytes + (heads * shard * D + D) * es    # embedding, LM head, final norm
