// Does a peer copy need SMs? Times a 128 MB copy from GPU 1 to GPU 0 three ways
// (cuMemcpyAsync with unified addresses, cuMemcpyPeerAsync, and the first one recorded in
// a CUDA graph), on a copy stream of each GPU, alone and while a kernel holds every SM of
// both GPUs (one block per SM, all of its shared memory, spinning for a fixed time).
// Build: nvcc -O3 -arch=sm_90a copy_probe.cu -lcuda -o copy_probe      Run: copy_probe
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); return 1; } } while (0)
#define CD(x) do { CUresult e_ = (x); if (e_ != CUDA_SUCCESS) { const char* s_; cuGetErrorString(e_, &s_); printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_); return 1; } } while (0)

__global__ void hold(unsigned long long ns) {
    extern __shared__ char smem[];
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); smem[threadIdx.x] = (char)t; } while (t - t0 < ns);
}

int main() {
    const size_t bytes = 128ull << 20;
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int smem;
    CK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
    void *src, *dst;
    cudaStream_t cs[2], ks[2];
    for (int d = 0; d < 2; ++d) {
        CK(cudaSetDevice(d));
        CK(cudaDeviceEnablePeerAccess(1 - d, 0));
        CK(cudaStreamCreateWithFlags(&cs[d], cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&ks[d], cudaStreamNonBlocking));
        CK(cudaFuncSetAttribute(hold, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    CK(cudaSetDevice(1)); CK(cudaMalloc(&src, bytes)); CK(cudaMemset(src, 1, bytes));
    CK(cudaSetDevice(0)); CK(cudaMalloc(&dst, bytes));
    printf("%d SMs, %d bytes of shared memory per block; 128 MB from GPU 1 to GPU 0, ms:\n", sms, smem);
    const char* ways[] = {"cuMemcpyAsync (unified)", "cuMemcpyPeerAsync", "cuMemcpyAsync in a graph"};
    for (int way = 0; way < 3; ++way)
        for (int side = 0; side < 2; ++side)   // the copy's stream on GPU 1 (sender) or 0 (receiver)
            for (int busy = 0; busy < 2; ++busy) {
                std::vector<float> ts;
                for (int rep = 0; rep < 7; ++rep) {
                    for (int d = 0; d < 2; ++d) { CK(cudaSetDevice(d)); CK(cudaDeviceSynchronize()); }
                    if (busy)
                        for (int d = 0; d < 2; ++d) {
                            CK(cudaSetDevice(d));
                            hold<<<sms, 128, smem, ks[d]>>>(40ull * 1000 * 1000);
                            CK(cudaGetLastError());
                        }
                    int dev = side == 0 ? 1 : 0;
                    CK(cudaSetDevice(dev));
                    cudaStream_t s = cs[dev];
                    cudaEvent_t a, b;
                    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
                    cudaGraphExec_t exec = nullptr;
                    if (way == 2) {
                        cudaGraph_t g;
                        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
                        CD(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes, s));
                        CK(cudaStreamEndCapture(s, &g));
                        CK(cudaGraphInstantiate(&exec, g, 0));
                        CK(cudaGraphDestroy(g));
                    }
                    CK(cudaEventRecord(a, s));
                    if (way == 0) CD(cuMemcpyAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes, s));
                    if (way == 1) CK(cudaMemcpyPeerAsync(dst, 0, src, 1, bytes, s));
                    if (way == 2) CK(cudaGraphLaunch(exec, s));
                    CK(cudaEventRecord(b, s));
                    CK(cudaEventSynchronize(b));
                    float ms; CK(cudaEventElapsedTime(&ms, a, b));
                    if (rep > 1) ts.push_back(ms);
                    CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
                    if (exec) CK(cudaGraphExecDestroy(exec));
                }
                std::sort(ts.begin(), ts.end());
                printf("%-26s stream on GPU %d, %s: %8.3f ms\n", ways[way], side == 0 ? 1 : 0,
                       busy ? "every SM held  " : "SMs free       ", ts[ts.size() / 2]);
            }
    return 0;
}
