// A decode-size GEMM whose epilogue does the Allreduce of its product (`Node::GemmAllreduce`):
// Y [M, N] = sum over ranks of X [M, K] W [K, N], row-major, bf16 or f16, f32 accumulation.
// Appended to `source.cu` (its workspace layout, flags, counters and helpers) and compiled
// for compute capability 8.0 and up; measured in `bench/decode_gemm/allreduce_harness.cu`.
//
// Block b computes the 64 output columns of tile b / KS over part b % KS of K (one wave:
// the grid is N / 64 * KS <= GMAX blocks; KS = 2 gives N = 4096 a block per SM too),
// streaming W and X through a ring of shared-memory stages (cp.async, swizzled 128-byte
// rows) into mma.sync. Its partial tile, rounded to the element type as a GEMM's output
// would be, goes into slot `rank * KS + part` of the tile's area in every rank's workspace;
// then the tile's blocks sum its slots (part by part, each in rank order: the same bits on
// every rank) into Y, each block a share of the tile. Two ways to say a slot is there: data
// beside the call's flag in every 16-byte store (`_ll`: no fence, twice the bytes; faster
// below 8 rows), or plain stores and the block's flag meeting (`_flag`, KS = 1 only: the
// meeting is between the blocks of one index). With a residual R (not null; [M, N] like Y,
// the same on every rank), Y = R + the sum, the sum rounded to the element type first: the
// bits of the Allreduce followed by an elementwise add.
#if !defined(DT_F32)
#define GA_BN 64
#define GA_BK 64
#define GA_STAGES 8
#define GA_THREADS 128

__device__ __forceinline__ void ga_cp_async16(u32 dst, const void* src, bool valid) {
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void ga_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void ga_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }
__device__ __forceinline__ void ga_ldsm_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ga_ldsm_x4_t(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ga_mma(float* d, const u32* a, u32 b0, u32 b1) {
#if defined(DT_BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// Chunk c (16 bytes) of row r of a 128-byte-row stage, at chunk c ^ (r & 7).
__device__ __forceinline__ u32 ga_swz(u32 base, int r, int c) { return base + r * 128 + ((c ^ (r & 7)) << 4); }

// The sum `s` as the output element: rounded, then R's element added (where R is given).
__device__ __forceinline__ E ga_out(float s, const E* R, u64 i) {
    E v = st1(s);
    return R ? st1(ld1(v) + ld1(R[i])) : v;
}

// MT: 16-row tiles of X (M <= 16 MT); LL: data beside its flags, else the flag meeting;
// KS: the parts of K (blocks per tile).
template <int MT, bool LL, int KS>
__device__ void gemm_allreduce(const E* __restrict__ X, const E* __restrict__ W, E* Y, const E* R,
                               u64 M_, u64 K_, u64 N_, const Peers& P, int rank, int world, const Ctl& c) {
    BEGIN(8);
    constexpr int NT = GA_BN / 8, MP = MT * 16;
    constexpr int W_STAGE = GA_BK * GA_BN * 2, X_STAGE = MP * GA_BK * 2, STAGE = W_STAGE + X_STAGE;
    extern __shared__ __align__(128) unsigned char ga_smem[];
    const u32 sbase = (u32)__cvta_generic_to_shared(ga_smem);
    const int M = (int)M_, K = (int)K_, N = (int)N_;
    const int tid = threadIdx.x, lane = tid & 31, wk = tid >> 5;  // 4 warps split each stage's K
    static_assert(KS == 1 || LL, "parts of K need flags beside the data");
    const int tile = blockIdx.x / KS, part = blockIdx.x % KS, n0 = tile * GA_BN;
    const int KT = K / GA_BK / KS, kbase = part * KT * GA_BK;

    auto load = [&](int kt, int s) {
        const u32 wb = sbase + s * STAGE, xb = wb + W_STAGE;
        const int k0 = kbase + kt * GA_BK;
#pragma unroll
        for (int i = 0; i < (GA_BK * 8) / GA_THREADS; ++i) {
            int q = tid + i * GA_THREADS, r = q >> 3, cc = q & 7;
            ga_cp_async16(ga_swz(wb, r, cc), W + (u64)(k0 + r) * N + n0 + cc * 8, true);
        }
#pragma unroll
        for (int i = 0; i < (MP * 8 + GA_THREADS - 1) / GA_THREADS; ++i) {
            int q = tid + i * GA_THREADS;
            if (q < MP * 8) {
                int r = q >> 3, cc = q & 7;
                bool ok = r < M;
                ga_cp_async16(ga_swz(xb, r, cc), X + (u64)(ok ? r : 0) * K + k0 + cc * 8, ok);
            }
        }
    };
    float acc[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[a][b][i] = 0.f;
#pragma unroll
    for (int s = 0; s < GA_STAGES - 1; ++s) { if (s < KT) load(s, s); ga_commit(); }
    for (int kt = 0; kt < KT; ++kt) {
        ga_wait<GA_STAGES - 2>();
        __syncthreads();
        if (kt + GA_STAGES - 1 < KT) load(kt + GA_STAGES - 1, (kt + GA_STAGES - 1) % GA_STAGES);
        ga_commit();
        const u32 wb = sbase + (kt % GA_STAGES) * STAGE, xb = wb + W_STAGE;
        const int sl = wk;  // this warp's 16 of the stage's 64 K
        u32 b[NT][2];
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            u32 r[4];
            ga_ldsm_x4_t(ga_swz(wb, sl * 16 + (lane & 15), 2 * j + (lane >> 4)), r);
            b[2 * j][0] = r[0]; b[2 * j][1] = r[1]; b[2 * j + 1][0] = r[2]; b[2 * j + 1][1] = r[3];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            u32 a[4];
            ga_ldsm_x4(ga_swz(xb, mt * 16 + (lane & 15), sl * 2 + (lane >> 4)), a);
#pragma unroll
            for (int j = 0; j < NT; ++j) ga_mma(acc[mt][j], a, b[j][0], b[j][1]);
        }
    }
    ga_wait<0>();
    __syncthreads();

    // The warps' partial sums over their K slices, through shared memory: red[wk][row][col].
    float* red = (float*)ga_smem;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int row = mt * 16 + (lane >> 2) + (i >= 2 ? 8 : 0);
                int col = j * 8 + 2 * (lane & 3) + (i & 1);
                red[(wk * MP + row) * GA_BN + col] = acc[mt][j][i];
            }
    __syncthreads();
    const u32 flag = s_par + 1u;
    // One part's slot of this tile: M x 64 elements (twice the bytes with flags beside).
    const u64 slot = (u64)M * GA_BN * sizeof(E) * (LL ? 2 : 1);
    const u64 area = LL ? c.usable_bytes : 0;  // the flagged area, or the half's start
    // Chunk (row, cc): 8 columns of the tile, one vector (LL: two packets).
    for (int q = tid; q < M * 8; q += GA_THREADS) {
        int row = q >> 3, cc = q & 7;
        float f[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float s = 0.f;
#pragma unroll
            for (int w = 0; w < 4; ++w) s += red[(w * MP + row) * GA_BN + cc * 8 + e];
            f[e] = s;
        }
        V4 v = pack(f);  // rounded as the GEMM's output would be
        const u64 at = area + ((u64)tile * world * KS + rank * KS + part) * slot;
        for (int d = 0; d < world; ++d) {
            char* dst = (char*)AT((rank + d) % world) + at;
            if (LL) {
                u64 pk = (u64)(row * GA_BN + cc * 8) / 4;
                st_ll(dst + pk * 16, v.x, v.y, flag);
                st_ll(dst + (pk + 1) * 16, v.z, v.w, flag);
            } else {
                *(V4*)(dst + (u64)(row * GA_BN + cc * 8) * sizeof(E)) = v;
            }
        }
    }
    if (!LL) MEET();
    const char* mine = (const char*)AT(rank) + area + (u64)tile * world * KS * slot;
    if (LL) {
        // Packet p: elements 4p.. of the tile (row p / 16, columns 4 (p % 16)..); the
        // tile's blocks take every KS-th group of GA_THREADS packets.
        const u64 packets = (u64)M * GA_BN / 4;
        for (int p = part * GA_THREADS + tid; p < (int)packets; p += KS * GA_THREADS) {
            float s[PE], t[PE];
#pragma unroll
            for (int k = 0; k < PE; ++k) s[k] = 0.f;
            bool ok = true;
#pragma unroll
            for (int q = 0; q < KS && ok; ++q) {
                // Part q's slots: rank r's at slot r * KS + q.
                ok = sum_flagged_slots(mine + q * packets * 16, KS * packets, (u64)p, world, flag, c, OP, &s_failed, t);
#pragma unroll
                for (int k = 0; k < PE; ++k) s[k] += t[k];
            }
            if (!ok) break;
            int row = p / (GA_BN / 4), col = (p % (GA_BN / 4)) * 4;
#pragma unroll
            for (int k = 0; k < PE; ++k) {
                const u64 i = (u64)row * N + n0 + col + k;
                Y[i] = ga_out(s[k], R, i);
            }
        }
    } else {
        for (int q = tid; q < M * 8; q += GA_THREADS) {
            int row = q >> 3, cc = q & 7;
            float s[8];
            sum_slots((const E*)mine, (u64)M * GA_BN, (u64)(row * GA_BN + cc * 8), world, s);
            const u64 at = (u64)row * N + n0 + cc * 8;
            if (R) {
#pragma unroll
                for (int e = 0; e < 8; ++e) s[e] = ld1(ga_out(s[e], R, at + e));
            }
            *(V4*)(Y + at) = pack(s);
        }
    }
    END();
}

extern "C" __global__ void __launch_bounds__(GA_THREADS) peer_gemm_allreduce_ll_m16(const E* X, const E* W, E* Y, const E* R, u64 M, u64 K, u64 N, Peers P, int rank, int world, Ctl c) {
    gemm_allreduce<1, true, 1>(X, W, Y, R, M, K, N, P, rank, world, c);
}
extern "C" __global__ void __launch_bounds__(GA_THREADS) peer_gemm_allreduce_ll_m16_k2(const E* X, const E* W, E* Y, const E* R, u64 M, u64 K, u64 N, Peers P, int rank, int world, Ctl c) {
    gemm_allreduce<1, true, 2>(X, W, Y, R, M, K, N, P, rank, world, c);
}
extern "C" __global__ void __launch_bounds__(GA_THREADS) peer_gemm_allreduce_flag_m16(const E* X, const E* W, E* Y, const E* R, u64 M, u64 K, u64 N, Peers P, int rank, int world, Ctl c) {
    gemm_allreduce<1, false, 1>(X, W, Y, R, M, K, N, P, rank, world, c);
}
extern "C" __global__ void __launch_bounds__(GA_THREADS) peer_gemm_allreduce_flag_m32(const E* X, const E* W, E* Y, const E* R, u64 M, u64 K, u64 N, Peers P, int rank, int world, Ctl c) {
    gemm_allreduce<2, false, 1>(X, W, Y, R, M, K, N, P, rank, world, c);
}
#endif
