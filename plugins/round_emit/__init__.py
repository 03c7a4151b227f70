"""round_emit: what a decode round emits, per request (stop tokens, max_new, the host row); see reference.py."""

from __future__ import annotations

import torch

from plugins.common.op import kdtree_op
from plugins.round_emit.reference import round_emit_reference

__all__ = ["round_emit", "round_emit_op"]


def round_emit(cand: torch.Tensor, count: torch.Tensor, stop_ids: torch.Tensor, produced: torch.Tensor,
               max_new: torch.Tensor, live: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor,
               bonus: torch.Tensor | None = None) -> None:
    """Emit the round's tokens (reference.py): updates produced, live, out (and, AR, count and bonus)."""
    # every argument passed explicitly: torch 2.11's mutation bookkeeping indexes the given args only
    round_emit_op(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus)


@kdtree_op("round_emit", mutates_args=("count", "produced", "live", "out", "bonus"))
def round_emit_op(cand: torch.Tensor, count: torch.Tensor, stop_ids: torch.Tensor, produced: torch.Tensor,
                  max_new: torch.Tensor, live: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor,
                  bonus: torch.Tensor | None) -> None:
    """The registered op (call round_emit()); the reference on every device but CUDA."""
    _check(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus)
    round_emit_reference(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus)


@round_emit_op.register_kernel("cuda")
def _round_emit_cuda(cand: torch.Tensor, count: torch.Tensor, stop_ids: torch.Tensor, produced: torch.Tensor,
                     max_new: torch.Tensor, live: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor,
                     bonus: torch.Tensor | None) -> None:
    _check(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus)
    from plugins.round_emit.kernel import round_emit_triton
    round_emit_triton(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus)


def _check(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus) -> None:
    if cand.dim() != 2 or cand.dtype != torch.int64 or cand.stride(1) != 1:
        raise ValueError(f"round_emit: cand must be int64 [b, a] with unit stride along a, got {cand.dtype} "
                         f"{tuple(cand.shape)} {cand.stride()}")
    b, a = cand.shape
    for name, t, dt in (("count", count, torch.int32), ("produced", produced, torch.int32),
                        ("max_new", max_new, torch.int32), ("live", live, torch.int32),
                        ("nonfinite", nonfinite, torch.int64), ("bonus", bonus, torch.int64)):
        if t is not None and (t.shape != (b,) or t.dtype != dt):
            raise ValueError(f"round_emit: {name} must be {dt} [{b}], got {t.dtype} {tuple(t.shape)}")
    if stop_ids.dim() != 2 or stop_ids.shape[0] != b or stop_ids.dtype != torch.int64 or stop_ids.stride(1) != 1:
        raise ValueError(f"round_emit: stop_ids must be int64 [{b}, S], got {stop_ids.dtype} {tuple(stop_ids.shape)}")
    if out.dim() != 2 or out.shape[0] != b or out.shape[1] < a + 4 or out.dtype != torch.int64 or out.stride(1) != 1:
        raise ValueError(f"round_emit: out must be int64 [{b}, >= {a + 4}], got {out.dtype} {tuple(out.shape)}")
    if bonus is not None and a != 1:
        raise ValueError(f"round_emit: an AR round (bonus given) has one candidate per request, got {a}")
