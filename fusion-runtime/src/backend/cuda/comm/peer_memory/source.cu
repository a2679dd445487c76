// Collectives over peer memory: one kernel per rank and call. Every rank's workspace is
// mapped into every other rank's address space (`Peers::ws`, by rank). A workspace holds
// flags, then two halves of data; calls alternate halves, so a call writes into a half its
// peers finished reading two calls ago (a rank's calls run one after another on its
// device, and a peer cannot pass a call's flags before it finished the previous call).
//
// A block's flags: `pads[block][peer]`, the last epoch `peer` raised for this block, and
// per block of this rank an epoch counter (moved only by the blocks a call runs: every
// rank runs the same calls with the same grids, so block b's counters agree on every
// rank) and a call counter (every call moves all GMAX of them, the blocks it does not run
// too, so every block of a call picks the same half). Block b only reads what block b of a peer wrote, so the flags
// of block b order everything it touches. A flag wait that outlasts the
// timeout, or sees the host's release word set, records itself in the status words
// (host memory) and the kernel ends early.
//
// The element type comes from a `#define` prepended by the host: DT_F32, DT_BF16, DT_F16.
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;
#define MAXR 8
#define GMAX 128
#define SEQ_AT (GMAX * MAXR)
#define CALLS_AT (GMAX * MAXR + GMAX)
// Where block b of rank r leaves its call's buffers `(in, out)` at each peer (the direct
// Allreduce): two 16-byte packets at byte 8 BUFFERS_AT + 32 (b MAXR + r), inside the flags
// (bytes 8192 to 40960, before `Ctl::data_offset`).
#define BUFFERS_AT 1024 /* byte 8192: past the u32 flags and counters */

#if defined(DT_F32)
#define EPV 4
typedef float E;
__device__ __forceinline__ float ld1(E x) { return x; }
__device__ __forceinline__ E st1(float f) { return f; }
#elif defined(DT_BF16)
#define EPV 8
typedef u16 E;
__device__ __forceinline__ float ld1(E h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ E st1(float f) { u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
#else
#define EPV 8
typedef u16 E;
__device__ __forceinline__ float ld1(E h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ E st1(float f) { u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r; }
#endif

struct alignas(16) V4 { u32 x, y, z, w; };
struct Peers { u64 ws[MAXR]; };
struct Ctl {
    u64 status;      // host-mapped u32[4]: state (1 timed out, 2 released), peer, op, ms
    u64 release;     // host-mapped u32: set by the host when the world failed
    u64 timeout_ns;
    u64 data_offset; // bytes from a workspace's start to its first half
    u64 half_bytes;  // bytes from one half to the next
    u64 usable_bytes; // bytes of a half the flag-meeting kernels use; the flagged-data
                      // (LL) kernel uses the rest, which nothing else writes
};

__device__ __forceinline__ u64 now_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ void st_release(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u32 ld_acquire(const u32* p) {
    u32 v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}
// Workspace data written by peers: read past L1.
__device__ __forceinline__ V4 ld_cg(const void* p) {
    V4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ E ld_cg1(const E* p) { volatile const E* q = p; return *q; }

__device__ __forceinline__ void unpack(V4 v, float* f) {
#if defined(DT_F32)
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
#else
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) { f[2 * i] = ld1((E)(w[i] & 0xffff)); f[2 * i + 1] = ld1((E)(w[i] >> 16)); }
#endif
}
__device__ __forceinline__ V4 pack(const float* f) {
#if defined(DT_F32)
    return V4{__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3])};
#else
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = (u32)st1(f[2 * i]) | ((u32)st1(f[2 * i + 1]) << 16);
    return V4{w[0], w[1], w[2], w[3]};
#endif
}

// Elements [e, e + count) of `src` (count <= EPV) into `dst`, as one vector when whole and aligned.
__device__ __forceinline__ void move_elems(E* dst, const E* src, u64 count, bool cg) {
    if (count == EPV && ((((u64)dst) | ((u64)src)) & 15) == 0) {
        *(V4*)dst = cg ? ld_cg(src) : *(const V4*)src;
    } else {
        for (u64 k = 0; k < count; ++k) dst[k] = cg ? ld_cg1(src + k) : src[k];
    }
}
__device__ __forceinline__ void store_sum(E* dst, const float* f, u64 count) {
    if (count == EPV && (((u64)dst) & 15) == 0) { *(V4*)dst = pack(f); }
    else { for (u64 k = 0; k < count; ++k) dst[k] = st1(f[k]); }
}

// The sum, in rank order, of the `world` slots (`stride` elements apart) of `base` at `e`.
__device__ __forceinline__ void sum_slots(const E* base, u64 stride, u64 e, int world, float* acc) {
    float f[EPV];
#pragma unroll
    for (int k = 0; k < EPV; ++k) acc[k] = 0.f;
    for (int r = 0; r < world; ++r) {
        unpack(ld_cg(base + r * stride + e), f);
#pragma unroll
        for (int k = 0; k < EPV; ++k) acc[k] += f[k];
    }
}

// This block's share [lo, hi) of `nv` vectors.
__device__ __forceinline__ void share(u64 nv, u64* lo, u64* hi) {
    u64 per = (nv + gridDim.x - 1) / gridDim.x;
    *lo = min(nv, per * blockIdx.x);
    *hi = min(nv, *lo + per);
}

// A bounded wait's clock: `tick()` after every failed check; true once the wait must end
// (the world's timeout passed, or the host released the waits), after recording why in
// the status words (the peer waited for, the collective, milliseconds).
struct Patience {
    u64 start;
    u32 spins;
    __device__ __forceinline__ bool tick(const Ctl& c, u32 peer, u32 op) {
        if ((++spins & 1023) != 0) return false;
        u64 tn = now_ns();
        if (start == 0) { start = tn; return false; }
        bool released = *(volatile u32*)c.release != 0;
        if (!released && tn - start <= c.timeout_ns) return false;
        volatile u32* s = (volatile u32*)c.status;
        s[1] = peer; s[2] = op; s[3] = (u32)((tn - start) / 1000000ull);
        __threadfence_system();
        s[0] = released ? 2u : 1u;
        __threadfence_system();
        return true;
    }
};

// Raises this block's flag `epoch` at every peer and waits for every peer's.
__device__ void meet(const Peers& P, int rank, int world, u32 epoch, const Ctl& c, u32 op, volatile int* failed) {
    __syncthreads();
    int t = threadIdx.x;
    if (t < world && t != rank && !*failed) {
        st_release((u32*)P.ws[t] + blockIdx.x * MAXR + rank, epoch);
        const u32* mine = (const u32*)P.ws[rank] + blockIdx.x * MAXR + t;
        Patience p = {0, 0};
        while ((int)(ld_acquire(mine) - epoch) < 0) {
            if (p.tick(c, (u32)t, op)) { *failed = 1; break; }
        }
    }
    __syncthreads();
}

// A kernel recorded into a caller's graph right after another kernel may be launched
// before that kernel has finished (a programmatic edge, `caller_capture.rs`): it reads
// nothing before this wait, which returns once every kernel it depends on has finished
// and its writes are visible (at once for an ordinary launch).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define WAIT_FOR_GRID_DEPENDENCIES() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define WAIT_FOR_GRID_DEPENDENCIES() do {} while (0)
#endif

#define BEGIN(op) \
    WAIT_FOR_GRID_DEPENDENCIES(); \
    __shared__ u32 s_seq, s_par; __shared__ int s_failed; \
    u32* counters = (u32*)P.ws[rank]; \
    if (threadIdx.x == 0) { s_seq = counters[SEQ_AT + blockIdx.x]; s_par = counters[CALLS_AT + blockIdx.x]; s_failed = 0; } \
    __syncthreads(); \
    u32 seq = s_seq; \
    u32 halves = 1u; \
    u64 half = c.data_offset + (u64)(s_par & 1u) * c.half_bytes; \
    const u32 OP = op;
#define END() \
    __syncthreads(); \
    if (threadIdx.x == 0) { counters[SEQ_AT + blockIdx.x] = seq; counters[CALLS_AT + blockIdx.x] = s_par + halves; } \
    for (u32 slot = gridDim.x + blockIdx.x + threadIdx.x * gridDim.x; slot < GMAX; slot += blockDim.x * gridDim.x) \
        counters[CALLS_AT + slot] = s_par + halves;
#define AT(q) ((E*)(P.ws[q] + half))
#define MEET() do { meet(P, rank, world, ++seq, c, OP, &s_failed); if (s_failed) { END(); return; } } while (0)

// Allreduce, one shot: every rank writes its whole input into slot `rank` of every peer,
// then sums the `world` slots of its own workspace (in rank order: the same bits on every rank).
extern "C" __global__ void __launch_bounds__(512) peer_allreduce_one_shot(const E* in, E* out, u64 n, Peers P, int rank, int world, Ctl c) {
    BEGIN(1);
    const u64 slot = (n + EPV - 1) / EPV * EPV;
    u64 lo, hi; share((n + EPV - 1) / EPV, &lo, &hi);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        u64 e = i * EPV, cnt = min((u64)EPV, n - e);
        for (int q = 0; q < world; ++q) move_elems(AT(q) + rank * slot + e, in + e, cnt, false);
    }
    MEET();
    const E* mine = AT(rank);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        u64 e = i * EPV, cnt = min((u64)EPV, n - e);
        float acc[EPV];
        sum_slots(mine, slot, e, world, acc);
        store_sum(out + e, acc, cnt);
    }
    END();
}

// Allreduce, two shots: part q of the input goes to rank q (slot `rank`), each rank sums
// its part and writes the sum into every peer's gather area, then copies the gathered sums
// out (measured faster than reading the other parts from their owners). A message larger than half a workspace goes in chunks, each in the next half (the
// call counter moves once per chunk, so the halves keep alternating across calls).
extern "C" __global__ void __launch_bounds__(512) peer_allreduce_two_shot(const E* in_all, E* out_all, u64 n_all, Peers P, int rank, int world, Ctl c) {
    BEGIN(2);
    const u64 unit = (u64)world * EPV;
    const u64 cap = c.usable_bytes / sizeof(E) / 2 / unit * unit;
    halves = (u32)((n_all + cap - 1) / cap);
    for (u32 ch = 0; ch < halves; ++ch) {
        half = c.data_offset + (u64)((s_par + ch) & 1u) * c.half_bytes;
        const E* in = in_all + (u64)ch * cap;
        E* out = out_all + (u64)ch * cap;
        const u64 n = min(cap, n_all - (u64)ch * cap);
        const u64 part = ((n + world - 1) / world + EPV - 1) / EPV * EPV;
        const u64 gather = (u64)world * part;
        u64 lo, hi; share(part / EPV, &lo, &hi);
        for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            for (int q = 0; q < world; ++q) {
                u64 e = q * part + i * EPV;
                if (e >= n) continue;
                move_elems(AT(q) + rank * part + i * EPV, in + e, min((u64)EPV, n - e), false);
            }
        }
        MEET();
        const E* mine = AT(rank);
        for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            u64 e = rank * part + i * EPV;
            if (e >= n) continue;
            float acc[EPV];
            sum_slots(mine, part, i * EPV, world, acc);
            V4 v = pack(acc);
            for (int q = 0; q < world; ++q) *(V4*)(AT(q) + gather + e) = v;
        }
        MEET();
        for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            for (int q = 0; q < world; ++q) {
                u64 e = q * part + i * EPV;
                if (e >= n) continue;
                move_elems(out + e, mine + gather + e, min((u64)EPV, n - e), true);
            }
        }
    }
    END();
}

// Allreduce for small messages, one shot without a flag round trip: every 8 bytes of the
// input travel with the call's flag beside them (16-byte stores of data, flag, data, flag),
// so a rank reads a peer's slot as soon as the flags there say this call, with no fence and
// no separate flag. The call counter (the same on every rank) is the flag; calls alternate
// halves, so a slot is written again only after its reader finished the call before.
// `peer_allreduce_ll` waits for the ranks' packets one rank after another (2 ranks);
// `peer_allreduce_ll_at_once` (below) loads them all at once (more ranks).
__device__ __forceinline__ void st_ll(void* p, u32 d0, u32 d1, u32 flag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(p), "r"(d0), "r"(flag), "r"(d1), "r"(flag) : "memory");
}
__device__ __forceinline__ void ld_ll(const void* p, u32* d0, u32* d1, u32* f0, u32* f1) {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(*d0), "=r"(*f0), "=r"(*d1), "=r"(*f1) : "l"(p) : "memory");
}
#define PE (8 / (int)sizeof(E))

extern "C" __global__ void __launch_bounds__(512) peer_allreduce_ll(const E* in, E* out, u64 n, Peers P, int rank, int world, Ctl c) {
    BEGIN(5);
    const u32 flag = s_par + 1u;
    const u64 packets = (n + PE - 1) / PE;
    u64 lo, hi; share(packets, &lo, &hi);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        union { E e[PE]; u32 w[2]; } pk;
        u64 e0 = i * PE;
#pragma unroll
        for (int k = 0; k < PE; ++k) pk.e[k] = e0 + k < n ? in[e0 + k] : (E)0;
        for (int q = 0; q < world; ++q) st_ll((char*)AT(q) + c.usable_bytes + (rank * packets + i) * 16, pk.w[0], pk.w[1], flag);
    }
    const char* mine = (const char*)AT(rank) + c.usable_bytes;
    for (u64 i = lo + threadIdx.x; i < hi && !*(volatile int*)&s_failed; i += blockDim.x) {
        float acc[PE];
#pragma unroll
        for (int k = 0; k < PE; ++k) acc[k] = 0.f;
        for (int r = 0; r < world; ++r) {
            union { E e[PE]; u32 w[2]; } pk;
            u32 f0, f1;
            Patience p = {0, 0};
            for (;;) {
                ld_ll(mine + (r * packets + i) * 16, &pk.w[0], &pk.w[1], &f0, &f1);
                if (f0 == flag && f1 == flag) break;
                if (p.tick(c, (u32)r, OP)) { s_failed = 1; break; }
            }
            if (s_failed) break;
#pragma unroll
            for (int k = 0; k < PE; ++k) acc[k] += ld1(pk.e[k]);
        }
        u64 e0 = i * PE;
#pragma unroll
        for (int k = 0; k < PE; ++k) if (e0 + k < n) out[e0 + k] = st1(acc[k]);
    }
    END();
}

// Element k (< PE) of the packet whose data words are (w0, w1), as a float.
__device__ __forceinline__ float packet_elem(u32 w0, u32 w1, int k) {
#if defined(DT_F32)
    return __uint_as_float(k == 0 ? w0 : w1);
#else
    u32 w = k < 2 ? w0 : w1;
    return ld1((E)((k & 1) ? (w >> 16) : (w & 0xffff)));
#endif
}
// Packet i of `in` (n elements) as its two words: one 8-byte load where the packet is
// whole and aligned, else element by element (0 past the end).
__device__ __forceinline__ u32 packet_word(const E* in, u64 n, u64 i, int word);
__device__ __forceinline__ void load_packet(const E* in, u64 n, u64 i, u32* w0, u32* w1) {
    if ((i + 1) * PE <= n && (((u64)in) & 7) == 0) {
        const u64 v = *(const u64*)(in + i * PE);
        *w0 = (u32)v; *w1 = (u32)(v >> 32);
    } else {
        *w0 = packet_word(in, n, i, 0); *w1 = packet_word(in, n, i, 1);
    }
}
// Element k of packet i of `in` (n elements), as the low bits of a word; 0 past the end.
__device__ __forceinline__ u32 packet_word(const E* in, u64 n, u64 i, int word) {
#if defined(DT_F32)
    u64 e = i * PE + word;
    return e < n ? __float_as_uint(in[e]) : 0u;
#else
    u64 e = i * PE + 2 * word;
    u32 lo = e < n ? (u32)in[e] : 0u, hi = e + 1 < n ? (u32)in[e + 1] : 0u;
    return lo | (hi << 16);
#endif
}

// The sum, in rank order, of packet `i` of every rank's slot (`stride` packets apart from
// `base`): every rank's packet loaded at once (one round trip to memory, not one per rank),
// then those not yet of this call (`flag`) loaded again until they are. False once a wait
// ended (the call failed; `failed` says so to the block).
__device__ __forceinline__ bool sum_flagged_slots(const char* base, u64 stride, u64 i, int world, u32 flag,
                                                  const Ctl& c, u32 op, volatile int* failed, float* acc) {
    u32 d0[MAXR], d1[MAXR], f0[MAXR], f1[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        d0[r] = d1[r] = f0[r] = f1[r] = 0u;
        if (r < world) ld_ll(base + (r * stride + i) * 16, &d0[r], &d1[r], &f0[r], &f1[r]);
    }
#pragma unroll
    for (int k = 0; k < PE; ++k) acc[k] = 0.f;
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r < world) {
            Patience p = {0, 0};
            while (!(f0[r] == flag && f1[r] == flag) && !*failed) {
                if (p.tick(c, (u32)r, op)) { *failed = 1; break; }
                ld_ll(base + (r * stride + i) * 16, &d0[r], &d1[r], &f0[r], &f1[r]);
            }
#pragma unroll
            for (int k = 0; k < PE; ++k) acc[k] += packet_elem(d0[r], d1[r], k);
        }
    }
    return !*failed;
}

// The same on more than 2 ranks: each thread loads every rank's packet at once (one round
// trip to memory, not one per rank), then loads again only those not yet of this call
// (on 4 H100s 0.3-0.6 us a call faster than rank after rank; on 2 ranks 0.1-0.5 us slower).
extern "C" __global__ void __launch_bounds__(512) peer_allreduce_ll_at_once(const E* in, E* out, u64 n, Peers P, int rank, int world, Ctl c) {
    BEGIN(5);
    const u32 flag = s_par + 1u;
    const u64 packets = (n + PE - 1) / PE;
    u64 lo, hi; share(packets, &lo, &hi);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        u32 w0, w1;
        load_packet(in, n, i, &w0, &w1);
        for (int q = 0; q < world; ++q) st_ll((char*)AT(q) + c.usable_bytes + (rank * packets + i) * 16, w0, w1, flag);
    }
    const char* mine = (const char*)AT(rank) + c.usable_bytes;
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float acc[PE];
        if (!sum_flagged_slots(mine, packets, i, world, flag, c, OP, &s_failed, acc)) break;
        u64 e0 = i * PE;
#pragma unroll
        for (int k = 0; k < PE; ++k) if (e0 + k < n) out[e0 + k] = st1(acc[k]);
    }
    END();
}

// The two words of a packet of PE sums.
__device__ __forceinline__ void pack_sums(const float* acc, u32* w0, u32* w1) {
#if defined(DT_F32)
    *w0 = __float_as_uint(acc[0]); *w1 = __float_as_uint(acc[1]);
#else
    *w0 = (u32)st1(acc[0]) | ((u32)st1(acc[1]) << 16);
    *w1 = (u32)st1(acc[2]) | ((u32)st1(acc[3]) << 16);
#endif
}

// Allreduce in two shots with the data beside its flags in both (mid-size messages on
// more than 2 ranks, where the one-shot kernel reads every rank's whole message and the
// two-shot one pays two flag meetings): packet j of part q goes to rank q (slot `rank` of
// the flagged area's first half); the owner of a part loads every rank's packet j at
// once, sums them in rank order and sends the sum to every rank (part q of the second
// half); every rank copies the sums out as they land. The call counter is every packet's
// flag, and calls alternate halves, as in the one-shot flagged kernels.
extern "C" __global__ void __launch_bounds__(512) peer_allreduce_ll_two_shot(const E* in, E* out, u64 n, Peers P, int rank, int world, Ctl c) {
    BEGIN(7);
    const u32 flag = s_par + 1u;
    const u64 packets = (n + PE - 1) / PE;
    const u64 part = (packets + world - 1) / world;
    const u64 second = (u64)world * part * 16;
    u64 lo, hi; share(packets, &lo, &hi);
    for (u64 g = lo + threadIdx.x; g < hi; g += blockDim.x) {
        const u64 q = g / part, j = g % part;
        u32 w0, w1;
        load_packet(in, n, g, &w0, &w1);
        st_ll((char*)AT(q) + c.usable_bytes + (rank * part + j) * 16, w0, w1, flag);
    }
    const char* mine = (const char*)AT(rank) + c.usable_bytes;
    u64 plo, phi; share(part, &plo, &phi);
    for (u64 j = plo + threadIdx.x; j < phi && rank * part + j < packets; j += blockDim.x) {
        float acc[PE];
        if (!sum_flagged_slots(mine, part, j, world, flag, c, OP, &s_failed, acc)) break;
        u32 s0, s1;
        pack_sums(acc, &s0, &s1);
        for (int q = 0; q < world; ++q)
            st_ll((char*)AT(q) + c.usable_bytes + second + (rank * part + j) * 16, s0, s1, flag);
    }
    for (u64 g = lo + threadIdx.x; g < hi && !*(volatile int*)&s_failed; g += blockDim.x) {
        const u64 q = g / part, j = g % part;
        u32 w0, w1, g0, g1;
        ld_ll(mine + second + (q * part + j) * 16, &w0, &w1, &g0, &g1);
        Patience p = {0, 0};
        while (!(g0 == flag && g1 == flag)) {
            if (p.tick(c, (u32)q, OP)) { s_failed = 1; break; }
            ld_ll(mine + second + (q * part + j) * 16, &w0, &w1, &g0, &g1);
        }
        if (s_failed) break;
        const u64 e0 = g * PE;
#pragma unroll
        for (int k = 0; k < PE; ++k) if (e0 + k < n) out[e0 + k] = st1(packet_elem(w0, w1, k));
    }
    END();
}

// Allreduce straight between the ranks' own buffers, for worlds whose ranks reach each
// other's memory (one process): nothing goes through the workspaces. Block b sends its
// call's `(in, out)` to every peer with the call's epoch beside every word (so a block
// waits for the peers' buffers in its own workspace, with no fence and no round trip to a
// peer before the data's); then it sums its share of part `rank` of
// every rank's input (in rank order: every rank gets the same bits) and stores the sum
// into every rank's output; and meets again, so no rank returns (and overwrites its input)
// while a peer still reads it, or before its output is whole. An output that overlaps its
// input is safe: only the owner of a part reads or writes it.

// The sum and stores of vectors [lo, hi) of part `first` for a world of W ranks known when
// compiled (2, 4, 8) and buffers aligned to 16 bytes: each thread issues the loads of U
// vectors from every rank before its first sum, so W x U peer loads are in flight at
// once (a loop over the ranks whose count is known only at run time waits for each
// rank's loads in turn).
template <int W, int U>
__device__ __forceinline__ void direct_part_w(const u64* s_in, const u64* s_out, u64 first, u64 lo, u64 hi, u64 n, int rank) {
    for (u64 i0 = lo + threadIdx.x; i0 < hi; i0 += (u64)U * blockDim.x) {
        V4 v[W][U];
#pragma unroll
        for (int q = 0; q < W; ++q)
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const u64 i = i0 + (u64)u * blockDim.x, e = first + i * EPV;
                if (i < hi && e + EPV <= n) v[q][u] = ld_cg((const E*)s_in[q] + e);
            }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const u64 i = i0 + (u64)u * blockDim.x, e = first + i * EPV;
            if (i >= hi || e >= n) continue;
            float acc[EPV], f[EPV];
#pragma unroll
            for (int k = 0; k < EPV; ++k) acc[k] = 0.f;
            if (e + EPV <= n) {
#pragma unroll
                for (int q = 0; q < W; ++q) {
                    unpack(v[q][u], f);
#pragma unroll
                    for (int k = 0; k < EPV; ++k) acc[k] += f[k];
                }
#pragma unroll
                for (int w = 0; w < W; ++w) *(V4*)((E*)s_out[(rank + w) % W] + e) = pack(acc);
            } else {
                const u64 cnt = n - e;
                for (int q = 0; q < W; ++q)
                    for (u64 k = 0; k < cnt; ++k) acc[k] += ld1(ld_cg1((const E*)s_in[q] + e + k));
                for (int w = 0; w < W; ++w)
                    for (u64 k = 0; k < cnt; ++k) ((E*)s_out[(rank + w) % W])[e + k] = st1(acc[k]);
            }
        }
    }
}

// The same for any world and any alignment, U vectors per thread at a time.
template <int U>
__device__ __forceinline__ void direct_part(const u64* s_in, const u64* s_out, u64 first, u64 lo, u64 hi, u64 n, int rank, int world, bool vec) {
    for (u64 i0 = lo + threadIdx.x; i0 < hi; i0 += (u64)U * blockDim.x) {
        float acc[U][EPV];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int k = 0; k < EPV; ++k) acc[u][k] = 0.f;
        for (int q = 0; q < world; ++q) {
            V4 v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                u64 i = i0 + (u64)u * blockDim.x, e = first + i * EPV;
                if (i < hi && e + EPV <= n && vec) v[u] = ld_cg((const E*)s_in[q] + e);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                u64 i = i0 + (u64)u * blockDim.x, e = first + i * EPV;
                if (i >= hi || e >= n) continue;
                float f[EPV];
                if (e + EPV <= n && vec) {
                    unpack(v[u], f);
                } else {
                    const E* src = (const E*)s_in[q] + e;
                    for (u64 k = 0; k < EPV; ++k) f[k] = e + k < n ? ld1(ld_cg1(src + k)) : 0.f;
                }
#pragma unroll
                for (int k = 0; k < EPV; ++k) acc[u][k] += f[k];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            u64 i = i0 + (u64)u * blockDim.x, e = first + i * EPV;
            if (i >= hi || e >= n) continue;
            u64 cnt = min((u64)EPV, n - e);
            for (int w = 0; w < world; ++w) {
                E* dst = (E*)s_out[(rank + w) % world] + e;
                if (vec && cnt == EPV) *(V4*)dst = pack(acc[u]);
                else for (u64 k = 0; k < cnt; ++k) dst[k] = st1(acc[u][k]);
            }
        }
    }
}

// `U`: vectors per thread at a time where the world is 2, 4 or 8 ranks and the buffers are
// aligned (the rest take `direct_part<2>`); `BY_WORLD` false: every world takes
// `direct_part<U>` (the benchmark's baseline).
template <int U, bool BY_WORLD = true>
__device__ void allreduce_direct(const E* in, E* out, u64 n, const Peers& P, int rank, int world, const Ctl& c) {
    BEGIN(6);
    (void)half;
    __shared__ u64 s_in[MAXR], s_out[MAXR];
    __shared__ int s_aligned;
    // Each peer's `(in, out)` arrives as two 16-byte packets with this call's epoch beside
    // every word (as the flagged kernels' data): no fence on either side, one trip.
    const u32 epoch = ++seq;
    if (threadIdx.x < world && threadIdx.x != rank) {
        char* at_peer = (char*)P.ws[threadIdx.x] + BUFFERS_AT * 8 + 32 * (blockIdx.x * MAXR + rank);
        st_ll(at_peer, (u32)(u64)in, (u32)((u64)in >> 32), epoch);
        st_ll(at_peer + 16, (u32)(u64)out, (u32)((u64)out >> 32), epoch);
    }
    if (threadIdx.x < world) {
        if (threadIdx.x == rank) {
            s_in[rank] = (u64)in; s_out[rank] = (u64)out;
        } else {
            const char* left = (const char*)P.ws[rank] + BUFFERS_AT * 8 + 32 * (blockIdx.x * MAXR + threadIdx.x);
            u32 w[4], f[4];
            Patience p = {0, 0};
            for (;;) {
                ld_ll(left, &w[0], &w[1], &f[0], &f[1]);
                ld_ll(left + 16, &w[2], &w[3], &f[2], &f[3]);
                if (f[0] == epoch && f[1] == epoch && f[2] == epoch && f[3] == epoch) break;
                if (p.tick(c, (u32)threadIdx.x, OP)) { s_failed = 1; break; }
            }
            s_in[threadIdx.x] = (u64)w[0] | ((u64)w[1] << 32);
            s_out[threadIdx.x] = (u64)w[2] | ((u64)w[3] << 32);
        }
    }
    __syncthreads();
    if (s_failed) { END(); return; }
    __syncthreads();
    if (threadIdx.x == 0) {
        int aligned = 1;
        for (int q = 0; q < world; ++q) if (((s_in[q] | s_out[q]) & 15) != 0) aligned = 0;
        s_aligned = aligned;
    }
    __syncthreads();
    const bool vec = s_aligned != 0;
    const u64 part = ((n + world - 1) / world + EPV - 1) / EPV * EPV;
    const u64 first = (u64)rank * part;
    u64 lo, hi; share(part / EPV, &lo, &hi);
    if (!BY_WORLD) direct_part<U>(s_in, s_out, first, lo, hi, n, rank, world, vec);
    else if (vec && world == 2) direct_part_w<2, U>(s_in, s_out, first, lo, hi, n, rank);
    else if (vec && world == 4) direct_part_w<4, U>(s_in, s_out, first, lo, hi, n, rank);
    else if (vec && world == 8) direct_part_w<8, (U > 2 ? 2 : U)>(s_in, s_out, first, lo, hi, n, rank);
    else direct_part<2>(s_in, s_out, first, lo, hi, n, rank, world, vec);
    MEET();
    END();
}

extern "C" __global__ void __launch_bounds__(512) peer_allreduce_direct(const E* in, E* out, u64 n, Peers P, int rank, int world, Ctl c) {
    allreduce_direct<2>(in, out, n, P, rank, world, c);
}

// Allgather: `m` elements per rank into slot `rank` of every peer; then the slots, in rank order, out.
extern "C" __global__ void __launch_bounds__(512) peer_allgather(const E* in, E* out, u64 m, Peers P, int rank, int world, Ctl c) {
    BEGIN(3);
    const u64 slot = (m + EPV - 1) / EPV * EPV;
    u64 lo, hi; share(slot / EPV, &lo, &hi);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        u64 e = i * EPV, cnt = min((u64)EPV, m - e);
        for (int q = 0; q < world; ++q) move_elems(AT(q) + rank * slot + e, in + e, cnt, false);
    }
    MEET();
    const E* mine = AT(rank);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        u64 e = i * EPV, cnt = min((u64)EPV, m - e);
        for (int r = 0; r < world; ++r) move_elems(out + r * m + e, mine + r * slot + e, cnt, true);
    }
    END();
}

// ReduceScatter: block q (`m` elements) of the input into slot `rank` of rank q; then the
// sum of the slots (in rank order) out.
extern "C" __global__ void __launch_bounds__(512) peer_reduce_scatter(const E* in, E* out, u64 m, Peers P, int rank, int world, Ctl c) {
    BEGIN(4);
    const u64 slot = (m + EPV - 1) / EPV * EPV;
    u64 lo, hi; share(slot / EPV, &lo, &hi);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        u64 e = i * EPV, cnt = min((u64)EPV, m - e);
        for (int q = 0; q < world; ++q) move_elems(AT(q) + rank * slot + e, in + q * m + e, cnt, false);
    }
    MEET();
    const E* mine = AT(rank);
    for (u64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        u64 e = i * EPV, cnt = min((u64)EPV, m - e);
        float acc[EPV];
        sum_slots(mine, slot, e, world, acc);
        store_sum(out + e, acc, cnt);
    }
    END();
}
