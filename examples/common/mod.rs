//! What every example shares: the common command-line options, the timed run on every
//! rank, the f64 host reference, and the summary. Included with `#[path]` by each example.
#![allow(dead_code)]

pub mod finish;

use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use fusion::prelude::*;

/// Options every example takes.
#[derive(Args, Debug)]
pub struct Common {
    /// Devices to run on [default: every GPU, else 4 simulated CPU devices]
    #[arg(long)]
    pub devices: Option<usize>,
    /// Element type of the tensors
    #[arg(long, value_enum, default_value_t = Dt::F32)]
    pub dtype: Dt,
    /// Size of the worker stream pool (`numberOfStreams`)
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// Timed calls, after one warm-up call that lowers the fusion
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Print the host program the fusion lowers to
    #[arg(long)]
    pub dump: bool,
    /// Whether stream loops are pipelined: `auto` from 256 rows per chunk on
    /// (`LowerOptions::pipelines.pipelining`), `always` or `never`
    #[arg(long, value_enum, default_value_t = Pipe::Auto)]
    pub pipelining: Pipe,
}

/// `--pipelining` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Pipe {
    Auto,
    Always,
    Never,
}

/// `--dtype` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dt {
    F32,
    Bf16,
    F16,
}

impl Dt {
    /// The tensor dtype.
    pub fn dtype(self) -> DType {
        match self {
            Dt::F32 => DType::F32,
            Dt::Bf16 => DType::BF16,
            Dt::F16 => DType::F16,
        }
    }

    /// Relative-error tolerance of the reference check.
    pub fn tolerance(self) -> f64 {
        match self {
            Dt::F32 => 1e-5,
            Dt::Bf16 | Dt::F16 => 1e-2,
        }
    }
}

impl Common {
    /// The world of `--devices` devices (CUDA when available, else simulated CPU devices).
    pub fn world(&self) -> fusion::Result<World> {
        World::auto(self.devices)
    }

    /// Execution options from `--streams`.
    pub fn options(&self) -> ExecOptions {
        ExecOptions {
            number_of_streams: self.streams,
            lower: LowerOptions {
                pipelines: fusion::PipelineOptions {
                    pipelining: match self.pipelining {
                        Pipe::Auto => Pipelining::Auto,
                        Pipe::Always => Pipelining::Always,
                        Pipe::Never => Pipelining::Never,
                    },
                    ..Default::default()
                },
                ..LowerOptions::default()
            },
            ..ExecOptions::default()
        }
    }
}

/// A host tensor of standard-normal values.
pub fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    Tensor::randn(shape, dtype, seed)
}

/// What a timed run produced: every rank's output (on the host; in a launched world,
/// gathered from the other processes) and the timings.
pub struct Timed {
    pub outputs: Vec<Tensor>,
    /// Median over the timed calls of the slowest rank of this process's time per call.
    pub median: Duration,
    pub iters: usize,
}

/// On every rank: `setup` prepares the inputs (sharding them onto the device), one warm-up
/// `call` lowers the fusion, then `iters` calls are timed (each rank synchronizes its
/// device after each call); the output of the last call is returned. With `dump`, rank 0
/// prints the host program first.
pub fn run_timed<S, Setup, Call, Program>(
    world: &World,
    iters: usize,
    dump: bool,
    setup: Setup,
    call: Call,
    program: Program,
) -> fusion::Result<Timed>
where
    Setup: Fn(&Rank) -> fusion::Result<S> + Sync,
    Call: Fn(&Rank, &S) -> fusion::Result<Tensor> + Sync,
    Program: Fn(&Rank, &S) -> fusion::Result<String> + Sync,
{
    let launched = world.is_launched();
    let per_rank = world.run(|rank| {
        let inputs = setup(rank)?;
        if dump {
            let text = program(rank, &inputs)?;
            if rank.index() == 0 {
                println!("{text}");
            }
        }
        let mut out = call(rank, &inputs)?;
        rank.synchronize()?;
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters {
            let start = Instant::now();
            let o = call(rank, &inputs)?;
            rank.synchronize()?;
            times.push(start.elapsed());
            // The last timed call's output is the one checked: on GPUs it comes from a
            // replayed CUDA graph where the program can be captured.
            if i + 1 == iters {
                out = o;
            }
        }
        // Every rank's output: in a launched world, the other processes' too.
        let outs = if launched {
            rank.gather_to_host(&out)?
        } else {
            vec![rank.to_host(&out)?]
        };
        Ok((outs, times))
    })?;
    let mut slowest: Vec<Duration> = (0..iters)
        .map(|i| per_rank.iter().map(|r| r.1[i]).max().unwrap_or_default())
        .collect();
    slowest.sort();
    let median = slowest.get(iters / 2).copied().unwrap_or_default();
    let outputs = if launched {
        per_rank[0].0.clone()
    } else {
        per_rank.iter().map(|r| r.0[0].clone()).collect()
    };
    Ok(Timed {
        outputs,
        median,
        iters,
    })
}

/// The elements of a host tensor as f64.
pub fn to_f64(t: &Tensor) -> fusion::Result<Vec<f64>> {
    Ok(t.to_f32_vec()?.into_iter().map(f64::from).collect())
}

/// `c[b] = a[b] @ w` for `batch` row blocks of `a` (`[batch, m, k]` times `[k, n]`).
pub fn matmul_ref(a: &[f64], w: &[f64], batch: usize, m: usize, k: usize, n: usize) -> Vec<f64> {
    let mut c = vec![0.0; batch * m * n];
    for bi in 0..batch {
        for i in 0..m {
            let row = &a[(bi * m + i) * k..][..k];
            let out = &mut c[(bi * m + i) * n..][..n];
            for (kk, &x) in row.iter().enumerate() {
                let wrow = &w[kk * n..][..n];
                for (o, &y) in out.iter_mut().zip(wrow) {
                    *o += x * y;
                }
            }
        }
    }
    c
}

/// Relative Frobenius error of `got` against `reference`.
pub fn rel_error(got: &Tensor, reference: &[f64]) -> fusion::Result<f64> {
    let got = to_f64(got)?;
    if got.len() != reference.len() {
        return Ok(f64::INFINITY);
    }
    let (mut num, mut den) = (0.0, 0.0);
    for (g, r) in got.iter().zip(reference) {
        num += (g - r) * (g - r);
        den += r * r;
    }
    Ok((num / den.max(f64::MIN_POSITIVE)).sqrt())
}

/// The largest relative error of replicated outputs (one per rank) against `reference`.
pub fn worst_error(outputs: &[Tensor], reference: &[f64]) -> fusion::Result<f64> {
    let mut worst = 0.0f64;
    for out in outputs {
        worst = worst.max(rel_error(out, reference)?);
    }
    Ok(worst)
}

/// Multiply-adds above which the host reference is skipped (it is a plain loop).
pub const REFERENCE_LIMIT: f64 = 4e9;

/// Prints the summary; returns whether the check passed (or was skipped).
pub struct Summary<'a> {
    pub name: &'a str,
    pub what: &'a str,
    pub world: &'a World,
    pub common: &'a Common,
    pub shapes: String,
    /// Worst relative error over the checked ranks, or `None` when the check was skipped.
    pub error: Option<f64>,
    pub timed: &'a Timed,
    /// Floating-point operations per call per device, for a throughput figure.
    pub flops_per_device: Option<f64>,
    pub lowerings: usize,
}

impl Summary<'_> {
    /// Prints the summary and returns whether the result is within tolerance.
    pub fn print(&self) -> bool {
        let c = self.common;
        println!("{}: {}", self.name, self.what);
        println!(
            "  backend {}, {} devices, dtype {}, {} streams",
            self.world.backend().name(),
            self.world.size(),
            c.dtype.dtype(),
            c.streams
        );
        if let Some(spec) = self.world.launch_spec() {
            println!(
                "  launched by {}: {} processes; this one holds rank(s) {:?} and checks every \
                 rank's output",
                spec.launcher.name(),
                spec.processes,
                self.world.local_ranks()
            );
        }
        println!("  {}", self.shapes);
        let tol = c.dtype.tolerance();
        let ok = match self.error {
            Some(e) => {
                let ok = e <= tol;
                println!(
                    "  check: relative error {e:.2e} against an f64 host reference (tolerance \
                     {tol:.0e}): {}",
                    if ok { "ok" } else { "FAILED" }
                );
                ok
            }
            None => {
                println!(
                    "  check: skipped, the problem is above the host reference's limit of \
                     {REFERENCE_LIMIT:.0e} multiply-adds"
                );
                true
            }
        };
        let ms = self.timed.median.as_secs_f64() * 1e3;
        let rate = self
            .flops_per_device
            .filter(|_| ms > 0.0)
            .map(|f| format!(", {:.2} GFLOP/s per device", f / (ms * 1e6)))
            .unwrap_or_default();
        println!(
            "  time: median {ms:.3} ms per call over {} calls after a warm-up{rate}",
            self.timed.iters
        );
        println!("  lowerings: {}", self.lowerings);
        ok
    }
}

/// Ends the process with status 1 when the check failed.
pub fn exit_on_failure(ok: bool) {
    if !ok {
        eprintln!("the result does not match the reference");
        std::process::exit(1);
    }
}
