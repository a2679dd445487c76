// Checks and times the Hopper GEMM with the ReduceScatter in its epilogue (gemm.cu's
// `HOPPER_GEMM_RS`) on D GPUs of one process (peer access between every pair): every rank
// r multiplies A_r [M, K/D] by B_r [K/D, N]; rows [j M/D, (j+1) M/D) of the sum over ranks
// land on rank j. Two walks: the own row block first, then the peers' (RsArgs), and the
// owners in turn tile by tile (RsArgs::interleave). Checked against the f32 sum of cuBLAS's
// f32 partials; timed against the same kernel without communication (the local GEMM alone)
// and cuBLAS's local GEMM, all ranks launched together, the slowest rank's event time per
// call, medians.
// Built with one of gemm.cu's timing-only probes (-DRS_PROBE_NO_WAITS, -DRS_PROBE_STORES,
// ...), its sums are wrong by design: read only its times.
// Build: bench/hopper_gemm/build.sh        Run: hopper_gemm_rs_bench [D] [reps]
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
#include "rs_common.cuh"

struct Rank {
    u16 *a[2], *b[2], *out, *scratch;
    u32 *ready, *done, *error;
    cudaStream_t s;
    cudaEvent_t e0, e1;
    cublasHandle_t h;
};

int main(int argc, char** argv) {
    int sms = 0;
    int world = open_world(argc, argv, &sms);
    int reps = argc > 2 ? atoi(argv[2]) : 30;
    std::vector<Rank> R(world);
    for (int r = 0; r < world; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaFuncSetAttribute(hopper_gemm_rs_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_FOR(3, 4)));
        CK(cudaFuncSetAttribute(hopper_gemm_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
        CK(cudaStreamCreateWithFlags(&R[r].s, cudaStreamNonBlocking));
        CK(cudaEventCreate(&R[r].e0)); CK(cudaEventCreate(&R[r].e1));
        CB(cublasCreate(&R[r].h));
        CB(cublasSetStream(R[r].h, R[r].s));
    }
    // (M, K, N) of the seed rows: A [M, K] and B [K, N] sharded on K.
    struct Shape { int m, k, n; } shapes[] = {{8192, 8192, 8192}, {16384, 8192, 2048}, {16384, 8192, 8192}, {4096, 4096, 4096}};
    std::vector<std::string> table;
    bool all_ok = true;
    for (auto sh : shapes) {
        int kl = sh.k / world, rows = sh.m / world, n = sh.n;
        if (rows % BM) { printf("skip %d: rows per rank %d not a multiple of %d\n", sh.m, rows, BM); continue; }
        int per_block = (rows / BM) * ((n + BN - 1) / BN);
        size_t na = (size_t)sh.m * kl, nb = (size_t)kl * n, nout = (size_t)rows * n;
        for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(r));
            for (int s = 0; s < 2; ++s) {
                CK(cudaMalloc(&R[r].a[s], na * 2)); CK(cudaMalloc(&R[r].b[s], nb * 2));
                fill(R[r].a[s], na, false); fill(R[r].b[s], nb, false);
            }
            CK(cudaMalloc(&R[r].out, nout * 2)); CK(cudaMemset(R[r].out, 0xFF, nout * 2));
            CK(cudaMalloc(&R[r].scratch, (size_t)sh.m * n * 2));
            CK(cudaMalloc(&R[r].ready, MAXR * 4)); CK(cudaMemset(R[r].ready, 0, MAXR * 4));
            CK(cudaMalloc(&R[r].done, MAXR * 4)); CK(cudaMemset(R[r].done, 0, MAXR * 4));
            CK(cudaMalloc(&R[r].error, 4)); CK(cudaMemset(R[r].error, 0, 4));
        }
        for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize()); }
        u32 epoch = 0; // GEMM+RS calls so far
        // One call of every rank on input set `set`. Modes: 0 GEMM+RS, 1 the same with K = 0
        // (the communication alone), 2 our local GEMM alone, 3 cuBLAS's local GEMM alone
        // (the last two into a scratch of M x N), 4 and 5: 0 and 1 with the interleaved walk,
        // 6: 4 with the peers' tiles added into blocks of this rank's own scratch instead of
        // the peers' outputs (the same work, no tile over the links; its sums are not
        // checked, only timed).
        auto is_rs = [](int mode) { return mode < 2 || mode >= 4; };
        auto launch = [&](int mode, int set) {
            if (is_rs(mode)) ++epoch;
            for (int r = 0; r < world; ++r) {
                CK(cudaSetDevice(r));
                Rank& q = R[r];
                TensorMap am = make_map(q.a[set], kl, sh.m, kl, 64, BM, false);
                TensorMap bm = make_map(q.b[set], n, kl, n, 64, 64, false);
                CK(cudaEventRecord(q.e0, q.s));
                if (is_rs(mode)) {
                    TensorMap cm = make_map(q.out, n, rows, n, 64, 64, false);
                    RsArgs a = storer_rs_args(R, r, rows, epoch, mode >= 4);
                    if (mode == 6)
                        for (int j = 0; j < world; ++j)
                            if (j != r) a.outs[j] = (u64)(q.scratch + (size_t)j * nout);
                    int grid = std::min(per_block * world, sms);
                    bool comm_only = mode == 1 || mode == 5;
                    hopper_gemm_rs_bf16_nn<<<grid, THREADS, SMEM_FOR(3, 4), q.s>>>(am, bm, cm, rows, n, comm_only ? 0 : kl, a);
                } else if (mode == 2) {
                    TensorMap cm = make_map(q.scratch, n, sh.m, n, 64, 64, false);
                    int tiles = (sh.m / BM) * ((n + BN - 1) / BN);
                    hopper_gemm_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_BYTES, q.s>>>(am, bm, cm, sh.m, n, kl);
                } else {
                    float one = 1.f, zero = 0.f;
                    CB(cublasGemmEx(q.h, CUBLAS_OP_N, CUBLAS_OP_N, n, sh.m, kl, &one, q.b[set], CUDA_R_16BF, n,
                                    q.a[set], CUDA_R_16BF, kl, &zero, q.scratch, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                }
                CK(cudaGetLastError());
                CK(cudaEventRecord(q.e1, q.s));
            }
        };
        auto finish = [&]() { return slowest_ms(R); };
        // The f32 reference: cuBLAS's f32 partials of every rank, summed block by block at
        // the owner.
        std::vector<float*> ref = rs_reference(R, sh.m, kl, n);
        // Each way's first call against it: worst relative error over the ranks, elements
        // left unwritten (the output is poisoned first), wait errors.
        auto check = [&](int mode, double* rel) { return rs_check(R, launch, mode, nout, ref, rel); };
        double rel, rel_mix;
        bool ok = check(0, &rel);
        ok &= check(4, &rel_mix);
        for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaFree(ref[r])); }
        u32 errors = 0;
        std::vector<float> t[7];
        for (int i = 0; i < reps + 3; ++i)
            for (int mode = 0; mode < 7; ++mode) {
                for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaStreamSynchronize(R[r].s)); }
                launch(mode, i % 2);
                float ms = finish();
                if (i >= 3) t[mode].push_back(ms);
            }
        for (int r = 0; r < world; ++r) {
            u32 e; CK(cudaSetDevice(r)); CK(cudaMemcpy(&e, R[r].error, 4, cudaMemcpyDeviceToHost)); errors |= e;
        }
        ok &= errors == 0;
        all_ok &= ok;
        double rs = median(t[0]), comm = median(t[1]), alone = median(t[2]), cub = median(t[3]);
        double mix = median(t[4]), mix_comm = median(t[5]), local = median(t[6]);
        double bytes = 2.0 * (world - 1) * rows * (double)n; // what each rank sends
        char line[400];
        snprintf(line, sizeof line,
                 "%5d %5d %5d | %d | %7.1f %7.1f %7.1f | %7.1f %7.1f | %7.1f (%3.0f GB/s) %7.1f (%3.0f GB/s) | %5.3f %5.3f | %5.3f %5.3f %5.3f | %.1e %.1e %s",
                 sh.m, sh.k, sh.n, world, rs * 1e3, mix * 1e3, local * 1e3, alone * 1e3, cub * 1e3, comm * 1e3,
                 bytes / comm / 1e6, mix_comm * 1e3, bytes / mix_comm / 1e6, rs / alone, rs / std::max(alone, comm),
                 mix / alone, mix / std::max(alone, mix_comm), local / alone, rel, rel_mix,
                 ok ? "ok" : (errors ? "WAIT TIMED OUT" : "FAIL"));
        puts(line); fflush(stdout);
        table.push_back(line);
        for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(r));
            for (int s = 0; s < 2; ++s) { CK(cudaFree(R[r].a[s])); CK(cudaFree(R[r].b[s])); }
            CK(cudaFree(R[r].out)); CK(cudaFree(R[r].scratch));
            CK(cudaFree(R[r].ready)); CK(cudaFree(R[r].done)); CK(cudaFree(R[r].error));
        }
    }
    printf("\n    M     K     N | D | GEMM+RS us: own block first, interleaved, interleaved with peers' tiles kept local"
           " | GEMM alone: ours, cuBLAS | comm alone (K = 0): own first, interleaved | own first over GEMM alone, over max(GEMM, comm)"
           " | interleaved, the same; kept local over GEMM alone | rel err vs f32 (own first, interleaved)\n");
    for (auto& l : table) puts(l.c_str());
    printf("%s\n", all_ok ? "ALL CORRECT" : "SOME FAILED");
    return all_ok ? 0 : 1;
}
