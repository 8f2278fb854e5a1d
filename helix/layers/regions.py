"""Named regions of the decode step that CUDA graph capture may leave eager ("breaks").

`region(ctx, name, fn)` runs fn() inline when there is no graph context or the break `name` is
not enabled; otherwise the captured segment ends, fn runs eagerly at every replay, and capture
continues. fn must only read tensors at fixed addresses (static inputs, earlier outputs) and
return the tensors later code reads. Names in use: "attention" (partial attention, and the KV
append where the layer does not fold it into an earlier launch: without context parallelism
MLA's absorbed steps append in the captured kv-row kernel, GQA in the captured rotation kernel,
fused_qk_norm.rope_append), "moe" (routed experts; at one row on sm_90 also the router and
its add + norm, which ride in the experts' launch: MoE._routed_row).
"""

from __future__ import annotations

from collections.abc import Callable


def region(ctx, name: str, fn: Callable):
    return fn() if ctx is None else ctx.graph_break(name, fn)
