// Checks and times the Hopper GEMM+ReduceScatter by copy engines (gemm.cu's
// `HOPPER_GEMM_RS_CE`, design in NOTES.md) on D GPUs of one process, beside the storer-warp
// kernel (`HOPPER_GEMM_RS`) and the GEMM alone, on the seed rows: every rank r multiplies
// A_r [M, K/D] by B_r [K/D, N]; rows [j M/D, (j+1) M/D) of the sum land on rank j.
//
// Per rank and call: the kernel on the main stream; per peer a copy stream that, for each
// chunk of the peer's row block, waits on the kernel's chunk counter (cuStreamWaitValue32),
// copies the chunk from this rank's scratch into slot `rank` of the peer's receive buffer
// (the half of the call's epoch) and writes the peer's arrival word (cuStreamWriteValue32);
// the main stream waits for the copy streams, so a call ends when its copies have.
// Checked against the f32 sum of cuBLAS's f32 partials (every rank's block, unwritten
// elements counted); timed as the slowest rank's event time per call, medians, all ranks
// launched together, modes in rotation.
// Build: bench/hopper_gemm/build.sh        Run: hopper_gemm_rs_ce_bench [D] [reps] [chunks]
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
    u16 *a[2], *b[2], *out, *scratch, *recv;
    u32 *counters, *arrive, *error;          // copy-engine way
    u32 *ready, *done;                       // storer-warp way
    cudaStream_t s;
    std::vector<cudaStream_t> copy;          // one per peer (index: peer)
    std::vector<cudaEvent_t> copied;         // one per peer
    cudaEvent_t e0, e1;
    cublasHandle_t h;
};

int main(int argc, char** argv) {
    int sms = 0;
    int world = open_world(argc, argv, &sms);
    int reps = argc > 2 ? atoi(argv[2]) : 30;
    int chunks = argc > 3 ? atoi(argv[3]) : 4;
    std::vector<Rank> R(world);
    for (int r = 0; r < world; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaFuncSetAttribute(hopper_gemm_rs_ce_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
        CK(cudaFuncSetAttribute(hopper_gemm_rs_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_FOR(3, 4)));
        CK(cudaFuncSetAttribute(hopper_gemm_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
        CK(cudaStreamCreateWithFlags(&R[r].s, cudaStreamNonBlocking));
        R[r].copy.resize(world);
        R[r].copied.resize(world);
        for (int p = 0; p < world; ++p) {
            CK(cudaStreamCreateWithFlags(&R[r].copy[p], cudaStreamNonBlocking));
            CK(cudaEventCreateWithFlags(&R[r].copied[p], cudaEventDisableTiming));
        }
        CK(cudaEventCreate(&R[r].e0)); CK(cudaEventCreate(&R[r].e1));
        CB(cublasCreate(&R[r].h));
        CB(cublasSetStream(R[r].h, R[r].s));
    }
    struct Shape { int m, k, n; } shapes[] = {{8192, 8192, 8192}, {16384, 8192, 2048}, {16384, 8192, 8192}};
    std::vector<std::string> table;
    bool all_ok = true;
    for (auto sh : shapes) {
        int kl = sh.k / world, rows = sh.m / world, n = sh.n;
        int tiles_m = rows / BM;
        if (rows % BM || tiles_m % chunks) { printf("skip %d: %d rows per rank, %d chunks\n", sh.m, rows, chunks); continue; }
        int tiles_n = (n + BN - 1) / BN, per_block = tiles_m * tiles_n;
        int chunk_rows = rows / chunks;
        u32 chunk_target = (u32)(CONSUMERS * (tiles_m / chunks) * tiles_n);
        size_t na = (size_t)sh.m * kl, nb = (size_t)kl * n, nout = (size_t)rows * n;
        for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(r));
            Rank& q = R[r];
            for (int s = 0; s < 2; ++s) {
                CK(cudaMalloc(&q.a[s], na * 2)); CK(cudaMalloc(&q.b[s], nb * 2));
                fill(q.a[s], na, false); fill(q.b[s], nb, false);
            }
            CK(cudaMalloc(&q.out, nout * 2));
            CK(cudaMalloc(&q.scratch, (size_t)sh.m * n * 2));
            CK(cudaMalloc(&q.recv, 2 * (size_t)world * nout * 2));
            CK(cudaMalloc(&q.counters, MAXR * 64 * 4)); CK(cudaMemset(q.counters, 0, MAXR * 64 * 4));
            CK(cudaMalloc(&q.arrive, MAXR * 64 * 4)); CK(cudaMemset(q.arrive, 0, MAXR * 64 * 4));
            CK(cudaMalloc(&q.error, 4)); CK(cudaMemset(q.error, 0, 4));
            CK(cudaMalloc(&q.ready, MAXR * 4)); CK(cudaMemset(q.ready, 0, MAXR * 4));
            CK(cudaMalloc(&q.done, MAXR * 4)); CK(cudaMemset(q.done, 0, MAXR * 4));
        }
        for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize()); }
        u32 ce_epoch = 0, rs_epoch = 0;
        // One call of every rank on input set `set`. Modes: 0 RS by copy engines, 1 the same
        // with K = 0 (its communication alone), 2 the storer-warp RS, 3 our GEMM alone, 4 mode
        // 0 counting each stored tile at once (a wait for its stores) instead of a tile later.
        auto is_ce = [](int mode) { return mode < 2 || mode == 4; };
        auto launch = [&](int mode, int set) {
            if (is_ce(mode)) ++ce_epoch;
            if (mode == 2) ++rs_epoch;
            for (int r = 0; r < world; ++r) {
                CK(cudaSetDevice(r));
                Rank& q = R[r];
                TensorMap am = make_map(q.a[set], kl, sh.m, kl, 64, BM, false);
                TensorMap bm = make_map(q.b[set], n, kl, n, 64, 64, false);
                TensorMap cm = make_map(q.out, n, rows, n, 64, 64, false);
                CK(cudaEventRecord(q.e0, q.s));
                if (is_ce(mode)) {
                    RsCeArgs a;
                    memset(&a, 0, sizeof a);
                    a.scratch = make_map(q.scratch, n, sh.m, n, 64, 64, false);
                    a.counters = (u64)q.counters;
                    a.recv = (u64)q.recv;
                    a.arrive = (u64)q.arrive;
                    a.error = (u64)q.error;
                    a.timeout_ns = 10ull * 1000 * 1000 * 1000;
                    a.rank = r; a.world = world; a.rows_per = rows; a.chunks = chunks; a.epoch = ce_epoch;
                    a.count_at_once = mode == 4;
                    int grid = std::min(per_block * world, sms);
                    hopper_gemm_rs_ce_bf16_nn<<<grid, THREADS, SMEM_BYTES, q.s>>>(am, bm, cm, rows, n, mode == 1 ? 0 : kl, a);
                    CK(cudaGetLastError());
                    size_t half = (size_t)(ce_epoch & 1u) * world * nout;
                    for (int o = 0; o < world; ++o) {
                        if (o == r) continue;
                        cudaStream_t cs = q.copy[o];
                        CK(cudaStreamWaitEvent(cs, q.e0, 0));
                        for (int c = 0; c < chunks; ++c) {
                            CD(cuStreamWaitValue32((CUstream)cs, (CUdeviceptr)(q.counters + o * chunks + c),
                                                   ce_epoch * chunk_target, CU_STREAM_WAIT_VALUE_GEQ));
                            CK(cudaMemcpyPeerAsync(R[o].recv + half + (size_t)r * nout + (size_t)c * chunk_rows * n, o,
                                                   q.scratch + ((size_t)o * rows + (size_t)c * chunk_rows) * n, r,
                                                   (size_t)chunk_rows * n * 2, cs));
                            CD(cuStreamWriteValue32((CUstream)cs, (CUdeviceptr)(R[o].arrive + r * chunks + c), ce_epoch, 0));
                        }
                        CK(cudaEventRecord(q.copied[o], cs));
                        CK(cudaStreamWaitEvent(q.s, q.copied[o], 0));
                    }
                } else if (mode == 2) {
                    RsArgs a = storer_rs_args(R, r, rows, rs_epoch);
                    int grid = std::min(per_block * world, sms);
                    hopper_gemm_rs_bf16_nn<<<grid, THREADS, SMEM_FOR(3, 4), q.s>>>(am, bm, cm, rows, n, kl, a);
                } else {
                    TensorMap sm = make_map(q.scratch, n, sh.m, n, 64, 64, false);
                    int tiles = (sh.m / BM) * tiles_n;
                    hopper_gemm_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_BYTES, q.s>>>(am, bm, sm, sh.m, n, kl);
                }
                CK(cudaGetLastError());
                CK(cudaEventRecord(q.e1, q.s));
            }
        };
        auto finish = [&]() { return slowest_ms(R); };
        // The f32 reference: cuBLAS's f32 partials of every rank, summed block by block.
        std::vector<float*> ref = rs_reference(R, sh.m, kl, n);
        // A way's call on input set 0 against the reference: worst relative error over the
        // ranks, elements left unwritten (the output is poisoned first), wait errors.
        auto check = [&](int mode, double* rel) { return rs_check(R, launch, mode, nout, ref, rel); };
        double rel_ce, rel_rs, rel_once;
        bool ok = check(0, &rel_ce);
        ok &= check(2, &rel_rs);
        ok &= check(4, &rel_once);
        for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaFree(ref[r])); }
        u32 errors = 0;
        std::vector<float> t[5];
        if (ok) {
            for (int i = 0; i < reps + 3; ++i)
                for (int mode = 0; mode < 5; ++mode) {
                    for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize()); }
                    launch(mode, i % 2);
                    float ms = finish();
                    if (i >= 3) t[mode].push_back(ms);
                }
            for (int r = 0; r < world; ++r) {
                u32 e; CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize()); CK(cudaMemcpy(&e, R[r].error, 4, cudaMemcpyDeviceToHost)); errors |= e;
            }
        }
        ok &= errors == 0;
        all_ok &= ok;
        char line[320];
        if (ok) {
            double ce = median(t[0]), comm = median(t[1]), rs = median(t[2]), alone = median(t[3]), once = median(t[4]);
            double bytes = 2.0 * (world - 1) * rows * (double)n;  // what each rank sends
            snprintf(line, sizeof line, "%5d %5d %5d | %d | %d | %7.1f %7.1f %7.1f | %7.1f | %7.1f (%3.0f GB/s) | %5.3f %5.3f | %5.3f | %.1e %.1e %.1e ok",
                     sh.m, sh.k, sh.n, world, chunks, ce * 1e3, once * 1e3, rs * 1e3, alone * 1e3, comm * 1e3, bytes / comm / 1e6,
                     ce / alone, ce / std::max(alone, comm), rs / alone, rel_ce, rel_once, rel_rs);
        } else {
            snprintf(line, sizeof line, "%5d %5d %5d | %d | %d | FAILED (rel %.1e / %.1e / %.1e, errors %u)", sh.m, sh.k, sh.n, world, chunks,
                     rel_ce, rel_once, rel_rs, errors);
        }
        puts(line); fflush(stdout);
        table.push_back(line);
        for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(r));
            CK(cudaDeviceSynchronize());
            Rank& q = R[r];
            for (int s = 0; s < 2; ++s) { CK(cudaFree(q.a[s])); CK(cudaFree(q.b[s])); }
            CK(cudaFree(q.out)); CK(cudaFree(q.scratch)); CK(cudaFree(q.recv));
            CK(cudaFree(q.counters)); CK(cudaFree(q.arrive)); CK(cudaFree(q.error));
            CK(cudaFree(q.ready)); CK(cudaFree(q.done));
        }
    }
    printf("\n    M     K     N | D | chunks | RS by copy engines (tiles counted a tile later / at once), storer-warp RS (us) | GEMM alone | CE comm alone (K = 0) | CE over GEMM alone, over max(GEMM, comm) | storer RS over GEMM alone | rel err vs f32 (CE, CE at once, storer)\n");
    for (auto& l : table) puts(l.c_str());
    printf("%s\n", all_ok ? "ALL CORRECT" : "SOME FAILED");
    return all_ok ? 0 : 1;
}
