// What a kernel boundary costs on its own, for benchmarks/boundary_cost.py: chains of kernels in one CUDA graph, with
// and without programmatic dependent launch, beside one persistent kernel whose phases meet at a grid barrier.
//
// kdtree_bench_stream: CTA c reads its share of `bytes` of weights w (16-byte streaming loads, never reused, so
//   from HBM), then one float of the previous kernel's output `in` (written by the predecessor: after the PDL wait),
//   and writes out[c].  early = 1: the weights are read before the PDL wait (as the runtime's "early" kernels do),
//   early = 0: after it.  bytes = 0 is a kernel that only passes a value on: the boundary alone.
// kdtree_bench_phases: `phases` rounds of the same work in one launch, a grid-wide barrier between rounds (every CTA
//   must be resident: the launcher asks for a cooperative launch of at most one CTA an SM).

#include "../../plugins/common/cuda/hopper.cuh"  // pdl_wait, pdl_trigger, ld_stream; u32, u64

__device__ __forceinline__ u32 load_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// this CTA's share of w: 16-byte words [begin, end), 8 loads in flight a thread
__device__ __forceinline__ u32 stream_share(const uint4* w, u64 words, u32 cta, u32 ctas) {
    const u64 per = (words + ctas - 1) / ctas;
    const u64 begin = per * cta;
    const u64 end = begin + per < words ? begin + per : words;
    u32 acc = 0;
    u64 i = begin + threadIdx.x;
    const u64 step = blockDim.x;
    for (; i + 7 * step < end; i += 8 * step) {
        uint4 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = ld_stream(w + i + j * step);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < end; i += step) {
        uint4 v = ld_stream(w + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    return acc;
}

// the CTA's result: its threads' xor of the weights and the predecessor's value, one float (kept so that nothing is
// dead code; the value itself means nothing)
__device__ __forceinline__ void pass_on(u32 acc, const float* in, float* out, u32 cta) {
    __shared__ u32 red;
    if (threadIdx.x == 0) red = 0;
    __syncthreads();
    atomicXor(&red, acc);
    __syncthreads();
    if (threadIdx.x == 0) out[cta] = in[cta] + (float)(red & 1u);
}

extern "C" __global__ void kdtree_bench_stream(const uint4* __restrict__ w, u64 words, const float* in, float* out,
                                               int early) {
    pdl_trigger();
    u32 acc = 0;
    if (early) acc = stream_share(w, words, blockIdx.x, gridDim.x);
    pdl_wait();
    if (!early) acc = stream_share(w, words, blockIdx.x, gridDim.x);
    pass_on(acc, in, out, blockIdx.x);
}

// skinny_gemm.cu's weight reads alone (its t = 1 kernel without the tokens and the math): CTA c takes the row group
// of 16 rows c * 16 .. c * 16 + 15 of w [n, k] (bf16, row-major) over all of k; per 32-column block a lane reads 16
// bytes of rows g and g + 8 (g = lane / 4) at column 8 (lane % 4); warp i takes blocks i, i + W, ..., U = 8 blocks'
// loads issued before their use.  Against kdtree_bench_stream (contiguous 512-byte warp reads) at the same bytes:
// what the GEMM's access pattern costs.
extern "C" __global__ void kdtree_bench_rows(const uint4* __restrict__ w, int n, int k, const float* in, float* out,
                                             int early) {
    constexpr int U = 8;
    pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, q = lane & 3, nkb = k >> 5;
    const int r0 = blockIdx.x * 16;
    const int ra = r0 + g < n ? r0 + g : n - 1, rb = r0 + g + 8 < n ? r0 + g + 8 : n - 1;
    const uint4* wa = w + (u64)ra * (k >> 3) + q;  // 8 bf16 a uint4
    const uint4* wb = w + (u64)rb * (k >> 3) + q;
    u32 acc = 0;
    uint4 a[U], b[U];
    auto load = [&](int kb0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int kb = kb0 + u * warps;
            if (kb < nkb) {
                a[u] = ld_stream(wa + kb * 4);
                b[u] = ld_stream(wb + kb * 4);
            }
        }
    };
    if (early) load(warp);
    pdl_wait();
    for (int kb0 = warp; kb0 < nkb; kb0 += U * warps) {
        if (!early || kb0 != warp) load(kb0);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (kb0 + u * warps < nkb) acc ^= a[u].x ^ a[u].y ^ b[u].z ^ b[u].w ^ a[u].z ^ b[u].x ^ a[u].w ^ b[u].y;
    }
    pass_on(acc, in, out, blockIdx.x);
}

// bar[0]: CTAs arrived at the current barrier; bar[1]: barriers completed (the generation).  The last CTA to arrive
// resets the count and bumps the generation, so the pair is ready for the next barrier and the next launch.
__device__ __forceinline__ void grid_barrier(u32* bar, u32& gen) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&bar[0], 1u) == gridDim.x - 1) {
            bar[0] = 0;
            __threadfence();
            atomicExch(&bar[1], gen + 1);
        } else {
            while (load_acquire(&bar[1]) == gen) {
            }
        }
    }
    ++gen;
    __syncthreads();
}

// phase p streams w_base + (p % n_bufs) * words (the chain's buffers in the same order) and passes its value on
// through buf[p % 2] -> buf[(p + 1) % 2]
extern "C" __global__ void kdtree_bench_phases(const uint4* __restrict__ w, u64 words, u32 n_bufs, float* buf0,
                                               float* buf1, u32* bar, int phases) {
    pdl_wait();
    __shared__ u32 gen_s;
    if (threadIdx.x == 0) gen_s = load_acquire(&bar[1]);
    __syncthreads();
    u32 gen = gen_s;
    for (int p = 0; p < phases; ++p) {
        const u32 acc = stream_share(w + (u64)(p % n_bufs) * words, words, blockIdx.x, gridDim.x);
        pass_on(acc, p % 2 ? buf1 : buf0, p % 2 ? buf0 : buf1, blockIdx.x);
        grid_barrier(bar, gen);
    }
}
