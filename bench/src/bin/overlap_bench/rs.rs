//! The GEMM + ReduceScatter variants on one rank: the GEMM alone (also in the ring's row
//! pieces), the collective alone, the sequential program, the collective pipelines and the
//! P2P pipelines (direct and ring, with row ranges), over NCCL or the copy engines.

use fusion::compiler::hir::Transport;
use fusion::compiler::lower::{Pipelining, ReduceScatterPipeline};
use fusion::runtime::backend::Kernel;
use fusion::{Rank, Result, Tensor};
use fusion_bench::cli::list;
use fusion_bench::measure::{device_ms, random};

use crate::sample::{default_against_best, default_call, opts, variant, Execs, Sample, Samples};
use crate::Args;

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
pub fn run_rs(
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
        return rs_copy_engine(rank, a, e, t, [&a_local, &a4, &b_local], &seq, (m, n));
    }
    if a.only_default {
        let (s, _) = default_call(rank, a, &e.rs_p2p, &[&a4, &b_local], check)?;
        out.push(("default_call".into(), s));
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
    let (s, _) = default_call(rank, a, &e.rs_p2p, &[&a4, &b_local], check)?;
    out.push(("default_call".into(), s));
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
    // The fused GEMM + ReduceScatter (the plan candidate `scattered_gemm`): one persistent
    // Hopper GEMM per rank whose storer warps add each tile into its owner's output (where
    // the device runs that kernel in a world of one process; elsewhere this is the
    // sequential program).
    let mut o = seq_o.clone();
    o.lower = o.lower.with_pipelining(Pipelining::Never);
    o.lower.pipelines.scattered_gemm = true;
    let (s, _) = variant(rank, a, &e.rs_p2p, &[&a4, &b_local], &o, check)?;
    out.push(("scattered_gemm_persistent".into(), s));
    let _ = k;
    Ok(out)
}

/// The GEMM+RS variants over the copy-engine transport `t` on one rank: the P2P pipeline
/// (also with row ranges, direct and ring, and on one pool stream) and the collective
/// pipelines, each checked against `seq` (the sequential result). `local`: this rank's
/// `[1, m, k/d]` columns of A, the same as `[1, d, m/d, k/d]`, and its `[1, k/d, n]` rows
/// of B.
fn rs_copy_engine(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    t: &str,
    local: [&Tensor; 3],
    seq: &Tensor,
    (m, n): (usize, usize),
) -> Result<Samples> {
    let d = rank.world_size();
    let [a_local, a4, b_local] = local;
    let mut out: Samples = Vec::new();
    let same = |t: &Tensor| Ok(t.clone());
    let check = Some((&e.err, seq, &same as &dyn Fn(&Tensor) -> Result<Tensor>));
    let tag = t.replace('/', "_");
    let mut o = opts(d, Transport::CopyEngine, true, true);
    let (s, _) = variant(rank, a, &e.rs_p2p, &[a4, b_local], &o, check)?;
    out.push((format!("p2p_ce_{tag}_n{d}"), s));
    // The option variants of this group, for the alternating comparison at the end.
    let mut options = vec![(format!("p2p_ce_{tag}_n{d}"), o.clone())];
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
                    let (s, _) = variant(rank, a, &e.rs_p2p, &[a4, b_local], &oc, check)?;
                    let suffix = if compute == 1 { "" } else { "_c2" };
                    let vname = format!("p2p_ce_{tag}_n{n}_{name}{c}{suffix}");
                    options.push((vname.clone(), oc.clone()));
                    out.push((vname, s));
                }
            }
        }
        // The same pipeline with every iteration's GEMM and transfer on one pool
        // stream (the seeds' layout): the GEMMs of all iterations then run together.
        o.lower.streams.compute_first = false;
        let (s, _) = variant(rank, a, &e.rs_p2p, &[a4, b_local], &o, check)?;
        out.push((format!("p2p_ce_{tag}_n{d}_one_stream"), s));
        options.push((format!("p2p_ce_{tag}_n{d}_one_stream"), o.clone()));
    }
    for &c in &list(&a.chunks) {
        if (m / d) % c != 0 {
            continue;
        }
        let (chunked, to_seq) = rs_chunked(a_local, d, c, m, n)?;
        let check_c = Some((&e.err, seq, &*to_seq as &dyn Fn(&Tensor) -> Result<Tensor>));
        let o = opts(2, Transport::CopyEngine, true, true);
        let (s, _) = variant(rank, a, &e.rs_coll, &[&chunked, b_local], &o, check_c)?;
        out.push((format!("collective_ce_{tag}_s{c}_n2"), s));
    }
    let ab = default_against_best(rank, a, &e.rs_p2p, &[a4, b_local], &options, &out)?;
    out.extend(ab);
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
