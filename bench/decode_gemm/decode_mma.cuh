// What the decode-GEMM harnesses of this folder share (each still builds with one nvcc
// command): error checks, bf16 packing, the cp.async / ldmatrix / mma.sync helpers, and the
// main loop that streams K through a ring of shared-memory stages of 128-byte swizzled rows
// (W: BK rows of 64 columns; X: MT 16-row tiles of BK columns) into mma.sync, bf16 in, f32
// accumulation, the block's warps splitting each stage's K.
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CB(x) do { int s_ = (int)(x); if (s_ != 0) { fprintf(stderr, "%s:%d cublas status %d\n", __FILE__, __LINE__, s_); exit(1); } } while (0)

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#define BK 64
#define STAGES 8
#define THREADS 128

struct alignas(16) V4 { u32 x, y, z, w; };

__device__ __forceinline__ float bf_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ u32 bf2(float a, float b) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a)); return r;
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }
__device__ __forceinline__ void ldsm_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void mma(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A swizzled 128-byte row: chunk c (16 bytes) of row r at chunk c ^ (r & 7).
__device__ __forceinline__ u32 swz(u32 base, int r, int c) { return base + r * 128 + ((c ^ (r & 7)) << 4); }

// Stage rows k0 .. k0 + BK of X's MP rows (of M real ones, the rest zeros) into the stage at
// `xb`: MP rows of 128 bytes, 16 bytes a thread at a time.
template <int MP>
__device__ __forceinline__ void load_x(u32 xb, const u16* __restrict__ X, int M, int K, int k0, int tid) {
#pragma unroll
    for (int i = 0; i < (MP * 8 + THREADS - 1) / THREADS; ++i) {
        int q = tid + i * THREADS;
        if (q < MP * 8) {
            int r = q >> 3, c = q & 7;
            bool ok = r < M;
            cp_async16(swz(xb, r, c), X + (u64)(ok ? r : 0) * K + k0 + c * 8, ok);
        }
    }
}

// The whole K (KT stages of BK) into `acc`: `load(kt, s)` issues stage kt's cp.async copies
// into ring slot s (W at sbase + s * stage_bytes, X w_stage bytes after it); warp slice `wk`
// of WK takes K slices wk, wk + WK, .. of each stage; its NT 8-column subtiles start at
// 16-byte chunk `c0` of the W rows. Returns with every copy landed and the block synced.
template <int MT, int NT, int WK, class Load>
__device__ __forceinline__ void stream_k(float (&acc)[MT][NT][4], int KT, u32 sbase, int stage_bytes, int w_stage,
                                         Load load, int wk, int lane, int c0) {
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.f;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) { if (s < KT) load(s, s); cp_commit(); }
    for (int kt = 0; kt < KT; ++kt) {
        cp_wait<STAGES - 2>();
        __syncthreads();
        if (kt + STAGES - 1 < KT) load(kt + STAGES - 1, (kt + STAGES - 1) % STAGES);
        cp_commit();
        const u32 wb = sbase + (kt % STAGES) * stage_bytes, xb = wb + w_stage;
#pragma unroll
        for (int sl = wk; sl < BK / 16; sl += WK) {
            u32 b[NT][2];
#pragma unroll
            for (int j = 0; j < NT / 2; ++j) {
                u32 r[4];
                int krow = sl * 16 + (lane & 15), chunk = c0 + 2 * j + (lane >> 4);
                ldsm_x4_t(swz(wb, krow, chunk), r);
                b[2 * j][0] = r[0]; b[2 * j][1] = r[1]; b[2 * j + 1][0] = r[2]; b[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 a[4];
                int row = mt * 16 + (lane & 15), chunk = sl * 2 + (lane >> 4);
                ldsm_x4(swz(xb, row, chunk), a);
#pragma unroll
                for (int j = 0; j < NT; ++j) mma(acc[mt][j], a, b[j][0], b[j][1]);
            }
        }
    }
    cp_wait<0>();
    __syncthreads();
}

// n pseudo-random bf16 values in [-scale, scale), from `seed` (fresh inputs per shape).
__global__ void fill(u16* p, size_t n, unsigned seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
        float f = ((h & 0xffff) / 32768.0f - 1.0f) * scale;
        __nv_bfloat16 b = __float2bfloat16(f);
        p[i] = *(u16*)&b;
    }
}

static inline float host_bf(u16 h) { u32 w = ((u32)h) << 16; float f; memcpy(&f, &w, 4); return f; }
