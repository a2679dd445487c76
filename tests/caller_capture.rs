//! Fusion calls recorded into a CUDA graph the caller captures on its own stream
//! (`Rank::on` with a stream in capture): a step of the caller's kernels, a cudarc copy and
//! two fusion calls is captured once and replayed with fresh inputs written into the same
//! buffers, checked against a host reference at every replay; calls of the same fusions
//! outside the capture, at other addresses, run between the replays; the graph is
//! destroyed and the device frees what it held. On two GPUs, a tensor-parallel MLP (an
//! all-gather and a reduce-scatter, over the default transports and over NCCL) is recorded
//! on every rank and replayed; so is an Allreduce recorded between two of the caller's
//! kernels (the first writes its input). A call that cannot be recorded says why. GPU-only
//! (`#[ignore]`d): run with `--ignored` on a machine with a GPU.

mod common;

use std::sync::Arc;

use fusion::compiler::hir::Transport;
use fusion::compiler::ir::UnaryOp;
use fusion::prelude::*;
use fusion::runtime::cudarc;
use fusion::runtime::replay::ReplayStatus;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};

fusion! {
    /// `relu(x @ w)`.
    #[allow(dead_code)] // called through `run_with`
    fn up<m, k, n>(x: Tensor<f32, [m, k]>, w: Tensor<f32, [k, n]>) -> Tensor<f32, [m, n]> {
        relu(matmul(x, w))
    }
}

fusion! {
    /// `(y @ u) * sigmoid(g)`.
    #[allow(dead_code)] // called through `run_with`
    fn gate<m, n, p>(
        y: Tensor<f32, [m, n]>,
        u: Tensor<f32, [n, p]>,
        g: Tensor<f32, [m, p]>,
    ) -> Tensor<f32, [m, p]> {
        matmul(y, u) * sigmoid(g)
    }
}

fusion! {
    /// The Allreduce of a row-parallel layer's partial sums: one peer-memory kernel per
    /// rank at small sizes, recorded as its own kernel node (its edge from the kernel
    /// before it programmatic).
    #[allow(dead_code)] // called through `run_with`
    fn allreduce<d, n>(x: Tensor<f32, [d @ DIDx, n]>) -> Tensor<f32, [n]> {
        sum(x, 0)
    }
}

const M: usize = 16;
const K: usize = 64;
const N: usize = 48;
const P: usize = 32;
const REPLAYS: u32 = 6;

/// The caller's kernel: `take` copies `n` floats.
const KERNELS: &str = r#"
extern "C" __global__ void take(const float* y, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = y[i];
}
"#;

/// Input values of replay `seed`.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let mut h = i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503);
            h ^= h >> 13;
            h = h.wrapping_mul(0x5bd1e995);
            h ^= h >> 15;
            (h & 0xffff) as f32 / 65536.0 - 0.5
        })
        .collect()
}

fn cudarc<T>(r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
    Ok(r?)
}

/// The caller's side: its copy kernel.
struct Caller {
    take: CudaFunction,
}

impl Caller {
    fn new(ctx: &Arc<CudaContext>) -> Result<Caller> {
        let ptx = cudarc::nvrtc::compile_ptx(KERNELS)
            .map_err(|e| Error::World(format!("compiling the test kernel: {e:?}")))?;
        let module = cudarc(ctx.load_module(ptx))?;
        Ok(Caller {
            take: cudarc(module.load_function("take"))?,
        })
    }

    /// Copies `n` floats from `from` to `to` on `stream`.
    fn take(&self, stream: &CudaStream, from: u64, to: u64, n: usize) -> Result<()> {
        let n = n as u32;
        let mut b = stream.launch_builder(&self.take);
        b.arg(&from).arg(&to).arg(&n);
        let grid = LaunchConfig {
            grid_dim: (n.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: both ranges hold `n` floats of this context, alive while the stream (or
        // the graph it is captured into) runs.
        cudarc(unsafe { b.launch(grid) }.map(|_| ()))
    }
}

/// The device address of a cudarc buffer.
fn address(slice: &CudaSlice<f32>, stream: &Arc<CudaStream>) -> u64 {
    slice.device_ptr(stream).0
}

/// `a [r, c] @ b [c, n]` on the host, in f64.
fn matmul(a: &[f64], b: &[f64], r: usize, c: usize, n: usize) -> Vec<f64> {
    let mut out = vec![0f64; r * n];
    for i in 0..r {
        for l in 0..c {
            let x = a[i * c + l];
            for j in 0..n {
                out[i * n + j] += x * b[l * n + j];
            }
        }
    }
    out
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Checks `got` against `want`, naming `what`.
fn check(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, e)) in got.iter().zip(want).enumerate() {
        assert!(
            (*g as f64 - e).abs() <= 1e-3 * (1.0 + e.abs()),
            "{what}, element {i}: {g} != {e}"
        );
    }
}

/// The weights of the one-GPU step, on the device and on the host.
struct Weights {
    w: Ranked<2>,
    u: Ranked<2>,
    g: Ranked<2>,
    host: [Vec<f64>; 3],
}

impl Weights {
    fn new(rank: &Rank) -> Result<Weights> {
        let (w, u, g) = (
            Tensor::randn(&[K, N], DType::F32, 3),
            Tensor::randn(&[N, P], DType::F32, 4),
            Tensor::randn(&[M, P], DType::F32, 5),
        );
        let host = [
            f64s(&w.to_f32_vec()?),
            f64s(&u.to_f32_vec()?),
            f64s(&g.to_f32_vec()?),
        ];
        Ok(Weights {
            w: rank.to_device(&w)?.try_into()?,
            u: rank.to_device(&u)?.try_into()?,
            g: rank.to_device(&g)?.try_into()?,
            host,
        })
    }

    /// `up(x)` and `gate(up(x))` on the host.
    fn reference(&self, x: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let [w, u, g] = &self.host;
        let y: Vec<f64> = matmul(&f64s(x), w, M, K, N)
            .into_iter()
            .map(|v| v.max(0.0))
            .collect();
        let z = matmul(&y, u, M, N, P)
            .into_iter()
            .zip(g)
            .map(|(v, g)| v / (1.0 + (-g).exp()))
            .collect();
        (y, z)
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn a_step_with_two_fusion_calls_is_captured_by_the_caller_and_replayed() -> Result<()> {
    let Some(world) = common::gpu_world(1, false) else {
        return Ok(());
    };
    let rank = world.rank()?;
    let ctx = rank.cuda_context()?;
    let caller = Caller::new(&ctx)?;
    let stream = cudarc(ctx.new_stream())?;
    let weights = Weights::new(&rank)?;
    let options = ExecOptions::default();
    // The step's buffers: the host writes the next input into `staging`; the graph copies
    // it into `x` (the first call's input), `gate` writes into the caller's `z`, which the
    // graph copies into `result` with the caller's kernel and on into `copied` with cudarc.
    let mut staging = cudarc(stream.alloc_zeros::<f32>(M * K))?;
    let x: Ranked<2> = rank
        .from_cuda_slice(cudarc(stream.alloc_zeros::<f32>(M * K))?, &[M, K])?
        .try_into()?;
    let z: Ranked<2> = rank
        .from_cuda_slice(cudarc(stream.alloc_zeros::<f32>(M * P))?, &[M, P])?
        .try_into()?;
    let result = cudarc(stream.alloc_zeros::<f32>(M * P))?;
    let mut copied = cudarc(stream.alloc_zeros::<f32>(M * P))?;
    let (x_ptr, z_ptr) = (x.device_ptr().expect("x"), z.device_ptr().expect("z"));
    // Warm-up outside the capture: each program's first call on the rank (and `up`'s
    // second, captured as a graph of the rank's own).
    let on = rank.on(&stream);
    for _ in 0..2 {
        let y = up::run_with(&on, &x, &weights.w, None, &options)?.outputs;
        let y: Ranked<2> = y[0].clone().try_into()?;
        gate::run_with(&on, &y, &weights.u, &weights.g, Some(&z), &options)?;
    }
    cudarc(stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))?;
    let mut step = || -> Result<(ReplayStatus, ReplayStatus)> {
        caller.take(&stream, address(&staging, &stream), x_ptr, M * K)?;
        let first = up::run_with(&on, &x, &weights.w, None, &options)?;
        let y: Ranked<2> = first.outputs[0].clone().try_into()?;
        let second = gate::run_with(&on, &y, &weights.u, &weights.g, Some(&z), &options)?;
        caller.take(&stream, z_ptr, address(&result, &stream), M * P)?;
        cudarc(stream.memcpy_dtod(&result, &mut copied))?;
        Ok((first.replay, second.replay))
    };
    let recorded = step();
    let graph = cudarc(stream.end_capture(CUgraphInstantiate_flags(0)))?;
    let (first, second) = recorded?;
    assert!(
        matches!(first, ReplayStatus::Captured(n) if n > 0),
        "{first:?}"
    );
    assert!(
        matches!(second, ReplayStatus::Captured(n) if n > 0),
        "{second:?}"
    );
    let graph = graph.expect("a captured graph");
    // Replays with fresh inputs in the same buffers; between them, calls of the same
    // fusions outside the capture, at other addresses.
    let other: Ranked<2> = rank
        .to_device(&Tensor::randn(&[M, K], DType::F32, 9))?
        .try_into()?;
    let other_host = rank.to_host(&other)?.to_f32_vec()?;
    for replay in 0..REPLAYS {
        let input = values(M * K, 100 + replay);
        cudarc(stream.memcpy_htod(&input, &mut staging))?;
        cudarc(graph.launch())?;
        cudarc(stream.synchronize())?;
        let (_, want) = weights.reference(&input);
        check(
            &cudarc(stream.clone_dtoh(&copied))?,
            &want,
            &format!("replay {replay}"),
        );
        let y = up::run_with(&on, &other, &weights.w, None, &options)?.outputs;
        let (want, _) = weights.reference(&other_host);
        check(
            &rank.to_host(&y[0])?.to_f32_vec()?,
            &want,
            "a call between replays",
        );
    }
    // The graph goes: what it held is freed at the device's next call.
    drop(graph);
    let y = up::run_with(&on, &x, &weights.w, None, &options)?.outputs;
    cudarc(stream.synchronize())?;
    assert_eq!(rank.to_host(&y[0])?.shape(), &[M, N]);
    eprintln!("caller's capture: {REPLAYS} replays of a step with two fusion calls, all correct");
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn a_call_that_cannot_be_recorded_says_why_and_what_to_do() -> Result<()> {
    let Some(world) = common::gpu_world(1, false) else {
        return Ok(());
    };
    let rank = world.rank()?;
    let stream = cudarc(rank.cuda_context()?.new_stream())?;
    let weights = Weights::new(&rank)?;
    let x: Ranked<2> = rank
        .to_device(&Tensor::randn(&[M, K], DType::F32, 1))?
        .try_into()?;
    cudarc(stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))?;
    let err = up::run_with(
        &rank.on(&stream),
        &x,
        &weights.w,
        None,
        &ExecOptions::default(),
    );
    let _ = stream.end_capture(CUgraphInstantiate_flags(0));
    let err = err.unwrap_err().to_string();
    assert!(
        err.contains("being captured") && err.contains("once outside the capture"),
        "{err}"
    );
    Ok(())
}

/// One rank's step of the tensor-parallel MLP `ReduceScatter(relu(AllGather(x) W1) W2)`
/// (`mlp`), captured and replayed `REPLAYS` times.
fn tensor_parallel_step(rank: &Rank, mlp: &FusionExecutor, options: &ExecOptions) -> Result<()> {
    let (d, r) = (rank.world_size(), rank.index());
    let (m, h, f) = (8, 32, 64);
    let w1_full = Tensor::randn(&[d, h, f], DType::F32, 11);
    let w2_full = Tensor::randn(&[d, f, h], DType::F32, 12);
    let (w1_host, w2_host) = (f64s(&w1_full.to_f32_vec()?), f64s(&w2_full.to_f32_vec()?));
    let w1 = rank.shard(&w1_full, 0)?;
    let w2 = rank.shard(&w2_full, 0)?;
    let x = rank.shard(&Tensor::zeros(&[d, m, h], DType::F32), 0)?;
    let x_ptr = x.device_ptr().expect("x");
    let ctx = rank.cuda_context()?;
    let caller = Caller::new(&ctx)?;
    let stream = cudarc(ctx.new_stream())?;
    let mut staging = cudarc(stream.alloc_zeros::<f32>(m * h))?;
    let result = cudarc(stream.alloc_zeros::<f32>(m * h))?;
    let on = rank.on(&stream);
    mlp.run_with(&on, &[&x, &w1, &w2], None, options)?;
    cudarc(stream.synchronize())?;
    cudarc(stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))?;
    let step = || -> Result<ReplayStatus> {
        caller.take(&stream, address(&staging, &stream), x_ptr, m * h)?;
        let report = mlp.run_with(&on, &[&x, &w1, &w2], None, options)?;
        let out = report.outputs[0].device_ptr().expect("an output");
        caller.take(&stream, out, address(&result, &stream), m * h)?;
        Ok(report.replay)
    };
    let recorded = step();
    let graph = cudarc(stream.end_capture(CUgraphInstantiate_flags(0)))?;
    assert!(matches!(recorded?, ReplayStatus::Captured(n) if n > 0));
    let graph = graph.expect("a captured graph");
    for replay in 0..REPLAYS {
        let input = values(m * h, 1000 * r as u32 + replay);
        cudarc(stream.memcpy_htod(&input, &mut staging))?;
        cudarc(graph.launch())?;
        cudarc(stream.synchronize())?;
        // This rank's rows: sum over every rank j of relu(x_r W1_j) W2_j.
        let mut want = vec![0f64; m * h];
        for j in 0..d {
            let w1_j = &w1_host[j * h * f..(j + 1) * h * f];
            let w2_j = &w2_host[j * f * h..(j + 1) * f * h];
            let act: Vec<f64> = matmul(&f64s(&input), w1_j, m, h, f)
                .into_iter()
                .map(|v| v.max(0.0))
                .collect();
            for (s, v) in want.iter_mut().zip(matmul(&act, w2_j, m, f, h)) {
                *s += v;
            }
        }
        let got = cudarc(stream.clone_dtoh(&result))?;
        check(&got, &want, &format!("rank {r}, replay {replay}"));
    }
    Ok(())
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn a_tensor_parallel_step_is_recorded_on_every_rank() -> Result<()> {
    let nccl = ExecOptions {
        lower: fusion::compiler::lower::LowerOptions {
            transports: fusion::TransportOptions {
                p2p: Transport::Nccl,
                ..Default::default()
            },
            ..Default::default()
        },
        ..ExecOptions::default()
    };
    for (name, options) in [
        ("default transports", ExecOptions::default()),
        ("NCCL", nccl),
    ] {
        let Some(world) = common::gpu_world(2, false) else {
            return Ok(());
        };
        let mlp = FusionExecutor::new(common::cases::tp_mlp(DType::F32, UnaryOp::Relu));
        world.run(|rank| tensor_parallel_step(rank, &mlp, &options))?;
        eprintln!("caller's capture, tensor-parallel MLP over {name}: {REPLAYS} replays correct");
    }
    Ok(())
}

/// One rank's step: the caller's kernel writes the Allreduce's input, the recorded call
/// sums it over the ranks, the caller's kernel copies the sum out; replayed with fresh
/// inputs and checked every time.
fn allreduce_between_kernels(rank: &Rank, n: usize) -> Result<()> {
    let (d, r) = (rank.world_size(), rank.index());
    let x: Ranked<2> = rank
        .shard(&Tensor::zeros(&[d, n], DType::F32), 0)?
        .try_into()?;
    let x_ptr = x.device_ptr().expect("x");
    let ctx = rank.cuda_context()?;
    let caller = Caller::new(&ctx)?;
    let stream = cudarc(ctx.new_stream())?;
    let mut staging = cudarc(stream.alloc_zeros::<f32>(n))?;
    let result = cudarc(stream.alloc_zeros::<f32>(n))?;
    let on = rank.on(&stream);
    let options = ExecOptions::default();
    let program = allreduce::program(rank, &x, &options)?.to_string();
    assert!(program.contains("on PeerMemory"), "{program}");
    for _ in 0..2 {
        allreduce::run_with(&on, &x, None, &options)?;
    }
    cudarc(stream.synchronize())?;
    cudarc(stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))?;
    let step = || -> Result<ReplayStatus> {
        caller.take(&stream, address(&staging, &stream), x_ptr, n)?;
        let report = allreduce::run_with(&on, &x, None, &options)?;
        let out = report.outputs[0].device_ptr().expect("an output");
        caller.take(&stream, out, address(&result, &stream), n)?;
        Ok(report.replay)
    };
    let recorded = step();
    let graph = cudarc(stream.end_capture(CUgraphInstantiate_flags(0)))?;
    assert!(matches!(recorded?, ReplayStatus::Captured(1)));
    let graph = graph.expect("a captured graph");
    for replay in 0..REPLAYS {
        let input = values(n, 100 * r as u32 + replay);
        cudarc(stream.memcpy_htod(&input, &mut staging))?;
        cudarc(graph.launch())?;
        cudarc(stream.synchronize())?;
        let inputs: Vec<Vec<f32>> = (0..d).map(|j| values(n, 100 * j as u32 + replay)).collect();
        let want: Vec<f64> = (0..n)
            .map(|i| inputs.iter().map(|v| f64::from(v[i])).sum())
            .collect();
        let got = cudarc(stream.clone_dtoh(&result))?;
        check(&got, &want, &format!("rank {r}, replay {replay}"));
    }
    Ok(())
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn an_allreduce_recorded_after_a_kernel_of_yours_sums_what_it_wrote() -> Result<()> {
    // Worlds one after another on the same GPUs: a rank's thread of a later world may
    // drop memory of an earlier one's devices (the call's executor is shared), which must
    // not leave another device's context current for the next call.
    for d in [2, 4, 2] {
        let Some(world) = common::gpu_world(d, false) else {
            return Ok(());
        };
        // 16 KB and 256 KB: the flagged one-shot and (above 2 ranks) two-shot kernels.
        for n in [4096, 65536] {
            world.run(|rank| allreduce_between_kernels(rank, n))?;
            eprintln!("{d} ranks, {n} floats: an Allreduce between your kernels, {REPLAYS} replays correct");
        }
    }
    Ok(())
}
