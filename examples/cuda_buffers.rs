//! Bring your own buffers: the data stays in cudarc device buffers from start to end.
//!
//! On every rank: allocate the inputs with cudarc in the rank's CUDA context, fill them
//! from host data (one host-to-device copy each), run the AllGather + GEMM P2P pipeline
//! with a tensor over each buffer (no copy: `a` handed over with `Rank::from_cuda_slice`
//! and taken back with `Tensor::into_cuda_slice`, `b` lent with `Rank::with_cuda_view`),
//! write the result into a caller-allocated cudarc buffer (`Rank::with_cuda_view_mut` +
//! `run_with(.., Some(&output), ..)`), copy it back with cudarc and check it against an
//! f64 host reference. Exits with status 1 on a mismatch; on a machine without a CUDA GPU
//! it says so and exits 0.
//!
//! ```sh
//! cargo run --release --example cuda_buffers -- --devices 2 --dtype bf16
//! ```

#[path = "common/mod.rs"]
mod common;

use std::sync::Arc;

use clap::Parser;
use common::{check_line, exit_on_failure, Dt};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits};
use fusion::prelude::*;
use fusion::runtime::backend::cuda::{device_count, CudaElement};
use fusion::runtime::cudarc;
use half::{bf16, f16};

fusion! {
    /// `c = allgather(a) @ b`, pipelined over the devices with P2P transfers.
    pub fn ag_matmul<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [d @ Stream, m, n]> {
        matmul(a, b)
    }
}

/// AllGather + GEMM over cudarc buffers, checked against a host reference.
#[derive(Parser, Debug)]
struct Cli {
    /// Devices to run on [default: every GPU]
    #[arg(long)]
    devices: Option<usize>,
    /// Rows of `a` per device
    #[arg(short, default_value_t = 256)]
    m: usize,
    /// Contracted dimension
    #[arg(short, default_value_t = 512)]
    k: usize,
    /// Columns of the result
    #[arg(short, default_value_t = 384)]
    n: usize,
    /// Element type of the buffers
    #[arg(long, value_enum, default_value_t = Dt::Bf16)]
    dtype: Dt,
    /// Calls into the same output buffer (the last one is checked)
    #[arg(long, default_value_t = 3)]
    iters: usize,
}

/// What the example needs of an element type: a cudarc device type that a tensor can view,
/// converted from and to f32 on the host.
trait Element: CudaElement + DeviceRepr + ValidAsZeroBits + Copy + Default {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Element for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Element for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

fn cuda<T>(r: std::result::Result<T, DriverError>, what: &str) -> fusion::Result<T> {
    r.map_err(|e| fusion::Error::Backend {
        backend: "cudarc",
        reason: format!("{what}: {e:?}"),
    })
}

/// Host data of `shape` (standard normal, fixed seed) as elements of `T`.
fn host_data<T: Element>(shape: &[usize], seed: u64) -> fusion::Result<Vec<T>> {
    let t = Tensor::randn(shape, T::DTYPE, seed);
    Ok(t.to_f32_vec()?.into_iter().map(T::from_f32).collect())
}

fn main() -> std::process::ExitCode {
    common::finish::finish(run())
}

fn run() -> fusion::Result<()> {
    let cli = Cli::parse();
    if std::env::var("FUSION_BACKEND").is_ok_and(|b| b == "cpu") || device_count() == 0 {
        println!(
            "cuda_buffers: no CUDA GPU is visible (or FUSION_BACKEND=cpu); this example \
             shows cudarc buffers as tensors and needs GPUs, so it runs nothing here"
        );
        return Ok(());
    }
    let world = World::auto(cli.devices)?;
    let tolerance = cli.dtype.tolerance();
    let ok = match cli.dtype {
        Dt::F32 => check::<f32>(&cli, &world, tolerance)?,
        Dt::Bf16 => check::<bf16>(&cli, &world, tolerance)?,
        Dt::F16 => check::<f16>(&cli, &world, tolerance)?,
    };
    exit_on_failure(ok);
    Ok(())
}

/// What one rank holds at the end: its copy of the result, read back with cudarc.
struct RankResult {
    c: Vec<f32>,
    a_back: usize,
}

fn check<T: Element>(cli: &Cli, world: &World, tolerance: f64) -> fusion::Result<bool> {
    let (d, m, k, n) = (world.size(), cli.m, cli.k, cli.n);
    // Every rank's block of `a`, and `b`, as host data (the reference uses the same values).
    let a_host: Vec<Vec<T>> = (0..d)
        .map(|r| host_data::<T>(&[1, m, k], 1 + r as u64))
        .collect::<fusion::Result<_>>()?;
    let b_host = host_data::<T>(&[k, n], 100)?;
    let opts = ExecOptions::default();
    let results = world.run(|rank| {
        // The rank's context: buffers and streams made here can back tensors of this rank.
        let ctx = rank.cuda_context()?;
        let stream: Arc<CudaStream> = cuda(ctx.new_stream(), "creating a stream")?;
        let a_buf: CudaSlice<T> = cuda(stream.clone_htod(&a_host[rank.index()]), "copying a")?;
        let b_buf: CudaSlice<T> = cuda(stream.clone_htod(&b_host), "copying b")?;
        let mut c_buf: CudaSlice<T> = cuda(stream.alloc_zeros::<T>(d * m * n), "allocating c")?;

        // `a` is handed over (the tensor owns the buffer), `b` and `c` are lent.
        let a: Ranked<3> = rank.from_cuda_slice(a_buf, &[1, m, k])?.try_into()?;
        rank.with_cuda_view(&b_buf, &[k, n], |b| {
            let b: Ranked<2> = b.clone().try_into()?;
            rank.with_cuda_view_mut(&mut c_buf, &[d, m, n], |c| {
                let c: Ranked<3> = c.clone().try_into()?;
                for _ in 0..cli.iters {
                    // The outputs are written into `c`'s buffer: nothing is allocated
                    // for them, and the report's outputs are views of it.
                    let report = ag_matmul::run_with(rank, &a, &b, Some(&c), &opts)?;
                    if !report.outputs[0].shares_storage(&c) {
                        return Err(fusion::Error::World(
                            "the output was not written into the caller's buffer".into(),
                        ));
                    }
                }
                Ok(())
            })
        })?;
        // Take `a`'s buffer back: its stream now waits for the calls that read it.
        let a_buf: CudaSlice<T> = a.into_inner().into_cuda_slice()?;
        let a_back = a_buf.len();
        // `c` was given back when the borrow ended: read it on its own stream.
        let c: Vec<T> = cuda(stream.clone_dtoh(&c_buf), "copying c back")?;
        cuda(stream.synchronize(), "synchronizing")?;
        Ok(RankResult {
            c: c.into_iter().map(T::to_f32).collect(),
            a_back,
        })
    })?;

    // f64 reference: c[r] = a[r] @ b for every block r.
    let mut expected = vec![0f64; d * m * n];
    for (r, a) in a_host.iter().enumerate() {
        for i in 0..m {
            for j in 0..n {
                expected[(r * m + i) * n + j] = (0..k)
                    .map(|x| {
                        f64::from(a[i * k + x].to_f32()) * f64::from(b_host[x * n + j].to_f32())
                    })
                    .sum();
            }
        }
    }
    let den: f64 = expected.iter().map(|v| v * v).sum();
    let mut worst = 0f64;
    for r in &results {
        let num: f64 =
            r.c.iter()
                .zip(&expected)
                .map(|(&g, &e)| (f64::from(g) - e).powi(2))
                .sum();
        worst = worst.max((num / den.max(f64::MIN_POSITIVE)).sqrt());
        if !worst.is_finite() {
            worst = f64::INFINITY;
        }
    }
    let ok = worst <= tolerance && results.iter().all(|r| r.a_back == m * k);
    println!("cuda_buffers: AllGather + GEMM over cudarc buffers");
    println!(
        "  backend {}, {d} devices, dtype {}, a [{d} x {m}, {k}] b [{k}, {n}] -> c [{d} x {m}, {n}]",
        world.backend().name(),
        T::DTYPE
    );
    println!(
        "  inputs and outputs in cudarc buffers, no copies; {} calls into the same output",
        cli.iters
    );
    println!("{}", check_line(worst, tolerance, ok));
    println!("  lowerings: {}", ag_matmul::lowering_count());
    Ok(ok)
}
