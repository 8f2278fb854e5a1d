"""An attention layer's input: its one input projection (a MergedColumnLinear: qkv, or MLA's
q + kv_a), with the decoder layer's input norm in the projection's launch where it can be.

    forward(x, pos, meta, cache, backend, ctx)                       -> [T, D]
    add_norm_forward(h, residual, norm, pos, meta, cache, backend, ctx)
        -> (forward(norm(residual + h)), residual + h)

Both end in the layer's attend_projected(y, pos, T, meta, cache, backend, ctx), y being the
projection's joint output for the rows this rank projects. Under a pass-KV plan (meta.cp) a
rank projects only the rows it owns (meta.cp.rows), so the norm runs first, on all rows;
otherwise the add + norm go into the projection (skinny_gemm.add_norm_linear: one GEMV launch
at one or two rows on CUDA, the norm kernel then the GEMM elsewhere).
"""

from __future__ import annotations

from helix.tracing import phase


class NormedInput:
    """Mixin of GQAAttention and MLAAttention; the class sets `in_proj` (its
    MergedColumnLinear) and defines attend_projected."""

    def forward(self, x, pos, meta, cache, backend, ctx=None):
        """x [T, D] replicated (normed), pos [T] -> [T, D] replicated. With a pass-KV plan
        (meta.cp) this rank projects only the decode rows and the chunk positions it owns."""
        T = x.shape[0]
        if meta.cp is not None:
            x, pos = x[meta.cp.rows], pos[meta.cp.rows]
        with phase("qkv"):
            y = self.in_proj.joint(x)
        return self.attend_projected(y, pos, T, meta, cache, backend, ctx)

    def add_norm_forward(self, h, residual, norm, pos, meta, cache, backend, ctx=None):
        """-> (forward(norm(residual + h)), residual + h), the add + norm in the input
        projection's launch where it can be."""
        if meta.cp is not None:
            x, residual = norm.add_forward(h, residual)
            return self.forward(x, pos, meta, cache, backend, ctx), residual
        with phase("qkv"):
            y, residual = self.in_proj.add_norm_joint(h, residual, norm)
        return self.attend_projected(y, pos, h.shape[0], meta, cache, backend, ctx), residual
