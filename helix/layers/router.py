"""MoE routers, replicated on every rank (all ranks compute the same choice).

softmax top-k (Qwen3-MoE, DeepSeek-V2 greedy), DeepSeek-V2 group-limited greedy, and DeepSeek-V3
sigmoid scoring with e_score_correction_bias and group-limited top-k (noaux_tc).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helix.config import ModelConfig
from helix.layers.weights import load_full


def _group_mask(scores: torch.Tensor, n_group: int, topk_group: int, v3: bool) -> torch.Tensor:
    """[T, E] scores -> [T, E] bool: experts in each token's best `topk_group` groups."""
    T, E = scores.shape
    grouped = scores.view(T, n_group, E // n_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1) if v3 else grouped.max(-1).values
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    return keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.float32):
        super().__init__()
        self.cfg = cfg
        # DeepSeek keeps the router in fp32; Qwen3-MoE in the model dtype
        wdtype = torch.float32 if cfg.arch.startswith("deepseek") else dtype
        self.weight = nn.Parameter(torch.zeros((cfg.num_experts, cfg.hidden_size), dtype=wdtype),
                                   requires_grad=False)
        self.weight.weight_loader = load_full
        if cfg.scoring == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts),
                                                        requires_grad=False)
            self.e_score_correction_bias.weight_loader = load_full

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] in x.dtype, expert ids [T, k])."""
        c = self.cfg
        logits = F.linear(x.to(self.weight.dtype), self.weight).float()
        k = c.experts_per_token
        if c.scoring == "sigmoid":                      # DeepSeek-V3
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias.float()
            if c.n_group > 1:
                choice = choice.masked_fill(~_group_mask(choice, c.n_group, c.topk_group, True),
                                            float("-inf"))
            ids = choice.topk(k, dim=-1).indices
            w = scores.gather(1, ids)
            if c.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * c.routed_scaling_factor
        else:
            scores = logits.softmax(dim=-1)
            if c.topk_method == "group_limited_greedy":
                scores = scores.masked_fill(~_group_mask(scores, c.n_group, c.topk_group, False), 0.0)
            w, ids = scores.topk(k, dim=-1)
            if c.norm_topk_prob:
                w = w / w.sum(-1, keepdim=True)
            w = w * c.routed_scaling_factor
        return w.to(x.dtype), ids
