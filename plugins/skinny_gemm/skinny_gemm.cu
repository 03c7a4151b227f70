// skinny_gemm: y[t, n] = x[t, k] . w[n, k]^T (+ c[t, n]) for a few tokens (t <= 32), bf16 inputs, fp32
// accumulation, rounded once to bf16 or written as fp32: the decode round's dense GEMMs, which read each weight
// once and are bound by the bytes of the weights (K2.6 TP8, per layer: qkv_a 30 MB, o_proj 15 MB, router + shared
// gate_up 13 MB, q_b 4.7 MB; cuBLAS reads them at 17-55 % of HBM's rate, benchmarks/results/dense_gemm.json).
//
// Work.  A row group is 16 consecutive weight rows (contiguous bytes of w).  CTA (c, s) takes the RG row groups
// RG c .. RG c + RG - 1 (RG = 1, or 2 for t > 8: 32 consecutive rows) and the s-th of KS equal ranges of k's
// 32-column blocks; its W warps split that range (warp i takes blocks i, i + W, ...).  Per block a lane loads 16
// bytes of two rows (g, g + 8) of each row group and 16 bytes of each of its token columns (once, for every row
// group) straight from global memory into registers, U blocks ahead of the math, and multiplies them on
// mma.sync m16n8k16: the weights are A (16 rows), the tokens B (8 per tile, TT tiles).  Inside a block the k
// order is permuted the same way for A and B (a lane's 8 contiguous columns feed its fragment registers of two k
// steps), which leaves every dot product unchanged.  The CTA's warps are then summed through shared memory in
// warp order; with KS > 1 each CTA stores that partial tile, and the last CTA of the CTA column to finish (a
// ticket counter) sums the KS partials in split order and writes y.  So the sum order of an output element depends
// on (n, k, W, KS) only (launch.py picks W and KS from n and k), not on RG, TT or U: a token's result does not
// depend on t or on the other tokens, and an AR step and a tree round compute the same bits for the same row.
// RG = 2 halves the token bytes the CTAs read from L2 (n / 16 x t x k x 2 with RG = 1: at t = 16 the weights' size).
//
// PDL (sm_90+; launched with programmatic stream serialization): the weights never change during a round, so
// their L2 prefetch (flags & FLAG_PREFETCH) or each warp's first U blocks of them into registers
// (FLAG_EARLY_WEIGHTS) go out before the wait for the predecessor grid; x, c, y and the workspace are touched only
// after it.  The next kernel may launch once every CTA has passed the wait, or, with
// FLAG_LATE_TRIGGER, once every CTA has finished its k loop (its waiting CTAs then do not take SM slots from this
// kernel's later CTAs).
//
// bf16 through PTX on raw 32-bit registers; plugins/common/cuda/hopper.cuh (pdl_wait / pdl_trigger, l2_prefetch) is
// its one header (cubin.py inlines it for NVRTC).

#include "../common/cuda/hopper.cuh"  // pdl_wait, pdl_trigger, l2_prefetch, ld_stream

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;  // no <cstddef>: NVRTC compiles this with no headers

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

#define PF_CHUNK 16384u

// Token rows and c: written by the predecessor grid, which under PDL may still run when this CTA starts, so never
// through the non-coherent path (.nc assumes the data does not change while the kernel runs): from L2 (.cg), where
// every CTA finds them after the wait.
__device__ __forceinline__ uint4 ld_tokens(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ u16 ld_c(const u16* p) {
    u16 r;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ float ld_partial(const float* p) {  // another CTA's partial: from L2, never L1
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

#define FLAG_PREFETCH 1  // flags: this CTA's weights into L2 before the wait
#define FLAG_LATE_TRIGGER 2  // flags: the dependents launch after this CTA's k loop, not at its start
#define FLAG_EARLY_WEIGHTS 4  // flags: each warp's first U blocks of weights loaded into registers before the wait

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ float from_bf16(u16 v) { return __uint_as_float(((u32)v) << 16); }

// Output element e of a CTA's tile (token tok = e / 16, row = e % 16: 16 threads write 16 consecutive rows of one
// token) -> its place in the fragment tiles [TT][4][32]: C register i of lane (g, q) is row g + 8 (i / 2), token
// column 2 q + i % 2 of tile tok / 8.
__device__ __forceinline__ int frag_index(int tok, int row) {
    const int col = tok & 7;
    const int i = (row >= 8 ? 2 : 0) + (col & 1);
    const int lane = ((row & 7) << 2) | (col >> 1);
    return ((tok >> 3) * 4 + i) * 32 + lane;
}

// FRAG: w is in fragment order (fragment_order.py: [groups, k / 32, 2, 32, 8], rows past n zero): lane (g, q)'s 16
// bytes of rows g and g + 8 of a block are at lane and 32 + lane of the block's 1 KB, so a warp reads 512 contiguous
// bytes per load; the same values as the row-major loads, the same math: the same bits.
template <int TT, int RG, int U, bool OUT_F32, bool ADD_C, bool FRAG = false>
__device__ __forceinline__ void skinny(const u16* __restrict__ x, const u16* __restrict__ w, void* __restrict__ y,
                                       const u16* __restrict__ c, float* __restrict__ parts, int* __restrict__ tickets,
                                       int t, int n, int k, int ldx, int ldy, int ldc, int ks, int flags) {
    extern __shared__ float red[];  // [W warps][RG][TT][4][32] accumulators in fragment order, then the ticket
    static_assert(RG == 1 || RG == 2, "one or two row groups per CTA");
    constexpr int CTA_ROWS = 16 * RG;  // RG row groups of 16 consecutive weight rows
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int r0 = blockIdx.x * CTA_ROWS, rows = imin(CTA_ROWS, n - r0);
    const int nkb = k >> 5;  // 32-column blocks of k
    const int per = (nkb + ks - 1) / ks;
    const int kb_lo = imin(nkb, (int)blockIdx.y * per), kb_hi = imin(nkb, kb_lo + per);  // may be empty

    if (FRAG && (flags & FLAG_PREFETCH)) {  // fragment order: each row group's k range is one contiguous range
        for (int h = 0; h < RG; ++h) {
            const int rg = imin((int)blockIdx.x * RG + h, (n + 15) / 16 - 1);
            const char* base = reinterpret_cast<const char*>(w) + ((u64)rg * nkb + kb_lo) * 1024u;
            const u32 span = (u32)(kb_hi - kb_lo) * 1024u;
            for (u32 off = threadIdx.x * PF_CHUNK; off < span; off += blockDim.x * PF_CHUNK)
                l2_prefetch(base + off, span - off < PF_CHUNK ? span - off : PF_CHUNK);
        }
    } else if (flags & FLAG_PREFETCH) {  // this CTA's weights (rows r0.. of its k range) into L2 before the wait
        const char* base = reinterpret_cast<const char*>(w + (u64)r0 * k + (u64)kb_lo * 32);
        const u32 span = (u32)(kb_hi - kb_lo) * 64u;  // bytes of one row's range
        for (u32 i = threadIdx.x; i < (u32)rows * ((span + PF_CHUNK - 1) / PF_CHUNK); i += blockDim.x) {
            const u32 row = i % rows, off = (i / rows) * PF_CHUNK;
            if (off < span)
                l2_prefetch(base + (u64)row * k * 2 + off, span - off < PF_CHUNK ? span - off : PF_CHUNK);
        }
    }
    // rows past n (the last CTA's) read row n - 1 and are never stored; token columns past t read token 0 and are
    // never stored (an mma column depends on its own B column only)
    const uint4 *wa[RG], *wb[RG];  // rows g and g + 8 of each row group
    constexpr int KB_STRIDE = FRAG ? 64 : 4;  // uint4 from one block of a lane's row to the next
#pragma unroll
    for (int h = 0; h < RG; ++h) {
        if (FRAG) {  // a CTA's second row group past the last (odd groups) reads the last: never stored
            const u64 rg = (u64)imin((int)blockIdx.x * RG + h, (n + 15) / 16 - 1);
            wa[h] = reinterpret_cast<const uint4*>(w) + rg * nkb * 64 + lane;
            wb[h] = wa[h] + 32;
        } else {
            wa[h] = reinterpret_cast<const uint4*>(w + (u64)imin(r0 + 16 * h + g, n - 1) * k) + q;
            wb[h] = reinterpret_cast<const uint4*>(w + (u64)imin(r0 + 16 * h + g + 8, n - 1) * k) + q;
        }
    }
    uint4 a[U][RG], b[U][RG], xv[U][TT];  // a block's weights of every row group, its token columns once
    auto load_weights = [&](int kb0) {  // U blocks from kb0 (warp-uniform conditions)
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * warps;
            if (kb < kb_hi) {
#pragma unroll
                for (int h = 0; h < RG; ++h) {
                    a[u][h] = ld_stream(wa[h] + kb * KB_STRIDE);
                    b[u][h] = ld_stream(wb[h] + kb * KB_STRIDE);
                }
            }
        }
    };
    // FLAG_EARLY_WEIGHTS: the first blocks' weights (constant) go out before the wait, so their DRAM latency
    // overlaps the predecessor's tail; x, c, y and the workspace are touched only after it
    const bool early = (flags & FLAG_EARLY_WEIGHTS) != 0;
    if (early) load_weights(kb_lo + warp);
    pdl_wait();
    if (!(flags & FLAG_LATE_TRIGGER)) pdl_trigger();

    const uint4* xr[TT];
#pragma unroll
    for (int j = 0; j < TT; ++j) {
        const int tok = j * 8 + g;
        xr[j] = reinterpret_cast<const uint4*>(x + (u64)(tok < t ? tok : 0) * ldx) + q;
    }
    float acc[RG][TT][4];
#pragma unroll
    for (int h = 0; h < RG; ++h)
#pragma unroll
        for (int j = 0; j < TT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[h][j][i] = 0.f;

    // every accumulator acc[h][j] takes its mma's in block order, whatever RG and TT: the same sums as RG = 1
    for (int kb0 = kb_lo + warp; kb0 < kb_hi; kb0 += U * warps) {
        if (!early || kb0 != kb_lo + warp) load_weights(kb0);  // all loads of U blocks first, then the math
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * warps;
            if (kb < kb_hi) {
#pragma unroll
                for (int j = 0; j < TT; ++j) xv[u][j] = ld_tokens(xr[j] + kb * 4);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (kb0 + u * warps < kb_hi) {
#pragma unroll
                for (int s = 0; s < 2; ++s) {  // k step s: columns 4s..4s+3 of each lane's 8
#pragma unroll
                    for (int h = 0; h < RG; ++h) {  // both row groups take the same token registers
                        const u32 a0 = word(a[u][h], 2 * s), a1 = word(b[u][h], 2 * s);
                        const u32 a2 = word(a[u][h], 2 * s + 1), a3 = word(b[u][h], 2 * s + 1);
#pragma unroll
                        for (int j = 0; j < TT; ++j)
                            mma_bf16(acc[h][j], a0, a1, a2, a3, word(xv[u][j], 2 * s), word(xv[u][j], 2 * s + 1));
                    }
                }
            }
        }
    }
    if (flags & FLAG_LATE_TRIGGER) pdl_trigger();  // the weights are read: the next kernel may take the SM slots

#pragma unroll
    for (int h = 0; h < RG; ++h)
#pragma unroll
        for (int j = 0; j < TT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[(((warp * RG + h) * TT + j) * 4 + i) * 32 + lane] = acc[h][j][i];
    __syncthreads();
    const int tile = RG * TT * 128;  // a CTA's outputs: row group h's fragments at h * TT * 128
    if (ks > 1) {  // store this split's tile, then the CTA column's last CTA sums the splits in order
        float* mine = parts + ((u64)blockIdx.x * ks + blockIdx.y) * tile;
        for (int e = threadIdx.x; e < tile; e += blockDim.x) {
            float s = 0.f;
            for (int v = 0; v < warps; ++v) s += red[v * tile + e];
            mine[e] = s;
        }
        if (!last_arrival(tickets + blockIdx.x, ks, reinterpret_cast<int*>(red + warps * tile))) return;
    }
    // element e: token e / CTA_ROWS, row e % CTA_ROWS (consecutive threads write consecutive rows of one token)
    constexpr int ROW_BITS = RG == 2 ? 5 : 4;  // log2(CTA_ROWS): shifts, as the e >> 4 of RG = 1 always was
    for (int e = threadIdx.x; e < tile; e += blockDim.x) {
        const int tok = e >> ROW_BITS, row = e & (CTA_ROWS - 1);
        if (tok >= t || row >= rows) continue;
        const int f = (row >> 4) * TT * 128 + frag_index(tok, row & 15);
        float s = 0.f;
        if (ks > 1) {
            const float* col_parts = parts + (u64)blockIdx.x * ks * tile + f;
            for (int v = 0; v < ks; ++v) s += ld_partial(col_parts + (u64)v * tile);
        } else {
            for (int v = 0; v < warps; ++v) s += red[v * tile + f];
        }
        const u64 col = (u64)r0 + row;
        if (ADD_C) s += from_bf16(ld_c(c + (u64)tok * ldc + col));
        if (OUT_F32)
            reinterpret_cast<float*>(y)[(u64)tok * ldy + col] = s;
        else
            reinterpret_cast<u16*>(y)[(u64)tok * ldy + col] = to_bf16(s);
    }
}

// Variants (launch.py picks): TT token tiles of 8 (t <= 8, 16, 24, 32), RG row groups per CTA (1, or 2 for t > 8),
// U blocks in flight per warp (RG KB of weights each), bf16 or fp32 out, with or without c (bf16 out only).  Up to
// 512 threads (W = 16 warps) per CTA: <= 128 registers.  RG = 1 keeps the names it had: t<TT>_u<U>_<out>.
#define SKINNY(TT, RG, U, TAG, NAME, OUT_F32, ADD_C)                                                               \
    extern "C" __global__ void __launch_bounds__(512) kdtree_skinny_gemm_t##TT##TAG##_u##U##_##NAME(               \
        const u16* x, const u16* w, void* y, const u16* c, float* parts, int* tickets, int t, int n, int k,          \
        int ldx, int ldy, int ldc, int ks, int flags) {                                                            \
        skinny<TT, RG, U, OUT_F32, ADD_C>(x, w, y, c, parts, tickets, t, n, k, ldx, ldy, ldc, ks, flags);           \
    }

#define OUTS_RG(TT, RG, U, TAG)                                                                                    \
    SKINNY(TT, RG, U, TAG, bf16, false, false) SKINNY(TT, RG, U, TAG, bf16_c, false, true)                        \
    SKINNY(TT, RG, U, TAG, f32, true, false)
#define OUTS(TT, U) OUTS_RG(TT, 1, U, )
#define OUTS_R2(TT, U) OUTS_RG(TT, 2, U, _r2)
// launch.U_VARIANTS: <= 128 registers, no spill (ptxas -v, sm_90)
OUTS(1, 8) OUTS(1, 4) OUTS(2, 6) OUTS(2, 4) OUTS(3, 5) OUTS(3, 3) OUTS(4, 4) OUTS(4, 2)
OUTS_R2(2, 4) OUTS_R2(2, 2) OUTS_R2(3, 3) OUTS_R2(3, 2) OUTS_R2(4, 2) OUTS_R2(4, 1)

// Fragment-order weights (fragment_order.py), one token tile, one row group per CTA, U = 8: t1_u8_<out>_frag
#define SKINNY_FRAG(NAME, OUT_F32, ADD_C)                                                                          \
    extern "C" __global__ void __launch_bounds__(512) kdtree_skinny_gemm_t1_u8_##NAME##_frag(                      \
        const u16* x, const u16* w, void* y, const u16* c, float* parts, int* tickets, int t, int n, int k,          \
        int ldx, int ldy, int ldc, int ks, int flags) {                                                            \
        skinny<1, 1, 8, OUT_F32, ADD_C, true>(x, w, y, c, parts, tickets, t, n, k, ldx, ldy, ldc, ks, flags);       \
    }
SKINNY_FRAG(bf16, false, false) SKINNY_FRAG(bf16_c, false, true) SKINNY_FRAG(f32, true, false)
