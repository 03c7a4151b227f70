// tree_verify_wgmma: the tree_verify_mla split kernel for 64 query rows a program on Hopper's warpgroup MMA (sm_90a),
// bf16, d_qk 576 = d_v 512 + d_r 64: a DDTree round's attention (K2.6 TP8: 8 heads x 9..128 nodes).  Same contract
// as kernel.py's tree_verify_mla_split_kernel (partials in the same workspace layout, the same combine kernel after
// it); reference.py is the oracle.
//
// Why: the Triton kernel's 64 x 32 tiles with the value columns split over two programs compute every score twice
// and re-read the key tile per program (NOTES.md, "DDTree shapes swept again": ~21 GFLOP for 9.7 at N 17, 32K).  Here
// one CTA of two warpgroups (256 threads) owns 64 query rows and all 512 value columns, and a key tile of 64 latent
// rows is read from global memory once per CTA:
//   scores  warpgroup g computes S_g = Q [64 x 576] . K_g^T for keys 32 g .. 32 g + 31 of the tile (wgmma m64n32k16,
//           36 k steps, both operands in shared memory), so the scores are computed once;
//   softmax the two halves exchange their row maxima through shared memory (one barrier): both warpgroups then hold
//           the same running max m and rescale factor alpha, each keeps its own partial row sums (added at the end);
//           p = 2^(s - m) rounded to bf16 is stored into the shared P tile [64 x 64] (second barrier);
//   values  warpgroup g accumulates O_g += P [64 x 64] . V [64 x 256 g .. 256 g + 255] (wgmma m64n256k16, the key tile
//           read a second way: V is the same rows' first 512 columns, N-major), 128 fp32 registers a thread.
// Shared memory (dynamic, 1024-byte aligned, 128-byte swizzle: 16-byte chunk c of a 128-byte row r sits at chunk
// c ^ (r % 8)): Q as 9 blocks of [64 rows x 64 columns] (72 KB), two stages of the key tile in the same form (144 KB),
// P [64 x 64] (8 KB), the row-max exchange (512 B), two mbarriers.  The key tile t + 1 is loaded by the tensor memory
// accelerator (one thread, 9 boxes of 64 x 64, the 128-byte swizzle written by the copy itself) while tile t is
// computed (the barrier at the top of iteration t + 1 frees its stage); Q by cp.async.  Rows past the tensor's end
// land as zeros; committed rows past the length are zeroed after landing: their value rows meet p = 0, and 0 x a
// stale NaN would not be 0.
//
// Key range of request r and splits exactly as kernel.py: L = min(cache_lens[r], l_max) committed rows in
// cdiv(L, 64) tiles, then cdiv(n, 64) tiles of tree rows under the ancestor mask (64-key tiles: tree tile i is mask
// word i); split s takes tiles [s per, (s + 1) per), per = cdiv(all tiles, num_splits).  Program (m-block, split x
// request): blockIdx.x = m-block, blockIdx.y = r * num_splits + s.  direct != 0 (one split): out and lse (natural
// log) are written here; else o / l (fp32) and lse base 2 per split into the workspace.  Softmax in base 2 (scale2 =
// scale * log2 e), fp32 scores and sums, p rounded to bf16 for the value product (as the Triton kernel).
//
// PDL: the program waits for its predecessor grid (griddepcontrol.wait) before reading anything but, with `early`, the
// committed length and its first key tile when that is a committed one (early >= 2: its first two); then it lets the
// combine launch.  plugins/common/cuda/hopper.cuh is its one header (cubin.py inlines it for NVRTC).

#define KDTREE_ARCH_FEATURES  // plugins/common/cubin.py: compiled for sm_90a where the arch is sm_90 (wgmma)

#include "../common/cuda/hopper.cuh"  // smem_u32, pdl_*, mbar_*, cp_async16, fence_async_smem, smem_desc,
                                       // wgmma_*, ld_cg_s32

typedef unsigned short u16;

#define D_QK 576
#define D_V 512
#define BM 64  // query rows a CTA
#define BN 64  // keys a tile
#define NBLK 9  // 64-column blocks of a 576-wide row
#define BLK_BYTES (64 * 128)  // one block of 64 rows x 128 bytes
#define TILE_BYTES (NBLK * BLK_BYTES)  // 73728: Q, or one stage of the key tile
#define SMEM_Q 0
#define SMEM_KV TILE_BYTES
#define SMEM_P (3 * TILE_BYTES)
#define SMEM_RED (SMEM_P + BLK_BYTES)
#define SMEM_BAR (SMEM_RED + 2 * BM * 4)  // two mbarriers: stage 0 and 1 of the key tile landed
#define SMEM_BYTES 229904  // wgmma_launch.py asks for this + 1024 (alignment); the layout's end, checked below
static_assert(SMEM_BYTES == SMEM_BAR + 16, "SMEM_BYTES is the end of the shared-memory layout");
#define THREADS 256
#define NEG_INF (-__int_as_float(0x7f800000))

// (cp_async16, hopper.cuh: .cg, through L2 only: the key tile is read by the CTAs of the other m-blocks from L2)

__device__ __forceinline__ void wgmma_m64n32k16(float* d, u64 desc_a, u64 desc_b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
    __trap();  // wgmma needs sm_90a (wgmma_launch.py loads this kernel on sm_90 only)
#endif
}

__device__ __forceinline__ void wgmma_m64n256k16_vt(float* d, u64 desc_a, u64 desc_b, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1, 0, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
          "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
          "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
          "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]),
          "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]),
          "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
          "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]),
          "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
          "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]),
          "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]),
          "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
          "+f"(d[126]), "+f"(d[127])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
#else
    __trap();  // wgmma needs sm_90a (wgmma_launch.py loads this kernel on sm_90 only)
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {  // 2^x, -inf -> 0 (as Triton's exp2)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {  // round to nearest even, lo in the low half
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// A thread's part of a 64-row tile load: 16-byte chunk c8 = tid % 8 of each 128-byte row block, rows r = tid / 8 and
// r + 32, all 9 blocks: 18 chunks at fixed offsets (8 threads read a row block's 128 contiguous bytes).  Its shared
// offset within a block is the same for both rows (r and r + 32 share r % 8, the swizzle's phase).
__device__ __forceinline__ u32 tile_offset(int tid) {
    const int r = tid >> 3, c8 = tid & 7;
    return r * 128 + ((c8 ^ (r & 7)) << 4);
}

// The latent cache and the tree rows come by TensorMap (hopper.cuh): a [b, rows, 576] bf16 tensor (wgmma_launch.py:
// boxes of 64 columns x 64 rows, 128-byte swizzle, rows past the tensor's end read as zeros).
// One 64 x 64 box (columns c0.., rows c1.., request c2) of the tensor behind `map` into shared memory at dst (1024-byte
// aligned: the swizzle is the one wgmma reads), completing `bytes` on the mbarrier at bar.
__device__ __forceinline__ void tma_box(u32 dst, const TensorMap* map, int c0, int c1, int c2, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
        ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// Key tile t of request r (the first t_cache tiles from the cache, then the tree's) into the stage at `tile`: one
// thread arms the stage's mbarrier with the tile's bytes and issues its 9 boxes.
__device__ __forceinline__ void issue_tile(u32 tile, u32 bar, const TensorMap* cache_map, const TensorMap* tree_map,
                                           int t, int t_cache, int r) {
    const bool in_c = t < t_cache;
    const TensorMap* map = in_c ? cache_map : tree_map;
    const int first = (in_c ? t : t - t_cache) * BN;
    mbar_expect_tx(bar, TILE_BYTES);
#pragma unroll
    for (int blk = 0; blk < NBLK; ++blk) tma_box(tile + blk * BLK_BYTES, map, blk * 64, first, r, bar);
}

// The CTA's 64 query rows (row i = node * h + head of m-block mb; past m_rows zero-filled) -> the Q tile.
__device__ __forceinline__ void load_q(u32 tile, const u16* q, long long sqn, long long sqh, int first, int m_rows,
                                       int h, int tid) {
    const int r = tid >> 3, c8 = tid & 7;
    const u32 dst = tile + tile_offset(tid);
    const int g0 = first + r, g1 = first + r + 32;
    const bool ok0 = g0 < m_rows, ok1 = g1 < m_rows;
    const u16* src0 = ok0 ? q + (g0 / h) * sqn + (g0 % h) * sqh + c8 * 8 : q;
    const u16* src1 = ok1 ? q + (g1 / h) * sqn + (g1 % h) * sqh + c8 * 8 : q;
#pragma unroll
    for (int blk = 0; blk < NBLK; ++blk) {
        cp_async16(dst + blk * BLK_BYTES, src0 + (ok0 ? blk * 64 : 0), ok0 ? 16u : 0u);
        cp_async16(dst + blk * BLK_BYTES + 32 * 128, src1 + (ok1 ? blk * 64 : 0), ok1 ? 16u : 0u);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) tree_verify_wgmma(
    const __grid_constant__ TensorMap cache_map, const __grid_constant__ TensorMap tree_map,
    const u16* __restrict__ q, const int* __restrict__ lens, const long long* __restrict__ mask,
    void* __restrict__ out, float* __restrict__ lse, float* __restrict__ opart, float* __restrict__ lpart,
    long long sqb, long long sqn, long long sqh,
    long long smb, long long smn, long long sob, long long son, long long soh, long long slb, long long sln,
    int n, int h, int l_max, int num_splits, float scale2, int direct, int out_f32, int early) {
    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_u32(smem_raw);
    const u32 pad = (1024u - (raw & 1023u)) & 1023u;  // the swizzle atoms need 1024-byte alignment
    unsigned char* smem = smem_raw + pad;
    const u32 sb = raw + pad;
    float* red = (float*)(smem + SMEM_RED);  // [2 warpgroups][64 rows]: row maxima, then row sums
    const u32 bar = sb + SMEM_BAR;  // stage i's mbarrier at bar + 8 i

    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid & 127) >> 5, lane = tid & 31;
    const int mb = blockIdx.x, s = blockIdx.y % num_splits;
    const long long r = blockIdx.y / num_splits;
    const int m_rows = n * h;

    if (tid == 0) {
        mbar_init(bar, 1);
        mbar_init(bar + 8, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    // The committed rows and their count are written only by kv_commit at the end of a round, never by the grids just
    // before this one: with `early` a first tile from the cache is in flight before the wait, under the predecessor
    // (q_absorb) that the wait is for.  Tree rows, q, the mask and the workspace are read after it.
    // committed tiles, then the tree's: t_all tiles, split s takes [s per, (s + 1) per)
    int length = 0, t_cache = 0, t_all = 0, per = 0;
    auto plan_tiles = [&]() {
        length = max(0, min(ld_cg_s32(lens + r), l_max));
        t_cache = (length + BN - 1) / BN;
        t_all = t_cache + (n + BN - 1) / BN;
        per = (t_all + num_splits - 1) / num_splits;
    };
    if (early) plan_tiles();
    const bool first_early = early && s * per < t_cache;  // the split's first tile is a committed one (so it has one)
    // early >= 2: the second stage too, where the split's second tile is a committed one
    const bool second_early = first_early && early >= 2 && per > 1 && s * per + 1 < t_cache;
    if (tid == 0 && first_early) issue_tile(sb + SMEM_KV, bar, &cache_map, &tree_map, s * per, t_cache, (int)r);
    if (tid == 0 && second_early)
        issue_tile(sb + SMEM_KV + TILE_BYTES, bar + 8, &cache_map, &tree_map, s * per + 1, t_cache, (int)r);
    pdl_wait();  // q, tree rows, mask and the workspace come from the predecessor grids
    pdl_trigger();  // the combine may become resident; it waits for this grid's completion

    if (!early) plan_tiles();
    const int t_lo = s * per, t_hi = min(t_lo + per, t_all);

    // this thread's accumulator rows (wgmma D layout: warp w of a warpgroup holds rows 16 w .. 16 w + 15; lane l rows
    // l / 4 and l / 4 + 8, columns 2 (l % 4) + {0, 1} of every 8-column block)
    const int row0 = warp * 16 + (lane >> 2), row1 = row0 + 8;
    const int g0 = mb * BM + row0, g1 = mb * BM + row1;
    const bool ok0 = g0 < m_rows, ok1 = g1 < m_rows;
    const long long* mask0 = mask + r * smb + (long long)(ok0 ? g0 / h : 0) * smn;
    const long long* mask1 = mask + r * smb + (long long)(ok1 ? g1 / h : 0) * smn;
    const int cq = 2 * (lane & 3);

    if (tid == 0 && t_lo < t_hi && !first_early)
        issue_tile(sb + SMEM_KV, bar, &cache_map, &tree_map, t_lo, t_cache, (int)r);
    load_q(sb + SMEM_Q, q + r * sqb, sqn, sqh, mb * BM, m_rows, h, tid);
    cp_async_commit();

    float o[128];  // O_g [64 x 256]: value columns 256 g + 8 j + cq + {0, 1} of rows row0 (o[4 j], o[4 j + 1]) and
#pragma unroll     // row1 (o[4 j + 2], o[4 j + 3])
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;  // running max (shared by both halves), own partial sums
    // descriptors of Q and P (fixed); every address stays below 2^18, so a k step's offset >> 4 adds to the
    // descriptor's 14-bit address field without a carry
    const u64 dq = smem_desc(sb + SMEM_Q, 16, 1024), dp = smem_desc(sb + SMEM_P, 16, 1024);

    for (int t = t_lo; t < t_hi; ++t) {
        const int i = t - t_lo;
        const u32 kv = sb + SMEM_KV + (i & 1) * TILE_BYTES;
        cp_async_wait_all();  // this thread's part of Q
        mbar_wait(bar + 8 * (i & 1), (i >> 1) & 1);  // tile t landed (the stage's (i / 2)-th use)
        if (t < t_cache && length - t * BN < BN) {  // the last committed tile: zero its rows past the length (the
            const int valid = length - t * BN;       // map reads them: stale rows, and p = 0 times a NaN is NaN)
            for (int e = tid; e < NBLK * (BN - valid) * 8; e += THREADS) {
                const int blk = e / ((BN - valid) * 8), rest = e - blk * (BN - valid) * 8;
                *(uint4*)(smem + SMEM_KV + (i & 1) * TILE_BYTES + blk * BLK_BYTES + valid * 128 + rest * 16) =
                    make_uint4(0u, 0u, 0u, 0u);
            }
        }
        fence_async_smem();
        __syncthreads();  // tile t (and Q) visible to wgmma; every warp is done with tile t - 1, its stage and P
        if (tid == 0 && t + 1 < t_hi && !(i == 0 && second_early))  // (the second stage's tile issued early)
            issue_tile(sb + SMEM_KV + ((i + 1) & 1) * TILE_BYTES, bar + 8 * ((i + 1) & 1), &cache_map, &tree_map,
                       t + 1, t_cache, (int)r);

        float sc[16];  // S_g [64 x 32]: keys 32 g + 8 j + cq + {0, 1}, rows row0 (sc[4 j], sc[4 j + 1]), row1
        const u64 dk = smem_desc(kv + wg * 32 * 128, 16, 1024);  // the k step's offset is added to the address field
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D_QK / 16; ++kk) {
            const u32 col = ((kk >> 2) * BLK_BYTES + (kk & 3) * 32) >> 4;
            wgmma_m64n32k16(sc, dq + col, dk + col, kk > 0);
        }
        wgmma_commit();
        wgmma_wait_all();

        // visibility: committed keys below the length; tree keys below n under the row's ancestor word
        const bool in_c = t < t_cache;
        const int first = (in_c ? t : t - t_cache) * BN;
        const int lim = (in_c ? length : n) - first;
        u64 w0 = ok0 ? ~0ull : 0ull, w1 = ok1 ? ~0ull : 0ull;
        if (!in_c) {
            w0 = ok0 ? (u64)mask0[t - t_cache] : 0ull;
            w1 = ok1 ? (u64)mask1[t - t_cache] : 0ull;
        }
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = wg * 32 + j * 8 + cq + e;
                const bool kok = key < lim;
                const float x0 = (kok && ((w0 >> key) & 1ull)) ? sc[4 * j + e] * scale2 : NEG_INF;
                const float x1 = (kok && ((w1 >> key) & 1ull)) ? sc[4 * j + 2 + e] * scale2 : NEG_INF;
                sc[4 * j + e] = x0;
                sc[4 * j + 2 + e] = x1;
                mx0 = fmaxf(mx0, x0);
                mx1 = fmaxf(mx1, x1);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        if ((lane & 3) == 0) {
            red[wg * BM + row0] = mx0;
            red[wg * BM + row1] = mx1;
        }
        __syncthreads();  // both halves' row maxima
        const float mn0 = fmaxf(m0, fmaxf(mx0, red[(wg ^ 1) * BM + row0]));
        const float mn1 = fmaxf(m1, fmaxf(mx1, red[(wg ^ 1) * BM + row1]));
        const float mu0 = mn0 == NEG_INF ? 0.f : mn0, mu1 = mn1 == NEG_INF ? 0.f : mn1;  // never -inf - -inf
        const float a0 = fast_exp2(m0 - mu0), a1 = fast_exp2(m1 - mu1);
        m0 = mn0;
        m1 = mn1;
        float ps0 = 0.f, ps1 = 0.f;
        unsigned char* p_tile = smem + SMEM_P;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float p00 = fast_exp2(sc[4 * j] - mu0), p01 = fast_exp2(sc[4 * j + 1] - mu0);
            const float p10 = fast_exp2(sc[4 * j + 2] - mu1), p11 = fast_exp2(sc[4 * j + 3] - mu1);
            ps0 += p00 + p01;
            ps1 += p10 + p11;
            const int chunk = wg * 4 + j;  // 16-byte chunk of the key columns 8 chunk .. 8 chunk + 7
            *(u32*)(p_tile + row0 * 128 + ((chunk ^ (row0 & 7)) << 4) + cq * 2) = pack_bf16(p00, p01);
            *(u32*)(p_tile + row1 * 128 + ((chunk ^ (row1 & 7)) << 4) + cq * 2) = pack_bf16(p10, p11);
        }
        l0 = l0 * a0 + ps0;
        l1 = l1 * a1 + ps1;
        fence_async_smem();
        __syncthreads();  // P [64 x 64] complete

#pragma unroll
        for (int j = 0; j < 32; ++j) {
            o[4 * j] *= a0;
            o[4 * j + 1] *= a0;
            o[4 * j + 2] *= a1;
            o[4 * j + 3] *= a1;
        }
        const u64 dv = smem_desc(kv + wg * 4 * BLK_BYTES, BLK_BYTES, 1024);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_m64n256k16_vt(o, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4), 1);
        wgmma_commit();
        wgmma_wait_all();
    }

    // row sums: over the quad, then the two halves (the last reads of red came before the last P barrier)
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if ((lane & 3) == 0) {
        red[wg * BM + row0] = l0;
        red[wg * BM + row1] = l1;
    }
    __syncthreads();
    l0 += red[(wg ^ 1) * BM + row0];
    l1 += red[(wg ^ 1) * BM + row1];
    const bool seen0 = l0 > 0.f, seen1 = l1 > 0.f;
    const float inv0 = seen0 ? 1.f / l0 : 0.f, inv1 = seen1 ? 1.f / l1 : 0.f;
    const float lse0 = seen0 ? m0 + __log2f(l0) : NEG_INF, lse1 = seen1 ? m1 + __log2f(l1) : NEG_INF;
    const int col0 = wg * 256 + cq;
    if (direct) {
        const long long base0 = r * sob + (long long)(g0 / h) * son + (g0 % h) * soh + col0;
        const long long base1 = r * sob + (long long)(g1 / h) * son + (g1 % h) * soh + col0;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            if (out_f32) {
                if (ok0) *(float2*)((float*)out + base0 + 8 * j) = make_float2(o[4 * j] * inv0, o[4 * j + 1] * inv0);
                if (ok1)
                    *(float2*)((float*)out + base1 + 8 * j) = make_float2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
            } else {
                if (ok0) *(u32*)((u16*)out + base0 + 8 * j) = pack_bf16(o[4 * j] * inv0, o[4 * j + 1] * inv0);
                if (ok1) *(u32*)((u16*)out + base1 + 8 * j) = pack_bf16(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
            }
        }
        if (wg == 0 && (lane & 3) == 0) {
            const float ln2 = 0.6931471805599453f;
            if (ok0) lse[r * slb + (long long)(g0 / h) * sln + g0 % h] = lse0 * ln2;
            if (ok1) lse[r * slb + (long long)(g1 / h) * sln + g1 % h] = lse1 * ln2;
        }
    } else {
        const long long part0 = (r * num_splits + s) * m_rows + g0, part1 = (r * num_splits + s) * m_rows + g1;
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            if (ok0 && seen0)
                *(float2*)(opart + part0 * D_V + col0 + 8 * j) = make_float2(o[4 * j] * inv0, o[4 * j + 1] * inv0);
            if (ok1 && seen1)
                *(float2*)(opart + part1 * D_V + col0 + 8 * j) = make_float2(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1);
        }
        if (wg == 0 && (lane & 3) == 0) {
            if (ok0) lpart[part0] = lse0;
            if (ok1) lpart[part1] = lse1;
        }
    }
}
