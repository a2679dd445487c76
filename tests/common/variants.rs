//! The conformance cases with their inputs and f64 references, grouped by the lowering
//! they exercise, and every lowering variant that applies to each group: stream counts
//! 1-4, stream buffers and compute-first streams on and off, both transports, both P2P
//! schedules, the direct and ring reduce-scatter pipelines and their row ranges, and the
//! tensor-parallel layer blocks (with stream buffers and compute-first streams only:
//! their pipeline requires both).

use fusion::compiler::hir::Transport;
use fusion::compiler::ir::{Fusion, UnaryOp};
use fusion::compiler::lower::{LowerOptions, P2pSchedule, ReduceScatterPipeline};
use fusion::{ExecOptions, Tensor};

use super::cases;
use super::{test_dtype, Give, RefArray, Take};

/// Which lowering a case goes through (and so which options matter to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Stream loops on one device's data (no communication).
    Local,
    /// Collective-based pipelines (a collective per loop iteration).
    Collective,
    /// The P2P allgather pipeline (a DIDx axis becomes the Stream axis).
    P2pAllgather,
    /// The P2P reduce-scatter pipelines (direct and ring).
    P2pReduceScatter,
    /// Reshardings without streams.
    Reshard,
    /// Tensor-parallel layer blocks: both pipelines (gathered rows in, reduce-scattered
    /// results out) in one loop, GEMM epilogues, stream buffers between the GEMMs.
    Layers,
}

/// One case: a fusion, its inputs on `d` devices, how to assemble its output, and the
/// f64 reference computed from the full inputs.
pub struct Case {
    pub name: &'static str,
    pub family: Family,
    pub fusion: fn() -> Fusion,
    pub inputs: fn(usize, u64) -> Vec<(Tensor, Give)>,
    pub take: fn(usize) -> Take,
    pub reference: fn(&[Tensor]) -> RefArray,
    /// The smallest world the case runs on.
    pub min_devices: usize,
}

fn r(t: &Tensor) -> RefArray {
    RefArray::from_tensor(t)
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, test_dtype(), seed)
}

/// Every case of the conformance suite that lowers to stream loops or communications.
pub fn catalog() -> Vec<Case> {
    use Family::*;
    vec![
        Case {
            name: "SingleSetOp",
            family: Local,
            fusion: cases::single_set_op,
            inputs: |_, s| vec![(randn(&[5, 3], s), Give::Whole)],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]),
            min_devices: 1,
        },
        Case {
            name: "TwoSetOps",
            family: Local,
            fusion: cases::two_set_ops,
            inputs: |_, s| vec![(randn(&[4, 6], s), Give::Whole)],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]),
            min_devices: 1,
        },
        Case {
            name: "ThreeSetOps",
            family: Local,
            fusion: cases::three_set_ops_with_disjoint_for_loops,
            inputs: |_, s| vec![(randn(&[3, 7], s), Give::Whole)],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]),
            min_devices: 1,
        },
        Case {
            name: "SingleBinaryOp",
            family: Local,
            fusion: cases::single_binary_op,
            inputs: |_, s| {
                vec![
                    (randn(&[4, 5], s), Give::Whole),
                    (randn(&[4, 5], s + 1), Give::Whole),
                ]
            },
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]).zip(&r(&x[1]), |a, b| a + b),
            min_devices: 1,
        },
        Case {
            name: "Reduction",
            family: Local,
            fusion: cases::reduction,
            inputs: |_, s| vec![(randn(&[6, 9], s), Give::Whole)],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]).sum(1),
            min_devices: 1,
        },
        Case {
            name: "Matmul_M",
            family: Local,
            fusion: cases::matmul_m,
            inputs: |_, s| {
                vec![
                    (randn(&[5, 4], s), Give::Whole),
                    (randn(&[4, 3], s + 1), Give::Whole),
                ]
            },
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]).matmul(&r(&x[1])),
            min_devices: 1,
        },
        Case {
            name: "Allgather",
            family: Collective,
            fusion: cases::stream_parallel_allgather,
            inputs: |d, s| vec![(randn(&[3, d, 4], s), Give::Shard(1))],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]),
            min_devices: 1,
        },
        Case {
            name: "Allreduce",
            family: Collective,
            fusion: cases::stream_parallel_allreduce,
            inputs: |d, s| vec![(randn(&[3, d, 5], s), Give::Shard(1))],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]).sum(1),
            min_devices: 1,
        },
        Case {
            name: "ReduceScatter",
            family: Collective,
            fusion: cases::stream_parallel_reduce_scatter,
            inputs: |d, s| vec![(randn(&[2, d, d, 3], s), Give::Shard(1))],
            take: |_| Take::Sharded(1),
            reference: |x| r(&x[0]).sum(1),
            min_devices: 1,
        },
        Case {
            name: "AG_matmul",
            family: Collective,
            fusion: cases::ag_matmul,
            inputs: |d, s| {
                vec![
                    (randn(&[5, d, 3, 8], s), Give::Shard(1)),
                    (randn(&[8, 5], s + 1), Give::Whole),
                ]
            },
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]).matmul(&r(&x[1])),
            min_devices: 1,
        },
        Case {
            name: "matmul_AR",
            family: Collective,
            fusion: cases::matmul_ar,
            inputs: |d, s| {
                vec![
                    (randn(&[5, d, 2, 4], s), Give::Shard(1)),
                    (randn(&[d, 4, 5], s + 1), Give::Shard(0)),
                ]
            },
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]).matmul(&r(&x[1])).sum(1),
            min_devices: 1,
        },
        Case {
            name: "matmul_RS_through_bcast",
            family: Collective,
            fusion: cases::matmul_rs_through_broadcast,
            inputs: |d, s| {
                vec![
                    (randn(&[d, 3, d, 3, 4], s), Give::Shard(0)),
                    (randn(&[d, 4, 5], s + 1), Give::Shard(0)),
                ]
            },
            take: |_| Take::Sharded(1),
            reference: |x| r(&x[0]).matmul(&r(&x[1]).unsqueeze(1).unsqueeze(1)).sum(0),
            min_devices: 1,
        },
        Case {
            name: "AG_linear",
            family: Collective,
            fusion: cases::ag_linear_with_bias,
            inputs: |d, s| {
                vec![
                    (randn(&[2, d, 3, 6], s), Give::Shard(1)),
                    (randn(&[4, 6], s + 1), Give::Whole),
                    (randn(&[4], s + 2), Give::Whole),
                ]
            },
            take: |_| Take::Replicated,
            reference: |x| {
                r(&x[0])
                    .matmul(&r(&x[1]).transpose_last())
                    .zip(&r(&x[2]), |a, b| a + b)
            },
            min_devices: 1,
        },
        Case {
            name: "AllgatherP2p",
            family: P2pAllgather,
            fusion: cases::allgather_p2p,
            inputs: |d, s| vec![(randn(&[d, 6], s), Give::Shard(0))],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]),
            min_devices: 1,
        },
        Case {
            name: "AG_matmul_P2p",
            family: P2pAllgather,
            fusion: || cases::ag_matmul_p2p(test_dtype()),
            inputs: |d, s| {
                vec![
                    (randn(&[d, 4, 8], s), Give::Shard(0)),
                    (randn(&[8, 3], s + 1), Give::Whole),
                ]
            },
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]).matmul(&r(&x[1])),
            min_devices: 1,
        },
        Case {
            name: "matmul_RS_P2p",
            family: P2pReduceScatter,
            fusion: cases::matmul_rs_p2p,
            inputs: |d, s| {
                vec![
                    (randn(&[d, d, 5, 4], s), Give::Shard(0)),
                    (randn(&[d, 4, 3], s + 1), Give::Shard(0)),
                ]
            },
            take: |_| Take::Sharded(0),
            reference: |x| r(&x[0]).matmul(&r(&x[1]).unsqueeze(1)).sum(0),
            min_devices: 1,
        },
        Case {
            name: "TP MLP",
            family: Layers,
            fusion: || cases::tp_mlp(test_dtype(), UnaryOp::Relu),
            inputs: |d, s| {
                vec![
                    (randn(&[d, 4, 6], s), Give::Shard(0)),
                    (randn(&[d, 6, 5], s + 1), Give::Shard(0)),
                    (randn(&[d, 5, 6], s + 2), Give::Shard(0)),
                ]
            },
            take: |_| Take::Sharded(0),
            reference: |x| {
                let h = r(&x[0]).unsqueeze(1).matmul(&r(&x[1]));
                h.map(|v| v.max(0.0)).matmul(&r(&x[2])).sum(1)
            },
            min_devices: 1,
        },
        Case {
            name: "TP gated MLP",
            family: Layers,
            fusion: || cases::tp_gated_mlp(test_dtype()),
            inputs: |d, s| {
                vec![
                    (randn(&[d, 4, 6], s), Give::Shard(0)),
                    (randn(&[d, 6, 5], s + 1), Give::Shard(0)),
                    (randn(&[d, 6, 5], s + 2), Give::Shard(0)),
                    (randn(&[d, 5, 6], s + 3), Give::Shard(0)),
                ]
            },
            take: |_| Take::Sharded(0),
            reference: |x| {
                let rows = r(&x[0]).unsqueeze(1);
                let gate = rows.matmul(&r(&x[1])).map(|v| v / (1.0 + (-v).exp()));
                let up = rows.matmul(&r(&x[2]));
                gate.zip(&up, |a, b| a * b).matmul(&r(&x[3])).sum(1)
            },
            min_devices: 1,
        },
        Case {
            name: "TP QKV",
            family: Layers,
            fusion: || cases::tp_qkv(test_dtype()),
            inputs: |d, s| {
                vec![
                    (randn(&[d, 4, 6], s), Give::Shard(0)),
                    (randn(&[d, 6, 5], s + 1), Give::Shard(0)),
                ]
            },
            take: |_| Take::Sharded(1),
            reference: |x| r(&x[0]).unsqueeze(1).matmul(&r(&x[1])),
            min_devices: 1,
        },
        Case {
            name: "TP output projection",
            family: Layers,
            fusion: || cases::tp_out_proj(test_dtype()),
            inputs: |d, s| {
                vec![
                    (randn(&[d, d, 4, 5], s), Give::Shard(1)),
                    (randn(&[d, 5, 6], s + 1), Give::Shard(0)),
                ]
            },
            take: |_| Take::Sharded(0),
            reference: |x| r(&x[0]).matmul(&r(&x[1])).sum(1),
            min_devices: 1,
        },
        Case {
            name: "Allgather (no streams)",
            family: Reshard,
            fusion: cases::reshard_allgather,
            inputs: |d, s| vec![(randn(&[d, 5], s), Give::Shard(0))],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]),
            min_devices: 2,
        },
        Case {
            name: "Allreduce (no streams)",
            family: Reshard,
            fusion: cases::reshard_allreduce,
            inputs: |d, s| vec![(randn(&[d, 5], s), Give::Shard(0))],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]).sum(0),
            min_devices: 2,
        },
        Case {
            name: "ReduceScatter (no streams)",
            family: Reshard,
            fusion: cases::reshard_reduce_scatter,
            inputs: |d, s| vec![(randn(&[d, d, 3], s), Give::Shard(0))],
            take: |_| Take::Sharded(0),
            reference: |x| r(&x[0]).sum(0),
            min_devices: 2,
        },
        Case {
            name: "Scatter",
            family: Reshard,
            fusion: cases::reshard_scatter,
            inputs: |d, s| vec![(randn(&[d, 4], s), Give::Whole)],
            take: |_| Take::Sharded(0),
            reference: |x| r(&x[0]),
            min_devices: 2,
        },
        Case {
            name: "Gather",
            family: Reshard,
            fusion: cases::reshard_gather,
            inputs: |d, s| vec![(randn(&[d, 5], s), Give::Shard(0))],
            take: |_| Take::On(vec![0]),
            reference: |x| r(&x[0]),
            min_devices: 2,
        },
        Case {
            name: "Broadcast",
            family: Reshard,
            fusion: || cases::reshard_broadcast(1),
            inputs: |_, s| vec![(randn(&[3, 4], s), Give::OnlyOn(vec![1]))],
            take: |_| Take::Replicated,
            reference: |x| r(&x[0]),
            min_devices: 2,
        },
        Case {
            name: "Reduce",
            family: Reshard,
            fusion: cases::reshard_reduce,
            inputs: |d, s| vec![(randn(&[d, 6], s), Give::Shard(0))],
            take: |_| Take::On(vec![0]),
            reference: |x| r(&x[0]).sum(0),
            min_devices: 2,
        },
        Case {
            name: "SendRecv",
            family: Reshard,
            fusion: || cases::reshard_send_recv(&[0], &[1]),
            inputs: |_, s| vec![(randn(&[1, 5], s), Give::ShardOn(vec![0], 0))],
            take: |_| Take::ShardedOn(vec![1], 0),
            reference: |x| r(&x[0]),
            min_devices: 2,
        },
    ]
}

/// The lowering variants that apply to `family`, each with a short label.
pub fn variants(family: Family) -> Vec<(String, ExecOptions)> {
    let mut out = Vec::new();
    if family == Family::Reshard {
        out.push(("default".to_string(), ExecOptions::default()));
        return out;
    }
    for streams in 1..=4 {
        // The layer blocks' gather-scatter loop needs stream buffers and compute-first
        // streams (without them lowering says so).
        let both: &[bool] = if family == Family::Layers {
            &[true]
        } else {
            &[true, false]
        };
        for &stream_buffers in both {
            for &compute_first in both {
                let base = LowerOptions {
                    streams: fusion::StreamOptions {
                        buffers: stream_buffers,
                        compute_first,
                        ..Default::default()
                    },
                    ..LowerOptions::default()
                };
                let label = format!(
                    "{streams} streams, buffers {}, compute-first {}",
                    on(stream_buffers),
                    on(compute_first)
                );
                for (more, lower) in family_options(family, base) {
                    out.push((
                        format!("{label}{more}"),
                        ExecOptions {
                            number_of_streams: streams,
                            lower,
                            ..ExecOptions::default()
                        },
                    ));
                }
            }
        }
    }
    out
}

fn on(b: bool) -> &'static str {
    if b {
        "on"
    } else {
        "off"
    }
}

/// The options of `family`'s own lowering on top of `base`.
fn family_options(family: Family, base: LowerOptions) -> Vec<(String, LowerOptions)> {
    let transports = [Transport::Nccl, Transport::CopyEngine];
    match family {
        Family::Local | Family::Reshard => vec![(String::new(), base)],
        Family::Collective => transports
            .iter()
            .map(|&b| {
                (
                    format!(", collectives over {}", b.name()),
                    LowerOptions {
                        transports: fusion::TransportOptions {
                            collectives: b,
                            ..base.clone().transports
                        },
                        ..base.clone()
                    },
                )
            })
            .collect(),
        Family::P2pAllgather => {
            let mut v = Vec::new();
            for b in transports {
                for schedule in [P2pSchedule::Ring, P2pSchedule::MeshOrder] {
                    v.push((
                        format!(", P2P over {}, {schedule:?} schedule", b.name()),
                        LowerOptions {
                            transports: fusion::TransportOptions {
                                p2p: b,
                                ..base.clone().transports
                            },
                            pipelines: fusion::PipelineOptions {
                                p2p_schedule: schedule,
                                ..base.clone().pipelines
                            },
                            ..base.clone()
                        },
                    ));
                }
            }
            v
        }
        Family::P2pReduceScatter | Family::Layers => {
            let chunks = if family == Family::Layers { 2 } else { 3 };
            let mut v = Vec::new();
            for b in transports {
                for pipeline in [ReduceScatterPipeline::Direct, ReduceScatterPipeline::Ring] {
                    for c in 1..=chunks {
                        v.push((
                            format!(", P2P over {}, {pipeline:?} in {c} row ranges", b.name()),
                            LowerOptions {
                                transports: fusion::TransportOptions {
                                    p2p: b,
                                    ..base.clone().transports
                                },
                                pipelines: fusion::PipelineOptions {
                                    reduce_scatter: pipeline,
                                    reduce_scatter_subchunks: Some(c),
                                    ..base.clone().pipelines
                                },
                                ..base.clone()
                            },
                        ));
                    }
                }
                v.push((
                    format!(
                        ", P2P over {}, Ring in 2 row ranges on two compute streams",
                        b.name()
                    ),
                    LowerOptions {
                        transports: fusion::TransportOptions {
                            p2p: b,
                            ..base.clone().transports
                        },
                        streams: fusion::StreamOptions {
                            ring_compute_streams: 2,
                            ..base.clone().streams
                        },
                        pipelines: fusion::PipelineOptions {
                            reduce_scatter: ReduceScatterPipeline::Ring,
                            reduce_scatter_subchunks: Some(2),
                            ..base.clone().pipelines
                        },
                        ..base.clone()
                    },
                ));
            }
            v
        }
    }
}
