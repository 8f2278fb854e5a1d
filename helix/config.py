"""Typed, validated configuration: the model (parsed once from a HF config.json or a preset), the
parallel layout (named axes kvp, tpa, tpf, ep) and the runtime settings.

Every field carries a one-line doc; invalid values fail here, once, with a message naming the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from helix.errors import ConfigError
from helix.kv.quant import KV_CACHE_DTYPES, cache_dtype

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",          # Llama's layers; a sliding window caps the context
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash-attn")
# weights in memory: the checkpoint's own (auto), fp8 (quantized at load) or none (dequantized)
QUANTIZATIONS = ("auto", "fp8", "none")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0                 # base wavelength
    rope_type: str = "default"             # default | llama3 | yarn | linear
    factor: float = 1.0                    # context extension factor (llama3, yarn, linear)
    low_freq_factor: float = 1.0           # llama3: wavelengths above orig/low are divided
                                           # by factor
    high_freq_factor: float = 4.0          # llama3: wavelengths below orig/high are kept
    original_max_position: int = 8192      # pre-extension context length (llama3, yarn)
    beta_fast: float = 32.0                # yarn: ramp boundary (extrapolation)
    beta_slow: float = 1.0                 # yarn: ramp boundary (interpolation)
    mscale: float = 0.0                    # yarn: numerator mscale of the cos/sin attention factor
    mscale_all_dim: float = 0.0            # yarn: denominator mscale; also the softmax-scale
                                           # correction
    attention_factor: float | None = None  # yarn: explicit cos/sin factor (overrides mscale)
    truncate: bool = True                  # yarn: round the correction range to whole dims
    adjacent_pairs: bool = False           # rotate pairs (2i, 2i+1) (DeepSeek) instead of halves


@dataclass(frozen=True)
class ModelConfig:
    arch: str                              # llama | qwen2 | qwen3 | qwen3_moe | deepseek_v2 |
                                           # deepseek_v3
    vocab_size: int                        # rows of the embedding and the LM head
    hidden_size: int                       # model width D
    num_layers: int                        # decoder layers
    num_heads: int                         # query heads H
    num_kv_heads: int                      # KV heads Hkv (GQA); 1 latent "head" for MLA
    head_dim: int                          # d of q/k/v (GQA); unused for MLA
    intermediate_size: int                 # dense FFN width
    rms_eps: float = 1e-6                  # RMSNorm epsilon
    max_position: int = 4096               # longest context the model supports
    tie_embeddings: bool = False           # LM head shares the embedding matrix
    qkv_bias: bool = False                 # bias on q/k/v projections (Qwen2)
    attention_bias: bool = False           # HF attention_bias: o_proj's bias (Llama; its q/k/v
                                           # biases are qkv_bias), and MLA's q_a / kv_a / o_proj
                                           # biases
    mlp_bias: bool = False                 # bias on the dense FFN projections
    qk_norm: bool = False                  # per-head RMSNorm on q and k (Qwen3)
    rope: RopeConfig = field(default_factory=RopeConfig)
    # MoE
    num_experts: int = 0                   # routed experts E (0 = dense model)
    experts_per_token: int = 0             # top-k
    moe_intermediate_size: int = 0         # width of one routed expert
    num_shared_experts: int = 0            # DeepSeek shared experts (one fused MLP of n * width)
    norm_topk_prob: bool = False           # renormalise the top-k weights to sum to one
    scoring: str = "softmax"               # router scores: softmax | sigmoid
    topk_method: str = "greedy"            # greedy | group_limited_greedy (V2) | noaux_tc (V3)
    n_group: int = 1                       # expert groups for group-limited routing
    topk_group: int = 1                    # groups kept per token
    routed_scaling_factor: float = 1.0     # scale on the routed experts' sum
    moe_layers: tuple[bool, ...] = ()      # per layer: True = MoE FFN, False = dense FFN
    # MLA (DeepSeek)
    q_lora_rank: int | None = None         # low-rank q projection (None: direct q_proj)
    kv_lora_rank: int = 0                  # latent width of the compressed KV (0 = not MLA)
    qk_nope_head_dim: int = 0              # per-head q/k dims without rope
    qk_rope_head_dim: int = 0              # per-head q/k rope dims (shared rope key)
    v_head_dim: int = 0                    # per-head value dims
    bos_token_id: int | None = None        # begin-of-sequence id
    eos_token_ids: tuple[int, ...] = ()    # ids that end a request unless ignore_eos
    quantization: str | None = None        # the checkpoint's weights: None (16/32-bit) | fp8
                                           # (e4m3, 128x128 block scales: helix/layers/fp8.py)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk dim), times the YaRN mscale_all_dim correction squared (DeepSeek)."""
        dim = self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim
        scale = dim ** -0.5
        r = self.rope
        if r.rope_type == "yarn" and r.mscale_all_dim and r.factor > 1:
            import math
            m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
            scale *= m * m
        return scale

    def with_layers(self, n: int) -> "ModelConfig":
        """Same widths, `n` layers (benchmarking a few full-width layers)."""
        if n < 1:
            raise ConfigError(f"layers override must be >= 1, got {n}")
        moe = tuple(self.moe_layers[i] if i < len(self.moe_layers) else self.moe_layers[-1]
                    for i in range(n)) if self.moe_layers else ()
        return dataclasses.replace(self, num_layers=n, moe_layers=moe)

    @staticmethod
    def from_hf(cfg: dict) -> "ModelConfig":
        from helix.hf_config import model_config_from_hf
        return model_config_from_hf(cfg)


def world_sizes(model: ModelConfig, most: int = 1024) -> list[int]:
    """The world sizes N the model's widths allow: N divides the query heads and the dense FFN
    width (TP over all N), and for MoE the shared-expert width; some kvp x tpa (and tpf x ep)
    split of N may still be refused by Layout.validate, which names the fix."""
    out = []
    for n in range(1, min(most, model.num_heads) + 1):
        widths = [model.num_heads, model.intermediate_size]
        if model.is_moe and model.num_shared_experts:
            widths.append(model.moe_intermediate_size * model.num_shared_experts)
        if all(w % n == 0 for w in widths):
            out.append(n)
    return out


@dataclass(frozen=True)
class Layout:
    """Helix layout of N ranks: attention in KVP x TP_A, FFN in TP_F x EP, over the same ranks.

    Rank r has kvp index r // tpa and tpa index r % tpa (TP_A neighbours are adjacent ranks);
    FFN: ep index r // tpf and tpf index r % tpf.
    """

    kvp: int = 1            # KV-parallel degree: the KV cache is split along the sequence
    tpa: int = 1            # attention tensor-parallel degree: KV heads split across ranks
    tpf: int | None = None  # FFN tensor-parallel degree (default: world // ep)
    ep: int = 1             # expert-parallel degree (each EP rank owns E / ep experts)
    kv_interleave: int = 1  # I: position p lives on KVP rank (p // I) % kvp

    def __post_init__(self):
        for name in ("kvp", "tpa", "ep", "kv_interleave"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"layout {name} must be a positive integer, got {v!r}")
        world = self.kvp * self.tpa
        if self.tpf is None:
            if world % self.ep:
                raise ConfigError(f"ep={self.ep} does not divide the world size kvp*tpa={world}: "
                                  f"choose ep among the divisors of {world}")
            object.__setattr__(self, "tpf", world // self.ep)
        if self.tpf < 1 or self.tpf * self.ep != world:
            raise ConfigError(f"tpf*ep = {self.tpf}*{self.ep} must equal kvp*tpa = {world}: "
                              f"set --tpf {world // self.ep if world % self.ep == 0 else 1}")

    @property
    def world_size(self) -> int:
        return self.kvp * self.tpa

    @property
    def is_tp_baseline(self) -> bool:
        return self.kvp == 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self, model: ModelConfig) -> None:
        """Check the layout against the model; raises ConfigError naming the fix."""
        n = self.world_size
        if n not in world_sizes(model):
            experts = f", expert width {model.moe_intermediate_size}" if model.is_moe else ""
            raise ConfigError(f"world size kvp*tpa={n} does not fit this model ({model.num_heads} "
                              f"query heads, FFN width {model.intermediate_size}{experts}"
                              f"): use one of {', '.join(map(str, world_sizes(model)))}")
        if model.is_mla:
            if self.tpa != 1 and self.kvp != 1:
                raise ConfigError(f"MLA has one latent KV head: use tpa=1 (got tpa={self.tpa}); "
                                  f"put all {n} ranks on kvp, or use the TP baseline kvp=1")
        else:
            hkv = model.num_kv_heads
            if self.kvp > 1 and (self.tpa > hkv or hkv % self.tpa):
                raise ConfigError(f"tpa={self.tpa} must divide the {hkv} KV heads: choose tpa "
                                  f"among the divisors of {hkv} and raise kvp instead")
            if self.kvp == 1 and hkv % self.tpa and self.tpa % hkv:
                raise ConfigError(f"tpa={self.tpa} and {hkv} KV heads: one must divide the other")
        if not model.is_moe and self.ep > 1:
            raise ConfigError(f"ep={self.ep} needs a mixture-of-experts model; {model.arch} is "
                              f"dense: drop --ep (its FFN runs TP over all {n} ranks)")
        if model.is_moe:
            if model.num_experts % self.ep:
                raise ConfigError(f"{model.num_experts} experts are not divisible by ep={self.ep}: "
                                  f"choose ep among the divisors of {model.num_experts}")
            if model.moe_intermediate_size % self.tpf:
                raise ConfigError(f"expert width {model.moe_intermediate_size} is not divisible by "
                                  f"tpf={self.tpf}: raise ep or change the layout")


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "cpu"            # cpu | cuda
    dtype: str = "float32"         # weights, activations and KV: float32 | bfloat16 | float16
    kv_cache_dtype: str = "auto"   # KV pool storage: auto (the dtype above) | fp8 (e4m3: half
                                   # of bf16's bytes, twice the positions; helix/kv/quant.py)
    quantization: str = "auto"     # weights: auto (the checkpoint's: fp8 checkpoints stay fp8)
                                   # | fp8 (16-bit weights quantized at load, 128x128 blocks)
                                   # | none (fp8 checkpoints dequantized; helix/layers/fp8.py)
    page_size: int = 16            # KV positions per page (per rank)
    max_context: int = 0           # longest prompt + generation per request (0: model max, <= 8192)
    max_batch: int = 64            # most requests running at once
    num_pages: int = 0             # KV pages per rank (0: sized from free memory, capped by what
                                   # max_batch full contexts need)
    memory_utilization: float = 0.0   # share of the device's memory (cpu: of the RAM available)
                                   # the process may fill, KV pool included (0: 0.9 cuda, 0.5 cpu)
    max_prefill_tokens: int = 0    # prompt tokens one step prefills while requests decode, in
                                   # chunks across requests (0: 8192 on cuda, 1024 on cpu)
    idle_prefill_tokens: int = 0   # ... in a step with no request decoding: nobody waits on it,
                                   # and fewer, longer chunks reach the first token sooner
                                   # (0: 32768 on cuda, max_prefill_tokens on cpu; never less
                                   # than max_prefill_tokens)
    attention_backend: str = "auto"   # auto (triton on cuda, torch on cpu) | torch | triton |
                                   # flash-attn
    prefill_cp: str = "auto"       # prompt chunks over KVP ranks: pass-kv (each rank projects the
                                   # positions it owns), pass-q (every rank all of them), or auto
                                   # (the cheaper message, helix/kv/context_parallel.py)
    cp_gather_mb: int = 1024       # pass-KV: largest gathered copy of one layer's KV (MB); above
                                   # it the KV passes around a ring of the KVP ranks (0: always)
    hopb: int = 1                  # HOP-B: decode batch in this many micro-batches, the exchange
                                   # of one overlapping the attention of the next (0: auto, 2
                                   # from 8 rows on; only with kvp > 1)
    seed: int = 0                  # random weights of presets; default sampling seed
    timeout_s: float = 300.0       # collective timeout: a dead rank ends the run with an error
    layers: int = 0                # run only the first n decoder layers (0: all; benchmarking)
    cuda_graphs: bool = True       # steps through per-bucket graphs (CPU: same path, eager)
    graph_buckets: tuple[int, ...] = ()   # batch buckets (empty: 1, 2, 4, 8, 16, 24, ... max_batch)
    graph_breaks: tuple[str, ...] = ()    # regions to run eagerly under graphs: attention, moe
    graph_eager: bool = False      # bucketed, padded graph path but no capture (debug: A/B vs
                                   # capture)
    prefill_graphs: bool | None = None    # steps with prompt chunks through per-bucket graphs too
                                   # (with cuda_graphs; None: on for cuda, off for cpu)
    prefill_graph_buckets: tuple[int, ...] = ()   # tokens a rank projects, per prefill graph
                                   # (empty: 16 ... 256 doubling, then 8 per octave; none past
                                   # the largest step, max_prefill_tokens + max_batch)
    overlap: bool | None = None    # prepare step N+1 on the host while step N runs on the device;
                                   # tokens are reported one step later (None: on for cuda)
    prefix_caching: bool = True    # keep the KV of full blocks of written tokens after their
                                   # request, and start a request whose tokens begin the same
                                   # way from it (helix/kv/prefix_cache.py)
    scheduling: str = "fcfs"       # fcfs: arrival order | priority: SamplingParams.priority
                                   # first, preempting lower priorities (runtime/scheduler.py)
    host_cache_gb: float = 0.0     # host memory per rank for cached blocks evicted from the
                                   # device pool (0: they are dropped; helix/kv/host_cache.py)
    speculative_tokens: int = 0    # speculative decoding: up to this many tokens guessed by
                                   # n-gram lookup and verified per step (the same tokens; 0:
                                   # off; helix/runtime/speculative.py; no overlap then)
    speculative_ngram: int = 3     # ... the longest suffix looked up (n-grams of 1 .. this)

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        parse_dtype(self.dtype)
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                              f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        for name, lo in (("page_size", 1), ("max_batch", 1), ("max_context", 0), ("num_pages", 0),
                         ("layers", 0), ("seed", 0), ("max_prefill_tokens", 0),
                         ("idle_prefill_tokens", 0),
                         ("cp_gather_mb", 0), ("hopb", 0), ("speculative_tokens", 0),
                         ("speculative_ngram", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        for name in ("timeout_s", "memory_utilization", "host_cache_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ConfigError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.host_cache_gb and not self.prefix_caching:
            raise ConfigError("host_cache_gb keeps the prefix cache's blocks: it needs "
                              "prefix_caching (drop --no-prefix-caching or --host-cache-gb)")
        if self.memory_utilization > 1:
            raise ConfigError(f"memory_utilization is a fraction in (0, 1], got "
                              f"{self.memory_utilization}")
        unknown = set(self.graph_breaks) - {"attention", "moe"}
        if unknown:
            raise ConfigError(f"unknown graph break(s) {', '.join(sorted(unknown))}: "
                              f"use attention, moe")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.graph_buckets):
            raise ConfigError("graph buckets must be positive batch sizes")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1
               for b in self.prefill_graph_buckets):
            raise ConfigError("prefill graph buckets must be positive token counts")
        if self.scheduling not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling must be fcfs or priority, got {self.scheduling!r}")
        if self.prefill_cp not in ("auto", "pass-kv", "pass-q"):
            raise ConfigError(f"prefill_cp must be auto, pass-kv or pass-q, "
                              f"got {self.prefill_cp!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                              f"got {self.attention_backend!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        """The dtype the KV pool is allocated in."""
        return cache_dtype(self.kv_cache_dtype, self.torch_dtype)

    @property
    def resolved_backend(self) -> str:
        """The attention backend `auto` stands for: Triton's kernels on CUDA, the torch
        reference elsewhere (Triton on CPU runs only through its interpreter)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.device == "cuda" else "torch"

    @property
    def resolved_overlap(self) -> bool:
        """Overlapped steps: on for cuda unless set; never with speculative decoding (a draft
        needs the request's last token on the host)."""
        if self.speculative_tokens:
            return False
        return self.device == "cuda" if self.overlap is None else bool(self.overlap)

    @property
    def resolved_prefill_graphs(self) -> bool:
        """Whether steps with prompt chunks replay graphs (only with cuda_graphs)."""
        on = self.device == "cuda" if self.prefill_graphs is None else bool(self.prefill_graphs)
        return self.cuda_graphs and on

    @property
    def resolved_memory_utilization(self) -> float:
        return self.memory_utilization or (0.9 if self.device == "cuda" else 0.5)

    @property
    def resolved_max_prefill_tokens(self) -> int:
        return self.max_prefill_tokens or (8192 if self.device == "cuda" else 1024)

    @property
    def resolved_idle_prefill_tokens(self) -> int:
        idle = self.idle_prefill_tokens or (32768 if self.device == "cuda" else 0)
        return max(idle, self.resolved_max_prefill_tokens)

    @property
    def step_tokens(self) -> int:
        """The most tokens one step feeds the model (sizes buffers and the activation
        reserve)."""
        return self.max_batch + self.resolved_idle_prefill_tokens

    def resolved_max_context(self, model: ModelConfig) -> int:
        return self.max_context or min(model.max_position, 8192)
