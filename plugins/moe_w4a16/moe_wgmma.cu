// moe_w4a16 wgmma: the expert GEMMs of the routed MoE where experts see many tokens (launch_wgmma.MIN_TOKENS; off by
// default: slower than moe_v3.cu below 512 tokens, NOTES.md),
// on the same fragment-order INT4 experts as moe_v3.cu, with Hopper's warpgroup MMA (sm_90a).  The register-A (RS)
// kernels.  The warp-specialised forms (ws, wr) and gate_up's tokens by TMA (xt) were measured no faster and
// removed (NOTES.md "The warp-specialised expert GEMMs", "gate_up's tokens by TMA").
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
// of the pairs (rows 32 p .. 32 p + 15, 32 p + 16 ..).  A CTA takes a contiguous range of items; its warps stream the
// fragment words and scales of all of them through a register ring P groups deep that runs on across items.
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
// gate_up stages its tokens' x a 64-k block at a time (3 stages, the loads one block ahead in registers); down
// stages its entry's whole h tile (i <= 512) once per entry.
//
// bf16 through PTX on raw 32-bit registers; hopper.cuh (PDL, wgmma fence / commit) and fragment_ops.cuh are its
// headers (cubin.py inlines them for NVRTC).

#define KDTREE_ARCH_FEATURES  // plugins/common/cubin.py: compiled for sm_90a where the arch is sm_90 (wgmma)

#include "../common/cuda/hopper.cuh"  // smem_u32, pdl_*, ld_stream, fence_async_smem, smem_desc, wgmma_*
#include "fragment_ops.cuh"            // dequant_pair, ld_scales, ld_tokens_or_zero, to_bf16, ld_count, build_entries

#define WG 128                          // threads: one warpgroup
#define TILE 64                         // token slots an entry holds at most (wgmma's N up to 64)
#define RB 4                            // row pairs an item (4 warps x 16 rows: wgmma's M of 64)
#define X_STAGES 3                      // gate_up's token blocks in shared memory
#define BLOCK_BYTES (TILE * 128)        // 64 token rows x 64 k of bf16 (one 128-byte swizzle row each)
#define H_BLOCKS_MAX 8                  // down's h tile: i <= 512 (launch_wgmma.shapes_fit)
#define P_GROUPS 4                      // the weight ring's depth in groups (even: gate_up's blocks are 2 groups)

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
    __trap();  // wgmma needs sm_90a (launch_wgmma loads these kernels on sm_90 only)
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

// A registers of one group: a[8 m + 4 st + r] = A register r of tile m, k step st (word 2 m + st of the fragment
// word), times its row's scale (s.x: tile 0 rows g | g + 8, s.y: tile 1; registers 0, 2 hold row g, 1, 3 row g + 8).
__device__ __forceinline__ void group_a(u32 (&a)[16], const uint4& w, const uint2& s) {
    const u32 lo[2] = {__byte_perm(s.x, 0, 0x1010), __byte_perm(s.y, 0, 0x1010)};
    const u32 hi[2] = {__byte_perm(s.x, 0, 0x3232), __byte_perm(s.y, 0, 0x3232)};
    const u32 q[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int st = 0; st < 2; ++st)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                a[8 * m + 4 * st + r] = scaled(dequant_pair(q[2 * m + st] >> (4 * r)), (r & 1) ? hi[m] : lo[m]);
}

__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// 16 bytes of a token row, k 8 v .. 8 v + 7 of a 64-k block (group v / 4, its lanes' u = v % 4), into row `row` of
// the B block at `block`, where the fragment layout's k order puts them: word 0 (k 8u + 0, 1) at k step 0's columns
// 2u, 2u + 1, word 1 (8u + 2, 3) at step 0's 2u + 8, + 9, words 2 and 3 likewise in step 1.  In bytes of the row:
// 64 (v / 4) + 16 j + 4 u for word j, i.e. 16-byte chunk 4 (v / 4) + j, swizzled with the row's phase.
__device__ __forceinline__ void put_piece(u32 block, int row, int v, const uint4& x) {
    const u32 base = block + row * 128 + 4 * (v & 3);
    const int c0 = 4 * (v >> 2), sw = row & 7;
    st_shared_u32(base + (((c0 + 0) ^ sw) << 4), x.x);
    st_shared_u32(base + (((c0 + 1) ^ sw) << 4), x.y);
    st_shared_u32(base + (((c0 + 2) ^ sw) << 4), x.z);
    st_shared_u32(base + (((c0 + 3) ^ sw) << 4), x.w);
}

// The warps' weight stream over the CTA's items [first, last): group grp of item `item` next, P_GROUPS in flight.
// Each item has n_groups groups (a multiple of P_GROUPS), so an item's groups start at ring slot 0.  Item it is
// (entry it / n_rb, block it % n_rb): this warp's row pair (it % n_rb) RB + warp of the entry's expert.
struct Ring {
    uint4 w[P_GROUPS];
    uint2 s[P_GROUPS];
    const uint4* pw;  // this lane's fragment words of the item's first group
    const uint2* ps;  // this lane's scales
    const uint4* w_all;
    const uint2* s_all;
    const int* s_ent;
    int item, grp, last, n_groups, n_pairs, n_rb;

    __device__ __forceinline__ void setup() {
        const int e = s_ent[item / n_rb] >> 16, p = (item % n_rb) * RB + (threadIdx.x >> 5);
        const long blk = ((long)e * n_pairs + p) * n_groups;
        pw = w_all + blk * 32 + (threadIdx.x & 31);
        ps = s_all + blk * 8 + ((threadIdx.x & 31) >> 2);
    }
    // the first P_GROUPS groups of item `first` in flight
    __device__ __forceinline__ void start(const uint4* w_, const uint2* s_, const int* ent, int pairs, int groups,
                                          int first, int last_) {
        w_all = w_, s_all = s_, s_ent = ent, n_pairs = pairs, n_groups = groups, n_rb = pairs / RB;
        item = first, grp = 0, last = last_;
        setup();
#pragma unroll
        for (int k = 0; k < P_GROUPS; ++k) {
            load(k);
            next();
        }
    }
    __device__ __forceinline__ void load(int k) {
        w[k] = ld_stream(pw + (long)grp * 32);
        s[k] = ld_scales(ps + (long)grp * 8);
    }
    // past the last item's last group the cursor stays put (the loads re-read it, harmlessly)
    __device__ __forceinline__ void next() {
        if (grp + 1 < n_groups) {
            ++grp;
        } else if (item + 1 < last) {
            ++item;
            grp = 0;
            setup();
        }
    }
};

// One group's MMAs: acc_a += tile 0's A (both k steps) . B, acc_b += tile 1's, B the k steps at desc and desc + 32
// bytes; then wait until the previous group's are done (its A registers free).
template <int N>
__device__ __forceinline__ void group_mma(float (&acc_a)[32], float (&acc_b)[32], const u32 (&a)[16], u64 desc) {
    pin(acc_a);
    pin(acc_b);
    wgmma_fence();
    wgmma_n<N>(acc_a, &a[0], desc);
    wgmma_n<N>(acc_a, &a[4], desc + 2);
    wgmma_n<N>(acc_b, &a[8], desc);
    wgmma_n<N>(acc_b, &a[12], desc + 2);
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

// gate_up's token rows of an item, a 64-k block at a time: thread tid stages rows tid / 8 + 16 q (q < N / 16), the
// 16-byte piece tid % 8 of each (zeros past the entry's rows or d), loads one block ahead of the stores.
template <int N>
struct TokenBlocks {
    const uint4* xp[N / 16];
    uint4 xr[N / 16];
    int c_real;

    __device__ __forceinline__ void init(const uint4* __restrict__ x, const int* s_slot, int n_e, int top_k,
                                         int c_real_) {
        c_real = c_real_;
        const int tid = threadIdx.x & (WG - 1), v = tid & 7;
#pragma unroll
        for (int q = 0; q < N / 16; ++q) {
            const int row = (tid >> 3) + 16 * q, slot = row < n_e ? s_slot[row] : -1;
            xp[q] = slot >= 0 ? x + (long)(slot / top_k) * (c_real * 4) + v : nullptr;
        }
    }
    __device__ __forceinline__ void gather(int c) {  // block c's pieces into registers
        const int v = threadIdx.x & 7;
#pragma unroll
        for (int q = 0; q < N / 16; ++q)
            xr[q] = ld_tokens_or_zero<false>(xp[q] + 8 * c, xp[q] != nullptr && 2 * c + (v >> 2) < c_real);
    }
    __device__ __forceinline__ void put(u32 stages, int c) {  // ... into block c's stage (put_piece)
        const int tid = threadIdx.x & (WG - 1);
#pragma unroll
        for (int q = 0; q < N / 16; ++q) put_piece(stages + (c % X_STAGES) * BLOCK_BYTES, (tid >> 3) + 16 * q, tid & 7,
                                                   xr[q]);
    }
};

// silu(gate) * up of an item -> s_h [token][64 rows of the block] (rows 16 w + g, + 8), then 16-byte stores of its
// h rows; the CTA meets before the stores and after (s_h and s_slot are rewritten next item)
template <int N>
__device__ __forceinline__ void store_h(const float (&gacc)[32], const float (&uacc)[32], u16* s_h,
                                        u16* __restrict__ h, const int* s_slot, int n_e, int rb, int inter) {
    const int tid = threadIdx.x & (WG - 1), warp = tid >> 5, lane = tid & 31, g = lane >> 2, u = lane & 3;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const float gs = gacc[4 * j + r], us = uacc[4 * j + r];
            s_h[(8 * j + 2 * u + (r & 1)) * 64 + 16 * warp + g + 8 * (r >> 1)] = to_bf16(gs / (1.f + __expf(-gs)) * us);
        }
    __syncthreads();
    for (int q = tid; q < n_e * 8; q += WG) {
        const int n = q >> 3, piece = q & 7;
        *reinterpret_cast<uint4*>(h + (long)s_slot[n] * inter + 64 * rb + 8 * piece) =
            *reinterpret_cast<const uint4*>(s_h + n * 64 + 8 * piece);
    }
    __syncthreads();
}

// gate_up's token blocks: every thread stores its pieces (TokenBlocks) into X_STAGES stages, one block ahead
// (its loads two ahead), then the proxy fence and a CTA barrier
template <int N>
struct StoredTokens {
    TokenBlocks<N> tok;
    u32 stages;
    int blocks;

    __device__ __forceinline__ void block(int c) {  // block c + 1 into its stage (free: block c - 2's MMAs are done),
        if (c + 1 < blocks) tok.put(stages, c + 1);  // block c + 2's loads in flight, block c visible
        if (c + 2 < blocks) tok.gather(c + 2);
        fence_async_smem();
        __syncthreads();
    }
    __device__ __forceinline__ u32 tile(int c) const { return stages + (c % X_STAGES) * BLOCK_BYTES; }
};

// An item's gate and up sums over its 64-k blocks (accumulators zeroed here, all MMAs done on return).  feed.block(c)
// makes block c's B tile ready (and stages the blocks after it) at the block's first group; feed.tile(c) is its
// shared address.
template <int N>
__device__ __forceinline__ void gate_up_sums(Ring& ring, StoredTokens<N>& feed, float (&gacc)[32], float (&uacc)[32]) {
    zero(gacc);
    zero(uacc);
    u32 a[2][16];
    for (int g0 = 0; g0 < ring.n_groups; g0 += P_GROUPS) {
#pragma unroll
        for (int k = 0; k < P_GROUPS; ++k) {
            const int gi = g0 + k, c = gi >> 1;
            if ((k & 1) == 0) feed.block(c);
            group_a(a[k & 1], ring.w[k], ring.s[k]);
            ring.load(k);
            ring.next();
            const u32 b_tile = feed.tile(c) + 64 * (k & 1);  // the group's 32 k of the block
            group_mma<N>(gacc, uacc, a[k & 1], smem_desc(b_tile, 16, 1024));
        }
    }
    wgmma_wait_all();
    pin(gacc);
    pin(uacc);
}

// ---------------------------------------------------------------------------------------------------------
// gate_up: item = (entry, block rb of 4 row pairs); K = d in 64-k blocks of the tokens' x through 3 stages
// ---------------------------------------------------------------------------------------------------------
template <int N>
__device__ __forceinline__ void gate_up_item(Ring& ring, const uint4* __restrict__ x, u16* __restrict__ h,
                                             const int* s_slot, u16* s_h, u32 stages, int n_e, int rb, int top_k,
                                             int c_real, int inter) {
    StoredTokens<N> feed;
    feed.stages = stages;
    feed.blocks = ring.n_groups / 2;
    feed.tok.init(x, s_slot, n_e, top_k, c_real);
    feed.tok.gather(0);
    feed.tok.put(stages, 0);
    if (feed.blocks > 1) feed.tok.gather(1);
    float gacc[32], uacc[32];
    gate_up_sums<N>(ring, feed, gacc, uacc);
    store_h<N>(gacc, uacc, s_h, h, s_slot, n_e, rb, inter);
}

extern "C" __global__ void __launch_bounds__(WG, 2) kdtree_moe_wg_gate_up(
    const uint4* __restrict__ w13, const uint2* __restrict__ s13, const uint4* __restrict__ x,
    const int* __restrict__ counts, const int* __restrict__ lists, u16* __restrict__ h, int t, int top_k,
    int e_local, int c_real, int n_groups, int n_pairs, int inter) {
    extern __shared__ unsigned char smem_raw[];
    u32 stages;                                                         // [X_STAGES][64 rows][128 B]
    unsigned char* smem = aligned_smem(smem_raw, stages);
    u16* s_h = reinterpret_cast<u16*>(smem + X_STAGES * BLOCK_BYTES);   // [64 tokens][64 rows] bf16
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

    Ring ring;
    ring.start(w13, s13, s_ent, n_pairs, n_groups, first, last);
    for (int item = first; item < last; ++item) {
        const int ent = s_ent[item / n_rb], e = ent >> 16, tile = ent & 0xFFFF;
        const int n_e = min(TILE, s_cnt[e] - TILE * tile);
        if (tid < TILE) s_slot[tid] = tid < n_e ? ld_count(lists + (long)e * t + TILE * tile + tid) : -1;
        __syncthreads();
        const int rb = item % n_rb;
        if (n_e <= 16)
            gate_up_item<16>(ring, x, h, s_slot, s_h, stages, n_e, rb, top_k, c_real, inter);
        else if (n_e <= 32)
            gate_up_item<32>(ring, x, h, s_slot, s_h, stages, n_e, rb, top_k, c_real, inter);
        else
            gate_up_item<64>(ring, x, h, s_slot, s_h, stages, n_e, rb, top_k, c_real, inter);
    }
}

// ---------------------------------------------------------------------------------------------------------
// down: item = (entry, block rb of 4 row pairs = 128 output rows); K = i, the entry's whole h tile in shared memory
// ---------------------------------------------------------------------------------------------------------
// A down entry (ent: expert << 16 | its tile of TILE slots) into shared memory: its slots, their routing weights and
// its whole h tile (k in the fragments' order, rows rounded up to 16 / 32 / 64, zeros past the slots); the CTA
// meets after.  Returns the entry's slot count.
__device__ __forceinline__ int stage_down_entry(int ent, const int* s_cnt, const int* __restrict__ lists,
                                                const float* __restrict__ topk_w, const uint4* __restrict__ h, int t,
                                                int c_real, int n_groups, int* s_slot, float* s_wt, u32 h_tile) {
    const int tid = threadIdx.x & (WG - 1), e = ent >> 16, tile = ent & 0xFFFF;
    const int n_e = min(TILE, s_cnt[e] - TILE * tile);
    if (tid < TILE) {
        const int slot = tid < n_e ? ld_count(lists + (long)e * t + TILE * tile + tid) : -1;
        s_slot[tid] = slot;
        s_wt[tid] = slot >= 0 ? ld_cg_f32(topk_w + slot) : 0.f;
    }
    __syncthreads();
    const int h_row = c_real * 4, pieces = n_groups * 4;  // uint4 per h row (i / 8); 16-byte pieces a tile row
    const int rows = n_e <= 16 ? 16 : n_e <= 32 ? 32 : 64;
    for (int q0 = tid; q0 < rows * pieces; q0 += 8 * WG) {  // 8 loads in flight, then their stores
        uint4 r[8];
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            const int q = q0 + b * WG, row = q / pieces, pc = q % pieces;
            const int slot = q < rows * pieces ? s_slot[row] : -1;
            r[b] = ld_tokens_or_zero<true>(h + (long)(slot < 0 ? 0 : slot) * h_row + pc, slot >= 0 && pc < h_row);
        }
#pragma unroll
        for (int b = 0; b < 8; ++b) {
            const int q = q0 + b * WG, row = q / pieces, pc = q % pieces;
            if (q < rows * pieces) put_piece(h_tile + (pc >> 3) * BLOCK_BYTES, row, pc & 7, r[b]);
        }
    }
    fence_async_smem();
    __syncthreads();
    return n_e;
}

// topk_w[slot] * acc -> s_o [token][128 rows of the block] (rows 32 w + 16 m + g, + 8), then 16-byte stores of the
// item's out rows; the CTA meets before the stores and after (s_o is rewritten by the next item, s_slot / s_wt / the
// h tile by the next entry)
template <int N>
__device__ __forceinline__ void store_out(const float (&acc0)[32], const float (&acc1)[32], u16* s_o,
                                          u16* __restrict__ out, const int* s_slot, const float* s_wt, int n_e, int rb,
                                          int d) {
    const int tid = threadIdx.x & (WG - 1), warp = tid >> 5, lane = tid & 31, g = lane >> 2, u = lane & 3;
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
    for (int q = tid; q < n_e * 16; q += WG) {
        const int n = q >> 4, piece = q & 15;
        *reinterpret_cast<uint4*>(out + (long)s_slot[n] * d + 128 * rb + 8 * piece) =
            *reinterpret_cast<const uint4*>(s_o + n * 128 + 8 * piece);
    }
    __syncthreads();
}

template <int N>
__device__ __forceinline__ void down_item(Ring& ring, u16* __restrict__ out, const int* s_slot,
                                          const float* s_wt, u16* s_o, u32 h_tile, int n_e, int rb, int d) {
    float acc0[32], acc1[32];  // tile m = 0 (rows 32 p + ..), m = 1 (rows 32 p + 16 + ..)
    zero(acc0);
    zero(acc1);
    u32 a[2][16];
    for (int g0 = 0; g0 < ring.n_groups; g0 += P_GROUPS) {
#pragma unroll
        for (int k = 0; k < P_GROUPS; ++k) {
            const int gi = g0 + k;
            group_a(a[k & 1], ring.w[k], ring.s[k]);
            ring.load(k);
            ring.next();
            group_mma<N>(acc0, acc1, a[k & 1], smem_desc(h_tile + (gi >> 1) * BLOCK_BYTES + 64 * (gi & 1), 16, 1024));
        }
    }
    wgmma_wait_all();
    pin(acc0);
    pin(acc1);
    store_out<N>(acc0, acc1, s_o, out, s_slot, s_wt, n_e, rb, d);
}

extern "C" __global__ void __launch_bounds__(WG, 2) kdtree_moe_wg_down(
    const uint4* __restrict__ w2, const uint2* __restrict__ s2, const uint4* __restrict__ h,
    const float* __restrict__ topk_w, const int* __restrict__ counts, const int* __restrict__ lists,
    u16* __restrict__ out, int t, int e_local, int c_real, int n_groups, int n_pairs, int d) {
    extern __shared__ unsigned char smem_raw[];
    u32 h_tile;                                                           // [n_groups / 2][64 rows][128 B]
    unsigned char* smem = aligned_smem(smem_raw, h_tile);
    u16* s_o = reinterpret_cast<u16*>(smem + (n_groups / 2) * BLOCK_BYTES);  // [64 tokens][128 rows] bf16
    int* s_slot = reinterpret_cast<int*>(s_o + TILE * 128);               // [64]
    float* s_wt = reinterpret_cast<float*>(s_slot + TILE);                // [64] their routing weights
    int* s_ws = reinterpret_cast<int*>(s_wt + TILE);                      // [4]
    int* s_cnt = s_ws + 4;                                                // [e_local]
    int* s_ent = s_cnt + e_local;                                         // [entries]
    pdl_wait();  // h comes from gate_up, this grid's predecessor (counts, lists, topk_w from the route kernel)
    pdl_trigger();
    const int n_ent = build_entries<4>(counts, e_local, TILE, s_cnt, s_ent, s_ws);
    const int n_rb = n_pairs / RB;
    int first, last;
    cta_items(n_ent * n_rb, first, last);
    if (first >= last) return;

    Ring ring;
    ring.start(w2, s2, s_ent, n_pairs, n_groups, first, last);
    int cur = -1;
    int n_e = 0;
    for (int item = first; item < last; ++item) {
        const int ei = item / n_rb;
        if (ei != cur) {
            cur = ei;
            n_e = stage_down_entry(s_ent[ei], s_cnt, lists, topk_w, h, t, c_real, n_groups, s_slot, s_wt, h_tile);
        }
        const int rb = item % n_rb;
        if (n_e <= 16)
            down_item<16>(ring, out, s_slot, s_wt, s_o, h_tile, n_e, rb, d);
        else if (n_e <= 32)
            down_item<32>(ring, out, s_slot, s_wt, s_o, h_tile, n_e, rb, d);
        else
            down_item<64>(ring, out, s_slot, s_wt, s_o, h_tile, n_e, rb, d);
    }
}
