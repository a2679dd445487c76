// Checks and times the Hopper GEMM fed by an AllGather (gemm.cu's `HOPPER_GEMM_AG`) on D
// GPUs of one process: rank r holds A_r [M/D, K] and B [K, N]; C = AG(A) B lands on every
// rank. The copy engines pull the peers' row blocks into the gathered buffer while the GEMM
// runs; each copy is followed by a stream write of the call's epoch into the block's ready
// word, which the GEMM's loader waits for before it loads that block's rows. Checked
// against cuBLAS on the gathered A; timed against our GEMM and cuBLAS's on the whole
// gathered A (no communication) and the copies alone; all ranks launched together, the
// slowest rank's event time per call, medians.
// Build: bench/hopper_gemm/build.sh        Run: hopper_gemm_ag_bench [D] [reps]
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

struct Rank {
    u16 *a[2], *b[2], *gathered, *c, *ref;
    u32 *ready, *arrived, *error;
    cudaStream_t s, copy[MAXR];
    cudaEvent_t e0, e1, start, copied[MAXR];
    cublasHandle_t h;
};

int main(int argc, char** argv) {
    int sms = 0;
    int world = open_world(argc, argv, &sms);
    int reps = argc > 2 ? atoi(argv[2]) : 30;
    std::vector<Rank> R(world);
    for (int r = 0; r < world; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaFuncSetAttribute(hopper_gemm_ag_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
        CK(cudaFuncSetAttribute(hopper_gemm_bf16_nn, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
        CK(cudaStreamCreateWithFlags(&R[r].s, cudaStreamNonBlocking));
        for (int p = 0; p < MAXR; ++p) { CK(cudaStreamCreateWithFlags(&R[r].copy[p], cudaStreamNonBlocking)); CK(cudaEventCreateWithFlags(&R[r].copied[p], cudaEventDisableTiming)); }
        CK(cudaEventCreate(&R[r].e0)); CK(cudaEventCreate(&R[r].e1)); CK(cudaEventCreateWithFlags(&R[r].start, cudaEventDisableTiming));
        CB(cublasCreate(&R[r].h));
        CB(cublasSetStream(R[r].h, R[r].s));
        CK(cudaMalloc(&R[r].ready, MAXR * 8 * 4)); CK(cudaMemset(R[r].ready, 0, MAXR * 8 * 4));
        CK(cudaMalloc(&R[r].error, 4)); CK(cudaMemset(R[r].error, 0, 4));
        CK(cudaMalloc(&R[r].arrived, 4)); CK(cudaMemset(R[r].arrived, 0, 4));
    }
    // (M, K, N) of the seed rows: A [M, K] sharded on M, B [K, N] replicated.
    struct Shape { int m, k, n; } shapes[] = {{8192, 8192, 8192}, {16384, 8192, 2048}, {16384, 8192, 8192}, {4096, 4096, 4096}};
    std::vector<std::string> table;
    bool all_ok = true;
    u32 epoch = 0;
    for (auto sh : shapes) {
        int rows = sh.m / world, k = sh.k, n = sh.n;
        if (rows % BM) { printf("skip %d: rows per rank %d not a multiple of %d\n", sh.m, rows, BM); continue; }
        size_t na = (size_t)rows * k, nb = (size_t)k * n, nc = (size_t)sh.m * n;
        for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(r));
            for (int s = 0; s < 2; ++s) {
                CK(cudaMalloc(&R[r].a[s], na * 2)); fill(R[r].a[s], na, false);
                CK(cudaMalloc(&R[r].b[s], nb * 2)); fill(R[r].b[s], nb, false);
            }
            CK(cudaMalloc(&R[r].gathered, (size_t)sh.m * k * 2));
            CK(cudaMalloc(&R[r].c, nc * 2)); CK(cudaMalloc(&R[r].ref, nc * 2));
        }
        for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize()); }
        // Modes: 0 AllGather+GEMM, each rank pulling whole blocks, a copy stream per peer;
        // 1 the same in 4 pieces per block (piece 0 of every block first); 2 4 pieces pushed
        // by their owners (a copy stream per destination, the walk's order: block r - 1 first); 3 and 4 the
        // copies of 1 and 2 alone; 5 our GEMM on the gathered A alone; 6 cuBLAS's.
        const int MODES = 7;
        int timeouts[MODES] = {};
        // `fixed_epoch` (non-zero): every call carries this epoch, as calls replayed from one
        // graph do; the kernel's zeroing of the ready words at its end keeps them right.
        u32 fixed_epoch = 0;
        auto launch = [&](int mode, int set) {
            bool copies = mode <= 4, gemm_ag = mode <= 2;
            bool push = mode == 2 || mode == 4;
            int chunks = mode == 0 ? 1 : 4;
            if (copies) epoch = fixed_epoch ? fixed_epoch : epoch + 1;
            for (int r = 0; r < world; ++r) {
                CK(cudaSetDevice(r));
                u32 e; CK(cudaMemcpy(&e, R[r].error, 4, cudaMemcpyDeviceToHost));
                if (e) { ++timeouts[mode]; CK(cudaMemset(R[r].error, 0, 4)); }
                CK(cudaEventRecord(R[r].e0, R[r].s));
                CK(cudaEventRecord(R[r].start, R[r].s));
            }
            // (Every rank's buffers are free: the calls are apart, every device synchronized.)
            if (copies)
                for (int r = 0; r < world; ++r) {
                    CK(cudaSetDevice(r));
                    for (int pos = 1; pos < world; ++pos) CK(cudaStreamWaitEvent(R[r].copy[pos], R[r].start));
                }
            for (int r = 0; r < world; ++r) {
                CK(cudaSetDevice(r));
                Rank& q = R[r];
                if (copies) {
                    size_t piece = na / chunks;
                    for (int c = 0; c < chunks; ++c)
                        for (int pos = 1; pos < world; ++pos) {
                            cudaStream_t cs = q.copy[pos];
                            if (push) { // r's block to rank r + pos (which walks it at pos)
                                int p = (r + pos) % world;
                                CK(cudaMemcpyPeerAsync(R[p].gathered + (size_t)r * na + c * piece, p, q.a[set] + c * piece, r, piece * 2, cs));
                                CD(cuStreamWriteValue32((CUstream)cs, (CUdeviceptr)(R[p].ready + r * chunks + c), epoch, 0));
                            } else { // rank r - pos's block to r (the walk's order)
                                int j = (r - pos + world) % world;
                                CK(cudaMemcpyPeerAsync(q.gathered + (size_t)j * na + c * piece, r, R[j].a[set] + c * piece, j, piece * 2, cs));
                                CD(cuStreamWriteValue32((CUstream)cs, (CUdeviceptr)(q.ready + j * chunks + c), epoch, 0));
                            }
                        }
                    for (int pos = 1; pos < world; ++pos) CK(cudaEventRecord(q.copied[pos], q.copy[pos]));
                }
                TensorMap am = make_map(q.gathered, k, sh.m, k, 64, BM, false);
                TensorMap bm = make_map(q.b[set], n, k, n, 64, 64, false);
                TensorMap cm = make_map(q.c, n, sh.m, n, 64, 64, false);
                int tiles = (sh.m / BM) * ((n + BN - 1) / BN);
                if (gemm_ag) {
                    AgArgs a;
                    memset(&a, 0, sizeof a);
                    a.own = make_map(q.a[set], k, rows, k, 64, BM, false);
                    a.chunks = chunks;
                    a.ready = (u64)q.ready; a.arrived = (u64)q.arrived; a.error = (u64)q.error;
                    a.timeout_ns = 10ull * 1000 * 1000 * 1000;
                    a.rank = r; a.world = world; a.rows_per = rows; a.epoch = epoch;
                    hopper_gemm_ag_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_BYTES, q.s>>>(am, bm, cm, rows, n, k, a);
                } else if (mode == 5) {
                    hopper_gemm_bf16_nn<<<std::min(tiles, sms), THREADS, SMEM_BYTES, q.s>>>(am, bm, cm, sh.m, n, k);
                } else if (mode == 6) {
                    float one = 1.f, zero = 0.f;
                    CB(cublasGemmEx(q.h, CUBLAS_OP_N, CUBLAS_OP_N, n, sh.m, k, &one, q.b[set], CUDA_R_16BF, n,
                                    q.gathered, CUDA_R_16BF, k, &zero, q.ref, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
                }
                CK(cudaGetLastError());
            }
            // A call ends when its GEMM did (which waited for every piece) and its own copy
            // streams are done; pushed copies alone end when every push into the rank landed.
            for (int r = 0; r < world; ++r) {
                CK(cudaSetDevice(r));
                if (copies)
                    for (int x = 0; x < world; ++x)
                        if (x == r || mode == 4)
                            for (int pos = 1; pos < world; ++pos) CK(cudaStreamWaitEvent(R[r].s, R[x].copied[pos]));
                CK(cudaEventRecord(R[r].e1, R[r].s));
            }
        };
        auto finish = [&]() { return slowest_ms(R); };
        // Correctness: each way's first call against cuBLAS on the gathered A (set 0).
        double rel[3] = {0, 0, 0};
        bool ok = true;
        // Check 3 repeats way 1 with one fixed epoch, after a call on the other input set.
        for (int check = 0; check < 4; ++check) {
            int mode = check == 3 ? 1 : check;
            for (int r = 0; r < world; ++r) {
                CK(cudaSetDevice(r)); CK(cudaMemset(R[r].c, 0xFF, nc * 2)); CK(cudaMemset(R[r].gathered, 0xFF, (size_t)sh.m * k * 2));
                CK(cudaDeviceSynchronize());
            }
            if (check == 3) {
                fixed_epoch = 1;
                launch(mode, 1);
                finish();
            }
            launch(mode, 0);
            finish();
            fixed_epoch = 0;
            for (int r = 0; r < world; ++r) { // the own block, for the reference
                CK(cudaSetDevice(r));
                CK(cudaMemcpy(R[r].gathered + (size_t)r * na, R[r].a[0], na * 2, cudaMemcpyDeviceToDevice));
            }
            launch(6, 0); // cuBLAS on the gathered A, into ref
            finish();
            for (int r = 0; r < world; ++r) {
                CK(cudaSetDevice(r));
                u32 e; CK(cudaMemcpy(&e, R[r].error, 4, cudaMemcpyDeviceToHost));
                double* d; CK(cudaMalloc(&d, 24)); CK(cudaMemset(d, 0, 24));
                compare<<<264, 256>>>(R[r].c, R[r].ref, nc, false, d);
                double h[3]; CK(cudaMemcpy(h, d, 24, cudaMemcpyDeviceToHost)); CK(cudaFree(d));
                rel[mode] = std::max(rel[mode], sqrt(h[0] / h[1]));
                if (check == 3 && !(e == 0 && h[2] == 0 && sqrt(h[0] / h[1]) < 1e-2)) printf("a call with a repeated epoch went wrong\n");
                ok &= e == 0 && h[2] == 0 && sqrt(h[0] / h[1]) < 1e-2;
            }
        }
        std::vector<float> t[MODES];
        for (int i = 0; i < reps + 3; ++i)
            for (int mode = 0; mode < MODES; ++mode) {
                for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize()); }
                launch(mode, i % 2);
                float ms = finish();
                if (i >= 3) t[mode].push_back(ms);
            }
        u32 errors = 0;
        for (int r = 0; r < world; ++r) { u32 e; CK(cudaSetDevice(r)); CK(cudaMemcpy(&e, R[r].error, 4, cudaMemcpyDeviceToHost)); errors |= e; }
        for (int m = 0; m < MODES; ++m) errors += timeouts[m];
        ok &= errors == 0;
        all_ok &= ok;
        if (errors) printf("%d calls had a wait time out\n", (int)errors);
        double whole = median(t[0]), pull = median(t[1]), push = median(t[2]), comm_pull = median(t[3]);
        double comm_push = median(t[4]), alone = median(t[5]), cub = median(t[6]);
        double bound = std::max(std::min(comm_pull, comm_push), alone);
        char line[320];
        snprintf(line, sizeof line, "%5d %5d %5d | %d | %7.1f %7.1f %7.1f | %7.1f %7.1f | %7.1f %7.1f | %5.3f %5.3f %5.3f | %5.3f %5.3f %5.3f | %.1e %s",
                 sh.m, sh.k, sh.n, world, whole * 1e3, pull * 1e3, push * 1e3, alone * 1e3, cub * 1e3, comm_pull * 1e3,
                 comm_push * 1e3, whole / alone, pull / alone, push / alone, whole / bound, pull / bound, push / bound,
                 std::max(rel[0], std::max(rel[1], rel[2])), ok ? "ok" : (errors ? "WAIT TIMED OUT" : "FAIL"));
        puts(line); fflush(stdout);
        table.push_back(line);
        for (int r = 0; r < world; ++r) {
            CK(cudaSetDevice(r));
            for (int s = 0; s < 2; ++s) { CK(cudaFree(R[r].a[s])); CK(cudaFree(R[r].b[s])); }
            CK(cudaFree(R[r].gathered)); CK(cudaFree(R[r].c)); CK(cudaFree(R[r].ref));
        }
    }
    printf("\n    M     K     N | D | AG+GEMM us: pull whole blocks, pull 4 pieces, push 4 pieces | GEMM alone: ours, cuBLAS | copies alone: pull, push | over GEMM alone (3 ways) | over max(GEMM, faster copies) | rel err vs cuBLAS\n");
    for (auto& l : table) puts(l.c_str());
    printf("%s\n", all_ok ? "ALL CORRECT" : "SOME FAILED");
    return all_ok ? 0 : 1;
}
