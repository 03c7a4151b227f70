"""The elementwise stages of a decoder layer, in plain torch: the semantics the fused kernels keep.

Each function is what the layer computed before fusion, op for op, so the torch dtype rules (every
elementwise op computed in fp32 for bf16/fp16 inputs and rounded once to the input dtype) are the
contract: kernel.py rounds at the same points, so bf16 results agree bit for bit except where a
reduction's order differs (the RMS of a row).

Letters: t tokens (b * n flattened), d hidden, h heads, p qk_nope dims, r rope dims, c latent
(kv_lora_rank), i MLP intermediate.
"""

from __future__ import annotations

import torch

from plugins.common.activation import silu_mul_reference  # noqa: F401  (this module's stages, one shared)
from plugins.common.precision import acc


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32 (fp64 stays fp64), cast back, then scale.  x [..., d]."""
    xf = acc(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, delta2: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual step: s = x + (delta + delta2) (delta2 optional, summed first), then (s, rms_norm(s))."""
    if delta2 is not None:
        delta = delta + delta2
    s = x + delta  # [..., d]
    return s, rms_norm_reference(s, weight, eps)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., r] with cos/sin broadcastable to [..., r/2] -> rotated [..., r], de-interleaved: (all first
    elements of the pairs, then all second ones).  interleave: the pairs are (x0, x1), (x2, x3), ...;
    else (x_j, x_{j + r/2}) (the halves)."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mla_rope_q_reference(q: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         interleave: bool) -> torch.Tensor:
    """The absorbed MLA query: q [t, h, p+r] (q_b's output), q_lat [t, h, c] (q_nope . W_UK, any strides),
    cos/sin [t, r/2] -> q_full [t, h, c+r] = [q_lat | rope(q_pe)], contiguous."""
    r = cos.shape[-1] * 2
    q_pe = rotate_reference(q[..., q.shape[-1] - r:], cos[:, None], sin[:, None], interleave)  # [t, h, r]
    return torch.cat([q_lat, q_pe], dim=-1).contiguous()


def rope_cos_sin_reference(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] (integers), inv_freq [r/2] fp32 -> cos, sin [..., r/2] in dtype: the angle position x
    inv_freq in fp32, as transformers computes it, cos / sin times scale (the YaRN attention factor), rounded once."""
    freqs = positions[..., None].float() * inv_freq  # [..., r/2]
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def mla_q_absorb_reference(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleave: bool) -> torch.Tensor:
    """The absorbed MLA query from q_b's output: q [t, h, p+r], w_uk [h, p, c], cos/sin [t, r/2] -> q_full
    [t, h, c+r] = [q_nope . W_UK | rope(q_pe)], contiguous; q_nope . W_UK is one product per head rounded
    once to q's dtype (the batched GEMM, q read through its strides: no copy)."""
    q_lat = torch.bmm(q[..., :w_uk.shape[1]].transpose(0, 1), w_uk)  # [h, t, c]
    return mla_rope_q_reference(q, q_lat.transpose(0, 1), cos, sin, interleave)


def mla_v_absorb_reference(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """The attention's latent output back to value heads: o_lat [t, h, c] (any strides), w_uv [h, u, c] ->
    o [t, h, u] contiguous (o_proj's input rows), o_lat[:, j] . W_UV[j]^T per head rounded once to o_lat's
    dtype (the batched GEMM writes through o's strides: no transpose copy)."""
    t, h, _ = o_lat.shape
    o = torch.empty(t, h, w_uv.shape[1], dtype=o_lat.dtype, device=o_lat.device)  # [t, h, u]
    torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=o.transpose(0, 1))
    return o


def mla_rope_kv_reference(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                          sin: torch.Tensor, interleave: bool, out: torch.Tensor, q_low: torch.Tensor | None = None,
                          q_weight: torch.Tensor | None = None, q_out: torch.Tensor | None = None) -> None:
    """The latent row of each token: latent [t, c+r] (kv_a's output) -> out [b, n, c+r] (t = b * n, any
    strides; the cache's scratch rows) = [rms_norm(c_kv) * weight | rope(k_pe)]; cos/sin [t, r/2].  With
    q_low [t, q] (q_a's output): also q_out [t, q] = rms_norm(q_low) * q_weight, the query's low-rank norm."""
    if q_low is not None:
        q_out.copy_(rms_norm_reference(q_low, q_weight, eps))
    c = weight.shape[0]
    c_kv = rms_norm_reference(latent[..., :c], weight, eps)  # [t, c]
    k_pe = rotate_reference(latent[..., c:], cos, sin, interleave)  # [t, r]
    out.copy_(torch.cat([c_kv, k_pe], dim=-1).view(out.shape))


def head_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                             interleave: bool) -> torch.Tensor:
    """Per-head q / k norm then rope (the DFlash drafter's heads): x [t, h, e], weight [e], cos/sin [t, e/2]
    -> [t, h, e] = rotate(rms_norm(x) * weight), de-interleaved."""
    return rotate_reference(rms_norm_reference(x, weight, eps), cos[:, None], sin[:, None], interleave)


def kv_norm_rope_store_reference(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                                 sin: torch.Tensor, interleave: bool, pos: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, q: torch.Tensor | None = None,
                                 q_weight: torch.Tensor | None = None, q_out: torch.Tensor | None = None) -> None:
    """The drafter's new K/V rows into its cache, for L layers at once: kv [t, L, 2, g, e] (per layer the k heads,
    then the v heads: a GEMM's output), weight [L, e] (each layer's k norm), cos/sin [t, e/2], pos [b, n] (t = b * n
    tokens, request-major); k_cache / v_cache [L, b, cap, g, e].  Token (r, j)'s k heads of layer l, normed and
    roped (head_norm_rope), and its v heads go to row min(pos[r, j], cap - 1) of request r in layer l.  With q
    [t, h, e] and q_weight [e]: q_out [t, h, e] = head_norm_rope(q) too (the block's queries, same positions)."""
    b, n = pos.shape
    layers, g, e = kv.shape[1], kv.shape[3], kv.shape[4]
    rows = torch.arange(b, device=pos.device)[:, None]  # [b, 1]
    dest = pos.clamp(max=k_cache.shape[2] - 1)  # [b, n]
    for li in range(layers):
        k = head_norm_rope_reference(kv[:, li, 0], weight[li], eps, cos, sin, interleave).view(b, n, g, e)
        k_cache[li, rows, dest] = k
        v_cache[li, rows, dest] = kv[:, li, 1].reshape(b, n, g, e)
    if q is not None:
        q_out.copy_(head_norm_rope_reference(q, q_weight, eps, cos, sin, interleave))


def drafter_block_reference(lens: torch.Tensor, ctx_len: torch.Tensor, bonus: torch.Tensor, mask_id: int,
                            ctx_pos: torch.Tensor, blk_pos: torch.Tensor, block: torch.Tensor,
                            visible: torch.Tensor) -> None:
    """One drafter call's bookkeeping, per request r: lens [b] int32 committed context rows (advanced by
    ctx_len [b] int32 here), bonus [b] int64.  Writes ctx_pos [b, a] = lens + j (the context rows' positions),
    blk_pos [b, s] = start + j with start = lens + ctx_len (the block's), block [b, s] = [bonus, mask_id x
    (s - 1)] and visible [b] = start + s (int64: cache rows the block attends to)."""
    start = lens.long() + ctx_len.long()  # [b]
    ctx_pos.copy_(lens.long()[:, None] + torch.arange(ctx_pos.shape[1], device=lens.device))
    blk_pos.copy_(start[:, None] + torch.arange(blk_pos.shape[1], device=lens.device))
    block.fill_(mask_id)
    block[:, 0] = bonus
    visible.copy_(start + blk_pos.shape[1])
    lens += ctx_len


def embed_range_reference(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """This rank's share of a vocab-parallel embedding: tokens [b, n] int64, weight [>= count, d] (rows of the ids
    [start, start + count)) -> [b, n, d]: weight[id - start] for ids in the range, zero rows for the others (the
    all-reduce that follows sums the one rank's row)."""
    local = tokens - start  # [b, n]
    outside = (local < 0) | (local >= count)
    x = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)  # [b, n, d]
    return x.masked_fill_(outside[..., None], 0.0)


def embed_norm_rope_reference(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int,
                              norm_weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                              scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A forward's first stage on one rank (no all-reduce between the embedding and the first norm): tokens,
    positions [b, n] -> x = embed_range_reference(...) [b, n, d], rms_norm(x) * norm_weight [b, n, d], and cos, sin
    [b, n, r/2] in weight's dtype (rope_cos_sin_reference)."""
    x = embed_range_reference(tokens, weight, start, count)  # [b, n, d]
    cos, sin = rope_cos_sin_reference(positions, inv_freq, scale, weight.dtype)  # [b, n, r/2] each
    return x, rms_norm_reference(x, norm_weight, eps), cos, sin
