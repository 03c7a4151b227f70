"""Triton kernels for kv_commit: gather the accepted tree rows into the committed cache (all layers) and
the drafter context, then advance cache_lens.

Shapes: y layers, b requests, l_max cache capacity, n tree nodes, a accept capacity, d_qk row width,
f feature width; see reference.py for the contract.

Two launches, in stream order:
  1. copy   one 1-D grid of static size b * a * (ceil(y / LCH) + [feats] ceil(f / FB)) programs.
            Cache programs: (request r, accepted slot j, chunk of LCH layers) copy
            scratch[l, r, accept_idx[r, j]] -> cache[l, r, cache_lens[r] + j] for the chunk's layers,
            a [LCH, d_qk] tile split into a power-of-two main block and a (power-of-two padded) rest
            (576 = 512 + 64), so every lane of a 16-byte vector is a real element.
            Feature programs: (r, j, chunk of FB features) copy feats[r, accept_idx[r, j]] -> ctx_feats[r, j].
            Programs with j >= accept_len[r] exit at once (the grid never depends on data).
  2. advance cache_lens += accept_len (a separate launch, so no copy program can read an advanced length:
            programs of one launch have no ordering among themselves).  advance=False leaves it to the
            caller's next kernel (an AR step's round_emit).

Device-side guards instead of host checks: rows whose source index is outside [0, n) (or outside the
feats' node count) or whose destination is outside [0, l_max) are skipped, not written; slots
j >= a are never read.  cache_lens still advances by accept_len, like the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue


@triton.jit
def _kv_commit_copy_kernel(cache_ptr, lens_ptr, scratch_ptr, idx_ptr, alen_ptr, feats_ptr, ctx_ptr,
                           y, l_max, n, n_feat, f, a, n_layer_chunks, n_feat_chunks,
                           s_cy, s_cb, s_cl, s_sy, s_sb, s_sn, s_ib, s_fb, s_fn, s_xb, s_xa,
                           D: tl.constexpr, D_MAIN: tl.constexpr, D_REST: tl.constexpr, LCH: tl.constexpr,
                           FB: tl.constexpr, HAS_FEATS: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    n_cache = tl.num_programs(0) // (n_layer_chunks + n_feat_chunks) * n_layer_chunks  # b * a * layer chunks
    if pid < n_cache:
        chunk = pid % n_layer_chunks
        rj = pid // n_layer_chunks
        j = rj % a
        r = (rj // a).to(tl.int64)
        m = tl.load(alen_ptr + r)
        if j < m:
            src = tl.load(idx_ptr + r * s_ib + j).to(tl.int64)
            dst = tl.load(lens_ptr + r).to(tl.int64) + j
            if (src >= 0) & (src < n) & (dst >= 0) & (dst < l_max):
                layer = (chunk * LCH + tl.arange(0, LCH)).to(tl.int64)  # [LCH]
                lmask = (layer < y)[:, None]  # [LCH, 1]
                s_row = scratch_ptr + (layer * s_sy + r * s_sb + src * s_sn)[:, None]  # [LCH, 1]
                c_row = cache_ptr + (layer * s_cy + r * s_cb + dst * s_cl)[:, None]  # [LCH, 1]
                cols = tl.arange(0, D_MAIN)[None, :]  # [1, D_MAIN]
                main_mask = lmask & (cols < D_MAIN)
                v = tl.load(s_row + cols, mask=main_mask)  # [LCH, D_MAIN]
                if D_REST > 0:
                    cols2 = D_MAIN + tl.arange(0, D_REST)[None, :]  # [1, D_REST]
                    if D_MAIN + D_REST == D:
                        rest_mask = lmask & (cols2 < D_MAIN + D_REST)
                    else:
                        rest_mask = lmask & (cols2 < D)
                    v2 = tl.load(s_row + cols2, mask=rest_mask)  # [LCH, D_REST]
                    tl.store(c_row + cols2, v2, mask=rest_mask)
                tl.store(c_row + cols, v, mask=main_mask)
    elif HAS_FEATS:
        q = pid - n_cache
        chunk = q % n_feat_chunks
        rj = q // n_feat_chunks
        j = rj % a
        r = (rj // a).to(tl.int64)
        m = tl.load(alen_ptr + r)
        if j < m:
            src = tl.load(idx_ptr + r * s_ib + j).to(tl.int64)
            if (src >= 0) & (src < n_feat):
                cols = chunk.to(tl.int64) * FB + tl.arange(0, FB)  # [FB]
                fmask = cols < f
                v = tl.load(feats_ptr + r * s_fb + src * s_fn + cols, mask=fmask)  # [FB]
                tl.store(ctx_ptr + r * s_xb + j * s_xa + cols, v, mask=fmask)


ADVANCE_BLOCK = 128  # requests per advance program (one fixed specialisation for AOT builds)


@triton.jit
def _advance_lens_kernel(lens_ptr, alen_ptr, b, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < b
    lens = tl.load(lens_ptr + offs, mask=inside)
    tl.store(lens_ptr + offs, lens + tl.load(alen_ptr + offs, mask=inside), mask=inside)


def kv_commit_triton(cache: torch.Tensor, cache_lens: torch.Tensor, scratch: torch.Tensor, accept_idx: torch.Tensor,
                     accept_len: torch.Tensor, feats: torch.Tensor | None = None, ctx_feats: torch.Tensor | None = None,
                     layers_per_program: int = 8, feats_per_program: int = 4096, num_warps: int = 4,
                     advance: bool = True) -> None:
    """cache [y, b, l_max, d_qk], cache_lens [b] int32, scratch [y, b, n, d_qk], accept_idx [b, a] int32,
    accept_len [b] int32, optional feats [b, n_f <= n, f] -> ctx_feats [b, a, f].  Static checks only."""
    check_kv_commit(cache, cache_lens, scratch, accept_idx, accept_len, feats, ctx_feats)
    y, b, l_max, d = cache.shape
    n, a = scratch.shape[2], accept_idx.shape[1]
    if b == 0:
        return
    d_main = 1 << (d.bit_length() - 1)
    d_rest = triton.next_power_of_2(d - d_main) if d > d_main else 0
    lch = min(layers_per_program, triton.next_power_of_2(y))
    n_layer_chunks = triton.cdiv(y, lch)
    has_feats = feats is not None and feats.shape[2] > 0
    if has_feats:
        f, n_feat = feats.shape[2], feats.shape[1]
        fb = min(feats_per_program, max(triton.next_power_of_2(f), 16))
        n_feat_chunks = triton.cdiv(f, fb)
        fs = (feats.stride(0), feats.stride(1), ctx_feats.stride(0), ctx_feats.stride(1))
        fp, xp = feats, ctx_feats
    else:
        f, n_feat, fb, n_feat_chunks, fs, fp, xp = 0, 0, 16, 0, (0, 0, 0, 0), scratch, cache
    if y > 0 and d > 0 and a > 0:
        grid = (b * a * (n_layer_chunks + n_feat_chunks),)
        _kv_commit_copy_kernel[grid](
            cache, cache_lens, scratch, accept_idx, accept_len, fp, xp,
            y, l_max, n, n_feat, f, a, n_layer_chunks, n_feat_chunks,
            cache.stride(0), cache.stride(1), cache.stride(2), scratch.stride(0), scratch.stride(1),
            scratch.stride(2), accept_idx.stride(0), *fs,
            D=d, D_MAIN=d_main, D_REST=d_rest, LCH=lch, FB=fb, HAS_FEATS=has_feats, num_warps=num_warps,
            **pdl_args(pdl_for(cache)))
    if advance:
        _advance_lens_kernel[(triton.cdiv(b, ADVANCE_BLOCK),)](cache_lens, accept_len, b, BLOCK=ADVANCE_BLOCK,
                                                                num_warps=1, **pdl_args(pdl_for(cache)))


def check_kv_commit(cache, cache_lens, scratch, accept_idx, accept_len, feats, ctx_feats) -> None:
    """Shape, dtype, device and layout checks of the kernel path (ValueError naming the tensor)."""
    if cache.dim() != 4:
        raise ValueError(f"kv_commit: cache must be [y, b, l_max, d_qk], got {list(cache.shape)}")
    y, b, l_max, d = cache.shape
    if scratch.dim() != 4 or scratch.shape[:2] != (y, b) or scratch.shape[3] != d or scratch.dtype != cache.dtype:
        raise ValueError(f"kv_commit: scratch must be {cache.dtype} [{y}, {b}, n, {d}], got {scratch.dtype} "
                         f"{list(scratch.shape)}")
    if accept_idx.dim() != 2 or accept_idx.shape[0] != b or accept_idx.dtype != torch.int32:
        raise ValueError(f"kv_commit: accept_idx must be torch.int32 [{b}, a], got {accept_idx.dtype} "
                         f"{list(accept_idx.shape)}")
    for name, t in (("accept_len", accept_len), ("cache_lens", cache_lens)):
        if tuple(t.shape) != (b,) or t.dtype != torch.int32 or (b > 1 and t.stride(0) != 1):
            raise ValueError(f"kv_commit: {name} must be contiguous torch.int32 [{b}], got {t.dtype} {list(t.shape)}")
    if (feats is None) != (ctx_feats is None):
        raise ValueError("kv_commit: give both feats and ctx_feats or neither")
    tensors = [("cache", cache), ("scratch", scratch), ("accept_idx", accept_idx), ("accept_len", accept_len),
               ("cache_lens", cache_lens)]
    if feats is not None:
        if feats.dim() != 3 or feats.shape[0] != b or feats.shape[1] > scratch.shape[2]:
            raise ValueError(f"kv_commit: feats must be [{b}, <= {scratch.shape[2]}, f], got {list(feats.shape)}")
        if tuple(ctx_feats.shape) != (b, accept_idx.shape[1], feats.shape[2]) or ctx_feats.dtype != feats.dtype:
            raise ValueError(f"kv_commit: ctx_feats must be {feats.dtype} [{b}, {accept_idx.shape[1]}, "
                             f"{feats.shape[2]}], got {ctx_feats.dtype} {list(ctx_feats.shape)}")
        tensors += [("feats", feats), ("ctx_feats", ctx_feats)]
    for name, t in tensors:
        if t.device != cache.device:
            raise ValueError(f"kv_commit: {name} is on {t.device}, cache on {cache.device}")
        if t.dim() >= 2 and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"kv_commit: {name} must have a contiguous last dim, got strides {t.stride()}")
