// moe_w4a16 wgmma: the expert GEMMs of the routed MoE where experts see many tokens (launch_v3.WGMMA_MIN_TOKENS),
// on the same fragment-order INT4 experts as moe_v3.cu, with Hopper's warpgroup MMA (sm_90a).
//
//   gate_up:  h[slot, :] = silu(W1_e x[tok]) * (W3_e x[tok])        h [t * top_k, i] bf16
//   down:     out[slot, :] = topk_w[slot] * (W2_e h[slot])          out [t * top_k, d] bf16
// (what moe_v3.cu's kernels compute; the route kernel before and the Triton combine after are the same launches).
//
// Why: moe_v3.cu's mma.sync kernels take an expert's tokens 8 or 16 at a time and dequantise every weight once per
// such tile; under tree routing a round of hundreds of tokens sends 30-230 tokens to its hot experts, so the weights
// are read and dequantised up to 15 times (t = 512: 0.25 of the HBM roofline, NOTES.md).  Here one dequantised
// weight fragment serves up to 64 tokens: wgmma m64nNk16 with the weights as A from registers and the expert's
// tokens as B from shared memory (N = 16, 32 or 64 token columns, the entry's count rounded up).
//
// Work.  The entries (expert, tile of up to 64 token slots) come from the counts (fragment_ops.cuh's build_entries);
// an item is (entry, block of 4 row pairs): warp w of the CTA's one warpgroup holds row pair 4 rb + w, so the four
// warps' 16-row tiles make wgmma's 64 rows.  gate_up: its gate tiles and its up tiles are two wgmma row sets, so a
// thread holds gate and up of the same (row, token) and forms silu(gate) * up in registers.  down: tile m = 0 and 1
// of the pairs (rows 32 p .. 32 p + 15, 32 p + 16 ..).  A CTA takes a contiguous range of items; one thread streams
// their fragment words and scales, a 64-k block of the 4 pairs at a time, by bulk copies into a shared-memory ring of
// W_STAGES stages that runs on across items (Stream); the warps read their lanes' words from it.  down puts its first
// blocks in flight before its PDL wait (the weights and the routing outputs are final then; h is not).
//
// Weights as A.  A lane's 16-byte fragment word of a group holds, for both tiles and both k steps of the group, the
// A registers of mma.sync's m16n8k16 fragment, which is also the per-warp layout of wgmma's register A (rows 16 w
// .. 16 w + 15).  Dequantised (dequant_pair: q exact) and multiplied by the row's scale in one bf16 rounding
// (fma.rn.bf16x2 q * s - 0), so the group's scale is applied before the product (moe_v3.cu scales fp32 partial
// sums; the reference's weights are q * s exactly: both within the reference's tolerance, not the same bits).
//
// Tokens as B.  The fragment layout permutes k within a group (fragment_layout.py: lane (g, u) holds k 8u + 4s +
// {0, 1} and 8u + 4s + {2, 3} of k step s), so B must hold the token rows' k in that order: a thread loads 16 bytes
// (k 8v .. 8v + 7 of a 64-k block) and stores its four words to the k steps' places (put_piece).  B tiles are
// K-major rows of 128 bytes (64 k) with the 128-byte swizzle, 8-row atoms 1024 bytes apart (as tree_verify_wgmma.cu).
// gate_up copies its tokens' x a 64-k block at a time (4-byte cp.async, X_AHEAD blocks ahead of the MMAs: one block
// ahead through registers left each block waiting on the loads' latency, H100 2026-12-07); down stages its entry's
// whole h tile (i <= 512) once per entry.
//
// bf16 through PTX on raw 32-bit registers; hopper.cuh (PDL, wgmma fence / commit) and fragment_ops.cuh are its
// headers (cubin.py inlines them for NVRTC).

#define KDTREE_ARCH_FEATURES  // plugins/common/cubin.py: compiled for sm_90a where the arch is sm_90 (wgmma)

#include "../common/cuda/hopper.cuh"  // smem_u32, pdl_wait, pdl_trigger, ld_stream, wgmma_fence / commit / wait_all
#include "fragment_ops.cuh"            // dequant_pair, ld_scales, ld_tokens_or_zero, to_bf16, ld_count, build_entries

#define WG 128                          // threads: one warpgroup
#define TILE 64                         // token slots an entry holds at most (wgmma's N up to 64)
#define RB 4                            // row pairs an item (4 warps x 16 rows: wgmma's M of 64)
#define X_STAGES 6                      // gate_up's token blocks in shared memory ...
#define X_AHEAD (X_STAGES - 2)          // ... of which this many in flight ahead of the MMAs (2 still being read)
#define BLOCK_BYTES (TILE * 128)        // 64 token rows x 64 k of bf16 (one 128-byte swizzle row each)
#define H_BLOCKS_MAX 8                  // down's h tile: i <= 512 (launch_v3.wgmma_applies)
#define W_STAGES 8                      // the weight ring's stages: one 64-k block (2 groups) of 4 row pairs each
#define W_STAGE_BYTES (RB * 2 * 512 + RB * 2 * 64)  // 4608: the 4 pairs' fragment words, then their scales

// Shared-memory matrix descriptor of a K-major B tile with the 128-byte swizzle (layout type 1, bits 62-63): start
// address >> 4, leading byte offset 16 (unused), the next 8 rows 1024 bytes on.  A k step of 16 moves the start by
// 32 bytes (+2 in the descriptor; addresses stay below 2^18, so no carry out of the 14-bit field).
__device__ __forceinline__ u64 b_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

// Writes by the generic proxy (st.shared) become visible to wgmma (the async proxy) after this + a barrier.
__device__ __forceinline__ void fence_async_smem() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_wait_one() {  // all but the last committed group done
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
#endif
}

// d [64 x N] += A [64 x 16] . B [16 x N]: A from registers (this thread's a[0..3], mma.sync's m16n8k16 A fragment of
// its warp's 16 rows), B the K-major tile at desc.  d: the first N / 2 of 32 floats (wgmma's D layout: warp w rows
// 16 w + g and + 8, columns 8 j + 2 u + {0, 1} in d[4 j ..]).
#define WG_ACC8(o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), \
                   "+f"(d[o + 6]), "+f"(d[o + 7])
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_MMA(N, REGS, AREG, DESC)                                                                          \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" REGS "}, {" AREG "}, %" DESC \
                 ", 1, 1, 1, 0;\n"
#endif

__device__ __forceinline__ void wgmma16(float (&d)[32], const u32* a, u64 desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    WG_MMA(16, "%0, %1, %2, %3, %4, %5, %6, %7", "%8, %9, %10, %11", "12")
        : WG_ACC8(0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#else
    __trap();  // wgmma needs sm_90a (launch_v3 takes these kernels on sm_90 only)
#endif
}

__device__ __forceinline__ void wgmma32(float (&d)[32], const u32* a, u64 desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    WG_MMA(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16, %17, %18, %19", "20")
        : WG_ACC8(0), WG_ACC8(8) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#else
    __trap();
#endif
}

__device__ __forceinline__ void wgmma64(float (&d)[32], const u32* a, u64 desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    WG_MMA(64,
           "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
           "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
           "%32, %33, %34, %35", "36")
        : WG_ACC8(0), WG_ACC8(8), WG_ACC8(16), WG_ACC8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
#else
    __trap();
#endif
}

template <int N>
__device__ __forceinline__ void wgmma_n(float (&d)[32], const u32* a, u64 desc) {
    if (N == 16) wgmma16(d, a, desc);
    else if (N == 32) wgmma32(d, a, desc);
    else wgmma64(d, a, desc);
}

// The accumulators pinned in place around the asynchronous MMAs (the compiler may not move their reads or writes
// across the wgmma fence / wait).
__device__ __forceinline__ void pin(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void zero(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
}

// q * s in one rounding (bf16x2; the -0 addend keeps a product's sign of zero)
__device__ __forceinline__ u32 scaled(u32 q, u32 s) {
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(q), "r"(s), "r"(0x80008000u));
    return r;
}

// A registers of one group into a[o + 8 m + 4 st + r]: A register r of tile m, k step st (word 2 m + st of the
// fragment word), times its row's scale (s.x: tile 0 rows g | g + 8, s.y: tile 1; registers 0, 2 hold row g, 1, 3
// row g + 8).
__device__ __forceinline__ void group_a(u32 (&a)[32], const uint4& w, const uint2& s, int o) {
    const u32 lo[2] = {__byte_perm(s.x, 0, 0x1010), __byte_perm(s.y, 0, 0x1010)};
    const u32 hi[2] = {__byte_perm(s.x, 0, 0x3232), __byte_perm(s.y, 0, 0x3232)};
    const u32 q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int st = 0; st < 2; ++st)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                a[o + 8 * m + 4 * st + r] = scaled(dequant_pair(q[2 * m + st] >> (4 * r)), (r & 1) ? hi[m] : lo[m]);
}

__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// [src, src + bytes) global -> shared at dst (bytes and addresses multiples of 16), completing on the mbarrier
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ uint4 ld_shared_v4(u32 addr) {
    uint4 r;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr));
    return r;
}

__device__ __forceinline__ uint2 ld_shared_v2(u32 addr) {
    uint2 r;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "r"(addr));
    return r;
}

// Where word j (0..3) of a 16-byte token piece goes: the piece holds k 8 v .. 8 v + 7 of a 64-k block (group v / 4,
// its lanes' u = v % 4), and the fragment layout's k order puts word 0 (k 8u + 0, 1) at k step 0's columns 2u, 2u + 1,
// word 1 (8u + 2, 3) at step 0's 2u + 8, + 9, words 2 and 3 likewise in step 1: in bytes of the row 64 (v / 4) +
// 16 j + 4 u, i.e. 16-byte chunk 4 (v / 4) + j, swizzled with the row's phase, in row `row` of the B block at `block`.
__device__ __forceinline__ u32 piece_word(u32 block, int row, int v, int j) {
    return block + row * 128 + (((4 * (v >> 2) + j) ^ (row & 7)) << 4) + 4 * (v & 3);
}

// a piece already in registers (down's h tile)
__device__ __forceinline__ void put_piece(u32 block, int row, int v, const uint4& x) {
    st_shared_u32(piece_word(block, row, v, 0), x.x);
    st_shared_u32(piece_word(block, row, v, 1), x.y);
    st_shared_u32(piece_word(block, row, v, 2), x.z);
    st_shared_u32(piece_word(block, row, v, 3), x.w);
}

// 4 bytes global -> shared, asynchronously (zeros where src_bytes is 0)
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

// a piece copied asynchronously from global memory (gate_up's token rows: no registers held across the blocks)
__device__ __forceinline__ void copy_piece(u32 block, int row, int v, const uint4* src, bool on) {
    const unsigned* w = reinterpret_cast<const unsigned*>(src);
#pragma unroll
    for (int j = 0; j < 4; ++j) cp_async4(piece_word(block, row, v, j), w + j, on ? 4u : 0u);
}

// The CTA's weight stream: its items' 64-k blocks in sequence (block q = item first + q / bpi, block q % bpi of it),
// each in stage q % W_STAGES of a shared-memory ring: the 4 row pairs' fragment words of the block's 2 groups (4 x
// 1 KB, contiguous in the layout per pair), then their scales (4 x 128 B), by bulk copies one thread issues,
// completing on the stage's mbarrier.  W_STAGES - 1 blocks (~32 KB) in flight per CTA, where a register ring of
// 4 groups held 12 KB: one CTA streaming a 515 KB gate_up item alone was bound by that (H100, 2026-12-07: t = 1 at
// 90 µs).  A stage is refilled once every thread has passed the barrier at the start of the next block (its words
// were read into registers before it).
struct Stream {
    const unsigned char* w_all;
    const unsigned char* s_all;
    const int* s_ent;
    u32 ring, bars;  // shared addresses: W_STAGES stages, W_STAGES mbarriers
    int first, n_blocks, bpi, n_groups, n_pairs, n_rb;

    // thread 0: block q's copies into its stage (nothing past the CTA's last block)
    __device__ __forceinline__ void issue(int q) const {
        if (q >= n_blocks) return;
        const int item = first + q / bpi, c = q % bpi;
        const int e = s_ent[item / n_rb] >> 16, p0 = (item % n_rb) * RB;
        const u32 st = ring + (q % W_STAGES) * W_STAGE_BYTES, bar = bars + 8 * (q % W_STAGES);
        mbar_expect_tx(bar, W_STAGE_BYTES);
#pragma unroll
        for (int w = 0; w < RB; ++w) {
            const long grp = ((long)e * n_pairs + p0 + w) * n_groups + 2 * c;
            bulk_copy(st + w * 1024, w_all + grp * 512, 1024, bar);
            bulk_copy(st + RB * 1024 + w * 128, s_all + grp * 64, 128, bar);
        }
    }
    // every thread: until block q has landed; then this lane's word and scales of its group h (0, 1) of it
    __device__ __forceinline__ void wait(int q) const { mbar_wait(bars + 8 * (q % W_STAGES), (q / W_STAGES) & 1); }
    __device__ __forceinline__ uint4 word(int q, int h) const {
        return ld_shared_v4(ring + (q % W_STAGES) * W_STAGE_BYTES + (threadIdx.x >> 5) * 1024 + h * 512 +
                            (threadIdx.x & 31) * 16);
    }
    __device__ __forceinline__ uint2 scale(int q, int h) const {
        return ld_shared_v2(ring + (q % W_STAGES) * W_STAGE_BYTES + RB * 1024 + (threadIdx.x >> 5) * 128 + h * 64 +
                            ((threadIdx.x & 31) >> 2) * 8);
    }
    // the barriers initialised and the first W_STAGES blocks in flight (every thread calls it; a barrier ends it)
    __device__ __forceinline__ void start() const {
        if (threadIdx.x == 0) {
            for (int j = 0; j < W_STAGES; ++j) mbar_init(bars + 8 * j, 1);
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
            for (int q = 0; q < W_STAGES; ++q) issue(q);
        }
        __syncthreads();
    }
};

// One 64-k block's MMAs (its two groups): acc_a += tile 0's A . B, acc_b += tile 1's, for both groups' two k steps
// (B at desc + 64 bytes per group, + 32 per k step), committed as one wgmma group; then wait until the block before
// it is done (its A registers, the other set, free).  ptxas keeps the MMAs asynchronous with one group pending at the
// wait (wgmma.wait_group 1); with more (3 or 4 register sets) it serialised them (C7513), so a block's 8 MMAs share a
// commit group instead: twice the work in flight per wait.
template <int N>
__device__ __forceinline__ void block_mma(float (&acc_a)[32], float (&acc_b)[32], const u32 (&a)[32], u64 desc) {
    pin(acc_a);
    pin(acc_b);
    wgmma_fence();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        wgmma_n<N>(acc_a, &a[16 * hh + 0], desc + 4 * hh);
        wgmma_n<N>(acc_a, &a[16 * hh + 4], desc + 4 * hh + 2);
        wgmma_n<N>(acc_b, &a[16 * hh + 8], desc + 4 * hh);
        wgmma_n<N>(acc_b, &a[16 * hh + 12], desc + 4 * hh + 2);
    }
    wgmma_commit();
    wgmma_wait_one();
    pin(acc_a);
    pin(acc_b);
}

// The dynamic shared memory from its first 1024-byte boundary (the swizzle atoms' alignment): generic and shared
// addresses.
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw, u32& shared_addr) {
    const u32 a = smem_u32(raw), pad = (1024u - (a & 1023u)) & 1023u;
    shared_addr = a + pad;
    return raw + pad;
}

// This CTA's contiguous range [first, last) of n items (balanced over the grid)
__device__ __forceinline__ void cta_items(int n, int& first, int& last) {
    first = (int)((long)blockIdx.x * n / gridDim.x);
    last = (int)((long)(blockIdx.x + 1) * n / gridDim.x);
}

// ---------------------------------------------------------------------------------------------------------
// gate_up: item = (entry, block rb of 4 row pairs); K = d in 64-k blocks of the tokens' x through X_STAGES stages
// ---------------------------------------------------------------------------------------------------------
template <int N>
__device__ __forceinline__ void gate_up_item(const Stream& st, int& q, const uint4* __restrict__ x, u16* __restrict__ h,
                                             const int* s_slot, u16* s_h, u32 stages, int n_e, int rb, int top_k,
                                             int c_real, int inter) {
    constexpr int NQ = N / 16;  // token rows a thread stages per block (rows tid / 8 + 16 q)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, u = lane & 3, v = tid & 7;
    const int blocks = st.bpi;
    const uint4* xp[NQ];
#pragma unroll
    for (int r = 0; r < NQ; ++r) {
        const int row = (tid >> 3) + 16 * r, slot = row < n_e ? s_slot[row] : -1;
        xp[r] = slot >= 0 ? x + (long)(slot / top_k) * (c_real * 4) + v : nullptr;
    }
    // block c's pieces of the thread's rows into stage c % X_STAGES (zeros past the rows or the k), one commit group
    auto copy = [&](int c) {
        if (c < blocks) {
#pragma unroll
            for (int r = 0; r < NQ; ++r) {
                const bool on = xp[r] != nullptr && 2 * c + (v >> 2) < c_real;
                copy_piece(stages + (c % X_STAGES) * BLOCK_BYTES, (tid >> 3) + 16 * r, v, on ? xp[r] + 8 * c : x, on);
            }
        }
        cp_async_commit();  // (empty past the last block: the group count stays one a block)
    };
    float gacc[32], uacc[32];
    zero(gacc);
    zero(uacc);
    u32 a[2][32];  // a block's A registers (both groups), two sets: block c's MMAs run while block c + 1's are formed
#pragma unroll
    for (int c = 0; c < X_AHEAD; ++c) copy(c);
    for (int c0 = 0; c0 < blocks; c0 += 2) {  // (blocks is even: k groups come in multiples of 8)
#pragma unroll
        for (int b = 0; b < 2; ++b, ++q) {
            const int c = c0 + b;
            cp_async_wait<X_AHEAD - 1>();  // this thread's copies of block c have landed
            fence_async_smem();
            __syncthreads();  // everyone's, visible to wgmma; every thread is past block q - 1's weights
            copy(c + X_AHEAD);  // into block c - 2's stage: its MMAs are done (one block pending at most)
            if (tid == 0 && q > 0) st.issue(q - 1 + W_STAGES);
            st.wait(q);
            group_a(a[b], st.word(q, 0), st.scale(q, 0), 0);
            group_a(a[b], st.word(q, 1), st.scale(q, 1), 16);
            block_mma<N>(gacc, uacc, a[b], b_desc(stages + (c % X_STAGES) * BLOCK_BYTES));
        }
    }
    wgmma_wait_all();
    pin(gacc);
    pin(uacc);
    // silu(gate) * up -> s_h [token][64 rows of the block] (rows 16 w + g, + 8), then 16-byte stores of h rows
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const float gs = gacc[4 * j + r], us = uacc[4 * j + r];
            s_h[(8 * j + 2 * u + (r & 1)) * 64 + 16 * warp + g + 8 * (r >> 1)] = to_bf16(gs / (1.f + __expf(-gs)) * us);
        }
    __syncthreads();
    for (int k = tid; k < n_e * 8; k += WG) {
        const int n = k >> 3, piece = k & 7;
        *reinterpret_cast<uint4*>(h + (long)s_slot[n] * inter + 64 * rb + 8 * piece) =
            *reinterpret_cast<const uint4*>(s_h + n * 64 + 8 * piece);
    }
    __syncthreads();  // s_h and s_slot are rewritten by the next item
}

extern "C" __global__ void __launch_bounds__(WG, 2) kdtree_moe_wg_gate_up(
    const uint4* __restrict__ w13, const uint2* __restrict__ s13, const uint4* __restrict__ x,
    const int* __restrict__ counts, const int* __restrict__ lists, u16* __restrict__ h, int t, int top_k,
    int e_local, int c_real, int n_groups, int n_pairs, int inter) {
    extern __shared__ unsigned char smem_raw[];
    u32 stages;                                                         // [X_STAGES][64 rows][128 B]
    unsigned char* smem = aligned_smem(smem_raw, stages);
    const u32 ring = stages + X_STAGES * BLOCK_BYTES;                   // [W_STAGES][W_STAGE_BYTES] weights
    u16* s_h = reinterpret_cast<u16*>(smem + X_STAGES * BLOCK_BYTES + W_STAGES * (W_STAGE_BYTES + 8));  // [64][64]
    int* s_slot = reinterpret_cast<int*>(s_h + TILE * 64);              // [64] the item's slots (-1 past its count)
    int* s_ws = s_slot + TILE;                                          // [4]
    int* s_cnt = s_ws + 4;                                              // [e_local]
    int* s_ent = s_cnt + e_local;                                       // [entries]
    const int tid = threadIdx.x;
    pdl_wait();  // counts and lists come from the route kernel, this grid's predecessor
    pdl_trigger();
    const int n_ent = build_entries<4>(counts, e_local, TILE, s_cnt, s_ent, s_ws);
    const int n_rb = n_pairs / RB;
    int first, last;
    cta_items(n_ent * n_rb, first, last);
    if (first >= last) return;  // uniform over the CTA

    const Stream st{reinterpret_cast<const unsigned char*>(w13), reinterpret_cast<const unsigned char*>(s13), s_ent,
                    ring, ring + W_STAGES * W_STAGE_BYTES, first, (last - first) * (n_groups / 2), n_groups / 2,
                    n_groups, n_pairs, n_rb};
    st.start();
    int q = 0;  // the stream's next block
    for (int item = first; item < last; ++item) {
        const int ent = s_ent[item / n_rb], e = ent >> 16, tile = ent & 0xFFFF;
        const int n_e = min(TILE, s_cnt[e] - TILE * tile);
        if (tid < TILE) s_slot[tid] = tid < n_e ? ld_count(lists + (long)e * t + TILE * tile + tid) : -1;
        __syncthreads();
        const int rb = item % n_rb;
        if (n_e <= 16)
            gate_up_item<16>(st, q, x, h, s_slot, s_h, stages, n_e, rb, top_k, c_real, inter);
        else if (n_e <= 32)
            gate_up_item<32>(st, q, x, h, s_slot, s_h, stages, n_e, rb, top_k, c_real, inter);
        else
            gate_up_item<64>(st, q, x, h, s_slot, s_h, stages, n_e, rb, top_k, c_real, inter);
    }
}

// ---------------------------------------------------------------------------------------------------------
// down: item = (entry, block rb of 4 row pairs = 128 output rows); K = i, the entry's whole h tile in shared memory
// ---------------------------------------------------------------------------------------------------------
template <int N>
__device__ __forceinline__ void down_item(const Stream& st, int& q, u16* __restrict__ out, const int* s_slot,
                                          const float* s_wt, u16* s_o, u32 h_tile, int n_e, int rb, int d) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, u = lane & 3;
    float acc0[32], acc1[32];  // tile m = 0 (rows 32 p + ..), m = 1 (rows 32 p + 16 + ..)
    zero(acc0);
    zero(acc1);
    u32 a[2][32];
    for (int c0 = 0; c0 < st.bpi; c0 += 2) {
#pragma unroll
        for (int b = 0; b < 2; ++b, ++q) {
            __syncthreads();
            if (tid == 0 && q > 0) st.issue(q - 1 + W_STAGES);  // every thread is past block q - 1's weights
            st.wait(q);
            group_a(a[b], st.word(q, 0), st.scale(q, 0), 0);
            group_a(a[b], st.word(q, 1), st.scale(q, 1), 16);
            block_mma<N>(acc0, acc1, a[b], b_desc(h_tile + (c0 + b) * BLOCK_BYTES));
        }
    }
    wgmma_wait_all();
    pin(acc0);
    pin(acc1);
    // topk_w[slot] * acc -> s_o [token][128 rows of the block] (rows 32 w + 16 m + g, + 8), then 16-byte stores
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int n = 8 * j + 2 * u + (r & 1), row = 32 * warp + g + 8 * (r >> 1);
            const float wt = s_wt[n];
            s_o[n * 128 + row] = to_bf16(wt * acc0[4 * j + r]);
            s_o[n * 128 + row + 16] = to_bf16(wt * acc1[4 * j + r]);
        }
    __syncthreads();
    for (int k = tid; k < n_e * 16; k += WG) {
        const int n = k >> 4, piece = k & 15;
        *reinterpret_cast<uint4*>(out + (long)s_slot[n] * d + 128 * rb + 8 * piece) =
            *reinterpret_cast<const uint4*>(s_o + n * 128 + 8 * piece);
    }
    __syncthreads();  // s_o is rewritten by the next item, s_slot / s_wt / the h tile by the next entry
}

extern "C" __global__ void __launch_bounds__(WG, 2) kdtree_moe_wg_down(
    const uint4* __restrict__ w2, const uint2* __restrict__ s2, const uint4* __restrict__ h,
    const float* __restrict__ topk_w, const int* __restrict__ counts, const int* __restrict__ lists,
    u16* __restrict__ out, int t, int e_local, int c_real, int n_groups, int n_pairs, int d) {
    extern __shared__ unsigned char smem_raw[];
    u32 h_tile;                                                           // [n_groups / 2][64 rows][128 B]
    unsigned char* smem = aligned_smem(smem_raw, h_tile);
    const u32 ring = h_tile + (n_groups / 2) * BLOCK_BYTES;                 // [W_STAGES][W_STAGE_BYTES] weights
    u16* s_o = reinterpret_cast<u16*>(smem + (n_groups / 2) * BLOCK_BYTES + W_STAGES * (W_STAGE_BYTES + 8));
    int* s_slot = reinterpret_cast<int*>(s_o + TILE * 128);               // [64]
    float* s_wt = reinterpret_cast<float*>(s_slot + TILE);                // [64] their routing weights
    int* s_ws = reinterpret_cast<int*>(s_wt + TILE);                      // [4]
    int* s_cnt = s_ws + 4;                                                // [e_local]
    int* s_ent = s_cnt + e_local;                                         // [entries]
    const int tid = threadIdx.x;
    // Before the wait: the entries and the first weight blocks in flight.  down's predecessor is gate_up, whose h only
    // the h tiles read; counts, lists and topk_w come from the route kernel before it, complete before gate_up's wait
    // returned, and gate_up lets this grid launch only after that wait, so they are final here (read through L2).
    const int n_ent = build_entries<4>(counts, e_local, TILE, s_cnt, s_ent, s_ws);
    const int n_rb = n_pairs / RB;
    int first, last;
    cta_items(n_ent * n_rb, first, last);
    const Stream st{reinterpret_cast<const unsigned char*>(w2), reinterpret_cast<const unsigned char*>(s2), s_ent,
                    ring, ring + W_STAGES * W_STAGE_BYTES, first, max(0, last - first) * (n_groups / 2),
                    n_groups / 2, n_groups, n_pairs, n_rb};
    if (first < last) st.start();
    pdl_wait();  // gate_up's h is complete and visible from here
    pdl_trigger();
    if (first >= last) return;
    int q = 0;
    const int h_row = c_real * 4, pieces = n_groups * 4;  // uint4 per h row (i / 8); 16-byte pieces a tile row
    int cur = -1;
    int n_e = 0;
    for (int item = first; item < last; ++item) {
        const int ei = item / n_rb;
        if (ei != cur) {  // a new entry: its slots, their routing weights and its h tile (k in the fragments' order)
            cur = ei;
            const int ent = s_ent[ei], e = ent >> 16, tile = ent & 0xFFFF;
            n_e = min(TILE, s_cnt[e] - TILE * tile);
            if (tid < TILE) {
                const int slot = tid < n_e ? ld_count(lists + (long)e * t + TILE * tile + tid) : -1;
                s_slot[tid] = slot;
                s_wt[tid] = slot >= 0 ? ld_cg_f32(topk_w + slot) : 0.f;
            }
            __syncthreads();
            const int rows = n_e <= 16 ? 16 : n_e <= 32 ? 32 : 64;
            for (int q0 = tid; q0 < rows * pieces; q0 += 8 * WG) {  // 8 loads in flight, then their stores
                uint4 r[8];
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    const int q = q0 + b * WG, row = q / pieces, pc = q % pieces;
                    const int slot = q < rows * pieces ? s_slot[row] : -1;
                    r[b] = ld_tokens_or_zero<true>(h + (long)(slot < 0 ? 0 : slot) * h_row + pc,
                                                   slot >= 0 && pc < h_row);
                }
#pragma unroll
                for (int b = 0; b < 8; ++b) {
                    const int q = q0 + b * WG, row = q / pieces, pc = q % pieces;
                    if (q < rows * pieces) put_piece(h_tile + (pc >> 3) * BLOCK_BYTES, row, pc & 7, r[b]);
                }
            }
            fence_async_smem();
            __syncthreads();
        }
        const int rb = item % n_rb;
        if (n_e <= 16)
            down_item<16>(st, q, out, s_slot, s_wt, s_o, h_tile, n_e, rb, d);
        else if (n_e <= 32)
            down_item<32>(st, q, out, s_slot, s_wt, s_o, h_tile, n_e, rb, d);
        else
            down_item<64>(st, q, out, s_slot, s_wt, s_o, h_tile, n_e, rb, d);
    }
}
