"""Reference (torch, CPU and CUDA) for the routed MoE: noaux_tc routing and the expert FFNs.

Shapes: t tokens, d hidden, e experts, k experts per token, i expert intermediate, g groups.

route:  logits [t, e] fp32 (x @ gate^T), bias [e] fp32 (e_score_correction_bias)
        -> topk_idx [t, k] int64, topk_w [t, k] fp32
  scores = sigmoid(logits); choice = scores + bias;
  n_group > 1: group score = sum of the top-2 choices in the group; keep the topk_group best groups;
  pick the k best choices among kept experts; weights = scores of the picked experts
  (unbiased), normalised to sum 1 if norm_topk_prob, times routed_scaling_factor.

experts: x [t, d], topk_idx, topk_w, w13 [e, 2i, d] (gate rows | up rows), w2 [e, d, i]
        -> y [t, d] = sum_k topk_w[t, k] * w2[e] @ (silu(gate_e x) * up_e x),  e = topk_idx[t, k]
  accumulated expert by expert in ascending expert order (transformers' order), in x's dtype with
  fp32 routing weights.  Expert parallel: w13/w2 hold only experts [e_start, e_start + e_local);
  slots routed to other experts contribute nothing (the ranks' outputs are summed by an all-reduce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.common.precision import acc


def route_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                    norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    t, e = logits.shape
    scores = acc(logits).sigmoid()  # [t, e]
    choice = scores + bias.to(scores.dtype)  # [t, e]
    if n_group > 1:
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [t, g]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1.0)  # [t, g]
        allowed = keep.bool().unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        choice = choice.masked_fill(~allowed, float("-inf"))
    topk_idx = choice.topk(top_k, dim=-1)[1]  # [t, k]
    topk_w = scores.gather(1, topk_idx)  # [t, k]
    if norm_topk_prob:
        topk_w = topk_w / (topk_w.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_idx, topk_w * scaling


def experts_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, e_start: int = 0) -> torch.Tensor:
    y = torch.zeros_like(x)  # [t, d]
    e_local = w13.shape[0]
    for ex in torch.unique(topk_idx).tolist():
        if not e_start <= ex < e_start + e_local:
            continue  # held by another rank
        tok, slot = torch.where(topk_idx == ex)  # rows routed to expert ex
        gate, up = F.linear(x[tok], w13[ex - e_start]).chunk(2, dim=-1)  # [m, i] each
        h = F.linear(F.silu(gate) * up, w2[ex - e_start])  # [m, d]
        y.index_add_(0, tok, (h * topk_w[tok, slot, None]).to(y.dtype))
    return y


def shared_down_reference(y: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [t, d] + h [t, i'] . w [d, i']^T: the shared expert's down projection accumulated into the routed output,
    as a GEMM with beta = 1 does it (products summed in fp32, fp64 for fp64, y added, one rounding to y's dtype;
    same dtypes: torch's addmm, in place on y, as the runtime's linear(h, w, c=y) did before the op took it in)."""
    if y.dtype == h.dtype == w.dtype:
        return y.addmm_(h, w.t())
    return (F.linear(acc(h), acc(w)) + acc(y)).to(y.dtype)
