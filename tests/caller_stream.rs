//! Fusion calls on the caller's CUDA stream (`Rank::on`, `Rank::on_per_thread_stream`):
//! the caller's kernels write a call's inputs on its stream, the call runs there, and the
//! caller's kernels read the outputs there, with no host synchronization in between, for
//! 1,000 calls with fresh inputs, walked and replayed; and on the per-thread default
//! streams of two threads sharing one rank. GPU-only (`#[ignore]`d): run with `--ignored`
//! on a machine with a GPU (`scripts/gpu.sh caller-stream`).

use std::sync::Arc;

use fusion::prelude::*;
use fusion::runtime::cudarc;
use fusion::runtime::replay::ReplayStatus;

use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

fusion! {
    /// `relu(x @ w)`: one GEMM with its epilogue.
    fn layer<m, k, n>(x: Tensor<f32, [m, k]>, w: Tensor<f32, [k, n]>) -> Tensor<f32, [m, n]> {
        relu(matmul(x, w))
    }
}

const M: usize = 32;
const K: usize = 64;
const N: usize = 48;
const CALLS: usize = 1000;

/// The caller's kernels: `fill` writes call `seed`'s input, `take` copies an output into
/// the call's row of a results buffer.
const KERNELS: &str = r#"
__device__ float value(unsigned int i, unsigned int seed) {
    unsigned int h = i * 2654435761u ^ (seed * 40503u + 0x9e3779b9u);
    h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    return (float)(h & 0xffffu) / 65536.0f - 0.5f;
}
extern "C" __global__ void fill(float* x, unsigned int n, unsigned int seed) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value(i, seed);
}
extern "C" __global__ void take(const float* y, float* out, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = y[i];
}
"#;

/// `value` of the kernels, on the host.
fn value(i: u32, seed: u32) -> f32 {
    let mut h = i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503).wrapping_add(0x9e3779b9);
    h ^= h >> 13;
    h = h.wrapping_mul(0x5bd1e995);
    h ^= h >> 15;
    (h & 0xffff) as f32 / 65536.0 - 0.5
}

fn cudarc<T>(r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
    Ok(r?)
}

/// The caller's side: its kernels.
struct Caller {
    fill: CudaFunction,
    take: CudaFunction,
}

fn grid(n: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Caller {
    fn new(ctx: &Arc<CudaContext>) -> Result<Caller> {
        let ptx = cudarc::nvrtc::compile_ptx(KERNELS)
            .map_err(|e| Error::World(format!("compiling the test kernels: {e:?}")))?;
        let module = cudarc(ctx.load_module(ptx))?;
        Ok(Caller {
            fill: cudarc(module.load_function("fill"))?,
            take: cudarc(module.load_function("take"))?,
        })
    }

    /// Writes call `seed`'s input into `x` (`n` floats) on `stream`.
    fn fill(&self, stream: &CudaStream, x: u64, n: u32, seed: u32) -> Result<()> {
        let mut b = stream.launch_builder(&self.fill);
        b.arg(&x).arg(&n).arg(&seed);
        // SAFETY: `x` holds `n` floats of this context, alive until the stream passes.
        cudarc(unsafe { b.launch(grid(n)) }.map(|_| ()))
    }

    /// Copies `n` floats from `y` to `out` on `stream`.
    fn take(&self, stream: &CudaStream, y: u64, out: u64, n: u32) -> Result<()> {
        let mut b = stream.launch_builder(&self.take);
        b.arg(&y).arg(&out).arg(&n);
        // SAFETY: both ranges hold `n` floats of this context, alive until the stream passes.
        cudarc(unsafe { b.launch(grid(n)) }.map(|_| ()))
    }
}

/// `relu(x_seed @ w)` on the host, in f64.
fn reference(seed: u32, w: &[f32]) -> Vec<f64> {
    let x: Vec<f32> = (0..(M * K) as u32).map(|i| value(i, seed)).collect();
    let mut y = vec![0f64; M * N];
    for i in 0..M {
        for j in 0..N {
            let s: f64 = (0..K)
                .map(|l| x[i * K + l] as f64 * w[l * N + j] as f64)
                .sum();
            y[i * N + j] = s.max(0.0);
        }
    }
    y
}

/// `CALLS` calls on `target`, whose stream is `stream`: fill the input on the stream, call,
/// copy the output into the call's row of a results buffer on the stream, let the output
/// go; no host wait until the end. Checks every call's row against the host reference;
/// returns how many calls were replayed.
fn calls_on_stream(
    target: &impl CallTarget,
    rank: &Rank,
    stream: &Arc<CudaStream>,
    caller: &Caller,
    graphs: bool,
    first_seed: u32,
) -> Result<usize> {
    let w_host = Tensor::randn(&[K, N], DType::F32, 3);
    let w: Ranked<2> = rank.to_device(&w_host)?.try_into()?;
    let x: Ranked<2> = rank
        .from_cuda_slice(cudarc(stream.alloc_zeros::<f32>(M * K))?, &[M, K])?
        .try_into()?;
    let x_ptr = x.device_ptr().expect("a device tensor");
    let results = cudarc(stream.alloc_zeros::<f32>(CALLS * M * N))?;
    let results_ptr = {
        use cudarc::driver::DevicePtr;
        results.device_ptr(stream).0
    };
    let options = ExecOptions {
        graphs,
        ..ExecOptions::default()
    };
    let mut replayed = 0;
    for call in 0..CALLS {
        let seed = first_seed + call as u32;
        caller.fill(stream, x_ptr, (M * K) as u32, seed)?;
        let report = layer::run_with(target, &x, &w, None, &options)?;
        if report.replay == ReplayStatus::Replayed {
            replayed += 1;
        }
        let y = report.outputs[0].device_ptr().expect("a device output");
        let row = results_ptr + (call * M * N * 4) as u64;
        caller.take(stream, y, row, (M * N) as u32)?;
    }
    cudarc(stream.synchronize())?;
    let got = cudarc(stream.clone_dtoh(&results))?;
    let w_values = w_host.to_f32_vec()?;
    for call in 0..CALLS {
        let want = reference(first_seed + call as u32, &w_values);
        let row = &got[call * M * N..(call + 1) * M * N];
        for (i, (g, e)) in row.iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()),
                "graphs {graphs}, call {call}, element {i}: {g} != {e}"
            );
        }
    }
    Ok(replayed)
}

/// A one-GPU world, or `None` (with a message) without one.
fn gpu_rank() -> Option<(World, Rank)> {
    if fusion::runtime::backend::visible_gpus() == 0 {
        eprintln!("skipping: no CUDA GPU");
        return None;
    }
    let world = fusion::runtime::backend::cuda::cuda_world(Some(1)).expect("a CUDA world");
    let rank = world.rank().expect("its rank");
    Some((world, rank))
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn calls_on_the_callers_stream_are_ordered_by_it_walked_and_replayed() -> Result<()> {
    let Some((_world, rank)) = gpu_rank() else {
        return Ok(());
    };
    let ctx = rank.cuda_context()?;
    let caller = Caller::new(&ctx)?;
    let stream = cudarc(ctx.new_stream())?;
    let walked = calls_on_stream(&rank.on(&stream), &rank, &stream, &caller, false, 0)?;
    assert_eq!(walked, 0);
    let replayed = calls_on_stream(&rank.on(&stream), &rank, &stream, &caller, true, 5000)?;
    // The first call of the program on this rank ran above; the next captures, the rest
    // replay on the caller's stream.
    assert!(
        replayed >= CALLS - 2,
        "only {replayed} of {CALLS} calls replayed"
    );
    eprintln!("caller's stream: {CALLS} walked, {replayed} of {CALLS} replayed, all correct");
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn calls_on_the_per_thread_streams_of_two_threads_share_a_rank() -> Result<()> {
    let Some((_world, rank)) = gpu_rank() else {
        return Ok(());
    };
    let ctx = rank.cuda_context()?;
    let caller = Caller::new(&ctx)?;
    let replayed: Vec<usize> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..2u32)
            .map(|t| {
                let (rank, ctx, caller) = (&rank, &ctx, &caller);
                s.spawn(move || -> Result<usize> {
                    // This thread's per-thread default stream, as candle's CUDA device uses.
                    let stream = ctx.per_thread_stream();
                    let mut replayed = 0;
                    for graphs in [false, true] {
                        replayed += calls_on_stream(
                            &rank.on_per_thread_stream(),
                            rank,
                            &stream,
                            caller,
                            graphs,
                            10_000 * (t + 1) + if graphs { 5000 } else { 0 },
                        )?;
                    }
                    Ok(replayed)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|h| h.join().expect("a thread panicked"))
            .collect::<Result<Vec<_>>>()
    })?;
    eprintln!(
        "per-thread streams of two threads: replayed {replayed:?} of {CALLS} each, all correct"
    );
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn a_call_on_a_capturing_stream_says_why_it_cannot_be_recorded() -> Result<()> {
    let Some((_world, rank)) = gpu_rank() else {
        return Ok(());
    };
    let ctx = rank.cuda_context()?;
    let stream = cudarc(ctx.new_stream())?;
    let x: Ranked<2> = rank
        .to_device(&Tensor::randn(&[M, K], DType::F32, 1))?
        .try_into()?;
    let w: Ranked<2> = rank
        .to_device(&Tensor::randn(&[K, N], DType::F32, 2))?
        .try_into()?;
    cudarc(stream.begin_capture(
        cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
    ))?;
    let err = layer(&rank.on(&stream), &x, &w).unwrap_err().to_string();
    let _ = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
    assert!(err.contains("being captured"), "{err}");
    Ok(())
}
