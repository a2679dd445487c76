//! A Llama decoder layer written in candle whose tensor-parallel parts are fusions.
//!
//! The layer (RMSNorm, rotary attention with grouped KV heads and a KV cache, SiLU-gated
//! MLP) runs sequence- and tensor-parallel over the world: each rank holds its share of
//! the tokens and of every weight; the QKV projection (with the all-gather of the tokens),
//! the attention-output projection (with the reduce-scatter) and the gated MLP block are
//! fusions, the rest is candle. Weights come from a safetensors file through candle's
//! loader (`--weights PATH`; a random-weight file is written there first if it does not
//! exist). It runs a prefill of `--prefill` tokens and `--decode-steps` decode steps of
//! `--decode-tokens` tokens, checks every rank's output of every step against the same
//! layer run by candle alone on one device in f32, and prints the relative error, the time
//! per step and how many fusion calls replayed a CUDA graph.
//!
//! ```sh
//! cargo run --release --features candle --example candle_llama -- --devices 2
//! cargo run --release --features candle --example candle_llama -- --dtype bf16 --decode-steps 20
//! ```

mod app;
mod fusions;
mod layer;
mod tp;

use clap::Parser;

fn main() {
    if let Err(e) = app::run(app::Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
