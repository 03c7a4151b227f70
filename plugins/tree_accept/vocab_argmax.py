"""vocab_argmax: the target's greedy token when each rank holds a slice of the vocabulary (TP at T = 0).

Each rank reduces its slice to one (max, first index of it) pair per row, the ranks all-gather the pairs
(16 bytes per row instead of V / tp logits) and every rank picks the best, ties to the lowest id, as
torch.argmax over the whole vocabulary would (runtime/model/target.TargetModel.greedy).  Two ops, one launch
each on CUDA (the Triton kernels of vocab_argmax_kernel.py), instead of ~13 torch kernels a round (the
padding fill, max, the pair's casts and stack, the cross-rank argmax, two gathers, a cast, and the
non-finite guard's isfinite / not / any / copy):

  vocab_argmax_local(local [R, V_l] float, valid, start, pair [R, 2] fp64): pair[r] = (max of local[r, :valid],
      start + the first column holding it); columns >= valid (the vocabulary's padding rows, core/plan.py)
      never win; a NaN makes the max NaN (as torch.max).  Exact in fp64 (ids < 2^53, logits fp32).
  vocab_argmax_pick(every [W, R, 2] fp64, ids [R] int64, flag [b] int64): ids[r] = every[w*, r, 1] for the
      lowest rank w* with the largest max; flag[q] = 1 when a row of request q (rows q*R/b .. (q+1)*R/b) has a
      NaN or +-Inf as its best logit (the round's non-finite guard, runtime/decode/round.py), else 0.
The token of a flagged row is unspecified (the request stops there).
"""

from __future__ import annotations

import torch

from plugins.common.op import kdtree_op

__all__ = ["vocab_argmax_local", "vocab_argmax_pick"]


def local_reference(local: torch.Tensor, valid: int, start: int) -> torch.Tensor:
    """local [R, V_l] -> pair [R, 2] fp64 (see the module doc)."""
    best, idx = local[:, :valid].double().max(dim=-1)  # [R] first occurrence of the maximum
    return torch.stack([best, (idx + start).double()], dim=-1)


def pick_reference(every: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """every [W, R, 2] fp64 -> (ids [R] int64, flag [b] int64) (see the module doc)."""
    rank = every[..., 0].argmax(dim=0, keepdim=True)  # [1, R] the lowest rank among equal maxima
    ids = every[..., 1].gather(0, rank)[0].long()
    best = every[..., 0].gather(0, rank)[0]  # [R]
    return ids, (~torch.isfinite(best)).view(b, -1).any(1).long()


@kdtree_op("vocab_argmax_local", mutates_args=("pair",))
def vocab_argmax_local(local: torch.Tensor, valid: int, start: int, pair: torch.Tensor) -> None:
    """Writes pair [R, 2] fp64 from local [R, V_l] (see the module doc)."""
    _check_local(local, valid, pair)
    pair.copy_(local_reference(local, valid, start))


@vocab_argmax_local.register_kernel("cuda")
def _local_cuda(local: torch.Tensor, valid: int, start: int, pair: torch.Tensor) -> None:
    import triton

    from plugins.common.pdl import pdl_args, pdl_for
    from plugins.tree_accept.vocab_argmax_kernel import vocab_argmax_local_kernel
    _check_local(local, valid, pair)
    rows = local.shape[0]
    if rows:
        vocab_argmax_local_kernel[(rows,)](local, pair, valid, start, local.stride(0),
                                           BLOCK_V=min(4096, max(16, triton.next_power_of_2(valid))), num_warps=8,
                                           **pdl_args(pdl_for(local)))


@kdtree_op("vocab_argmax_pick", mutates_args=("ids", "flag"))
def vocab_argmax_pick(every: torch.Tensor, ids: torch.Tensor, flag: torch.Tensor) -> None:
    """Writes ids [R] int64 and flag [b] int64 from every [W, R, 2] fp64 (see the module doc)."""
    _check_pick(every, ids, flag)
    got, bad = pick_reference(every, flag.shape[0])
    ids.copy_(got)
    flag.copy_(bad)


@vocab_argmax_pick.register_kernel("cuda")
def _pick_cuda(every: torch.Tensor, ids: torch.Tensor, flag: torch.Tensor) -> None:
    import triton

    from plugins.common.pdl import pdl_args, pdl_for
    from plugins.tree_accept.vocab_argmax_kernel import vocab_argmax_pick_kernel
    _check_pick(every, ids, flag)
    w, rows = every.shape[:2]
    b = flag.shape[0]
    if b:
        vocab_argmax_pick_kernel[(b,)](every, ids, flag, w, rows, rows // b,
                                       BLOCK_R=max(2, triton.next_power_of_2(rows // b)), num_warps=1,
                                       **pdl_args(pdl_for(every)))


def _check_local(local: torch.Tensor, valid: int, pair: torch.Tensor) -> None:
    if local.dim() != 2 or not local.dtype.is_floating_point or local.stride(1) != 1:
        raise ValueError(f"vocab_argmax_local: local must be floating [R, V_l] with unit stride along V_l, got "
                         f"{local.dtype} {tuple(local.shape)} {local.stride()}")
    if not 1 <= valid <= local.shape[1]:
        raise ValueError(f"vocab_argmax_local: valid must be in 1..{local.shape[1]}, got {valid}")
    if tuple(pair.shape) != (local.shape[0], 2) or pair.dtype != torch.float64 or not pair.is_contiguous() \
            or pair.device != local.device:
        raise ValueError(f"vocab_argmax_local: pair must be contiguous fp64 [{local.shape[0]}, 2] on {local.device}, "
                         f"got {pair.dtype} {tuple(pair.shape)} on {pair.device}")


def _check_pick(every: torch.Tensor, ids: torch.Tensor, flag: torch.Tensor) -> None:
    if every.dim() != 3 or every.shape[2] != 2 or every.dtype != torch.float64 or not every.is_contiguous():
        raise ValueError(f"vocab_argmax_pick: every must be contiguous fp64 [W, R, 2], got {every.dtype} "
                         f"{tuple(every.shape)}")
    rows = every.shape[1]
    if tuple(ids.shape) != (rows,) or ids.dtype != torch.int64 or not ids.is_contiguous():
        raise ValueError(f"vocab_argmax_pick: ids must be contiguous int64 [{rows}], got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    if flag.dim() != 1 or flag.dtype != torch.int64 or flag.shape[0] < 1 or rows % flag.shape[0] \
            or not flag.is_contiguous():
        raise ValueError(f"vocab_argmax_pick: flag must be contiguous int64 [b] with b dividing {rows} rows, got "
                         f"{flag.dtype} {tuple(flag.shape)}")
    if ids.device != every.device or flag.device != every.device:
        raise ValueError(f"vocab_argmax_pick: ids and flag must be on {every.device}")
