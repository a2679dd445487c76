//! A Llama decoder layer written in candle, as a serving application would run it
//! tensor-parallel over the world, with its communicating parts as fusions.
//!
//! Two forms of the layer (`--decode-form`, `--prefill-form`):
//!
//! - `tp`, tensor-parallel (the default for decode): every rank holds every token; the Q,
//!   K, V, gate and up projections are local GEMMs over this rank's heads and FFN columns
//!   (Q, K and V one GEMM; gate and up one GEMM in a decode step's fusion),
//!   and the attention-output and down projections each a GEMM followed by an AllReduce of
//!   the partial sums; a decode step runs everything after attention as one fusion (the
//!   projections with their AllReduces and residuals, the RMSNorm between them, the MLP),
//!   a step of many tokens each row-parallel projection as a pipelined fusion;
//! - `sp`, sequence-parallel (the default for prefills of more than 512 tokens; shorter
//!   ones run `tp`, the faster there as measured): each rank holds its share of the
//!   tokens, and the QKV projection (with the all-gather of the tokens), the
//!   attention-output projection (with the reduce-scatter) and the gated MLP are fusions.
//!
//! Everything else is candle, the same code in every mode: RMSNorm (a fused kernel of
//! `kernels.rs` on CUDA; the decode fusion has the post-attention one), the rotary embedding of Q and K together (one op), the KV-cache write
//! (one op: a thread per element on CUDA), and attention grouped by KV head (the query
//! heads of a KV head are extra rows of one batched GEMM over the cache, read in place,
//! never repeated; the GEMMs in the layer's dtype, a causal softmax in f32 as one op);
//! the fused ops are `kernels.rs`, their CUDA kernels compiled at run time through NVRTC
//! and launched on candle's stream. Weights come from a safetensors file through candle's loader (`--weights PATH`;
//! a random-weight file is written there first if it does not exist). A run warms up, then
//! times `--prefill-reps` prefills of `--prefill` tokens, each from an empty cache, and
//! `--decode-steps` decode steps of `--decode-tokens` tokens, on every rank; `--layers N`
//! makes each step run the layer N times (the same weights, a KV cache each), as a
//! model's step runs its layers one after another: an eager step then leaves only the
//! last layer's GPU work for after the host is done issuing it. Each fusion
//! call reads and writes buffers kept across steps, so decode calls replay their CUDA
//! graphs; with `--graph` the whole decode step is recorded as one CUDA graph on candle's
//! stream and replayed. `--candle-tp` runs candle's own tensor parallelism (a blocking NCCL
//! all-reduce per block) and `--candle-only` candle alone, for comparison. Every output is
//! checked against the same layer run by candle alone on one device in f32; the report
//! ends with a table of median times and replayed calls. `--sections` also prints, per
//! rank, where an eager step's time goes part by part (`sections.rs`), and each fusion
//! call's host time, its slot copies apart from the call and a replayed call's setup
//! phase by phase (`calls.rs`).
//!
//! ```sh
//! cargo run --release --features candle --example candle_llama -- --devices 2
//! cargo run --release --features candle --example candle_llama -- --dtype bf16 --graph
//! ```

mod app;
mod cache;
mod calls;
mod config;
mod fusions;
mod graph;
mod kernels;
mod layer;
mod ops;
mod reference;
mod report;
mod schedule;
mod sections;
mod tp;

use clap::Parser;

fn main() {
    if let Err(e) = app::run(app::Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
