// What both kernels on fragment-order INT4 experts use (moe_v3.cu: mma.sync, moe_wgmma.cu: wgmma): a fragment
// word's dequantisation, the scales' and token rows' loads, the bf16 rounding, the routing outputs' loads through L2
// and the entry list built from them.
// Included as "fragment_ops.cuh" next to the sources (plugins/common/cubin.py inlines it for NVRTC).

#pragma once

#include "../common/cuda/hopper.cuh"  // ld_cg_s32

typedef unsigned short u16;

// A register r of a fragment word: nibbles r and r + 4 -> bf16 pair (q_lo, q_hi), q = stored - 8, exact.
__device__ __forceinline__ u32 dequant_pair(u32 w) {
    u32 biased, q;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u));  // 128 + v
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(q) : "r"(biased), "r"(0x3F803F80u), "r"(0xC308C308u));  // - 136
    return q;
}

__device__ __forceinline__ u16 to_bf16(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// A group's scales (4 bf16 of the lane's rows), read once
__device__ __forceinline__ uint2 ld_scales(const uint2* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// A ring slot's token vector: the 16 bytes at p where `on`, else zeros, in one asm block (zeros, then the load under
// a predicate into the same registers).  Written as `on ? load : 0` in C, ptxas loaded into a temporary and moved it
// into the slot at once: the move waited for the load (down, sm_90, ncu source page 2026-12-06: a third of the
// kernel's stall samples at t = 17 on those moves), so the ring's loads were not in flight behind the math.
//
// gate_up's token rows x (NC): written three launches back (the norm before the router GEMM), complete once gate_up's
// wait returns, and their addresses come from the lists read after it, so no load can move above the wait: re-read by
// other items of the SM, kept in L1.
// down's h rows (CG): written by gate_up, its predecessor, which under PDL may still run when down starts; with EARLY
// their addresses are known before down's wait.  Never through the non-coherent path: .nc tells ptxas the data cannot
// change while the kernel runs, and it hoisted the first h loads above griddepcontrol.wait (sm_90 SASS: LDG.CONSTANT
// before ACQBULK), a race with gate_up's stores.  From L2 (.cg): a strong load stays after the wait.
template <bool CG>
__device__ __forceinline__ uint4 ld_tokens_or_zero(const uint4* p, bool on) {
    uint4 r;
    if (CG)
        asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %4, 0;\n\t"
                     "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
                     "@q ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%5];\n\t}"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"((int)on), "l"(p));
    else
        asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %4, 0;\n\t"
                     "mov.b32 %0, 0;\n\tmov.b32 %1, 0;\n\tmov.b32 %2, 0;\n\tmov.b32 %3, 0;\n\t"
                     "@q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%5];\n\t}"
                     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"((int)on), "l"(p));
    return r;
}

// counts [e_local] -> entries (expert << 16 | tile) in expert order; returns how many (every thread of a CTA of W
// warps; s_ws holds W ints).  Each thread takes two neighbouring experts per pass, so 384 experts at W = 8 take one
// pass: one memory latency and one CTA scan, not two.
// The counts come from L2 (.cg): the route kernel, this grid's predecessor, writes them, and under PDL this grid may
// start while it runs, so not through the non-coherent path that `const __restrict__` lets the compiler pick.
__device__ __forceinline__ int ld_count(const int* p) { return ld_cg_s32(p); }

__device__ __forceinline__ float ld_cg_f32(const float* p) {
    float r;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

// Not inlined: its registers then stay out of the callers' allocation (inlined, ptxas spilled 8-20 bytes in
// gate_up nt1_p7 / nt2_p4 / w16 and both down kernels; as a call, none of them spills).
template <int W>
__device__ __noinline__ int build_entries(const int* __restrict__ counts, int e_local, int tile_tokens, int* s_cnt,
                                          int* s_ent, int* s_ws) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int base = 0;
    for (int e0 = 0; e0 < e_local; e0 += 64 * W) {
        const int e = e0 + 2 * threadIdx.x;  // this thread's experts e, e + 1
        const int c0 = e < e_local ? ld_count(counts + e) : 0;
        const int c1 = e + 1 < e_local ? ld_count(counts + e + 1) : 0;
        if (e < e_local) s_cnt[e] = c0;
        if (e + 1 < e_local) s_cnt[e + 1] = c1;
        const int n0 = (c0 + tile_tokens - 1) / tile_tokens, n1 = (c1 + tile_tokens - 1) / tile_tokens;
        int v = n0 + n1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xFFFFFFFFu, v, o);
            if (lane >= o) v += y;
        }
        if (lane == 31) s_ws[warp] = v;
        __syncthreads();
        int before = 0, total = 0;
#pragma unroll
        for (int k = 0; k < W; ++k) {
            const int sv = s_ws[k];
            before += k < warp ? sv : 0;
            total += sv;
        }
        const int first = base + before + v - n0 - n1;
        for (int j = 0; j < n0; ++j) s_ent[first + j] = (e << 16) | j;
        for (int j = 0; j < n1; ++j) s_ent[first + n0 + j] = ((e + 1) << 16) | j;
        base += total;
        __syncthreads();
    }
    return base;
}
