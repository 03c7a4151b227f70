// L2 prefetch of weight tensors: bulk prefetches (cp.async.bulk.prefetch.L2, sm_90) of `chunk`-byte pieces,
// issued and not waited for: a kernel ends as soon as its requests are out, and the lines arrive in L2 while
// later kernels run.  A hint only: nothing reads what it fetched, so it cannot change a result.  Addresses,
// sizes and chunk: multiples of 16.  Before sm_90: one prefetch.global.L2 per 128-byte line.
//
// kdtree_spin: one thread spins `cycles` SM clocks (the benchmark's stand-in for the kernels a prefetch overlaps).

#include "../common/cuda/hopper.cuh"  // l2_prefetch, pdl_wait; u64

// [p, p + size) into L2; evict_last: with the L2 evict-last policy (`policy` from createpolicy), sm_90 only.
__device__ __forceinline__ void prefetch_range(const char* p, unsigned int size, bool evict_last, u64 policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (evict_last)
        asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p), "r"(size),
                     "l"(policy) : "memory");
    else
        l2_prefetch(p, size);
#else
    for (unsigned int b = 0; b < size; b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + b) : "memory");
#endif
}

// One region [base, base + bytes), request i by thread i (grid-strided).
extern "C" __global__ void kdtree_l2_prefetch(const char* base, u64 bytes, unsigned int chunk, int evict_last) {
    const u64 n = (bytes + chunk - 1) / chunk;
    u64 policy = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
#endif
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 off = i * chunk;
        prefetch_range(base + off, (unsigned int)(bytes - off < chunk ? bytes - off : chunk), evict_last, policy);
    }
}

// Up to four regions [p_r, p_r + b_r) (b_r = 0: none), request i of their concatenation by thread i; then the PDL
// wait (sm_90; launched with programmatic stream serialization): the prefetches go out while the predecessor grid
// still runs, and the kernel completes only after it, so its dependents keep the stream's order.  The decode
// round's form (the plugin's `kdtree::l2_prefetch` op).
extern "C" __global__ void kdtree_l2_prefetch_regions(const char* p0, u64 b0, const char* p1, u64 b1, const char* p2,
                                                      u64 b2, const char* p3, u64 b3, unsigned int chunk) {
    const char* ps[4] = {p0, p1, p2, p3};
    const u64 bs[4] = {b0, b1, b2, b3};
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const u64 n = (bs[r] + chunk - 1) / chunk;
        if (i < n) {
            const u64 off = i * chunk;
            prefetch_range(ps[r] + off, (unsigned int)(bs[r] - off < chunk ? bs[r] - off : chunk), false, 0);
            break;
        }
        i -= n;
    }
    pdl_wait();
}

extern "C" __global__ void kdtree_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
