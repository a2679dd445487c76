// What the GEMM+ReduceScatter checks share (rs_harness.cu): the f32
// reference and the error of a rank's block against it. Included after common.cuh.
#pragma once

__global__ void add_f32(float* dst, const float* src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

// sum (x - r)^2, sum r^2, non-finite count; x in 16-bit, r in f32
__global__ void compare_f32(const u16* x, const float* r, size_t n, bool f16, double* out) {
    double se = 0, sr = 0, bad = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float a = to_f32(x[i], f16), b = r[i];
        if (!isfinite(a)) { bad += 1; continue; }
        se += (double)(a - b) * (a - b);
        sr += (double)b * b;
    }
    atomicAdd(&out[0], se); atomicAdd(&out[1], sr); atomicAdd(&out[2], bad);
}

// The f32 reference of a GEMM+ReduceScatter of bf16 operands: every rank's cuBLAS f32
// partial A_r [m, kl] B_r [kl, n] (input set 0: `a[0]`, `b[0]`, on its handle `h` and stream
// `s`), summed block by block at the owner: element j holds rank j's rows [j m / D,
// (j + 1) m / D), on device j. The caller frees them.
template <class Rank>
static std::vector<float*> rs_reference(std::vector<Rank>& R, int m, int kl, int n) {
    int world = (int)R.size(), rows = m / world;
    size_t nout = (size_t)rows * n;
    std::vector<float*> ref(world), part(world), tmp(world);
    for (int r = 0; r < world; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaMalloc(&part[r], (size_t)m * n * 4));
        CK(cudaMalloc(&ref[r], nout * 4)); CK(cudaMemset(ref[r], 0, nout * 4));
        CK(cudaMalloc(&tmp[r], nout * 4));
        float one = 1.f, zero = 0.f;
        CB(cublasGemmEx(R[r].h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, kl, &one, R[r].b[0], CUDA_R_16BF, n,
                        R[r].a[0], CUDA_R_16BF, kl, &zero, part[r], CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        CK(cudaStreamSynchronize(R[r].s));
    }
    for (int j = 0; j < world; ++j)
        for (int s = 0; s < world; ++s) {
            CK(cudaMemcpyPeer(tmp[j], j, part[s] + (size_t)j * rows * n, s, nout * 4));
            CK(cudaSetDevice(j));
            add_f32<<<264, 256>>>(ref[j], tmp[j], nout);
            CK(cudaDeviceSynchronize());
        }
    for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaFree(part[r])); CK(cudaFree(tmp[r])); }
    return ref;
}

// On the current device: the relative error of bf16 `out` against `ref` (n elements), and
// how many of its elements are not finite (left unwritten: the checks poison outputs first).
static void rs_error(const u16* out, const float* ref, size_t n, double* rel, double* unwritten) {
    double* d; CK(cudaMalloc(&d, 24)); CK(cudaMemset(d, 0, 24));
    compare_f32<<<264, 256>>>(out, ref, n, false, d);
    double h[3]; CK(cudaMemcpy(h, d, 24, cudaMemcpyDeviceToHost)); CK(cudaFree(d));
    *rel = sqrt(h[0] / h[1]);
    *unwritten = h[2];
}

// The storer-warp GEMM+ReduceScatter's arguments (gemm.cu's RsArgs) for rank `r` of `R`
// (every rank's `out`, `ready`, `done`; its `error`), call `epoch`, a 10 s wait bound;
// `interleave`: the owners in turn tile by tile (RsArgs::interleave).
template <class Rank>
static RsArgs storer_rs_args(std::vector<Rank>& R, int r, int rows, u32 epoch, bool interleave = false) {
    RsArgs a;
    memset(&a, 0, sizeof a);
    for (int j = 0; j < (int)R.size(); ++j) {
        a.outs[j] = (u64)R[j].out;
        a.ready[j] = (u64)R[j].ready;
        a.done[j] = (u64)R[j].done;
    }
    a.error = (u64)R[r].error;
    a.timeout_ns = 10ull * 1000 * 1000 * 1000;
    a.rank = r; a.world = (int)R.size(); a.rows_per = rows; a.epoch = epoch;
    a.interleave = interleave ? 1 : 0;
    return a;
}

// One call of `mode` (`launch(mode, 0)`: input set 0) on every rank, its blocks against the
// reference `ref`: the worst relative error over the ranks in `rel`; true when no wait
// timed out (every rank's `error` word), nothing was left unwritten (`out` is poisoned
// first) and the error is under 1e-2.
template <class Rank, class Launch>
static bool rs_check(std::vector<Rank>& R, Launch launch, int mode, size_t nout, const std::vector<float*>& ref, double* rel) {
    int world = (int)R.size();
    for (int r = 0; r < world; ++r) { CK(cudaSetDevice(r)); CK(cudaMemset(R[r].out, 0xFF, nout * 2)); CK(cudaDeviceSynchronize()); }
    launch(mode, 0);
    slowest_ms(R);
    u32 errors = 0;
    double unwritten = 0;
    *rel = 0;
    for (int j = 0; j < world; ++j) {
        CK(cudaSetDevice(j));
        CK(cudaDeviceSynchronize());
        u32 e; CK(cudaMemcpy(&e, R[j].error, 4, cudaMemcpyDeviceToHost)); errors |= e;
        double rel_j, unwritten_j;
        rs_error(R[j].out, ref[j], nout, &rel_j, &unwritten_j);
        *rel = std::max(*rel, rel_j);
        unwritten += unwritten_j;
    }
    if (errors) printf("  mode %d: a wait timed out (error word %u)\n", mode, errors);
    if (unwritten) printf("  mode %d: %.0f elements unwritten\n", mode, unwritten);
    return errors == 0 && unwritten == 0 && *rel < 1e-2;
}
