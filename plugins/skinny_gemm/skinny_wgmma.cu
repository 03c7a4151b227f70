// skinny_wgmma: y [t, n] = x [t, k] . w [n, k]^T (+ c [t, n]) for t <= 32 tokens on Hopper's warpgroup MMA (sm_90a),
// bf16 in, fp32 sums, bf16 or fp32 out: the dense GEMMs of a DDTree round (9..32 tokens), where skinny_gemm.cu's
// mma.sync tiles re-read the token columns per warp and lose to cuBLAS (NOTES.md).  reference.py is the oracle.
//
// Weights are the M side (64 rows a CTA), the tokens the N side (NT = 8, 16, 24 or 32 slots; rows past t read as
// zeros): per 64-column k tile one warpgroup issues 4 x wgmma m64nNTk16 with both operands in shared memory.  The
// tiles come through the tensor memory accelerator (one thread issues them: a 64 x 64 box of w, 8 KB, and an NT x 64
// box of x, NT x 128 B, 128-byte swizzle written by the copy) into a ring of STAGES stages, each completing on its
// mbarrier; a stage is refilled once every warp has passed the barrier after the wgmmas that read it, so STAGES - 1
// tiles (~84 KB at STAGES 8) stay in flight a CTA.
//
// Grid (n / 64 row blocks, KS k splits): split s takes k tiles [s per, (s + 1) per), per = cdiv(k / 64, KS).  KS = 1:
// the CTA writes y.  KS > 1: each CTA writes its partial tile [64 x NT] fp32 to parts[s][row block], then takes a
// ticket of its row block; the last of the KS sums the KS partials in split order (the same order whichever CTA comes
// last), writes y and puts the ticket back to zero for the next call.
//
// PDL: weights do not depend on the predecessor grid, so the first STAGES tiles of w are requested before
// griddepcontrol.wait and those of x after it; then the next grid may launch (it waits for this one's completion).
// plugins/common/cuda/hopper.cuh is its one header (cubin.py inlines it for NVRTC).

#define KDTREE_ARCH_FEATURES  // plugins/common/cubin.py: compiled for sm_90a where the arch is sm_90 (wgmma)

#include "../common/cuda/hopper.cuh"  // smem_u32, pdl_*, mbar_*, TensorMap, tma_2d, smem_desc, wgmma_*

typedef unsigned short u16;

#define BM 64  // weight rows a CTA
#define BK 64  // k columns a box (128 bytes of bf16: one swizzle row)
#define BOX_W_BYTES (BM * BK * 2)  // 8 KB a weight box
#define THREADS 128  // one warpgroup

// D [64 x NT] += A [64 x 16] . B [NT x 16]^T, fp32 accumulators: NT / 2 a thread.
template <int NT>
__device__ __forceinline__ void wgmma_tile(float* d, u64 da, u64 db);

template <>
__device__ __forceinline__ void wgmma_tile<8>(float* d, u64 da, u64 db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(da), "l"(db));
#else
    __trap();
#endif
}

template <>
__device__ __forceinline__ void wgmma_tile<16>(float* d, u64 da, u64 db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, "
                 "%7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
                 : "l"(da), "l"(db));
#else
    __trap();
#endif
}

template <>
__device__ __forceinline__ void wgmma_tile<24>(float* d, u64 da, u64 db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n24k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, "
                 "%7, %8, %9, %10, %11}, %12, %13, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
                 : "l"(da), "l"(db));
#else
    __trap();
#endif
}

template <>
__device__ __forceinline__ void wgmma_tile<32>(float* d, u64 da, u64 db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, "
                 "%7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15])
                 : "l"(da), "l"(db));
#else
    __trap();
#endif
}

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ float from_bf16(u16 v) { return __uint_as_float(((u32)v) << 16); }

// Accumulator element e (0 .. NT / 2 - 1) of this thread: row 16 warp + lane / 4 (+ 8 for e % 4 >= 2), column (token)
// 8 (e / 4) + 2 (lane % 4) + e % 2 (wgmma's D layout).
__device__ __forceinline__ int acc_row(int e, int warp, int lane) { return warp * 16 + (lane >> 2) + ((e & 2) << 2); }
__device__ __forceinline__ int acc_col(int e, int lane) { return (e >> 2) * 8 + 2 * (lane & 3) + (e & 1); }

// Stage i of a CTA: KB boxes of 64 k columns (KB x 64 contiguous columns of each weight row), the weight boxes at
// w_at and the token boxes at x_at, all completing on bar; nb <= KB boxes where the stage runs past k.
__device__ __forceinline__ void stage_weights(const TensorMap* w_map, u32 w_at, int kt, int nb, int row, u32 bar) {
    for (int b = 0; b < nb; ++b) tma_2d(w_at + b * BOX_W_BYTES, w_map, (kt + b) * BK, row, bar);
}
template <int NT>
__device__ __forceinline__ void stage_tokens(const TensorMap* x_map, u32 x_at, int kt, int nb, u32 bar) {
    for (int b = 0; b < nb; ++b) tma_2d(x_at + b * (NT * BK * 2), x_map, (kt + b) * BK, 0, bar);
}

// out: y [t, n] (row stride ldy), bf16 (OUT_F32 0) or fp32; c [t, n] bf16 (row stride ldc) added before the rounding
// where given (bf16 out only).  parts [KS][n / 64][64 x NT] fp32 and tickets [n / 64] int32 (zero between calls) when
// KS > 1.  KB boxes a stage, STAGES stages in the ring: (1, 8) takes 64 columns of a row at a time, (4, 4) 256.
template <int NT, int OUT_F32, int KB, int STAGES>
__device__ __forceinline__ void skinny_wgmma(const TensorMap& w_map, const TensorMap& x_map, void* y, const u16* c,
                                             float* parts, int* tickets, int t, int n, int k, int ldy, int ldc,
                                             int ks) {
    extern __shared__ unsigned char smem_raw[];
    constexpr u32 X_BOX = NT * BK * 2;
    constexpr u32 W_BYTES = KB * BOX_W_BYTES, STAGE = W_BYTES + KB * X_BOX;  // a multiple of 1024 for every NT
    const u32 raw = smem_u32(smem_raw);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;
    const u32 sb = raw + pad;  // stage i: w at sb + i STAGE, x after it
    const u32 bar = sb + STAGES * STAGE;  // STAGES mbarriers
    int* s_last = (int*)(smem_raw + pad + STAGES * STAGE + STAGES * 8);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rb = blockIdx.x, s = blockIdx.y;
    const int tiles = k / BK, stages = (tiles + KB - 1) / KB, per = (stages + ks - 1) / ks;
    const int st0 = s * per, count = max(min(st0 + per, stages) - st0, 0);
    auto boxes = [&](int i) { return min(KB, tiles - (st0 + i) * KB); };  // of stage i (the last may be short)

    if (tid == 0) {
        for (int i = 0; i < STAGES; ++i) mbar_init(bar + 8 * i, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (int i = 0; i < STAGES && i < count; ++i) {  // weights first: they do not wait for the predecessor
            mbar_expect_tx(bar + 8 * i, boxes(i) * (BOX_W_BYTES + X_BOX));
            stage_weights(&w_map, sb + i * STAGE, (st0 + i) * KB, boxes(i), rb * BM, bar + 8 * i);
        }
    }
    pdl_wait();  // x (and c) come from the predecessor grids
    if (tid == 0)
        for (int i = 0; i < STAGES && i < count; ++i)
            stage_tokens<NT>(&x_map, sb + i * STAGE + W_BYTES, (st0 + i) * KB, boxes(i), bar + 8 * i);
    __syncthreads();  // the mbarriers' init visible to every thread
    pdl_trigger();

    float acc[NT / 2];
#pragma unroll
    for (int e = 0; e < NT / 2; ++e) acc[e] = 0.f;
    for (int i = 0; i < count; ++i) {
        const int st = i % STAGES, nb = boxes(i);
        mbar_wait(bar + 8 * st, (i / STAGES) & 1);
        const u32 wa = sb + st * STAGE, xa = wa + W_BYTES;
        wgmma_fence();
#pragma unroll
        for (int b = 0; b < KB; ++b) {
            if (b < nb) {
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk)
                    wgmma_tile<NT>(acc, smem_desc(wa + b * BOX_W_BYTES + kk * 32, 16, 1024),
                                   smem_desc(xa + b * X_BOX + kk * 32, 16, 1024));
            }
        }
        wgmma_commit();
        wgmma_wait_all();
        __syncthreads();  // every warp's wgmmas have read stage st
        if (tid == 0 && i + STAGES < count) {
            const int j = i + STAGES, kt = (st0 + j) * KB;
            mbar_expect_tx(bar + 8 * st, boxes(j) * (BOX_W_BYTES + X_BOX));
            stage_weights(&w_map, wa, kt, boxes(j), rb * BM, bar + 8 * st);
            stage_tokens<NT>(&x_map, xa, kt, boxes(j), bar + 8 * st);
        }
    }

    if (ks > 1) {  // this split's partial, then the last CTA of the row block sums all KS in split order
        float* mine = parts + ((long long)s * gridDim.x + rb) * (BM * NT);
#pragma unroll
        for (int e = 0; e < NT / 2; ++e) mine[acc_col(e, lane) * BM + acc_row(e, warp, lane)] = acc[e];
        __threadfence();
        __syncthreads();
        if (tid == 0) *s_last = atomicAdd(tickets + rb, 1) == ks - 1;
        __syncthreads();
        if (!*s_last) return;
        __threadfence();
#pragma unroll
        for (int e = 0; e < NT / 2; ++e) acc[e] = 0.f;
        for (int j = 0; j < ks; ++j) {
            const float* p = parts + ((long long)j * gridDim.x + rb) * (BM * NT);
#pragma unroll
            for (int e = 0; e < NT / 2; ++e) acc[e] += __ldcg(p + acc_col(e, lane) * BM + acc_row(e, warp, lane));
        }
        if (tid == 0) tickets[rb] = 0;
    }
#pragma unroll
    for (int e = 0; e < NT / 2; ++e) {
        const int col = acc_col(e, lane), row = rb * BM + acc_row(e, warp, lane);
        if (col >= t || row >= n) continue;
        if (OUT_F32) {
            ((float*)y)[(long long)col * ldy + row] = acc[e];
        } else {
            const float v = c ? acc[e] + from_bf16(c[(long long)col * ldc + row]) : acc[e];
            ((u16*)y)[(long long)col * ldy + row] = to_bf16(v);
        }
    }
}

#define SKINNY_WGMMA_KERNEL(NAME, NT, OUT_F32, KB, STAGES)                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                                      \
        const __grid_constant__ TensorMap w_map, const __grid_constant__ TensorMap x_map, void* y, const u16* c,      \
        float* parts, int* tickets, int t, int n, int k, int ldy, int ldc, int ks) {                                 \
        skinny_wgmma<NT, OUT_F32, KB, STAGES>(w_map, x_map, y, c, parts, tickets, t, n, k, ldy, ldc, ks);           \
    }
// kdtree_skinny_wgmma_t<NT>_<out>: one box a stage, 8 stages; kdtree_skinny_wgmma_kb4_t<NT>_<out>: four, 4 stages
// (wgmma_launch.plan picks)
#define SKINNY_WGMMA(NT, NAME, OUT_F32)                                                        \
    SKINNY_WGMMA_KERNEL(kdtree_skinny_wgmma_t##NT##_##NAME, NT, OUT_F32, 1, 8)                 \
    SKINNY_WGMMA_KERNEL(kdtree_skinny_wgmma_kb4_t##NT##_##NAME, NT, OUT_F32, 4, 4)

SKINNY_WGMMA(8, bf16, 0)
SKINNY_WGMMA(16, bf16, 0)
SKINNY_WGMMA(24, bf16, 0)
SKINNY_WGMMA(32, bf16, 0)
SKINNY_WGMMA(8, f32, 1)
SKINNY_WGMMA(16, f32, 1)
SKINNY_WGMMA(24, f32, 1)
SKINNY_WGMMA(32, f32, 1)
