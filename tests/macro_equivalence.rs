//! The expansion of `fusion!`: every case of `tests/common/cases.rs` (the fusions of
//! `tests/conformance.rs`) written with `fusion!` builds, through its generated `build()`,
//! a fusion that lowers to the same printed host program as the builder's on every world
//! size where the case applies. The macro checks a fusion with `fusion-compiler`'s builder and
//! records the calls it made; this is the test that `build()` repeats them. The generated
//! `run_with` is checked with preallocated outputs: the buffer passed in is the one
//! written, with the builder's numbers.
//!
//! Not covered here: output aliasing (`alias_output_to_input`) has no `fusion!` syntax; the
//! numbers of these fusions are the conformance suite's.

// Most typed entry points are not called: the test is of `build()` and `run_with`.
#![allow(dead_code)]

mod common;

use common::{assemble, cases, distribute, run, Give, Take, DEVICE_COUNTS};
use fusion::compiler::ir::{Fusion, UnaryOp};
use fusion::compiler::lower::{lower, LowerOptions};
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
const ALL: &[usize] = &DEVICE_COUNTS;
const MULTI: &[usize] = &[2, 3, 4, 8];
const FOUR_UP: &[usize] = &[4, 8];

type Case = (
    &'static str,
    Fusion,
    fusion::compiler::Result<Fusion>,
    &'static [usize],
);

#[test]
fn every_fusion_builds_the_builders_program() {
    let all: Vec<Case> = vec![
        (
            "SingleSetOp",
            cases::single_set_op(),
            single_set_op::build(),
            ALL,
        ),
        ("TwoSetOps", cases::two_set_ops(), two_set_ops::build(), ALL),
        (
            "ThreeSetOpsWithDisjointsForLoops",
            cases::three_set_ops_with_disjoint_for_loops(),
            three_set_ops::build(),
            ALL,
        ),
        (
            "SingleBinaryOp",
            cases::single_binary_op(),
            single_binary_op::build(),
            ALL,
        ),
        ("Reduction", cases::reduction(), reduction::build(), ALL),
        ("Matmul_M", cases::matmul_m(), matmul_m::build(), ALL),
        (
            "Allgather",
            cases::stream_parallel_allgather(),
            stream_parallel_allgather::build(),
            ALL,
        ),
        (
            "Allreduce",
            cases::stream_parallel_allreduce(),
            stream_parallel_allreduce::build(),
            ALL,
        ),
        (
            "ReduceScatter",
            cases::stream_parallel_reduce_scatter(),
            stream_parallel_reduce_scatter::build(),
            ALL,
        ),
        ("AG_matmul", cases::ag_matmul(), ag_matmul::build(), ALL),
        ("matmul_AR", cases::matmul_ar(), matmul_ar::build(), ALL),
        (
            "matmul_RS_through_bcast",
            cases::matmul_rs_through_broadcast(),
            matmul_rs_through_broadcast::build(),
            ALL,
        ),
        (
            "AG_linear",
            cases::ag_linear_with_bias(),
            ag_linear_with_bias::build(),
            ALL,
        ),
        (
            "AllgatherP2p",
            cases::allgather_p2p(),
            allgather_p2p::build(),
            ALL,
        ),
        (
            "AG_matmul_P2p (f32)",
            cases::ag_matmul_p2p(DType::F32),
            ag_matmul_p2p_f32::build(),
            ALL,
        ),
        (
            "AG_matmul_P2p (bf16)",
            cases::ag_matmul_p2p(DType::BF16),
            ag_matmul_p2p_bf16::build(),
            ALL,
        ),
        (
            "matmul_RS_P2p",
            cases::matmul_rs_p2p(),
            matmul_rs_p2p::build(),
            ALL,
        ),
        (
            "TP MLP",
            cases::tp_mlp(F32, UnaryOp::GeluTanh),
            tp_mlp::build(),
            ALL,
        ),
        (
            "TP gated MLP",
            cases::tp_gated_mlp(F32),
            tp_gated_mlp::build(),
            ALL,
        ),
        ("TP QKV", cases::tp_qkv(F32), tp_qkv::build(), ALL),
        (
            "TP output projection",
            cases::tp_out_proj(F32),
            tp_out_proj::build(),
            ALL,
        ),
        (
            "Allgather (no streams)",
            cases::reshard_allgather(),
            reshard_allgather::build(),
            MULTI,
        ),
        (
            "Allreduce (no streams)",
            cases::reshard_allreduce(),
            reshard_allreduce::build(),
            MULTI,
        ),
        (
            "ReduceScatter (no streams)",
            cases::reshard_reduce_scatter(),
            reshard_reduce_scatter::build(),
            MULTI,
        ),
        (
            "Scatter",
            cases::reshard_scatter(),
            reshard_scatter::build(),
            MULTI,
        ),
        (
            "Gather",
            cases::reshard_gather(),
            reshard_gather::build(),
            MULTI,
        ),
        (
            "Broadcast",
            cases::reshard_broadcast(3),
            reshard_broadcast::build(),
            FOUR_UP,
        ),
        (
            "Reduce",
            cases::reshard_reduce(),
            reshard_reduce::build(),
            MULTI,
        ),
        (
            "SendRecv",
            cases::reshard_send_recv(&[0, 1], &[2, 3]),
            reshard_send_recv::build(),
            FOUR_UP,
        ),
    ];
    for (name, builder, from_macro, devices) in all {
        let from_macro = from_macro
            .unwrap_or_else(|e| panic!("{name}: the fusion! version does not build: {e}"));
        for &d in devices {
            let program = |f: &Fusion| {
                let lowered = lower(f, d, &LowerOptions::default());
                lowered
                    .unwrap_or_else(|e| panic!("{name} on {d} devices: {e}"))
                    .program
            };
            assert_eq!(
                program(&from_macro).to_string(),
                program(&builder).to_string(),
                "{name} on {d} devices: the fusion! program differs from the builder's"
            );
        }
    }
}

fn randn(shape: &[usize], salt: u64) -> Tensor {
    Tensor::randn(shape, F32, salt)
}

/// A rank-typed view of a distributed input.
fn ranked<const R: usize>(t: &Tensor) -> fusion::Result<Ranked<R>> {
    Ranked::new(t.clone())
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
