"""The target model's weights, grouped the way the forward pass uses them (filled by runtime/load/).

Shape vocabulary: d hidden, h heads, p qk_nope dims, r rope dims, c kv_lora_rank (latent),
u v_head_dim, q q_lora_rank, i intermediate, e routed experts, v vocab.
MLA is kept in its weight-absorbed form: kv_b [h*(p+u), c] is split (by build_pipeline/shard.py) into
w_uk [h, p, c] (q_nope -> latent) and w_uv [h, u, c] (latent -> value heads).  Under TP every
tensor is this rank's cut (h, i, e, v local).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class AttentionWeights:
    q_a: torch.Tensor | None  # [q, d]   (None when q_lora_rank is null)
    q_a_norm: torch.Tensor | None  # [q]
    q_b: torch.Tensor  # [h*(p+r), q] or, without q_lora, q_proj [h*(p+r), d]
    kv_a: torch.Tensor  # [c+r, d]
    kv_a_norm: torch.Tensor  # [c]
    w_uk: torch.Tensor  # [h, p, c]
    w_uv: torch.Tensor  # [h, u, c]
    o: torch.Tensor  # [d, h*u]

    def latent_inputs(self) -> torch.Tensor | None:
        """[q+c+r, d]: q_a and kv_a as one matrix when they are consecutive rows of one tensor (as
        runtime/load/artifact.assemble_weights holds them), so x multiplies both in one GEMM; else None."""
        return stacked(self.q_a, self.kv_a)


def stacked(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """[m+k, d]: a [m, d] and b [k, d] as one matrix when they are consecutive rows of one tensor (as
    runtime/load/artifact.stack_rows holds them), else None."""
    if a is None or b is None or not (a.is_contiguous() and b.is_contiguous()) or a.dtype != b.dtype \
            or a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() \
            or b.storage_offset() != a.storage_offset() + a.numel() or a.shape[1] != b.shape[1]:
        return None
    return torch.as_strided(a, (a.shape[0] + b.shape[0], a.shape[1]), (a.shape[1], 1))


@dataclass
class MLPWeights:
    gate_up: torch.Tensor  # [2i, d]  gate rows then up rows
    down: torch.Tensor  # [d, i]


@dataclass
class Experts:
    """The routed experts a rank holds, once, in the form the kdtree::moe_w4a16 op reads: INT4 in one of the
    op's kernel layouts with scales (fragment order, plugins/moe_w4a16/fragment_layout.py, for v3; planar,
    layout.py, for the Triton path; kp_x = x rounded up to 256), or dense (scales None: bf16 /
    FP8-dequantised checkpoints).  The CPU reference dequantises INT4 per call; no dequantised copy is ever
    held (at K2.6 TP8 it would be ~250 GB per rank)."""

    w13: torch.Tensor  # INT4 [e_l, 2i/32, kp_d/32, 32, 4] | [e_l, 2i, kp_d/8] int32 | dense [e_l, 2i, d]
    w13_scale: torch.Tensor | None  # [e_l, 2i/32, kp_d/32, 8, 4] | [e_l, kp_d/32, 2i]
    w2: torch.Tensor  # INT4 [e_l, d/32, kp_i/32, 32, 4] | [e_l, d, kp_i/8] int32 | dense [e_l, d, i]
    w2_scale: torch.Tensor | None  # [e_l, d/32, kp_i/32, 8, 4] | [e_l, kp_i/32, d]

    @property
    def count(self) -> int:
        return self.w13.shape[0]


@dataclass
class MoEWeights:
    gate: torch.Tensor  # [e, d] router: as stored when that is the model dtype (bf16), else >= fp32
    gate_bias: torch.Tensor  # [e] fp32 e_score_correction_bias
    experts: Experts  # this rank's routed experts (whole under ep, intermediate-sliced under tp)
    shared: MLPWeights | None

    def router_inputs(self) -> torch.Tensor | None:
        """[e+2i, d]: the router and the shared expert's gate_up as one matrix when they are consecutive rows of
        one tensor (runtime/load/artifact.assemble_weights stacks them when their dtypes agree), so the MoE
        input multiplies both in one GEMM; else None."""
        return stacked(self.gate, self.shared.gate_up if self.shared is not None else None)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [d]
    attn: AttentionWeights
    mlp_norm: torch.Tensor  # [d]
    mlp: MLPWeights | MoEWeights


@dataclass
class TargetWeights:
    embed: torch.Tensor  # [v, d]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [d]
    lm_head: torch.Tensor  # [v, d]


def tensors_of(obj) -> Iterator[torch.Tensor]:
    """Every tensor held by a weights dataclass (or list of them), depth first in field order; a tensor
    held twice (tied embeddings) is yielded twice."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_of(o)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from tensors_of(getattr(obj, f.name))
