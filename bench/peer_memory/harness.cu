// The peer-memory Allreduce kernels of the runtime (`source.cu`, bf16) on every GPU of one
// process, each kernel at each size: checked bit for bit against a host sum in rank order,
// then timed as the runtime's decode benchmark times its calls (50 calls captured in one
// CUDA graph per GPU, the graphs of all GPUs launched together, slowest GPU's time per call,
// median of 20 samples). Workspaces and flags laid out as the runtime lays them out.
//
//   flagged     `peer_allreduce_ll`: data travels with its flags (no flag round trip),
//               each thread waiting for the ranks' packets one rank after another;
//   at_once     `peer_allreduce_ll_at_once`: the same, every rank's packet loaded at once;
//   ll_two      `peer_allreduce_ll_two_shot`: two shots, the data beside its flags in both;
//   one_shot    `peer_allreduce_one_shot`: the input pushed to every peer's workspace;
//   two_shot    `peer_allreduce_two_shot`: parts pushed to their owners, sums pushed back;
//   direct      `peer_allreduce_direct` (`allreduce_direct<U>`): the owner of each part
//               reads it from every rank's input and stores the sum into every rank's
//               output, U vectors per thread at a time (the runtime's kernel: U = 2), on
//               2, 4 and 8 ranks with every rank's loads in flight at once;
//   direct_rt   the same with the ranks' loads one rank after another (the kernel before
//               the world size became a compile-time parameter).
// Columns marked xN run N times the runtime's blocks for that size (at most 128), /N a
// N-th of them (at least 1); tT blocks of T threads (the runtime's: 512). The flagged
// kernels' loops stride by the block, so any multiple of 32 of at least the world size
// runs them.
//
// Build: nvcc -O3 -std=c++17 -arch=sm_90 harness.cu -o peer_allreduce_bench
// Run:   peer_allreduce_bench [devices]
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

// -DPEER_SOURCE='"path"' builds it over another version of the kernels (-DBASELINE: one
// from before `allreduce_direct` took the world size as a compile-time parameter).
#define DT_BF16
#ifndef PEER_SOURCE
#define PEER_SOURCE "../../fusion-runtime/src/backend/cuda/comm/peer_memory/source.cu"
#endif
#include PEER_SOURCE

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static const size_t REGION = 64ull << 20, FLAGGED = 8ull << 20, DATA_OFF = 64ull << 10;
static const size_t USABLE = REGION - FLAGGED;

static float bf(u16 h) { u32 w = ((u32)h) << 16; float f; memcpy(&f, &w, 4); return f; }
static u16 to_bf(float f) {
    u32 w; memcpy(&w, &f, 4);
    u32 lsb = (w >> 16) & 1u;
    return (u16)((w + 0x7fffu + lsb) >> 16);
}

struct Rank {
    int dev;
    cudaStream_t stream;
    char* ws;
    u16 *in, *out;
    u32* status;   // host-mapped
    u32* release;  // host-mapped
    cudaEvent_t ev0, ev1;
    cudaGraphExec_t graph = nullptr;
};

template <int U>
__global__ void __launch_bounds__(512) direct_u(const E* in, E* out, u64 n, Peers P, int rank, int world, Ctl c) {
    allreduce_direct<U>(in, out, n, P, rank, world, c);
}

template <int U>
__global__ void __launch_bounds__(512) direct_rt(const E* in, E* out, u64 n, Peers P, int rank, int world, Ctl c) {
#ifdef BASELINE
    allreduce_direct<U>(in, out, n, P, rank, world, c);
#else
    allreduce_direct<U, false>(in, out, n, P, rank, world, c);
#endif
}

static unsigned grid_for(size_t bytes) {
    size_t g = (bytes + (32 << 10) - 1) / (32 << 10);
    return (unsigned)std::min<size_t>(std::max<size_t>(g, 8), 128);
}

// kind: 0 flagged, 1 one shot, 2 two shots, 3 direct U=1, 4 direct U=2, 5 direct U=4,
// 6 flagged, every rank's packet at once; 7 flagged two shots; 8 direct, ranks in turn, U=2;
// grid: the runtime's blocks times this (at most 128), or divided by minus this.
struct Variant { const char* name; int kind; int grid; int threads = 512; };

static bool fits(int kind, size_t bytes, int world) {
    switch (kind) {
    case 0: case 6: return world * ((bytes + 7) / 8) * 16 <= FLAGGED;
    case 7: { size_t packets = (bytes + 7) / 8; return 2 * world * ((packets + world - 1) / world) * 16 <= FLAGGED; }
    case 1: return world * ((bytes + 15) / 16 * 16) <= USABLE;
    default: return true;
    }
}

static void launch(Rank& r, const Variant& v, size_t n, Peers P, int rank, int world, Ctl c, unsigned grid) {
    dim3 g(grid), b(v.threads);
    switch (v.kind) {
    case 0: peer_allreduce_ll<<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    case 1: peer_allreduce_one_shot<<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    case 2: peer_allreduce_two_shot<<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    case 3: direct_u<1><<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    case 4: peer_allreduce_direct<<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    case 5: direct_u<4><<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    case 6: peer_allreduce_ll_at_once<<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    case 7: peer_allreduce_ll_two_shot<<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    case 8: direct_rt<2><<<g, b, 0, r.stream>>>(r.in, r.out, n, P, rank, world, c); break;
    }
}

int main(int argc, char** argv) {
    int world = 0;
    CK(cudaGetDeviceCount(&world));
    if (argc > 1) world = std::min(world, atoi(argv[1]));
    if (world < 2) { fprintf(stderr, "needs 2 GPUs or more\n"); return 1; }
    const size_t maxb = 64ull << 20, maxn = maxb / 2;
    std::vector<Rank> ranks(world);
    Peers P{};
    for (int d = 0; d < world; ++d) {
        Rank& r = ranks[d];
        r.dev = d;
        CK(cudaSetDevice(d));
        for (int o = 0; o < world; ++o) if (o != d) CK(cudaDeviceEnablePeerAccess(o, 0));
        CK(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking));
        CK(cudaMalloc(&r.ws, DATA_OFF + 2 * REGION));
        CK(cudaMemset(r.ws, 0, DATA_OFF + 2 * REGION));
        CK(cudaMalloc(&r.in, maxb));
        CK(cudaMalloc(&r.out, maxb));
        CK(cudaHostAlloc(&r.status, 16, cudaHostAllocMapped | cudaHostAllocPortable));
        CK(cudaHostAlloc(&r.release, 4, cudaHostAllocMapped | cudaHostAllocPortable));
        memset(r.status, 0, 16); *r.release = 0;
        CK(cudaEventCreate(&r.ev0)); CK(cudaEventCreate(&r.ev1));
        P.ws[d] = (u64)r.ws;
    }
    // Fresh random inputs on every rank (the same for the whole run; every call sums them).
    std::vector<std::vector<u16>> host(world, std::vector<u16>(maxn));
    unsigned seed = 12345;
    for (int d = 0; d < world; ++d) {
        for (size_t i = 0; i < maxn; ++i) {
            seed = seed * 1664525u + 1013904223u;
            host[d][i] = to_bf(((seed >> 8) & 0xffff) / 32768.0f - 1.0f);
        }
        CK(cudaSetDevice(d));
        CK(cudaMemcpy(ranks[d].in, host[d].data(), maxb, cudaMemcpyHostToDevice));
    }
    auto ctl = [&](int d) {
        Ctl c;
        u32* sd; u32* rd;
        CK(cudaHostGetDevicePointer((void**)&sd, ranks[d].status, 0));
        CK(cudaHostGetDevicePointer((void**)&rd, ranks[d].release, 0));
        c.status = (u64)sd; c.release = (u64)rd; c.timeout_ns = 10ull * 1000000000ull;
        c.data_offset = DATA_OFF; c.half_bytes = REGION; c.usable_bytes = USABLE;
        return c;
    };
    const Variant variants[] = {{"flagged", 0, 1}, {"flag_x4", 0, 4}, {"at_once", 6, 1}, {"at_once_x4", 6, 4},
                                {"at_once_x2", 6, 2}, {"ao_x4_t256", 6, 4, 256}, {"ao_x4_t128", 6, 4, 128},
                                {"ll_two", 7, 1}, {"ll_two_x4", 7, 4},
                                {"one_shot", 1, 1}, {"one_x4", 1, 4},
                                {"two_shot", 2, 1}, {"direct_rt", 8, 1},
                                {"direct_u1", 3, 1}, {"direct_u2", 4, 1}, {"direct_u4", 5, 1},
                                {"dir_u1_x2", 3, 2}, {"dir_u1_x4", 3, 4}, {"dir_u2_x2", 4, 2},
                                {"dir_u2_/2", 4, -2}, {"dir_u4_/2", 5, -2}, {"dir_u4_/4", 5, -4}};
    auto grid = [](const Variant& v, size_t bytes) {
        return v.grid > 0 ? std::min(128u, grid_for(bytes) * v.grid) : std::max(1u, grid_for(bytes) / (unsigned)-v.grid);
    };
    const size_t sizes[] = {4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10,
                            1 << 20, 2 << 20, 4 << 20, 16 << 20, 64 << 20};
    // Check: odd and even sizes, every kernel.
    int bad = 0;
    for (const Variant& v : variants) {
        for (size_t n : {(size_t)1, (size_t)999, (size_t)4096, (size_t)65537, (size_t)300001, (size_t)1 << 21}) {
            if (!fits(v.kind, n * 2, world)) continue;
            for (int d = 0; d < world; ++d) {
                CK(cudaSetDevice(d));
                CK(cudaMemsetAsync(ranks[d].out, 0xff, n * 2, ranks[d].stream));
                launch(ranks[d], v, n, P, d, world, ctl(d), grid(v, n * 2));
            }
            for (int d = 0; d < world; ++d) { CK(cudaSetDevice(d)); CK(cudaStreamSynchronize(ranks[d].stream)); }
            size_t wrong = 0;
            std::vector<u16> got(n);
            for (int d = 0; d < world; ++d) {
                CK(cudaSetDevice(d));
                CK(cudaMemcpy(got.data(), ranks[d].out, n * 2, cudaMemcpyDeviceToHost));
                for (size_t i = 0; i < n; ++i) {
                    float acc = 0.f;
                    for (int q = 0; q < world; ++q) acc += bf(host[q][i]);
                    if (got[i] != to_bf(acc)) ++wrong;
                }
            }
            if (wrong) { printf("check %s n=%zu: %zu wrong\n", v.name, n, wrong); ++bad; }
        }
    }
    printf("check: %s\n", bad ? "FAILED" : "every kernel bit-identical to the rank-order sum on every rank");
    const int CALLS = 50, SAMPLES = 20;
    printf("%-9s", "bytes");
    for (const Variant& v : variants) printf(" %10s", v.name);
    printf("   (us per call, slowest GPU, median of %d graphs of %d calls, %d GPUs)\n", SAMPLES, CALLS, world);
    for (size_t bytes : sizes) {
        size_t n = bytes / 2;
        printf("%-9zu", bytes);
        for (const Variant& v : variants) {
            if (!fits(v.kind, bytes, world)) { printf(" %10s", "-"); continue; }
            for (int d = 0; d < world; ++d) {
                Rank& r = ranks[d];
                CK(cudaSetDevice(d));
                cudaGraph_t g;
                CK(cudaStreamBeginCapture(r.stream, cudaStreamCaptureModeThreadLocal));
                for (int i = 0; i < CALLS; ++i) launch(r, v, n, P, d, world, ctl(d), grid(v, bytes));
                CK(cudaStreamEndCapture(r.stream, &g));
                if (r.graph) CK(cudaGraphExecDestroy(r.graph));
                CK(cudaGraphInstantiate(&r.graph, g, 0));
                CK(cudaGraphDestroy(g));
            }
            std::vector<double> samples;
            for (int s = 0; s < SAMPLES + 2; ++s) {
                for (int d = 0; d < world; ++d) {
                    CK(cudaSetDevice(d));
                    CK(cudaEventRecord(ranks[d].ev0, ranks[d].stream));
                    CK(cudaGraphLaunch(ranks[d].graph, ranks[d].stream));
                    CK(cudaEventRecord(ranks[d].ev1, ranks[d].stream));
                }
                double worst = 0;
                for (int d = 0; d < world; ++d) {
                    CK(cudaSetDevice(d));
                    CK(cudaEventSynchronize(ranks[d].ev1));
                    float ms; CK(cudaEventElapsedTime(&ms, ranks[d].ev0, ranks[d].ev1));
                    worst = std::max(worst, (double)ms);
                }
                if (s >= 2) samples.push_back(worst * 1000.0 / CALLS);
            }
            std::sort(samples.begin(), samples.end());
            printf(" %10.2f", samples[samples.size() / 2]);
            fflush(stdout);
        }
        printf("\n");
    }
    for (int d = 0; d < world; ++d) if (ranks[d].status[0]) { printf("rank %d: a wait timed out\n", d); bad = 1; }
    return bad ? 1 : 0;
}
