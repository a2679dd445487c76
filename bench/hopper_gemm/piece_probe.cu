// What does splitting a peer copy into pieces cost? Every rank of 4 (or D) GPUs pushes its
// 64 MB block to rank + 1, rank + 2, ... in that order (each step pairs the ranks, as a P2P
// AllGather pipeline does), on one copy stream, the block whole or in P pieces; after each
// piece a stream write of a word in the receiver's memory (as a "rows ready" signal), and
// optionally a stream wait for an already-set word of the sender before each piece (as a
// hand-off's "buffer ready" take). Also the blocks on a copy stream per peer, all at once.
// The slowest rank's event time of the whole sequence, medians of 20; a spinner kernel on
// rank 0 records when each piece's word became set (landing times, ms after the start).
// Build: nvcc -O3 -arch=sm_90a piece_probe.cu -lcuda -o piece_probe      Run: piece_probe [D]
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CD(x) do { CUresult e_ = (x); if (e_ != CUDA_SUCCESS) { const char* s_; cuGetErrorString(e_, &s_); printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)

typedef unsigned int u32;
typedef unsigned long long u64;

// Records, for each of `n` words, the globaltimer when it first held `value` (relative to
// the kernel's start), until all did or 20 ms passed.
__global__ void spin(volatile u32* words, int n, u32 value, u64* stamps) {
    u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    int left = n;
    for (int i = 0; i < n; ++i) stamps[i] = 0;
    while (left > 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > 20000000ull) break;
        for (int i = 0; i < n; ++i)
            if (!stamps[i] && words[i] == value) { stamps[i] = t - t0; --left; }
    }
}

int main(int argc, char** argv) {
    int D = argc > 1 ? atoi(argv[1]) : 4;
    int reps = 20;
    const size_t block = 64ull << 20;
    CD(cuInit(0));
    std::vector<char*> src(D), dst(D);
    std::vector<u32*> words(D), local(D);
    std::vector<u64*> stamps(D);
    std::vector<cudaStream_t> one(D), spin_s(D);
    std::vector<std::vector<cudaStream_t>> per(D, std::vector<cudaStream_t>(D));
    std::vector<cudaEvent_t> e0(D), e1(D), go(D);
    for (int r = 0; r < D; ++r) {
        CK(cudaSetDevice(r));
        for (int p = 0; p < D; ++p) if (p != r) CK(cudaDeviceEnablePeerAccess(p, 0));
        CK(cudaMalloc(&src[r], block)); CK(cudaMemset(src[r], r + 1, block));
        CK(cudaMalloc(&dst[r], block * D));
        CK(cudaMalloc(&words[r], 4 * 64)); CK(cudaMemset(words[r], 0, 4 * 64));
        CK(cudaMalloc(&local[r], 4)); CK(cudaMemset(local[r], 0xFF, 4));
        CK(cudaMalloc(&stamps[r], 8 * 64));
        CK(cudaStreamCreateWithFlags(&one[r], cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&spin_s[r], cudaStreamNonBlocking));
        for (int p = 0; p < D; ++p) CK(cudaStreamCreateWithFlags(&per[r][p], cudaStreamNonBlocking));
        CK(cudaEventCreate(&e0[r])); CK(cudaEventCreate(&e1[r])); CK(cudaEventCreateWithFlags(&go[r], cudaEventDisableTiming));
    }
    struct Way { const char* name; int pieces; bool signal, take, per_peer; };
    Way ways[] = {
        {"one stream, whole blocks", 1, false, false, false},
        {"one stream, whole blocks + signal", 1, true, false, false},
        {"one stream, 2 pieces + signals", 2, true, false, false},
        {"one stream, 4 pieces + signals", 4, true, false, false},
        {"one stream, 8 pieces + signals", 8, true, false, false},
        {"one stream, 16 pieces + signals", 16, true, false, false},
        {"one stream, 4 pieces, no signals", 4, false, false, false},
        {"one stream, 4 pieces + take + signals", 4, true, true, false},
        {"stream per peer, whole, at once", 1, true, false, true},
    };
    u32 value = 0;
    printf("D = %d, 64 MB per block, each rank pushes to rank+1, rank+2, ... in order\n", D);
    printf("%-40s %9s %9s  landing on rank 0 (ms): first piece, each block's last piece\n", "way", "ms", "GB/s in");
    for (const Way& w : ways) {
        std::vector<float> times;
        std::vector<u64> land(64, 0);
        int n = (D - 1) * w.pieces;
        for (int it = 0; it < reps + 2; ++it) {
            ++value;
            for (int r = 0; r < D; ++r) { CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize()); }
            // rank 0's spinner first, then every rank's copies
            CK(cudaSetDevice(0));
            spin<<<1, 1, 0, spin_s[0]>>>(words[0], n, value, stamps[0]);
            for (int r = 0; r < D; ++r) {
                CK(cudaSetDevice(r));
                CK(cudaEventRecord(e0[r], one[r]));
                CK(cudaEventRecord(go[r], one[r]));
                size_t piece = block / w.pieces;
                for (int s = 1; s < D; ++s) {
                    int to = (r + s) % D;
                    cudaStream_t cs = one[r];
                    if (w.per_peer) { cs = per[r][to]; CK(cudaStreamWaitEvent(cs, go[r])); }
                    for (int c = 0; c < w.pieces; ++c) {
                        if (w.take) CD(cuStreamWaitValue32((CUstream)cs, (CUdeviceptr)local[r], 0xFFFFFFFFu, CU_STREAM_WAIT_VALUE_EQ));
                        CD(cuMemcpyAsync((CUdeviceptr)(dst[to] + (size_t)r * block + c * piece), (CUdeviceptr)(src[r] + c * piece), piece, (CUstream)cs));
                        // the receiver's word of (block from r, piece c): index (step at the receiver) * pieces + c
                        int word = ((to - r + D) % D - 1) * w.pieces + c;
                        if (w.signal) CD(cuStreamWriteValue32((CUstream)cs, (CUdeviceptr)(words[to] + word), value, 0));
                    }
                    if (w.per_peer) { cudaEvent_t done; CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming)); CK(cudaEventRecord(done, cs)); CK(cudaStreamWaitEvent(one[r], done)); CK(cudaEventDestroy(done)); }
                }
                CK(cudaEventRecord(e1[r], one[r]));
            }
            float worst = 0;
            for (int r = 0; r < D; ++r) {
                CK(cudaSetDevice(r)); CK(cudaDeviceSynchronize());
                float ms; CK(cudaEventElapsedTime(&ms, e0[r], e1[r])); worst = std::max(worst, ms);
            }
            if (it >= 2) times.push_back(worst);
            if (it == reps + 1 && w.signal) { CK(cudaSetDevice(0)); CK(cudaMemcpy(land.data(), stamps[0], 8 * n, cudaMemcpyDeviceToHost)); }
        }
        std::sort(times.begin(), times.end());
        float med = times[times.size() / 2];
        printf("%-40s %9.3f %9.1f ", w.name, med, (D - 1) * block / (med * 1e-3) / 1e9);
        if (w.signal) {
            printf(" %.3f |", land[0] * 1e-6);
            for (int s = 0; s < D - 1; ++s) printf(" %.3f", land[(s + 1) * w.pieces - 1] * 1e-6);
        }
        printf("\n");
        fflush(stdout);
    }
    return 0;
}
