// A decode-size GEMM whose epilogue does the Allreduce (the row-parallel projections of a
// tensor-parallel decode step: Y = sum over ranks of X_r W_r), against cuBLAS's GEMM alone,
// on every GPU of one process (peer access between them). It measured whether the
// Allreduce can hide inside the GEMM at decode sizes; the runtime's kernel
// (`fusion-runtime/src/backend/cuda/comm/peer_memory/gemm_allreduce.cu`, one tile a block,
// both epilogues, two parts of K at 4096 columns) grew from it. This copy stays as the
// bench for variants the runtime does not run (the GEMM alone against cuBLAS with cold
// weights, several tiles a block): a variant that wins here moves there, measured again
// through `decode_bench`.
//
// The kernel: 64 output columns per tile, one tile per block (N / 64 blocks, one wave) or
// several one after another (/2: half the blocks), M <= 128 rows padded to 16s, the whole K
// streamed through a ring of shared-memory stages (cp.async, swizzled rows), tensor cores
// through mma.sync (bf16 in, f32 accumulation). Its epilogue rounds a tile's partial to bf16
// (as the GEMM's output would be) and stores it into slot `rank` of the tile's area in every
// rank's workspace, then sums the ranks' slots in rank order (the same bits on every rank):
//   flag  plain stores, then a released flag per peer and tile; the reader acquires the
//         flags, then reads the slots;
//   ll    8 bytes of data beside the call's flag in every 16-byte store (twice the bytes on
//         the links, no fence); the reader polls the data itself.
// Calls alternate two halves of the workspace, as the runtime's peer-memory kernels do.
// Two more kernels try to finish some tiles before the GEMM ends, so that their exchange
// overlaps it (2026-11-27, `bench/results/2026-11-27-1515-decode-gemm-ar-tiles-groups-h100x4/`;
// neither won, docs/DECISIONS.md says why): `gemm_ar_tiles` (narrower tiles, several a
// block, one ring of stages through them) and `gemm_ar_groups` (split-K groups whose tiles
// finish one phase after another, a fifth warp summing the parts and sending each tile;
// its stages by cp.async or, `tma` variants, by the tensor memory accelerator).
//
// Rows: Llama-70B's o_proj and down_proj at TP `devices` (K = 8192 / D and 28672 / D,
// N = 8192), M = 1, 8, 32, 128; columns: cuBLAS (`cublasGemmEx`, bf16 out) alone, this
// kernel as a GEMM alone, then each GEMM + Allreduce variant. Weights rotate over copies
// (none is in L2 when read), fresh random inputs; every variant checked against an f64
// host sum of cuBLAS's f32 partials (and every rank's bits against rank 0's). Timed as 20
// calls captured in one CUDA graph per GPU after a barrier kernel (every GPU starts
// together), events around the calls, slowest GPU's time per call, median of 15 samples.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 allreduce_harness.cu -lcublas -lcuda -o gemm_allreduce_bench
// Run:   gemm_allreduce_bench [devices]
#include "decode_mma.cuh"
#include <cuda.h>
#include <algorithm>
#include <cmath>
#include <vector>

#define MAXR 8
#define BN 64
#define MAXTILES 256
// Workspace layout (bytes): flags u32[MAXTILES][MAXR], block counters u32[MAXTILES],
// barrier flags u32[MAXR] + counter, then two halves of tile areas.
#define FLAGS_AT 0
#define COUNTERS_AT (MAXTILES * MAXR * 4)
#define BARRIER_AT (COUNTERS_AT + MAXTILES * 4)
// Split-K groups (`gemm_ar_groups`): per tile and part the epoch its partial is in the
// local scratch, and per block a local epoch counter (apart from the world's counters: a
// GEMM alone runs on one GPU only).
#define LFLAGS_AT (BARRIER_AT + 1024)
#define LCOUNTERS_AT (LFLAGS_AT + MAXTILES * 8 * 4)
#define DATA_AT (64 << 10)
#define HALF_BYTES (MAXTILES * MAXR * 128 * BN * 4ull)  // 64 MB: M <= 128, D <= 8, data with flags

struct Peers { u64 ws[MAXR]; };

__device__ __forceinline__ u64 now_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ void st_release(u32* p, u32 v) { asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ u32 ld_acquire(const u32* p) { u32 v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ V4 ld_cg(const void* p) {
    V4 v; asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)); return v;
}
// Waits until *p reaches `want` (wrap-safe); false after 2 s (a hang in the harness).
__device__ __forceinline__ bool wait_flag(const u32* p, u32 want) {
    u64 t0 = 0; u32 spins = 0;
    while ((int)(ld_acquire(p) - want) < 0) {
        if ((++spins & 1023) == 0) { u64 t = now_ns(); if (!t0) t0 = t; else if (t - t0 > 2000000000ull) return false; }
    }
    return true;
}

enum Mode { GEMM_ONLY = 0, AR_FLAG = 1, AR_LL = 2 };

__device__ __forceinline__ void st_ll(void* p, u32 d0, u32 d1, u32 flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(d0), "r"(flag), "r"(d1), "r"(flag) : "memory");
}
__device__ __forceinline__ void ld_ll(const void* p, u32* d0, u32* d1, u32* f0, u32* f1) {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(*d0), "=r"(*f0), "=r"(*d1), "=r"(*f1) : "l"(p) : "memory");
}

// Y[M, N] = sum over ranks of X[M, K] W[K, N], row-major bf16 (MODE GEMM_ONLY: this rank's
// term alone). MT: 16-row tiles; WN: warps across a tile's 64 columns (the other 4 / WN
// warps split each stage's K). A block computes the tiles blockIdx.x, + gridDim.x, ... one
// after another, sending each as it is done (AR_FLAG: plain stores, then a released flag
// per peer; AR_LL: 8 bytes of data with the call's flag beside them in every 16-byte
// store, no fence), and sums them all at the end.
template <int MT, int WN, int MODE>
__global__ void __launch_bounds__(THREADS) gemm_ar(const u16* __restrict__ X, const u16* __restrict__ W, u16* __restrict__ Y,
                                                   int M, int K, int N, Peers P, int rank, int world) {
    constexpr int WK = 4 / WN, NT = BN / WN / 8, MP = MT * 16;
    constexpr int W_STAGE = BK * BN * 2, X_STAGE = MP * BK * 2, STAGE = W_STAGE + X_STAGE;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sbase = (u32)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wn = warp % WN, wk = warp / WN;
    const int KT = K / BK, tiles = N / BN;
    __shared__ u32 s_epoch;
    __shared__ int s_failed;
    u32* counters = MODE != GEMM_ONLY ? (u32*)(P.ws[rank] + COUNTERS_AT) : nullptr;
    if (MODE != GEMM_ONLY && tid == 0) { s_epoch = counters[blockIdx.x] + 1; s_failed = 0; }
    const u64 slot_bytes = (u64)M * BN * 2 * (MODE == AR_LL ? 2 : 1);  // one rank's slot of a tile
    u32 epoch = 0;
    u64 half = 0;

    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int n0 = tile * BN;
        auto load = [&](int kt, int s) {
            const u32 wb = sbase + s * STAGE, xb = wb + W_STAGE;
            const int k0 = kt * BK;
#pragma unroll
            for (int i = 0; i < (BK * 8) / THREADS; ++i) {
                int q = tid + i * THREADS, r = q >> 3, c = q & 7;
                cp_async16(swz(wb, r, c), W + (u64)(k0 + r) * N + n0 + c * 8, true);
            }
            load_x<MP>(xb, X, M, K, k0, tid);
        };
        float acc[MT][NT][4];
        stream_k<MT, NT, WK>(acc, KT, sbase, STAGE, W_STAGE, load, wk, lane, (wn * (BN / WN)) / 8);
        epoch = MODE != GEMM_ONLY ? s_epoch : 0;
        half = DATA_AT + (u64)(epoch & 1u) * HALF_BYTES;

        // The warps' partial sums over their K slices, through shared memory: red[wk][row][col].
        float* red = (float*)smem;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int row = mt * 16 + (lane >> 2) + (i >= 2 ? 8 : 0);
                    int col = wn * (BN / WN) + j * 8 + 2 * (lane & 3) + (i & 1);
                    red[(wk * MP + row) * BN + col] = acc[mt][j][i];
                }
        __syncthreads();
        // Chunk (row, c): 8 columns, one 16-byte vector (AR_LL: two packets).
        for (int q = tid; q < M * 8; q += THREADS) {
            int row = q >> 3, c = q & 7;
            float f[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < WK; ++w) sum += red[(w * MP + row) * BN + c * 8 + e];
                f[e] = sum;
            }
            V4 v{bf2(f[0], f[1]), bf2(f[2], f[3]), bf2(f[4], f[5]), bf2(f[6], f[7])};
            if (MODE == GEMM_ONLY) {
                *(V4*)(Y + (u64)row * N + n0 + c * 8) = v;
            } else {
                const u64 at = half + ((u64)tile * world + rank) * slot_bytes;
                for (int d = 0; d < world; ++d) {
                    char* dst = (char*)P.ws[(rank + d) % world] + at;
                    if (MODE == AR_FLAG) {
                        *(V4*)(dst + (u64)(row * BN + c * 8) * 2) = v;
                    } else {
                        u64 pk = (u64)(row * BN + c * 8) / 4;  // packet of 4 elements
                        st_ll(dst + pk * 16, v.x, v.y, epoch);
                        st_ll(dst + (pk + 1) * 16, v.z, v.w, epoch);
                    }
                }
            }
        }
        __syncthreads();
        if (MODE == AR_FLAG && tid < world && tid != rank) st_release((u32*)(P.ws[tid] + FLAGS_AT) + tile * MAXR + rank, epoch);
    }
    if (MODE == GEMM_ONLY) return;

    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int n0 = tile * BN;
        const char* mine = (const char*)P.ws[rank] + half + (u64)tile * world * slot_bytes;
        if (MODE == AR_FLAG) {
            if (tid < world && tid != rank) {
                if (!wait_flag((const u32*)(P.ws[rank] + FLAGS_AT) + tile * MAXR + tid, epoch)) s_failed = 1;
            }
            __syncthreads();
            if (s_failed) { if (tid == 0) printf("rank %d tile %d: a peer's flag never came\n", rank, tile); return; }
            for (int q = tid; q < M * 8; q += THREADS) {
                int row = q >> 3, c = q & 7;
                float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int r = 0; r < world; ++r) {
                    V4 v = ld_cg(mine + r * slot_bytes + (u64)(row * BN + c * 8) * 2);
                    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) { f[2 * e] += bf_lo(w[e]); f[2 * e + 1] += bf_hi(w[e]); }
                }
                V4 o{bf2(f[0], f[1]), bf2(f[2], f[3]), bf2(f[4], f[5]), bf2(f[6], f[7])};
                *(V4*)(Y + (u64)row * N + n0 + c * 8) = o;
            }
        } else {
            // Packet p: elements 4p.. of the tile (row p / 16, columns 4 (p % 16)..).
            for (int p = tid; p < M * BN / 4; p += THREADS) {
                u32 d0[MAXR], d1[MAXR], f0[MAXR], f1[MAXR];
#pragma unroll
                for (int r = 0; r < MAXR; ++r) if (r < world) ld_ll(mine + r * slot_bytes + (u64)p * 16, &d0[r], &d1[r], &f0[r], &f1[r]);
                float f[4] = {0, 0, 0, 0};
#pragma unroll
                for (int r = 0; r < MAXR; ++r) {
                    if (r < world) {
                        u64 t0 = 0; u32 spins = 0;
                        while (!(f0[r] == epoch && f1[r] == epoch)) {
                            if ((++spins & 1023) == 0) {
                                u64 t = now_ns();
                                if (!t0) t0 = t; else if (t - t0 > 2000000000ull) { printf("rank %d tile %d: packet %d of rank %d never came\n", rank, tile, p, r); return; }
                            }
                            ld_ll(mine + r * slot_bytes + (u64)p * 16, &d0[r], &d1[r], &f0[r], &f1[r]);
                        }
                        f[0] += bf_lo(d0[r]); f[1] += bf_hi(d0[r]); f[2] += bf_lo(d1[r]); f[3] += bf_hi(d1[r]);
                    }
                }
                int row = p / (BN / 4), col = (p % (BN / 4)) * 4;
                uint2 o{bf2(f[0], f[1]), bf2(f[2], f[3])};
                *(uint2*)(Y + (u64)row * N + n0 + col) = o;
            }
        }
    }
    // Every counter moves, those of blocks this grid did not run too: all agree on the
    // next call's epoch whatever its grid.
    __syncthreads();
    for (int b = blockIdx.x + tid * gridDim.x; b < MAXTILES; b += THREADS * gridDim.x) counters[b] = epoch;
}

// The same GEMM + Allreduce with BN_ columns a tile (64, 32 or 16) and one ring of stages
// running through all of a block's tiles (tiles blockIdx.x, + gridDim.x, ..): the first
// stages of a block's next tile load while its last tile's epilogue sends, so narrower
// tiles, two or four a block, keep every SM streaming weights, and the exchange of a
// block's first tiles overlaps the GEMM of its last. W stages keep 128-byte swizzled lines
// (8 / (BN_ / 8) rows of K a line); the warps' partial sums go through their own shared
// memory (`red`), not the stages, which hold the next tile's loads meanwhile.
template <int MT, int WN, int BN_>
struct TileCfg {
    static constexpr int WK = 4 / WN, NT = BN_ / WN / 8, MP = MT * 16, WCH = BN_ / 8, RPL = 8 / WCH;
    static constexpr int W_STAGE = BK * BN_ * 2, X_STAGE = MP * BK * 2, STAGE = W_STAGE + X_STAGE;
    static constexpr int RED = WK * MP * BN_ * 4;
    static constexpr int WANT = 8 * 64 / BN_;  // the bytes of W in flight of 8 stages of 64 columns
    static constexpr int FIT = (200 * 1024 - RED) / STAGE;
    static constexpr int STG = WANT < FIT ? WANT : FIT;
    static constexpr size_t SMEM = (size_t)STG * STAGE + RED;
    static_assert(NT >= 2 && NT % 2 == 0, "ldmatrix takes two 8-column groups at a time");
    static_assert(STG >= 3, "a ring of at least three stages");
};
template <int BN_>
__device__ __forceinline__ u32 wswz(u32 base, int r, int c) {
    constexpr int WCH = BN_ / 8, RPL = 8 / WCH;
    return swz(base, r / RPL, (r % RPL) * WCH + c);
}

template <int MT, int WN, int BN_, int MODE>
__global__ void __launch_bounds__(THREADS) gemm_ar_tiles(const u16* __restrict__ X, const u16* __restrict__ W, u16* __restrict__ Y,
                                                         int M, int K, int N, Peers P, int rank, int world) {
    using C = TileCfg<MT, WN, BN_>;
    constexpr int WK = C::WK, NT = C::NT, MP = C::MP, WCH = C::WCH, STG = C::STG;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sbase = (u32)__cvta_generic_to_shared(smem);
    float* red = (float*)(smem + (size_t)STG * C::STAGE);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wn = warp % WN, wk = warp / WN;
    const int KT = K / BK, tiles = N / BN_;
    const int mine_n = (tiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
    const int steps = mine_n * KT;
    __shared__ u32 s_epoch;
    __shared__ int s_failed;
    u32* counters = MODE != GEMM_ONLY ? (u32*)(P.ws[rank] + COUNTERS_AT) : nullptr;
    if (MODE != GEMM_ONLY && tid == 0) { s_epoch = counters[blockIdx.x] + 1; s_failed = 0; }
    const u64 slot_bytes = (u64)M * BN_ * 2 * (MODE == AR_LL ? 2 : 1);

    auto load = [&](int g, int s) {
        const int i = g / KT, kt = g % KT, n0 = ((int)blockIdx.x + i * (int)gridDim.x) * BN_;
        const u32 wb = sbase + s * C::STAGE, xb = wb + C::W_STAGE;
        const int k0 = kt * BK;
#pragma unroll
        for (int j = 0; j < (BK * WCH + THREADS - 1) / THREADS; ++j) {
            int q = tid + j * THREADS;
            if (q < BK * WCH) {
                int r = q / WCH, c = q % WCH;
                cp_async16(wswz<BN_>(wb, r, c), W + (u64)(k0 + r) * N + n0 + c * 8, true);
            }
        }
        load_x<MP>(xb, X, M, K, k0, tid);
    };
    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.f;
#pragma unroll
    for (int s = 0; s < STG - 1; ++s) { if (s < steps) load(s, s); cp_commit(); }
    __syncthreads();
    const u32 epoch = MODE != GEMM_ONLY ? s_epoch : 0;
    const u64 half = DATA_AT + (u64)(epoch & 1u) * HALF_BYTES;
    const int c0 = (wn * (BN_ / WN)) / 8;
    for (int g = 0; g < steps; ++g) {
        cp_wait<STG - 2>();
        __syncthreads();
        if (g + STG - 1 < steps) load(g + STG - 1, (g + STG - 1) % STG);
        cp_commit();
        const u32 wb = sbase + (g % STG) * C::STAGE, xb = wb + C::W_STAGE;
#pragma unroll
        for (int sl = wk; sl < BK / 16; sl += WK) {
            u32 b[NT][2];
#pragma unroll
            for (int j = 0; j < NT / 2; ++j) {
                u32 r[4];
                ldsm_x4_t(wswz<BN_>(wb, sl * 16 + (lane & 15), c0 + 2 * j + (lane >> 4)), r);
                b[2 * j][0] = r[0]; b[2 * j][1] = r[1]; b[2 * j + 1][0] = r[2]; b[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 a[4];
                ldsm_x4(swz(xb, mt * 16 + (lane & 15), sl * 2 + (lane >> 4)), a);
#pragma unroll
                for (int j = 0; j < NT; ++j) mma(acc[mt][j], a, b[j][0], b[j][1]);
            }
        }
        if (g % KT != KT - 1) continue;
        // Tile done: the warps' partials into `red`, then summed over K slices and sent.
        const int tile = (int)blockIdx.x + (g / KT) * (int)gridDim.x, n0 = tile * BN_;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int row = mt * 16 + (lane >> 2) + (i >= 2 ? 8 : 0);
                    int col = wn * (BN_ / WN) + j * 8 + 2 * (lane & 3) + (i & 1);
                    red[(wk * MP + row) * BN_ + col] = acc[mt][j][i];
                    acc[mt][j][i] = 0.f;
                }
        __syncthreads();
        for (int q = tid; q < M * WCH; q += THREADS) {
            int row = q / WCH, c = q % WCH;
            float f[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float sum = 0.f;
#pragma unroll
                for (int w = 0; w < WK; ++w) sum += red[(w * MP + row) * BN_ + c * 8 + e];
                f[e] = sum;
            }
            V4 v{bf2(f[0], f[1]), bf2(f[2], f[3]), bf2(f[4], f[5]), bf2(f[6], f[7])};
            if (MODE == GEMM_ONLY) {
                *(V4*)(Y + (u64)row * N + n0 + c * 8) = v;
            } else {
                const u64 at = half + ((u64)tile * world + rank) * slot_bytes;
                for (int d = 0; d < world; ++d) {
                    char* dst = (char*)P.ws[(rank + d) % world] + at;
                    if (MODE == AR_FLAG) {
                        *(V4*)(dst + (u64)(row * BN_ + c * 8) * 2) = v;
                    } else {
                        u64 pk = (u64)(row * BN_ + c * 8) / 4;
                        st_ll(dst + pk * 16, v.x, v.y, epoch);
                        st_ll(dst + (pk + 1) * 16, v.z, v.w, epoch);
                    }
                }
            }
        }
        __syncthreads();
        if (MODE == AR_FLAG && tid < world && tid != rank) st_release((u32*)(P.ws[tid] + FLAGS_AT) + tile * MAXR + rank, epoch);
    }
    cp_wait<0>();
    if (MODE == GEMM_ONLY) return;

    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int n0 = tile * BN_;
        const char* mine = (const char*)P.ws[rank] + half + (u64)tile * world * slot_bytes;
        if (MODE == AR_FLAG) {
            if (tid < world && tid != rank) {
                if (!wait_flag((const u32*)(P.ws[rank] + FLAGS_AT) + tile * MAXR + tid, epoch)) s_failed = 1;
            }
            __syncthreads();
            if (s_failed) { if (tid == 0) printf("rank %d tile %d: a peer's flag never came\n", rank, tile); return; }
            for (int q = tid; q < M * WCH; q += THREADS) {
                int row = q / WCH, c = q % WCH;
                float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int r = 0; r < world; ++r) {
                    V4 v = ld_cg(mine + r * slot_bytes + (u64)(row * BN_ + c * 8) * 2);
                    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) { f[2 * e] += bf_lo(w[e]); f[2 * e + 1] += bf_hi(w[e]); }
                }
                V4 o{bf2(f[0], f[1]), bf2(f[2], f[3]), bf2(f[4], f[5]), bf2(f[6], f[7])};
                *(V4*)(Y + (u64)row * N + n0 + c * 8) = o;
            }
        } else {
            for (int p = tid; p < M * BN_ / 4; p += THREADS) {
                u32 d0[MAXR], d1[MAXR], f0[MAXR], f1[MAXR];
#pragma unroll
                for (int r = 0; r < MAXR; ++r) if (r < world) ld_ll(mine + r * slot_bytes + (u64)p * 16, &d0[r], &d1[r], &f0[r], &f1[r]);
                float f[4] = {0, 0, 0, 0};
#pragma unroll
                for (int r = 0; r < MAXR; ++r) {
                    if (r < world) {
                        u64 t0 = 0; u32 spins = 0;
                        while (!(f0[r] == epoch && f1[r] == epoch)) {
                            if ((++spins & 1023) == 0) {
                                u64 t = now_ns();
                                if (!t0) t0 = t; else if (t - t0 > 2000000000ull) { printf("rank %d tile %d: packet %d of rank %d never came\n", rank, tile, p, r); return; }
                            }
                            ld_ll(mine + r * slot_bytes + (u64)p * 16, &d0[r], &d1[r], &f0[r], &f1[r]);
                        }
                        f[0] += bf_lo(d0[r]); f[1] += bf_hi(d0[r]); f[2] += bf_lo(d1[r]); f[3] += bf_hi(d1[r]);
                    }
                }
                int row = p / (BN_ / 4), col = (p % (BN_ / 4)) * 4;
                uint2 o{bf2(f[0], f[1]), bf2(f[2], f[3])};
                *(uint2*)(Y + (u64)row * N + n0 + col) = o;
            }
        }
    }
    __syncthreads();
    for (int b = blockIdx.x + tid * gridDim.x; b < MAXTILES; b += THREADS * gridDim.x) counters[b] = epoch;
}

// The GEMM + Allreduce with its tiles finished one after another, keeping 64 columns (128
// bytes of each W row) a stage: groups of G blocks share G tiles, and in phase p every block
// of group g streams its own 1/G of K for tile g G + p. At the end of a phase the blocks
// leave their f32 partials in local scratch; block p's fifth warp (the storer) sums the G
// partials of its tile in part order, rounds it and sends it to every rank (AR_FLAG: plain
// stores, then a released flag per peer; AR_LL: data beside the call's flag), while its
// four compute warps go on streaming. So tiles finish at 1/G, 2/G, .. of the GEMM, and only
// the last 1/G of the exchange follows it. At the end every block sums its own tile's slots
// in rank order (the same bits on every rank). GEMM_ONLY: the storer writes Y.
__device__ __forceinline__ void st_release_gpu(u32* p, u32 v) { asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ u32 ld_acquire_gpu(const u32* p) { u32 v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void named_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_compute() { asm volatile("bar.sync 1, %0;" :: "n"(THREADS) : "memory"); }
__device__ __forceinline__ float4 ld_cg_f4(const float* p) {
    float4 v; asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p)); return v;
}

// The tensor memory accelerator (TMA): one thread asks for a whole stage (W's 64 x 64 tile
// and X's rows, rows past M filled with zeros), landing in the 128-byte swizzle `swz` reads,
// counted on the stage's memory barrier.
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) { asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory"); }
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n .reg .pred p;\n MBAR_WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra MBAR_WAIT_%=;\n}\n"
                 :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma2d(u32 dst, const CUtensorMap* map, int c0, int c1, u32 bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}

template <int MT, int WN, int G, int MODE, bool TMA>
__global__ void __launch_bounds__(THREADS + 32) gemm_ar_groups(const u16* __restrict__ X, const u16* __restrict__ W, u16* __restrict__ Y,
                                                               float* part, int M, int K, int N, Peers P, int rank, int world,
                                                               const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tx) {
    constexpr int WK = 4 / WN, NT = BN / WN / 8, MP = MT * 16;
    constexpr int W_STAGE = BK * BN * 2, X_STAGE = MP * BK * 2, STAGE = W_STAGE + X_STAGE;
    constexpr int RED = WK * MP * BN * 4;
    constexpr int FIT = (200 * 1024 - 2 * RED) / STAGE;
    constexpr int STG = STAGES < FIT ? STAGES : FIT;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    // TMA's 128-byte swizzle wants stages on 1024-byte boundaries (1 KB more is asked for).
    unsigned char* smem = smem_raw + ((1024 - ((u32)__cvta_generic_to_shared(smem_raw) & 1023)) & 1023);
    const u32 sbase = (u32)__cvta_generic_to_shared(smem);
    float* red = (float*)(smem + (size_t)STG * STAGE);  // two buffers of RED bytes
    __shared__ __align__(8) unsigned long long full_bars[STG];
    const u32 full0 = (u32)__cvta_generic_to_shared(full_bars);
    if (TMA && threadIdx.x == 0) {
        for (int s = 0; s < STG; ++s) mbar_init(full0 + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Tile of group g in phase p: p (tiles / G) + g, so that the blocks of a phase read one
    // run of columns of each W row (G runs of 1/G of the row, one per part of K).
    const int TG = (int)gridDim.x / G;
    const int g = blockIdx.x / G, j = blockIdx.x % G, my_tile = j * TG + g;
    const int KT = K / BK / G, steps = G * KT;
    u32* ws32 = (u32*)P.ws[rank];
    u32* counters = (u32*)(P.ws[rank] + COUNTERS_AT);
    u32* lcounters = (u32*)(P.ws[rank] + LCOUNTERS_AT);
    u32* lflags = (u32*)(P.ws[rank] + LFLAGS_AT);
    __shared__ u32 s_epoch, s_lepoch;
    __shared__ int s_failed;
    if (tid == 0) { s_epoch = MODE != GEMM_ONLY ? counters[blockIdx.x] + 1 : 0; s_lepoch = lcounters[blockIdx.x] + 1; s_failed = 0; }
    __syncthreads();
    const u32 epoch = s_epoch, lepoch = s_lepoch;
    const u64 half = DATA_AT + (u64)(epoch & 1u) * HALF_BYTES;
    const u64 slot_bytes = (u64)M * BN * 2 * (MODE == AR_LL ? 2 : 1);
    const u64 tile_part = (u64)M * BN;  // f32 elements of one partial
    (void)ws32;

    if (warp < 4) {
        const int wn = warp % WN, wk = warp / WN;
        // With one warp per scheduler the ring's pace is its instructions per stage, so a
        // thread's copies come from precomputed sources and shared offsets (the same row
        // and chunk pattern for W and X: row tid / 8 + 16 i, chunk tid % 8).
        constexpr int XI = MP * 8 / THREADS;
        const int r0 = tid >> 3, cc = tid & 7;
        const u32 soff = (u32)(r0 * 128 + ((cc ^ (r0 & 7)) << 4));
        const u16* w_thr = W + (u64)r0 * N + (u64)g * BN + cc * 8;
        const u64 w_16rows = (u64)16 * N, w_phase = (u64)TG * BN, w_stage = (u64)BK * N;
        const u16* x_thr[XI];
        int x_bytes[XI];
#pragma unroll
        for (int i = 0; i < XI; ++i) {
            const bool ok = r0 + 16 * i < M;
            x_thr[i] = X + (u64)(ok ? r0 + 16 * i : 0) * K + (u64)j * KT * BK + cc * 8;
            x_bytes[i] = ok ? 16 : 0;
        }
        // The next stage to load: phase lp, step lk of it, into ring slot ls.
        int lp = 0, lk = 0, ls = 0;
        auto load_next = [&]() {
            if constexpr (TMA) {
                if (tid == 0) {
                    const u32 bar = full0 + 8 * ls, wb = sbase + ls * STAGE;
                    const int k0 = (j * KT + lk) * BK;
                    mbar_expect_tx(bar, STAGE);
                    tma2d(wb, &tw, (lp * TG + g) * BN, k0, bar);
                    tma2d(wb + W_STAGE, &tx, k0, 0, bar);
                }
                if (++lk == KT) { lk = 0; ++lp; }
                if (++ls == STG) ls = 0;
                return;
            }
            const u32 wb = sbase + ls * STAGE + soff, xb = wb + W_STAGE;
            const u16* src = w_thr + (u64)lp * w_phase + ((u64)(j * KT + lk)) * w_stage;
#pragma unroll
            for (int i = 0; i < 4; ++i) cp_async16(wb + i * 2048, src + i * w_16rows, true);
#pragma unroll
            for (int i = 0; i < XI; ++i) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(xb + i * 2048), "l"(x_thr[i] + lk * BK), "r"(x_bytes[i]));
            }
            if (++lk == KT) { lk = 0; ++lp; }
            if (++ls == STG) ls = 0;
        };
        float acc[MT][NT][4];
#pragma unroll
        for (int a = 0; a < MT; ++a)
#pragma unroll
            for (int b = 0; b < NT; ++b)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.f;
        int issued = 0;
        if (TMA) bar_compute();  // the barriers' initialization seen by every compute warp
#pragma unroll
        for (int s = 0; s < STG - 1; ++s) { if (issued < steps) { load_next(); ++issued; } if (!TMA) cp_commit(); }
        const int c0 = (wn * (BN / WN)) / 8;
        int slot = 0, kl = 0, ph = 0;
        u32 parity = 0;
        for (int gs = 0; gs < steps; ++gs) {
            if (!TMA) cp_wait<STG - 2>();
            bar_compute();  // every warp is done with the slot the next load fills
            if (issued < steps) { load_next(); ++issued; }
            if (TMA) mbar_wait(full0 + 8 * slot, parity);
            else cp_commit();
            const u32 wb = sbase + slot * STAGE, xb = wb + W_STAGE;
            if (++slot == STG) { slot = 0; parity ^= 1u; }
#pragma unroll
            for (int sl = wk; sl < BK / 16; sl += WK) {
                u32 b[NT][2];
#pragma unroll
                for (int jj = 0; jj < NT / 2; ++jj) {
                    u32 r[4];
                    ldsm_x4_t(swz(wb, sl * 16 + (lane & 15), c0 + 2 * jj + (lane >> 4)), r);
                    b[2 * jj][0] = r[0]; b[2 * jj][1] = r[1]; b[2 * jj + 1][0] = r[2]; b[2 * jj + 1][1] = r[3];
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    u32 a[4];
                    ldsm_x4(swz(xb, mt * 16 + (lane & 15), sl * 2 + (lane >> 4)), a);
#pragma unroll
                    for (int jj = 0; jj < NT; ++jj) mma(acc[mt][jj], a, b[jj][0], b[jj][1]);
                }
            }
            if (++kl != KT) continue;
            kl = 0;
            // The warps' partials into red buffer (phase & 1) for the storer, which sums them
            // into the scratch and raises the part's flag; the compute warps go on at once.
            const int rb_i = ph & 1;
            float* rb = red + rb_i * (RED / 4);
            if (ph >= 2) named_sync(4 + rb_i, THREADS + 32);  // the storer is done with it
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int jj = 0; jj < NT; ++jj)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        int row = mt * 16 + (lane >> 2) + (i >= 2 ? 8 : 0);
                        int col = wn * (BN / WN) + jj * 8 + 2 * (lane & 3) + (i & 1);
                        rb[(wk * MP + row) * BN + col] = acc[mt][jj][i];
                        acc[mt][jj][i] = 0.f;
                    }
            __threadfence_block();
            named_arrive(2 + rb_i, THREADS + 32);
            ++ph;
        }
        cp_wait<0>();
    } else {
        // The storer: each phase's partial of this block into the scratch (summed over the
        // warps' K slices, then its flag); in phase j, this block's tile once every part of
        // it is there: summed in part order, rounded and sent.
        for (int ph = 0; ph < G; ++ph) {
            const int rb_i = ph & 1, t = ph * TG + g;
            const float* rb = red + rb_i * (RED / 4);
            named_sync(2 + rb_i, THREADS + 32);
            float* dst = part + ((u64)t * G + j) * tile_part;
            for (int q = lane; q < M * (BN / 4); q += 32) {
                int row = q / (BN / 4), c4 = (q % (BN / 4)) * 4;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
                for (int w = 0; w < WK; ++w) {
                    const float* rr = rb + (w * MP + row) * BN + c4;
                    v.x += rr[0]; v.y += rr[1]; v.z += rr[2]; v.w += rr[3];
                }
                *(float4*)(dst + row * BN + c4) = v;
            }
            __syncwarp();
            if (ph + 2 < G) { __threadfence_block(); named_arrive(4 + rb_i, THREADS + 32); }
            if (lane == 0) { __threadfence(); st_release_gpu(&lflags[t * 8 + j], lepoch); }
            if (ph != j) continue;
            if (lane < G) {
                u64 t0 = 0; u32 spins = 0;
                while ((int)(ld_acquire_gpu(&lflags[my_tile * 8 + lane]) - lepoch) < 0) {
                    if ((++spins & 1023) == 0) { u64 tn = now_ns(); if (!t0) t0 = tn; else if (tn - t0 > 2000000000ull) { printf("rank %d tile %d: part %d never came\n", rank, my_tile, lane); s_failed = 1; break; } }
                }
            }
            __syncwarp();
            const int n0 = my_tile * BN;
            for (int q = lane; q < M * 8; q += 32) {
                int row = q >> 3, c = q & 7;
                float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
                for (int i = 0; i < G; ++i) {
                    const float* src = part + ((u64)my_tile * G + i) * tile_part + row * BN + c * 8;
                    float4 a = ld_cg_f4(src), b = ld_cg_f4(src + 4);
                    f[0] += a.x; f[1] += a.y; f[2] += a.z; f[3] += a.w; f[4] += b.x; f[5] += b.y; f[6] += b.z; f[7] += b.w;
                }
                V4 v{bf2(f[0], f[1]), bf2(f[2], f[3]), bf2(f[4], f[5]), bf2(f[6], f[7])};
                if (MODE == GEMM_ONLY) {
                    *(V4*)(Y + (u64)row * N + n0 + c * 8) = v;
                } else {
                    const u64 at = half + ((u64)my_tile * world + rank) * slot_bytes;
                    for (int d = 0; d < world; ++d) {
                        char* dst2 = (char*)P.ws[(rank + d) % world] + at;
                        if (MODE == AR_FLAG) {
                            *(V4*)(dst2 + (u64)(row * BN + c * 8) * 2) = v;
                        } else {
                            u64 pk = (u64)(row * BN + c * 8) / 4;
                            st_ll(dst2 + pk * 16, v.x, v.y, epoch);
                            st_ll(dst2 + (pk + 1) * 16, v.z, v.w, epoch);
                        }
                    }
                }
            }
            __syncwarp();
            if (MODE == AR_FLAG && lane < world && lane != rank) st_release((u32*)(P.ws[lane] + FLAGS_AT) + my_tile * MAXR + rank, epoch);
        }
    }
    __syncthreads();
    constexpr int ALL = THREADS + 32;
    if (MODE != GEMM_ONLY && !s_failed) {
        const int n0 = my_tile * BN;
        const char* mine = (const char*)P.ws[rank] + half + (u64)my_tile * world * slot_bytes;
        if (MODE == AR_FLAG) {
            if (tid < world && tid != rank) {
                if (!wait_flag((const u32*)(P.ws[rank] + FLAGS_AT) + my_tile * MAXR + tid, epoch)) s_failed = 1;
            }
            __syncthreads();
            if (!s_failed) {
                for (int q = tid; q < M * 8; q += ALL) {
                    int row = q >> 3, c = q & 7;
                    float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                    for (int r = 0; r < world; ++r) {
                        V4 v = ld_cg(mine + r * slot_bytes + (u64)(row * BN + c * 8) * 2);
                        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                        for (int e = 0; e < 4; ++e) { f[2 * e] += bf_lo(w[e]); f[2 * e + 1] += bf_hi(w[e]); }
                    }
                    V4 o{bf2(f[0], f[1]), bf2(f[2], f[3]), bf2(f[4], f[5]), bf2(f[6], f[7])};
                    *(V4*)(Y + (u64)row * N + n0 + c * 8) = o;
                }
            } else if (tid == 0) {
                printf("rank %d tile %d: a peer's flag never came\n", rank, my_tile);
            }
        } else {
            for (int p = tid; p < M * BN / 4; p += ALL) {
                u32 d0[MAXR], d1[MAXR], f0[MAXR], f1[MAXR];
#pragma unroll
                for (int r = 0; r < MAXR; ++r) if (r < world) ld_ll(mine + r * slot_bytes + (u64)p * 16, &d0[r], &d1[r], &f0[r], &f1[r]);
                float f[4] = {0, 0, 0, 0};
                bool ok = true;
#pragma unroll
                for (int r = 0; r < MAXR; ++r) {
                    if (r < world && ok) {
                        u64 t0 = 0; u32 spins = 0;
                        while (!(f0[r] == epoch && f1[r] == epoch)) {
                            if ((++spins & 1023) == 0) {
                                u64 t = now_ns();
                                if (!t0) t0 = t; else if (t - t0 > 2000000000ull) { printf("rank %d tile %d: packet %d of rank %d never came\n", rank, my_tile, p, r); ok = false; break; }
                            }
                            ld_ll(mine + r * slot_bytes + (u64)p * 16, &d0[r], &d1[r], &f0[r], &f1[r]);
                        }
                        f[0] += bf_lo(d0[r]); f[1] += bf_hi(d0[r]); f[2] += bf_lo(d1[r]); f[3] += bf_hi(d1[r]);
                    }
                }
                if (!ok) break;
                int row = p / (BN / 4), col = (p % (BN / 4)) * 4;
                uint2 o{bf2(f[0], f[1]), bf2(f[2], f[3])};
                *(uint2*)(Y + (u64)row * N + n0 + col) = o;
            }
        }
    }
    __syncthreads();
    if (tid == 0) lcounters[blockIdx.x] = lepoch;
    if (MODE != GEMM_ONLY)
        for (int b = blockIdx.x + tid * gridDim.x; b < MAXTILES; b += ALL * gridDim.x) counters[b] = epoch;
}

// Every GPU meets here before the timed calls: one block, a flag per peer.
__global__ void barrier(Peers P, int rank, int world) {
    u32* cnt = (u32*)(P.ws[rank] + BARRIER_AT) + MAXR;
    __shared__ u32 s_e;
    if (threadIdx.x == 0) s_e = *cnt + 1;
    __syncthreads();
    int t = threadIdx.x;
    if (t < world && t != rank) {
        st_release((u32*)(P.ws[t] + BARRIER_AT) + rank, s_e);
        if (!wait_flag((const u32*)(P.ws[rank] + BARRIER_AT) + t, s_e)) printf("barrier: rank %d waited for %d in vain\n", rank, t);
    }
    __syncthreads();
    if (t == 0) *cnt = s_e;
}

struct Rank {
    int dev;
    cudaStream_t st;
    cublasHandle_t blas;
    char* ws;
    u16 *x, *y;
    std::vector<u16*> w;  // weight copies
    float* ref;            // f32 partial
    float* part;           // split-K groups' partials (local)
    cudaEvent_t e0, e1;
};

struct Shape { const char* what; int m, k, n; };

static size_t g_pad = 0;  // extra shared memory a launch of `gemm_ar` asks for (a control)
template <int MT, int WN, int MODE>
static void launch(Rank& R, const u16* w, int m, int k, int n, int per, Peers P, int rank, int world) {
    constexpr int MP = MT * 16;
    size_t smem = (size_t)STAGES * (BK * BN * 2 + MP * BK * 2);
    size_t red = (size_t)(4 / WN) * MP * BN * 4;
    smem = std::max(smem, red);
    static bool set[8] = {};
    if (!set[R.dev]) { CK(cudaFuncSetAttribute(gemm_ar<MT, WN, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem + (32 << 10))); set[R.dev] = true; }
    smem += g_pad;
    gemm_ar<MT, WN, MODE><<<(n / BN + per - 1) / per, THREADS, smem, R.st>>>(R.x, w, R.y, m, k, n, P, rank, world);
}

template <int MODE>
static void launch_m(Rank& R, const u16* w, int m, int k, int n, int per, Peers P, int rank, int world) {
    if (m <= 16) launch<1, 1, MODE>(R, w, m, k, n, per, P, rank, world);
    else if (m <= 32) launch<2, 1, MODE>(R, w, m, k, n, per, P, rank, world);
    else if (m <= 64) launch<4, 1, MODE>(R, w, m, k, n, per, P, rank, world);
    else launch<8, 2, MODE>(R, w, m, k, n, per, P, rank, world);
}

template <int MT, int WN, int BN_, int MODE>
static void launch_tiles(Rank& R, const u16* w, int m, int k, int n, int per, Peers P, int rank, int world) {
    using C = TileCfg<MT, WN, BN_>;
    static bool set[8] = {};
    if (!set[R.dev]) { CK(cudaFuncSetAttribute(gemm_ar_tiles<MT, WN, BN_, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)C::SMEM)); set[R.dev] = true; }
    gemm_ar_tiles<MT, WN, BN_, MODE><<<(n / BN_ + per - 1) / per, THREADS, C::SMEM, R.st>>>(R.x, w, R.y, m, k, n, P, rank, world);
}
// A 2-D tensor map over a row-major bf16 [outer, inner] matrix, boxes of box_outer rows of
// box_inner elements, the 128-byte swizzle.
static CUtensorMap make_map(const void* base, u64 inner, u64 outer, u32 box_inner, u32 box_outer) {
    CUtensorMap m;
    cuuint64_t dims[2] = {inner, outer};
    cuuint64_t strides[1] = {inner * 2};
    cuuint32_t box[2] = {box_inner, box_outer};
    cuuint32_t es[2] = {1, 1};
    CUresult r = cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, es,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) { fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", (int)r); exit(1); }
    return m;
}
template <int MT, int WN, int G, int MODE, bool TMA>
static void launch_groups(Rank& R, const u16* w, int m, int k, int n, Peers P, int rank, int world) {
    constexpr int MP = MT * 16, STAGE = BK * BN * 2 + MP * BK * 2, RED = (4 / WN) * MP * BN * 4;
    constexpr int FIT = (200 * 1024 - 2 * RED) / STAGE, STG = STAGES < FIT ? STAGES : FIT;
    const size_t smem = (size_t)STG * STAGE + 2 * RED + 1024;
    static bool set[8] = {};
    if (!set[R.dev]) { CK(cudaFuncSetAttribute(gemm_ar_groups<MT, WN, G, MODE, TMA>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)); set[R.dev] = true; }
    CUtensorMap tw{}, tx{};
    if (TMA) { tw = make_map(w, n, k, BN, BK); tx = make_map(R.x, k, m, BK, MP); }
    gemm_ar_groups<MT, WN, G, MODE, TMA><<<n / BN, THREADS + 32, smem, R.st>>>(R.x, w, R.y, R.part, m, k, n, P, rank, world, tw, tx);
}
template <int G, int MODE, bool TMA>
static void launch_groups_m(Rank& R, const u16* w, int m, int k, int n, Peers P, int rank, int world) {
    if (m <= 16) launch_groups<1, 1, G, MODE, TMA>(R, w, m, k, n, P, rank, world);
    else if (m <= 32) launch_groups<2, 1, G, MODE, TMA>(R, w, m, k, n, P, rank, world);
    else if (m <= 64) launch_groups<4, 1, G, MODE, TMA>(R, w, m, k, n, P, rank, world);
    else launch_groups<8, 2, G, MODE, TMA>(R, w, m, k, n, P, rank, world);
}
// `groups` 1, 2, 4: stages by cp.async; 11, 12, 14: the same G, stages by TMA.
template <int MODE>
static void launch_groups_g(Rank& R, const u16* w, int groups, int m, int k, int n, Peers P, int rank, int world) {
    switch (groups) {
        case 1: launch_groups_m<1, MODE, false>(R, w, m, k, n, P, rank, world); break;
        case 2: launch_groups_m<2, MODE, false>(R, w, m, k, n, P, rank, world); break;
        case 4: launch_groups_m<4, MODE, false>(R, w, m, k, n, P, rank, world); break;
        case 11: launch_groups_m<1, MODE, true>(R, w, m, k, n, P, rank, world); break;
        case 12: launch_groups_m<2, MODE, true>(R, w, m, k, n, P, rank, world); break;
        default: launch_groups_m<4, MODE, true>(R, w, m, k, n, P, rank, world); break;
    }
}
template <int BN_, int MODE>
static void launch_tiles_m(Rank& R, const u16* w, int m, int k, int n, int per, Peers P, int rank, int world) {
    if (m <= 16) launch_tiles<1, 1, BN_, MODE>(R, w, m, k, n, per, P, rank, world);
    else if (m <= 32) launch_tiles<2, 1, BN_, MODE>(R, w, m, k, n, per, P, rank, world);
    else if (m <= 64) launch_tiles<4, 1, BN_, MODE>(R, w, m, k, n, per, P, rank, world);
    else launch_tiles<8, (BN_ >= 32 ? 2 : 1), BN_, MODE>(R, w, m, k, n, per, P, rank, world);
}
template <int MODE>
static void launch_tiles_bn(Rank& R, const u16* w, int bn, int m, int k, int n, int per, Peers P, int rank, int world) {
    if (bn == 64) launch_tiles_m<64, MODE>(R, w, m, k, n, per, P, rank, world);
    else launch_tiles_m<32, MODE>(R, w, m, k, n, per, P, rank, world);
}

// What a timed call runs: cuBLAS alone, or this kernel in `mode` with `per` tiles a block.
// `bn` 0: the first kernel (64 columns, a ring per tile); 64, 32: `gemm_ar_tiles` (its
// tiles one after another in one ring); `groups` 2, 4: `gemm_ar_groups`.
struct Which { const char* name; bool cublas; int mode; int per; int bn; int groups; int pad_kb = 0; };
static const Which CUBLAS{"cuBLAS", true, GEMM_ONLY, 1, 0, 0};
static const Which VARIANTS[] = {
    {"gemm", false, GEMM_ONLY, 1, 0, 0}, {"gemm32/2", false, GEMM_ONLY, 2, 32, 0},
    {"gemm g1", false, GEMM_ONLY, 1, 0, 1}, {"gemm g4", false, GEMM_ONLY, 1, 0, 4},
    {"tma g1", false, GEMM_ONLY, 1, 0, 11}, {"tma g2", false, GEMM_ONLY, 1, 0, 12}, {"tma g4", false, GEMM_ONLY, 1, 0, 14},
    {"flag", false, AR_FLAG, 1, 0, 0}, {"ll", false, AR_LL, 1, 0, 0},
    {"flag tma g2", false, AR_FLAG, 1, 0, 12}, {"flag tma g4", false, AR_FLAG, 1, 0, 14}, {"ll tma g4", false, AR_LL, 1, 0, 14},
};

static void call(Rank& R, const Which& which, int copy, const Shape& s, Peers P, int rank, int world) {
    const u16* w = R.w[copy % R.w.size()];
    if (which.cublas) {
        float one = 1.f, zero = 0.f;
        CB(cublasGemmEx(R.blas, CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &one, w, CUDA_R_16BF, s.n, R.x, CUDA_R_16BF, s.k,
                        &zero, R.y, CUDA_R_16BF, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    } else if (which.groups != 0) {
        if (which.mode == GEMM_ONLY) launch_groups_g<GEMM_ONLY>(R, w, which.groups, s.m, s.k, s.n, P, rank, world);
        else if (which.mode == AR_FLAG) launch_groups_g<AR_FLAG>(R, w, which.groups, s.m, s.k, s.n, P, rank, world);
        else launch_groups_g<AR_LL>(R, w, which.groups, s.m, s.k, s.n, P, rank, world);
    } else if (which.bn != 0) {
        if (which.mode == GEMM_ONLY) launch_tiles_bn<GEMM_ONLY>(R, w, which.bn, s.m, s.k, s.n, which.per, P, rank, world);
        else if (which.mode == AR_FLAG) launch_tiles_bn<AR_FLAG>(R, w, which.bn, s.m, s.k, s.n, which.per, P, rank, world);
        else launch_tiles_bn<AR_LL>(R, w, which.bn, s.m, s.k, s.n, which.per, P, rank, world);
    } else if (which.mode == GEMM_ONLY) {
        g_pad = (size_t)which.pad_kb << 10;
        launch_m<GEMM_ONLY>(R, w, s.m, s.k, s.n, which.per, P, rank, world);
        g_pad = 0;
    } else if (which.mode == AR_FLAG) {
        launch_m<AR_FLAG>(R, w, s.m, s.k, s.n, which.per, P, rank, world);
    } else {
        launch_m<AR_LL>(R, w, s.m, s.k, s.n, which.per, P, rank, world);
    }
    CK(cudaGetLastError());
}

// Median over 15 samples of the slowest GPU's microseconds per call (20 calls per graph).
static double timed(std::vector<Rank>& ranks, const Which& which, const Shape& s, Peers P) {
    const int world = (int)ranks.size(), CALLS = 20, SAMPLES = 15;
    std::vector<cudaGraphExec_t> ex(world);
    for (int r = 0; r < world; ++r) {
        Rank& R = ranks[r];
        CK(cudaSetDevice(R.dev));
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(R.st, cudaStreamCaptureModeThreadLocal));
        if (world > 1) barrier<<<1, 32, 0, R.st>>>(P, r, world);  // one GPU alone keeps the counters
        CK(cudaEventRecordWithFlags(R.e0, R.st, cudaEventRecordExternal));
        for (int i = 0; i < CALLS; ++i) call(R, which, i, s, P, r, world);
        CK(cudaEventRecordWithFlags(R.e1, R.st, cudaEventRecordExternal));
        CK(cudaStreamEndCapture(R.st, &g));
        CK(cudaGraphInstantiate(&ex[r], g, 0));
        CK(cudaGraphDestroy(g));
    }
    std::vector<double> samples;
    for (int it = 0; it < SAMPLES + 2; ++it) {
        for (int r = 0; r < world; ++r) { CK(cudaSetDevice(ranks[r].dev)); CK(cudaGraphLaunch(ex[r], ranks[r].st)); }
        double worst = 0;
        for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(ranks[r].dev));
            CK(cudaStreamSynchronize(ranks[r].st));
            float ms; CK(cudaEventElapsedTime(&ms, ranks[r].e0, ranks[r].e1));
            worst = std::max(worst, ms * 1000.0 / CALLS);
        }
        if (it >= 2) samples.push_back(worst);
    }
    for (int r = 0; r < world; ++r) { CK(cudaSetDevice(ranks[r].dev)); CK(cudaGraphExecDestroy(ex[r])); }
    std::sort(samples.begin(), samples.end());
    return samples[samples.size() / 2];
}

int main(int argc, char** argv) {
    int avail = 0; CK(cudaGetDeviceCount(&avail));
    const int world = argc > 1 ? atoi(argv[1]) : avail;
    if (world < 1 || world > avail || world > MAXR) { fprintf(stderr, "devices: 1..%d\n", std::min(avail, MAXR)); return 2; }
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("gemm_allreduce_bench: %d x %s\n", world, prop.name);
    std::vector<Rank> ranks(world);
    Peers P{};
    const int MMAX = 128, KMAX = 28672 / world, NMAX = 8192, COPIES = 4;
    for (int r = 0; r < world; ++r) {
        Rank& R = ranks[r];
        R.dev = r;
        CK(cudaSetDevice(r));
        for (int q = 0; q < world; ++q) if (q != r) {
            int can = 0; CK(cudaDeviceCanAccessPeer(&can, r, q));
            if (!can) { fprintf(stderr, "GPU %d cannot reach GPU %d\n", r, q); return 1; }
            CK(cudaDeviceEnablePeerAccess(q, 0));
        }
        CK(cudaStreamCreateWithFlags(&R.st, cudaStreamNonBlocking));
        CB(cublasCreate(&R.blas));
        CB(cublasSetStream(R.blas, R.st));
        void* blas_ws; CK(cudaMalloc(&blas_ws, 32 << 20));
        CB(cublasSetWorkspace(R.blas, blas_ws, 32 << 20));
        size_t ws_bytes = DATA_AT + 2ull * HALF_BYTES;
        CK(cudaMalloc(&R.ws, ws_bytes));
        CK(cudaMemset(R.ws, 0, ws_bytes));
        P.ws[r] = (u64)R.ws;
        CK(cudaMalloc(&R.x, (size_t)MMAX * KMAX * 2));
        CK(cudaMalloc(&R.y, (size_t)MMAX * NMAX * 2));
        CK(cudaMalloc(&R.ref, (size_t)MMAX * NMAX * 4));
        CK(cudaMalloc(&R.part, (size_t)4 * MMAX * NMAX * 4));
        for (int c = 0; c < COPIES; ++c) {
            u16* w; CK(cudaMalloc(&w, (size_t)KMAX * NMAX * 2));
            fill<<<1024, 256, 0, R.st>>>(w, (size_t)KMAX * NMAX, 1234u + 77u * r + 1000u * c, 0.05f);
            R.w.push_back(w);
        }
        CK(cudaEventCreate(&R.e0)); CK(cudaEventCreate(&R.e1));
        CK(cudaStreamSynchronize(R.st));
    }
    std::vector<Shape> shapes;
    for (int m : {1, 8, 32, 128}) {
        shapes.push_back({"o_proj", m, 8192 / world, 8192});
        shapes.push_back({"down_proj", m, 28672 / world, 8192});
    }
    printf("Microseconds per call; gemm: this kernel as a GEMM alone (one GPU); flag, ll: GEMM + Allreduce on %d GPUs\n", world);
    printf("(/2, /4: tiles a block, one after another); +: over cuBLAS alone; err: max |y - f64 sum| / max |sum|.\n");
    printf("| shape | M | K | cuBLAS |");
    for (const Which& v : VARIANTS) printf(" %s |", v.name);
    printf(" best AR + | err fused | err cuBLAS + sum |\n|---|---|---|---|");
    for (size_t i = 0; i < sizeof(VARIANTS) / sizeof(VARIANTS[0]); ++i) printf("---|");
    printf("---|---|---|\n");
    bool all_ok = true;
    for (const Shape& s : shapes) {
        // Fresh inputs for this shape; the checks use copy 0 of the weights.
        for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(r));
            fill<<<256, 256, 0, ranks[r].st>>>(ranks[r].x, (size_t)s.m * s.k, 99u + 13u * r + 7u * s.m + s.k, 1.0f);
        }
        // Reference: f32 partials from cuBLAS, summed in f64 on the host; and the unfused
        // result: cuBLAS's bf16 partials summed in rank order in f32, rounded to bf16.
        std::vector<double> want((size_t)s.m * s.n, 0.0);
        std::vector<float> part((size_t)s.m * s.n);
        std::vector<float> cublas_sum((size_t)s.m * s.n, 0.0f);
        std::vector<u16> yb((size_t)s.m * s.n);
        std::vector<std::vector<float>> partials(world);
        for (int r = 0; r < world; ++r) {
            Rank& R = ranks[r];
            CK(cudaSetDevice(r));
            float one = 1.f, zero = 0.f;
            CB(cublasGemmEx(R.blas, CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &one, R.w[0], CUDA_R_16BF, s.n, R.x, CUDA_R_16BF, s.k,
                            &zero, R.ref, CUDA_R_32F, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            CK(cudaMemcpyAsync(part.data(), R.ref, part.size() * 4, cudaMemcpyDeviceToHost, R.st));
            CK(cudaStreamSynchronize(R.st));
            partials[r] = part;
            for (size_t i = 0; i < part.size(); ++i) want[i] += part[i];
            call(R, CUBLAS, 0, s, P, r, world);
            CK(cudaMemcpyAsync(yb.data(), R.y, yb.size() * 2, cudaMemcpyDeviceToHost, R.st));
            CK(cudaStreamSynchronize(R.st));
            for (size_t i = 0; i < yb.size(); ++i) cublas_sum[i] += host_bf(yb[i]);
        }
        double scale = 0; for (double v : want) scale = std::max(scale, std::fabs(v));
        double err_cublas = 0;
        for (size_t i = 0; i < want.size(); ++i) {
            __nv_bfloat16 b = __float2bfloat16(cublas_sum[i]);
            err_cublas = std::max(err_cublas, std::fabs((double)__bfloat162float(b) - want[i]) / scale);
        }
        double err_fused = 0;
        for (const Which& v : VARIANTS) {
            if (v.mode == GEMM_ONLY) {
                // A GEMM alone: rank 0's output against cuBLAS's f32 partial.
                CK(cudaSetDevice(0));
                call(ranks[0], v, 0, s, P, 0, world);
                CK(cudaMemcpy(yb.data(), ranks[0].y, yb.size() * 2, cudaMemcpyDeviceToHost));
                double sc = 0, e = 0;
                for (float x : partials[0]) sc = std::max(sc, (double)std::fabs(x));
                for (size_t i = 0; i < yb.size(); ++i) e = std::max(e, std::fabs(host_bf(yb[i]) - partials[0][i]) / sc);
                if (e > 1e-2) { printf("%s wrong: %s M=%d max err %.3g\n", v.name, s.what, s.m, e); all_ok = false; }
                continue;
            }
            // Fused: every rank's output against the reference, and bit for bit against rank 0's.
            for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaMemset(ranks[r].y, 0xff, yb.size() * 2)); }
            for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); call(ranks[r], v, 0, s, P, r, world); }
            std::vector<u16> y0;
            for (int r = 0; r < world; ++r) {
                CK(cudaSetDevice(r));
                CK(cudaStreamSynchronize(ranks[r].st));
                CK(cudaMemcpy(yb.data(), ranks[r].y, yb.size() * 2, cudaMemcpyDeviceToHost));
                double e = 0;
                for (size_t i = 0; i < yb.size(); ++i) e = std::max(e, std::fabs(host_bf(yb[i]) - want[i]) / scale);
                if (!(e <= 2e-2)) { printf("%s wrong: %s M=%d rank %d max err %.3g\n", v.name, s.what, s.m, r, e); all_ok = false; }
                err_fused = std::max(err_fused, e);
                if (r == 0) y0 = yb;
                else if (memcmp(y0.data(), yb.data(), yb.size() * 2) != 0) { printf("%s: rank %d's sum differs from rank 0's\n", v.name, r); all_ok = false; }
            }
        }
        std::vector<Rank> one(ranks.begin(), ranks.begin() + 1);
        double t_cublas = timed(one, CUBLAS, s, P);
        printf("| %s | %d | %d | %.2f |", s.what, s.m, s.k, t_cublas);
        double best = 1e30;
        for (const Which& v : VARIANTS) {
            double t = v.mode == GEMM_ONLY ? timed(one, v, s, P) : timed(ranks, v, s, P);
            if (v.mode != GEMM_ONLY) best = std::min(best, t);
            printf(" %.2f |", t);
        }
        printf(" %.2f | %.2e | %.2e |\n", best - t_cublas, err_fused, err_cublas);
        fflush(stdout);
    }
    printf("check: %s\n", all_ok ? "ok" : "FAILED");
    return all_ok ? 0 : 1;
}
