//! Host cost of the device operations a host program is made of: how long the calling
//! thread spends enqueuing one GEMM, one stream wait and one copy kernel (device work is
//! not waited for), a `Matmul` node and a one-GEMM call (rank 0), replayed also on the
//! caller's stream (`Rank::on`) and the per-thread default stream. On several ranks, also
//! whole calls of tiny copy-engine pipelines, walked and replayed as CUDA graphs: the
//! AllGather+GEMM ring and the GEMM+ReduceScatter ring with 1, 2, 4 and 8 row ranges per
//! block (`D`, `2 D`, `4 D`, `8 D` stream iterations). These bound how fine a pipeline can
//! be before the host, not the GPU, sets its pace.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin host_costs -- --devices 1
//! # two ranks on the visible GPUs, both on GPU 0 on a one-GPU machine
//! cargo run --release -p fusion-bench --bin host_costs -- --devices 2 --share-gpus
//! ```

use std::time::Instant;

use clap::Parser;
use fusion::compiler::hir::NodeKind;
use fusion::compiler::lower::{LowerOptions, Pipelining, ReduceScatterPipeline};
use fusion::runtime::backend::{BackendKind, Kernel};
use fusion::runtime::replay::ReplayStatus;
use fusion::{DType, ExecOptions, FusionExecutor, Rank, Result, RunReport, Tensor, World};
use fusion_bench::finish::finish;
use fusion_bench::fusions;

#[derive(Parser, Debug)]
struct Args {
    /// Devices (default: every GPU, else 4 simulated devices); rank 0 reports.
    #[arg(long)]
    devices: Option<usize>,
    /// GEMM rows, contraction and columns.
    #[arg(short, default_value_t = 1024)]
    m: usize,
    #[arg(short, default_value_t = 2048)]
    k: usize,
    #[arg(short, default_value_t = 2048)]
    n: usize,
    /// Calls per measurement.
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Put the ranks on the visible GPUs, several per GPU when there are fewer GPUs than
    /// `--devices` (`cuda_world_sharing_gpus`: copy-engine pipelines only, no NCCL).
    #[arg(long)]
    share_gpus: bool,
    /// Also measure how a graph's launch cost grows with its nodes, for kernels on one
    /// stream (a straight line) and on two streams (forks and joins).
    #[arg(long)]
    graph_topologies: bool,
}

/// Median host microseconds per call of `f`, over 5 rounds of `calls` calls, each round
/// started with an idle device.
fn host_us(rank: &Rank, calls: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    let mut rounds = Vec::new();
    for _ in 0..5 {
        rank.synchronize()?;
        let t = Instant::now();
        for _ in 0..calls {
            f()?;
        }
        rounds.push(t.elapsed().as_secs_f64() * 1e6 / calls as f64);
    }
    rank.synchronize()?;
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[rounds.len() / 2])
}

/// Host and device time per call of a short burst of calls.
struct Burst {
    /// Host microseconds per call, the calls enqueued back to back from an idle device.
    host: f64,
    /// Microseconds per call until the device finished the burst.
    device: f64,
}

/// Calls per burst: few enough that the device's queues never fill, so the host time is
/// what the calling thread spends, not time it waits for the device.
const BURST: usize = 8;

/// Medians over 15 bursts of [`BURST`] calls of `f`, each burst started from an idle
/// device with all ranks at the start line.
fn burst_us(rank: &Rank, mut f: impl FnMut() -> Result<()>) -> Result<Burst> {
    let (mut host, mut device) = (Vec::new(), Vec::new());
    for _ in 0..15 {
        rank.synchronize()?;
        rank.communicator().exchange(&[])?;
        let t = Instant::now();
        for _ in 0..BURST {
            f()?;
        }
        host.push(t.elapsed().as_secs_f64() * 1e6 / BURST as f64);
        rank.synchronize()?;
        device.push(t.elapsed().as_secs_f64() * 1e6 / BURST as f64);
    }
    Ok(Burst {
        host: median(host),
        device: median(device),
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> std::process::ExitCode {
    finish(run())
}

/// (what, microseconds per call) rows of one rank.
type Rows = Vec<(String, f64)>;

fn run() -> Result<()> {
    let a = Args::parse();
    let world = if a.share_gpus {
        fusion::runtime::backend::cuda::cuda_world_sharing_gpus(a.devices.unwrap_or(2))?
    } else {
        World::auto(a.devices)?
    };
    let rows = world.run(|rank| {
        let launch_rows = if a.graph_topologies && rank.device().kind() == BackendKind::Cuda {
            graph_topologies(rank)?
        } else {
            Vec::new()
        };
        // Every rank measures (so that all of them are at the same place when the pipelines
        // start, and a GPU shared by ranks is as busy as in a pipeline); rank 0 reports.
        let mut rows = single_device(rank, &a)?;
        rank.synchronize()?;
        rank.communicator().exchange(&[])?;
        if rank.world_size() > 1 {
            rows.extend(pipelines(rank)?);
        }
        rows.extend(launch_rows);
        Ok(rows)
    })?;
    println!(
        "host_costs: backend {} devices {}{} (rank 0)",
        world.backend().name(),
        world.size(),
        if a.share_gpus {
            " sharing the visible GPUs"
        } else {
            ""
        }
    );
    for (what, us) in &rows[0] {
        println!("  {what:<80} {us:>7.2} us per call");
    }
    Ok(())
}

/// Whole calls of tiny copy-engine pipelines (8x8 blocks), walked and replayed, on every
/// rank at once; rank 0 reports.
fn pipelines(rank: &Rank) -> Result<Rows> {
    let d = rank.world_size();
    let dt = DType::BF16;
    let mut rows = Vec::new();
    let mut measure =
        |what: String, exec: &FusionExecutor, inputs: &[&Tensor], lower: &LowerOptions| {
            for (mode, graphs) in [("walked", false), ("graphs on", true)] {
                let o = ExecOptions {
                    graphs,
                    // Tiny pipelines are what this measures (Auto would not pipeline them).
                    lower: LowerOptions {
                        pipelines: fusion::PipelineOptions {
                            pipelining: Pipelining::Always,
                            ..lower.clone().pipelines
                        },
                        ..lower.clone()
                    },
                    ..ExecOptions::default()
                };
                // Warm up (the first calls lower, capture and learn addresses).
                for _ in 0..3 {
                    exec.run_with(rank, inputs, None, &o)?;
                }
                let (mut setups, mut launches) = (Vec::new(), Vec::new());
                let burst = burst_us(rank, || {
                    let r = exec.run_with(rank, inputs, None, &o)?;
                    setups.push(r.stats.replay_setup.nanos as f64 / 1e3);
                    launches.push(r.stats.graph_launch.nanos as f64 / 1e3);
                    Ok(())
                })?;
                let r = exec.run_with(rank, inputs, None, &o)?;
                let how = match r.replay {
                    ReplayStatus::Replayed => format!(
                        "replayed: {} graph nodes, setup {:.1} us, launch {:.1} us",
                        r.stats.graph_nodes,
                        median(setups),
                        median(launches)
                    ),
                    other => format!("{} host-IR nodes, {other:?}", r.stats.nodes_executed),
                };
                rows.push((
                    format!(
                        "{what}, {mode} ({how}; device {:.1} us per call)",
                        burst.device
                    ),
                    burst.host,
                ));
            }
            Ok::<_, fusion::Error>(())
        };
    let ag = FusionExecutor::new(fusions::ag_matmul_p2p(dt)?);
    let x = rank.shard(&Tensor::randn(&[d, 8, 8], dt, 3), 0)?;
    let w = rank.to_device(&Tensor::randn(&[8, 8], dt, 4))?;
    measure(
        format!("AG+GEMM P2P ring, {d} iterations"),
        &ag,
        &[&x, &w],
        &LowerOptions::default(),
    )?;
    let rs = FusionExecutor::new(fusions::matmul_rs_p2p(dt)?);
    let x = rank.shard(&Tensor::randn(&[d, d, 16, 8], dt, 5), 0)?;
    let w = rank.shard(&Tensor::randn(&[d, 8, 8], dt, 6), 0)?;
    for c in [1, 2, 4, 8] {
        let lower = LowerOptions {
            pipelines: fusion::PipelineOptions {
                reduce_scatter: ReduceScatterPipeline::Ring,
                reduce_scatter_subchunks: Some(c),
                ..Default::default()
            },
            ..LowerOptions::default()
        };
        measure(
            format!("GEMM+RS ring, {} iterations", d * c),
            &rs,
            &[&x, &w],
            &lower,
        )?;
    }
    Ok(rows)
}

/// One GEMM, a stream wait, a copy, a `Matmul` node and a one-GEMM call on this rank.
fn single_device(rank: &Rank, a: &Args) -> Result<Rows> {
    let (m, k, n) = (a.m, a.k, a.n);
    let host_a = Tensor::randn(&[m, k], DType::BF16, 1);
    let host_b = Tensor::randn(&[k, n], DType::BF16, 2);
    {
        let dev = rank.device();
        dev.ensure_streams(2)?;
        let x = rank.to_device(&host_a)?;
        let y = rank.to_device(&host_b)?;
        let c = dev.allocate(0, DType::BF16, &[m, n])?;
        let gemm = |accumulate| {
            host_us(rank, a.calls, || {
                dev.execute(
                    0,
                    Kernel::Gemm {
                        a: &x,
                        b: &y,
                        bias: None,
                        accumulate,
                        addend: None,
                        epilogue: &[],
                        dst: &c,
                    },
                )
            })
        };
        let plain = gemm(false)?;
        let acc = gemm(true)?;
        let wait = host_us(rank, a.calls, || dev.stream_wait(1, 0))?;
        let small = dev.allocate(0, DType::BF16, &[64, 64])?;
        let small2 = dev.allocate(0, DType::BF16, &[64, 64])?;
        let copy = host_us(rank, a.calls, || {
            dev.execute(
                0,
                Kernel::Copy {
                    src: &small,
                    dst: &small2,
                },
            )
        })?;
        // A one-GEMM fusion: the host time of its `Matmul` node when the program is
        // walked, and of a whole call, walked and replayed as a graph.
        let exec = FusionExecutor::new(fusions::gemm(DType::BF16)?);
        let xa = x.reshape(&[1, m, k])?;
        let eager = ExecOptions {
            graphs: false,
            ..ExecOptions::default()
        };
        let mut node = Vec::new();
        for _ in 0..a.calls {
            let r = exec.run_with(rank, &[&xa, &y], None, &eager)?;
            let h = r.stats.host_by_kind[NodeKind::Matmul as usize];
            if h.count > 0 {
                node.push(h.nanos as f64 / 1e3 / f64::from(h.count));
            }
        }
        node.sort_by(f64::total_cmp);
        let matmul_node = node.get(node.len() / 2).copied().unwrap_or(f64::NAN);
        // The same node writing into an output the caller allocated once (as a pipeline's
        // GEMMs write into slices of a buffer allocated before the loop).
        let out = dev.allocate(0, DType::BF16, &[1, m, n])?;
        let mut node_into = Vec::new();
        for _ in 0..a.calls {
            let r = exec.run_with(rank, &[&xa, &y], Some(&[&out]), &eager)?;
            let h = r.stats.host_by_kind[NodeKind::Matmul as usize];
            if h.count > 0 {
                node_into.push(h.nanos as f64 / 1e3 / f64::from(h.count));
            }
        }
        node_into.sort_by(f64::total_cmp);
        let matmul_node_into = node_into
            .get(node_into.len() / 2)
            .copied()
            .unwrap_or(f64::NAN);
        let call_eager = host_us(rank, a.calls, || {
            exec.run_with(rank, &[&xa, &y], None, &eager).map(|_| ())
        })?;
        let call_graph = host_us(rank, a.calls, || {
            exec.run_with(rank, &[&xa, &y], None, &ExecOptions::default())
                .map(|_| ())
        })?;
        let how = exec
            .run_with(rank, &[&xa, &y], None, &ExecOptions::default())?
            .replay;
        let stream_rows = caller_streams(rank, a.calls, &exec, &[&xa, &y])?;
        let mut rows = vec![
            (format!("GEMM {m}x{k}x{n} bf16"), plain),
            (format!("GEMM {m}x{k}x{n} bf16, accumulating"), acc),
            ("stream wait (event record + wait)".to_string(), wait),
            ("copy kernel 64x64".to_string(), copy),
            ("Matmul node of a walked program".to_string(), matmul_node),
            (
                "Matmul node, output allocated by the caller".to_string(),
                matmul_node_into,
            ),
            ("one-GEMM fusion call, walked".to_string(), call_eager),
            (
                format!("one-GEMM fusion call, graphs on ({how:?})"),
                call_graph,
            ),
        ];
        rows.extend(stream_rows);
        Ok(rows)
    }
}

/// The replayed one-GEMM call on the caller's streams (`Rank::on`: a stream of the
/// caller's, and the per-thread default stream) against the same call on the rank's own
/// stream, in this process: rounds of `calls` calls of each, interleaved (own, caller's,
/// per-thread, own, ...), each round from an idle device; medians of 9 rounds.
fn caller_streams(
    rank: &Rank,
    calls: usize,
    exec: &FusionExecutor,
    inputs: &[&Tensor],
) -> Result<Rows> {
    if rank.backend() != BackendKind::Cuda {
        return Ok(Vec::new());
    }
    let graphs = ExecOptions::default();
    let stream = rank.cuda_context()?.new_stream()?;
    let on_stream = rank.on(&stream);
    let per_thread = rank.on_per_thread_stream();
    let targets: [(&str, &dyn Fn() -> Result<RunReport>); 3] = [
        ("on the rank's own stream", &|| {
            exec.run_with(rank, inputs, None, &graphs)
        }),
        ("on the caller's stream (Rank::on)", &|| {
            exec.run_with(&on_stream, inputs, None, &graphs)
        }),
        ("on the per-thread default stream", &|| {
            exec.run_with(&per_thread, inputs, None, &graphs)
        }),
    ];
    let mut rounds: [Vec<f64>; 3] = Default::default();
    for round in 0..10 {
        for (i, (_, target)) in targets.iter().enumerate() {
            // Each stream's first calls (the first round is not counted): its outputs,
            // its sync with the rank.
            for _ in 0..3 {
                target()?;
            }
            rank.synchronize()?;
            let t = Instant::now();
            for _ in 0..calls {
                target()?;
            }
            if round > 0 {
                rounds[i].push(t.elapsed().as_secs_f64() * 1e6 / calls as f64);
            }
        }
    }
    rank.synchronize()?;
    let mut rows = Vec::new();
    let mut us = [0.0; 3];
    for (i, (what, target)) in targets.iter().enumerate() {
        us[i] = median(std::mem::take(&mut rounds[i]));
        let how = target()?.replay;
        rows.push((
            format!("one-GEMM fusion call, graphs on, {what}, interleaved ({how:?})"),
            us[i],
        ));
    }
    rows.push((
        "caller's stream minus the rank's own stream".to_string(),
        us[1] - us[0],
    ));
    rows.push((
        "per-thread default stream minus the rank's own stream".to_string(),
        us[2] - us[0],
    ));
    Ok(rows)
}

/// Launch cost of captured graphs of `n` copy kernels: on one stream, on two streams
/// joined once at the end, and on two streams with a fork and a join around every kernel.
fn graph_topologies(rank: &Rank) -> Result<Rows> {
    let dev = rank.device();
    dev.ensure_streams(2)?;
    let src = dev.allocate(0, DType::BF16, &[64, 64])?;
    let dst = dev.allocate(0, DType::BF16, &[64, 64])?;
    let copy = |s| {
        dev.execute(
            s,
            Kernel::Copy {
                src: &src,
                dst: &dst,
            },
        )
    };
    let mut rows = Vec::new();
    for n in [4usize, 16, 64] {
        let shapes: [(&str, &dyn Fn() -> Result<()>); 3] = [
            ("one stream", &|| (0..n).try_for_each(|_| copy(0))),
            ("two streams, one join", &|| {
                dev.stream_wait(1, 0)?;
                for i in 0..n {
                    copy(i % 2)?;
                }
                dev.stream_wait(0, 1)
            }),
            ("two streams, fork and join per kernel", &|| {
                for i in 0..n {
                    if i % 2 == 1 {
                        dev.stream_wait(1, 0)?;
                        copy(1)?;
                        dev.stream_wait(0, 1)?;
                    } else {
                        copy(0)?;
                    }
                }
                Ok(())
            }),
        ];
        for (what, record) in shapes {
            rank.synchronize()?;
            dev.begin_capture(0)?;
            let recorded = record();
            let graph = dev.end_capture();
            recorded?;
            let graph = graph?;
            let mut t = Vec::new();
            for _ in 0..50 {
                rank.synchronize()?;
                let start = Instant::now();
                graph.launch(None)?;
                t.push(start.elapsed().as_secs_f64() * 1e6);
            }
            rank.synchronize()?;
            rows.push((
                format!(
                    "graph launch, {n} copy kernels, {what} ({} nodes)",
                    graph.nodes()
                ),
                median(t),
            ));
        }
    }
    rows.extend(graph_node_kinds(rank)?);
    Ok(rows)
}

/// Launch cost of one-stream graphs of 4 and 32 nodes of one kind each (memset, copy on
/// the device, copy to the next rank's device, flag write, flag wait, external event
/// record), recorded straight through the driver on a stream of this example's own.
fn graph_node_kinds(rank: &Rank) -> Result<Rows> {
    use fusion::runtime::cudarc::driver::sys;
    let fail = |what: &str, r: sys::CUresult| -> Result<()> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(fusion::Error::World(format!("{what}: {r:?}")))
        }
    };
    let dev = rank.device();
    let bytes = 64 * 64 * 2;
    let a = dev.allocate(0, DType::BF16, &[64, 64])?;
    let b = dev.allocate(0, DType::BF16, &[64, 64])?;
    let flags = rank.to_device(&Tensor::full(&[64], DType::F32, 1.0))?;
    let (pa, pb, pf) = (
        a.device_ptr().unwrap_or(0),
        b.device_ptr().unwrap_or(0),
        flags.device_ptr().unwrap_or(0),
    );
    // The next rank's buffer, for copies between devices (peer access is on in a world).
    let all = rank.communicator().exchange(&[pb as i64])?;
    let peer = all[(rank.index() + 1) % rank.world_size()][0] as u64;
    rank.synchronize()?;
    let mut stream: sys::CUstream = std::ptr::null_mut();
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: the rank's thread has its device's context current.
    unsafe {
        fail("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1))?;
        fail("cuEventCreate", sys::cuEventCreate(&mut event, 2))?;
    }
    // The flag words hold 1.0f (nonzero), so a wait for >= 1 passes at once.
    let one_f32 = 1.0f32.to_bits();
    type Record<'a> = &'a dyn Fn() -> sys::CUresult;
    let kinds: [(&str, Record<'_>); 7] = [
        ("memset", &|| unsafe {
            sys::cuMemsetD32Async(pa, 0, 16, stream)
        }),
        ("copy on the device", &|| unsafe {
            sys::cuMemcpyAsync(pb, pa, bytes, stream)
        }),
        ("copy to the next rank", &|| unsafe {
            sys::cuMemcpyAsync(peer, pa, bytes, stream)
        }),
        ("flag write", &|| unsafe {
            sys::cuStreamWriteValue32_v2(stream, pf, one_f32, 0)
        }),
        ("flag wait", &|| unsafe {
            sys::cuStreamWaitValue32_v2(stream, pf, 1, 0)
        }),
        ("external event record", &|| unsafe {
            sys::cuEventRecordWithFlags(event, stream, 1)
        }),
        ("allocation and free (two nodes)", &|| unsafe {
            let mut p = 0;
            match sys::cuMemAllocAsync(&mut p, bytes, stream) {
                sys::CUresult::CUDA_SUCCESS => sys::cuMemFreeAsync(p, stream),
                e => e,
            }
        }),
    ];
    let mut rows = Vec::new();
    for (what, record) in kinds {
        for n in [4usize, 32] {
            match launch_us(n, record, stream) {
                Ok(us) => rows.push((format!("graph launch, {n} nodes of one kind: {what}"), us)),
                Err(e) => rows.push((
                    format!("graph launch, {n} nodes of one kind: {what}: {e}"),
                    f64::NAN,
                )),
            }
        }
    }
    // SAFETY: our own stream and event, idle.
    unsafe {
        sys::cuStreamSynchronize(stream);
        sys::cuEventDestroy_v2(event);
        sys::cuStreamDestroy_v2(stream);
    }
    rank.communicator().exchange(&[])?;
    Ok(rows)
}

/// Median host time of launching a graph of `n` operations recorded by `record` on
/// `stream` (which the graph is launched on too).
fn launch_us(
    n: usize,
    record: &dyn Fn() -> fusion::runtime::cudarc::driver::sys::CUresult,
    stream: fusion::runtime::cudarc::driver::sys::CUstream,
) -> Result<f64> {
    use fusion::runtime::cudarc::driver::sys;
    let fail = |what: &str, r: sys::CUresult| -> Result<()> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(fusion::Error::World(format!("{what}: {r:?}")))
        }
    };
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: capturing our own stream; every recorded operation names memory of
    // this rank (or the next rank's, reachable by peer access).
    unsafe {
        fail(
            "cuStreamBeginCapture",
            sys::cuStreamBeginCapture_v2(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            ),
        )?;
        let mut first = sys::CUresult::CUDA_SUCCESS;
        for _ in 0..n {
            let r = record();
            if first == sys::CUresult::CUDA_SUCCESS {
                first = r;
            }
        }
        let ended = sys::cuStreamEndCapture(stream, &mut graph);
        fail("recording", first)?;
        fail("cuStreamEndCapture", ended)?;
        fail(
            "cuGraphInstantiate",
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
        )?;
    }
    let mut t = Vec::new();
    for _ in 0..50 {
        // SAFETY: launching the graph just made on our stream.
        unsafe {
            fail("cuStreamSynchronize", sys::cuStreamSynchronize(stream))?;
            let start = Instant::now();
            fail("cuGraphLaunch", sys::cuGraphLaunch(exec, stream))?;
            t.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    // SAFETY: done with the graph.
    unsafe {
        fail("cuStreamSynchronize", sys::cuStreamSynchronize(stream))?;
        sys::cuGraphExecDestroy(exec);
        sys::cuGraphDestroy(graph);
    }
    Ok(median(t))
}
