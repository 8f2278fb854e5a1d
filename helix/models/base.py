"""The decoder stack shared by every family: embed -> L x (attention, FFN) -> norm -> LM head.
Module names follow the Hugging Face checkpoints, so parameter names are checkpoint names."""

from __future__ import annotations

from torch import nn

from helix.config import ModelConfig
from helix.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from helix.layers.norm import RMSNorm
from helix.parallel.comm import Comm
from helix.tracing import phase


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)
        self.mlp = mlp
        self.ffn_phase = "moe" if type(mlp).__name__ == "MoE" else "ffn"

    def forward(self, h, pos, meta, cache, backend, ctx=None, residual=None):
        """-> (out, residual): this layer's hidden state is out + residual. The residual adds are
        left to the next norm, which fuses them (RMSNorm.add_forward: one kernel on CUDA), and
        the norm to its consumer where that launch can take it (the attention's input
        projection, the router, the MLP's gate/up: their add_norm_forward): residual=None
        means h is the whole hidden state (the first layer)."""
        if residual is None:
            a = self.self_attn(self.input_layernorm(h), pos, meta, cache, backend, ctx)
            residual = h
        else:                             # the input projection's launch can take the add + norm
            a, residual = self.self_attn.add_norm_forward(h, residual, self.input_layernorm, pos,
                                                          meta, cache, backend, ctx)
        with phase(self.ffn_phase):       # the router's or gate/up's launch: likewise
            return self.mlp.add_norm_forward(a, residual, self.post_attention_layernorm, ctx)


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, layers: list[DecoderLayer], dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, dtype)


class CausalLM(nn.Module):
    """forward(ids [T], pos [T], meta, caches, backend, last [S]) -> logits [S, V] fp32.
    last: the row of each sequence's last token, or None when every row is one (decode).
    ctx: the graph context of a captured decode step (named eager regions), or None."""

    def __init__(self, cfg: ModelConfig, comm: Comm, layers: list[DecoderLayer], dtype):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg, comm, layers, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, comm, dtype,
                                      tied=self.model.embed_tokens if cfg.tie_embeddings else None)

    def kv_cache_shapes(self, num_pages: int, page_size: int) -> list[list[tuple[int, ...]]]:
        return [layer.self_attn.kv_cache_shape(num_pages, page_size) for layer in self.model.layers]

    def forward(self, ids, pos, meta, caches, backend, last, ctx=None):
        return self.head(*self.hidden(ids, pos, meta, caches, backend, ctx), last)

    def hidden(self, ids, pos, meta, caches, backend, ctx=None):
        """-> (h, residual) [T, D]: the last layer's output and the residual it is still to be
        added to (None without layers). A captured prefill step ends here (helix/runtime/
        prefill_graphs.py): the head's row count is the step's sequence count."""
        h = self.model.embed_tokens(ids)
        residual = None
        for layer, cache in zip(self.model.layers, caches):
            h, residual = layer(h, pos, meta, cache, backend, ctx, residual)
        return h, residual

    def head(self, h, residual, last):
        """The final norm and the LM head of rows `last` (None: every row) -> logits [S, V]."""
        if last is not None and residual is None:
            h = self.model.norm(h[last])
        elif last is not None and 4 * last.shape[0] < h.shape[0]:   # prefill: gather first
            h = self.model.norm.add_forward(h[last], residual[last])[0]
        else:                                   # decode: add + norm in one kernel, then gather
            h = self.model.norm.add_forward(h, residual)[0]
            h = h if last is None else h[last]
        return self.lm_head(h)
