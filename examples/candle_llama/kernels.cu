// The decode step's own CUDA kernels (compiled at run time through NVRTC by kernels.rs and
// launched on candle's stream). No headers: elements are moved as raw 16- or 32-bit words.

// KV-cache write: row `i` of `src` (`[t, kv, hd]`, element (i, g, d) at
// `i * s_tok + g * s_head + d`) goes to row `pos[i]` of head `g` of the cache `dst`
// (`[kv, cap, hd]`, contiguous). One thread per element; positions past the cache are
// skipped.
template <typename E>
__device__ void kv_write(E *dst, const E *src, const unsigned int *pos, unsigned int t,
                         unsigned int kv, unsigned int hd, unsigned int cap,
                         unsigned long long s_tok, unsigned long long s_head) {
  const unsigned long long n = (unsigned long long)t * kv * hd;
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long e = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; e < n;
       e += step) {
    const unsigned int d = (unsigned int)(e % hd);
    const unsigned long long r = e / hd;
    const unsigned int g = (unsigned int)(r % kv);
    const unsigned int i = (unsigned int)(r / kv);
    const unsigned int p = pos[i];
    if (p < cap) {
      dst[((unsigned long long)g * cap + p) * hd + d] = src[i * s_tok + g * s_head + d];
    }
  }
}

extern "C" __global__ void kv_write_16(unsigned short *dst, const unsigned short *src,
                                       const unsigned int *pos, unsigned int t, unsigned int kv,
                                       unsigned int hd, unsigned int cap,
                                       unsigned long long s_tok, unsigned long long s_head) {
  kv_write(dst, src, pos, t, kv, hd, cap, s_tok, s_head);
}

extern "C" __global__ void kv_write_32(unsigned int *dst, const unsigned int *src,
                                       const unsigned int *pos, unsigned int t, unsigned int kv,
                                       unsigned int hd, unsigned int cap,
                                       unsigned long long s_tok, unsigned long long s_head) {
  kv_write(dst, src, pos, t, kv, hd, cap, s_tok, s_head);
}

// f32 <-> bf16 (round to nearest even, as candle's CPU conversion), without headers.
__device__ __forceinline__ float load(const unsigned short *p, unsigned long long i) {
  return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ float load(const float *p, unsigned long long i) { return p[i]; }
__device__ __forceinline__ void store(unsigned short *p, unsigned long long i, float v) {
  unsigned int u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    p[i] = (unsigned short)((u >> 16) | 0x40u);
  } else {
    p[i] = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}
__device__ __forceinline__ void store(float *p, unsigned long long i, float v) { p[i] = v; }

// Rotary embedding in f32: `x` (`[t, n, hd]`, element (i, h, d) at
// `i * s_tok + h * s_head + d`) rotated by the angles of position `pos[i]`, whose cosines
// and sines are row `pos[i]` of `table` (`[cap, hd]`: `hd / 2` cosines, then the sines),
// written to `dst` (`[t, n, hd]`, contiguous). One thread per pair (d, d + hd / 2).
template <typename E>
__device__ void rope(E *dst, const E *x, const unsigned int *pos, const float *table,
                     unsigned int t, unsigned int n, unsigned int hd, unsigned int cap,
                     unsigned long long s_tok, unsigned long long s_head) {
  const unsigned int half = hd / 2;
  const unsigned long long pairs = (unsigned long long)t * n * half;
  const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long e = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
       e < pairs; e += step) {
    const unsigned int d = (unsigned int)(e % half);
    const unsigned long long r = e / half;
    const unsigned int h = (unsigned int)(r % n);
    const unsigned int i = (unsigned int)(r / n);
    const unsigned int p = pos[i] < cap ? pos[i] : cap - 1;
    const float c = table[(unsigned long long)p * hd + d];
    const float s = table[(unsigned long long)p * hd + half + d];
    const unsigned long long from = i * s_tok + h * s_head + d;
    const float a = load(x, from);
    const float b = load(x, from + half);
    const unsigned long long to = r * hd + d;
    store(dst, to, a * c - b * s);
    store(dst, to + half, a * s + b * c);
  }
}

extern "C" __global__ void rope_bf16(unsigned short *dst, const unsigned short *x,
                                     const unsigned int *pos, const float *table, unsigned int t,
                                     unsigned int n, unsigned int hd, unsigned int cap,
                                     unsigned long long s_tok, unsigned long long s_head) {
  rope(dst, x, pos, table, t, n, hd, cap, s_tok, s_head);
}

extern "C" __global__ void rope_f32(float *dst, const float *x, const unsigned int *pos,
                                    const float *table, unsigned int t, unsigned int n,
                                    unsigned int hd, unsigned int cap, unsigned long long s_tok,
                                    unsigned long long s_head) {
  rope(dst, x, pos, table, t, n, hd, cap, s_tok, s_head);
}

// Causal softmax in f32 of scaled scores: row r of `s` (`[rows, keys]`, contiguous, rows =
// batches of `t` queries) is query `r % t`, at position `pos[r % t]`, which sees keys
// `0..=pos[r % t]`: `dst` gets softmax(scale * s) over those and 0 past them. A block per
// row (256 threads, tree reductions in shared memory).
template <typename E>
__device__ void causal_softmax(E *dst, const E *s, const unsigned int *pos, unsigned int rows,
                               unsigned int t, unsigned int keys, float scale) {
  __shared__ float buf[256];
  for (unsigned int r = blockIdx.x; r < rows; r += gridDim.x) {
    const unsigned int p = pos[r % t];
    const unsigned int seen = p < keys ? p + 1 : keys;
    const unsigned long long base = (unsigned long long)r * keys;
    float m = -__int_as_float(0x7f800000);
    for (unsigned int j = threadIdx.x; j < seen; j += blockDim.x) {
      m = fmaxf(m, scale * load(s, base + j));
    }
    buf[threadIdx.x] = m;
    __syncthreads();
    for (unsigned int w = blockDim.x / 2; w > 0; w >>= 1) {
      if (threadIdx.x < w) buf[threadIdx.x] = fmaxf(buf[threadIdx.x], buf[threadIdx.x + w]);
      __syncthreads();
    }
    m = buf[0];
    __syncthreads();
    float sum = 0.0f;
    for (unsigned int j = threadIdx.x; j < seen; j += blockDim.x) {
      sum += expf(scale * load(s, base + j) - m);
    }
    buf[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned int w = blockDim.x / 2; w > 0; w >>= 1) {
      if (threadIdx.x < w) buf[threadIdx.x] += buf[threadIdx.x + w];
      __syncthreads();
    }
    const float inv = buf[0] > 0.0f ? 1.0f / buf[0] : 0.0f;
    __syncthreads();
    for (unsigned int j = threadIdx.x; j < keys; j += blockDim.x) {
      store(dst, base + j, j < seen ? expf(scale * load(s, base + j) - m) * inv : 0.0f);
    }
  }
}

extern "C" __global__ void causal_softmax_bf16(unsigned short *dst, const unsigned short *s,
                                               const unsigned int *pos, unsigned int rows,
                                               unsigned int t, unsigned int keys, float scale) {
  causal_softmax(dst, s, pos, rows, t, keys, scale);
}

extern "C" __global__ void causal_softmax_f32(float *dst, const float *s, const unsigned int *pos,
                                              unsigned int rows, unsigned int t,
                                              unsigned int keys, float scale) {
  causal_softmax(dst, s, pos, rows, t, keys, scale);
}
