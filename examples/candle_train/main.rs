//! Training through tensor-parallel fusions with candle's autograd.
//!
//! A stack of sequence-parallel MLP blocks `x + gelu(x W1) W2` (each rank holds its rows
//! of the batch, its columns of W1 and its rows of W2) is trained with plain SGD on
//! synthetic data (targets `tanh(x A)` for a fixed random `A`), every rank from its own
//! thread. The blocks' communicating parts are fusions with `#[backward]`, applied as
//! candle ops (`fusion_candle::Differentiable`): `loss.backward()` runs their derived
//! backward fusions, and candle's `GradStore` holds each rank's weight gradients.
//! `--form layers` (the default) makes each block two ops, a column-parallel linear
//! (all-gather + GEMM) and a row-parallel one (GEMM + reduce-scatter) with candle's gelu
//! between; `--form block` one op for the whole block. The ops keep their forward's GEMM
//! results for the backward (the saving form); `--recompute` has the backwards recompute
//! them instead (less memory, one more GEMM per layer).
//!
//! The same model trained by candle alone on one device, from the same weights and data,
//! is the reference (`--single` trains only it): the example prints both loss curves and
//! the largest relative difference between them.
//!
//! ```sh
//! cargo run --release --features candle --example candle_train -- --devices 4
//! cargo run --release --features candle --example candle_train -- --single
//! ```

mod model;
mod train;

use clap::Parser;

use train::{max_relative_difference, train_single, train_tp, Args};

fn main() {
    let args = Args::parse();
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let reference = train_single(args)?;
    let every = args.every.max(1);
    if args.single {
        println!("{:>6} {:>12}", "step", "candle");
        for (s, l) in reference.iter().enumerate().filter(|(s, _)| s % every == 0) {
            println!("{s:>6} {l:>12.6}");
        }
        return Ok(());
    }
    let tp = train_tp(args)?;
    println!(
        "{:>6} {:>12} {:>12} {:>10}",
        "step", "fusions", "candle", "rel. diff"
    );
    for (s, (a, b)) in tp.iter().zip(&reference).enumerate() {
        if s % every == 0 || s + 1 == tp.len() {
            let rel = max_relative_difference(&[*a], &[*b]);
            println!("{s:>6} {a:>12.6} {b:>12.6} {rel:>10.2e}");
        }
    }
    println!(
        "{} steps, {:?} form, {:?} backward: loss {:.6} -> {:.6}; max relative difference to \
         candle alone {:.2e}",
        tp.len(),
        args.form,
        args.backward(),
        tp.first().copied().unwrap_or(f32::NAN),
        tp.last().copied().unwrap_or(f32::NAN),
        max_relative_difference(&tp, &reference)
    );
    Ok(())
}
