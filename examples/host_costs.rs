//! Host cost of the device operations a host program is made of: how long the calling
//! thread spends enqueuing one GEMM, one stream wait and one copy kernel (device work is
//! not waited for), a `Matmul` node and a one-GEMM call (rank 0). On several ranks, also
//! whole calls of tiny copy-engine pipelines, walked and replayed as CUDA graphs: the
//! AllGather+GEMM ring and the GEMM+ReduceScatter ring with 1, 2, 4 and 8 row ranges per
//! block (`D`, `2 D`, `4 D`, `8 D` stream iterations). These bound how fine a pipeline can
//! be before the host, not the GPU, sets its pace.
//!
//! ```sh
//! cargo run --release --example host_costs -- --devices 1
//! # two ranks on the visible GPUs, both on GPU 0 on a one-GPU machine
//! CUDA_DEVICE_MAX_CONNECTIONS=32 CUDA_MODULE_LOADING=EAGER \
//!     cargo run --release --example host_costs -- --devices 2 --share-gpus
//! ```

#[path = "common/finish.rs"]
mod finish;
#[allow(dead_code)] // the overlap benchmark's fusions; this uses one
#[path = "overlap_bench/fusions.rs"]
mod fusions;

use std::time::Instant;

use clap::Parser;
use fusion::core::hir::NodeKind;
use fusion::core::lower::{LowerOptions, ReduceScatterPipeline};
use fusion::runtime::backend::Kernel;
use fusion::runtime::replay::ReplayStatus;
use fusion::{DType, ExecOptions, FusionExecutor, Rank, Result, Tensor, World};

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

fn main() -> std::process::ExitCode {
    finish::finish(run())
}

/// (what, microseconds per call) rows of one rank.
type Rows = Vec<(String, f64)>;

fn run() -> Result<()> {
    let a = Args::parse();
    let world = if a.share_gpus {
        fusion::runtime::world::cuda_world_sharing_gpus(a.devices.unwrap_or(2))?
    } else {
        World::auto(a.devices)?
    };
    let rows = world.run(|rank| {
        // Every rank measures (so that all of them are at the same place when the pipelines
        // start, and a GPU shared by ranks is as busy as in a pipeline); rank 0 reports.
        let mut rows = single_device(rank, &a)?;
        rank.synchronize()?;
        rank.communicator().exchange(&[])?;
        if rank.world_size() > 1 {
            rows.extend(pipelines(rank, &a)?);
        }
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
fn pipelines(rank: &Rank, a: &Args) -> Result<Rows> {
    let d = rank.world_size();
    let dt = DType::BF16;
    let mut rows = Vec::new();
    let mut measure =
        |what: String, exec: &FusionExecutor, inputs: &[&Tensor], lower: &LowerOptions| {
            for (mode, graphs) in [("walked", false), ("graphs on", true)] {
                let o = ExecOptions {
                    graphs,
                    lower: lower.clone(),
                    ..ExecOptions::default()
                };
                let us = host_us(rank, a.calls, || {
                    exec.run_with(rank, inputs, None, &o).map(|_| ())
                })?;
                let r = exec.run_with(rank, inputs, None, &o)?;
                let how = match r.replay {
                    ReplayStatus::Replayed => format!(
                        "replayed: {} graph nodes, launch {:.1} us",
                        r.stats.graph_nodes,
                        r.stats.graph_launch.nanos as f64 / 1e3
                    ),
                    other => format!("{} host-IR nodes, {other:?}", r.stats.nodes_executed),
                };
                rows.push((format!("{what}, {mode} ({how})"), us));
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
            reduce_scatter_pipeline: ReduceScatterPipeline::Ring,
            reduce_scatter_subchunks: Some(c),
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
        Ok(vec![
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
        ])
    }
}
