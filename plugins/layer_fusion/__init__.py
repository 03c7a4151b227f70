"""layer_fusion: a decoder layer's elementwise stages as one kernel each (see kernel.py for why).

Registered as kdtree:: ops (torch.export sees one node per stage); CUDA tensors of bf16 / fp16 / fp32
run the Triton kernels, everything else (CPU, fp64) the torch reference (reference.py), which the
wrappers call directly on CPU to keep the dispatcher's per-call cost out of the CPU path.

Letters: t tokens, d hidden, h heads, p qk_nope dims, r rope dims, c latent, i MLP intermediate.
"""

from __future__ import annotations

import torch

from core.env_flags import env_flag
from plugins.common.op import kdtree_op
from plugins.common.precision import KERNEL_DTYPES
from plugins.layer_fusion.reference import (
    add_rms_norm_reference,
    drafter_block_reference,
    embed_norm_rope_reference,
    embed_range_reference,
    kv_norm_rope_store_reference,
    mla_q_absorb_reference,
    mla_rope_kv_reference,
    mla_v_absorb_reference,
    rms_norm_reference,
    rope_cos_sin_reference,
    rotate_reference,
    silu_mul_reference,
)

__all__ = ["rms_norm", "add_rms_norm", "rope_cos_sin", "mla_q_absorb", "mla_v_absorb", "mla_rope_kv", "silu_mul",
           "kv_norm_rope_store", "drafter_block", "embed_range", "embed_norm_rope", "rotate_reference"]

# KDTREE_FUSION=0 (read once, at import): the references on CUDA too, i.e. the unfused torch ops, the peer
# benchmarks/layer_fusion.py measures in the same run
FUSION = env_flag("KDTREE_FUSION", True)


def _fused(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Run the kernel: a CUDA tensor of a kernel dtype, every other tensor of the same dtype."""
    return FUSION and x.is_cuda and x.dtype in KERNEL_DTYPES and all(o is None or o.dtype == x.dtype for o in others)


def _check_rows(name: str, d: int, **tensors: torch.Tensor | None) -> None:
    for key, t in tensors.items():
        if t is not None and (t.dim() != 2 or t.shape[1] != d or t.stride(1) != 1):
            raise ValueError(f"{name}: {key} must be [t, {d}] with unit stride along d, got {tuple(t.shape)} "
                             f"strides {t.stride()}")


# ---- rms_norm and the residual step

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> rms_norm(x) * weight [..., d] (transformers' RMSNorm)."""
    if not _fused(x, weight):
        return rms_norm_reference(x, weight, eps)
    return rms_norm_op(x, weight, eps)


@kdtree_op("rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@rms_norm_op.register_kernel("cuda")
def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _fused(x, weight):
        return rms_norm_reference(x, weight, eps)
    from plugins.layer_fusion.kernel import add_rms_norm_triton
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    _check_rows("rms_norm", d, x=rows)
    y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [t, d]
    add_rms_norm_triton(rows, None, None, weight, eps, None, y)
    return y.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta2: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual step of a layer: x, delta (, delta2) [..., d] -> (s = x + (delta + delta2),
    rms_norm(s) * weight)."""
    if not _fused(x, delta, delta2, weight):
        return add_rms_norm_reference(x, delta, delta2, weight, eps)
    return add_rms_norm_op(x, delta, delta2, weight, eps)


@kdtree_op("add_rms_norm", mutates_args=())
def add_rms_norm_op(x: torch.Tensor, delta: torch.Tensor, delta2: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_reference(x, delta, delta2, weight, eps)


@add_rms_norm_op.register_fake
def _(x, delta, delta2, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


@add_rms_norm_op.register_kernel("cuda")
def _add_rms_norm_cuda(x: torch.Tensor, delta: torch.Tensor, delta2: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not _fused(x, delta, delta2, weight):
        return add_rms_norm_reference(x, delta, delta2, weight, eps)
    from plugins.layer_fusion.kernel import add_rms_norm_triton
    d = x.shape[-1]
    rows = [t.reshape(-1, d) if t is not None else None for t in (x, delta, delta2)]
    _check_rows("add_rms_norm", d, x=rows[0], delta=rows[1], delta2=rows[2])
    s = torch.empty(rows[0].shape, dtype=x.dtype, device=x.device)  # [t, d]
    y = torch.empty_like(s)
    add_rms_norm_triton(rows[0], rows[1], rows[2], weight, eps, s, y)
    return s.view(x.shape), y.view(x.shape)


# ---- rope tables

def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] integers, inv_freq [r/2] fp32 -> cos, sin [..., r/2] in dtype (reference.py)."""
    if not (FUSION and positions.is_cuda and dtype in KERNEL_DTYPES and inv_freq.dtype == torch.float32):
        return rope_cos_sin_reference(positions, inv_freq, scale, dtype)
    return rope_cos_sin_op(positions, inv_freq, scale, dtype)


@kdtree_op("rope_cos_sin", mutates_args=())
def rope_cos_sin_op(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin_reference(positions, inv_freq, scale, dtype)


@rope_cos_sin_op.register_fake
def _(positions, inv_freq, scale, dtype):
    shape = (*positions.shape, inv_freq.shape[0])
    return positions.new_empty(shape, dtype=dtype), positions.new_empty(shape, dtype=dtype)


@rope_cos_sin_op.register_kernel("cuda")
def _rope_cos_sin_cuda(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or not inv_freq.is_contiguous() \
            or positions.dtype.is_floating_point:
        raise ValueError(f"rope_cos_sin: need integer positions and contiguous fp32 inv_freq [r/2], got positions "
                         f"{positions.dtype}, inv_freq {inv_freq.dtype} {tuple(inv_freq.shape)}")
    from plugins.layer_fusion.kernel import rope_cos_sin_triton
    flat = positions.reshape(-1).contiguous()  # [t] (a view when positions is contiguous)
    cos = torch.empty(flat.shape[0], inv_freq.shape[0], dtype=dtype, device=positions.device)  # [t, r/2]
    sin = torch.empty_like(cos)
    rope_cos_sin_triton(flat, inv_freq, scale, cos, sin)
    shape = (*positions.shape, inv_freq.shape[0])
    return cos.view(shape), sin.view(shape)


# ---- MLA: the query and the latent row

def mla_q_absorb(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 interleave: bool) -> torch.Tensor:
    """q [t, h, p+r] (q_b's output, any strides), w_uk [h, p, c], cos/sin [t, r/2] -> q_full [t, h, c+r] =
    [q_nope . W_UK | rope(q_pe)]: the per-head absorption product and the rope in one kernel."""
    if not _fused(q, w_uk, cos, sin):
        return mla_q_absorb_reference(q, w_uk, cos, sin, interleave)
    return mla_q_absorb_op(q, w_uk, cos, sin, interleave)


@kdtree_op("mla_q_absorb", mutates_args=())
def mla_q_absorb_op(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    interleave: bool) -> torch.Tensor:
    return mla_q_absorb_reference(q, w_uk, cos, sin, interleave)


@mla_q_absorb_op.register_fake
def _(q, w_uk, cos, sin, interleave):
    return q.new_empty(q.shape[0], q.shape[1], w_uk.shape[2] + 2 * cos.shape[-1])


@mla_q_absorb_op.register_kernel("cuda")
def _mla_q_absorb_cuda(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       interleave: bool) -> torch.Tensor:
    if not _fused(q, w_uk, cos, sin):
        return mla_q_absorb_reference(q, w_uk, cos, sin, interleave)
    from plugins.layer_fusion.kernel import mla_q_absorb_triton
    t, h = q.shape[:2]
    p, c, r2 = w_uk.shape[1], w_uk.shape[2], cos.shape[-1]
    if q.dim() != 3 or w_uk.dim() != 3 or w_uk.shape[0] != h or q.shape[2] != p + 2 * r2 or cos.shape != (t, r2) \
            or sin.shape != (t, r2) or q.stride(2) != 1 or w_uk.stride(2) != 1 or cos.stride(1) != 1 \
            or sin.stride() != cos.stride():
        raise ValueError(f"mla_q_absorb: need q [{t}, {h}, p+r], w_uk [{h}, p, c], cos/sin [{t}, r/2] with unit last "
                         f"strides; got q {tuple(q.shape)} {q.stride()}, w_uk {tuple(w_uk.shape)} {w_uk.stride()}, "
                         f"cos {tuple(cos.shape)} {cos.stride()}, sin {tuple(sin.shape)} {sin.stride()}")
    out = torch.empty(t, h, c + 2 * r2, dtype=q.dtype, device=q.device)
    mla_q_absorb_triton(q, w_uk, cos, sin, interleave, out)
    return out


def mla_v_absorb(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat [t, h, c] (the attention's latent output, any strides), w_uv [h, u, c] -> o [t, h, u] contiguous:
    o_lat . W_UV^T per head, o_proj's input rows."""
    if not _fused(o_lat, w_uv):
        return mla_v_absorb_reference(o_lat, w_uv)
    return mla_v_absorb_op(o_lat, w_uv)


@kdtree_op("mla_v_absorb", mutates_args=())
def mla_v_absorb_op(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    return mla_v_absorb_reference(o_lat, w_uv)


@mla_v_absorb_op.register_fake
def _(o_lat, w_uv):
    return o_lat.new_empty(o_lat.shape[0], o_lat.shape[1], w_uv.shape[1])


@mla_v_absorb_op.register_kernel("cuda")
def _mla_v_absorb_cuda(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    if not _fused(o_lat, w_uv):
        return mla_v_absorb_reference(o_lat, w_uv)
    from plugins.layer_fusion.kernel import mla_v_absorb_triton
    t, h, c = o_lat.shape
    if o_lat.dim() != 3 or w_uv.dim() != 3 or w_uv.shape[0] != h or w_uv.shape[2] != c or o_lat.stride(2) != 1 \
            or w_uv.stride(2) != 1:
        raise ValueError(f"mla_v_absorb: need o_lat [{t}, {h}, c], w_uv [{h}, u, c] with unit last strides; got "
                         f"o_lat {tuple(o_lat.shape)} {o_lat.stride()}, w_uv {tuple(w_uv.shape)} {w_uv.stride()}")
    out = torch.empty(t, h, w_uv.shape[1], dtype=o_lat.dtype, device=o_lat.device)
    mla_v_absorb_triton(o_lat, w_uv, out)
    return out


def mla_rope_kv(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                interleave: bool, out: torch.Tensor, q_low: torch.Tensor | None = None,
                q_weight: torch.Tensor | None = None, q_out: torch.Tensor | None = None) -> None:
    """latent [t, c+r] (kv_a's output), cos/sin [t, r/2] -> out [b, n, c+r] (b * n = t, e.g. the cache's
    scratch rows) = [rms_norm(c_kv) * weight | rope(k_pe)].  With q_low [t, q] (q_a's output, any row stride):
    also q_out [t, q] = rms_norm(q_low) * q_weight, in the same kernel (one launch for both latent rows)."""
    if (q_low is None) != (q_weight is None) or (q_low is None) != (q_out is None):
        raise ValueError("mla_rope_kv: q_low, q_weight and q_out come together")
    if not _fused(latent, weight, cos, sin, out, q_low, q_weight, q_out):
        mla_rope_kv_reference(latent, weight, eps, cos, sin, interleave, out, q_low, q_weight, q_out)
        return
    mla_rope_kv_op(latent, weight, eps, cos, sin, interleave, out, q_low, q_weight, q_out)


@kdtree_op("mla_rope_kv", mutates_args=("out", "q_out"))
def mla_rope_kv_op(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   interleave: bool, out: torch.Tensor, q_low: torch.Tensor | None, q_weight: torch.Tensor | None,
                   q_out: torch.Tensor | None) -> None:
    mla_rope_kv_reference(latent, weight, eps, cos, sin, interleave, out, q_low, q_weight, q_out)


@mla_rope_kv_op.register_kernel("cuda")
def _mla_rope_kv_cuda(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      interleave: bool, out: torch.Tensor, q_low: torch.Tensor | None, q_weight: torch.Tensor | None,
                      q_out: torch.Tensor | None) -> None:
    if not _fused(latent, weight, cos, sin, out, q_low, q_weight, q_out):
        mla_rope_kv_reference(latent, weight, eps, cos, sin, interleave, out, q_low, q_weight, q_out)
        return
    from plugins.layer_fusion.kernel import mla_rope_kv_triton
    b, n, w = out.shape
    r2 = cos.shape[-1]
    _check_rows("mla_rope_kv", w, latent=latent)
    if latent.shape[0] != b * n or w != weight.shape[0] + 2 * r2 or cos.shape != (b * n, r2) \
            or cos.stride(1) != 1 or sin.stride() != cos.stride() or out.stride(2) != 1:
        raise ValueError(f"mla_rope_kv: need latent [{b * n}, c+r], out [{b}, {n}, c+r], cos/sin [{b * n}, r/2]; got "
                         f"latent {tuple(latent.shape)}, out {tuple(out.shape)} {out.stride()}, cos {tuple(cos.shape)}")
    if q_low is not None:
        q = q_weight.shape[0]
        _check_rows("mla_rope_kv", q, q_low=q_low, q_out=q_out)
        if q_low.shape[0] != b * n or q_out.shape[0] != b * n:
            raise ValueError(f"mla_rope_kv: q_low / q_out need {b * n} rows, got {q_low.shape[0]} / {q_out.shape[0]}")
    mla_rope_kv_triton(latent, weight, eps, cos, sin, interleave, out, q_low, q_weight, q_out)


# ---- the drafter's attention heads

def kv_norm_rope_store(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       interleave: bool, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       q: torch.Tensor | None = None, q_weight: torch.Tensor | None = None) -> torch.Tensor | None:
    """The drafter's new K/V rows into its cache in one launch, for one layer or all of them
    (reference.kv_norm_rope_store_reference): kv [t, L, 2, g, e] (a GEMM's k | v heads per layer), weight [L, e],
    cos/sin [t, e/2], pos [b, n] int64 (t = b * n), k_cache / v_cache [L, b, cap, g, e].  With q [t, h, e] (unit
    last stride) and q_weight [e]: also returns the q heads normed and roped, [t, h, e], from the same launch."""
    q_out = None if q is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if not _fused(kv, weight, cos, sin, k_cache, v_cache, q, q_weight):
        kv_norm_rope_store_reference(kv, weight, eps, cos, sin, interleave, pos, k_cache, v_cache, q, q_weight, q_out)
    else:
        kv_norm_rope_store_op(kv, weight, eps, cos, sin, interleave, pos, k_cache, v_cache, q, q_weight, q_out)
    return q_out


@kdtree_op("kv_norm_rope_store", mutates_args=("k_cache", "v_cache", "q_out"))
def kv_norm_rope_store_op(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                          interleave: bool, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          q: torch.Tensor | None, q_weight: torch.Tensor | None, q_out: torch.Tensor | None) -> None:
    kv_norm_rope_store_reference(kv, weight, eps, cos, sin, interleave, pos, k_cache, v_cache, q, q_weight, q_out)


@kv_norm_rope_store_op.register_kernel("cuda")
def _kv_norm_rope_store_cuda(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                             sin: torch.Tensor, interleave: bool, pos: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, q: torch.Tensor | None, q_weight: torch.Tensor | None,
                             q_out: torch.Tensor | None) -> None:
    if not _fused(kv, weight, cos, sin, k_cache, v_cache, q, q_weight):
        kv_norm_rope_store_reference(kv, weight, eps, cos, sin, interleave, pos, k_cache, v_cache, q, q_weight, q_out)
        return
    from plugins.layer_fusion.kernel import kv_norm_rope_store_triton
    t, layers, two, g, e = kv.shape
    b, n = pos.shape
    if two != 2 or kv.stride(4) != 1 or e % 2 or t != b * n or pos.dtype != torch.int64 or not pos.is_contiguous() \
            or weight.shape != (layers, e) or weight.stride(1) != 1 or cos.shape != (t, e // 2) or cos.stride(1) != 1 \
            or sin.stride() != cos.stride() or k_cache.shape[:2] != (layers, b) or k_cache.shape[3:] != (g, e) \
            or v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride() or k_cache.stride(4) != 1:
        raise ValueError(f"kv_norm_rope_store: need kv [t, L, 2, g, e] (unit last stride), pos int64 [b, n] with "
                         f"t = b*n, weight [L, e], cos/sin [t, e/2], k_cache = v_cache [L, b, cap, g, e] (same "
                         f"strides); got kv {tuple(kv.shape)} {kv.stride()}, weight {tuple(weight.shape)}, pos "
                         f"{pos.dtype} {tuple(pos.shape)}, cos {tuple(cos.shape)}, k_cache {tuple(k_cache.shape)} "
                         f"{k_cache.stride()}, v_cache {tuple(v_cache.shape)} {v_cache.stride()}")
    if q is not None and (q.dim() != 3 or q.shape[0] != t or q.shape[2] != e or q.stride(2) != 1
                          or q_weight.shape != (e,) or q_out.shape != q.shape or q_out.stride(2) != 1):
        raise ValueError(f"kv_norm_rope_store: need q [{t}, h, {e}] (unit last stride), q_weight [{e}], q_out as q; "
                         f"got q {tuple(q.shape)} {q.stride()}, q_weight {tuple(q_weight.shape)}")
    kv_norm_rope_store_triton(kv, weight, eps, cos, sin, interleave, pos, k_cache, v_cache, q, q_weight, q_out)


def drafter_block(lens: torch.Tensor, ctx_len: torch.Tensor, bonus: torch.Tensor, mask_id: int, ctx_pos: torch.Tensor,
                  blk_pos: torch.Tensor, block: torch.Tensor, visible: torch.Tensor) -> None:
    """A drafter call's positions, block tokens and visible lengths, and lens advanced by ctx_len, in one launch
    (reference.drafter_block_reference)."""
    if not (FUSION and lens.is_cuda):
        drafter_block_reference(lens, ctx_len, bonus, mask_id, ctx_pos, blk_pos, block, visible)
        return
    drafter_block_op(lens, ctx_len, bonus, mask_id, ctx_pos, blk_pos, block, visible)


@kdtree_op("drafter_block", mutates_args=("lens", "ctx_pos", "blk_pos", "block", "visible"))
def drafter_block_op(lens: torch.Tensor, ctx_len: torch.Tensor, bonus: torch.Tensor, mask_id: int,
                     ctx_pos: torch.Tensor, blk_pos: torch.Tensor, block: torch.Tensor, visible: torch.Tensor) -> None:
    drafter_block_reference(lens, ctx_len, bonus, mask_id, ctx_pos, blk_pos, block, visible)


@drafter_block_op.register_kernel("cuda")
def _drafter_block_cuda(lens: torch.Tensor, ctx_len: torch.Tensor, bonus: torch.Tensor, mask_id: int,
                        ctx_pos: torch.Tensor, blk_pos: torch.Tensor, block: torch.Tensor,
                        visible: torch.Tensor) -> None:
    from plugins.layer_fusion.kernel import drafter_block_triton
    b = lens.shape[0]
    ok = (lens.shape == ctx_len.shape == bonus.shape == visible.shape == (b,) and lens.dtype == ctx_len.dtype
          == torch.int32 and bonus.dtype == ctx_pos.dtype == blk_pos.dtype == block.dtype == visible.dtype
          == torch.int64 and ctx_pos.shape[0] == b and blk_pos.shape == block.shape and blk_pos.shape[0] == b
          and all(t.is_contiguous() for t in (lens, ctx_len, bonus, ctx_pos, blk_pos, block, visible)))
    if not ok:
        raise ValueError(f"drafter_block: need lens, ctx_len int32 [b], bonus, visible int64 [b], ctx_pos int64 "
                         f"[b, a], blk_pos = block int64 [b, s], all contiguous; got lens {lens.dtype} "
                         f"{tuple(lens.shape)}, ctx_len {ctx_len.dtype} {tuple(ctx_len.shape)}, bonus {bonus.dtype} "
                         f"{tuple(bonus.shape)}, ctx_pos {tuple(ctx_pos.shape)}, blk_pos {tuple(blk_pos.shape)}, "
                         f"block {tuple(block.shape)}, visible {visible.dtype} {tuple(visible.shape)}")
    drafter_block_triton(lens, ctx_len, bonus, mask_id, ctx_pos, blk_pos, block, visible)


# ---- the vocab-parallel embedding

def embed_range(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """tokens [b, n] int64, weight [>= count, d] -> [b, n, d]: rows of the ids in [start, start + count), zeros
    for the others, in one launch (reference.embed_range_reference)."""
    if not (_fused(weight) and tokens.dtype == torch.int64):
        return embed_range_reference(tokens, weight, start, count)
    return embed_range_op(tokens, weight, start, count)


@kdtree_op("embed_range", mutates_args=())
def embed_range_op(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return embed_range_reference(tokens, weight, start, count)


@embed_range_op.register_fake
def _(tokens, weight, start, count):
    return weight.new_empty(*tokens.shape, weight.shape[1])


@embed_range_op.register_kernel("cuda")
def _embed_range_cuda(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    if not (_fused(weight) and tokens.dtype == torch.int64):
        return embed_range_reference(tokens, weight, start, count)
    from plugins.layer_fusion.kernel import embed_range_triton
    if weight.dim() != 2 or weight.stride(1) != 1 or count > weight.shape[0]:
        raise ValueError(f"embed_range: need weight [>= {count}, d] with unit last stride, got {tuple(weight.shape)} "
                         f"{weight.stride()}")
    flat = tokens.reshape(-1).contiguous()  # [t]
    out = torch.empty(flat.shape[0], weight.shape[1], dtype=weight.dtype, device=weight.device)
    embed_range_triton(flat, weight, start, count, out)
    return out.view(*tokens.shape, weight.shape[1])


def embed_norm_rope(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int, norm_weight: torch.Tensor,
                    eps: float, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, positions [b, n] -> (x, rms_norm(x) * norm_weight) [b, n, d] and cos, sin [b, n, r/2] in weight's dtype:
    embed_range, the first layer's norm and rope_cos_sin in one launch, for one rank (no all-reduce between the
    embedding and the norm).  reference.embed_norm_rope_reference."""
    if not (_fused(weight, norm_weight) and tokens.dtype == torch.int64 and not positions.dtype.is_floating_point
            and inv_freq.dtype == torch.float32):
        return embed_norm_rope_reference(tokens, weight, start, count, norm_weight, eps, positions, inv_freq, scale)
    return embed_norm_rope_op(tokens, weight, start, count, norm_weight, eps, positions, inv_freq, scale)


@kdtree_op("embed_norm_rope", mutates_args=())
def embed_norm_rope_op(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int, norm_weight: torch.Tensor,
                       eps: float, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return embed_norm_rope_reference(tokens, weight, start, count, norm_weight, eps, positions, inv_freq, scale)


@embed_norm_rope_op.register_fake
def _(tokens, weight, start, count, norm_weight, eps, positions, inv_freq, scale):
    x = weight.new_empty(*tokens.shape, weight.shape[1])
    cs = weight.new_empty(*positions.shape, inv_freq.shape[0])
    return x, torch.empty_like(x), cs, torch.empty_like(cs)


@embed_norm_rope_op.register_kernel("cuda")
def _embed_norm_rope_cuda(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int,
                          norm_weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if not (_fused(weight, norm_weight) and tokens.dtype == torch.int64):
        return embed_norm_rope_reference(tokens, weight, start, count, norm_weight, eps, positions, inv_freq, scale)
    from plugins.layer_fusion.kernel import embed_norm_rope_triton
    d = weight.shape[-1]
    if weight.dim() != 2 or weight.stride(1) != 1 or count > weight.shape[0] or norm_weight.shape != (d,) \
            or not norm_weight.is_contiguous():
        raise ValueError(f"embed_norm_rope: need weight [>= {count}, d] with unit last stride and norm_weight [d] "
                         f"contiguous, got {tuple(weight.shape)} {weight.stride()}, {tuple(norm_weight.shape)}")
    if positions.shape != tokens.shape or positions.dtype.is_floating_point or inv_freq.dim() != 1 \
            or inv_freq.dtype != torch.float32 or not inv_freq.is_contiguous():
        raise ValueError(f"embed_norm_rope: need integer positions shaped as tokens {tuple(tokens.shape)} and "
                         f"contiguous fp32 inv_freq [r/2], got positions {positions.dtype} {tuple(positions.shape)}, "
                         f"inv_freq {inv_freq.dtype} {tuple(inv_freq.shape)}")
    flat, pos = tokens.reshape(-1).contiguous(), positions.reshape(-1).contiguous()  # [t] each
    x = torch.empty(flat.shape[0], d, dtype=weight.dtype, device=weight.device)  # [t, d]
    h = torch.empty_like(x)
    cos = torch.empty(flat.shape[0], inv_freq.shape[0], dtype=weight.dtype, device=weight.device)  # [t, r/2]
    sin = torch.empty_like(cos)
    embed_norm_rope_triton(flat, weight, start, count, norm_weight, eps, pos, inv_freq, scale, x, h, cos, sin)
    rows, cols = (*tokens.shape, d), (*tokens.shape, inv_freq.shape[0])
    return x.view(rows), h.view(rows), cos.view(cols), sin.view(cols)


# ---- the MLP's activation

def silu_mul(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gate_up [..., 2i] (gate, then up) -> silu(gate) * up [..., i] in out_dtype (default gate_up's).  A wider
    gate_up (an fp32 GEMM output) is rounded to out_dtype first: the model-dtype GEMM output it stands for."""
    out_dtype = out_dtype or gate_up.dtype
    if not (_fused(gate_up) and out_dtype in KERNEL_DTYPES and
            (out_dtype == gate_up.dtype or gate_up.dtype == torch.float32)):
        return silu_mul_reference(gate_up, out_dtype)
    return silu_mul_op(gate_up, out_dtype)


@kdtree_op("silu_mul", mutates_args=())
def silu_mul_op(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return silu_mul_reference(gate_up, out_dtype)


@silu_mul_op.register_fake
def _(gate_up, out_dtype):
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=out_dtype)


@silu_mul_op.register_kernel("cuda")
def _silu_mul_cuda(gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if not _fused(gate_up):
        return silu_mul_reference(gate_up, out_dtype)
    from plugins.layer_fusion.kernel import silu_mul_triton
    two_i = gate_up.shape[-1]
    rows = gate_up.reshape(-1, two_i)
    _check_rows("silu_mul", two_i, gate_up=rows)
    out = torch.empty(rows.shape[0], two_i // 2, dtype=out_dtype, device=gate_up.device)  # [t, i]
    silu_mul_triton(rows, out)
    return out.view(*gate_up.shape[:-1], two_i // 2)
