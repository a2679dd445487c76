// What the Hopper GEMM's standalone checks share: error checks, random 16-bit inputs,
// 16-bit to f32, tensor maps, medians. Included after gemm.cu (its TensorMap, u16, u32).
#pragma once
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CB(x) do { cublasStatus_t e_ = (x); if (e_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d %s: cublas %d\n", __FILE__, __LINE__, #x, (int)e_); exit(1); } } while (0)
#define CD(x) do { CUresult e_ = (x); if (e_ != CUDA_SUCCESS) { const char* s_; cuGetErrorString(e_, &s_); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); exit(1); } } while (0)

__global__ void fill_random(u16* p, size_t n, u32 seed, bool f16) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        u32 x = (u32)i * 2654435761u ^ seed;
        x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16;
        float f = ((x & 0xFFFFFF) / 16777216.0f) * 2.f - 1.f;
        u16 h;
        if (f16) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        else asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
        p[i] = h;
    }
}

__device__ __host__ inline float to_f32(u16 h, bool f16) {
    if (!f16) { u32 u = ((u32)h) << 16; float f; memcpy(&f, &u, 4); return f; }
    // f16 -> f32 by hand (host and device alike)
    u32 s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = ldexpf((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexpf((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}

// A 2-D row-major map: `inner` elements per row (contiguous), `outer` rows, `ld` elements apart.
static TensorMap make_map(const void* base, u64 inner, u64 outer, u64 ld, u32 box_inner, u32 box_outer, bool f16) {
    CUtensorMap m;
    cuuint64_t dims[2] = {inner, outer};
    cuuint64_t strides[1] = {ld * 2};
    cuuint32_t box[2] = {box_inner, box_outer};
    cuuint32_t es[2] = {1, 1};
    CD(cuTensorMapEncodeTiled(&m, f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                              (void*)base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
    TensorMap t;
    memcpy(&t, &m, sizeof t);
    return t;
}

static double median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

// The slowest rank's milliseconds between its events `e0` and `e1`, once every rank's `e1`
// has passed.
template <class Rank>
static float slowest_ms(std::vector<Rank>& R) {
    float worst = 0;
    for (int r = 0; r < (int)R.size(); ++r) {
        CK(cudaSetDevice(r));
        CK(cudaEventSynchronize(R[r].e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, R[r].e0, R[r].e1));
        worst = std::max(worst, ms);
    }
    return worst;
}

static u32 g_seed = 12345;
static void fill(u16* p, size_t n, bool f16) { fill_random<<<1024, 256>>>(p, n, g_seed++ * 7919u, f16); CK(cudaGetLastError()); }


// sum (x - r)^2, sum r^2, non-finite count
__global__ void compare(const u16* x, const u16* r, size_t n, bool f16, double* out) {
    double se = 0, sr = 0, bad = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float a = to_f32(x[i], f16), b = to_f32(r[i], f16);
        if (!isfinite(a)) { bad += 1; continue; }
        se += (double)(a - b) * (a - b);
        sr += (double)b * b;
    }
    atomicAdd(&out[0], se); atomicAdd(&out[1], sr); atomicAdd(&out[2], bad);
}

// The first `world` GPUs (at most the command line's first argument, and MAXR) with peer
// access between every pair, printed; `sms`: the first one's SM count. Exits with a
// message where that fails.
static int open_world(int argc, char** argv, int* sms) {
    int world = 0;
    CK(cudaGetDeviceCount(&world));
    if (argc > 1) world = std::min(world, atoi(argv[1]));
    if (world < 1 || world > MAXR) { fprintf(stderr, "need 1..%d GPUs\n", MAXR); exit(2); }
    for (int r = 0; r < world; ++r) {
        CK(cudaSetDevice(r));
        for (int p = 0; p < world; ++p)
            if (p != r) {
                cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
                if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
                    fprintf(stderr, "peer access %d->%d: %s\n", r, p, cudaGetErrorString(e));
                    exit(2);
                }
            }
    }
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    *sms = prop.multiProcessorCount;
    printf("%d x %s\n", world, prop.name);
    return world;
}
