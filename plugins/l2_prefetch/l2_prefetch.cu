// L2 prefetch of a weight tensor: bulk prefetches (cp.async.bulk.prefetch.L2, sm_90) of `chunk`-byte pieces of
// [base, base + bytes), issued and not waited for: the kernel ends as soon as its requests are out, and the
// lines arrive in L2 while later kernels run.  A hint only: nothing reads what it fetched, so it cannot change
// a result.  bytes and chunk: multiples of 16, base 16-byte aligned.
//
// kdtree_spin: one thread spins `cycles` SM clocks (the benchmark's stand-in for the kernels a prefetch overlaps).

typedef unsigned long long u64;

// evict_last != 0: the lines are fetched with the L2 evict-last policy (kept over lines streamed in after them).
extern "C" __global__ void kdtree_l2_prefetch(const char* base, u64 bytes, unsigned int chunk, int evict_last) {
    const u64 n = (bytes + chunk - 1) / chunk;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u64 policy = 0;
    if (evict_last) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
#endif
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 off = i * chunk;
        const unsigned int size = (unsigned int)(bytes - off < chunk ? bytes - off : chunk);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if (evict_last)
            asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(base + off), "r"(size),
                         "l"(policy) : "memory");
        else
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + off), "r"(size) : "memory");
#else
        for (unsigned int b = 0; b < size; b += 128)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(base + off + b) : "memory");
#endif
    }
}

extern "C" __global__ void kdtree_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}
