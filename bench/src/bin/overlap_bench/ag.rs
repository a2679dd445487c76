//! The AllGather + GEMM variants on one rank: the collective alone, the GEMM alone, the
//! sequential program, the collective pipelines and the P2P pipelines, over NCCL or the
//! copy engines, and the fused AllGather + GEMM on the persistent Hopper kernel.

use fusion::compiler::hir::{CopyStreams, Transport};
use fusion::{ExecOptions, GemmEngine, Rank, Result, Tensor};
use fusion_bench::cli::list;

use crate::sample::{default_against_best, default_call, opts, variant, Execs, Samples};
use crate::Args;

/// AG+GEMM variants on one rank. `transport` is `None` for the NCCL and baseline group.
pub fn run_ag(
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
        let options = vec![(format!("p2p_ce_{tag}_n{d}"), o)];
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
        let ab = default_against_best(rank, a, &e.ag_p2p, &[&a_local, &b], &options, &out)?;
        out.extend(ab);
        return Ok(out);
    }
    if a.only_default {
        let (s, _) = default_call(rank, a, &e.ag_p2p, &[&a_local, &b], check)?;
        out.push(("default_call".into(), s));
        return Ok(out);
    }
    let (s, gathered) = variant(rank, a, &e.allgather, &[&a_local], &nccl_seq, None)?;
    out.push(("comm_alone".into(), s));
    // One [m, k] @ [k, n] GEMM (the bound's GEMM), on the gathered rows.
    let full = gathered.reshape(&[1, m, gathered.shape()[2]])?;
    let (s, _) = variant(rank, a, &e.gemm, &[&full, &b], &nccl_seq, None)?;
    out.push(("gemm_alone".into(), s));
    // The same GEMM on the persistent Hopper kernel (cuBLAS where it does not run).
    let persistent = ExecOptions {
        gemm: GemmEngine::Persistent,
        ..nccl_seq.clone()
    };
    let (s, _) = variant(rank, a, &e.gemm, &[&full, &b], &persistent, None)?;
    out.push(("gemm_alone_persistent".into(), s));
    let (s, _) = variant(rank, a, &e.ag_p2p, &[&a_local, &b], &nccl_seq, check)?;
    out.push(("sequential".into(), s));
    let (s, _) = default_call(rank, a, &e.ag_p2p, &[&a_local, &b], check)?;
    out.push(("default_call".into(), s));
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
    // The fused AllGather + GEMM (the plan candidate `gathered_gemm`): one persistent
    // Hopper GEMM whose loader waits for each block's ready word behind the copy engines
    // (where the device runs that kernel; elsewhere this is the copy-engine pipeline).
    // With `rows` row ranges per block, each said ready on its own (the plan candidates).
    // And in four ranges landing in the senders' order (`CopyStreams::OneInSendOrder`, the
    // candidate `gathered_gemm_send_order_rows4`).
    for (rows, send_order) in [(None, false), (Some(2), false), (Some(4), true)] {
        let mut o = opts(d, Transport::CopyEngine, true, true);
        o.lower.pipelines.gathered_gemm = true;
        o.lower.pipelines.allgather_subchunks = rows;
        if send_order {
            o.lower.transports.copy_streams = CopyStreams::OneInSendOrder;
        }
        let (s, _) = variant(rank, a, &e.ag_p2p, &[&a_local, &b], &o, check)?;
        let tag = rows.map_or(String::new(), |r| format!("_rows{r}"));
        let order = if send_order { "_send_order" } else { "" };
        out.push((format!("gathered_gemm_persistent{order}{tag}"), s));
    }
    Ok(out)
}
