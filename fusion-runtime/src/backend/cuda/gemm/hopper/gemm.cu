// A persistent GEMM for Hopper (sm_90a): C[M,N] = A[M,K] B[K,N], bf16 or f16 operands,
// f32 accumulation, C in the operands' type. One block per SM walks output tiles of
// 128 x 256 in the order `tile_at` gives. Three warpgroups per block: the first loads
// (one thread issues bulk tensor copies of A and B tiles into a ring of NS shared-memory
// stages, each completing on its `full` barrier); the other two each multiply 64 rows of
// the tile with wgmma from shared memory and release a stage on its `empty` barrier once
// their matrix instructions have read it. Because the loader runs ahead across tiles, the
// next tile's first stages load while the consumers store the last one.
//
// Operand layouts, chosen by template arguments: A is K-contiguous (row-major) or
// M-contiguous (a transposed view); B is N-contiguous (row-major) or K-contiguous. Tiles
// sit in shared memory in the 128-byte swizzle that both the copy engine and wgmma read.
// The tensor maps (built on the host) give the copy engine the global strides and bounds:
// loads past M, N or K fill zeros, and the epilogue stores only in-bounds elements.
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

#define BM 128
#define BN 256
#define BK 64
// Stages (NS) and output pieces per consumer (NP) of the plain GEMM; the ReduceScatter
// variants also run with 3 stages and 4 pieces (a whole 64 x 256 output per consumer
// staged, so an epilogue whose stores go over NVLink never waits for its own pieces).
#define STAGES 4
#define PIECES 2
#define CONSUMERS 2
#define THREADS (128 * (CONSUMERS + 1))
#define A_BYTES (BM * BK * 2)
#define B_BYTES (BN * BK * 2)
#define STAGE_BYTES (A_BYTES + B_BYTES)
// The epilogue stages a consumer's output through shared memory in pieces of 64 x 64
// (128-byte rows, swizzled like the operands), two per consumer, stored by the copy engine.
#define OUT_PIECE_BYTES (64 * 64 * 2)
// Stages, output pieces, then the barriers; 1024 bytes of slack to align for the swizzle.
#define SMEM_FOR(NS, NP) ((NS) * STAGE_BYTES + CONSUMERS * (NP) * OUT_PIECE_BYTES + 1024 + 2 * ((NS) + CONSUMERS * (NP)) * 8)
#define SMEM_BYTES SMEM_FOR(STAGES, PIECES)
// M tiles per group of the tile order: a wave of blocks shares A rows and B columns in L2.
#define GROUP_M 8

// A tensor map as the driver encodes it (opaque, 128 bytes, 64-byte aligned).
struct alignas(64) TensorMap { u64 words[16]; };

__device__ __forceinline__ u32 smem_u32(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void bar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void bar_expect_bytes(u64* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(smem_u32(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void bar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(bar)) : "memory");
}

// Waits until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void bar_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    }
}

// One 2-D box of `map` at (c0 innermost, c1) into shared memory, completing on `bar`.
__device__ __forceinline__ void load_box(void* dst, const TensorMap* map, int c0, int c1, u64* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];"
                 :: "r"(smem_u32(dst)), "l"((u64)map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
                 : "memory");
}

// A shared-memory matrix descriptor for wgmma, 128-byte swizzle. `lead` and `stride` are
// the byte offsets between core-matrix groups along the operand's two dimensions.
__device__ __forceinline__ u64 smem_desc(const void* p, u32 lead, u32 stride) {
    u64 d = 0;
    d |= (u64)((smem_u32(p) & 0x3FFFF) >> 4);
    d |= (u64)((lead >> 4) & 0x3FFF) << 16;
    d |= (u64)((stride >> 4) & 0x3FFF) << 32;
    d |= (u64)1 << 62;
    return d;
}

#include "wgmma.inc.cu"

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Tile `t` of the walk: groups of GROUP_M tile rows, each walked column by column.
__device__ __forceinline__ void tile_at(int t, int tiles_m, int tiles_n, int* tm, int* tn) {
    int per_group = GROUP_M * tiles_n;
    int group = t / per_group;
    int first_m = group * GROUP_M;
    int rows = min(tiles_m - first_m, GROUP_M);
    int in_group = t - group * per_group;
    *tm = first_m + in_group % rows;
    *tn = in_group / rows;
}

// What a GEMM+ReduceScatter call needs besides its operands. Every rank computes a
// partial product of all M rows; rows [j * rows_per, (j + 1) * rows_per) belong to rank j.
// The walk takes this rank's own row block first, then the blocks of ranks rank + 1,
// rank + 2, ... (so at any moment the ranks add into different peers). An own tile is
// stored as a plain GEMM stores it (the copy engine, from shared memory): the output needs
// no zeroing and the own partial no read-modify-write. Once a block's consumers have
// stored all their own tiles, each raises the count of its rank at every rank
// (`ready[peer]`, index rank; `epoch * RS_SHARES * CONSUMERS` once every block of the call
// has, see `block_share`).
// A peer's tile is added, in the operands' type, into its owner's output (`outs[owner]`)
// after that count: the consumers stage it in shared memory and three storer warps (the
// loader's idle warps) read it back and add it with 16-byte reductions over NVLink, so
// the tensor cores never wait for the links and the copy engine stays free for the
// operand loads. At the end each block's storers count themselves done at every owner
// (`done[owner]`, index source) and wait until every source's blocks are done here
// (every rank runs the same grid), so the output is whole when the kernel ends. The
// counters only grow; they start at zero with the first call.
//
// With `interleave` the owners take turns tile by tile (tile t goes to rank rank + t mod
// world), so the links carry the peers' tiles over the whole GEMM instead of its last
// (world - 1) / world; every tile, the own ones too, is staged and added by the storers,
// into an output the storers zero first (each block a slice) and count in `ready` before
// any add.
//
// The runtime's calls (`epoch` 0) learn the rest on the device, so that a graph may replay
// them: the epoch is this rank's `calls` word plus one (the grid's last block, counted in
// `arrived`, adds one and zeroes `arrived`), and a peer's output address (`outs[j]` 0) is
// read from rank j's `slots[j]` (a u64 address, then a u32 epoch at byte 8), where block 0
// of rank j publishes its own `outs[j]` first. A rank's next call cannot overwrite a slot
// a peer still reads: it starts after this call's `done` wait, which every peer's storers
// pass only after reading the slots.
#define MAXR 8
struct RsArgs {
    u64 outs[MAXR];  // every rank's output block (elements, row stride n), mapped here
    u64 ready[MAXR]; // u32 counters
    u64 done[MAXR];  // u32 counters
    u64 error;       // u32 word set to 1 + the peer when a wait outlasted `timeout_ns`
    u64 timeout_ns;
    int rank, world, rows_per;
    u32 epoch;       // calls so far, this one included (1, 2, ...); 0: from `calls`
    int interleave;  // owners in turn tile by tile (see above); 0: own block first
    u64 slots[MAXR]; // each rank's output-address slot, mapped here (with `outs[j]` 0)
    u64 calls;       // u32: this rank's calls so far (with `epoch` 0)
    u64 arrived;     // u32: blocks of this call past their last wait (with `epoch` 0)
};

// What an AllGather+GEMM call needs besides its operands: A is the gathered [world *
// rows_per, K] buffer, whose row blocks (rank j's rows: block j) are being copied in while
// the GEMM runs, in `chunks` pieces of rows_per / chunks rows each; `ready` (u32 words,
// index j * chunks + c) carries the call's epoch once piece c of block j is whole. This
// rank's own rows are read where they are (`own`, [rows_per, K]), never copied. The
// loader walks the own block first, then blocks rank - 1, rank - 2, ... (the order in
// which the runtime's ring loop receives them: iteration i gathers block rank - i; the
// pieces are best copied in the walk's order, so the block the GEMM reaches next is never
// the one still arriving), and loads a piece's rows only after its word says so; the
// consumers see nothing of this.
//
// After its last wait a block counts itself in `arrived`; the last of the grid zeroes every
// ready word and the count, so a call replayed from a graph (its epoch baked in) starts from
// zeroed words like a fresh one. The copies of the next call start after this kernel ended
// (their streams wait for the call's start, which follows this call's end).
struct AgArgs {
    TensorMap own;
    u64 arrived;     // u32 counter, zero between calls
    int chunks;
    u64 ready;
    u64 error;       // u32 word set to 1 + the block when a wait outlasted `timeout_ns`
    u64 timeout_ns;
    int rank, world, rows_per;
    u32 epoch;
    u64 bias;        // 0, or a vector [n] of the operands' type added to every row
    int act;         // applied after the bias (ACT_*)
    // With `glu`, a gated product: C = act(A B) * (A up), B and `up` [K, n] alike (the
    // gated MLP's gate and up weights). A tile is 128 output columns: its B stage holds
    // those columns of B (boxes 0-1) and of `up` (boxes 2-3), so a thread holds a gate
    // value in accumulator group j and its up value in group j + 16 (no bias).
    TensorMap up;
    int glu;
    // With `aux_save` (no glu), the f32 result after the bias and before the activation is
    // also stored through `aux_map`, the output's map at another address: a training
    // forward keeps the pre-activation its backward reads.
    int aux_save;
    TensorMap aux_map;
};

// The activations an AllGather+GEMM's epilogue applies in f32 before its one rounding.
// tanh is the hardware's approximation (`tanh.approx.f32`, relative error below 2^-10.9,
// under a bf16 or f16 rounding), sigmoid is 0.5 + 0.5 tanh(x / 2); gelu uses erff.
#define ACT_NONE 0
#define ACT_RELU 1
#define ACT_GELU 2
#define ACT_GELU_TANH 3
#define ACT_SILU 4
#define ACT_SIGMOID 5
#define ACT_TANH 6
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int ACT> __device__ __forceinline__ float activate(float x) {
    if (ACT == ACT_RELU) return fmaxf(x, 0.0f);
    if (ACT == ACT_GELU) return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
    if (ACT == ACT_GELU_TANH) return 0.5f * x * (1.0f + tanh_approx(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    if (ACT == ACT_SILU) return x * (0.5f + 0.5f * tanh_approx(0.5f * x));
    if (ACT == ACT_SIGMOID) return 0.5f + 0.5f * tanh_approx(0.5f * x);
    if (ACT == ACT_TANH) return tanh_approx(x);
    return x;
}

__device__ __forceinline__ float half_to_float(u16 v, bool f16) {
    if (!f16) return __uint_as_float((u32)v << 16);
    float f;
    asm("{.reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h;}" : "=f"(f) : "h"(v));
    return f;
}

// Adds the bias (columns col0.. of a consumer's 64 x 256 accumulators, see `write_piece`
// for the layout; columns past n get none) and applies activation ACT, in place. Straight
// code for one activation: the kernel runs the one its call asks for (`apply_epilogue`).
template <bool F16, int ACT>
__device__ __forceinline__ void apply_epilogue_of(float* d, u64 bias, int col0, int n) {
    int t = threadIdx.x % 128;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            int col = col0 + 8 * j + 2 * (t % 4) + e;
            float b = (bias != 0 && col < n) ? half_to_float(((const u16*)bias)[col], F16) : 0.0f;
#pragma unroll
            for (int h = 0; h < 2; ++h) d[4 * j + 2 * h + e] = activate<ACT>(d[4 * j + 2 * h + e] + b);
        }
    }
}

// A gated product's epilogue: accumulator groups j < 16 hold the gate, j + 16 the up
// values of the same columns; the result act(gate) * up goes to groups j < 16.
template <int ACT> __device__ __forceinline__ void apply_gate_of(float* d) {
#pragma unroll
    for (int i = 0; i < 64; ++i) d[i] = activate<ACT>(d[i]) * d[i + 64];
}

__device__ __forceinline__ void apply_gate(float* d, int act) {
    switch (act) {
    case ACT_RELU: apply_gate_of<ACT_RELU>(d); break;
    case ACT_GELU: apply_gate_of<ACT_GELU>(d); break;
    case ACT_GELU_TANH: apply_gate_of<ACT_GELU_TANH>(d); break;
    case ACT_SILU: apply_gate_of<ACT_SILU>(d); break;
    case ACT_SIGMOID: apply_gate_of<ACT_SIGMOID>(d); break;
    case ACT_TANH: apply_gate_of<ACT_TANH>(d); break;
    default: apply_gate_of<ACT_NONE>(d); break;
    }
}

template <bool F16>
__device__ __forceinline__ void apply_epilogue(float* d, u64 bias, int act, int col0, int n) {
    switch (act) {
    case ACT_RELU: apply_epilogue_of<F16, ACT_RELU>(d, bias, col0, n); break;
    case ACT_GELU: apply_epilogue_of<F16, ACT_GELU>(d, bias, col0, n); break;
    case ACT_GELU_TANH: apply_epilogue_of<F16, ACT_GELU_TANH>(d, bias, col0, n); break;
    case ACT_SILU: apply_epilogue_of<F16, ACT_SILU>(d, bias, col0, n); break;
    case ACT_SIGMOID: apply_epilogue_of<F16, ACT_SIGMOID>(d, bias, col0, n); break;
    case ACT_TANH: apply_epilogue_of<F16, ACT_TANH>(d, bias, col0, n); break;
    default: apply_epilogue_of<F16, ACT_NONE>(d, bias, col0, n); break;
    }
}

// What the auxiliary-matrix entries (HOPPER_GEMM_SLOPE, HOPPER_GEMM_ADD) combine the
// product with before its one rounding: an auxiliary matrix shaped as C, of the operands'
// type, read through `aux_map` (C's map at another address, or C's own). The slope entry
// multiplies by the derivative of its activation (ACT_*, a template argument) at it: a
// backward's dH = (dY W^T) * act'(H) in one kernel. The add entry adds it: C += A B (in
// place) or C = A B + X, as cuBLAS's beta = 1. A consumer's 64 x 256 block of it is loaded
// by the copy engine into the consumer's four output pieces after the tile's first k-block
// (the entries run with 3 stages and 4 pieces, as the ReduceScatter entry does), so the
// epilogue reads it from shared memory.
struct AuxArgs {
    TensorMap aux_map;
};

// The auxiliary-matrix mode of the add entry (the slope entries' is their ACT_* code).
#define AUX_ADD 100

// The derivative of activation ACT at x, in f32; tanh and the sigmoid as `activate` takes
// them (the hardware's tanh approximation), erf and exp in full precision.
template <int ACT> __device__ __forceinline__ float slope(float x) {
    if (ACT == ACT_RELU) return x > 0.0f ? 1.0f : 0.0f;
    if (ACT == ACT_GELU)
        return 0.5f * (1.0f + erff(x * 0.70710678118654752f)) + x * 0.3989422804014327f * expf(-0.5f * x * x);
    if (ACT == ACT_GELU_TANH) {
        float t = tanh_approx(0.7978845608028654f * (x + 0.044715f * x * x * x));
        return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * x * x);
    }
    if (ACT == ACT_SILU) {
        float s = 0.5f + 0.5f * tanh_approx(0.5f * x);
        return s * (1.0f + x * (1.0f - s));
    }
    if (ACT == ACT_SIGMOID) {
        float s = 0.5f + 0.5f * tanh_approx(0.5f * x);
        return s * (1.0f - s);
    }
    if (ACT == ACT_TANH) {
        float t = tanh_approx(x);
        return 1.0f - t * t;
    }
    return 1.0f;
}

// Combines a consumer's 64 x 256 accumulators (the layout of `write_piece`) with the
// auxiliary block the copy engine loaded into its four pieces (64 x 64 each, in the swizzle
// `write_piece` writes), read a pair of columns (one word) at a time: adds it (AUX_ADD) or
// multiplies by slope<AUX> of it.
template <int AUX> __device__ __forceinline__ float combine(float d, float x) {
    if (AUX == AUX_ADD) return d + x;
    return d * slope<AUX>(x);
}

template <bool F16, int AUX>
__device__ __forceinline__ void apply_aux(float* d, const unsigned char* pieces) {
    int t = threadIdx.x % 128;
    int row = (t / 32) * 16 + (t % 32) / 4;
#pragma unroll
    for (int q = 0; q < BN / 64; ++q) {
        const unsigned char* piece = pieces + q * OUT_PIECE_BYTES;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int r = row + 8 * h, i = 4 * (8 * q + jj) + 2 * h;
                u32 x = *(const u32*)(piece + r * 128 + ((jj ^ (r % 8)) * 16) + 4 * (t % 4));
                d[i] = combine<AUX>(d[i], half_to_float((u16)(x & 0xffff), F16));
                d[i + 1] = combine<AUX>(d[i + 1], half_to_float((u16)(x >> 16), F16));
            }
        }
    }
}

__device__ __forceinline__ u64 now_ns() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ u32 ld_acquire(u64 p) {
    u32 v; asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}

__device__ __forceinline__ void st_release(u64 p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_add(u64 p, u32 v) {
    asm volatile("red.release.sys.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

// Waits until `ready(word)` holds, at most the timeout; false (and the error word set to
// 1 + `peer`) when it gave up. The error word may be host memory (the runtime's status
// word, which the host also sets to let every wait through): it is read once every 1024
// polls, as is the clock, so the spinning blocks do not keep the PCIe link busy with reads
// that the copy engines' hand-offs (flags in host memory too) then wait behind.
template <typename Ready>
__device__ __forceinline__ bool wait_word(u64 error, u64 timeout_ns, u64 word, int peer, Ready ready) {
    if (ready(ld_acquire(word))) return true;
    u64 start = now_ns();
    u32 polls = 0;
    while (!ready(ld_acquire(word))) {
        if ((++polls & 1023) != 0) continue;
        if (ld_acquire(error) != 0 || now_ns() - start > timeout_ns) {
            atomicCAS((u32*)error, 0u, (u32)(peer + 1));
            return false;
        }
    }
    return true;
}

// How the tiles are walked. PLAIN: grouped tile rows. RS and AG: row block after row
// block, this rank's first (see RsArgs, AgArgs); `tiles_m` counts one block's tile rows.
#define WALK_PLAIN 0
#define WALK_RS 1
#define WALK_AG 2
#define WALK_RS_INTERLEAVED 3
struct Walk { int kind, rank, world, rows_per, chunks, bn; }; // bn: a tile's columns

// Where tile `t` of the walk is: the row of A it starts at, its first column, its owner
// (its row block; -1 in a plain walk), its index in the owner's block, and its first row
// in the output.
struct TilePlace { int a_row, col, owner, local, out_row, chunk; };

__device__ __forceinline__ TilePlace place_tile(int t, int tiles_m, int tiles_n, const Walk& w) {
    TilePlace p;
    p.chunk = 0;
    int tm, tn;
    if (w.kind == WALK_PLAIN) {
        tile_at(t, tiles_m, tiles_n, &tm, &tn);
        p.a_row = tm * BM; p.out_row = tm * BM; p.owner = -1; p.local = t;
    } else if (w.kind == WALK_RS) {
        int per_block = tiles_m * tiles_n;
        int pos = t / per_block;
        p.local = t - pos * per_block;
        p.owner = (w.rank + pos) % w.world;
        tile_at(p.local, tiles_m, tiles_n, &tm, &tn);
        p.a_row = p.owner * w.rows_per + tm * BM;
        p.out_row = tm * BM;
    } else if (w.kind == WALK_RS_INTERLEAVED) {
        int pos = t % w.world;
        p.local = t / w.world;
        p.owner = (w.rank + pos) % w.world;
        tile_at(p.local, tiles_m, tiles_n, &tm, &tn);
        p.a_row = p.owner * w.rows_per + tm * BM;
        p.out_row = tm * BM;
    } else {
        int per_block = tiles_m * tiles_n;
        int pos = t / per_block;
        p.local = t - pos * per_block;
        p.owner = (w.rank + w.world - pos) % w.world;
        tile_at(p.local, tiles_m, tiles_n, &tm, &tn);
        p.chunk = tm / (tiles_m / w.chunks);
        p.a_row = p.owner * w.rows_per + tm * BM;
        p.out_row = p.a_row;
    }
    p.col = tn * w.bn;
    return p;
}

__device__ __forceinline__ u32 pack2(float lo, float hi, bool f16) {
    u32 r;
    if (f16) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Barrier among the 128 threads of consumer warpgroup `consumer` (ids 1.. ; 0 is __syncthreads).
__device__ __forceinline__ void consumer_sync(int consumer) {
    asm volatile("bar.sync %0, 128;" :: "r"(consumer + 1) : "memory");
}

// Stores a 64 x 64 box of shared memory at (c0 innermost, c1) of `map`; the copy engine
// clips what falls outside the tensor.
__device__ __forceinline__ void store_box(const TensorMap* map, int c0, int c1, const void* src) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];"
                 :: "l"((u64)map), "r"(c0), "r"(c1), "r"(smem_u32(src)) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until at most N of this thread's bulk stores still read shared memory.
template <int N> __device__ __forceinline__ void stores_read_wait() {
    asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}

// Writes columns 64q..64q+63 of a consumer's 64 x 256 accumulators into a 64 x 64 piece of
// shared memory. Thread layout of m64nNk16: warp w owns rows 16w..16w+15; lane l holds, per
// 8 columns j, rows l/4 and l/4+8, columns 2(l%4) and +1. In a piece, row r's 16-byte
// chunk j sits at chunk j ^ (r % 8) (the 128-byte swizzle the copy engine reads), so a
// warp's stores hit 32 different banks.
template <bool F16>
__device__ __forceinline__ void write_piece(const float* d, unsigned char* piece, int q) {
    int t = threadIdx.x % 128;
    int row = (t / 32) * 16 + (t % 32) / 4;
#pragma unroll
    for (int jj = 0; jj < 8; ++jj) {
        int j = 8 * q + jj;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int r = row + 8 * h;
            u32 v = pack2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1], F16);
            *(u32*)(piece + r * 128 + ((jj ^ (r % 8)) * 16) + 4 * (t % 4)) = v;
        }
    }
}

// Stores a consumer's 64 x 256 accumulators (their first 64 qn columns) at rows m0..,
// columns n0.. of C through its NP shared-memory pieces, 64 columns at a time, each stored
// by the copy engine.
template <bool F16, int NP>
__device__ __forceinline__ void store_tile(const float* d, unsigned char* out, const TensorMap* c_map,
                                           int consumer, int m0, int n0, int qn = BN / 64) {
    int t = threadIdx.x % 128;
#pragma unroll
    for (int q = 0; q < BN / 64; ++q) {
        if (q >= qn) break;
        unsigned char* piece = out + (q % NP) * OUT_PIECE_BYTES;
        if (t == 0) stores_read_wait<NP - 1>();
        consumer_sync(consumer);
        write_piece<F16>(d, piece, q);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        consumer_sync(consumer);
        if (t == 0) store_box(c_map, n0 + 64 * q, m0, piece);
    }
}

// Barrier among the storer warps (warps 1-3).
__device__ __forceinline__ void storer_sync() {
    asm volatile("bar.sync %0, 96;" :: "r"(CONSUMERS + 1) : "memory");
}

__device__ __forceinline__ void red_add_v4(u64 p, uint4 v, bool f16) {
    if (f16)
        asm volatile("red.relaxed.sys.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};"
                     :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    else
        asm volatile("red.relaxed.sys.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};"
                     :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// What a call's blocks add to each `ready` (per consumer) and `done` counter together,
// whatever the grid (at most RS_SHARES blocks): block 0 adds RS_SHARES - (grid - 1), the
// others 1 each, so a counter holds epoch * RS_SHARES once a call's blocks all counted,
// and calls with different grids (other shapes) share the counters.
#define RS_SHARES 1024u
__device__ __forceinline__ u32 block_share() { return blockIdx.x == 0 ? RS_SHARES - (gridDim.x - 1) : 1u; }

// A GEMM+ReduceScatter consumer's own tiles are stored (its copy-engine stores complete,
// then ordered before everything after at system scope): it counts itself at every rank,
// so peers may add into those tiles. Its pieces are free for staging again after this.
__device__ __forceinline__ void count_own_stored(const RsArgs* rs, int consumer) {
    if (threadIdx.x % 128 == 0) {
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        asm volatile("fence.proxy.async.global;" ::: "memory");
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        for (int peer = 0; peer < rs->world; ++peer)
            red_release_add(rs->ready[peer] + 4 * (u64)rs->rank, block_share());
    }
    consumer_sync(consumer);
}

// The storers' side of a GEMM+ReduceScatter (see RsArgs): for every peer's tile of the
// walk and every consumer's piece, wait until it is staged, add it into the owner's
// output, free it. `staged` / `freed`: per consumer and piece, barriers the consumers and
// the storers arrive on once per peer's tile.
template <bool F16, int NP>
__device__ __forceinline__ void store_tiles_to_owners(const RsArgs* rs, const Walk& walk, unsigned char* out,
                                                      u64* staged, u64* freed, int tiles, int tiles_m,
                                                      int tiles_n, int n) {
    static_assert(NP == BN / 64, "the storers take a whole staged tile");
    int s = threadIdx.x - 32; // 0..95
    u32 ready_mask = 0;
    u32 phase = 0;
    bool interleaved = walk.kind == WALK_RS_INTERLEAVED;
    __shared__ u64 s_outs[MAXR];
    __shared__ u32 s_epoch;
    if (s == 0) {
        u32 epoch = rs->epoch;
        if (epoch == 0) epoch = ld_acquire(rs->calls) + 1;
        s_epoch = epoch;
        if (blockIdx.x == 0 && rs->outs[rs->rank] != 0 && rs->slots[rs->rank] != 0) {
            *(volatile u64*)rs->slots[rs->rank] = rs->outs[rs->rank];
            st_release(rs->slots[rs->rank] + 8, epoch);
        }
        for (int j = 0; j < rs->world; ++j) {
            u64 out_j = rs->outs[j];
            // A wait that gave up (the peer failed, or the world let every wait through)
            // leaves no address: nothing is added there.
            if (out_j == 0 && wait_word(rs->error, rs->timeout_ns, rs->slots[j] + 8, j,
                                        [epoch](u32 v) { return v == epoch; }))
                out_j = *(volatile u64*)rs->slots[j];
            s_outs[j] = out_j;
        }
    }
    storer_sync();
    const u32 epoch = s_epoch;
    if (interleaved) {
        // Zero this block's slice of the own output, then count it at every rank.
        u64 vecs = (u64)rs->rows_per * n / 8, per = (vecs + gridDim.x - 1) / gridDim.x;
        u64 v0 = blockIdx.x * per, v1 = min(vecs, v0 + per);
        uint4* own_out = (uint4*)s_outs[rs->rank];
#ifndef RS_PROBE_NO_ZERO // harness probes (bench/hopper_gemm/self_harness.cu): timing only
        for (u64 v = v0 + s; v < v1; v += 96) own_out[v] = make_uint4(0, 0, 0, 0);
#else
        (void)own_out; (void)v0; (void)v1;
#endif
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        storer_sync();
        if (s == 0)
            for (int peer = 0; peer < rs->world; ++peer)
                red_release_add(rs->ready[peer] + 4 * (u64)rs->rank, CONSUMERS * block_share());
    }
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        TilePlace p = place_tile(t, tiles_m, tiles_n, walk);
        if (p.owner == rs->rank && !interleaved) continue; // stored by the consumers
        if (!(ready_mask & (1u << p.owner))) {
#ifndef RS_PROBE_NO_WAITS // harness probe (timing only): no rank waits for another
            if (s == 0) {
                u32 target = epoch * RS_SHARES * CONSUMERS;
                wait_word(rs->error, rs->timeout_ns, rs->ready[rs->rank] + 4 * (u64)p.owner, p.owner,
                          [target](u32 v) { return (int)(v - target) >= 0; });
            }
#endif
            storer_sync();
            ready_mask |= 1u << p.owner;
        }
        const u16* dst = (const u16*)s_outs[p.owner];
        for (int c = 0; c < CONSUMERS; ++c) {
#pragma unroll
            for (int q = 0; q < NP; ++q) {
                bar_wait(&staged[c * NP + q], phase);
                const unsigned char* piece = out + (c * NP + q) * OUT_PIECE_BYTES;
                int row0 = p.out_row + c * 64, col0 = p.col + 64 * q;
                // 512 chunks of 16 bytes: chunk i is row i / 8, 16-byte column i % 8.
                for (int i = s; i < 512; i += 96) {
                    int r = i / 8, j = i % 8;
                    int row = row0 + r, col = col0 + 8 * j;
                    uint4 v = *(const uint4*)(piece + r * 128 + ((j ^ (r % 8)) * 16));
#if defined(RS_PROBE_NO_ADDS)
                    if (v.x == 0x7fc07fc0u && v.y == 0x12345678u) s_outs[0] = 0; // keep the read
#elif defined(RS_PROBE_STORES)
                    if (dst != nullptr && row < rs->rows_per && col < n)
                        *(uint4*)(dst + (u64)row * n + col) = v;
#else
                    if (dst != nullptr && row < rs->rows_per && col < n)
                        red_add_v4((u64)(dst + (u64)row * n + col), v, F16);
#endif
                }
                storer_sync();
                if (s == 0) bar_arrive(&freed[c * NP + q]);
            }
        }
        phase ^= 1;
    }
    // Done here: every add of this block is ordered before the count at every owner.
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    storer_sync();
    if (s == 0) {
        for (int owner = 0; owner < rs->world; ++owner)
            red_release_add(rs->done[owner] + 4 * (u64)rs->rank, block_share());
        u32 target = epoch * RS_SHARES;
#ifndef RS_PROBE_NO_WAITS
        for (int src = 0; src < rs->world; ++src)
            wait_word(rs->error, rs->timeout_ns, rs->done[rs->rank] + 4 * (u64)src, src,
                      [target](u32 v) { return (int)(v - target) >= 0; });
#else
        (void)target;
#endif
        // The runtime's calls: the grid's last block counts the call.
        if (rs->epoch == 0 && atomicAdd((u32*)rs->arrived, 1u) == gridDim.x - 1) {
            *(volatile u32*)rs->arrived = 0;
            *(volatile u32*)rs->calls = epoch;
            __threadfence_system();
        }
    }
}

// A_MN: A is M-contiguous (its map's inner dimension is M); B_K: B is K-contiguous.
// WALK (see Walk): WALK_RS a GEMM+ReduceScatter (`rs`, see RsArgs), WALK_AG an
// AllGather+GEMM (`ag`, see AgArgs); the other is null. With either, `m` is the rows of one
// row block.
// AUX (a plain walk only): the product combined with an auxiliary matrix (`ax`, see
// AuxArgs): times slope<AUX>(aux) for an ACT_* code, plus aux for AUX_ADD; ACT_NONE: none.
template <bool F16, bool A_MN, bool B_K, int NS, int NP, int WALK, int AUX = ACT_NONE>
__device__ __forceinline__ void gemm_body(const TensorMap* a_map, const TensorMap* b_map,
                                          const TensorMap* c_map, int m, int n, int k,
                                          const RsArgs* rs, const AgArgs* ag,
                                          const AuxArgs* ax = nullptr) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* smem = (unsigned char*)(((u64)smem_raw + 1023) & ~(u64)1023);
    unsigned char* out = smem + NS * STAGE_BYTES;
    u64* full = (u64*)(out + CONSUMERS * NP * OUT_PIECE_BYTES);
    u64* empty = full + NS;
    u64* staged = empty + NS;             // [CONSUMERS][NP], with `rs`
    u64* freed = staged + CONSUMERS * NP; // [CONSUMERS][NP], with `rs`
    u64* aux_loaded = staged;             // [CONSUMERS], with AUX (no `rs`)
    int wg = threadIdx.x / 128;
    Walk walk = {WALK, 0, 1, m, 1, BN};
    if (WALK == WALK_RS) walk = {rs->interleave ? WALK_RS_INTERLEAVED : WALK_RS, rs->rank, rs->world, rs->rows_per, 1, BN};
    if (WALK == WALK_AG) walk = {WALK, ag->rank, ag->world, ag->rows_per, ag->chunks, ag->glu ? BN / 2 : BN};
    int tiles_m = (m + BM - 1) / BM, tiles_n = (n + walk.bn - 1) / walk.bn;
    int tiles = tiles_m * tiles_n * walk.world;
    int k_blocks = (k + BK - 1) / BK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < NS; ++s) {
            bar_init(&full[s], 1);
            bar_init(&empty[s], CONSUMERS * 4);
        }
        if (WALK == WALK_RS)
            for (int i = 0; i < CONSUMERS * NP; ++i) {
                bar_init(&staged[i], 1);
                bar_init(&freed[i], 1);
            }
        if (AUX != ACT_NONE)
            for (int c = 0; c < CONSUMERS; ++c) bar_init(&aux_loaded[c], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x == 0) {
            int stage = 0;
            u32 phase = 0;
            u64 ready_mask = 0; // bit j * chunks + c: piece c of block j seen ready
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                TilePlace p = place_tile(t, tiles_m, tiles_n, walk);
                const TensorMap* a_src = a_map;
                if (WALK == WALK_AG && p.owner == ag->rank) {
                    a_src = &ag->own;
                    p.a_row -= p.owner * ag->rows_per;
                } else if (WALK == WALK_AG) {
                    int word = p.owner * ag->chunks + p.chunk;
                    if (!(ready_mask & (1ull << word))) {
                        u32 epoch = ag->epoch;
                        wait_word(ag->error, ag->timeout_ns, ag->ready + 4 * (u64)word, p.owner,
                                  [epoch](u32 f) { return f == epoch; });
                        ready_mask |= 1ull << word;
                    }
                }
                for (int kb = 0; kb < k_blocks; ++kb) {
                    bar_wait(&empty[stage], phase ^ 1);
                    unsigned char* sa = smem + stage * STAGE_BYTES;
                    unsigned char* sb = sa + A_BYTES;
                    bar_expect_bytes(&full[stage], STAGE_BYTES);
                    if (A_MN) {
                        // Boxes of 64 (m) x 64 (k): two per tile.
                        for (int i = 0; i < BM / 64; ++i)
                            load_box(sa + i * 64 * BK * 2, a_src, p.a_row + 64 * i, kb * BK, &full[stage]);
                    } else {
                        load_box(sa, a_src, kb * BK, p.a_row, &full[stage]);
                    }
                    if (B_K) {
                        load_box(sb, b_map, kb * BK, p.col, &full[stage]);
                    } else {
                        // Boxes of 64 (n) x 64 (k): four per tile.
                        for (int i = 0; i < BN / 64; ++i) {
                            // A gated product's tile: its columns of B, then of `up`.
                            bool up = WALK == WALK_AG && ag->glu && i >= 2;
                            int col = WALK == WALK_AG && ag->glu ? p.col + 64 * (i % 2) : p.col + 64 * i;
                            load_box(sb + i * 64 * BK * 2, up ? &ag->up : b_map, col, kb * BK, &full[stage]);
                        }
                    }
                    if (++stage == NS) { stage = 0; phase ^= 1; }
                }
            }
            if (WALK == WALK_AG) {
                __threadfence();
                if (atomicAdd((u32*)ag->arrived, 1u) == gridDim.x - 1) {
                    for (int i = 0; i < ag->world * ag->chunks; ++i) ((volatile u32*)ag->ready)[i] = 0;
                    *(volatile u32*)ag->arrived = 0;
                    __threadfence_system();
                }
            }
        } else if constexpr (WALK == WALK_RS) {
            if (threadIdx.x >= 32)
                store_tiles_to_owners<F16, NP>(rs, walk, out, staged, freed, tiles, tiles_m, tiles_n, n);
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        int consumer = wg - 1;
        float d[128];
        int stage = 0;
        u32 phase = 0, tile_phase = 0; // tile_phase: RS, peers' tiles staged so far, mod 2;
        (void)tile_phase;              // AUX, auxiliary blocks loaded so far, mod 2
        bool own_stored = false; // RS: this consumer's own tiles stored and counted
        unsigned char* my_pieces = out + consumer * NP * OUT_PIECE_BYTES;
        // AUX: the tile's auxiliary block into this consumer's pieces, once the last
        // tile's stores have read them (an async-proxy write after the generic writes that
        // `store_tile` fenced); issued after the first k-block, so the wait finds the
        // stores done.
        auto load_aux_block = [&](const TilePlace& p) {
            if (threadIdx.x % 128 != 0) return;
            stores_read_wait<0>();
            bar_expect_bytes(&aux_loaded[consumer], NP * OUT_PIECE_BYTES);
            for (int q = 0; q < NP; ++q)
                load_box(my_pieces + q * OUT_PIECE_BYTES, &ax->aux_map, p.col + 64 * q,
                         p.out_row + consumer * 64, &aux_loaded[consumer]);
        };
        (void)load_aux_block;
        for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
            TilePlace p = place_tile(t, tiles_m, tiles_n, walk);
            bool own = true; // a tile of this rank's output
            if constexpr (WALK == WALK_RS) {
                own = p.owner == rs->rank && !rs->interleave; // interleaved: all staged
                if (!own && !own_stored && !rs->interleave) {
                    count_own_stored(rs, consumer);
                    own_stored = true;
                }
            }
            int prev = -1;
            for (int kb = 0; kb < k_blocks; ++kb) {
                bar_wait(&full[stage], phase);
                unsigned char* sa = smem + stage * STAGE_BYTES;
                unsigned char* sb = sa + A_BYTES;
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    u64 da, db;
                    if (A_MN) // 64 (m) x 64 (k) box of this consumer; 16 k rows per step
                        da = smem_desc(sa + consumer * 64 * BK * 2 + kk * 16 * 128, 64 * BK * 2, 1024);
                    else // rows of 64 k; this consumer's 64 rows; 16 k per step
                        da = smem_desc(sa + consumer * 64 * 128 + kk * 32, 16, 1024);
                    if (B_K)
                        db = smem_desc(sb + kk * 32, 16, 1024);
                    else // four 64 (n) x 64 (k) boxes, 8 KB apart
                        db = smem_desc(sb + kk * 16 * 128, 64 * BK * 2, 1024);
                    int acc = (kb > 0 || kk > 0) ? 1 : 0;
                    if (F16) wgmma_f16(d, da, db, acc, A_MN ? 1 : 0, B_K ? 0 : 1);
                    else wgmma_bf16(d, da, db, acc, A_MN ? 1 : 0, B_K ? 0 : 1);
                }
                wgmma_commit();
                // Keep this step's instructions in flight; the previous step's are done,
                // so its stage goes back to the loader.
                wgmma_wait<1>();
                if (prev >= 0 && threadIdx.x % 32 == 0) bar_arrive(&empty[prev]);
                if constexpr (AUX != ACT_NONE) {
                    if (kb == 0) load_aux_block(p);
                }
                prev = stage;
                if (++stage == NS) { stage = 0; phase ^= 1; }
            }
            wgmma_wait<0>();
            if (prev >= 0 && threadIdx.x % 32 == 0) bar_arrive(&empty[prev]);
            if (k_blocks == 0) {
#pragma unroll
                for (int i = 0; i < 128; ++i) d[i] = 0.f;
                if constexpr (AUX != ACT_NONE) load_aux_block(p);
            }
            int qn = BN / 64; // output pieces of the tile
            unsigned char* pieces = out + consumer * NP * OUT_PIECE_BYTES;
            if constexpr (WALK == WALK_AG) {
                int row0 = p.out_row + consumer * 64;
                if (ag->glu) {
                    apply_gate(d, ag->act);
                    qn = BN / 128;
                } else if (ag->aux_save) {
                    if (ag->bias != 0) apply_epilogue<F16>(d, ag->bias, ACT_NONE, p.col, n);
                    store_tile<F16, NP>(d, pieces, &ag->aux_map, consumer, row0, p.col, qn);
                    if (ag->act != ACT_NONE) apply_epilogue<F16>(d, 0, ag->act, p.col, n);
                } else if (ag->bias != 0 || ag->act != ACT_NONE) {
                    apply_epilogue<F16>(d, ag->bias, ag->act, p.col, n);
                }
            }
            if constexpr (AUX != ACT_NONE) {
                static_assert(NP == BN / 64, "the auxiliary block fills the pieces");
                bar_wait(&aux_loaded[consumer], tile_phase);
                tile_phase ^= 1;
                apply_aux<F16, AUX>(d, my_pieces);
            }
            if (WALK != WALK_RS || own) {
                store_tile<F16, NP>(d, pieces, c_map, consumer, p.out_row + consumer * 64, p.col, qn);
            } else if constexpr (WALK == WALK_RS) {
                // A peer's tile: staged for the storers, one piece at a time.
#pragma unroll
                for (int q = 0; q < NP; ++q) {
                    bar_wait(&freed[consumer * NP + q], tile_phase ^ 1);
#ifndef RS_PROBE_NO_STAGING
                    write_piece<F16>(d, pieces + q * OUT_PIECE_BYTES, q);
#endif
                    consumer_sync(consumer);
                    if (threadIdx.x % 128 == 0) bar_arrive(&staged[consumer * NP + q]);
                }
                tile_phase ^= 1;
            }
        }
        if constexpr (WALK == WALK_RS) {
            if (!own_stored && !rs->interleave) count_own_stored(rs, consumer);
        }
        if (threadIdx.x % 128 == 0) stores_read_wait<0>();
    }
}

#define HOPPER_GEMM(NAME, F16, A_MN, B_K)                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                 \
    NAME(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,  \
         const __grid_constant__ TensorMap c_map, int m, int n, int k) {                     \
        gemm_body<F16, A_MN, B_K, STAGES, PIECES, WALK_PLAIN>(&a_map, &b_map, &c_map, m, n, k, nullptr, nullptr); \
    }

// GEMM+ReduceScatter: `c_map` is this rank's output block (rows_per x n), `m` = rows_per;
// NS stages, NP output pieces per consumer (shared memory: SMEM_FOR(NS, NP)).
#define HOPPER_GEMM_RS(NAME, F16, A_MN, B_K, NS, NP)                                          \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                 \
    NAME(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,  \
         const __grid_constant__ TensorMap c_map, int m, int n, int k,                       \
         const __grid_constant__ RsArgs rs) {                                               \
        gemm_body<F16, A_MN, B_K, NS, NP, WALK_RS>(&a_map, &b_map, &c_map, m, n, k, &rs, nullptr); \
    }

// AllGather+GEMM: A is the gathered buffer (see AgArgs), `c_map` the whole output, `m` =
// rows_per.
#define HOPPER_GEMM_AG(NAME, F16, A_MN, B_K)                                                  \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                 \
    NAME(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,  \
         const __grid_constant__ TensorMap c_map, int m, int n, int k,                       \
         const __grid_constant__ AgArgs ag) {                                               \
        gemm_body<F16, A_MN, B_K, STAGES, PIECES, WALK_AG>(&a_map, &b_map, &c_map, m, n, k, nullptr, &ag); \
    }

// A GEMM whose product is combined with an auxiliary matrix (see AuxArgs) in mode AUX;
// 3 stages and 4 pieces a consumer (shared memory: SMEM_FOR(3, 4), within the plain
// entry's). The slope entries (AUX an ACT_* code) and the add entry (AUX_ADD).
#define HOPPER_GEMM_AUX(NAME, F16, A_MN, B_K, AUX)                                            \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                 \
    NAME(const __grid_constant__ TensorMap a_map, const __grid_constant__ TensorMap b_map,  \
         const __grid_constant__ TensorMap c_map, int m, int n, int k,                       \
         const __grid_constant__ AuxArgs ax) {                                              \
        gemm_body<F16, A_MN, B_K, 3, 4, WALK_PLAIN, AUX>(&a_map, &b_map, &c_map, m, n, k, nullptr, nullptr, &ax); \
    }
#define HOPPER_GEMM_SLOPE(NAME, F16, A_MN, B_K, ACT) HOPPER_GEMM_AUX(NAME, F16, A_MN, B_K, ACT)
#define HOPPER_GEMM_ADD(NAME, F16, A_MN, B_K) HOPPER_GEMM_AUX(NAME, F16, A_MN, B_K, AUX_ADD)

#ifdef ALL_VARIANTS
HOPPER_GEMM(hopper_gemm_bf16_nn, false, false, false)
HOPPER_GEMM(hopper_gemm_bf16_nt, false, false, true)
HOPPER_GEMM(hopper_gemm_bf16_tn, false, true, false)
HOPPER_GEMM(hopper_gemm_bf16_tt, false, true, true)
HOPPER_GEMM(hopper_gemm_f16_nn, true, false, false)
HOPPER_GEMM(hopper_gemm_f16_nt, true, false, true)
HOPPER_GEMM(hopper_gemm_f16_tn, true, true, false)
HOPPER_GEMM_RS(hopper_gemm_rs_bf16_nn, false, false, false, 3, 4)
HOPPER_GEMM_RS(hopper_gemm_rs_f16_nn, true, false, false, 3, 4)
HOPPER_GEMM_AG(hopper_gemm_ag_bf16_nn, false, false, false)
HOPPER_GEMM_AG(hopper_gemm_ag_f16_nn, true, false, false)
HOPPER_GEMM_SLOPE(hopper_gemm_slope3_bf16_nt, false, false, true, ACT_GELU_TANH)
HOPPER_GEMM_ADD(hopper_gemm_add_bf16_nn, false, false, false)
#endif
