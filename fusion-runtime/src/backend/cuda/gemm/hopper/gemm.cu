// A persistent GEMM for Hopper (sm_90a): C[M,N] = A[M,K] B[K,N], bf16 or f16 operands,
// f32 accumulation, C in the operands' type. One block per SM walks output tiles of
// 128 x 256 in the order `tile_at` gives. Three warpgroups per block: the first loads
// (one thread issues bulk tensor copies of A and B tiles into a ring of STAGES shared-memory
// stages, each completing on its `full` barrier); the other two each multiply 64 rows of
// the tile with wgmma from shared memory and release a stage on its `empty` barrier once
// their matrix instructions have read it. Because the loader runs ahead across tiles, the
// next tile's first stages load while the consumers store the last one.
//
// Operand layouts, chosen by template arguments: A is K-contiguous (row-major) or
// M-contiguous (a transposed view); B is N-contiguous (row-major) or K-contiguous. Tiles
// sit in shared memory in the 128-byte swizzle that both the copy engine and wgmma read.
// The tensor maps (built on the host) give the copy engine the global strides and bounds:
// loads past M, N or K fill zeros, and the epilogue stores only in-bounds elements.
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#define BM 128
#define BN 256
#define BK 64
#define STAGES 4
#define CONSUMERS 2
#define THREADS (128 * (CONSUMERS + 1))
#define A_BYTES (BM * BK * 2)
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
// The epilogue stages a consumer's output through shared memory in pieces of 64 x 64
// (128-byte rows, swizzled like the operands), two per consumer, stored by the copy engine.
#define OUT_PIECE_BYTES (64 * 64 * 2)
#define OUT_BYTES (CONSUMERS * 2 * OUT_PIECE_BYTES)
// Stages, output pieces, then the barriers; 1024 bytes of slack to align for the swizzle.
#define SMEM_BYTES (STAGES * STAGE_BYTES + OUT_BYTES + 1024 + 2 * STAGES * 8)
// M tiles per group of the tile order: a wave of blocks shares A rows and B columns in L2.
#define GROUP_M 8

// A tensor map as the driver encodes it (opaque, 128 bytes, 64-byte aligned).
struct alignas(64) TensorMap { u64 words[16]; };

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void bar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void bar_expect_bytes(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(bar)) : "memory");
}

// Waits until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    }
}

// One 2-D box of `map` at (c0 innermost, c1) into shared memory, completing on `bar`.
__device__ __forceinline__ void load_box(void* dst, const TensorMap* map, int c0, int c1, u64* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_u32(dst)), "l"((u64)map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
                 : "memory");
}

// A shared-memory matrix descriptor for wgmma, 128-byte swizzle. `lead` and `stride` are
// the byte offsets between core-matrix groups along the operand's two dimensions.
__device__ __forceinline__ u64 smem_desc(const void* p, u32 lead, u32 stride) {
    u64 d = 0;
    d |= (u64)((smem_u32(p) & 0x3FFFF) >> 4);
    d |= (u64)((lead >> 4) & 0x3FFF) << 16;
    d |= (u64)((stride >> 4) & 0x3FFF) << 32;
    d |= (u64)1 << 62;
    return d;
}

#include "wgmma.inc.cu"

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Tile `t` of the walk: groups of GROUP_M tile rows, each walked column by column.
__device__ __forceinline__ void tile_at(int t, int tiles_m, int tiles_n, int* tm, int* tn) {
    int per_group = GROUP_M * tiles_n;
    int group = t / per_group;
    int first_m = group * GROUP_M;
    int rows = min(tiles_m - first_m, GROUP_M);
    int in_group = t - group * per_group;
    *tm = first_m + in_group % rows;
    *tn = in_group / rows;
}

__device__ __forceinline__ u32 pack2(float lo, float hi, bool f16) {
    u32 r;
    if (f16) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Barrier among the 128 threads of consumer warpgroup `consumer` (ids 1.. ; 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync(int consumer) {
    asm volatile("bar.sync %0, 128;" :: "r"(consumer + 1) : "memory");
}

// Stores a 64 x 64 box of shared memory at (c0 innermost, c1) of `map`; the copy engine
// clips what falls outside the tensor.
__device__ __forceinline__ void store_box(const TensorMap* map, int c0, int c1, const void* src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 :: "l"((u64)map), "r"(c0), "r"(c1), "r"(smem_u32(src)) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N of this thread's bulk stores still read shared memory.
template <int N> __device__ __forceinline__ void stores_read_wait() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

// Stores a consumer's 64 x 256 accumulators at rows m0.., columns n0.. of C through its two
// shared-memory pieces, 64 columns at a time. Thread layout of m64nNk16: warp w owns rows
// 16w..16w+15; lane l holds, per 8 columns j, rows l/4 and l/4+8, columns 2(l%4) and +1.
// In a piece, row r's 16-byte chunk j sits at chunk j ^ (r % 8) (the 128-byte swizzle),
// so a warp's stores hit 32 different banks.
template <bool F16>
__device__ __forceinline__ void store_tile(const float* d, unsigned char* out, const TensorMap* c_map,
                                           int consumer, int m0, int n0) {
    int t = threadIdx.x % 128;
    int row = (t / 32) * 16 + (t % 32) / 4;
#pragma unroll
    for (int q = 0; q < BN / 64; ++q) {
        unsigned char* piece = out + (q % 2) * OUT_PIECE_BYTES;
        if (t == 0) stores_read_wait<1>();
        consumer_sync(consumer);
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            int j = 8 * q + jj;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int r = row + 8 * h;
                u32 v = pack2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1], F16);
                *(u32*)(piece + r * 128 + ((jj ^ (r % 8)) * 16) + 4 * (t % 4)) = v;
            }
        }
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        consumer_sync(consumer);
        if (t == 0) store_box(c_map, n0 + 64 * q, m0, piece);
    }
}

// A_MN: A is M-contiguous (its map's inner dimension is M); B_K: B is K-contiguous.
template <bool F16, bool A_MN, bool B_K>
__device__ __forceinline__ void gemm_body(const TensorMap* a_map, const TensorMap* b_map,
                                          const TensorMap* c_map, int m, int n, int k) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~(u64)1023);
    unsigned char* out = smem + STAGES * STAGE_BYTES;
    u64* full = (u64*)(out + OUT_BYTES);
    u64* empty = full + STAGES;
    int wg = threadIdx.x / 128;
    int tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN;
    int tiles = tiles_m * tiles_n;
    int k_blocks = (k + BK - 1) / BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(&full[s], 1);
            bar_init(&empty[s], CONSUMERS * 4);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            int stage = 0;
            u32 phase = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int tm, tn;
                tile_at(t, tiles_m, tiles_n, &tm, &tn);
                for (int kb = 0; kb < k_blocks; ++kb) {
                    bar_wait(&empty[stage], phase ^ 1);
                    unsigned char* sa = smem + stage * STAGE_BYTES;
                    unsigned char* sb = sa + A_BYTES;
                    bar_expect_bytes(&full[stage], STAGE_BYTES);
                    if (A_MN) {
                        // Boxes of 64 (m) x 64 (k): two per tile.
                        for (int i = 0; i < BM / 64; ++i)
                            load_box(sa + i * 64 * BK * 2, a_map, tm * BM + 64 * i, kb * BK, &full[stage]);
                    } else {
                        load_box(sa, a_map, kb * BK, tm * BM, &full[stage]);
                    }
                    if (B_K) {
                        load_box(sb, b_map, kb * BK, tn * BN, &full[stage]);
                    } else {
                        // Boxes of 64 (n) x 64 (k): four per tile.
                        for (int i = 0; i < BN / 64; ++i)
                            load_box(sb + i * 64 * BK * 2, b_map, tn * BN + 64 * i, kb * BK, &full[stage]);
                    }
                    if (++stage == STAGES) { stage = 0; phase ^= 1; }
                }
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int consumer = wg - 1;
        float d[128];
        int stage = 0;
        u32 phase = 0;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            int tm, tn;
            tile_at(t, tiles_m, tiles_n, &tm, &tn);
            int prev = -1;
            for (int kb = 0; kb < k_blocks; ++kb) {
                bar_wait(&full[stage], phase);
                unsigned char* sa = smem + stage * STAGE_BYTES;
                unsigned char* sb = sa + A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    u64 da, db;
                    if (A_MN) // 64 (m) x 64 (k) box of this consumer; 16 k rows per step
                        da = smem_desc(sa + consumer * 64 * BK * 2 + kk * 16 * 128, 64 * BK * 2, 1024);
                    else // rows of 64 k; this consumer's 64 rows; 16 k per step
                        da = smem_desc(sa + consumer * 64 * 128 + kk * 32, 16, 1024);
                    if (B_K)
                        db = smem_desc(sb + kk * 32, 16, 1024);
                    else // four 64 (n) x 64 (k) boxes, 8 KB apart
                        db = smem_desc(sb + kk * 16 * 128, 64 * BK * 2, 1024);
                    int acc = (kb > 0 || kk > 0) ? 1 : 0;
                    if (F16) wgmma_f16(d, da, db, acc, A_MN ? 1 : 0, B_K ? 0 : 1);
                    else wgmma_bf16(d, da, db, acc, A_MN ? 1 : 0, B_K ? 0 : 1);
                }
                wgmma_commit();
                // Keep this step's instructions in flight; the previous step's are done,
                // so its stage goes back to the loader.
                wgmma_wait<1>();
                if (prev >= 0 && threadIdx.x % 32 == 0) bar_arrive(&empty[prev]);
                prev = stage;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
            wgmma_wait<0>();
            if (prev >= 0 && threadIdx.x % 32 == 0) bar_arrive(&empty[prev]);
            if (k_blocks == 0) {
#pragma unroll
                for (int i = 0; i < 128; ++i) d[i] = 0.f;
            }
            store_tile<F16>(d, out + consumer * 2 * OUT_PIECE_BYTES, c_map, consumer,
                            tm * BM + consumer * 64, tn * BN);
        }
        if (threadIdx.x % 128 == 0) stores_read_wait<0>();
    }
}

#define HOPPER_GEMM(NAME, F16, A_MN, B_K)                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                 \
    NAME(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,  \
         const __grid_constant__ TensorMap c_map, int m, int n, int k) {                     \
        gemm_body<F16, A_MN, B_K>(&a_map, &b_map, &c_map, m, n, k);                         \
    }

#ifdef ALL_VARIANTS
HOPPER_GEMM(hopper_gemm_bf16_nn, false, false, false)
HOPPER_GEMM(hopper_gemm_bf16_nt, false, false, true)
HOPPER_GEMM(hopper_gemm_bf16_tn, false, true, false)
HOPPER_GEMM(hopper_gemm_bf16_tt, false, true, true)
HOPPER_GEMM(hopper_gemm_f16_nn, true, false, false)
HOPPER_GEMM(hopper_gemm_f16_nt, true, false, true)
HOPPER_GEMM(hopper_gemm_f16_tn, true, true, false)
#endif
