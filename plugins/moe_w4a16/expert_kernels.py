"""Triton grouped expert GEMMs for moe_w4a16: gate/up (split-K partials), SiLU * up of the summed partials,
down (routing weight), combine.

Both GEMMs run "swapped": a program computes out^T [BN weight rows, BM tokens] = W [BN, k] . X^T [k, BM],
so the weight rows fill the tensor core's M side and the few tokens of an expert its N side (>= 16,
padding masked).  Grid (G, BN block of output rows, [split x] token tile): program g loops over the active
experts a = g, g + G, ... < n_active, reading the local expert id active[a] and its token count from the
routing workspace (G is a static bound from the launcher: a few waves of programs, at most min(e_local,
t * K), so that programs past the data-dependent n_active are few).  For each expert a program takes token
tiles z, z + MT, ... and, for each, streams its k range.
Small token counts give few (expert, row block) pairs, so gate/up splits k over programs and writes fp32
partials [splits, t*K, 2i]; silu_mul_kernel sums them once in a fixed order (deterministic, no atomics, no
memset) into h [t*K, i], which down reads like gate/up reads x.

INT4 (plugins/moe_w4a16/layout.py): a [BN, 32] int32 tile of a 256-block holds 8 nibble planes;
plane p is the K-contiguous [BN, 32] slice k = 256 b + 32 p + (0..31) of one scale group.  The plane is
dequantised in registers (`_plane`: shift, mask, or with 0x4B000000, one fp32 subtraction, times the
group scale, one rounding to x's dtype, as the reference's dequantise-then-cast) and fed to the dot;
the dots of a k block chain on one accumulator (`_kblock`).  With bf16 tokens and bf16 scales on the GPU
(PACKED), planes p and p + 4 are dequantised together, two weights per bf16x2 instruction
(`_plane_pair`).  The token operand is loaded [BM, 32] (k contiguous,
16-byte vectors, so Triton pipelines it with cp.async like the weights) and transposed in shared memory.
Scales: per plane [BN] loads, or (SCALE_TILE) one [BN, 8] tile per k block (any scale strides).
Dense (bf16 / fp32 checkpoints): the same loop reads the weights directly, no scales.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins.common.pdl import pdl_prologue


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b in fp32; DOT_PREC "interp" (TRITON_INTERPRET runs, whose bf16 dot is wrong) multiplies
    fp32 copies, "ieee" fp32 operands exactly, "tf32" the operands as they are (bf16 on the GPU)."""
    if DOT_PREC == "interp":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _plane(w, P: tl.constexpr, scale, dtype: tl.constexpr):
    """Nibble plane P of int32 words w [BN, 32], dequantised: q * scale [BN] -> [BN, 32] in dtype.

    (v | 0x4B000000) read as fp32 is 2^23 + v exactly (v = q + 8 in [0, 15]), so one subtraction gives q;
    the product is rounded once to dtype, as the reference's dequantise-then-cast does."""
    q = (((w >> (4 * P)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # [BN, 32] q exactly
    return (q * scale[:, None]).to(dtype)


@triton.jit
def _plane_pair(ws, s_lo, s_hi):
    """Nibble planes P and P + 4 of int32 words shifted right by 4P (ws [BN, 32]), dequantised two weights per
    instruction -> (q_P * s_lo, q_P+4 * s_hi), two [BN, 32] bf16 (s_lo, s_hi [BN] bf16).

    The two planes are 16 bits apart, so (ws & 0x000F000F) | 0x43004300 is the bf16 pair (128 + v_P, 128 + v_P+4)
    (v = q + 8); one bf16x2 subtraction of 136 gives q exactly and one bf16x2 multiply by the scale pair rounds
    q * s once, as _plane does (sm_90 PTX: sub / mul .bf16x2)."""
    s2 = (s_lo.to(tl.uint16, bitcast=True).to(tl.uint32)
          | (s_hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)).to(tl.int32, bitcast=True)  # [BN] (s_lo, s_hi)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, m;
        lop3.b32 t, $2, 0x000F000F, 0x43004300, 0xEA;
        mov.b32 m, 0x43084308;
        sub.rn.bf16x2 t, t, m;
        mul.rn.bf16x2 t, t, $3;
        mov.b32 {$0, $1}, t;
        }""",
        constraints="=h,=h,r,r", args=[ws, tl.broadcast_to(s2[:, None], ws.shape)],
        dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _kblock(acc, rows, mmask, w_e, s_e, rn, nmask, kb, kb_ok, K, stride_wn, stride_sn, stride_sg,
            INT4: tl.constexpr, PACKED: tl.constexpr, SCALE_TILE: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc [BN, BM] + W[rn, k] . X[rows, k]^T over the 256 k of block kb (k < K; nothing when not kb_ok).

    rows [BM] row pointers of the token operand (x or h); W: INT4 planes (8 per int32 word, dequantised in
    registers: PACKED two per instruction for bf16 tokens and bf16 scales, else one by one) or dense rows."""
    rj = tl.arange(0, 32)
    if INT4:
        w = tl.load(w_e + rn[:, None] * stride_wn + kb * 32 + rj[None, :], mask=nmask[:, None] & kb_ok,
                    other=0)  # [BN, 32] int32: 8 nibble planes of 32 k each
    if PACKED:
        for pp in tl.static_range(4):
            rk_lo = kb * 256 + pp * 32 + rj  # [32] plane pp; plane pp + 4 is 128 k further
            x_lo = tl.load(rows[:, None] + rk_lo[None, :], mask=mmask[:, None] & ((rk_lo < K) & kb_ok)[None, :],
                           other=0.0)  # [BM, 32]
            x_hi = tl.load(rows[:, None] + (rk_lo + 128)[None, :],
                           mask=mmask[:, None] & ((rk_lo + 128 < K) & kb_ok)[None, :], other=0.0)
            s_lo = tl.load(s_e + rn * stride_sn + (kb * 8 + pp) * stride_sg, mask=nmask & kb_ok, other=0.0)
            s_hi = tl.load(s_e + rn * stride_sn + (kb * 8 + pp + 4) * stride_sg, mask=nmask & kb_ok, other=0.0)
            w_lo, w_hi = _plane_pair(w >> (4 * pp), s_lo, s_hi)  # [BN, 32] bf16 each
            acc = _dot(w_lo, tl.trans(x_lo), acc, DOT_PREC)
            acc = _dot(w_hi, tl.trans(x_hi), acc, DOT_PREC)
    else:
        if INT4:
            s8 = w  # placeholder when the scales are loaded per plane
            if SCALE_TILE:
                s8 = tl.load(s_e + rn[:, None] * stride_sn + (kb * 8 + tl.arange(0, 8))[None, :] * stride_sg,
                             mask=nmask[:, None] & kb_ok, other=0.0).to(tl.float32)  # [BN, 8] group scales
        for p in tl.static_range(8):
            rk = kb * 256 + p * 32 + rj  # [32]
            kmask = (rk < K) & kb_ok
            xk = tl.load(rows[:, None] + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, 32]
            if INT4:
                sc = _plane_scale(s_e, s8, rn, nmask & kb_ok, kb * 8 + p, stride_sn, stride_sg, p, SCALE_TILE)
                wk = _plane(w, p, sc, xk.dtype)  # [BN, 32]
            else:
                wk = tl.load(w_e + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                             other=0.0)  # [BN, 32]
            acc = _dot(wk, tl.trans(xk), acc, DOT_PREC)
    return acc


@triton.jit
def _plane_scale(s_e, s8, rn, nmask, g, stride_sn, stride_sg, P: tl.constexpr, SCALE_TILE: tl.constexpr):
    """The [BN] scales of group g (= 8 kb + P) of rows rn: picked from the kb's [BN, 8] tile s8 when
    SCALE_TILE, else loaded on their own."""
    if SCALE_TILE:
        return tl.sum(tl.where(tl.arange(0, 8)[None, :] == P, s8, 0.0), axis=1)
    else:
        return tl.load(s_e + rn * stride_sn + g * stride_sg, mask=nmask, other=0.0).to(tl.float32)


@triton.jit
def _active_expert(a, counts_ptr, active_ptr, w_ptr, s_ptr, stride_we, stride_se):
    """The a-th active expert (a < n_active = counts[e_local]): (local id e, its slot count, its weights,
    its scales)."""
    e = tl.load(active_ptr + a)
    return e, tl.load(counts_ptr + e), w_ptr + e.to(tl.int64) * stride_we, s_ptr + e.to(tl.int64) * stride_se


@triton.jit
def _token_tile(lists_ptr, e, T, m0, cnt, BM: tl.constexpr):
    """Slots [m0, m0 + BM) of expert e's list: (slot ids [BM], valid [BM])."""
    rm = m0 + tl.arange(0, BM)
    mmask = rm < cnt
    return tl.load(lists_ptr + e * T + rm, mask=mmask, other=0), mmask


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, s_ptr, part_ptr, counts_ptr, active_ptr, lists_ptr,
                   T, D, N2, e_local, n_slots, stride_we, stride_wn, stride_se, stride_sn, stride_sg,
                   TOPK: tl.constexpr, INT4: tl.constexpr, N_KB: tl.constexpr, KB_PER: tl.constexpr,
                   MT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, PACKED: tl.constexpr,
                   SCALE_TILE: tl.constexpr, DOT_PREC: tl.constexpr):
    """part[split, s, n] = sum over this split's k of w13_e[n, k] x[s // K, k], for the slots s of expert e.

    x [t, d]; w13 int32 [e, 2i, kp/8] (INT4) or [e, 2i, d] (dense); scales [e, kp/32, 2i] (any strides);
    part [splits, t*K, 2i] fp32 (gate rows then up rows; silu_mul_kernel sums the splits).
    Grid (G, BN-row block of the 2i rows, split * MT + token tile): program (g, ., .) takes active experts
    g, g + G, ...; split-K over blocks of 256 k (KB_PER per split) gives small token counts enough programs;
    token tiles past MT loop.
    """
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_z = tl.program_id(2)
    split = pid_z // MT
    part = part_ptr + split.to(tl.int64) * n_slots * N2
    rn = pid_n * BN + tl.arange(0, BN)  # [BN] rows of w13 (gate rows < i <= up rows)
    nmask = rn < N2
    ae = pid_e
    while ae < tl.load(counts_ptr + e_local):  # active experts pid_e, pid_e + G, ... (G = grid dim 0)
        e, cnt, w_e, s_e = _active_expert(ae, counts_ptr, active_ptr, w_ptr, s_ptr, stride_we, stride_se)
        m0 = (pid_z % MT) * BM
        while m0 < cnt:  # (a while, not range(cnt): the interpreter cannot range over a loaded value)
            slot, mmask = _token_tile(lists_ptr, e, T, m0, cnt, BM)  # [BM]
            x_rows = x_ptr + (slot // TOPK).to(tl.int64) * D  # [BM]
            acc = tl.zeros([BN, BM], tl.float32)
            for kk in range(0, KB_PER):  # constexpr trip count: the interpreter cannot range over a runtime int
                kb = split * KB_PER + kk
                acc = _kblock(acc, x_rows, mmask, w_e, s_e, rn, nmask, kb, kb < N_KB, D, stride_wn, stride_sn,
                              stride_sg, INT4, PACKED, SCALE_TILE, DOT_PREC)
            tl.store(part + slot[None, :].to(tl.int64) * N2 + rn[:, None], acc, mask=nmask[:, None] & mmask[None, :])
            m0 += MT * BM
        ae += tl.num_programs(0)


@triton.jit
def silu_mul_kernel(part_ptr, h_ptr, idx_ptr, I, n_slots, e_start, e_local, SPLITS: tl.constexpr,
                    BI: tl.constexpr):
    """h[s, j] = silu(gate) * up for the slots s routed to a local expert, gate / up the sums over the SPLITS
    partials part[:, s, j] / part[:, s, I + j] (fixed order: deterministic), rounded once to h's dtype.

    part [SPLITS, t*K, 2i] fp32 -> h [t*K, i].  Grid (slot, BI block of i).  The partials are read once here
    instead of by every row block of down_kernel."""
    s = tl.program_id(0).to(tl.int64)
    rj = tl.program_id(1) * BI + tl.arange(0, BI)  # [BI]
    le = tl.load(idx_ptr + s) - e_start
    m = (rj < I) & (le >= 0) & (le < e_local)
    g = tl.zeros([BI], tl.float32)
    u = tl.zeros([BI], tl.float32)
    for sp in tl.static_range(SPLITS):
        row = part_ptr + (sp * n_slots + s) * (2 * I)
        g += tl.load(row + rj, mask=m, other=0.0)
        u += tl.load(row + I + rj, mask=m, other=0.0)
    tl.store(h_ptr + s * I + rj, (g / (1.0 + tl.exp(-g)) * u).to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def down_kernel(h_ptr, w_ptr, s_ptr, topw_ptr, out_ptr, counts_ptr, active_ptr, lists_ptr,
                T, D, I, e_local, stride_we, stride_wn, stride_se, stride_sn, stride_sg,
                INT4: tl.constexpr, N_KB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, PACKED: tl.constexpr,
                SCALE_TILE: tl.constexpr, DOT_PREC: tl.constexpr):
    """out[s, n] = topk_w[s] * (down_e[n] . h[s]), h = silu(gate) * up from silu_mul_kernel.

    h [t*K, i] (x's dtype); w2 int32 [e, d, kp/8] (INT4) or [e, d, i] (dense); scales [e, kp/32, d];
    out [t*K, d] (x's dtype).  Grid (G, BN block of d, token tile): program (g, ., .) takes active experts
    g, g + G, ...
    """
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)  # [BN] output features
    nmask = rn < D
    ae = pid_e
    while ae < tl.load(counts_ptr + e_local):  # active experts pid_e, pid_e + G, ... (G = grid dim 0)
        e, cnt, w_e, s_e = _active_expert(ae, counts_ptr, active_ptr, w_ptr, s_ptr, stride_we, stride_se)
        m0 = tl.program_id(2) * BM
        while m0 < cnt:  # (a while, not range(cnt): the interpreter cannot range over a loaded value)
            slot, mmask = _token_tile(lists_ptr, e, T, m0, cnt, BM)  # [BM]
            h_rows = h_ptr + slot.to(tl.int64) * I  # [BM]
            acc = tl.zeros([BN, BM], tl.float32)
            for kb in range(0, N_KB):  # N_KB constexpr: the interpreter cannot range over a runtime int
                acc = _kblock(acc, h_rows, mmask, w_e, s_e, rn, nmask, kb, True, I, stride_wn, stride_sn, stride_sg,
                              INT4, PACKED, SCALE_TILE, DOT_PREC)
            tw = tl.load(topw_ptr + slot, mask=mmask, other=0.0)  # [BM] fp32 routing weights
            out = acc * tw[None, :]
            tl.store(out_ptr + slot[None, :].to(tl.int64) * D + rn[:, None], out.to(out_ptr.dtype.element_ty),
                     mask=nmask[:, None] & mmask[None, :])
            m0 += tl.num_programs(2) * BM
        ae += tl.num_programs(0)


@triton.jit
def combine_kernel(out_ptr, idx_ptr, y_ptr, counts_ptr, D, e_start, e_local, K: tl.constexpr, BD: tl.constexpr,
                   BC: tl.constexpr, PDL: tl.constexpr):
    """y[t] = sum over the token's K slots routed to local experts of out[t*K + j] (fp32 sum, slot order).

    Program (0, 0) also zeroes counts [e_local + 1] (BC >= e_local + 1): the route kernel of the next call
    counts into it.  This kernel runs after the last reader of counts (the down kernel) in stream order, so
    the workspace leaves every call as it came (counts zero) and no memset launch precedes the route kernel."""
    pdl_prologue(PDL)  # counts are zeroed below: after the down kernel, its last reader, completed
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        rc = tl.arange(0, BC)
        tl.store(counts_ptr + rc, tl.zeros([BC], tl.int32), mask=rc < e_local + 1)
    t = tl.program_id(0).to(tl.int64)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = rd < D
    acc = tl.zeros([BD], tl.float32)
    for j in tl.static_range(K):
        le = tl.load(idx_ptr + t * K + j) - e_start
        ok = (le >= 0) & (le < e_local)
        v = tl.load(out_ptr + (t * K + j) * D + rd, mask=dmask & ok, other=0.0)
        acc += v.to(tl.float32)
    tl.store(y_ptr + t * D + rd, acc.to(y_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _shared_down_tile(h_ptr, w_ptr, rt, rd, tmask, dmask, I, stride_h, BT: tl.constexpr, BD: tl.constexpr,
                      BI: tl.constexpr, N_KI: tl.constexpr, DOT_PREC: tl.constexpr):
    """h [rt, I] . w [rd, I]^T in fp32: [BT, BD].  h is read through L2 (.cg): the route kernel writes it."""
    shared = tl.zeros([BT, BD], tl.float32)
    ri = tl.arange(0, BI)
    for kb in range(N_KI):  # constexpr trip count (the interpreter cannot range over a runtime int)
        ik = kb * BI + ri  # [BI]
        imask = ik < I
        hk = tl.load(h_ptr + rt[:, None] * stride_h + ik[None, :], mask=tmask[:, None] & imask[None, :], other=0.0,
                     cache_modifier=".cg")
        wk = tl.load(w_ptr + rd[:, None] * I + ik[None, :], mask=dmask[:, None] & imask[None, :], other=0.0)
        shared = _dot(hk, tl.trans(wk), shared, DOT_PREC)  # [BT, BI] . [BI, BD]
    return shared


@triton.jit
def combine_shared_kernel(out_ptr, idx_ptr, y_ptr, counts_ptr, h_ptr, w_ptr, T, D, I, stride_h, e_start, e_local,
                          K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BI: tl.constexpr, N_KI: tl.constexpr,
                          BC: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr = False,
                          SHARED_F: tl.constexpr = False):
    """combine_kernel with the shared expert's down projection folded in: for the tile of BT tokens and BD columns,
    y = round(round(sum of the local slots of out, fp32, slot order) + h [t, I] . w [D, I]^T in fp32): the routed
    output rounded as combine_kernel returns it, then the GEMM with beta = 1 (reference.shared_down_reference).
    Grid (cdiv(T, BT), cdiv(D, BD)); program (0, 0) re-zeroes counts as combine_kernel does.
    EARLY: the shared product before the PDL wait, so its weight stream overlaps the down kernel's tail.  h is the
    route kernel's output, three launches back: every kernel between lets its dependents launch only after its own
    wait, so the route kernel has completed whenever this grid runs.  Only out (the down kernel's) and the counts
    zeroing wait.  The same arithmetic either way.  SHARED_F: h_ptr is the product itself, fp32 [T, D] (row stride
    stride_h), formed by the previous kernel: loaded after the wait and added the same way (w_ptr unused)."""
    rt = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)  # [BT] tokens
    rd = tl.program_id(1) * BD + tl.arange(0, BD)  # [BD] columns
    tmask, dmask = rt < T, rd < D
    if SHARED_F:
        pass  # the product is loaded after the wait
    elif EARLY:
        shared = _shared_down_tile(h_ptr, w_ptr, rt, rd, tmask, dmask, I, stride_h, BT, BD, BI, N_KI, DOT_PREC)
    pdl_prologue(PDL)  # counts are zeroed below: after the down kernel, its last reader, completed
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        rc = tl.arange(0, BC)
        tl.store(counts_ptr + rc, tl.zeros([BC], tl.int32), mask=rc < e_local + 1)
    acc = tl.zeros([BT, BD], tl.float32)
    for j in tl.static_range(K):
        le = tl.load(idx_ptr + rt * K + j, mask=tmask, other=-1) - e_start  # [BT] local expert of slot j
        ok = (le >= 0) & (le < e_local) & tmask
        v = tl.load(out_ptr + (rt * K + j)[:, None] * D + rd[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        acc += v.to(tl.float32)
    routed = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # [BT, BD] the routed output, rounded
    if SHARED_F:
        shared = tl.load(h_ptr + rt[:, None] * stride_h + rd[None, :], mask=tmask[:, None] & dmask[None, :],
                         other=0.0).to(tl.float32)
    elif not EARLY:
        shared = _shared_down_tile(h_ptr, w_ptr, rt, rd, tmask, dmask, I, stride_h, BT, BD, BI, N_KI, DOT_PREC)
    tl.store(y_ptr + rt[:, None] * D + rd[None, :], (routed + shared).to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & dmask[None, :])
