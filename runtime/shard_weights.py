"""One rank's TargetWeights cut from the whole model's, by the ParallelPlan (build_pipeline/plan.py).

For a model directory: every rank streams the checkpoint and keeps its slice (fine for the tiny
models and for tests; a real model goes through `kdtree build`, whose artifact stores each rank's
slice so a rank reads only its own files: runtime/artifact.load_rank).  Both give the same tensors.

Letters: h heads (h_l = h/tp), p qk_nope, r rope, u v_head_dim, c latent, d hidden, i intermediate,
e experts, v vocab.
"""

from __future__ import annotations

import torch

from build_pipeline.config import ModelConfig
from build_pipeline.plan import ParallelPlan
from runtime.weights import AttentionWeights, LayerWeights, MLPWeights, MoEWeights, TargetWeights


def shard_target_weights(cfg: ModelConfig, plan: ParallelPlan, w: TargetWeights, rank: int) -> TargetWeights:
    """Rank `rank`'s weights under `plan` (replicated tensors are shared, not copied)."""
    plan.validate(cfg)
    if plan.tp == 1:
        return w
    layers = []
    for li, lw in enumerate(w.layers):
        pre = f"layers.{li}."
        a = lw.attn
        q_key = pre + ("attn.q_b" if cfg.q_lora_rank is not None else "attn.q")
        attn = AttentionWeights(
            q_a=a.q_a, q_a_norm=a.q_a_norm, kv_a=a.kv_a, kv_a_norm=a.kv_a_norm,
            q_b=plan.shard(q_key, a.q_b, rank),  # [h_l*(p+r), q]
            w_uk=_heads(plan, a.w_uk, rank),  # [h_l, p, c]
            w_uv=_heads(plan, a.w_uv, rank),  # [h_l, u, c]
            o=plan.shard(pre + "attn.o", a.o, rank),  # [d, h_l*u]
        )
        if isinstance(lw.mlp, MoEWeights):
            m = lw.mlp
            mlp: MLPWeights | MoEWeights = MoEWeights(
                gate=m.gate, gate_bias=m.gate_bias,
                w13=_gate_up(plan, pre + "moe.w13", m.w13, rank, dim=1),  # [e or e_l, 2*i_l or 2i, d]
                w2=plan.shard(pre + "moe.w2", m.w2, rank),  # [e, d, i_l] or [e_l, d, i]
                shared=_mlp(plan, pre + "moe.shared.", m.shared, rank) if m.shared is not None else None,
                # the packed kernel layout is not cut here: the CUDA path reads the dense slice
                # (a `kdtree build` artifact carries each rank's packed experts)
                int4=None)
        else:
            mlp = _mlp(plan, pre + "mlp.", lw.mlp, rank)
        layers.append(LayerWeights(lw.attn_norm, attn, lw.mlp_norm, mlp))
    embed = plan.shard("embed", w.embed, rank)  # [v/tp, d]
    lm_head = embed if w.lm_head is w.embed else plan.shard("lm_head", w.lm_head, rank)
    return TargetWeights(embed=embed, layers=layers, norm=w.norm, lm_head=lm_head)


def _heads(plan: ParallelPlan, t: torch.Tensor, rank: int) -> torch.Tensor:
    """[h, ...] -> this rank's [h_l, ...] (the kv_b split by head, in its absorbed W_UK / W_UV form)."""
    per = t.shape[0] // plan.tp
    return t[rank * per:(rank + 1) * per].contiguous()


def _mlp(plan: ParallelPlan, pre: str, m: MLPWeights, rank: int) -> MLPWeights:
    return MLPWeights(gate_up=_gate_up(plan, pre + "gate", m.gate_up, rank, dim=0),  # [2*i_l, d]
                      down=plan.shard(pre + "down", m.down, rank))  # [d, i_l]


def _gate_up(plan: ParallelPlan, key: str, t: torch.Tensor, rank: int, dim: int) -> torch.Tensor:
    """gate rows | up rows stacked on `dim`: cut each half by the plan and re-stack (gate_l | up_l).
    Under ep the stacked experts are cut on dim 0 instead and the halves stay whole."""
    if plan.rule(key).kind == "experts":
        return plan.shard(key, t, rank)
    gate, up = t.chunk(2, dim=dim)
    cut = dim  # the rows of gate / up are what the plan splits (gate/up: split 0 per expert)
    per = gate.shape[cut] // plan.tp
    return torch.cat([gate.narrow(cut, rank * per, per), up.narrow(cut, rank * per, per)], dim=cut).contiguous()
