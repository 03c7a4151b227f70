// moe_w4a16 v3: the expert GEMMs of the routed MoE on INT4 weights in fragment order
// (plugins/moe_w4a16/fragment_layout.py), mma.sync m16n8k16 bf16 with fp32 accumulation (sm_80 and up:
// the same source is the sm_90 and the sm_120 kernel).
//
// Inputs come from the route kernel (route_kernel.py): counts [e_local + 1] tokens per local expert,
// lists [e_local, t] slot ids (token * top_k + j) per expert, topk_w [t * top_k] routing weights.
//
//   gate_up:  h[slot, :] = silu(W1_e x[tok]) * (W3_e x[tok])        h [t * top_k, i] bf16
//   down:     out[slot, :] = topk_w[slot] * (W2_e h[slot])          out [t * top_k, d] bf16
// and the combine (y[tok] = sum over the token's local slots, in slot order) stays the Triton kernel.
//
// Work.  Each CTA first turns counts into the list of (expert, token tile) entries, in expert order
// (a tile is 8 * NT token slots of one expert).  gate_up: a work item is (entry, row pair p of 32 w13 rows
// = 16 gate + 16 up rows); the CTA's 8 warps split its k groups (warp w takes groups w, w + 8, ...), and a
// shared-memory reduction in warp order (deterministic) ends the item with silu(gate) * up.  down: a work
// item is (entry, row pair of 32 w2 rows), done by one warp over the whole k (i is short), no barrier.
// Each warp streams its items' 16-byte fragment words, scales and token vectors through a ring of P
// register slots (loads P groups ahead of the math).  Grids are persistent: items are strided over
// gridDim.x CTAs (gate_up) or over all warps (down).  One token (launch_v3.ONE_LAUNCH): kdtree_moe_v3_one runs
// both GEMMs in one grid, a counter per pick between them (its section below).
//
// bf16 through PTX on raw 32-bit registers; plugins/common/cuda/hopper.cuh (PDL, l2_prefetch) is its one header
// (cubin.py inlines it for NVRTC).

#include "../common/cuda/hopper.cuh"  // pdl_wait, pdl_trigger, l2_prefetch, ld_stream, ld_cg_s32
#include "fragment_ops.cuh"            // dequant_pair, ld_scales, ld_tokens_or_zero, to_bf16, ld_count, build_entries

#define WARPS 8
#define THREADS (WARPS * 32)

// L2 prefetch (l2_prefetch, sm_90+: the bulk prefetch, one request per `bytes`, not waited for): a hint that puts a
// work item's weights in flight at once, where the register ring alone keeps only P groups per warp in flight.
// Nothing reads what it fetched, so it cannot change a result.  p and bytes: multiples of 16.
#define PF_CHUNK 16384u

// The lanes of one warp prefetch [p, p + bytes) in PF_CHUNK pieces.
__device__ __forceinline__ void warp_prefetch(const void* p, unsigned int bytes, int lane) {
    for (unsigned int off = lane * PF_CHUNK; off < bytes; off += 32 * PF_CHUNK)
        l2_prefetch(reinterpret_cast<const char*>(p) + off, bytes - off < PF_CHUNK ? bytes - off : PF_CHUNK);
}

// Programmatic dependent launch (launch_v3.py launches with it on sm_90+): wait until the predecessor grid has
// completed and its memory is visible, before reading anything, then let this kernel's dependents launch.
// Without the launch attribute the wait returns at once.
__device__ __forceinline__ void pdl_prologue() {
    pdl_wait();
    pdl_trigger();
}

// The kernels' last argument `pf`, bit flags (0: none):
#define PF_L2 1  // gate_up prefetches each item's weights into L2 as it starts it, down each warp's next item
// the 16-warp gate_up (t = 1 only: launch_v3.gate_up_w16) at t = 1: every entry's one position holds token 0 (a slot
// < top_k), so the token rows need neither the lists nor stage_slots' round trip before the first loads; only the h
// stores' slots are read (late, through L2).  The 8-warp kernels compile without it (the same SASS as before).
#define PF_ONE 2
// (bit 2 was PF_EARLY, down's weights before its wait chosen at run time: now the EARLY template, kernels
// kdtree_moe_v3_down_early_*, where the wait is not behind a branch that ptxas schedules across)

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ u32 word(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// One k group (two mma k steps) of one lane: acc[m][j] += scale(m, row) * (Q_m . X_j) over the group's 32 k.
template <int NT>
__device__ __forceinline__ void group_mma(float (&acc)[2][NT][4], const uint4& w, const uint2& s, const uint4 (&x)[NT]) {
    float part[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) part[m][j][r] = 0.f;
#pragma unroll
    for (int st = 0; st < 2; ++st) {
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const u32 q = word(w, 2 * m + st);
            const u32 a0 = dequant_pair(q), a1 = dequant_pair(q >> 4), a2 = dequant_pair(q >> 8),
                      a3 = dequant_pair(q >> 12);
#pragma unroll
            for (int j = 0; j < NT; ++j) mma_bf16(part[m][j], a0, a1, a2, a3, word(x[j], 2 * st), word(x[j], 2 * st + 1));
        }
    }
    const float sc[2][2] = {{bf16_lo(s.x), bf16_hi(s.x)}, {bf16_lo(s.y), bf16_hi(s.y)}};  // [tile][row g | g + 8]
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[m][j][r] += sc[m][r >> 1] * part[m][j][r];
}

__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned r;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
    return r;
}

// *p where `on`, else `otherwise`, through L2 (the route kernel's outputs: see ld_count), one asm block (see
// ld_tokens_or_zero: no move after the load)
__device__ __forceinline__ int ld_count_or(const int* p, bool on, int otherwise) {
    int r;
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\tmov.b32 %0, %3;\n\t@q ld.global.cg.s32 %0, [%1];\n\t}"
                 : "=r"(r) : "l"(p), "r"((int)on), "r"(otherwise));
    return r;
}

__device__ __forceinline__ float ld_cg_f32_or_zero(const float* p, bool on) {
    float r;
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\tmov.b32 %0, 0;\n\t@q ld.global.cg.f32 %0, [%1];\n\t}"
                 : "=f"(r) : "l"(p), "r"((int)on));
    return r;
}

// Bytes of the launch's dynamic shared memory past p.
__device__ __forceinline__ unsigned smem_room(const void* p, const unsigned char* base) {
    const unsigned used = (unsigned)(reinterpret_cast<const unsigned char*>(p) - base), all = dynamic_smem_bytes();
    return all > used ? all - used : 0u;
}

// The slot ids of the CTA's n_ent entries, tt slots each (-1 past an expert's count), into s_slot [n_ent * tt],
// and with topk_w their routing weights into s_wt (0 where no slot): each thread issues its loads together, once,
// where an item's setup loaded its slots from L2 and used them at once (ncu source page, down at t = 17 on the H100:
// the warps stalled on those loads and on the weight loads that needed them).  `room`: the bytes of shared memory past
// s_slot in the launch; false (nothing staged, the callers load as before) where n_ent * tt slots do not fit.  Every
// thread of the CTA calls it (a barrier ends it).
template <int W>
__device__ __noinline__ bool stage_slots(const int* __restrict__ lists, const float* __restrict__ topk_w, int t,
                                         const int* s_cnt, const int* s_ent, int n_ent, int tt, int* s_slot,
                                         float* s_wt, unsigned room) {
    constexpr int U = 4;  // loads per thread in flight
    const int n = n_ent * tt;
    if ((unsigned)n * (topk_w != nullptr ? 8u : 4u) > room) return false;  // uniform over the CTA
    for (int i0 = threadIdx.x; i0 < n; i0 += U * 32 * W) {
        int slot[U];
        float wt[U];
#pragma unroll
        for (int q = 0; q < U; ++q) {
            const int i = i0 + q * 32 * W, ent = i < n ? s_ent[i / tt] : 0, e = ent >> 16;
            const int pos = (ent & 0xFFFF) * tt + i % tt;
            slot[q] = ld_count_or(lists + (long)e * t + pos, i < n && pos < s_cnt[e], -1);
        }
        if (topk_w != nullptr) {
#pragma unroll
            for (int q = 0; q < U; ++q) wt[q] = ld_cg_f32_or_zero(topk_w + (slot[q] < 0 ? 0 : slot[q]), slot[q] >= 0);
        }
#pragma unroll
        for (int q = 0; q < U; ++q) {
            const int i = i0 + q * 32 * W;
            if (i < n) {
                s_slot[i] = slot[q];
                if (topk_w != nullptr) s_wt[i] = wt[q];
            }
        }
    }
    __syncthreads();
    return true;
}

// Slot of position q of entry i (tt slots an entry): from s_slot where stage_slots staged it, else from the lists
// through L2 (-1 past its expert's count).
__device__ __forceinline__ int entry_slot(bool staged, const int* s_slot, const int* s_ent, const int* s_cnt,
                                          const int* __restrict__ lists, int t, int tt, int i, int q) {
    if (staged) return s_slot[i * tt + q];
    const int ent = s_ent[i], e = ent >> 16, pos = (ent & 0xFFFF) * tt + q;
    return pos < s_cnt[e] ? ld_count(lists + (long)e * t + pos) : -1;
}

// acc [2 row tiles][NT token tiles][4 floats of the m16n8 fragment] = 0
template <int NT>
__device__ __forceinline__ void zero_acc(float (&acc)[2][NT][4]) {
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[m][j][r] = 0.f;
}

// The load side of a warp: walks the CTA's (or warp's) items in chunks of P groups and fills the ring.
// Within a chunk nothing branches: a chunk's P groups are consumed and the next chunk's P groups loaded in
// one straight-line block (past the last chunk the cursor stays put and the loads re-read it, harmlessly).
template <int NT, int P, bool CG = false>  // CG: the token loads through L2 (down's h; ld_tokens_or_zero)
struct Ring {
    uint4 w[P], x[P][NT];
    uint2 s[P];
    const uint4* pw;      // this lane's fragment words of the item's first group
    const uint2* ps;      // this lane's scales
    const uint4* px[NT];  // this lane's token row per n tile (at its 16-byte column), or nullptr
    int chunk;            // chunk of the item the next loads read

    // group c of the current item (c: the warp's k group index within the row pair's groups)
    __device__ __forceinline__ void load(int k, int c, int c_real) {
        load_weights(k, c);
        load_tokens(k, c, c_real);
    }
    __device__ __forceinline__ void load_weights(int k, int c) {
        w[k] = ld_stream(pw + (long)c * 32);
        s[k] = ld_scales(ps + (long)c * 8);
    }
    __device__ __forceinline__ void load_tokens(int k, int c, int c_real) {
#pragma unroll
        for (int j = 0; j < NT; ++j)
            x[k][j] = ld_tokens_or_zero<CG>(px[j] + 4 * c, px[j] != nullptr && c < c_real);
    }
};

// The end of a gate_up item: the W warps' gate and up sums of it (acc, zeroed here) through red [W][2 m][NT][4][32],
// added in warp order, silu(gate) * up into s_h [8 NT tokens][16 rows] bf16.  Every thread of the CTA calls it; the
// CTA meets before the sums and after.
template <int NT, int W>
__device__ __forceinline__ void item_h(float (&acc)[2][NT][4], float* red, u16* s_h) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                red[(warp * 2 + m) * NT * 128 + (j * 4 + r) * 32 + lane] = acc[m][j][r];
                acc[m][j][r] = 0.f;
            }
    __syncthreads();
    for (int q = threadIdx.x; q < NT * 128; q += 32 * W) {
        float gs = 0.f, us = 0.f;
#pragma unroll
        for (int w = 0; w < W; ++w) {
            gs += red[(w * 2) * NT * 128 + q];
            us += red[(w * 2 + 1) * NT * 128 + q];
        }
        const int lq = q & 31, r = (q >> 5) & 3, j = q >> 7;
        const int row = (lq >> 2) + 8 * (r >> 1), col = 8 * j + 2 * (lq & 3) + (r & 1);
        s_h[col * 16 + row] = to_bf16(gs / (1.f + __expf(-gs)) * us);
    }
    __syncthreads();
}

// The end of a down item (row pair p) of one warp: token column c of tile j weighted by my_w[j] of lane (c, 0) (each
// lane holds its column g's), staged [8 NT tokens][32 rows] in `stage`, then lane (g, u) stores rows 8 u .. 8 u + 7 of
// its column's slot my_slot[j] (where it has one) in 16 bytes; acc zeroed.
template <int NT>
__device__ __forceinline__ void store_out_rows(float (&acc)[2][NT][4], const float (&my_w)[NT],
                                               const int (&my_slot)[NT], u16* stage, u16* __restrict__ out, int d,
                                               int p) {
    const int lane = threadIdx.x & 31, g = lane >> 2, u = lane & 3;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int hi = 0; hi < 2; ++hi) {
            const int col = 2 * u + hi;
            const float wt = __shfl_sync(0xFFFFFFFFu, my_w[j], col * 4);
            u16* o = stage + (8 * j + col) * 32 + g;
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                o[16 * m] = to_bf16(wt * acc[m][j][hi]);
                o[16 * m + 8] = to_bf16(wt * acc[m][j][2 + hi]);
                acc[m][j][hi] = acc[m][j][2 + hi] = 0.f;
            }
        }
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < NT; ++j)
        if (my_slot[j] >= 0)
            *reinterpret_cast<uint4*>(out + (long)my_slot[j] * d + p * 32 + 8 * u) =
                *reinterpret_cast<const uint4*>(stage + (8 * j + g) * 32 + 8 * u);
    __syncwarp();
}

// ---------------------------------------------------------------------------------------------------------
// gate_up: item = (entry, row pair); the CTA's W warps split the item's k groups (warp w: groups w + W m)
// ---------------------------------------------------------------------------------------------------------
template <int NT, int P, int W>
__device__ void gate_up(const uint4* __restrict__ w13, const uint2* __restrict__ s13, const uint4* __restrict__ x,
                        const int* __restrict__ counts, const int* __restrict__ lists, u16* __restrict__ h,
                        int t, int top_k, int e_local, int c_real, int n_groups, int n_pairs, int inter, int pf) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int TT = 8 * NT;            // token slots per tile
    constexpr int RED = 2 * NT * 4 * 32;  // floats one warp leaves per item
    float* s_red = reinterpret_cast<float*>(smem);                  // [2 parity][W][2 m][NT][4][32]
    u16* s_h = reinterpret_cast<u16*>(s_red + 2 * W * RED);         // [TT tokens][16 rows] bf16
    int* s_ws = reinterpret_cast<int*>(s_h + TT * 16);
    int* s_cnt = s_ws + W;
    int* s_ent = s_cnt + e_local;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, u = lane & 3;

    const int n_ent = build_entries<W>(counts, e_local, TT, s_cnt, s_ent, s_ws);
    int* s_slot = s_ent + n_ent;  // [n_ent][TT] the entries' slots, where they fit (stage_slots)
    const bool one = W == 16 && (pf & PF_ONE) && t == 1;  // uniform: token 0 at each position 0, nothing staged
    const bool staged = !one && stage_slots<W>(lists, nullptr, t, s_cnt, s_ent, n_ent, TT, s_slot, nullptr,
                                               smem_room(s_slot, smem));
    auto slot_of = [&](int i, int q) { return entry_slot(staged, s_slot, s_ent, s_cnt, lists, t, TT, i, q); };
    const int n_work = n_ent * n_pairs;
    const int chunks = n_groups / (W * P);  // chunks per item (the host picks P dividing n_groups / W)
    const int mine = (int)blockIdx.x < n_work ? (n_work - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int total = mine * chunks;
    if (total == 0) return;  // uniform over the CTA
    const int x_row = c_real * 4;  // uint4 per token row (d / 8)

    Ring<NT, P> ring;
    int l_wi = blockIdx.x;
    auto l_setup = [&](int wi) {
        const int ent = s_ent[wi / n_pairs], p = wi % n_pairs, e = ent >> 16;
        const long blk = ((long)e * n_pairs + p) * n_groups;
        ring.pw = w13 + blk * 32 + lane;
        ring.ps = s13 + blk * 8 + g;
        ring.chunk = 0;
        if ((pf & PF_L2) && warp == W - 1) {  // the item's weights (n_groups * 512 B) and scales, all in flight at once
            warp_prefetch(w13 + blk * 32, n_groups * 512u, lane);
            if (lane == 31) l2_prefetch(s13 + blk * 8, n_groups * 64u);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int slot = one ? (8 * j + g == 0 ? 0 : -1) : slot_of(wi / n_pairs, 8 * j + g);
            ring.px[j] = slot >= 0 ? x + (long)(slot / top_k) * x_row + u : nullptr;
        }
    };
    auto l_next = [&]() {  // advance the load cursor by one chunk (stays on the last one)
        if (ring.chunk + 1 < chunks) {
            ++ring.chunk;
        } else if (l_wi + (int)gridDim.x < n_work) {
            l_wi += gridDim.x;
            l_setup(l_wi);
        }
    };
    l_setup(l_wi);
#pragma unroll
    for (int k = 0; k < P; ++k) ring.load(k, warp + W * k, c_real);
    l_next();

    // the writer threads (tid < 2 * TT) of the item's h rows: token tid / 2, rows 8 (tid % 2) ..
    int c_wi = blockIdx.x, c_chunk = 0, parity = 0, w_slot = -1;
    auto w_prefetch = [&](int wi) {
        w_slot = threadIdx.x < 2 * TT ? slot_of(wi / n_pairs, threadIdx.x >> 1) : -1;
    };
    w_prefetch(c_wi);
    float acc[2][NT][4];
    zero_acc<NT>(acc);

    for (int ch = 0; ch < total; ++ch) {
        const int base = warp + W * P * ring.chunk;
#pragma unroll
        for (int k = 0; k < P; ++k) {
            group_mma<NT>(acc, ring.w[k], ring.s[k], ring.x[k]);
            ring.load(k, base + W * k, c_real);
        }
        l_next();
        if (++c_chunk < chunks) continue;
        // end of the item: reduce over the warps (in warp order), silu(gate) * up, 16-byte stores of h
        item_h<NT, W>(acc, s_red + parity * W * RED, s_h);
        if (w_slot >= 0) {
            const int p = c_wi % n_pairs;
            *reinterpret_cast<uint4*>(h + (long)w_slot * inter + p * 16 + 8 * (threadIdx.x & 1)) =
                *reinterpret_cast<const uint4*>(s_h + (threadIdx.x >> 1) * 16 + 8 * (threadIdx.x & 1));
        }
        parity ^= 1;
        c_chunk = 0;
        c_wi += gridDim.x;
        if (c_wi < n_work) w_prefetch(c_wi);
    }
}

// ---------------------------------------------------------------------------------------------------------
// down: item = (entry, row pair), one warp over the whole k (warps of all CTAs stride over the items)
// ---------------------------------------------------------------------------------------------------------
template <int NT, int P, bool EARLY>
__device__ void down(const uint4* __restrict__ w2, const uint2* __restrict__ s2, const uint4* __restrict__ h,
                     const float* __restrict__ topk_w, const int* __restrict__ counts, const int* __restrict__ lists,
                     u16* __restrict__ out, int t, int e_local, int c_real, int n_groups, int n_pairs, int d,
                     int pf) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int TT = 8 * NT;
    u16* s_o = reinterpret_cast<u16*>(smem);  // [WARPS][TT tokens][32 rows] bf16: the warp's item, staged
    int* s_ws = reinterpret_cast<int*>(s_o + WARPS * TT * 32);
    int* s_cnt = s_ws + WARPS;
    int* s_ent = s_cnt + e_local;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, u = lane & 3;
    u16* stage = s_o + warp * TT * 32;
    // EARLY: down's predecessor is gate_up, whose h only the token loads read; counts, lists and topk_w come from
    // the route kernel before it, which completed before gate_up's wait returned, and gate_up lets this grid launch
    // only after that wait (pdl_prologue in every CTA), so they are final whenever this grid runs (read through L2,
    // .cg).  The entry list is built and the first P groups of weights and scales (a whole item at TP8) are
    // prefetched into L2 while gate_up still runs; the ring's loads follow the wait (h through .cg: ld_tokens_or_zero).
    // Not the weights into registers before the wait: ptxas sinks those .nc loads below griddepcontrol.wait (sm_90
    // SASS, CUDA 13.0) once the h loads can no longer move above it.
    if (!EARLY) pdl_prologue();

    const int n_ent = build_entries<WARPS>(counts, e_local, TT, s_cnt, s_ent, s_ws);
    int* s_slot = s_ent + n_ent;                                       // [n_ent][TT] slots, where they fit
    float* s_wt = reinterpret_cast<float*>(s_slot + n_ent * TT);      // [n_ent][TT] their routing weights
    const bool staged = stage_slots<WARPS>(lists, topk_w, t, s_cnt, s_ent, n_ent, TT, s_slot, s_wt,
                                           smem_room(s_slot, smem));
    auto slot_of = [&](int i, int q) { return entry_slot(staged, s_slot, s_ent, s_cnt, lists, t, TT, i, q); };
    const int n_work = n_ent * n_pairs;
    const int gw = blockIdx.x * WARPS + warp, n_warps = gridDim.x * WARPS;
    const int chunks = n_groups / P;  // chunks per item (P divides n_groups: a multiple of 8)
    const int mine = gw < n_work ? (n_work - 1 - gw) / n_warps + 1 : 0;
    const int total = mine * chunks;
    if (total == 0) return;  // uniform over the warp; no CTA barrier follows (nothing read or written after the wait)
    const int h_row = c_real * 4;  // uint4 per h row (i / 8)

    Ring<NT, P, true> ring;  // h through L2 (.cg)
    int l_wi = gw;
    auto l_setup = [&](int wi) {
        const int ent = s_ent[wi / n_pairs], p = wi % n_pairs, e = ent >> 16;
        const long blk = ((long)e * n_pairs + p) * n_groups;
        ring.pw = w2 + blk * 32 + lane;
        ring.ps = s2 + blk * 8 + g;
        ring.chunk = 0;
        if ((pf & PF_L2) && wi + n_warps < n_work) {  // the warp's next item in flight while this one streams
            const int nx = wi + n_warps, nent = s_ent[nx / n_pairs];
            const long nblk = ((long)(nent >> 16) * n_pairs + nx % n_pairs) * n_groups;
            if (lane == 0) l2_prefetch(w2 + nblk * 32, n_groups * 512u);
            if (lane == 1) l2_prefetch(s2 + nblk * 8, n_groups * 64u);
        }
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int slot = slot_of(wi / n_pairs, 8 * j + g);
            ring.px[j] = slot >= 0 ? h + (long)slot * h_row + u : nullptr;
        }
    };
    auto l_next = [&]() {
        if (ring.chunk + 1 < chunks) {
            ++ring.chunk;
        } else if (l_wi + n_warps < n_work) {
            l_wi += n_warps;
            l_setup(l_wi);
        }
    };
    l_setup(l_wi);
    if (EARLY) {  // the first chunk's weights and scales put in flight into L2, then the wait
        if (lane == 0) l2_prefetch(ring.pw, P * 512u);  // lane 0's words start the chunk (g = 0 for the scales too)
        if (lane == 1) l2_prefetch(ring.ps, P * 64u);
        pdl_prologue();  // gate_up's h is complete and visible from here
    }
#pragma unroll
    for (int k = 0; k < P; ++k) ring.load(k, k, c_real);
    l_next();

    int c_wi = gw, c_chunk = 0;
    int my_slot[NT];  // slot of token column g of each n tile (lane g's B operand; 4 lanes hold each)
    float my_w[NT];
    auto prefetch_slots = [&](int wi) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            my_slot[j] = slot_of(wi / n_pairs, 8 * j + g);
            my_w[j] = staged ? s_wt[(wi / n_pairs) * TT + 8 * j + g]
                             : my_slot[j] >= 0 ? ld_cg_f32(topk_w + my_slot[j]) : 0.f;
        }
    };
    prefetch_slots(c_wi);
    float acc[2][NT][4];
    zero_acc<NT>(acc);

    for (int ch = 0; ch < total; ++ch) {
        const int base = P * ring.chunk;
#pragma unroll
        for (int k = 0; k < P; ++k) {
            group_mma<NT>(acc, ring.w[k], ring.s[k], ring.x[k]);
            ring.load(k, base + k, c_real);
        }
        l_next();
        if (++c_chunk < chunks) continue;
        // end of the item: weight each token column, stage [token][32 rows], 16-byte stores of out rows
        store_out_rows<NT>(acc, my_w, my_slot, stage, out, d, c_wi % n_pairs);
        c_chunk = 0;
        c_wi += n_warps;
        if (c_wi < n_work) prefetch_slots(c_wi);
    }
}

// ---------------------------------------------------------------------------------------------------------
// One token (the AR step): gate_up and down in one launch (launch_v3.ONE_LAUNCH)
// ---------------------------------------------------------------------------------------------------------
// CTA b of top_k x n_pairs13 (16 warps, one CTA an SM) takes pick k = b / n_pairs13 of the token and row pair
// p = b % n_pairs13 of that expert's w13: gate_up's item as the 16-warp kernel runs it with PF_ONE (the same ring,
// group order and warp-order reduction: the same h bits).  Its warp w then takes down's row pair q = p + n_pairs13 w
// of the same expert (where q < n_pairs2), as down's warps do (the same group order and epilogue: the same out bits),
// with that row pair's weights and scales copied into shared memory (cp.async) before gate_up's stream starts, so
// they are in flight while gate_up runs instead of after its grid ends.  down needs slot k's whole h row, which the
// n_pairs13 CTAs of pick k write: each CTA adds 1 to sync[k] after its h stores (release) and waits for sync[k] ==
// n_pairs13 (acquire) before its down math.  Every CTA of the grid is resident at once (the launcher keeps the grid
// within the SMs, and a CTA takes a whole SM's registers), so the wait ends; a wait past ~1-2 s traps (a launch error,
// not a hang).  The last CTA of pick k past the wait (sync[top_k + k] its arrivals) zeroes both words for the next
// call.  The expert comes from topk_idx (the route kernel's output, through L2): neither the counts nor the lists.
// With the shared expert's down weights (sd_w [d, i_s] bf16, launch_v3.ONE_SHARED) CTA b also forms sd_rows rows of
// shared_h [i_s] . sd_w^T into sd_out [d] fp32 (one_shared_rows) while it waits for pick k's other CTAs, its weight
// rows copied into shared memory with down's: rows b sd_rows .., or with y (below) slice k of the rows of p's down
// row pairs (p + n_pairs13 w, the pairs its warps take: 32 m_p rows).  The combine then adds sd_out instead of
// forming the product itself (which it cannot start before this grid leaves the SMs).  Every CTA does its rows, local
// pick or not.
// With y (launch_v3.ONE_COMBINE) the grid also does the combine: the top_k CTAs (k, p) of one p write the out rows and
// the shared rows of the same row pairs, so after its rows each takes a ticket of sync[2 top_k + p] and the last sums
// them into y (one_combine_rows: the combine kernel's arithmetic, the same bits); CTA 0 re-zeroes the routing counts.
#define ONE_P 7  // gate_up's ring depth: GATE_UP_W16's (launch_v3.GATE_UP_W16_P), whose bits it keeps

// Row pair p's rows: its row i (of 32 m_p, where m_p = the down row pairs p + n_pairs13 w < n_pairs2) is d's row
__device__ __forceinline__ int one_group_row(int i, int p, int n_pairs13) {
    return 32 * (p + n_pairs13 * (i >> 5)) + (i & 31);
}

// d's row of a CTA's shared-expert slice row i: row pair p's (by_pair: ONE_COMBINE) or a plain range
__device__ __forceinline__ int one_shared_row(int i, bool by_pair, int p, int n_pairs13) {
    return by_pair ? one_group_row(i, p, n_pairs13) : i;
}

// A CTA's slice of the shared-expert rows, (first slice row r0, rows n_sd): CTA b's range b sd_rows .. of d, or
// (by_pair) CTA (k, p)'s k-th sd_rows of row pair p's 32 m_p rows; none without the shared expert (has false)
__device__ __forceinline__ int2 one_slice(bool by_pair, bool has, int k, int p, int sd_rows, int d, int n_pairs13,
                                          int n_pairs2) {
    const int m_p = p < n_pairs2 ? (n_pairs2 - p + n_pairs13 - 1) / n_pairs13 : 0;
    const int r0 = (by_pair ? k : (int)blockIdx.x) * sd_rows;
    return make_int2(r0, has ? max(0, min(sd_rows, (by_pair ? 32 * m_p : d) - r0)) : 0);
}

// kdtree_moe_v3_one's shared-expert rows: for its slice's row r < n_sd (d's row one_shared_row(r0 + r)),
// sd_out[row] = sum over i_s of sd_h[c] * s_sd[r][c] in fp32; warp w takes rows w, w + 16, ..., lane l the 8-column
// chunks l, l + 32, ... (products in column order within a chunk, chunks in order within a lane, then the lanes'
// butterfly sum: a row's bits do not depend on which CTA forms it).  Waits for this thread's cp.async copies and
// then the CTA's, so every thread of the CTA calls it.
__device__ __forceinline__ void one_shared_rows(const uint4* s_sd, const uint4* __restrict__ sd_h,
                                                float* __restrict__ sd_out, int2 slice, int i_s, bool by_pair,
                                                int p, int n_pairs13, int warp, int lane) {
    const int r0 = slice.x, n_sd = slice.y;
    cp_async_wait_all();
    __syncthreads();
    const int chunks = i_s / 8;
    for (int r = warp; r < n_sd; r += 16) {
        float acc = 0.f;
        for (int c = lane; c < chunks; c += 32) {
            const uint4 wv = s_sd[r * chunks + c], hv = sd_h[c];
            const u32 wa[4] = {wv.x, wv.y, wv.z, wv.w}, ha[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc = fmaf(bf16_lo(ha[j]), bf16_lo(wa[j]), acc);
                acc = fmaf(bf16_hi(ha[j]), bf16_hi(wa[j]), acc);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) sd_out[one_shared_row(r0 + r, by_pair, p, n_pairs13)] = acc;
    }
}

// The combine of row pair p's 32 m_p rows (ONE_COMBINE), by the last of its top_k CTAs: for 8 columns a thread,
// y = bf16(bf16(the local slots' out rows summed in fp32 in slot order, + 0 for the others) + sd_out) (without the
// shared expert, bf16 of the sum): combine_shared_kernel's (and combine_kernel's) arithmetic, the same bits.  out and
// sd_out are other CTAs' stores, read through L2 after the ticket's fences.
__device__ __forceinline__ void one_combine_rows(const u16* out, const int* topk_idx, const float* sd_out, u16* y,
                                                 int top_k, int e_start, int e_local, int p, int n_pairs13,
                                                 int n_pairs2, int d) {
    const int m_p = p < n_pairs2 ? (n_pairs2 - p + n_pairs13 - 1) / n_pairs13 : 0;
    for (int v = threadIdx.x; v < 4 * m_p; v += blockDim.x) {  // [m_p * 32 rows / 8]: 8 columns of y a thread
        const int col = one_group_row(8 * v, p, n_pairs13);
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        for (int j = 0; j < top_k; ++j) {
            const int le = ld_cg_s32(topk_idx + j) - e_start;
            const bool local = le >= 0 && le < e_local;
            uint4 o = make_uint4(0u, 0u, 0u, 0u);
            if (local) asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                                    : "=r"(o.x), "=r"(o.y), "=r"(o.z), "=r"(o.w) : "l"(out + (long)j * d + col));
            const u32 oa[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                acc[2 * c] += bf16_lo(oa[c]);
                acc[2 * c + 1] += bf16_hi(oa[c]);
            }
        }
        u32 ya[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            float lo = acc[2 * c], hi = acc[2 * c + 1];
            if (sd_out != nullptr) {
                lo = __uint_as_float((u32)to_bf16(lo) << 16) + __ldcg(sd_out + col + 2 * c);
                hi = __uint_as_float((u32)to_bf16(hi) << 16) + __ldcg(sd_out + col + 2 * c + 1);
            }
            ya[c] = (u32)to_bf16(lo) | ((u32)to_bf16(hi) << 16);
        }
        *reinterpret_cast<uint4*>(y + col) = make_uint4(ya[0], ya[1], ya[2], ya[3]);
    }
}

extern "C" __global__ void __launch_bounds__(16 * 32, 1) kdtree_moe_v3_one(
    const uint4* __restrict__ w13, const uint2* __restrict__ s13, const uint4* __restrict__ w2,
    const uint2* __restrict__ s2, const uint4* __restrict__ x, const int* __restrict__ topk_idx,
    const float* __restrict__ topk_w, u16* __restrict__ h, u16* __restrict__ out, int* __restrict__ sync, int top_k,
    int e_start, int e_local, int c_real13, int n_groups13, int n_pairs13, int inter, int c_real2, int n_groups2,
    int n_pairs2, int d, const uint4* __restrict__ sd_w, const uint4* __restrict__ sd_h, float* __restrict__ sd_out,
    int i_s, int sd_rows, u16* __restrict__ y, int* __restrict__ counts) {
    constexpr int W = 16, P = ONE_P;
    __shared__ int s_last;  // last_arrival's flag
    extern __shared__ __align__(16) unsigned char smem[];
    float* s_red = reinterpret_cast<float*>(smem);                // [W][2 m][4][32] gate_up's partial sums
    u16* s_h = reinterpret_cast<u16*>(s_red + W * 2 * 128);      // [8 tokens][16 rows] bf16
    u16* s_o = s_h + 8 * 16;                                     // [W][8 tokens][32 rows] bf16: down's rows, staged
    uint4* s_w2 = reinterpret_cast<uint4*>(s_o + W * 8 * 32);    // [W][n_groups2][32 lanes] down's words
    uint2* s_s2 = reinterpret_cast<uint2*>(s_w2 + W * n_groups2 * 32);  // [W][n_groups2][32 lanes] its scales
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, u = lane & 3;
    const int k = blockIdx.x / n_pairs13, p = blockIdx.x % n_pairs13, q = p + n_pairs13 * warp;
    // this CTA's rows of sd_w (slice k of row pair p's with the combine, else a range), into shared memory before
    // the wait: constants
    uint4* s_sd = reinterpret_cast<uint4*>(s_s2 + W * n_groups2 * 32);  // [n_sd][i_s / 8] uint4
    const bool by_pair = y != nullptr;
    {
        const int2 sl = one_slice(by_pair, sd_w != nullptr, k, p, sd_rows, d, n_pairs13, n_pairs2);  // (r0, n_sd)
        const int cpr = i_s / 8;  // 16-byte pieces a row
        for (int j = tid; j < sl.y * cpr; j += W * 32)
            cp_async16(smem_u32(s_sd + j), sd_w + (long)one_shared_row(sl.x + j / cpr, by_pair, p, n_pairs13) * cpr
                       + j % cpr, 16);
    }
    pdl_prologue();  // topk_idx / topk_w from the route kernel, this grid's predecessor
    if (y != nullptr && blockIdx.x == 0)  // the routing counts back to zero for the next call (nothing here reads them)
        for (int j = tid; j <= e_local; j += W * 32) counts[j] = 0;
    const int e = ld_count(topk_idx + k) - e_start;
    if (e < 0 || e >= e_local) {  // not a local expert: uniform over the CTA and over pick k's CTAs
        cp_async_commit();
        one_shared_rows(s_sd, sd_h, sd_out, one_slice(by_pair, sd_w != nullptr, k, p, sd_rows, d, n_pairs13,
                        n_pairs2), i_s, by_pair, p, n_pairs13, warp, lane);
        if (y != nullptr && last_arrival(sync + 2 * top_k + p, top_k, &s_last))
            one_combine_rows(out, topk_idx, sd_w == nullptr ? nullptr : sd_out, y, top_k, e_start, e_local, p,
                             n_pairs13, n_pairs2, d);
        return;
    }

    const bool has_down = q < n_pairs2;
    if (has_down) {  // this lane's words and scales of down's row pair q, in group order
        const long blk = ((long)e * n_pairs2 + q) * n_groups2;
        const u32 dw = smem_u32(s_w2 + warp * n_groups2 * 32 + lane);
        const u32 ds = smem_u32(s_s2 + warp * n_groups2 * 32 + lane);
        for (int c = 0; c < n_groups2; ++c) {
            cp_async16(dw + c * 512, w2 + (blk + c) * 32 + lane, 16);
            cp_async8(ds + c * 256, s2 + (blk + c) * 8 + g);
        }
    }
    cp_async_commit();

    // gate_up: item (e, p), warp w takes groups w + W m; token 0 at column 0 (PF_ONE)
    Ring<1, P> ring;
    const long blk13 = ((long)e * n_pairs13 + p) * n_groups13;
    ring.pw = w13 + blk13 * 32 + lane;
    ring.ps = s13 + blk13 * 8 + g;
    ring.px[0] = g == 0 ? x + u : nullptr;
    const int chunks = n_groups13 / (W * P);  // the launcher checks that W P divides the groups
#pragma unroll
    for (int kk = 0; kk < P; ++kk) ring.load(kk, warp + W * kk, c_real13);
    float acc[2][1][4];
    zero_acc<1>(acc);
    for (int ch = 0; ch < chunks; ++ch) {
        const bool more = ch + 1 < chunks;  // uniform
        const int base = warp + W * P * (ch + 1);
#pragma unroll
        for (int kk = 0; kk < P; ++kk) {
            group_mma<1>(acc, ring.w[kk], ring.s[kk], ring.x[kk]);
            if (more) ring.load(kk, base + W * kk, c_real13);
        }
    }
    item_h<1, W>(acc, s_red, s_h);  // acc zeroed for down
    if (tid < 2)  // token column 0 (slot k): h[k, 16 p ..] in two 16-byte stores
        *reinterpret_cast<uint4*>(h + (long)k * inter + p * 16 + 8 * tid) =
            *reinterpret_cast<const uint4*>(s_h + 8 * tid);
    __syncthreads();
    if (tid == 0) {  // publish this CTA's h rows
        __threadfence();
        atomicAdd(sync + k, 1);
    }
    // the shared rows while pick k's other CTAs work
    one_shared_rows(s_sd, sd_h, sd_out, one_slice(by_pair, sd_w != nullptr, k, p, sd_rows, d, n_pairs13,
                        n_pairs2), i_s, by_pair, p, n_pairs13, warp, lane);
    if (tid == 0) {  // wait for pick k's other CTAs' h rows
        for (long spins = 0; ld_acquire_gpu(sync + k) < n_pairs13; ++spins) {
            if (spins > (1l << 21)) __trap();  // ~1-2 s of polls: a CTA of the grid never ran (not resident at once)
            __nanosleep(32);
        }
        if (atomicAdd(sync + top_k + k, 1) == n_pairs13 - 1) {  // the last past the wait: zero both for the next call
            sync[k] = 0;
            sync[top_k + k] = 0;
        }
    }
    __syncthreads();
    if (!has_down && y == nullptr) return;

    if (has_down) {  // down: row pair q over the whole k from shared memory, h row k through L2 at token column 0
        cp_async_wait_all();
        __syncwarp();
        const uint4* hx = g == 0 ? reinterpret_cast<const uint4*>(h) + (long)k * c_real2 * 4 + u : nullptr;
        const uint4* sw = s_w2 + warp * n_groups2 * 32 + lane;
        const uint2* ss = s_s2 + warp * n_groups2 * 32 + lane;
        for (int c = 0; c < n_groups2; ++c) {
            const uint4 xv[1] = {ld_tokens_or_zero<true>(hx + 4 * c, hx != nullptr && c < c_real2)};
            group_mma<1>(acc, sw[c * 32], ss[c * 32], xv);
        }
        const float my_w[1] = {g == 0 ? ld_cg_f32(topk_w + k) : 0.f};  // token column 0 is slot k, the others none
        const int my_slot[1] = {g == 0 ? k : -1};
        store_out_rows<1>(acc, my_w, my_slot, s_o + warp * 8 * 32, out, d, q);
    }
    if (y != nullptr && last_arrival(sync + 2 * top_k + p, top_k, &s_last))  // every CTA of the grid reaches it
        one_combine_rows(out, topk_idx, sd_w == nullptr ? nullptr : sd_out, y, top_k, e_start, e_local, p, n_pairs13,
                         n_pairs2, d);
}

#define GATE_UP(NT, P, MINB)                                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB) kdtree_moe_v3_gate_up_nt##NT##_p##P(         \
        const uint4* w13, const uint2* s13, const uint4* x, const int* counts, const int* lists, u16* h, int t, \
        int top_k, int e_local, int c_real, int n_groups, int n_pairs, int inter, int pf) {                  \
        pdl_prologue();                                                                                        \
        gate_up<NT, P, WARPS>(w13, s13, x, counts, lists, h, t, top_k, e_local, c_real, n_groups, n_pairs, inter, \
                              pf);                                                                             \
    }
// 16 warps in one CTA per SM (<= 128 registers each): where the items are about as many as the SMs (t = 1: 8
// experts x 16 row pairs), twice the warps per SM of two 8-warp CTAs that the items cannot fill
#define GATE_UP_W16(NT, P)                                                                                       \
    extern "C" __global__ void __launch_bounds__(16 * 32, 1) kdtree_moe_v3_gate_up_w16_nt##NT##_p##P(          \
        const uint4* w13, const uint2* s13, const uint4* x, const int* counts, const int* lists, u16* h, int t, \
        int top_k, int e_local, int c_real, int n_groups, int n_pairs, int inter, int pf) {                  \
        pdl_prologue();                                                                                        \
        gate_up<NT, P, 16>(w13, s13, x, counts, lists, h, t, top_k, e_local, c_real, n_groups, n_pairs, inter, pf); \
    }
#define DOWN_KERNEL(NAME, NT, P, MINB, EARLY)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, MINB) NAME(                                         \
        const uint4* w2, const uint2* s2, const uint4* h, const float* topk_w, const int* counts,             \
        const int* lists, u16* out, int t, int e_local, int c_real, int n_groups, int n_pairs, int d, int pf) {\
        down<NT, P, EARLY>(w2, s2, h, topk_w, counts, lists, out, t, e_local, c_real, n_groups, n_pairs, d, pf); \
    }
// each down variant twice: waiting first, and with its weights before the wait (launch_v3.EARLY_WEIGHTS)
#define DOWN(NT, P, MINB)                                                       \
    DOWN_KERNEL(kdtree_moe_v3_down_nt##NT##_p##P, NT, P, MINB, false)          \
    DOWN_KERNEL(kdtree_moe_v3_down_early_nt##NT##_p##P, NT, P, MINB, true)

// Variants (launch_v3.py picks): NT token tiles of 8; gate_up's P divides its groups per warp (kp_d / 256: 28 at
// d = 7168), down's P divides kp_i / 32 (a multiple of 8).  MINB 2: two CTAs per SM (<= 128 registers).
GATE_UP(1, 7, 2) GATE_UP(1, 4, 2) GATE_UP(1, 2, 2) GATE_UP(1, 1, 2)
GATE_UP(2, 4, 2) GATE_UP(2, 2, 2) GATE_UP(2, 1, 2)
GATE_UP(4, 2, 1) GATE_UP(4, 1, 1)
GATE_UP_W16(1, 7)
DOWN(1, 8, 2)
DOWN(2, 4, 2)
