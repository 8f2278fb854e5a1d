"""Exact combination of partial attention results from KVP ranks.

pack_partials puts O and LSE into ONE send buffer per destination (the LSE's fp32 bits ride in
the O dtype's last columns), so the exchange is one all-to-all. merge_partials applies
L = logsumexp_j LSE_j, O = sum_j exp(LSE_j - L) O_j; a partial with LSE = -inf (empty shard)
contributes nothing, and all-empty rows give O = 0, never NaN.
"""

from __future__ import annotations

import torch


def lse_cols(dtype: torch.dtype) -> int:
    """Columns of `dtype` that hold one fp32 LSE in the packed exchange buffer."""
    return max(1, 4 // torch.empty((), dtype=dtype).element_size())


def pack_partials(o: torch.Tensor, lse: torch.Tensor, n: int) -> torch.Tensor:
    """o [T, H, d], lse [T, H] fp32 -> send [n, T, H/n, d + c]: head chunk j goes to rank j."""
    T, H, d = o.shape
    c = lse_cols(o.dtype)
    buf = torch.empty((T, H, d + c), dtype=o.dtype, device=o.device)
    buf[..., :d] = o
    lse = lse.float().contiguous()
    buf[..., d:] = lse.view(o.dtype).view(T, H, c) if c > 1 else lse.unsqueeze(-1).to(o.dtype)
    return buf.view(T, n, H // n, d + c).transpose(0, 1).contiguous()


def unpack_partials(recv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """recv [n, T, h, d + c] -> (o [n, T, h, d], lse [n, T, h] fp32)."""
    c = recv.shape[-1] - d
    o = recv[..., :d]
    tail = recv[..., d:].contiguous()
    lse = tail.view(torch.float32).squeeze(-1) if c > 1 else tail.squeeze(-1).float()
    return o, lse


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o [n, T, h, d], lse [n, T, h] fp32 -> (o [T, h, d] in o.dtype, lse [T, h] fp32)."""
    ninf = float("-inf")
    lse = torch.nan_to_num(lse.float(), nan=ninf, posinf=ninf, neginf=ninf)
    total = torch.logsumexp(lse, dim=0)                                   # [T, h]
    finite = torch.isfinite(total)
    w = torch.exp(lse - torch.where(finite, total, torch.zeros_like(total)))  # -inf parts -> 0
    out = (w.unsqueeze(-1) * o.float()).sum(0)
    return out.to(o.dtype), total
