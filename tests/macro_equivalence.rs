//! Every case of `tests/common/cases.rs` (the fusions of `tests/conformance.rs`) written
//! with `fusion!`: the macro's fusion lowers to the same printed host program as the
//! builder's on every world size where the case applies, and running it through the typed
//! entry point gives the same numbers, bit for bit. Preallocated outputs are checked through
//! the generated `run_with` too: the buffer passed in is the one written, with the builder's
//! numbers.
//!
//! Not covered here: output aliasing (`alias_output_to_input`, in
//! `outputs_alias_inputs_without_copies` of the conformance suite) has no `fusion!` syntax
//! and stays builder-only; the conformance tests that only vary options, schedules or
//! transports of these fusions are not repeated; and the fusions are f32 (plus bf16 for
//! AG_matmul_P2p) whatever `FUSION_TEST_DTYPE` says.

mod common;

use common::{assemble, cases, distribute, run, Give, Take, DEVICE_COUNTS};
use fusion::core::ir::Fusion;
use fusion::core::lower::{lower, LowerOptions};
use fusion::prelude::*;
use fusion::RunReport;

fusion! {
    fn single_set_op<m, n>(t0: Tensor<f32, [m, n]>) -> Tensor<f32, [m @ Stream, n]> {
        set(t0)
    }

    fn two_set_ops<m, n>(t0: Tensor<f32, [m, n]>) -> Tensor<f32, [m @ Stream, n]> {
        let t1: Tensor<f32, [m @ Stream, n]> = set(t0);
        set(t1)
    }

    fn three_set_ops<m, n>(t0: Tensor<f32, [m, n]>) -> Tensor<f32, [m @ Stream, n]> {
        let t1: Tensor<f32, [m @ Stream, n]> = set(t0);
        let t2 = set(t1);
        set(t2)
    }

    fn single_binary_op<m, n>(
        t0: Tensor<f32, [m, n]>,
        t1: Tensor<f32, [m, n]>,
    ) -> Tensor<f32, [m @ Stream, n]> {
        t0 + t1
    }

    fn reduction<m, n>(t0: Tensor<f32, [m, n]>) -> Tensor<f32, [m @ Stream]> {
        sum(t0, 1)
    }

    fn matmul_m<m, k, n>(a: Tensor<f32, [m, k]>, b: Tensor<f32, [k, n]>) -> Tensor<f32, [m @ Stream, n]> {
        matmul(a, b)
    }

    fn stream_parallel_allgather<s, d, m>(
        t0: Tensor<f32, [s, d @ DIDx, m]>,
    ) -> Tensor<f32, [s @ Stream, d, m]> {
        set(t0)
    }

    fn stream_parallel_allreduce<s, d, m>(
        t0: Tensor<f32, [s, d @ DIDx, m]>,
    ) -> Tensor<f32, [s @ Stream, m]> {
        sum(t0, 1)
    }

    fn stream_parallel_reduce_scatter<s, d, m>(
        t0: Tensor<f32, [s, d @ DIDx, d, m]>,
    ) -> Tensor<f32, [s @ Stream, d @ DIDx, m]> {
        sum(t0, 1)
    }

    fn ag_matmul<s, d, m, k, n>(
        a: Tensor<f32, [s, d @ DIDx, m, k]>,
        b: Tensor<f32, [k, n]>,
    ) -> Tensor<f32, [s @ Stream, d, m, n]> {
        matmul(a, b)
    }

    fn matmul_ar<s, d, m, k, n>(
        a: Tensor<f32, [s, d @ DIDx, m, k]>,
        b: Tensor<f32, [d @ DIDx, k, n]>,
    ) -> Tensor<f32, [s @ Stream, m, n]> {
        let partial: Tensor<f32, [s @ Stream, d @ DIDx, m, n]> = matmul(a, b);
        sum(partial, 1)
    }

    fn matmul_rs_through_broadcast<d, s, m, k, n>(
        a: Tensor<f32, [d @ DIDx, s, d, m, k]>,
        b: Tensor<f32, [d @ DIDx, k, n]>,
    ) -> Tensor<f32, [s @ Stream, d @ DIDx, m, n]> {
        let partial: Tensor<f32, [d @ DIDx, s @ Stream, d, m, n]> =
            matmul(a, broadcast(b, [false, true, true, false, false]));
        sum(partial, 0)
    }

    fn ag_linear_with_bias<s, d, m, k, n>(
        x: Tensor<f32, [s, d @ DIDx, m, k]>,
        w: Tensor<f32, [n, k]>,
        bias: Tensor<f32, [n]>,
    ) -> Tensor<f32, [s @ Stream, d, m, n]> {
        linear(x, w, bias)
    }

    fn allgather_p2p<d, m>(t0: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [d @ Stream, m]> {
        set(t0)
    }

    fn ag_matmul_p2p_f32<d, m, k, n>(
        a: Tensor<f32, [d @ DIDx, m, k]>,
        b: Tensor<f32, [k, n]>,
    ) -> Tensor<f32, [d @ Stream, m, n]> {
        matmul(a, b)
    }

    fn ag_matmul_p2p_bf16<d, m, k, n>(
        a: Tensor<bf16, [d @ DIDx, m, k]>,
        b: Tensor<bf16, [k, n]>,
    ) -> Tensor<bf16, [d @ Stream, m, n]> {
        matmul(a, b)
    }

    fn matmul_rs_p2p<d, m, k, n>(
        a: Tensor<f32, [d @ DIDx, d, m, k]>,
        b: Tensor<f32, [d @ DIDx, k, n]>,
    ) -> Tensor<f32, [d @ DIDx, m, n]> {
        let partial: Tensor<f32, [d @ DIDx, d @ Stream, m, n]> =
            matmul(a, broadcast(b, [false, true, false, false]));
        sum(partial, 0)
    }

    /// Returning an input with another layout copies it: here, an Allgather.
    fn tp_mlp<d, m, h, f>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        w1: Tensor<f32, [d @ DIDx, h, f]>,
        w2: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ DIDx, m, h]> {
        let act: Tensor<f32, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(matmul(broadcast(x, [false, true, false, false]), w1));
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
        sum(partial, 1)
    }

    fn tp_gated_mlp<d, m, h, f>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        wg: Tensor<f32, [d @ DIDx, h, f]>,
        wu: Tensor<f32, [d @ DIDx, h, f]>,
        wd: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ DIDx, m, h]> {
        let rows = broadcast(x, [false, true, false, false]);
        let act: Tensor<f32, [d @ Stream, d @ DIDx, m, f]> =
            silu(matmul(rows, wg)) * matmul(rows, wu);
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, h]> = matmul(act, wd);
        sum(partial, 1)
    }

    fn tp_qkv<d, m, h, q>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        w: Tensor<f32, [d @ DIDx, h, q]>,
    ) -> Tensor<f32, [d @ Stream, d @ DIDx, m, q]> {
        matmul(broadcast(x, [false, true, false, false]), w)
    }

    fn tp_out_proj<d, m, f, h>(
        a: Tensor<f32, [d, d @ DIDx, m, f]>,
        w: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ DIDx, m, h]> {
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, h]> = matmul(a, w);
        sum(partial, 1)
    }

    fn reshard_allgather<d, m>(t0: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [d, m]> {
        t0
    }

    fn reshard_allreduce<d, m>(t0: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [m]> {
        sum(t0, 0)
    }

    fn reshard_reduce_scatter<d, m>(t0: Tensor<f32, [d @ DIDx, d, m]>) -> Tensor<f32, [d @ DIDx, m]> {
        sum(t0, 0)
    }

    fn reshard_scatter<d, m>(t0: Tensor<f32, [d, m]>) -> Tensor<f32, [d @ DIDx, m]> {
        set(t0)
    }

    fn reshard_gather<d, m>(t0: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [d, m], mesh = [0]> {
        set(t0)
    }

    fn reshard_broadcast<m, n>(t0: Tensor<f32, [m, n], mesh = [3]>) -> Tensor<f32, [m, n]> {
        set(t0)
    }

    fn reshard_reduce<d, m>(t0: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [m], mesh = [0]> {
        sum(t0, 0)
    }

    fn reshard_send_recv<h, m>(
        t0: Tensor<f32, [h @ DIDx, m], mesh = [0, 1]>,
    ) -> Tensor<f32, [h @ DIDx, m], mesh = [2, 3]> {
        set(t0)
    }
}

const F32: DType = DType::F32;

/// A rank-typed view of a distributed input; ranks outside a sub-mesh get a placeholder.
fn ranked<const R: usize>(t: &Tensor) -> fusion::Result<Ranked<R>> {
    if t.numel() == 0 && t.rank() != R {
        return Ok(Ranked::placeholder(t.dtype()));
    }
    Ranked::new(t.clone())
}

/// Calls a generated entry point with this rank's inputs, typed by the entry's signature.
macro_rules! entry {
    ($f:path; $($i:tt),*) => {
        |rank: &Rank, ins: &[Tensor]| -> fusion::Result<Vec<Tensor>> {
            Ok(vec![$f(rank, $(&ranked(&ins[$i])?),*)?.into_inner()])
        }
    };
}

type Entry<'a> = &'a (dyn Fn(&Rank, &[Tensor]) -> fusion::Result<Vec<Tensor>> + Sync);

struct Case<'a> {
    name: &'a str,
    builder: Fusion,
    from_macro: fusion::core::Result<Fusion>,
    entry: Entry<'a>,
    /// Full inputs and how they are distributed, for `d` devices.
    inputs: &'a dyn Fn(usize) -> Vec<(Tensor, Give)>,
    take: &'a dyn Fn(usize) -> Take,
    devices: &'a [usize],
}

fn check(case: Case) {
    let from_macro = case
        .from_macro
        .unwrap_or_else(|e| panic!("{}: the fusion! version does not build: {e}", case.name));
    let opts = ExecOptions::default();
    for &d in case.devices {
        let expected = lower(&case.builder, d, &LowerOptions::default())
            .unwrap()
            .program
            .to_string();
        let got = lower(&from_macro, d, &LowerOptions::default())
            .unwrap_or_else(|e| panic!("{} on {d} devices: {e}", case.name))
            .program
            .to_string();
        assert_eq!(
            got, expected,
            "{} on {d} devices: the fusion! program differs from the builder's",
            case.name
        );

        let inputs = (case.inputs)(d);
        let take = (case.take)(d);
        let by_builder = run(
            &case.builder,
            d,
            &inputs,
            std::slice::from_ref(&take),
            &opts,
        );
        let world = World::local(d).unwrap();
        let per_rank = world
            .run(|rank| {
                let local = distribute(rank, &inputs)?;
                let outs = (case.entry)(rank, &local)?;
                outs.iter()
                    .map(|t| rank.to_host(t))
                    .collect::<fusion::Result<Vec<Tensor>>>()
            })
            .unwrap_or_else(|e| panic!("{} on {d} devices: {e}", case.name));
        let parts: Vec<Tensor> = per_rank.into_iter().map(|mut o| o.remove(0)).collect();
        let by_macro = assemble(&parts, &take);
        let expected = &by_builder.outputs[0];
        assert_eq!(by_macro.shape(), expected.shape(), "{} on {d}", case.name);
        assert_eq!(
            by_macro.to_f32_vec().unwrap(),
            expected.to_f32_vec().unwrap(),
            "{} on {d} devices: the fusion! entry point computes other numbers",
            case.name
        );
    }
}

fn randn(shape: &[usize], salt: u64) -> Tensor {
    Tensor::randn(shape, F32, salt)
}

const ALL: &[usize] = &DEVICE_COUNTS;
const MULTI: &[usize] = &[2, 3, 4, 8];
const FOUR_UP: &[usize] = &[4, 8];

#[test]
fn single_device_stream_lowering() {
    check(Case {
        name: "SingleSetOp",
        builder: cases::single_set_op(),
        from_macro: single_set_op::build(),
        entry: &entry!(single_set_op; 0),
        inputs: &|d| vec![(randn(&[5, 3], d as u64), Give::Whole)],
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "TwoSetOps",
        builder: cases::two_set_ops(),
        from_macro: two_set_ops::build(),
        entry: &entry!(two_set_ops; 0),
        inputs: &|d| vec![(randn(&[4, 6], d as u64), Give::Whole)],
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "ThreeSetOpsWithDisjointsForLoops",
        builder: cases::three_set_ops_with_disjoint_for_loops(),
        from_macro: three_set_ops::build(),
        entry: &entry!(three_set_ops; 0),
        inputs: &|d| vec![(randn(&[3, 7], d as u64), Give::Whole)],
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "SingleBinaryOp",
        builder: cases::single_binary_op(),
        from_macro: single_binary_op::build(),
        entry: &entry!(single_binary_op; 0, 1),
        inputs: &|d| {
            vec![
                (randn(&[4, 5], d as u64), Give::Whole),
                (randn(&[4, 5], 100 + d as u64), Give::Whole),
            ]
        },
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "Reduction",
        builder: cases::reduction(),
        from_macro: reduction::build(),
        entry: &entry!(reduction; 0),
        inputs: &|d| vec![(randn(&[6, 9], d as u64), Give::Whole)],
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "Matmul_M",
        builder: cases::matmul_m(),
        from_macro: matmul_m::build(),
        entry: &entry!(matmul_m; 0, 1),
        inputs: &|d| {
            vec![
                (randn(&[5, 4], d as u64), Give::Whole),
                (randn(&[4, 3], 100 + d as u64), Give::Whole),
            ]
        },
        take: &|_| Take::Replicated,
        devices: ALL,
    });
}

#[test]
fn collective_pipelines() {
    check(Case {
        name: "Allgather",
        builder: cases::stream_parallel_allgather(),
        from_macro: stream_parallel_allgather::build(),
        entry: &entry!(stream_parallel_allgather; 0),
        inputs: &|d| vec![(randn(&[3, d, 4], d as u64), Give::Shard(1))],
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "Allreduce",
        builder: cases::stream_parallel_allreduce(),
        from_macro: stream_parallel_allreduce::build(),
        entry: &entry!(stream_parallel_allreduce; 0),
        inputs: &|d| vec![(randn(&[3, d, 5], d as u64), Give::Shard(1))],
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "ReduceScatter",
        builder: cases::stream_parallel_reduce_scatter(),
        from_macro: stream_parallel_reduce_scatter::build(),
        entry: &entry!(stream_parallel_reduce_scatter; 0),
        inputs: &|d| vec![(randn(&[2, d, d, 3], d as u64), Give::Shard(1))],
        take: &|_| Take::Sharded(1),
        devices: ALL,
    });
    check(Case {
        name: "AG_matmul",
        builder: cases::ag_matmul(),
        from_macro: ag_matmul::build(),
        entry: &entry!(ag_matmul; 0, 1),
        inputs: &|d| {
            vec![
                (randn(&[2, d, 3, 8], d as u64), Give::Shard(1)),
                (randn(&[8, 5], 100 + d as u64), Give::Whole),
            ]
        },
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "matmul_AR",
        builder: cases::matmul_ar(),
        from_macro: matmul_ar::build(),
        entry: &entry!(matmul_ar; 0, 1),
        inputs: &|d| {
            vec![
                (randn(&[3, d, 2, 4], d as u64), Give::Shard(1)),
                (randn(&[d, 4, 5], 100 + d as u64), Give::Shard(0)),
            ]
        },
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "matmul_RS_through_bcast",
        builder: cases::matmul_rs_through_broadcast(),
        from_macro: matmul_rs_through_broadcast::build(),
        entry: &entry!(matmul_rs_through_broadcast; 0, 1),
        inputs: &|d| {
            vec![
                (randn(&[d, 2, d, 3, 4], d as u64), Give::Shard(0)),
                (randn(&[d, 4, 5], 100 + d as u64), Give::Shard(0)),
            ]
        },
        take: &|_| Take::Sharded(1),
        devices: ALL,
    });
    check(Case {
        name: "AG_linear",
        builder: cases::ag_linear_with_bias(),
        from_macro: ag_linear_with_bias::build(),
        entry: &entry!(ag_linear_with_bias; 0, 1, 2),
        inputs: &|d| {
            vec![
                (randn(&[2, d, 3, 6], d as u64), Give::Shard(1)),
                (randn(&[4, 6], 100 + d as u64), Give::Whole),
                (randn(&[4], 200 + d as u64), Give::Whole),
            ]
        },
        take: &|_| Take::Replicated,
        devices: ALL,
    });
}

#[test]
fn p2p_pipelines() {
    check(Case {
        name: "AllgatherP2p",
        builder: cases::allgather_p2p(),
        from_macro: allgather_p2p::build(),
        entry: &entry!(allgather_p2p; 0),
        inputs: &|d| vec![(randn(&[d, 6], d as u64), Give::Shard(0))],
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "AG_matmul_P2p (f32)",
        builder: cases::ag_matmul_p2p(DType::F32),
        from_macro: ag_matmul_p2p_f32::build(),
        entry: &entry!(ag_matmul_p2p_f32; 0, 1),
        inputs: &ag_matmul_p2p_inputs,
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "AG_matmul_P2p (bf16)",
        builder: cases::ag_matmul_p2p(DType::BF16),
        from_macro: ag_matmul_p2p_bf16::build(),
        entry: &entry!(ag_matmul_p2p_bf16; 0, 1),
        inputs: &|d| {
            vec![
                (
                    Tensor::randn(&[d, 4, 8], DType::BF16, d as u64),
                    Give::Shard(0),
                ),
                (
                    Tensor::randn(&[8, 3], DType::BF16, 100 + d as u64),
                    Give::Whole,
                ),
            ]
        },
        take: &|_| Take::Replicated,
        devices: ALL,
    });
    check(Case {
        name: "matmul_RS_P2p",
        builder: cases::matmul_rs_p2p(),
        from_macro: matmul_rs_p2p::build(),
        entry: &entry!(matmul_rs_p2p; 0, 1),
        inputs: &matmul_rs_p2p_inputs,
        take: &|_| Take::Sharded(0),
        devices: ALL,
    });
}

#[test]
fn transformer_layers() {
    use fusion::core::ir::UnaryOp;
    check(Case {
        name: "TP MLP",
        builder: cases::tp_mlp(F32, UnaryOp::GeluTanh),
        from_macro: tp_mlp::build(),
        entry: &entry!(tp_mlp; 0, 1, 2),
        inputs: &|d| {
            vec![
                (randn(&[d, 4, 6], d as u64), Give::Shard(0)),
                (randn(&[d, 6, 5], 10 + d as u64), Give::Shard(0)),
                (randn(&[d, 5, 6], 20 + d as u64), Give::Shard(0)),
            ]
        },
        take: &|_| Take::Sharded(0),
        devices: ALL,
    });
    check(Case {
        name: "TP gated MLP",
        builder: cases::tp_gated_mlp(F32),
        from_macro: tp_gated_mlp::build(),
        entry: &entry!(tp_gated_mlp; 0, 1, 2, 3),
        inputs: &|d| {
            vec![
                (randn(&[d, 4, 6], d as u64), Give::Shard(0)),
                (randn(&[d, 6, 5], 10 + d as u64), Give::Shard(0)),
                (randn(&[d, 6, 5], 30 + d as u64), Give::Shard(0)),
                (randn(&[d, 5, 6], 20 + d as u64), Give::Shard(0)),
            ]
        },
        take: &|_| Take::Sharded(0),
        devices: ALL,
    });
    check(Case {
        name: "TP QKV",
        builder: cases::tp_qkv(F32),
        from_macro: tp_qkv::build(),
        entry: &entry!(tp_qkv; 0, 1),
        inputs: &|d| {
            vec![
                (randn(&[d, 4, 6], d as u64), Give::Shard(0)),
                (randn(&[d, 6, 5], 10 + d as u64), Give::Shard(0)),
            ]
        },
        take: &|_| Take::Sharded(1),
        devices: ALL,
    });
    check(Case {
        name: "TP output projection",
        builder: cases::tp_out_proj(F32),
        from_macro: tp_out_proj::build(),
        entry: &entry!(tp_out_proj; 0, 1),
        inputs: &|d| {
            vec![
                (randn(&[d, d, 4, 5], d as u64), Give::Shard(1)),
                (randn(&[d, 5, 6], 10 + d as u64), Give::Shard(0)),
            ]
        },
        take: &|_| Take::Sharded(0),
        devices: ALL,
    });
}

fn ag_matmul_p2p_inputs(d: usize) -> Vec<(Tensor, Give)> {
    vec![
        (randn(&[d, 4, 8], d as u64), Give::Shard(0)),
        (randn(&[8, 3], 100 + d as u64), Give::Whole),
    ]
}

fn matmul_rs_p2p_inputs(d: usize) -> Vec<(Tensor, Give)> {
    vec![
        (randn(&[d, d, 3, 4], d as u64), Give::Shard(0)),
        (randn(&[d, 4, 5], 100 + d as u64), Give::Shard(0)),
    ]
}

/// Calls a generated `run_with` with this rank's inputs and, when given, a preallocated
/// output, each typed by the entry's signature.
macro_rules! entry_into {
    ($f:ident; $($i:tt),*) => {
        |rank: &Rank, ins: &[Tensor], out: Option<&Tensor>| -> fusion::Result<RunReport> {
            let out = out.map(ranked).transpose()?;
            $f::run_with(
                rank,
                $(&ranked(&ins[$i])?,)*
                out.as_ref(),
                &ExecOptions::default(),
            )
        }
    };
}

type EntryInto<'a> =
    &'a (dyn Fn(&Rank, &[Tensor], Option<&Tensor>) -> fusion::Result<RunReport> + Sync);

/// Runs the macro's fusion into a NaN-filled output allocated on each rank: the report's
/// output is that buffer, one allocation fewer than without it, and the buffer holds the
/// builder's numbers (bit for bit) once assembled.
fn check_preallocated(
    name: &str,
    builder: &Fusion,
    entry: EntryInto,
    inputs: &dyn Fn(usize) -> Vec<(Tensor, Give)>,
    take: &dyn Fn(usize) -> Take,
    devices: &[usize],
) {
    let opts = ExecOptions::default();
    for &d in devices {
        let inputs = inputs(d);
        let take = take(d);
        let by_builder = run(builder, d, &inputs, std::slice::from_ref(&take), &opts);
        let world = World::local(d).unwrap();
        let parts = world
            .run(|rank| {
                let local = distribute(rank, &inputs)?;
                let plain = entry(rank, &local, None)?;
                let shape = plain.outputs[0].shape().to_vec();
                let out = rank.to_device(&Tensor::full(&shape, F32, f32::NAN))?;
                let pre = entry(rank, &local, Some(&out))?;
                assert!(
                    pre.outputs[0].shares_storage(&out),
                    "{name} on {d} devices, rank {}: the output is the given buffer",
                    rank.index()
                );
                assert_eq!(
                    pre.stats.allocations + 1,
                    plain.stats.allocations,
                    "{name} on {d} devices, rank {}: the output is not allocated again",
                    rank.index()
                );
                assert_eq!(
                    rank.to_host(&plain.outputs[0])?.to_f32_vec()?,
                    rank.to_host(&out)?.to_f32_vec()?,
                    "{name} on {d} devices, rank {}: the buffer holds what a plain run returns",
                    rank.index()
                );
                rank.to_host(&out)
            })
            .unwrap_or_else(|e| panic!("{name} on {d} devices: {e}"));
        let by_macro = assemble(&parts, &take);
        let expected = &by_builder.outputs[0];
        assert_eq!(by_macro.shape(), expected.shape(), "{name} on {d}");
        assert_eq!(
            by_macro.to_f32_vec().unwrap(),
            expected.to_f32_vec().unwrap(),
            "{name} on {d} devices: the preallocated output holds other numbers",
        );
    }
}

#[test]
fn preallocated_outputs_through_run_with() {
    check_preallocated(
        "AG_matmul_P2p (f32)",
        &cases::ag_matmul_p2p(DType::F32),
        &entry_into!(ag_matmul_p2p_f32; 0, 1),
        &ag_matmul_p2p_inputs,
        &|_| Take::Replicated,
        ALL,
    );
    check_preallocated(
        "matmul_RS_P2p",
        &cases::matmul_rs_p2p(),
        &entry_into!(matmul_rs_p2p; 0, 1),
        &matmul_rs_p2p_inputs,
        &|_| Take::Sharded(0),
        ALL,
    );
}

#[test]
fn reshardings_without_streams() {
    check(Case {
        name: "Allgather (no streams)",
        builder: cases::reshard_allgather(),
        from_macro: reshard_allgather::build(),
        entry: &entry!(reshard_allgather; 0),
        inputs: &|d| vec![(randn(&[d, 5], d as u64), Give::Shard(0))],
        take: &|_| Take::Replicated,
        devices: MULTI,
    });
    check(Case {
        name: "Allreduce (no streams)",
        builder: cases::reshard_allreduce(),
        from_macro: reshard_allreduce::build(),
        entry: &entry!(reshard_allreduce; 0),
        inputs: &|d| vec![(randn(&[d, 5], d as u64), Give::Shard(0))],
        take: &|_| Take::Replicated,
        devices: MULTI,
    });
    check(Case {
        name: "ReduceScatter (no streams)",
        builder: cases::reshard_reduce_scatter(),
        from_macro: reshard_reduce_scatter::build(),
        entry: &entry!(reshard_reduce_scatter; 0),
        inputs: &|d| vec![(randn(&[d, d, 3], d as u64), Give::Shard(0))],
        take: &|_| Take::Sharded(0),
        devices: MULTI,
    });
    check(Case {
        name: "Scatter",
        builder: cases::reshard_scatter(),
        from_macro: reshard_scatter::build(),
        entry: &entry!(reshard_scatter; 0),
        inputs: &|d| vec![(randn(&[d, 4], d as u64), Give::Whole)],
        take: &|_| Take::Sharded(0),
        devices: MULTI,
    });
    check(Case {
        name: "Gather",
        builder: cases::reshard_gather(),
        from_macro: reshard_gather::build(),
        entry: &entry!(reshard_gather; 0),
        inputs: &|d| vec![(randn(&[d, 5], d as u64), Give::Shard(0))],
        take: &|_| Take::On(vec![0]),
        devices: MULTI,
    });
    check(Case {
        name: "Broadcast",
        builder: cases::reshard_broadcast(3),
        from_macro: reshard_broadcast::build(),
        entry: &entry!(reshard_broadcast; 0),
        inputs: &|d| vec![(randn(&[3, 4], d as u64), Give::OnlyOn(vec![3]))],
        take: &|_| Take::Replicated,
        devices: FOUR_UP,
    });
    check(Case {
        name: "Reduce",
        builder: cases::reshard_reduce(),
        from_macro: reshard_reduce::build(),
        entry: &entry!(reshard_reduce; 0),
        inputs: &|d| vec![(randn(&[d, 6], d as u64), Give::Shard(0))],
        take: &|_| Take::On(vec![0]),
        devices: MULTI,
    });
    check(Case {
        name: "SendRecv",
        builder: cases::reshard_send_recv(&[0, 1], &[2, 3]),
        from_macro: reshard_send_recv::build(),
        entry: &entry!(reshard_send_recv; 0),
        inputs: &|d| vec![(randn(&[2, 5], d as u64), Give::ShardOn(vec![0, 1], 0))],
        take: &|_| Take::ShardedOn(vec![2, 3], 0),
        devices: FOUR_UP,
    });
}
