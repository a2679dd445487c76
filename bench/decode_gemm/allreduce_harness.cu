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
// Kernels that finish some tiles before the GEMM ends (narrower tiles several a block;
// split-K groups, cp.async- or TMA-fed) were tried here and lost where measured (commit fc2e5f1,
// `bench/results/2026-11-27-1515-decode-gemm-ar-tiles-groups-h100x4/`; docs/DECISIONS.md,
// "The decode GEMM's tiles all finish at its end").
//
// Rows: Llama-70B's o_proj and down_proj at TP `devices` (K = 8192 / D and 28672 / D,
// N = 8192), M = 1, 8, 32, 128; columns: cuBLAS (`cublasGemmEx`, bf16 out) alone, this
// kernel as a GEMM alone, then each GEMM + Allreduce variant. Weights rotate over copies
// (none is in L2 when read), fresh random inputs; every variant checked against an f64
// host sum of cuBLAS's f32 partials (and every rank's bits against rank 0's). Timed as 20
// calls captured in one CUDA graph per GPU after a barrier kernel (every GPU starts
// together), events around the calls, slowest GPU's time per call, median of 15 samples.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 allreduce_harness.cu -lcublas -o gemm_allreduce_bench
// Run:   gemm_allreduce_bench [devices]
#include "decode_mma.cuh"
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
    cudaEvent_t e0, e1;
};

struct Shape { const char* what; int m, k, n; };

template <int MT, int WN, int MODE>
static void launch(Rank& R, const u16* w, int m, int k, int n, int per, Peers P, int rank, int world) {
    constexpr int MP = MT * 16;
    size_t smem = (size_t)STAGES * (BK * BN * 2 + MP * BK * 2);
    size_t red = (size_t)(4 / WN) * MP * BN * 4;
    smem = std::max(smem, red);
    static bool set[8] = {};
    if (!set[R.dev]) { CK(cudaFuncSetAttribute(gemm_ar<MT, WN, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)); set[R.dev] = true; }
    gemm_ar<MT, WN, MODE><<<(n / BN + per - 1) / per, THREADS, smem, R.st>>>(R.x, w, R.y, m, k, n, P, rank, world);
}

template <int MODE>
static void launch_m(Rank& R, const u16* w, int m, int k, int n, int per, Peers P, int rank, int world) {
    if (m <= 16) launch<1, 1, MODE>(R, w, m, k, n, per, P, rank, world);
    else if (m <= 32) launch<2, 1, MODE>(R, w, m, k, n, per, P, rank, world);
    else if (m <= 64) launch<4, 1, MODE>(R, w, m, k, n, per, P, rank, world);
    else launch<8, 2, MODE>(R, w, m, k, n, per, P, rank, world);
}

// What a timed call runs: cuBLAS alone, or this kernel in `mode` with `per` tiles a block.
struct Which { const char* name; bool cublas; int mode; int per; };
static const Which CUBLAS{"cuBLAS", true, GEMM_ONLY, 1};
static const Which VARIANTS[] = {
    {"gemm", false, GEMM_ONLY, 1}, {"gemm/2", false, GEMM_ONLY, 2},
    {"flag", false, AR_FLAG, 1}, {"ll", false, AR_LL, 1}, {"ll/2", false, AR_LL, 2},
};

static void call(Rank& R, const Which& which, int copy, const Shape& s, Peers P, int rank, int world) {
    const u16* w = R.w[copy % R.w.size()];
    if (which.cublas) {
        float one = 1.f, zero = 0.f;
        CB(cublasGemmEx(R.blas, CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &one, w, CUDA_R_16BF, s.n, R.x, CUDA_R_16BF, s.k,
                        &zero, R.y, CUDA_R_16BF, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    } else if (which.mode == GEMM_ONLY) {
        launch_m<GEMM_ONLY>(R, w, s.m, s.k, s.n, which.per, P, rank, world);
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
