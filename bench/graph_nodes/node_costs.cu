// What a CUDA graph's nodes between small kernels cost the graph: 40 small kernels in a chain,
// (0) on fixed buffers, (1) each writing a fresh cudaMallocAsync'd buffer and freeing the one
// before (candle's allocations inside a capture: memory nodes), (2) an external event record
// after each kernel (what `candle_llama --graph --sections` records at its marks), (3) each
// kernel as a child graph node (how a recorded call's graph enters a caller's), (4) kernels
// with programmatic dependent launch. Prints the median us per replay of 300, and per kernel.
// Build and run on a GPU machine: nvcc -O2 -arch=sm_90 -o node_costs node_costs.cu && ./node_costs
// Results: bench/results/2026-11-27-0425-candle-decode-blocks-h100x4/README.md.
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)
__global__ void step(const float* in, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * 0.5f + 1.0f;
}
int main() {
  const int n = 4096, kernels = 40, reps = 300;
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float *a, *b; CK(cudaMalloc(&a, n * 4)); CK(cudaMalloc(&b, n * 4));
  CK(cudaMemset(a, 0, n * 4));
  std::vector<cudaEvent_t> evs(kernels);
  for (auto& ev : evs) CK(cudaEventCreate(&ev));
  const char* names[] = {"fixed buffers", "alloc+free nodes", "event nodes", "child graph per kernel", "kernels with PDL"};
  // A one-kernel graph, added as a child graph node per kernel in mode 3.
  cudaGraph_t child; CK(cudaGraphCreate(&child, 0));
  {
    cudaKernelNodeParams kp = {}; void* args[] = {&a, &b, (void*)&n};
    kp.func = (void*)step; kp.gridDim = dim3(n / 256); kp.blockDim = dim3(256); kp.kernelParams = args;
    cudaGraphNode_t kn; CK(cudaGraphAddKernelNode(&kn, child, nullptr, 0, &kp));
  }
  for (int mode = 0; mode < 5; mode++) {
    cudaGraph_t g; cudaGraphExec_t x;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    float* prev = a;
    for (int k = 0; k < kernels; k++) {
      if (mode == 1) {
        float* cur; CK(cudaMallocAsync(&cur, n * 4, s));
        step<<<n / 256, 256, 0, s>>>(prev, cur, n);
        if (prev != a) CK(cudaFreeAsync(prev, s));
        prev = cur;
      } else if (mode == 3) {
        cudaStreamCaptureStatus st; unsigned long long id; cudaGraph_t g0; const cudaGraphNode_t* deps; const cudaGraphEdgeData* ed; size_t nd;
        CK(cudaStreamGetCaptureInfo(s, &st, &id, &g0, &deps, &ed, &nd));
        cudaGraphNode_t cn; CK(cudaGraphAddChildGraphNode(&cn, g0, deps, nd, child));
        CK(cudaStreamUpdateCaptureDependencies(s, &cn, nullptr, 1, cudaStreamSetCaptureDependencies));
      } else if (mode == 4) {
        cudaLaunchConfig_t cfg = {}; cfg.gridDim = dim3(n / 256); cfg.blockDim = dim3(256); cfg.stream = s;
        cudaLaunchAttribute at; at.id = cudaLaunchAttributeProgrammaticStreamSerialization; at.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &at; cfg.numAttrs = 1;
        const float* in = k % 2 ? b : a; float* out = k % 2 ? a : b;
        CK(cudaLaunchKernelEx(&cfg, step, in, out, n));
      } else {
        step<<<n / 256, 256, 0, s>>>(k % 2 ? b : a, k % 2 ? a : b, n);
        if (mode == 2) CK(cudaEventRecordWithFlags(evs[k], s, cudaEventRecordExternal));
      }
    }
    if (mode == 1 && prev != a) CK(cudaFreeAsync(prev, s));
    CK(cudaStreamEndCapture(s, &g));
    size_t nodes = 0; CK(cudaGraphGetNodes(g, nullptr, &nodes));
    CK(cudaGraphInstantiate(&x, g, 0));
    CK(cudaGraphUpload(x, s));
    cudaEvent_t t0, t1; CK(cudaEventCreate(&t0)); CK(cudaEventCreate(&t1));
    std::vector<float> ms;
    for (int r = 0; r < reps + 20; r++) {
      CK(cudaEventRecord(t0, s)); CK(cudaGraphLaunch(x, s)); CK(cudaEventRecord(t1, s));
      CK(cudaStreamSynchronize(s));
      float m; CK(cudaEventElapsedTime(&m, t0, t1)); if (r >= 20) ms.push_back(m * 1000);
    }
    std::sort(ms.begin(), ms.end());
    printf("| %s | %zu nodes | %.2f us a replay | %.2f us a kernel |\n", names[mode], nodes, ms[ms.size() / 2], ms[ms.size() / 2] / kernels);
  }
  return 0;
}
