// Hopper (sm_90) primitives shared by the CUDA C kernels: programmatic dependent launch, shared-memory addresses, the
// weights' streaming load, the 32-bit L2 load, the L2 bulk prefetch, mbarriers (the tensor memory accelerator's
// completion), the async-proxy fence, the wgmma operand descriptor and the warpgroup MMA's fence / commit / wait,
// and the split-K kernels' last-CTA ticket.  Each but the
// ticket wraps one PTX instruction; where an arch lacks it (PDL and the prefetch below sm_90, wgmma outside
// sm_90a) it compiles to nothing, so the same source builds for sm_120 (whose kernels never take those paths).
//
// Included by the .cu files as "../common/cuda/hopper.cuh"; plugins/common/cubin.py inlines it before NVRTC
// compiles a file (NVRTC gets no include path), nvcc (kdtree build, the tests) resolves it next to the source.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Wait until the predecessor grid has completed and its memory is visible (returns at once without the launch
// attribute).
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Let the next grid launch: its CTAs become resident and wait at their own pdl_wait (holding their SM slots) for
// this grid's completion before reading what it writes.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// 16 bytes of weights read once (no L1 allocation; .nc: nothing writes them while a kernel runs, so the load may go
// before the PDL wait)
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// A 32-bit load through L2 (ld.global.cg): what a kernel may read before its PDL wait of data written a launch or
// more before its predecessor (routing counts and lists, the committed cache length): a strong load ptxas keeps in
// place, never the non-coherent path that `const __restrict__` would let it pick (tests/test_pdl_order_sass.py)
__device__ __forceinline__ int ld_cg_s32(const int* p) {
    int r;
    asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// [p, p + bytes) into L2, not waited for (p and bytes multiples of 16; nothing below sm_90)
__device__ __forceinline__ void l2_prefetch(const void* p, u32 bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// A CUtensorMap (plugins/common/tensor_maps.py: cuTensorMapEncodeTiled), passed to a kernel by value
// (__grid_constant__): 128 opaque bytes.
struct __align__(64) TensorMap {
    u64 bytes[16];
};

// A box (column c0, row c1) of the 2-d tensor behind `map` into shared memory at dst, completing on the mbarrier at bar
__device__ __forceinline__ void tma_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
        ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {  // this thread arrives; `bytes` will land
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// 16 bytes global -> shared, zero-filled past src_bytes (0 or 16); .cg: through L2 only
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

// 8 bytes global -> shared (.ca: the 8-byte form has no .cg)
__device__ __forceinline__ void cp_async8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// this thread's cp.async copies landed (other threads see them after a barrier)
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// A 32-bit load with acquire semantics at GPU scope: what a thread reads after it sees another CTA's release
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int r;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(r) : "l"(p) : "memory");
    return r;
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {  // until the phase of this parity has completed
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// The split-K ticket of the kernels that sum their CTAs' partials in the last CTA to finish (skinny_gemm;
// skinny_wgmma.cu still has its own copy: moving it there changes that kernel's SASS).  Every thread of the CTA
// calls it once its stores of this CTA's partial are issued; thread 0 takes
// a ticket of *ticket (s_flag: an int of shared memory), and the CTA that arrives count-th is the last: it zeroes the
// ticket for the next launch (same stream, after this grid) and, with the fence after, reads the others' partials
// (through L2: ld.global.cg).  Returns whether this CTA is the last (uniform over the CTA).
__device__ __forceinline__ bool last_arrival(int* ticket, int count, int* s_flag) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int n = atomicAdd(ticket, 1);
        *s_flag = n == count - 1;
        if (n == count - 1) *ticket = 0;
    }
    __syncthreads();
    if (!*s_flag) return false;
    __threadfence();
    return true;
}

// Writes by the generic proxy (st.shared, cp.async) become visible to wgmma (the async proxy) after this + a barrier.
__device__ __forceinline__ void fence_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Shared-memory matrix descriptor of a wgmma operand with the 128-byte swizzle (layout type 1 in bits 62-63): start
// address, leading and stride byte offsets, each >> 4.  K-major operands: 8 rows of 128 bytes a swizzle atom, the next
// 8 rows 1024 bytes on (stride), leading offset unused (16); a k step of 16 columns moves the start by 32 bytes (+2:
// addresses stay below 2^18, so no carry out of the 14-bit field).  N-major ones (tree_verify_wgmma.cu's V): 64
// columns x 8 k an atom, the next 8 k 1024 bytes on (stride), the next 64 columns `lead` bytes on.
__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lead_bytes, u32 stride_bytes) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lead_bytes >> 4) << 16) | ((u64)(stride_bytes >> 4) << 32)
           | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_wait_all() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_wait_one() {  // all but the last committed group done
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#endif
}
