//! Overlap benchmark: AllGather+GEMM and GEMM+ReduceScatter on every device of the world,
//! timing communication alone, GEMM alone, the sequential program and each of our
//! lowerings (collective pipeline, NCCL P2P pipeline, copy-engine P2P pipeline), in one
//! process and run.
//! Every variant's result is checked against the sequential result of the same run.
//!
//! ```sh
//! cargo run --release --example overlap_bench -- --json out.json
//! ```
//!
//! Times are medians over `--iters` calls (device events around each call, all ranks
//! released together), the maximum over ranks; "bound" is max(NCCL collective alone, GEMM
//! alone) measured in the same run.

mod fusions;
mod measure;
mod report;

#[path = "../common/finish.rs"]
mod finish;

use std::sync::Arc;

use clap::Parser;
use fusion::compiler::hir::Transport;
use fusion::compiler::lower::{LowerOptions, Pipelining, ReduceScatterPipeline};
use fusion::runtime::backend::Kernel;
use fusion::{DType, ExecOptions, FusionExecutor, Rank, Result, Tensor, World};

use measure::{device_ms, host_us, median, random, rel_error};
use report::Row;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Devices (default: every GPU, else 4 simulated devices).
    #[arg(long)]
    devices: Option<usize>,
    /// Shapes as M,K,N separated by `;`.
    #[arg(long, default_value = "16384,8192,2048;8192,8192,8192;16384,8192,8192")]
    shapes: String,
    /// `ag`, `rs` or both.
    #[arg(long, default_value = "ag,rs")]
    ops: String,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Chunk counts of the collective pipelines.
    #[arg(long, default_value = "2,4,8")]
    chunks: String,
    /// Stream counts.
    #[arg(long, default_value = "2,4")]
    streams: String,
    /// Copy-engine transports to try, as mode/stream: `push/peer` (the sender copies, on a
    /// copy stream per peer) is the only one since the others were measured and deleted
    /// (`docs/ARCHITECTURE.md`, "Decisions"); empty for none.
    #[arg(long, default_value = "push/peer")]
    transports: String,
    /// Row sub-chunks per device block of the copy-engine GEMM+RS pipeline to try besides
    /// the default (`LowerOptions::pipelines.reduce_scatter_subchunks`), with the transports of
    /// `--rs-subchunk-transports`.
    #[arg(long, default_value = "1,2,4")]
    rs_subchunks: String,
    /// Transports (of `--transports`) with which the `--rs-subchunks` variants run.
    #[arg(long, default_value = "push/peer")]
    rs_subchunk_transports: String,
    /// Variants (names as printed) to run once more with a trace; rank 0's timeline is
    /// printed.
    #[arg(long, default_value = "")]
    trace: String,
    /// Write every measurement as JSON lines here.
    #[arg(long)]
    json: Option<String>,
    /// Seed of the random inputs (default: drawn from the clock, so every run gets fresh
    /// inputs; printed for a rerun).
    #[arg(long)]
    seed: Option<u64>,
    /// Small shapes for a quick run on simulated devices.
    #[arg(long)]
    quick: bool,
    /// Stream iterations (chunks) of the tiny collective AG+GEMM pipeline whose host time
    /// per call is measured eagerly and replayed as a CUDA graph (empty: skip).
    #[arg(long, default_value = "2,4,8,16")]
    host_iterations: String,
}

fn list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|x| x.trim().parse().ok()).collect()
}

/// What one rank measured for one variant.
#[derive(Clone, Debug, Default)]
struct Sample {
    ms: f64,
    relerr: f64,
    peak_bytes: usize,
    nodes: usize,
    /// The timeline of one traced call, when this variant was asked for.
    trace: Option<Vec<fusion::runtime::trace::TraceEvent>>,
    /// Host time per node kind of that call: (kind, count, microseconds).
    host: Vec<(String, u32, f64)>,
}

type Samples = Vec<(String, Sample)>;

/// Every rank's (ms, relative error) of each variant in `samples`, in rank order: ranks in
/// other processes (a launched world) report theirs through the world.
fn gather_times(rank: &Rank, samples: &Samples) -> Result<Vec<Vec<(f64, f64)>>> {
    let flat: Vec<f32> = samples
        .iter()
        .flat_map(|(_, s)| [s.ms as f32, s.relerr as f32])
        .collect();
    let t = Tensor::from_f32(&[samples.len(), 2], &flat, DType::F32)?;
    rank.gather_to_host(&t)?
        .into_iter()
        .map(|t| {
            let v = t.to_f32_vec()?;
            Ok(v.chunks(2)
                .map(|c| (f64::from(c[0]), f64::from(c[1])))
                .collect())
        })
        .collect()
}

fn opts(
    streams: usize,
    backend: Transport,
    stream_lowering: bool,
    stream_buffers: bool,
) -> ExecOptions {
    // The pipelines are what it measures, at every size of its sweeps.
    let mut lower = LowerOptions::default()
        .with_transport(backend)
        .with_pipelining(Pipelining::Always);
    lower.streams.buffers = stream_buffers;
    if !stream_lowering {
        lower = lower.without_pass("StreamParallelType");
    }
    ExecOptions {
        number_of_streams: streams,
        lower,
        ..ExecOptions::default()
    }
}

/// How a variant's output is compared: the error fusion, the reference, and a view of
/// the output in the reference's layout.
type Check<'a> = Option<(
    &'a FusionExecutor,
    &'a Tensor,
    &'a dyn Fn(&Tensor) -> Result<Tensor>,
)>;

/// Times `exec` on `inputs`, checks its output against the reference.
fn variant(
    rank: &Rank,
    a: &Args,
    exec: &FusionExecutor,
    inputs: &[&Tensor],
    o: &ExecOptions,
    check: Check<'_>,
) -> Result<(Sample, Tensor)> {
    let ms = device_ms(rank, a.iters, a.warmup, || {
        exec.run_with(rank, inputs, None, o).map(|_| ())
    })?;
    // One more call for the output (replayed where the timed calls were), one walked call
    // for the memory and host profile (a replayed call walks nothing; untraced: trace
    // markers would add host time), and one traced call when traces were asked for.
    let report = exec.run_with(rank, inputs, None, o)?;
    let walked = ExecOptions {
        graphs: false,
        ..o.clone()
    };
    let profile = exec.run_with(rank, inputs, None, &walked)?;
    let trace = if a.trace.is_empty() {
        None
    } else {
        let traced = ExecOptions {
            trace: true,
            ..o.clone()
        };
        exec.run_with(rank, inputs, None, &traced)?.trace
    };
    let out = report.outputs[0].clone();
    let relerr = match check {
        Some((err_exec, reference, view)) => rel_error(rank, err_exec, &view(&out)?, reference)?,
        None => 0.0,
    };
    Ok((
        Sample {
            ms,
            relerr,
            peak_bytes: profile.stats.peak_live_bytes,
            nodes: profile.stats.nodes_executed,
            trace,
            host: profile
                .stats
                .host_profile()
                .into_iter()
                .map(|(k, h)| (format!("{k:?}"), h.count, h.nanos as f64 / 1e3))
                .collect(),
        },
        out,
    ))
}

struct Execs {
    allgather: FusionExecutor,
    gemm: FusionExecutor,
    ag_p2p: FusionExecutor,
    ag_coll: FusionExecutor,
    reduce_scatter: FusionExecutor,
    rs_p2p: FusionExecutor,
    rs_coll: FusionExecutor,
    err: FusionExecutor,
}

/// AG+GEMM variants on one rank. `transport` is `None` for the NCCL and baseline group.
fn run_ag(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    host: &[Tensor; 2],
    shape: (usize, usize, usize),
    transport: Option<&str>,
) -> Result<Samples> {
    let d = rank.world_size();
    let (m, _k, n) = shape;
    let _ = &n;
    let r = rank.index();
    let a_local = rank.to_device(&host[0].shard(0, r, d)?)?; // [1, m/d, k]
    let b = rank.to_device(&host[1])?; // [k, n]
    let mut out: Samples = Vec::new();
    let nccl_seq = opts(d, Transport::Nccl, false, true);
    let (_, seq) = variant(rank, a, &e.ag_p2p, &[&a_local, &b], &nccl_seq, None)?;
    let same = |t: &Tensor| Ok(t.clone());
    let check = Some((&e.err, &seq, &same as &dyn Fn(&Tensor) -> Result<Tensor>));
    if let Some(t) = transport {
        let tag = t.replace('/', "_");
        let o = opts(d, Transport::CopyEngine, true, true);
        let (s, _) = variant(rank, a, &e.ag_p2p, &[&a_local, &b], &o, check)?;
        out.push((format!("p2p_ce_{tag}_n{d}"), s));
        for &ns in &list(&a.streams) {
            for &c in &list(&a.chunks) {
                if (m / d) % c != 0 {
                    continue;
                }
                let chunked = a_local.squeeze(0)?.split_axis(0, c)?.unsqueeze(1)?;
                let seq_c = seq.reshape(&[d, c, m / (d * c), n])?;
                let to_seq = |t: &Tensor| -> Result<Tensor> { t.permute(&[1, 0, 2, 3]) };
                let check_c = Some((
                    &e.err,
                    &seq_c,
                    &to_seq as &dyn Fn(&Tensor) -> Result<Tensor>,
                ));
                let o = opts(ns, Transport::CopyEngine, true, true);
                let (s, _) = variant(rank, a, &e.ag_coll, &[&chunked, &b], &o, check_c)?;
                out.push((format!("collective_ce_{tag}_s{c}_n{ns}"), s));
            }
        }
        return Ok(out);
    }
    let (s, gathered) = variant(rank, a, &e.allgather, &[&a_local], &nccl_seq, None)?;
    out.push(("comm_alone".into(), s));
    // One [m, k] @ [k, n] GEMM (the bound's GEMM), on the gathered rows.
    let full = gathered.reshape(&[1, m, gathered.shape()[2]])?;
    let (s, _) = variant(rank, a, &e.gemm, &[&full, &b], &nccl_seq, None)?;
    out.push(("gemm_alone".into(), s));
    let (s, _) = variant(rank, a, &e.ag_p2p, &[&a_local, &b], &nccl_seq, check)?;
    out.push(("sequential".into(), s));
    for &ns in &list(&a.streams) {
        for &c in &list(&a.chunks) {
            if (m / d) % c != 0 {
                continue;
            }
            // Chunk c of this rank's rows: [c, 1, m/(d c), k] (a view).
            let chunked = a_local.squeeze(0)?.split_axis(0, c)?.unsqueeze(1)?;
            // Output [c, d, m/(d c), n] viewed in the sequential order [d, c, m/(d c), n].
            let seq_c = seq.reshape(&[d, c, m / (d * c), n])?;
            let to_seq = |t: &Tensor| -> Result<Tensor> { t.permute(&[1, 0, 2, 3]) };
            let check_c = Some((
                &e.err,
                &seq_c,
                &to_seq as &dyn Fn(&Tensor) -> Result<Tensor>,
            ));
            for buffers in [true, false] {
                if !(buffers || c == 8 && ns == 2) {
                    continue;
                }
                let o = opts(ns, Transport::Nccl, true, buffers);
                let (s, _) = variant(rank, a, &e.ag_coll, &[&chunked, &b], &o, check_c)?;
                let tag = if buffers { "" } else { "_fullbuf" };
                out.push((format!("collective_s{c}_n{ns}{tag}"), s));
            }
        }
    }
    for ns in [2, d] {
        let o = opts(ns, Transport::Nccl, true, true);
        let (s, _) = variant(rank, a, &e.ag_p2p, &[&a_local, &b], &o, check)?;
        out.push((format!("p2p_nccl_n{ns}"), s));
        if ns == d {
            break;
        }
    }
    Ok(out)
}

/// Median device ms of `x @ w` computed as `pieces` GEMMs of consecutive row ranges, taking
/// turns on `streams` streams (joined at the end); every block of `pieces / d` ranges after
/// the first adds a running sum of the previous block's shape, as the ring's steps do.
fn gemm_in_row_pieces(
    rank: &Rank,
    a: &Args,
    x: &Tensor,
    w: &Tensor,
    pieces: usize,
    streams: usize,
) -> Result<f64> {
    let dev = rank.device();
    let (m, n) = (x.shape()[0], w.shape()[1]);
    let rows = m / pieces;
    let per_block = pieces / rank.world_size();
    let out = dev.allocate(0, x.dtype(), &[m, n])?;
    let sum = rank.to_device(&random(&[rows, n], x.dtype(), 7)?)?;
    dev.ensure_streams(streams)?;
    device_ms(rank, a.iters, a.warmup, || {
        for s in 1..streams {
            dev.stream_wait(s, 0)?;
        }
        for p in 0..pieces {
            let dst = out.narrow(0, p * rows, rows)?;
            dev.execute(
                p % streams,
                Kernel::Gemm {
                    a: &x.narrow(0, p * rows, rows)?,
                    b: w,
                    bias: None,
                    accumulate: p >= per_block,
                    addend: (p >= per_block).then_some(&sum),
                    epilogue: &[],
                    dst: &dst,
                },
            )?;
        }
        for s in 1..streams {
            dev.stream_wait(0, s)?;
        }
        Ok(())
    })
}

/// GEMM+RS variants on one rank.
fn run_rs(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    host: &[Tensor; 2],
    shape: (usize, usize, usize),
    transport: Option<&str>,
) -> Result<Samples> {
    let d = rank.world_size();
    let (m, k, n) = shape;
    let r = rank.index();
    // A: this rank's [m, k/d] columns as [1, d, m/d, k/d]; B: its [k/d, n] rows as [1, k/d, n].
    let a_local = rank.to_device(&host[0].shard(0, r, d)?)?;
    let a4 = a_local.squeeze(0)?.split_axis(0, d)?.unsqueeze(0)?;
    let b_local = rank.to_device(&host[1].shard(0, r, d)?)?;
    let mut out: Samples = Vec::new();
    let seq_o = opts(d, Transport::Nccl, false, true);
    let (_, seq) = variant(rank, a, &e.rs_p2p, &[&a4, &b_local], &seq_o, None)?;
    let same = |t: &Tensor| Ok(t.clone());
    let check = Some((&e.err, &seq, &same as &dyn Fn(&Tensor) -> Result<Tensor>));
    if let Some(t) = transport {
        let tag = t.replace('/', "_");
        let mut o = opts(d, Transport::CopyEngine, true, true);
        let (s, _) = variant(rank, a, &e.rs_p2p, &[&a4, &b_local], &o, check)?;
        out.push((format!("p2p_ce_{tag}_n{d}"), s));
        if a.rs_subchunk_transports.split(',').any(|x| x.trim() == t) {
            // Both pipelines with each block in `c` row ranges: direct (partials sent to
            // their owner, summed round by round) and the ring (running sums added in the
            // GEMM epilogue); what the defaults already give is not run twice.
            for (pipeline, name) in [
                (ReduceScatterPipeline::Direct, "sub"),
                (ReduceScatterPipeline::Ring, "ring"),
            ] {
                for c in list(&a.rs_subchunks) {
                    let mut oc = o.clone();
                    oc.lower.pipelines.reduce_scatter_subchunks = Some(c);
                    oc.lower.pipelines.reduce_scatter = pipeline;
                    // The ring also with its GEMMs taking turns on two compute streams.
                    let computes = if pipeline == ReduceScatterPipeline::Ring {
                        &[1, 2][..]
                    } else {
                        &[1][..]
                    };
                    // And the ring with a pool stream per row range: on fewer, the GEMM
                    // that adds the sum of iteration `i - c` also waits for the later
                    // exchanges queued on that iteration's stream.
                    let streams = if pipeline == ReduceScatterPipeline::Ring && c > d {
                        vec![d, c]
                    } else {
                        vec![d]
                    };
                    for (&compute, &n) in computes
                        .iter()
                        .flat_map(|c| streams.iter().map(move |n| (c, n)))
                    {
                        oc.lower.streams.ring_compute_streams = compute;
                        oc.number_of_streams = n;
                        if oc.lower.reduce_scatter_plan(d) == o.lower.reduce_scatter_plan(d)
                            && compute == o.lower.streams.ring_compute_streams
                            && n == d
                        {
                            continue;
                        }
                        let (s, _) = variant(rank, a, &e.rs_p2p, &[&a4, &b_local], &oc, check)?;
                        let suffix = if compute == 1 { "" } else { "_c2" };
                        out.push((format!("p2p_ce_{tag}_n{n}_{name}{c}{suffix}"), s));
                    }
                }
            }
            // The same pipeline with every iteration's GEMM and transfer on one pool
            // stream (the seeds' layout): the GEMMs of all iterations then run together.
            o.lower.streams.compute_first = false;
            let (s, _) = variant(rank, a, &e.rs_p2p, &[&a4, &b_local], &o, check)?;
            out.push((format!("p2p_ce_{tag}_n{d}_one_stream"), s));
        }
        for &c in &list(&a.chunks) {
            if (m / d) % c != 0 {
                continue;
            }
            let (chunked, to_seq) = rs_chunked(&a_local, d, c, m, n)?;
            let check_c = Some((&e.err, &seq, &*to_seq as &dyn Fn(&Tensor) -> Result<Tensor>));
            let o = opts(2, Transport::CopyEngine, true, true);
            let (s, _) = variant(rank, a, &e.rs_coll, &[&chunked, &b_local], &o, check_c)?;
            out.push((format!("collective_ce_{tag}_s{c}_n2"), s));
        }
        return Ok(out);
    }
    // One [m, k/d] @ [k/d, n] GEMM, then its result reduce-scattered.
    let (s, partial) = variant(
        rank,
        a,
        &e.gemm,
        &[&a_local, &b_local.squeeze(0)?],
        &seq_o,
        None,
    )?;
    out.push(("gemm_alone".into(), s));
    // The same GEMM as the ring computes it with `c` row ranges per block: `d c` GEMMs of
    // `m / (d c)` rows back to back, those after the first block's adding a running sum
    // (the floor the ring's GEMMs set, without any transfer).
    for c in list(&a.rs_subchunks) {
        let pieces = d * c;
        if m % pieces != 0 {
            continue;
        }
        for streams in [1, 2] {
            let ms = gemm_in_row_pieces(
                rank,
                a,
                &a_local.squeeze(0)?,
                &b_local.squeeze(0)?,
                pieces,
                streams,
            )?;
            let tag = if streams == 1 { "" } else { "_s2" };
            out.push((
                format!("gemm_alone_rows{pieces}{tag}"),
                Sample {
                    ms,
                    ..Sample::default()
                },
            ));
        }
    }
    let partial = partial.reshape(&[1, d, m / d, n])?;
    let (s, _) = variant(rank, a, &e.reduce_scatter, &[&partial], &seq_o, None)?;
    out.push(("comm_alone".into(), s));
    let (s, _) = variant(rank, a, &e.rs_p2p, &[&a4, &b_local], &seq_o, check)?;
    out.push(("sequential".into(), s));
    for &c in &list(&a.chunks) {
        if (m / d) % c != 0 {
            continue;
        }
        let (chunked, to_seq) = rs_chunked(&a_local, d, c, m, n)?;
        let check_c = Some((&e.err, &seq, &*to_seq as &dyn Fn(&Tensor) -> Result<Tensor>));
        let o = opts(2, Transport::Nccl, true, true);
        let (s, _) = variant(rank, a, &e.rs_coll, &[&chunked, &b_local], &o, check_c)?;
        out.push((format!("collective_s{c}_n2"), s));
    }
    let o = opts(d, Transport::Nccl, true, true);
    let (s, _) = variant(rank, a, &e.rs_p2p, &[&a4, &b_local], &o, check)?;
    out.push((format!("p2p_nccl_n{d}"), s));
    let _ = k;
    Ok(out)
}

/// The collective GEMM+RS pipeline's input: rows `j*(m/d) + s*(m/(d c)) + i` of this
/// rank's `[m, k/d]` columns as `[1, c, d, m/(d c), k/d]` (a view), so that each chunk's
/// result rows form a block of the sequential result; and the view of the pipeline's
/// `[c, 1, m/(d c), n]` output in the sequential `[1, m/d, n]` layout.
#[allow(clippy::type_complexity)]
fn rs_chunked(
    a_local: &Tensor,
    d: usize,
    c: usize,
    m: usize,
    n: usize,
) -> Result<(Tensor, Box<dyn Fn(&Tensor) -> Result<Tensor>>)> {
    let chunked = a_local
        .squeeze(0)?
        .split_axis(0, d)?
        .split_axis(1, c)?
        .permute(&[1, 0, 2, 3])?
        .unsqueeze(0)?;
    let mc = m / (d * c);
    Ok((
        chunked,
        Box::new(move |t: &Tensor| t.reshape(&[1, c * mc, n])),
    ))
}

/// Rank 0's timeline of a traced call: each communication and kernel with its stream,
/// chunk and interval.
fn print_trace(s: &Sample) {
    let Some(events) = &s.trace else {
        return;
    };
    use fusion::runtime::trace::{busy_ms, overlaps};
    println!(
        "    trace (rank 0): comm busy {:.3} ms, compute busy {:.3} ms, {} comm/compute overlaps",
        busy_ms(events, true),
        busy_ms(events, false),
        overlaps(events).len()
    );
    let total: f64 = s.host.iter().map(|h| h.2).sum();
    let per_kind: Vec<String> = s
        .host
        .iter()
        .map(|(k, n, us)| format!("{k} {n}x {:.1}", us / f64::from(*n)))
        .collect();
    println!(
        "    host (rank 0, untraced call): {total:.1} us in leaf nodes; us per node: {}",
        per_kind.join(", ")
    );
    for e in events {
        println!(
            "    {:>8.3} {:>8.3}  stream {:<2} chunk {:<4} {}",
            e.start_ms,
            e.end_ms,
            e.stream,
            e.chunk.map_or("-".into(), |c| c.to_string()),
            e.name
        );
    }
}

/// Host cost of a tiny AllGather+GEMM P2P pipeline over `backend`: per call and the
/// number of host-IR nodes it runs.
fn host_overhead(world: &World, dt: DType, backend: Transport) -> Result<(f64, usize)> {
    let exec = FusionExecutor::new(fusions::ag_matmul_p2p(dt)?);
    let d = world.size();
    let host_a = random(&[d, 8, 8], dt, 99)?;
    let host_b = random(&[8, 8], dt, 98)?;
    // Walked, not replayed: this measures the host cost per host-IR node.
    let o = ExecOptions {
        graphs: false,
        ..opts(4, backend, true, true)
    };
    let per_rank = world.run(|rank| {
        let a = rank.shard(&host_a, 0)?;
        let b = rank.to_device(&host_b)?;
        let us = host_us(rank, 200, || {
            exec.run_with(rank, &[&a, &b], None, &o).map(|_| ())
        })?;
        let nodes = exec
            .run_with(rank, &[&a, &b], None, &o)?
            .stats
            .nodes_executed;
        rank.synchronize()?;
        // The slowest rank, wherever it runs.
        let all = rank.gather_to_host(&Tensor::from_f32(&[1], &[us as f32], DType::F32)?)?;
        let worst = all
            .iter()
            .map(|t| t.to_f32_vec().map(|v| f64::from(v[0])))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .fold(0.0, f64::max);
        Ok((worst, nodes))
    })?;
    Ok(per_rank
        .into_iter()
        .fold((0.0, 0), |acc, x| (acc.0.max(x.0), x.1)))
}

/// One row of the host time per call: iterations, mode, microseconds per call, host-IR
/// nodes walked, replay status, and for replayed calls the median setup and launch
/// microseconds and the graph's nodes.
struct HostPerCall {
    iterations: usize,
    mode: &'static str,
    us: f64,
    nodes: usize,
    status: String,
    setup: f64,
    launch: f64,
    graph_nodes: usize,
}

/// Host time per call of a tiny collective AG+GEMM pipeline over NCCL with `s` stream
/// iterations: walking the host program (graphs off), and replaying its CUDA graph (the
/// default, where the backend has graphs). Rows: (s, mode, us per call, host-IR nodes
/// the last call walked, how it ran).
fn host_per_iterations(world: &World, dt: DType, iterations: &[usize]) -> Result<Vec<HostPerCall>> {
    let d = world.size();
    let mut rows = Vec::new();
    for &s in iterations {
        let host_a = random(&[s, d, 8, 8], dt, 97)?;
        let host_b = random(&[8, 8], dt, 96)?;
        for (mode, graphs) in [("eager", false), ("replayed", true)] {
            let exec = FusionExecutor::new(fusions::ag_matmul_collective(dt)?);
            let o = ExecOptions {
                graphs,
                ..opts(4, Transport::Nccl, true, true)
            };
            let per_rank = world.run(|rank| {
                let a = rank.shard(&host_a, 1)?;
                let b = rank.to_device(&host_b)?;
                let (mut setups, mut launches) = (Vec::new(), Vec::new());
                let us = host_us(rank, 200, || {
                    let r = exec.run_with(rank, &[&a, &b], None, &o)?;
                    setups.push(r.stats.replay_setup.nanos as f64 / 1e3);
                    launches.push(r.stats.graph_launch.nanos as f64 / 1e3);
                    Ok(())
                })?;
                let (setup, launch) = (median(setups), median(launches));
                let last = exec.run_with(rank, &[&a, &b], None, &o)?;
                rank.synchronize()?;
                let all =
                    rank.gather_to_host(&Tensor::from_f32(&[1], &[us as f32], DType::F32)?)?;
                let worst = all
                    .iter()
                    .map(|t| t.to_f32_vec().map(|v| f64::from(v[0])))
                    .collect::<Result<Vec<_>>>()?
                    .into_iter()
                    .fold(0.0, f64::max);
                Ok(HostPerCall {
                    iterations: s,
                    mode,
                    us: worst,
                    nodes: last.stats.nodes_executed,
                    status: format!("{:?}", last.replay),
                    setup,
                    launch,
                    graph_nodes: last.stats.graph_nodes,
                })
            })?;
            rows.push(per_rank.into_iter().next().expect("a rank"));
        }
    }
    Ok(rows)
}

fn main() -> std::process::ExitCode {
    finish::finish(run())
}

fn run() -> Result<()> {
    let mut a = Args::parse();
    if a.quick {
        a.shapes = "64,32,16;32,32,32".into();
        a.iters = 3;
        a.warmup = 1;
    }
    let dt = DType::from_name(&a.dtype)
        .ok_or_else(|| fusion::Error::World(format!("unknown dtype {}", a.dtype)))?;
    let world = World::auto(a.devices)?;
    let d = world.size();
    println!(
        "overlap_bench: backend {} devices {d} dtype {dt}{}",
        world.backend().name(),
        match world.launch_spec() {
            Some(s) => format!(
                " (launched by {}: {} processes, this one holds ranks {:?})",
                s.launcher.name(),
                s.processes,
                world.local_ranks()
            ),
            None => " (one process)".into(),
        }
    );
    // In a launched world only rank 0's process writes the results.
    let reports = world.local_ranks().contains(&0);
    let execs = Execs {
        allgather: FusionExecutor::new(fusions::allgather(dt)?),
        gemm: FusionExecutor::new(fusions::gemm(dt)?),
        ag_p2p: FusionExecutor::new(fusions::ag_matmul_p2p(dt)?),
        ag_coll: FusionExecutor::new(fusions::ag_matmul_collective(dt)?),
        reduce_scatter: FusionExecutor::new(fusions::reduce_scatter(dt)?),
        rs_p2p: FusionExecutor::new(fusions::matmul_rs_p2p(dt)?),
        rs_coll: FusionExecutor::new(fusions::matmul_rs_collective(dt)?),
        err: FusionExecutor::new(fusions::squared_error(dt)?),
    };
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |t| t.as_nanos() as u64)
    });
    // Every process of a launched world uses rank 0's seed.
    let seed = world.run(|rank| Ok(rank.communicator().exchange(&[seed as i64])?[0][0] as u64))?[0];
    println!("overlap_bench: input seed {seed}");
    let mut rows: Vec<Row> = Vec::new();
    let transports: Vec<String> = a
        .transports
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(t) = transports.iter().find(|t| t.as_str() != "push/peer") {
        return Err(fusion::Error::World(format!(
            "--transports {t}: the copy-engine transport is push/peer (pull mode and the \
             serial and iteration copy streams were deleted, see docs/ARCHITECTURE.md, \
             \"Decisions\")"
        )));
    }
    for shape_s in a.shapes.split(';') {
        let v = list(shape_s);
        let (m, k, n) = (v[0], v[1], v[2]);
        for op in a.ops.split(',') {
            let host: Arc<[Tensor; 2]> = Arc::new(match op {
                "ag" => [
                    random(&[d, m / d, k], dt, seed.wrapping_add(1))?,
                    random(&[k, n], dt, seed.wrapping_add(2))?,
                ],
                "rs" => [
                    random(&[d, m, k / d], dt, seed.wrapping_add(3))?,
                    random(&[d, k / d, n], dt, seed.wrapping_add(4))?,
                ],
                other => return Err(fusion::Error::World(format!("unknown op {other}"))),
            });
            let groups: Vec<Option<String>> = std::iter::once(None)
                .chain(transports.iter().cloned().map(Some))
                .collect();
            for g in groups {
                let per_rank = world.run(|rank| {
                    let samples = match op {
                        "ag" => run_ag(rank, &a, &execs, &host, (m, k, n), g.as_deref()),
                        _ => run_rs(rank, &a, &execs, &host, (m, k, n), g.as_deref()),
                    }?;
                    let all = gather_times(rank, &samples)?;
                    Ok((samples, all))
                })?;
                let (per_rank, mut everyone): (Vec<Samples>, Vec<_>) = per_rank.into_iter().unzip();
                let all_ranks = everyone.swap_remove(0);
                for (i, (name, _)) in per_rank[0].iter().enumerate() {
                    let samples: Vec<&Sample> = per_rank.iter().map(|r| &r[i].1).collect();
                    let every: Vec<(f64, f64)> = all_ranks.iter().map(|r| r[i]).collect();
                    rows.push(Row {
                        op: if op == "ag" { "AG+GEMM" } else { "GEMM+RS" }.into(),
                        m,
                        k,
                        n,
                        devices: d,
                        dtype: dt.name().into(),
                        variant: name.clone(),
                        ms: every.iter().map(|s| s.0).fold(0.0, f64::max),
                        rank_ms: every.iter().map(|s| s.0).collect(),
                        relerr: every.iter().map(|s| s.1).fold(0.0, f64::max),
                        peak_bytes: samples[0].peak_bytes,
                        nodes: samples[0].nodes,
                    });
                    let r = rows.last().expect("pushed");
                    if !reports {
                        continue;
                    }
                    println!(
                        "{:8} {m:>6} {k:>6} {n:>6} {:<28} {:8.3} ms  relerr {:.2e}",
                        r.op, r.variant, r.ms, r.relerr
                    );
                    if a.trace.split(',').any(|t| t == name) {
                        print_trace(&per_rank[0][i].1);
                    }
                }
            }
        }
    }
    let mut host_lines = String::new();
    for (backend, transport) in [
        (Transport::CopyEngine, "copy_engine"),
        (Transport::Nccl, "nccl"),
    ] {
        let (us, nodes) = host_overhead(&world, dt, backend)?;
        let per = us / nodes as f64;
        println!("host overhead ({transport}): tiny AG+GEMM P2P pipeline {us:.1} us per call, {nodes} host-IR nodes, {per:.2} us per node");
        host_lines.push_str(&format!(
            "{{\"case\": \"host_overhead\", \"transport\": \"{transport}\", \"devices\": {d}, \"us_per_call\": {us:.3}, \"nodes\": {nodes}, \"us_per_node\": {per:.4}}}\n"
        ));
    }
    let iterations = list(&a.host_iterations);
    if !iterations.is_empty() {
        for HostPerCall {
            iterations: s,
            mode,
            us,
            nodes,
            status,
            setup,
            launch,
            graph_nodes,
        } in host_per_iterations(&world, dt, &iterations)?
        {
            if reports {
                println!(
                    "host per call: collective AG+GEMM, {s:>2} stream iterations, {mode:<8} {us:8.1} us ({nodes} host-IR nodes walked; {status}; setup {setup:.1} us, graph launch {launch:.1} us, {graph_nodes} graph nodes)"
                );
            }
            host_lines.push_str(&format!(
                "{{\"case\": \"host_per_call\", \"devices\": {d}, \"iterations\": {s}, \"mode\": \"{mode}\", \"us_per_call\": {us:.3}, \"nodes\": {nodes}, \"status\": \"{status}\", \"replay_setup_us\": {setup:.3}, \"graph_launch_us\": {launch:.3}, \"graph_nodes\": {graph_nodes}}}\n"
            ));
        }
    }
    if !reports {
        return Ok(());
    }
    if let Some(path) = &a.json {
        let mut text = String::new();
        for r in &rows {
            text.push_str(&r.json());
            text.push('\n');
        }
        text.push_str(&host_lines);
        std::fs::write(path, text)
            .map_err(|e| fusion::Error::World(format!("writing {path}: {e}")))?;
    }
    report::print_table(&rows);
    Ok(())
}
