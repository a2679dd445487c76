//! The plan space: every way the lowering can be told to run one fusion call, as named
//! candidates ([`Plan`]), and a cost model that estimates each lowered candidate
//! ([`cost`]).
//!
//! A plan is a [`LowerOptions`] plus the size of the worker stream pool. The candidates
//! are the choices that won somewhere in the measurements of `docs/DECISIONS.md`:
//! pipelined or whole collectives, the P2P transport, the reduce-scatter pipeline and its
//! row ranges, compute-first streams, the ring's compute streams, the pool size, which
//! collectives run over peer memory, one copy stream or one per peer for copy-engine
//! transfers, whether pointwise ops fold into GEMM epilogues, and whether a decode GEMM's
//! Allreduce runs in its epilogue, whether a backward's weight gradients all stay in its
//! gather-scatter loop (`gradients_in_loop`) or all run after it (`gradients_after_loop`);
//! and, not measured yet,
//! the AllGather + GEMM pipeline in row ranges and as one persistent GEMM fed by the
//! loop's copies (`gathered_gemm`), and the GEMM + ReduceScatter as one persistent GEMM
//! that adds each tile into its owner's output (`scattered_gemm`), both at once
//! (`gathered_scattered_gemm`); the
//! runtime lowers these only where the device runs such a GEMM. Most candidates change
//! nothing for a given fusion (a fusion without a reduce-scatter has no reduce-scatter
//! pipeline); the runtime lowers them all and keeps one candidate per distinct program.
//! Which one a call runs is decided per shape by the runtime, from the cost model or by
//! timing them.

pub mod cost;

use crate::hir::Transport;
use crate::options::{
    CopyStreams, LowerOptions, PeerMemoryCollectives, Pipelining, ReduceScatterPipeline,
    WeightGradients,
};

/// The worker stream pool a call gets by default (`ExecOptions::number_of_streams`): one
/// stream per device of a P2P pipeline up to 4 devices.
pub const DEFAULT_STREAMS: usize = 4;

/// Bumped whenever the candidates or their meaning change, so that plans tuned by an
/// older build are not trusted (19: `gradients_after_loop` also runs an AllGather loop's
/// weight gradients that read only its gathered rows and inputs once after it; 18: `gradients_after_loop`; 17: a gather-scatter loop's weight gradients that read no
/// result of the loop run once after it, summed over every gathered block; 16: a gather-scatter loop runs what its last GEMM does not
/// read after the ring send; 15: an unpipelined weight gradient summed over gathered
/// blocks is one GEMM; 14: the gathered GEMM also takes a saved pre-activation,
/// so the gathered candidates of a training step's forward changed; 13: a GEMM batched
/// over a shared weight runs as one GEMM,
/// so the unpipelined candidates' times changed; 12: the gathered GEMM also takes weights
/// broadcast against the Stream axis; 11: `CopyStreams::OneInSendOrder`).
pub const PLAN_SPACE_REVISION: u32 = 19;

/// One candidate: a name (stable across builds of the same revision, used in caches and
/// dumps), the lowering options and the stream pool size.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// `default`, `unpipelined`, `rs_ring4`, ...: what differs from the default.
    pub name: String,
    /// How the fusion is lowered.
    pub lower: LowerOptions,
    /// Size of the worker stream pool.
    pub number_of_streams: usize,
}

impl Plan {
    fn new(name: impl Into<String>, lower: LowerOptions, number_of_streams: usize) -> Self {
        Plan {
            name: name.into(),
            lower,
            number_of_streams,
        }
    }
}

/// The candidates for a call on `world_size` devices, the default first (a tie keeps it).
/// Every candidate computes the same result; they differ in how the program overlaps
/// communication with compute.
pub fn candidates(world_size: usize) -> Vec<Plan> {
    let d = world_size;
    let base = LowerOptions::default();
    let mut out = vec![Plan::new("default", base.clone(), DEFAULT_STREAMS)];
    if d < 2 {
        return out;
    }
    let with = |f: &dyn Fn(&mut LowerOptions)| {
        let mut o = base.clone();
        f(&mut o);
        o
    };
    out.push(Plan::new(
        "unpipelined",
        base.clone().with_pipelining(Pipelining::Never),
        DEFAULT_STREAMS,
    ));
    out.push(Plan::new(
        "pipelined",
        base.clone().with_pipelining(Pipelining::Always),
        DEFAULT_STREAMS,
    ));
    out.push(Plan::new(
        "p2p_nccl",
        with(&|o| o.transports.p2p = Transport::Nccl),
        DEFAULT_STREAMS,
    ));
    out.push(Plan::new(
        "collectives_ce",
        with(&|o| o.transports.collectives = Transport::CopyEngine),
        DEFAULT_STREAMS,
    ));
    // Every copy-engine transfer of a rank on one copy stream (fusions without copy-engine
    // transfers lower it to the default program).
    out.push(Plan::new(
        "ce_one_copy_stream",
        with(&|o| o.transports.copy_streams = CopyStreams::One),
        DEFAULT_STREAMS,
    ));
    out.push(Plan::new(
        "peer_memory_never",
        with(&|o| o.transports.peer_memory = PeerMemoryCollectives::Never),
        DEFAULT_STREAMS,
    ));
    out.push(Plan::new(
        "peer_memory_all",
        with(&|o| o.transports.peer_memory = PeerMemoryCollectives::UpTo(usize::MAX)),
        DEFAULT_STREAMS,
    ));
    // A decode GEMM and its Allreduce kept apart (the default runs them as one kernel where
    // the device has it: `lower::gemm_allreduce`).
    out.push(Plan::new(
        "gemm_allreduce_apart",
        with(&|o| o.transports.gemm_allreduce = false),
        DEFAULT_STREAMS,
    ));
    for streams in [2, d, 2 * d] {
        if streams != DEFAULT_STREAMS && streams <= 16 && !out_has_streams(&out, streams) {
            out.push(Plan::new(
                format!("streams{streams}"),
                base.clone(),
                streams,
            ));
        }
    }
    // Reduce-scatter pipelines (a fusion without one lowers them all to the default).
    for (pipeline, tag) in [
        (ReduceScatterPipeline::Direct, "direct"),
        (ReduceScatterPipeline::Ring, "ring"),
    ] {
        for rows in [1, 2, 4] {
            let lower = with(&|o| {
                o.pipelines.reduce_scatter = pipeline;
                o.pipelines.reduce_scatter_subchunks = Some(rows);
            });
            // A ring with more row ranges than devices also gets a pool stream per range.
            let streams = if pipeline == ReduceScatterPipeline::Ring && rows > d {
                DEFAULT_STREAMS.max(rows)
            } else {
                DEFAULT_STREAMS
            };
            out.push(Plan::new(format!("rs_{tag}{rows}"), lower.clone(), streams));
            if pipeline == ReduceScatterPipeline::Ring {
                let mut two = lower;
                two.streams.ring_compute_streams = 2;
                out.push(Plan::new(format!("rs_{tag}{rows}_c2"), two, streams));
            }
        }
    }
    // A backward's weight gradients all block by block in its gather-scatter loop, or all
    // once after it.
    for (name, placement) in [
        ("gradients_in_loop", WeightGradients::InLoop),
        ("gradients_after_loop", WeightGradients::AfterLoop),
    ] {
        out.push(Plan::new(
            name,
            with(&|o| o.pipelines.weight_gradients = placement),
            DEFAULT_STREAMS,
        ));
    }
    out.push(Plan::new(
        "one_stream",
        with(&|o| o.streams.compute_first = false),
        DEFAULT_STREAMS,
    ));
    // Pointwise consumers as separate kernels instead of in the GEMM's epilogue.
    out.push(Plan::new(
        "no_epilogue_fusion",
        base.clone().without_pass("FuseEpilogue"),
        DEFAULT_STREAMS,
    ));
    // AllGather + GEMM in row ranges per gathered chunk (a fusion without such a loop
    // lowers them to the default).
    for rows in [2, 4] {
        out.push(Plan::new(
            format!("ag_rows{rows}"),
            with(&|o| o.pipelines.allgather_subchunks = Some(rows)),
            DEFAULT_STREAMS,
        ));
    }
    out.extend(persistent_gemm_candidates(&base));
    out
}

/// The candidates that run a collective inside the persistent GEMM, `base` plus each option.
fn persistent_gemm_candidates(base: &LowerOptions) -> Vec<Plan> {
    let with = |set: &dyn Fn(&mut LowerOptions)| {
        let mut o = base.clone();
        set(&mut o);
        o
    };
    let mut out = Vec::new();
    // AllGather + GEMM as one persistent GEMM beside the loop's copies. The runtime lowers
    // it only where the device runs such a GEMM (elsewhere, and for a fusion without such
    // a loop, it lowers to the default program).
    out.push(Plan::new(
        "gathered_gemm",
        with(&|o| o.pipelines.gathered_gemm = true),
        DEFAULT_STREAMS,
    ));
    // The same GEMM told of each block's rows in two ranges, so that it starts on a block
    // before all of it landed (four ranges lost everywhere they were measured: DECISIONS).
    out.push(Plan::new(
        "gathered_gemm_rows2",
        with(&|o| {
            o.pipelines.gathered_gemm = true;
            o.pipelines.allgather_subchunks = Some(2);
        }),
        DEFAULT_STREAMS,
    ));
    // The blocks in four row ranges each, landing in the senders' order one after another
    // with no hand-off round trip between them (`CopyStreams::OneInSendOrder`), so the GEMM
    // follows the copies range by range (fastest at 16384,8192,8192 on 2 and 4 H100s; whole
    // blocks and two ranges so ordered won nowhere: DECISIONS, "Row ranges in the senders'
    // order").
    out.push(Plan::new(
        "gathered_gemm_send_order_rows4",
        with(&|o| {
            o.pipelines.gathered_gemm = true;
            o.pipelines.allgather_subchunks = Some(4);
            o.transports.copy_streams = CopyStreams::OneInSendOrder;
        }),
        DEFAULT_STREAMS,
    ));
    // GEMM + ReduceScatter as one persistent GEMM whose epilogue adds each tile into its
    // owner's output: its product is kept whole (not streamed), so the pair stays at the
    // top level where `lower::gemm_reduce_scatter` applies, while the loops feeding the GEMM
    // (an AllGather + GEMM) keep their pipelines. The runtime lowers it only where the
    // device runs such a GEMM (elsewhere it is the default program).
    let mut scattered = base.clone();
    scattered.pipelines.scattered_gemm = true;
    out.push(Plan::new(
        "scattered_gemm",
        scattered.clone(),
        DEFAULT_STREAMS,
    ));
    // Both: a block that gathers into one GEMM and scatters from another (the MLP block)
    // runs as two persistent GEMMs, the first's bias and activation in its epilogue.
    let mut both = scattered;
    both.pipelines.gathered_gemm = true;
    out.push(Plan::new("gathered_scattered_gemm", both, DEFAULT_STREAMS));
    out
}

fn out_has_streams(plans: &[Plan], streams: usize) -> bool {
    plans
        .iter()
        .any(|p| p.lower == LowerOptions::default() && p.number_of_streams == streams)
}

/// The candidate named `name` on `world_size` devices.
pub fn find(world_size: usize, name: &str) -> Option<Plan> {
    candidates(world_size).into_iter().find(|p| p.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::{Axis, FusionBuilder};
    use crate::hir::{HostProgram, Node};
    use crate::ir::Fusion;
    use crate::lower::lower;
    use crate::DType;

    /// `[d @ Stream, m, n] = matmul(a [d @ DIDx, m, k], b [k, n])`: AllGather + GEMM.
    fn ag_gemm() -> Fusion {
        let mut b = FusionBuilder::new();
        let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
        let a = b
            .input(
                "a",
                DType::F32,
                &[Axis::didx(d), Axis::serial(m), Axis::serial(k)],
            )
            .unwrap();
        let w = b
            .input("b", DType::F32, &[Axis::serial(k), Axis::serial(n)])
            .unwrap();
        let c = b.matmul(a, w).unwrap();
        let out = [Axis::stream(d), Axis::serial(m), Axis::serial(n)];
        let c = b.declare(c, DType::F32, &out).unwrap();
        b.output(c).unwrap();
        b.build().unwrap()
    }

    /// The AllGather + GEMM program of candidate `name` on `world` devices, pipelined.
    fn ag_program(world: usize, name: &str, buffers: bool) -> HostProgram {
        let mut o = find(world, name).unwrap().lower;
        o.pipelines.pipelining = Pipelining::Always;
        o.streams.buffers = buffers;
        lower(&ag_gemm(), world, &o).unwrap().program
    }

    /// The main stream loop's iteration count (printed) and body (printed).
    fn main_loop(p: &HostProgram) -> (String, String) {
        let l = p
            .body
            .iter()
            .filter_map(|n| match n {
                Node::ForLoop(l) => Some(l),
                _ => None,
            })
            .max_by_key(|l| l.body.len())
            .expect("a stream loop");
        let mut body = p.clone();
        body.body = l.body.clone();
        (p.ir.display_scalar(l.stop).to_string(), body.to_string())
    }

    #[test]
    fn ag_rows_split_each_gathered_chunk_into_row_ranges() {
        for (name, c) in [("ag_rows2", 2), ("ag_rows4", 4)] {
            for buffers in [true, false] {
                let p = ag_program(4, name, buffers);
                let (stop, body) = main_loop(&p);
                assert_eq!(stop, format!("( d * {c} )"), "D * c iterations");
                // Step-major: ring step `i / c`, row range `i % c`.
                assert!(body.contains(&format!("( StreamIdx / {c} )")), "{body}");
                assert!(body.contains(&format!("( StreamIdx % {c} )")), "{body}");
                // The chunk's rows, the local shard's rows (sent) and the output's rows
                // are row-range slices: three in the receiving branch and the GEMM.
                assert!(body.matches(" = slice(").count() >= 3, "{body}");
                assert_eq!(body.matches("type=recv").count(), 1, "{body}");
                assert!(p.notes.iter().any(|n| n.contains("row ranges")));
                if buffers {
                    // Slots of one row range each: ceil(m / c) rows.
                    let text = p.to_string();
                    assert!(text.contains(&format!("( m + {} ) / {c}", c - 1)), "{text}");
                }
            }
        }
    }

    #[test]
    fn ag_rows_leave_the_default_program_alone_when_unsplit() {
        let p = ag_program(4, "default", true);
        let (stop, body) = main_loop(&p);
        assert_eq!(stop, "d");
        assert!(!body.contains(" = slice("), "{body}");
        assert!(!p.notes.iter().any(|n| n.contains("row ranges")));
        let mut one = LowerOptions::default();
        one.pipelines.allgather_subchunks = Some(1);
        one.pipelines.pipelining = Pipelining::Always;
        let unsplit = lower(&ag_gemm(), 4, &one).unwrap().program;
        assert_eq!(unsplit.to_string(), p.to_string());
    }

    #[test]
    fn one_device_has_no_gather_to_split() {
        let mut o = LowerOptions::default().with_pipelining(Pipelining::Always);
        o.pipelines.allgather_subchunks = Some(2);
        let p = lower(&ag_gemm(), 1, &o).unwrap().program;
        assert_eq!(main_loop(&p).0, "d");
        assert!(p.notes.is_empty(), "{:?}", p.notes);
    }

    #[test]
    fn one_device_has_only_the_default() {
        let c = candidates(1);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].name, "default");
    }

    #[test]
    fn ag_rows_are_candidates() {
        for d in [2, 4, 8] {
            for c in [2, 4] {
                let p = find(d, &format!("ag_rows{c}")).unwrap();
                let mut back = p.lower.clone();
                assert_eq!(back.pipelines.allgather_subchunks, Some(c));
                back.pipelines.allgather_subchunks = None;
                assert_eq!(back, LowerOptions::default());
            }
        }
    }

    #[test]
    fn names_are_unique_and_the_default_comes_first() {
        for d in [2, 3, 4, 8] {
            let c = candidates(d);
            assert_eq!(c[0].lower, LowerOptions::default());
            assert_eq!(c[0].number_of_streams, DEFAULT_STREAMS);
            let mut names: Vec<_> = c.iter().map(|p| p.name.clone()).collect();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), c.len(), "{names:?}");
            assert!(find(d, "rs_ring4").is_some());
            assert!(find(d, "nonsense").is_none());
        }
    }

    #[test]
    fn one_copy_stream_is_a_candidate() {
        for d in [2, 4] {
            let p = find(d, "ce_one_copy_stream").unwrap();
            assert_eq!(p.lower.transports.copy_streams, CopyStreams::One);
            let mut back = p.lower.clone();
            back.transports.copy_streams = CopyStreams::PerPeer;
            assert_eq!(back, LowerOptions::default());
            assert_eq!(p.number_of_streams, DEFAULT_STREAMS);
        }
        assert!(find(1, "ce_one_copy_stream").is_none());
    }

    #[test]
    fn pool_sizes_follow_the_device_count() {
        assert!(find(2, "streams2").is_some());
        assert!(find(4, "streams4").is_none(), "4 streams is the default");
        assert!(find(4, "streams8").is_some());
        assert!(find(8, "streams8").is_some());
        assert!(find(8, "streams16").is_some());
        assert_eq!(find(2, "rs_ring4").unwrap().number_of_streams, 4);
        assert_eq!(find(8, "rs_ring4").unwrap().number_of_streams, 4);
    }
}
