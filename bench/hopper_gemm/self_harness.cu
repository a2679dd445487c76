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
//   rs-4    the interleaved walk as rank 0 of a world of 4 whose every owner's output is
//           this GPU's one block of M / 4 rows (the peers' counters preset as arrived): a
//           D = 4 rank's staging, zeroing and adds with no links (timed, not checked: the
//           block holds the sum of the four row blocks' products);
//   ag-gelu the AllGather entry as `ag`, with a gelu_tanh epilogue (timed, not checked);
//   plain-3 the plain GEMM with 3 operand stages and 4 output pieces (the ReduceScatter
//           entry's shared memory): what fewer stages cost;
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

// The plain GEMM with the ReduceScatter entry's shared memory split (3 stages, 4 pieces):
// what the staging's shared memory costs the operand pipeline.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
hopper_gemm_bf16_nn_s3(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,
                       const __grid_constant__ TensorMap c_map, int m, int n, int k) {
    gemm_body<false, false, false, 3, 4, WALK_PLAIN>(&a_map, &b_map, &c_map, m, n, k, nullptr, nullptr);
}

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
    CK(cudaFuncSetAttribute(hopper_gemm_bf16_nn_s3, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_FOR(3, 4)));
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
    // rs-4's counters: ready at the own rank (words 0-3), at the "peers" (4-15), done at
    // the own rank (16-19), at the "peers" (20-31).
    u32* w4; CK(cudaMalloc(&w4, 32 * 4));
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
        u32 rs4_epoch = 0;
        {
            u32 init[32] = {0};
            for (int j = 1; j < 4; ++j) init[j] = init[16 + j] = 0x40000000u; // the peers: arrived
            CK(cudaMemcpy(w4, init, sizeof init, cudaMemcpyHostToDevice));
        }
        CK(cudaMemset(done, 0, MAXR * 4));
        CK(cudaMemset(ready + 16, 0, MAXR * 4));
        size_t na = (size_t)p.m * p.k, nb = (size_t)p.k * p.n, nc = (size_t)p.m * p.n;
        u16 *a[2], *b[2], *c[8];
        for (int i = 0; i < 2; ++i) {
            CK(cudaMalloc(&a[i], na * 2)); fill(a[i], na, false);
            CK(cudaMalloc(&b[i], nb * 2)); fill(b[i], nb, false);
        }
        for (int i = 0; i < 8; ++i) CK(cudaMalloc(&c[i], nc * 2));
        int tiles = (p.m / BM) * ((p.n + BN - 1) / BN);
        // Way 0 plain, 1 ag, 2 rs, 3 cuBLAS, 4 rs interleaved, 5 rs-4, 6 plain-3, 7 ag-gelu; into c[way].
        auto launch = [&](int way, int set) {
            TensorMap am = make_map(a[set], p.k, p.m, p.k, 64, BM, false);
            TensorMap bm = make_map(b[set], p.n, p.k, p.n, 64, 64, false);
            TensorMap cm = make_map(c[way], p.n, p.m, p.n, 64, 64, false);
            if (way == 1 || way == 7) ++epoch;
            if (way == 2 || way == 4) ++rs_epoch;
            if (way == 5) ++rs4_epoch;
            if (way == 1 || way == 7) // every piece of the one block arrived, as a copy stream says it
                for (int w = 0; w < chunks; ++w)
                    CD(cuStreamWriteValue32((CUstream)s, (CUdeviceptr)(ready + w), epoch, 0));
            CK(cudaEventRecord(e0, s));
            if (way == 6) {
                hopper_gemm_bf16_nn_s3<<<std::min(tiles, sms), THREADS, SMEM_FOR(3, 4), s>>>(am, bm, cm, p.m, p.n, p.k);
            } else if (way == 0) {
                hopper_gemm_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_BYTES, s>>>(am, bm, cm, p.m, p.n, p.k);
            } else if (way == 1 || way == 7) {
                AgArgs g;
                memset(&g, 0, sizeof g);
                g.own = am; // never read: no tile is rank 1's
                g.chunks = chunks;
                g.ready = (u64)ready; g.arrived = (u64)arrived; g.error = (u64)error;
                g.timeout_ns = 10ull * 1000 * 1000 * 1000;
                g.rank = 1; g.world = 1; g.rows_per = p.m; g.epoch = epoch;
                g.act = way == 7 ? ACT_GELU_TANH : ACT_NONE;
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
            } else if (way == 5) {
                RsArgs r;
                memset(&r, 0, sizeof r);
                for (int j = 0; j < 4; ++j) {
                    r.outs[j] = (u64)c[5];
                    r.ready[j] = (u64)(w4 + 4 * j);
                    r.done[j] = (u64)(w4 + 16 + 4 * j);
                }
                r.interleave = 1;
                r.error = (u64)error;
                r.timeout_ns = 10ull * 1000 * 1000 * 1000;
                r.rank = 0; r.world = 4; r.rows_per = p.m / 4; r.epoch = rs4_epoch;
                hopper_gemm_rs_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_FOR(3, 4), s>>>(am, bm, cm, p.m / 4, p.n, p.k, r);
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
        unsigned long long diff[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int way = 0; way < 8; ++way) {
            CK(cudaMemset(c[way], 0xFF, nc * 2));
            launch(way, 0);
            elapsed();
        }
        for (int way : {1, 2, 3, 4, 6}) {
            unsigned long long* d; CK(cudaMalloc(&d, 8)); CK(cudaMemset(d, 0, 8));
            count_diff<<<264, 256>>>(c[way], c[0], nc, d);
            CK(cudaMemcpy(&diff[way], d, 8, cudaMemcpyDeviceToHost)); CK(cudaFree(d));
        }
        ok &= diff[1] == 0 && diff[2] == 0 && diff[4] == 0 && diff[6] == 0;
        std::vector<float> t[8];
        for (int i = 0; i < reps + 3; ++i)
            for (int way = 0; way < 8; ++way) {
                CK(cudaStreamSynchronize(s));
                launch(way, i % 2);
                float ms = elapsed();
                if (i >= 3) t[way].push_back(ms);
            }
        u32 e; CK(cudaMemcpy(&e, error, 4, cudaMemcpyDeviceToHost));
        ok &= e == 0;
        all_ok &= ok;
        double plain = median(t[0]), ag = median(t[1]), rs = median(t[2]), cub = median(t[3]), il = median(t[4]), r4 = median(t[5]), p3 = median(t[6]), ag_act = median(t[7]);
        char line[480];
        snprintf(line, sizeof line, "%5d %5d %5d | %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f %7.1f | %5.3f %5.3f %5.3f %5.3f %5.3f %5.3f %5.3f | %llu %llu %llu %llu %s",
                 p.m, p.n, p.k, plain * 1e3, ag * 1e3, ag_act * 1e3, rs * 1e3, il * 1e3, r4 * 1e3, p3 * 1e3, cub * 1e3, ag / plain, ag_act / plain,
                 rs / plain, il / plain, r4 / plain, p3 / plain, plain / cub, diff[1], diff[2], diff[4], diff[3], ok ? "ok" : (e ? "WAIT TIMED OUT" : "FAIL"));
        puts(line); fflush(stdout);
        table.push_back(line);
        for (int i = 0; i < 2; ++i) { CK(cudaFree(a[i])); CK(cudaFree(b[i])); }
        for (int i = 0; i < 8; ++i) CK(cudaFree(c[i]));
    }
    printf("\n    M     N     K | us: plain, AG aimed at itself (plain, gelu_tanh epilogue), RS aimed at itself (own first, interleaved, as rank of 4), plain-3, cuBLAS"
           " | AG / plain (plain, gelu_tanh), RS / plain (own first, interleaved, as rank of 4), plain-3 / plain, plain / cuBLAS | elements unlike plain: AG, RS, RS interleaved, cuBLAS\n");
    for (auto& l : table) puts(l.c_str());
    printf("%s\n", all_ok ? "ALL CORRECT" : "SOME FAILED");
    return all_ok ? 0 : 1;
}
