// Comparing two tensors of one shape on the device (`Device::discrepancy`): each block sums,
// in double, the squared differences and the squared reference over a grid-stride share of
// the elements and writes the two sums to `partials[2 * block]` and `[2 * block + 1]`; the
// host adds the blocks' sums. A NaN or infinite element makes its block's first sum NaN or
// infinite (double holds the square of any f32), so the host sees it.
//
// Both operands are contiguous and of one element type, from a `#define` prepended by the
// host: DT_F32, DT_BF16, DT_F16.
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
#define BLOCK 256

#if defined(DT_F32)
typedef float E;
__device__ __forceinline__ double ld(E x) { return (double)x; }
#elif defined(DT_BF16)
typedef u16 E;
__device__ __forceinline__ double ld(E h) { return (double)__uint_as_float(((u32)h) << 16); }
#else
typedef u16 E;
__device__ __forceinline__ double ld(E h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return (double)f;
}
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
fusion_discrepancy(const E* got, const E* want, u64 n, double* partials) {
    double err = 0.0, ref = 0.0;
    for (u64 i = (u64)blockIdx.x * BLOCK + threadIdx.x; i < n; i += (u64)gridDim.x * BLOCK) {
        double y = ld(want[i]);
        double d = ld(got[i]) - y;
        err += d * d;
        ref += y * y;
    }
    __shared__ double s_err[BLOCK];
    __shared__ double s_ref[BLOCK];
    s_err[threadIdx.x] = err;
    s_ref[threadIdx.x] = ref;
    __syncthreads();
    for (u32 half = BLOCK / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) {
            s_err[threadIdx.x] += s_err[threadIdx.x + half];
            s_ref[threadIdx.x] += s_ref[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partials[2 * blockIdx.x] = s_err[0];
        partials[2 * blockIdx.x + 1] = s_ref[0];
    }
}
