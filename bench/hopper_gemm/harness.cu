// Checks and times the persistent Hopper GEMM (fusion-runtime's gemm/hopper/gemm.cu)
// against cuBLAS on one GPU: correctness against cuBLAS on fresh random inputs (output
// poisoned first, every element checked) and against an f64 host reference on small odd
// shapes; then medians of event-timed runs, rotating among input sets.
// Build (sm_90a):  bench/hopper_gemm/build.sh    Run:  hopper_gemm_bench [reps]
#include <cuda.h>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define ALL_VARIANTS
#include "../../fusion-runtime/src/backend/cuda/gemm/hopper/gemm.cu"

#include "common.cuh"

typedef void (*Kernel)(const __grid_constant__ TensorMap, const __grid_constant__ TensorMap, const __grid_constant__ TensorMap, int, int, int);

struct Variant { const char* name; Kernel k; bool f16, a_mn, b_k; };
static Variant VARIANTS[] = {
    {"bf16 nn", hopper_gemm_bf16_nn, false, false, false},
    {"bf16 nt", hopper_gemm_bf16_nt, false, false, true},
    {"bf16 tn", hopper_gemm_bf16_tn, false, true, false},
    {"f16 nn", hopper_gemm_f16_nn, true, false, false},
};

struct Problem { int m, n, k; };

// A is [M,K] row-major (lda = K), or with a_mn stored [K,M] (lda = M); B is [K,N] (ldb = N),
// or with b_k stored [N,K] (ldb = K).
static void run_ours(const Variant& v, int sms, const u16* a, const u16* b, u16* c, Problem p, cudaStream_t s) {
    TensorMap am = v.a_mn ? make_map(a, p.m, p.k, p.m, 64, 64, v.f16) : make_map(a, p.k, p.m, p.k, 64, BM, v.f16);
    TensorMap bm = v.b_k ? make_map(b, p.k, p.n, p.k, 64, BN, v.f16) : make_map(b, p.n, p.k, p.n, 64, 64, v.f16);
    TensorMap cm = make_map(c, p.n, p.m, p.n, 64, 64, v.f16);
    int tiles = ((p.m + BM - 1) / BM) * ((p.n + BN - 1) / BN);
    int grid = std::min(tiles, sms);
    v.k<<<grid, THREADS, SMEM_BYTES, s>>>(am, bm, cm, p.m, p.n, p.k);
    CK(cudaGetLastError());
}

static void run_cublas(cublasHandle_t h, const Variant& v, const u16* a, const u16* b, u16* c, Problem p) {
    float one = 1.f, zero = 0.f;
    cudaDataType t = v.f16 ? CUDA_R_16F : CUDA_R_16BF;
    // Column-major: C^T [N,M] = op(B)^T op(A)^T.
    cublasOperation_t ob = v.b_k ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t oa = v.a_mn ? CUBLAS_OP_T : CUBLAS_OP_N;
    int ldb = v.b_k ? p.k : p.n, lda = v.a_mn ? p.m : p.k;
    CB(cublasGemmEx(h, ob, oa, p.n, p.m, p.k, &one, b, t, ldb, a, t, lda, &zero, c, t, p.n,
                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Small odd shapes against an f64 host reference.
static bool check_small(const Variant& v, int sms, Problem p) {
    size_t na = (size_t)p.m * p.k, nb = (size_t)p.k * p.n, nc = (size_t)p.m * p.n;
    u16 *a, *b, *c;
    CK(cudaMalloc(&a, na * 2)); CK(cudaMalloc(&b, nb * 2)); CK(cudaMalloc(&c, nc * 2));
    fill(a, na, v.f16); fill(b, nb, v.f16);
    CK(cudaMemset(c, 0xFF, nc * 2));
    run_ours(v, sms, a, b, c, p, 0);
    CK(cudaDeviceSynchronize());
    std::vector<u16> ha(na), hb(nb), hc(nc);
    CK(cudaMemcpy(ha.data(), a, na * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hb.data(), b, nb * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hc.data(), c, nc * 2, cudaMemcpyDeviceToHost));
    double se = 0, sr = 0; size_t bad = 0;
    for (int i = 0; i < p.m; ++i)
        for (int j = 0; j < p.n; ++j) {
            double r = 0;
            for (int kk = 0; kk < p.k; ++kk) {
                double x = to_f32(v.a_mn ? ha[(size_t)kk * p.m + i] : ha[(size_t)i * p.k + kk], v.f16);
                double y = to_f32(v.b_k ? hb[(size_t)j * p.k + kk] : hb[(size_t)kk * p.n + j], v.f16);
                r += x * y;
            }
            double o = to_f32(hc[(size_t)i * p.n + j], v.f16);
            if (!std::isfinite(o)) { ++bad; continue; }
            se += (o - r) * (o - r); sr += r * r;
        }
    double rel = sqrt(se / sr);
    bool ok = bad == 0 && rel < 1e-2;
    printf("check %-8s %5dx%5dx%5d  rel %.2e  unwritten %zu  %s\n", v.name, p.m, p.n, p.k, rel, bad, ok ? "ok" : "FAIL");
    CK(cudaFree(a)); CK(cudaFree(b)); CK(cudaFree(c));
    return ok;
}

int main(int argc, char** argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 30;
    const char* only = getenv("ONLY_VARIANT");
    CK(cudaFree(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    int sms = prop.multiProcessorCount;
    printf("device %s, %d SMs, smem/block optin %zu\n", prop.name, sms, prop.sharedMemPerBlockOptin);
    for (auto& v : VARIANTS) CK(cudaFuncSetAttribute(v.k, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    bool all_ok = true;
    Problem small[] = {{128, 256, 64}, {200, 296, 136}, {384, 520, 1000}, {1000, 264, 72}};
    for (auto& v : VARIANTS)
        for (auto p : small) all_ok &= check_small(v, sms, p);

    cublasHandle_t h;
    CB(cublasCreate(&h));
    // Local GEMMs of the seed rows and the MLP block (M, N, K).
    Problem probs[] = {
        {8192, 8192, 8192}, {8192, 8192, 2048}, {8192, 2048, 8192}, {16384, 8192, 2048},
        {16384, 2048, 8192}, {16384, 8192, 512}, {8192, 3584, 4096}, {8192, 4096, 3584},
        {4096, 4096, 4096},
    };
    const int SETS = 3;
    std::vector<std::string> table;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    for (auto& v : VARIANTS) {
        if (only && std::string(only) != v.name) continue;
        for (auto p : probs) {
            size_t na = (size_t)p.m * p.k, nb = (size_t)p.k * p.n, nc = (size_t)p.m * p.n;
            u16 *a[SETS], *b[SETS], *c, *r;
            for (int s = 0; s < SETS; ++s) {
                CK(cudaMalloc(&a[s], na * 2)); CK(cudaMalloc(&b[s], nb * 2));
                fill(a[s], na, v.f16); fill(b[s], nb, v.f16);
            }
            CK(cudaMalloc(&c, nc * 2)); CK(cudaMalloc(&r, nc * 2));
            CK(cudaMemset(c, 0xFF, nc * 2));
            run_ours(v, sms, a[0], b[0], c, p, 0);
            run_cublas(h, v, a[0], b[0], r, p);
            double* acc;
            CK(cudaMalloc(&acc, 24)); CK(cudaMemset(acc, 0, 24));
            compare<<<264, 256>>>(c, r, nc, v.f16, acc);
            double hacc[3];
            CK(cudaMemcpy(hacc, acc, 24, cudaMemcpyDeviceToHost));
            double rel = sqrt(hacc[0] / hacc[1]);
            bool ok = hacc[2] == 0 && rel < 1e-2;
            all_ok &= ok;
            std::vector<float> to, tc;
            for (int i = 0; i < reps + 3; ++i) {
                int s = i % SETS;
                float ms;
                CK(cudaEventRecord(e0));
                run_ours(v, sms, a[s], b[s], c, p, 0);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (i >= 3) to.push_back(ms);
                CK(cudaEventRecord(e0));
                run_cublas(h, v, a[s], b[s], r, p);
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&ms, e0, e1));
                if (i >= 3) tc.push_back(ms);
            }
            double mo = median(to), mc = median(tc);
            double fl = 2.0 * p.m * p.n * p.k;
            char line[256];
            snprintf(line, sizeof line, "%-8s %5d %5d %5d | %8.1f %8.1f | %6.0f %6.0f | %5.3f | %.1e %s",
                     v.name, p.m, p.n, p.k, mo * 1e3, mc * 1e3, fl / mo / 1e9, fl / mc / 1e9, mc / mo, rel, ok ? "ok" : "FAIL");
            puts(line);
            fflush(stdout);
            table.push_back(line);
            for (int s = 0; s < SETS; ++s) { CK(cudaFree(a[s])); CK(cudaFree(b[s])); }
            CK(cudaFree(c)); CK(cudaFree(r)); CK(cudaFree(acc));
        }
    }
    printf("\nvariant      M     N     K |  ours us cublas us | TFLOP/s ours cublas | cublas/ours | rel err\n");
    for (auto& l : table) puts(l.c_str());
    printf("%s\n", all_ok ? "ALL CORRECT" : "SOME FAILED");
    return all_ok ? 0 : 1;
}
