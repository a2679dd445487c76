// Decode-sized GEMMs on one GPU: what cuBLASLt's first heuristic answer costs against the
// other algorithms it offers and against cuBLAS's `cublasGemmEx` (which candle calls), for
// the row-parallel projections of a tensor-parallel decode step. Row-major activations X
// [M, K] times row-major weights W [K, N] into Y [M, N], bf16 in and out, f32 accumulation,
// as the runtime describes them to cuBLASLt (column-major Yt (N x M) = Wt Xt, both "N").
// The weights rotate over enough copies that none is in L2 when it is read; fresh random
// inputs; every algorithm checked against cublasGemmEx's result. Events around 50
// launches, median of 15 samples, microseconds per GEMM.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 harness.cu -lcublasLt -lcublas -o decode_gemm_bench
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CB(x) do { int s_ = (int)(x); if (s_ != 0) { fprintf(stderr, "%s:%d cublas status %d\n", __FILE__, __LINE__, s_); exit(1); } } while (0)

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
        p[i] = __float2bfloat16(((h & 0xffff) / 32768.0f - 1.0f) * 0.05f);
    }
}

__global__ void max_rel(const __nv_bfloat16* a, const __nv_bfloat16* b, size_t n, float* out) {
    float m = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
        m = fmaxf(m, fabsf(x - y) / fmaxf(fabsf(y), 1e-2f));
    }
    atomicMax((int*)out, __float_as_int(m));
}

struct Shape { const char* what; int m, k, n; };

int main() {
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("decode_gemm_bench: %s\n", prop.name);
    cublasHandle_t blas; CB(cublasCreate(&blas));
    cublasLtHandle_t lt; CB(cublasLtCreate(&lt));
    cudaStream_t st; CK(cudaStreamCreate(&st));
    CB(cublasSetStream(blas, st));
    const size_t WS = 32 << 20;
    void* ws; CK(cudaMalloc(&ws, WS));
    CB(cublasSetWorkspace(blas, ws, WS));
    void* lt_ws; CK(cudaMalloc(&lt_ws, WS));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    float* dmax; CK(cudaMalloc(&dmax, 4));
    const Shape shapes[] = {
        {"candle o_proj TP2", 1, 2048, 4096}, {"candle o_proj TP2", 8, 2048, 4096}, {"candle o_proj TP2", 64, 2048, 4096},
        {"candle down TP2", 1, 7168, 4096}, {"candle down TP2", 8, 7168, 4096}, {"candle down TP2", 64, 7168, 4096},
        {"candle o_proj TP4", 1, 1024, 4096}, {"candle down TP4", 1, 3584, 4096},
        {"70B o_proj TP2", 1, 4096, 8192}, {"70B o_proj TP2", 32, 4096, 8192},
        {"70B down TP2", 1, 14336, 8192}, {"70B down TP2", 128, 14336, 8192},
    };
    const int REPS = 50, SAMPLES = 15;
    printf("%-18s %4s %6s %6s | %9s %9s %9s %6s | %s\n", "shape", "m", "k", "n", "GemmEx", "Lt top1", "Lt best", "best#", "Lt answers: us each");
    for (const Shape& s : shapes) {
        size_t wbytes = (size_t)s.k * s.n * 2;
        int copies = (int)std::max<size_t>(2, (size_t)(400ull << 20) / wbytes);
        std::vector<__nv_bfloat16*> w(copies);
        for (int i = 0; i < copies; ++i) { CK(cudaMalloc(&w[i], wbytes)); fill<<<1024, 256>>>(w[i], (size_t)s.k * s.n, 17u + i); }
        __nv_bfloat16 *x, *y, *yref;
        CK(cudaMalloc(&x, (size_t)s.m * s.k * 2)); CK(cudaMalloc(&y, (size_t)s.m * s.n * 2)); CK(cudaMalloc(&yref, (size_t)s.m * s.n * 2));
        fill<<<256, 256>>>(x, (size_t)s.m * s.k, 99u);
        const float one = 1.f, zero = 0.f;
        auto gemmex = [&](int i, __nv_bfloat16* out) {
            CB(cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &one, w[i % copies], CUDA_R_16BF, s.n,
                            x, CUDA_R_16BF, s.k, &zero, out, CUDA_R_16BF, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        };
        cublasLtMatmulDesc_t desc; CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasLtMatrixLayout_t la, lb, ld;
        CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.n, s.k, s.n));
        CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.k, s.m, s.k));
        CB(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, s.n, s.m, s.n));
        cublasLtMatmulPreference_t pref; CB(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t wsb = WS;
        CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
        cublasLtMatmulHeuristicResult_t res[16]; int got = 0;
        CB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 16, res, &got));
        auto ltmm = [&](int a, int i, __nv_bfloat16* out) {
            return cublasLtMatmul(lt, desc, &one, w[i % copies], la, x, lb, &zero, out, ld, out, ld, &res[a].algo, lt_ws, WS, st);
        };
        auto time = [&](auto&& launch) {
            std::vector<float> v;
            for (int smp = 0; smp < SAMPLES + 2; ++smp) {
                CK(cudaEventRecord(e0, st));
                for (int r = 0; r < REPS; ++r) launch(smp * REPS + r);
                CK(cudaEventRecord(e1, st));
                CK(cudaEventSynchronize(e1));
                float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
                if (smp >= 2) v.push_back(ms * 1000.f / REPS);
            }
            std::sort(v.begin(), v.end());
            return v[v.size() / 2];
        };
        gemmex(0, yref);
        float t_ex = time([&](int i) { gemmex(i, y); });
        std::vector<float> t_lt(got, -1.f);
        for (int a = 0; a < got; ++a) {
            if (ltmm(a, 0, y) != 0) continue;
            CK(cudaMemset(dmax, 0, 4));
            max_rel<<<64, 256, 0, st>>>(y, yref, (size_t)s.m * s.n, dmax);
            float h; CK(cudaMemcpy(&h, dmax, 4, cudaMemcpyDeviceToHost));
            if (h > 0.05f) { printf("  algo %d: max relative error %.3g\n", a, h); continue; }
            t_lt[a] = time([&](int i) { ltmm(a, i, y); });
        }
        int best = -1;
        for (int a = 0; a < got; ++a) if (t_lt[a] > 0 && (best < 0 || t_lt[a] < t_lt[best])) best = a;
        printf("%-18s %4d %6d %6d | %9.2f %9.2f %9.2f %6d |", s.what, s.m, s.k, s.n, t_ex, t_lt[0], best >= 0 ? t_lt[best] : -1.f, best);
        for (int a = 0; a < got; ++a) printf(" %.1f", t_lt[a]);
        printf("\n");
        fflush(stdout);
        cublasLtMatmulPreferenceDestroy(pref); cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(ld); cublasLtMatmulDescDestroy(desc);
        for (auto p : w) CK(cudaFree(p));
        CK(cudaFree(x)); CK(cudaFree(y)); CK(cudaFree(yref));
    }
    return 0;
}
