//! Row programs (a norm, a softmax as one kernel: `Kernel::Rows`) at prefill sizes, against
//! the same fusion written so that its reduction ends the row segment (the sum in a kernel
//! of its own rows, the scaling in a pointwise kernel: what ran before row programs) and
//! against no pointwise fusion at all (`FuseElementwise` off: a kernel per op).
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin row_bench -- --devices 1
//! ```
//!
//! Each variant's output is checked against the unfused one's on the device before it is
//! timed; `--calls` calls are recorded into one CUDA graph of the caller's and launched
//! whole (device time, whatever the host's pace; fewer calls where their buffers would
//! take more than 4 GB), median of `--iters` samples, slowest rank; `GB/s` counts the bytes
//! the fusion must read and write once. Rows whose unfused call would need more than 8 GB
//! are skipped.

use clap::Parser;
use fusion::compiler::ir::Fusion;
use fusion::compiler::lower::LowerOptions;
use fusion::prelude::*;
use fusion::{CallTarget, ExecOptions, FusionExecutor};
use fusion_bench::cli::{list, seed_or_clock};
use fusion_bench::finish::finish;
use fusion_bench::measure::{device_ms, random, rel_error};
use fusion_bench::stream_timing::Timing;
use fusion_bench::Dt;

fusion! {
    /// The residual add and RMSNorm of a decoder layer: `y = x + r`, then `y * rsqrt(sum(y^2
    /// + eps)) * w` in f32 (`w` the norm's weight times `sqrt(h)`, `eps` the epsilon over
    /// `h` in each element), both returned: one row kernel.
    #[allow(dead_code)] // built through `::build`
    fn add_rms_norm<T: Float, m, h>(
        x: Tensor<T, [m, h]>,
        r: Tensor<T, [m, h]>,
        w: Tensor<f32, [h]>,
        eps: Tensor<f32, [h]>,
    ) -> (Tensor<T, [m, h]>, Tensor<T, [m, h]>) {
        let y = x + r;
        let yf = cast(y, f32);
        let e: Tensor<f32, [1, h]> = broadcast(eps, [true, false]);
        let squares: Tensor<f32, [m]> = sum(yf * yf + e, 1);
        let s: Tensor<f32, [m, 1]> = broadcast(squares, [false, true]);
        let wb: Tensor<f32, [1, h]> = broadcast(w, [true, false]);
        (y, cast(yf * rsqrt(s) * wb, T))
    }

    /// The same with `rsqrt` on the sum before its broadcast: the sum ends its row segment,
    /// so the scaling is a pointwise kernel of its own that reads the rows again.
    #[allow(dead_code)] // built through `::build`
    fn add_rms_norm_apart<T: Float, m, h>(
        x: Tensor<T, [m, h]>,
        r: Tensor<T, [m, h]>,
        w: Tensor<f32, [h]>,
        eps: Tensor<f32, [h]>,
    ) -> (Tensor<T, [m, h]>, Tensor<T, [m, h]>) {
        let y = x + r;
        let yf = cast(y, f32);
        let e: Tensor<f32, [1, h]> = broadcast(eps, [true, false]);
        let inv: Tensor<f32, [m, 1]> = broadcast(rsqrt(sum(yf * yf + e, 1)), [false, true]);
        let wb: Tensor<f32, [1, h]> = broadcast(w, [true, false]);
        (y, cast(yf * inv * wb, T))
    }

    /// A row softmax in f32: three passes over each row in one kernel.
    #[allow(dead_code)] // built through `::build`
    fn softmax<T: Float, m, n>(x: Tensor<T, [m, n]>) -> Tensor<T, [m, n]> {
        let xf = cast(x, f32);
        let top: Tensor<f32, [m, 1]> = broadcast(max(xf, 1), [false, true]);
        let e = exp(xf - top);
        let total: Tensor<f32, [m, 1]> = broadcast(sum(e, 1), [false, true]);
        cast(e / total, T)
    }

    /// The same with `rsqrt` on the sum before its broadcast: the exponentials are written
    /// out, and a pointwise kernel scales them by `rsqrt(sum)^2`.
    #[allow(dead_code)] // built through `::build`
    fn softmax_apart<T: Float, m, n>(x: Tensor<T, [m, n]>) -> Tensor<T, [m, n]> {
        let xf = cast(x, f32);
        let top: Tensor<f32, [m, 1]> = broadcast(max(xf, 1), [false, true]);
        let e = exp(xf - top);
        let inv: Tensor<f32, [m, 1]> = broadcast(rsqrt(sum(e, 1)), [false, true]);
        cast(e * inv * inv, T)
    }
}

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Devices (default: every GPU; each runs the same rows).
    #[arg(long)]
    devices: Option<usize>,
    /// Rows (tokens).
    #[arg(long, default_value = "512,2048,8192,16384")]
    rows: String,
    /// Widths of the norm (hidden sizes).
    #[arg(long, default_value = "4096,8192")]
    norm_widths: String,
    /// Widths of the softmax (keys; a vocabulary).
    #[arg(long, default_value = "1024,4096,32768")]
    softmax_widths: String,
    #[arg(long, value_enum, default_value_t = Dt::Bf16)]
    dtype: Dt,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Calls recorded into the timed graph.
    #[arg(long, default_value_t = 20)]
    calls: usize,
    /// Seed of the random inputs (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
}

/// One fusion's variants: its row-kernel form, the form whose reductions end their
/// segments, and which of the inputs' shapes it takes.
struct Case {
    name: &'static str,
    fused: fn(DType) -> fusion::compiler::Result<Fusion>,
    apart: fn(DType) -> fusion::compiler::Result<Fusion>,
    norm: bool,
}

/// The most memory one unfused call may need (bytes): larger rows are skipped.
const MAX_CALL_BYTES: usize = 8 << 30;
/// The most memory the calls recorded into one graph may keep (fewer calls where larger).
const MAX_GRAPH_BYTES: usize = 4 << 30;

fn unfused() -> ExecOptions {
    ExecOptions {
        lower: LowerOptions::default().without_pass("FuseElementwise"),
        ..ExecOptions::default()
    }
}

fn main() -> std::process::ExitCode {
    finish(run())
}

fn run() -> fusion::Result<()> {
    let a = Args::parse();
    let world = World::auto(a.devices)?;
    let dt = a.dtype.dtype();
    let seed = seed_or_clock(a.seed);
    println!(
        "row_bench: backend {} devices {} dtype {dt} input seed {seed}",
        world.backend().name(),
        world.size()
    );
    let cases = [
        Case {
            name: "add_rms_norm",
            fused: add_rms_norm::build,
            apart: add_rms_norm_apart::build,
            norm: true,
        },
        Case {
            name: "softmax",
            fused: softmax::build,
            apart: softmax_apart::build,
            norm: false,
        },
    ];
    let cuda = world.backend().name() == "cuda";
    let timing = Timing {
        calls: a.calls,
        iters: a.iters,
    };
    let mut table = vec!["| fusion | rows x width | row kernel us (GB/s) | apart us | unfused us | apart / row | unfused / row | max rel. error |".to_string(),
        "| --- | --- | --- | --- | --- | --- | --- | --- |".to_string()];
    let err_exec = FusionExecutor::new(fusion_bench::fusions::squared_error(dt)?);
    for case in &cases {
        let (fused, apart) = (
            FusionExecutor::new((case.fused)(dt)?),
            FusionExecutor::new((case.apart)(dt)?),
        );
        let widths = if case.norm {
            &a.norm_widths
        } else {
            &a.softmax_widths
        };
        for h in list(widths) {
            for m in list(&a.rows) {
                // The unfused variant keeps up to ~8 f32 intermediates of the rows per call,
                // and the calls recorded into one graph keep theirs until it is dropped.
                let per_call = m * h * 4 * 8;
                if per_call > MAX_CALL_BYTES {
                    println!(
                        "| {} | {m} x {h} | skipped: its unfused call needs {} MB |",
                        case.name,
                        per_call >> 20
                    );
                    continue;
                }
                let timing = Timing {
                    calls: timing.calls.min(MAX_GRAPH_BYTES / per_call).max(2),
                    ..timing
                };
                let per_rank = world.run(|rank| {
                    let x = rank.to_device(&random(&[m, h], dt, seed)?)?;
                    let mut ins = vec![x];
                    if case.norm {
                        ins.push(rank.to_device(&random(&[m, h], dt, seed + 1)?)?);
                        ins.push(rank.to_device(&random(&[h], DType::F32, seed + 2)?)?);
                        let eps = Tensor::from_f32(&[h], &vec![1e-5 / h as f32; h], DType::F32)?;
                        ins.push(rank.to_device(&eps)?);
                    }
                    let ins: Vec<&Tensor> = ins.iter().collect();
                    let plain = fused.run_with(rank, &ins, None, &unfused())?.outputs;
                    let mut us = Vec::new();
                    let mut err = 0f64;
                    for (exec, opts) in [
                        (&fused, ExecOptions::default()),
                        (&apart, ExecOptions::default()),
                        (&fused, unfused()),
                    ] {
                        let out = exec.run_with(rank, &ins, None, &opts)?.outputs;
                        for (o, p) in out.iter().zip(&plain) {
                            err = err.max(rel_error(rank, &err_exec, o, p)?);
                        }
                        let call =
                            |t: &dyn CallTarget| exec.run_with(t, &ins, None, &opts).map(|_| ());
                        us.push(if cuda {
                            timing.graph_us(rank, &|on| call(on))?
                        } else {
                            // Simulated devices: markers around each call.
                            1e3 * device_ms(rank, a.iters, 3, || call(rank))?
                        });
                    }
                    Ok((us, err))
                })?;
                let slowest = |i: usize| per_rank.iter().map(|(u, _)| u[i]).fold(0.0, f64::max);
                let err = per_rank.iter().map(|(_, e)| *e).fold(0.0, f64::max);
                let (row, apart_us, plain_us) = (slowest(0), slowest(1), slowest(2));
                // Read once, written once: x (and r, written back as y) and the output.
                let elems = (m * h) as f64 * dt.size_bytes() as f64;
                let bytes = if case.norm { 4.0 * elems } else { 2.0 * elems };
                let line = format!(
                    "| {} | {m} x {h} | {row:.2} ({:.0}) | {apart_us:.2} | {plain_us:.2} | {:.2} | {:.2} | {err:.1e} |",
                    case.name,
                    bytes / row / 1e3,
                    apart_us / row,
                    plain_us / row
                );
                println!("{line}");
                table.push(line);
            }
        }
    }
    println!("\n{}", table.join("\n"));
    Ok(())
}
