// One GPU: what the communicating entries of the Hopper GEMM cost when everything they wait
// for and store to is on the GPU itself. The same local GEMMs as harness.cu, five ways:
//   plain   the GEMM alone (`hopper_gemm_*`);
//   ag      the AllGather entry (`hopper_gemm_ag_*`) told it is rank 1 of a world of 1, so
//           every tile's rows are a "peer's" block: the loader waits for each of its 4 pieces'
//           ready words (written by a stream write just before the launch, as a copy engine
//           does after a piece lands) and reads through the gathered map;
//   rs      the ReduceScatter entry (`hopper_gemm_rs_*`) in a world of 1: every tile is the
//           rank's own, stored as the plain GEMM stores it and counted at the owner
//           (itself), with the owner's done counter;
//   rs-il   the ReduceScatter entry with the runtime's interleaved walk in a world of 1:
//           the storers zero the output, then add every staged tile into it;
//   cuBLAS  for scale.
// Each is checked against `plain` (bit-identical: one partial, the same accumulation order)
// and timed by events, fresh random inputs alternating between two sets, medians.
// Build: bench/hopper_gemm/build.sh        Run: hopper_gemm_self_bench [reps]
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

// Elements that differ bit for bit.
__global__ void count_diff(const u16* x, const u16* y, size_t n, unsigned long long* out) {
    unsigned long long d = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        d += x[i] != y[i];
    atomicAdd(out, d);
}

struct Problem { int m, n, k; };

int main(int argc, char** argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 30;
    const char* one[] = {argv[0], "1"};
    int sms = 0;
    open_world(2, (char**)one, &sms);
    CK(cudaSetDevice(0));
    CK(cudaFuncSetAttribute(hopper_gemm_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    CK(cudaFuncSetAttribute(hopper_gemm_ag_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
    CK(cudaFuncSetAttribute(hopper_gemm_rs_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_FOR(3, 4)));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    cublasHandle_t h;
    CB(cublasCreate(&h)); CB(cublasSetStream(h, s));
    u32 *ready, *arrived, *done, *error;
    CK(cudaMalloc(&ready, MAXR * 8 * 4)); CK(cudaMemset(ready, 0, MAXR * 8 * 4));
    CK(cudaMalloc(&arrived, 4)); CK(cudaMemset(arrived, 0, 4));
    CK(cudaMalloc(&done, MAXR * 4)); CK(cudaMemset(done, 0, MAXR * 4));
    CK(cudaMalloc(&error, 4)); CK(cudaMemset(error, 0, 4));
    const int chunks = 4;
    Problem probs[] = {
        {8192, 8192, 8192}, {8192, 8192, 2048}, {8192, 2048, 8192}, {16384, 8192, 2048},
        {16384, 2048, 8192}, {16384, 8192, 512}, {8192, 3584, 4096}, {8192, 4096, 3584},
        {4096, 4096, 4096},
    };
    std::vector<std::string> table;
    bool all_ok = true;
    u32 epoch = 0; // AllGather calls so far
    for (auto p : probs) {
        u32 rs_epoch = 0; // ReduceScatter calls of this shape: its counters start at zero
        CK(cudaMemset(done, 0, MAXR * 4));
        CK(cudaMemset(ready + 16, 0, MAXR * 4));
        size_t na = (size_t)p.m * p.k, nb = (size_t)p.k * p.n, nc = (size_t)p.m * p.n;
        u16 *a[2], *b[2], *c[5];
        for (int i = 0; i < 2; ++i) {
            CK(cudaMalloc(&a[i], na * 2)); fill(a[i], na, false);
            CK(cudaMalloc(&b[i], nb * 2)); fill(b[i], nb, false);
        }
        for (int i = 0; i < 5; ++i) CK(cudaMalloc(&c[i], nc * 2));
        int tiles = (p.m / BM) * ((p.n + BN - 1) / BN);
        // Way 0 plain, 1 ag, 2 rs, 3 cuBLAS, 4 rs interleaved; into c[way].
        auto launch = [&](int way, int set) {
            TensorMap am = make_map(a[set], p.k, p.m, p.k, 64, BM, false);
            TensorMap bm = make_map(b[set], p.n, p.k, p.n, 64, 64, false);
            TensorMap cm = make_map(c[way], p.n, p.m, p.n, 64, 64, false);
            if (way == 1) ++epoch;
            if (way == 2 || way == 4) ++rs_epoch;
            if (way == 1) // every piece of the one block arrived, as a copy stream says it
                for (int w = 0; w < chunks; ++w)
                    CD(cuStreamWriteValue32((CUstream)s, (CUdeviceptr)(ready + w), epoch, 0));
            CK(cudaEventRecord(e0, s));
            if (way == 0) {
                hopper_gemm_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_BYTES, s>>>(am, bm, cm, p.m, p.n, p.k);
            } else if (way == 1) {
                AgArgs g;
                memset(&g, 0, sizeof g);
                g.own = am; // never read: no tile is rank 1's
                g.chunks = chunks;
                g.ready = (u64)ready; g.arrived = (u64)arrived; g.error = (u64)error;
                g.timeout_ns = 10ull * 1000 * 1000 * 1000;
                g.rank = 1; g.world = 1; g.rows_per = p.m; g.epoch = epoch;
                hopper_gemm_ag_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_BYTES, s>>>(am, bm, cm, p.m, p.n, p.k, g);
            } else if (way == 2 || way == 4) {
                RsArgs r;
                memset(&r, 0, sizeof r);
                r.outs[0] = (u64)c[way]; r.ready[0] = (u64)(ready + 16); r.done[0] = (u64)done;
                r.interleave = way == 4;
                r.error = (u64)error;
                r.timeout_ns = 10ull * 1000 * 1000 * 1000;
                r.rank = 0; r.world = 1; r.rows_per = p.m; r.epoch = rs_epoch;
                hopper_gemm_rs_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_FOR(3, 4), s>>>(am, bm, cm, p.m, p.n, p.k, r);
            } else {
                float one_f = 1.f, zero = 0.f;
                CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, p.n, p.m, p.k, &one_f, b[set], CUDA_R_16BF, p.n,
                                a[set], CUDA_R_16BF, p.k, &zero, c[3], CUDA_R_16BF, p.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            }
            CK(cudaGetLastError());
            CK(cudaEventRecord(e1, s));
        };
        auto elapsed = [&]() {
            CK(cudaEventSynchronize(e1));
            float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
            return ms;
        };
        // Correctness: each way's output (poisoned first) against plain's, bit for bit.
        bool ok = true;
        unsigned long long diff[5] = {0, 0, 0, 0, 0};
        for (int way = 0; way < 5; ++way) {
            CK(cudaMemset(c[way], 0xFF, nc * 2));
            launch(way, 0);
            elapsed();
        }
        for (int way = 1; way < 5; ++way) {
            unsigned long long* d; CK(cudaMalloc(&d, 8)); CK(cudaMemset(d, 0, 8));
            count_diff<<<264, 256>>>(c[way], c[0], nc, d);
            CK(cudaMemcpy(&diff[way], d, 8, cudaMemcpyDeviceToHost)); CK(cudaFree(d));
        }
        ok &= diff[1] == 0 && diff[2] == 0 && diff[4] == 0;
        std::vector<float> t[5];
        for (int i = 0; i < reps + 3; ++i)
            for (int way = 0; way < 5; ++way) {
                CK(cudaStreamSynchronize(s));
                launch(way, i % 2);
                float ms = elapsed();
                if (i >= 3) t[way].push_back(ms);
            }
        u32 e; CK(cudaMemcpy(&e, error, 4, cudaMemcpyDeviceToHost));
        ok &= e == 0;
        all_ok &= ok;
        double plain = median(t[0]), ag = median(t[1]), rs = median(t[2]), cub = median(t[3]), il = median(t[4]);
        char line[360];
        snprintf(line, sizeof line, "%5d %5d %5d | %7.1f %7.1f %7.1f %7.1f %7.1f | %5.3f %5.3f %5.3f %5.3f | %llu %llu %llu %llu %s",
                 p.m, p.n, p.k, plain * 1e3, ag * 1e3, rs * 1e3, il * 1e3, cub * 1e3, ag / plain, rs / plain, il / plain,
                 plain / cub, diff[1], diff[2], diff[4], diff[3], ok ? "ok" : (e ? "WAIT TIMED OUT" : "FAIL"));
        puts(line); fflush(stdout);
        table.push_back(line);
        for (int i = 0; i < 2; ++i) { CK(cudaFree(a[i])); CK(cudaFree(b[i])); }
        for (int i = 0; i < 5; ++i) CK(cudaFree(c[i]));
    }
    printf("\n    M     N     K | us: plain, AG aimed at itself, RS aimed at itself (own first, interleaved), cuBLAS"
           " | AG / plain, RS / plain (own first, interleaved), plain / cuBLAS | elements unlike plain: AG, RS, RS interleaved, cuBLAS\n");
    for (auto& l : table) puts(l.c_str());
    printf("%s\n", all_ok ? "ALL CORRECT" : "SOME FAILED");
    return all_ok ? 0 : 1;
}
