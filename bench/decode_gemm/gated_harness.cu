// The gated MLP's first half at decode sizes, Y = silu(X Wg) * (X Wu) (X [M, K], Wg and Wu
// [K, F], row-major bf16, f32 accumulation), as one kernel against what a decode step runs
// today: cuBLAS's two GEMMs and an elementwise SiLU-product kernel (the candle layer's
// fusion `mlp_residual`: cuBLASLt's GEMMs, one elementwise kernel), and cuBLAS's one GEMM on
// the two weights side by side ([K, 2F], a merged gate/up projection) with the same
// elementwise kernel. It measures whether the project's decode GEMM (the main loop of
// `peer_memory/gemm_allreduce.cu`) with both weights in each stage and the product in its
// epilogue is worth a node of the runtime: the candle layer's captured step at TP 4 spends
// ~50 us in its MLP fusion, whose 87 MB of weights take ~29 us at 3 TB/s
// (`bench/results/2026-11-27-0425-candle-decode-blocks-h100x4/`).
//
// The kernel: 32 output columns per tile; each stage row holds 32 columns of Wg then the
// same 32 of Wu (one 128-byte swizzled row, so the main loop is the GEMM's, 64 columns
// wide), so F / 32 tiles (112 at Llama-8B's TP 4 width, F = 3584: one wave on 132 SMs where
// two GEMMs of 64-column tiles would have 56 blocks each), M <= 32 rows padded to 16s, the
// whole K streamed through a ring of cp.async stages into mma.sync, four warps splitting
// each stage's K, their partial sums joined through shared memory; the epilogue writes
// silu(g) * u rounded once to bf16 (cuBLAS's path rounds g, u, silu(g) and the product).
//
// Rows: Llama-3-8B's MLP at TP 4 and 2 (K = 4096, F = 3584, 7168) and Llama-70B's at TP 8
// and 4 (K = 8192, F = 3584, 7168), M = 1, 8, 16, 32. Weights rotate over copies (none in
// L2 when read), fresh random inputs; every variant checked against an f64 host product of
// cuBLAS's f32 GEMMs (max |y - ref| / max |ref| <= 1e-2). Timed as 20 calls captured in one
// CUDA graph, events around them, median of 15 samples, microseconds per call; `GB/s` is
// the weights read (2 K F x 2 bytes) per microsecond of the fused kernel.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 gated_harness.cu -lcublas -o gated_gemm_bench
// Run:   gated_gemm_bench
#include "decode_mma.cuh"
#include <algorithm>
#include <cmath>
#include <vector>

#define TN 32  // output columns a tile (TN of Wg and TN of Wu a stage row)

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

// Y[M, F] = silu(X Wg) * (X Wu). MT: 16-row tiles of X. A block computes tiles blockIdx.x,
// + gridDim.x, ... (F / TN tiles).
template <int MT>
__global__ void __launch_bounds__(THREADS) gated(const u16* __restrict__ X, const u16* __restrict__ Wg, const u16* __restrict__ Wu,
                                                 u16* __restrict__ Y, int M, int K, int F) {
    constexpr int NT = 2 * TN / 8, MP = MT * 16, WK = THREADS / 32;
    constexpr int W_STAGE = BK * 2 * TN * 2, X_STAGE = MP * BK * 2, STAGE = W_STAGE + X_STAGE;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sbase = (u32)__cvta_generic_to_shared(smem);
    const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;
    const int KT = K / BK, tiles = F / TN;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int n0 = tile * TN;
        auto load = [&](int kt, int s) {
            const u32 wb = sbase + s * STAGE, xb = wb + W_STAGE;
            const int k0 = kt * BK;
#pragma unroll
            for (int i = 0; i < (BK * 8) / THREADS; ++i) {
                int q = tid + i * THREADS, r = q >> 3, c = q & 7;
                const u16* src = c < 4 ? Wg + (u64)(k0 + r) * F + n0 + c * 8 : Wu + (u64)(k0 + r) * F + n0 + (c - 4) * 8;
                cp_async16(swz(wb, r, c), src, true);
            }
            load_x<MP>(xb, X, M, K, k0, tid);
        };
        float acc[MT][NT][4];
        stream_k<MT, NT, WK>(acc, KT, sbase, STAGE, W_STAGE, load, wk, lane, 0);
        // The warps' partial sums over their K slices: red[wk][row][col], col < TN gate, else up.
        float* red = (float*)smem;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    int row = mt * 16 + (lane >> 2) + (i >= 2 ? 8 : 0);
                    int col = j * 8 + 2 * (lane & 3) + (i & 1);
                    red[(wk * MP + row) * 2 * TN + col] = acc[mt][j][i];
                }
        __syncthreads();
        // Chunk (row, c): 8 output columns, one 16-byte store.
        for (int q = tid; q < M * (TN / 8); q += THREADS) {
            int row = q / (TN / 8), c = q % (TN / 8);
            float f[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                float g = 0.f, u = 0.f;
#pragma unroll
                for (int w = 0; w < WK; ++w) {
                    g += red[(w * MP + row) * 2 * TN + c * 8 + e];
                    u += red[(w * MP + row) * 2 * TN + TN + c * 8 + e];
                }
                f[e] = silu(g) * u;
            }
            V4 v{bf2(f[0], f[1]), bf2(f[2], f[3]), bf2(f[4], f[5]), bf2(f[6], f[7])};
            *(V4*)(Y + (u64)row * F + n0 + c * 8) = v;
        }
        __syncthreads();
    }
}

// y[r, j] = silu(g[r, j]) * u[r, j] with g and u rows `ld` apart, bf16 in and out (computed
// in f32, as candle's and the runtime's elementwise kernels do); 8 columns a thread.
__global__ void silu_mul(const u16* g, const u16* u, int ld, u16* y, int M, int F) {
    int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= M * (F / 8)) return;
    int r = q / (F / 8), c = (q % (F / 8)) * 8;
    V4 gv = *(const V4*)(g + (u64)r * ld + c), uv = *(const V4*)(u + (u64)r * ld + c);
    u32 gw[4] = {gv.x, gv.y, gv.z, gv.w}, uw[4] = {uv.x, uv.y, uv.z, uv.w}, o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        float a = silu(bf_lo(gw[e])) * bf_lo(uw[e]), b = silu(bf_hi(gw[e])) * bf_hi(uw[e]);
        o[e] = bf2(a, b);
    }
    *(V4*)(y + (u64)r * F + c) = V4{o[0], o[1], o[2], o[3]};
}

struct Shape { const char* what; int m, k, f; };
// One copy of the weights: Wg and Wu apart, and side by side ([K, 2F]).
struct Weights { u16 *g, *u, *cat; };

struct Bench {
    cudaStream_t st;
    cublasHandle_t blas;
    u16 *x, *y, *gout, *uout, *catout;
    float *gref, *uref;
    std::vector<Weights> w;
    cudaEvent_t e0, e1;
};

enum Which { CUBLAS_TWO = 0, CUBLAS_CAT = 1, FUSED = 2 };
static const char* NAMES[] = {"cuBLAS x2 + silu*", "cuBLAS [Wg|Wu] + silu*", "fused"};

static void gemm(Bench& B, const u16* w, int ldw, const u16* x, u16* out, int m, int k, int n) {
    float one = 1.f, zero = 0.f;
    CB(cublasGemmEx(B.blas, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, ldw, x, CUDA_R_16BF, k, &zero, out,
                    CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

template <int MT>
static void launch(Bench& B, const Weights& w, const Shape& s) {
    constexpr int MP = MT * 16;
    size_t smem = std::max((size_t)STAGES * (BK * 2 * TN * 2 + MP * BK * 2), (size_t)(THREADS / 32) * MP * 2 * TN * 4);
    static bool set = false;
    if (!set) { CK(cudaFuncSetAttribute(gated<MT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)); set = true; }
    gated<MT><<<s.f / TN, THREADS, smem, B.st>>>(B.x, w.g, w.u, B.y, s.m, s.k, s.f);
}

static void call(Bench& B, Which which, int copy, const Shape& s) {
    const Weights& w = B.w[copy % B.w.size()];
    const int ew = (s.m * (s.f / 8) + 255) / 256;
    if (which == CUBLAS_TWO) {
        gemm(B, w.g, s.f, B.x, B.gout, s.m, s.k, s.f);
        gemm(B, w.u, s.f, B.x, B.uout, s.m, s.k, s.f);
        silu_mul<<<ew, 256, 0, B.st>>>(B.gout, B.uout, s.f, B.y, s.m, s.f);
    } else if (which == CUBLAS_CAT) {
        gemm(B, w.cat, 2 * s.f, B.x, B.catout, s.m, s.k, 2 * s.f);
        silu_mul<<<ew, 256, 0, B.st>>>(B.catout, B.catout + s.f, 2 * s.f, B.y, s.m, s.f);
    } else if (s.m <= 16) {
        launch<1>(B, w, s);
    } else {
        launch<2>(B, w, s);
    }
    CK(cudaGetLastError());
}

// Median over 15 samples of the microseconds per call (20 calls per graph).
static double timed(Bench& B, Which which, const Shape& s) {
    const int CALLS = 20, SAMPLES = 15;
    cudaGraph_t g;
    cudaGraphExec_t ex;
    CK(cudaStreamBeginCapture(B.st, cudaStreamCaptureModeThreadLocal));
    CK(cudaEventRecordWithFlags(B.e0, B.st, cudaEventRecordExternal));
    for (int i = 0; i < CALLS; ++i) call(B, which, i, s);
    CK(cudaEventRecordWithFlags(B.e1, B.st, cudaEventRecordExternal));
    CK(cudaStreamEndCapture(B.st, &g));
    CK(cudaGraphInstantiate(&ex, g, 0));
    CK(cudaGraphDestroy(g));
    std::vector<double> samples;
    for (int it = 0; it < SAMPLES + 2; ++it) {
        CK(cudaGraphLaunch(ex, B.st));
        CK(cudaStreamSynchronize(B.st));
        float ms; CK(cudaEventElapsedTime(&ms, B.e0, B.e1));
        if (it >= 2) samples.push_back(ms * 1000.0 / CALLS);
    }
    CK(cudaGraphExecDestroy(ex));
    std::sort(samples.begin(), samples.end());
    return samples[samples.size() / 2];
}

int main() {
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("gated_gemm_bench: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    const int MMAX = 32, KMAX = 8192, FMAX = 7168;
    // Enough copies that none is in L2 when read again (the smallest set, K 4096 x F 3584 x
    // 2 weights x 2 layouts, is 117 MB).
    const int COPIES = 4;
    Bench B;
    CK(cudaStreamCreateWithFlags(&B.st, cudaStreamNonBlocking));
    CB(cublasCreate(&B.blas));
    CB(cublasSetStream(B.blas, B.st));
    void* blas_ws; CK(cudaMalloc(&blas_ws, 32 << 20));
    CB(cublasSetWorkspace(B.blas, blas_ws, 32 << 20));
    CK(cudaMalloc(&B.x, (size_t)MMAX * KMAX * 2));
    CK(cudaMalloc(&B.y, (size_t)MMAX * FMAX * 2));
    CK(cudaMalloc(&B.gout, (size_t)MMAX * FMAX * 2));
    CK(cudaMalloc(&B.uout, (size_t)MMAX * FMAX * 2));
    CK(cudaMalloc(&B.catout, (size_t)MMAX * 2 * FMAX * 2));
    CK(cudaMalloc(&B.gref, (size_t)MMAX * FMAX * 4));
    CK(cudaMalloc(&B.uref, (size_t)MMAX * FMAX * 4));
    CK(cudaEventCreate(&B.e0)); CK(cudaEventCreate(&B.e1));
    for (int c = 0; c < COPIES; ++c) {
        Weights w;
        CK(cudaMalloc(&w.g, (size_t)KMAX * FMAX * 2));
        CK(cudaMalloc(&w.u, (size_t)KMAX * FMAX * 2));
        CK(cudaMalloc(&w.cat, (size_t)KMAX * 2 * FMAX * 2));
        B.w.push_back(w);
    }
    std::vector<Shape> shapes;
    for (int m : {1, 8, 16, 32}) {
        shapes.push_back({"8B TP4", m, 4096, 3584});
        shapes.push_back({"8B TP2", m, 4096, 7168});
        shapes.push_back({"70B TP8", m, 8192, 3584});
        shapes.push_back({"70B TP4", m, 8192, 7168});
    }
    printf("Microseconds per call (weights cold); GB/s: the weights over the fused kernel's time;\n");
    printf("err: max |y - f64 silu(g) u| / max |ref| against cuBLAS's f32 GEMMs.\n");
    printf("| shape | M | K | F | %s | %s | %s | fused / best cuBLAS | GB/s | err fused | err cuBLAS x2 |\n", NAMES[0], NAMES[1], NAMES[2]);
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    bool all_ok = true;
    for (const Shape& s : shapes) {
        // Weights of this shape (Wg and Wu, and the same side by side), fresh inputs.
        for (int c = 0; c < COPIES; ++c) {
            Weights& w = B.w[c];
            size_t n = (size_t)s.k * s.f;
            fill<<<1024, 256, 0, B.st>>>(w.g, n, 1234u + 1000u * c + s.f, 0.05f);
            fill<<<1024, 256, 0, B.st>>>(w.u, n, 4321u + 1000u * c + s.f, 0.05f);
            CK(cudaMemcpy2DAsync(w.cat, (size_t)2 * s.f * 2, w.g, (size_t)s.f * 2, (size_t)s.f * 2, s.k, cudaMemcpyDeviceToDevice, B.st));
            CK(cudaMemcpy2DAsync(w.cat + s.f, (size_t)2 * s.f * 2, w.u, (size_t)s.f * 2, (size_t)s.f * 2, s.k, cudaMemcpyDeviceToDevice, B.st));
        }
        fill<<<256, 256, 0, B.st>>>(B.x, (size_t)s.m * s.k, 99u + 7u * s.m + s.k, 1.0f);
        // Reference: cuBLAS's f32 GEMMs of copy 0, silu(g) * u in f64 on the host.
        float one = 1.f, zero = 0.f;
        CB(cublasGemmEx(B.blas, CUBLAS_OP_N, CUBLAS_OP_N, s.f, s.m, s.k, &one, B.w[0].g, CUDA_R_16BF, s.f, B.x, CUDA_R_16BF, s.k,
                        &zero, B.gref, CUDA_R_32F, s.f, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        CB(cublasGemmEx(B.blas, CUBLAS_OP_N, CUBLAS_OP_N, s.f, s.m, s.k, &one, B.w[0].u, CUDA_R_16BF, s.f, B.x, CUDA_R_16BF, s.k,
                        &zero, B.uref, CUDA_R_32F, s.f, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        std::vector<float> g((size_t)s.m * s.f), u((size_t)s.m * s.f);
        CK(cudaMemcpyAsync(g.data(), B.gref, g.size() * 4, cudaMemcpyDeviceToHost, B.st));
        CK(cudaMemcpyAsync(u.data(), B.uref, u.size() * 4, cudaMemcpyDeviceToHost, B.st));
        CK(cudaStreamSynchronize(B.st));
        std::vector<double> want(g.size());
        double scale = 0;
        for (size_t i = 0; i < g.size(); ++i) {
            double gv = g[i];
            want[i] = gv / (1.0 + std::exp(-gv)) * u[i];
            scale = std::max(scale, std::fabs(want[i]));
        }
        double err[3] = {0, 0, 0};
        std::vector<u16> yb(g.size());
        for (int v = 0; v < 3; ++v) {
            CK(cudaMemsetAsync(B.y, 0xff, yb.size() * 2, B.st));
            call(B, (Which)v, 0, s);
            CK(cudaMemcpyAsync(yb.data(), B.y, yb.size() * 2, cudaMemcpyDeviceToHost, B.st));
            CK(cudaStreamSynchronize(B.st));
            for (size_t i = 0; i < yb.size(); ++i) err[v] = std::max(err[v], std::fabs(host_bf(yb[i]) - want[i]) / scale);
            if (!(err[v] <= 1e-2)) { printf("%s wrong: %s M=%d max err %.3g\n", NAMES[v], s.what, s.m, err[v]); all_ok = false; }
        }
        double t[3];
        for (int v = 0; v < 3; ++v) t[v] = timed(B, (Which)v, s);
        double bytes = 2.0 * s.k * s.f * 2;
        printf("| %s | %d | %d | %d | %.2f | %.2f | %.2f | %.3f | %.0f | %.2e | %.2e |\n", s.what, s.m, s.k, s.f, t[0], t[1], t[2],
               t[2] / std::min(t[0], t[1]), bytes / (t[2] * 1e3), err[2], err[0]);
        fflush(stdout);
    }
    printf("check: %s\n", all_ok ? "ok" : "FAILED");
    return all_ok ? 0 : 1;
}
