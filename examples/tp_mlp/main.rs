//! A tensor-parallel, sequence-parallel transformer MLP block as one fusion:
//! `y = ReduceScatter(gelu(AllGather(x) W1) W2)` (or, with `--gated`,
//! `ReduceScatter((silu(AG(x) Wg) * (AG(x) Wu)) Wd)`). x is sharded on its rows, W1 (Wg,
//! Wu) by columns and W2 (Wd) by rows. The host program is one stream loop: the rows of
//! x arrive chunk by chunk while the GEMMs of the previous chunk run, the activation is
//! the first GEMM's epilogue, and each chunk's second GEMM adds onto the running sum of
//! the reduce-scatter ring. The two fusions are in `blocks.rs` (the layer benchmark and
//! the candle Llama layer use them too).
//!
//! ```sh
//! cargo run --release --example tp_mlp -- --devices 4 -m 64 --hidden 128 -f 96 --dump
//! cargo run --release --example tp_mlp -- --devices 2 --gated --dtype bf16
//! ```

mod blocks;
#[path = "../common/mod.rs"]
mod common;

use common::{checked, matmul_ref, rel_error, to_f64, Report, Run};
use fusion::compiler::ir::UnaryOp;
use fusion::prelude::*;

use blocks::{gated_mlp, mlp};

type R3 = Ranked<3>;

/// The tensor-parallel MLP block in one fusion, checked against a host reference.
#[derive(clap::Args, Debug)]
struct Dims {
    /// Rows of x per device (M / devices)
    #[arg(short, default_value_t = 256)]
    m: usize,
    /// Hidden size H
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    /// FFN columns per device (F / devices)
    #[arg(short, default_value_t = 192)]
    f: usize,
    /// The gated form: silu(x Wg) * (x Wu), then W_down
    #[arg(long)]
    gated: bool,
}

fn main() -> std::process::ExitCode {
    common::main(lesson)
}

/// Standard-normal values scaled by `1 / sqrt(fan_in)`, so activations stay O(1).
fn weights(shape: &[usize], fan_in: usize, dtype: DType, seed: u64) -> fusion::Result<Tensor> {
    let s = 1.0 / (fan_in as f32).sqrt();
    let v: Vec<f32> = Tensor::randn(shape, DType::F32, seed)
        .to_f32_vec()?
        .into_iter()
        .map(|x| x * s)
        .collect();
    Tensor::from_f32(shape, &v, dtype)
}

/// `out[b] = sum_i act_i(b) @ w2[i]` with `act_i(b)` from the gathered rows' row block `b`:
/// `gelu(x[b] @ w1[i])`, or `silu(x[b] @ wg[i]) * (x[b] @ wu[i])`.
fn reference(ws: &[Vec<f64>], x: &[f64], d: usize, m: usize, h: usize, f: usize) -> Vec<f64> {
    let mut out = vec![0.0; d * m * h];
    for i in 0..d {
        let block = |w: usize| &ws[w][i * h * f..][..h * f];
        let first = matmul_ref(x, block(0), d, m, h, f);
        let act: Vec<f64> = if ws.len() == 2 {
            first
                .iter()
                .map(|&v| UnaryOp::GeluTanh.apply_f64(v))
                .collect()
        } else {
            let up = matmul_ref(x, block(1), d, m, h, f);
            first
                .iter()
                .zip(&up)
                .map(|(&g, &u)| UnaryOp::Silu.apply_f64(g) * u)
                .collect()
        };
        let down = ws.last().expect("a down projection");
        let part = matmul_ref(&act, &down[i * f * h..][..f * h], d, m, f, h);
        out.iter_mut().zip(part).for_each(|(o, p)| *o += p);
    }
    out
}

/// x, W1 (or Wg and Wu) and W2 (Wd) sharded on their first axis; each device keeps its
/// rows of y.
fn lesson(dims: &Dims, run: &Run) -> fusion::Result<Report> {
    let (d, m, h, f) = (run.devices(), dims.m, dims.hidden, dims.f);
    let dtype = run.dtype();
    let x = weights(&[d, m, h], 1, dtype, 1)?;
    let mut ws = vec![weights(&[d, h, f], h, dtype, 2)?];
    if dims.gated {
        ws.push(weights(&[d, h, f], h, dtype, 3)?);
    }
    ws.push(weights(&[d, f, h], d * f, dtype, 4)?);
    let opts = run.options();
    let timed = run.timed(
        |rank| -> fusion::Result<Vec<R3>> {
            std::iter::once(&x)
                .chain(&ws)
                .map(|t| rank.shard(t, 0)?.try_into())
                .collect()
        },
        |rank, t| {
            Ok(match t.as_slice() {
                [x, w1, w2] => mlp::call(rank, x, w1, w2, &opts)?,
                [x, wg, wu, wd] => gated_mlp::call(rank, x, wg, wu, wd, &opts)?,
                _ => unreachable!("three or four inputs"),
            }
            .into_inner())
        },
        |rank, t| {
            Ok(match t.as_slice() {
                [x, w1, w2] => mlp::program(rank, x, w1, w2, &opts)?,
                [x, wg, wu, wd] => gated_mlp::program(rank, x, wg, wu, wd, &opts)?,
                _ => unreachable!("three or four inputs"),
            }
            .to_string())
        },
    )?;
    let gemms = if dims.gated { 3 } else { 2 };
    let macs = (gemms * d * m * h * f * d) as f64;
    let error = checked(macs, || {
        let ws64 = ws.iter().map(to_f64).collect::<fusion::Result<Vec<_>>>()?;
        let expected = reference(&ws64, &to_f64(&x)?, d, m, h, f);
        let gathered = concat(&timed.outputs, 0)?;
        rel_error(&gathered, &expected)
    })?;
    Ok(Report {
        what: if dims.gated {
            "gated MLP block RS((silu(AG(x) Wg) * (AG(x) Wu)) Wd), one pipeline"
        } else {
            "MLP block RS(gelu(AG(x) W1) W2), one pipeline"
        },
        shapes: format!(
            "x [{}, {h}] sharded on rows, weights [{h}, {}] by columns and [{}, {h}] by \
             rows -> y [{}, {h}] sharded on rows",
            d * m,
            d * f,
            d * f,
            d * m
        ),
        error,
        timed,
        flops_per_device: Some(2.0 * macs / d as f64),
        lowerings: if dims.gated {
            gated_mlp::lowering_count()
        } else {
            mlp::lowering_count()
        },
    })
}
