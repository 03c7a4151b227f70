"""round_emit: what a decode round emits, per request (stop tokens, max_new, the host row); see reference.py."""

from __future__ import annotations

import torch

from plugins.common.op import kdtree_op
from plugins.round_emit.reference import round_emit_reference

__all__ = ["round_emit", "round_emit_op"]


def round_emit(cand: torch.Tensor | None, count: torch.Tensor, stop_ids: torch.Tensor, produced: torch.Tensor,
               max_new: torch.Tensor, live: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor,
               bonus: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
               path_idx: torch.Tensor | None = None, ctx_tokens: torch.Tensor | None = None,
               cache_lens: torch.Tensor | None = None) -> None:
    """Emit the round's tokens (reference.py): updates produced, live, out (and, AR, count and bonus, and
    cache_lens when given; a tree round, cand None: count, ctx_tokens, the candidates taken from tokens along
    path_idx)."""
    # every argument passed explicitly: torch 2.11's mutation bookkeeping indexes the given args only
    round_emit_op(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus, tokens, path_idx, ctx_tokens,
                  cache_lens)


@kdtree_op("round_emit", mutates_args=("count", "produced", "live", "nonfinite", "out", "bonus", "ctx_tokens",
                                       "cache_lens"))
def round_emit_op(cand: torch.Tensor | None, count: torch.Tensor, stop_ids: torch.Tensor, produced: torch.Tensor,
                  max_new: torch.Tensor, live: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor,
                  bonus: torch.Tensor | None, tokens: torch.Tensor | None = None,
                  path_idx: torch.Tensor | None = None, ctx_tokens: torch.Tensor | None = None,
                  cache_lens: torch.Tensor | None = None) -> None:
    """The registered op (call round_emit()); the reference on every device but CUDA."""
    _check(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus, tokens, path_idx, ctx_tokens,
           cache_lens)
    round_emit_reference(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus, tokens, path_idx,
                         ctx_tokens, cache_lens)


@round_emit_op.register_kernel("cuda")
def _round_emit_cuda(cand: torch.Tensor | None, count: torch.Tensor, stop_ids: torch.Tensor, produced: torch.Tensor,
                     max_new: torch.Tensor, live: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor,
                     bonus: torch.Tensor | None, tokens: torch.Tensor | None = None,
                     path_idx: torch.Tensor | None = None, ctx_tokens: torch.Tensor | None = None,
                     cache_lens: torch.Tensor | None = None) -> None:
    _check(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus, tokens, path_idx, ctx_tokens,
           cache_lens)
    from plugins.round_emit.kernel import round_emit_triton
    round_emit_triton(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus, tokens, path_idx,
                      ctx_tokens, cache_lens)


def _check(cand, count, stop_ids, produced, max_new, live, nonfinite, out, bonus, tokens, path_idx,
           ctx_tokens, cache_lens=None) -> None:
    if cache_lens is not None and (bonus is None or tokens is not None):
        raise ValueError("round_emit: cache_lens is advanced in AR rounds only (a tree round's kv_commit runs after "
                         "the emission and reads the unadvanced lengths)")
    if tokens is not None:  # a tree round
        if cand is not None or bonus is None or path_idx is None or ctx_tokens is None:
            raise ValueError("round_emit: a tree round gives tokens, path_idx, ctx_tokens and bonus, and no cand")
        if tokens.dim() != 2 or tokens.dtype != torch.int64 or tokens.stride(1) != 1:
            raise ValueError(f"round_emit: tokens must be int64 [b, N] with unit stride along N, got {tokens.dtype} "
                             f"{tuple(tokens.shape)} {tokens.stride()}")
        if path_idx.dim() != 2 or path_idx.shape[0] != tokens.shape[0] or path_idx.dtype != torch.int32 \
                or path_idx.stride(1) != 1:
            raise ValueError(f"round_emit: path_idx must be int32 [{tokens.shape[0]}, a] with unit stride along a, "
                             f"got {path_idx.dtype} {tuple(path_idx.shape)} {path_idx.stride()}")
        if ctx_tokens.shape != path_idx.shape or ctx_tokens.dtype != torch.int64 or ctx_tokens.stride(1) != 1:
            raise ValueError(f"round_emit: ctx_tokens must be int64 {list(path_idx.shape)} with unit stride, got "
                             f"{ctx_tokens.dtype} {tuple(ctx_tokens.shape)} {ctx_tokens.stride()}")
        b, a = path_idx.shape
    elif cand is None or cand.dim() != 2 or cand.dtype != torch.int64 or cand.stride(1) != 1:
        raise ValueError(f"round_emit: cand must be int64 [b, a] with unit stride along a, got "
                         f"{None if cand is None else (cand.dtype, tuple(cand.shape), cand.stride())}")
    else:
        b, a = cand.shape
    for name, t, dt in (("count", count, torch.int32), ("produced", produced, torch.int32),
                        ("max_new", max_new, torch.int32), ("live", live, torch.int32),
                        ("nonfinite", nonfinite, torch.int64), ("bonus", bonus, torch.int64),
                        ("cache_lens", cache_lens, torch.int32)):
        if t is not None and (t.shape != (b,) or t.dtype != dt):
            raise ValueError(f"round_emit: {name} must be {dt} [{b}], got {t.dtype} {tuple(t.shape)}")
    if stop_ids.dim() != 2 or stop_ids.shape[0] != b or stop_ids.dtype != torch.int64 or stop_ids.stride(1) != 1:
        raise ValueError(f"round_emit: stop_ids must be int64 [{b}, S], got {stop_ids.dtype} {tuple(stop_ids.shape)}")
    if out.dim() != 2 or out.shape[0] != b or out.shape[1] < a + 4 or out.dtype != torch.int64 or out.stride(1) != 1:
        raise ValueError(f"round_emit: out must be int64 [{b}, >= {a + 4}], got {out.dtype} {tuple(out.shape)}")
    if bonus is not None and tokens is None and a != 1:
        raise ValueError(f"round_emit: an AR round (bonus given) has one candidate per request, got {a}")
