//! Conformance suite of the engine: every case checks the host program's structure and
//! its numbers against an independent f64 reference, on 1, 2, 3, 4 and 8 simulated
//! devices. Case names follow nvFuser's tests behind the seeds.

mod common;

use common::cases::{self, axes, single_set_op};
use common::*;
use fusion::core::builder::FusionBuilder;
use fusion::core::hir::NodeKind::{self, *};
use fusion::core::ir::ParallelType;
use fusion::{DType, ExecOptions, Tensor};

const F32: DType = DType::F32;
const TOL: f64 = 1e-5;

fn opts() -> ExecOptions {
    ExecOptions::default()
}

fn seed(d: usize, salt: u64) -> u64 {
    d as u64 * 1000 + salt
}

use ParallelType::Serial as S;

const SYNC_LOOP_TOP: [NodeKind; 4] = [Allocate, GetCurrentStream, ForLoop, ForLoop];

// ---------------------------------------------------------------- single-device stream lowering

#[test]
fn single_set_op_case() {
    let f = single_set_op();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[5, 3], F32, seed(d, 1));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Whole)],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        assert_eq!(
            main_loop_body(&r.program),
            [
                SetCurrentStream,
                AliasSelect,
                AliasSelect,
                Set,
                SetCurrentStream,
                Synchronize
            ]
        );
        assert_close(
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            TOL,
            "SingleSetOp",
        );
    }
}

#[test]
fn two_set_ops_merge_loops() {
    let f = cases::two_set_ops();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[4, 6], F32, seed(d, 2));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Whole)],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(
            kinds(&r.program.body),
            [
                Allocate,
                Allocate,
                GetCurrentStream,
                ForLoop,
                ForLoop,
                Deallocate
            ]
        );
        assert_eq!(
            main_loop_body(&r.program),
            [
                SetCurrentStream,
                AliasSelect,
                AliasSelect,
                Set,
                AliasSelect,
                Set,
                SetCurrentStream,
                Synchronize
            ]
        );
        assert_close(&RefArray::from_tensor(&x), &r.outputs[0], TOL, "TwoSetOps");
    }
}

#[test]
fn three_set_ops_with_disjoint_for_loops() {
    let f = cases::three_set_ops_with_disjoint_for_loops();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[3, 7], F32, seed(d, 3));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Whole)],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(
            kinds(&r.program.body),
            [
                Allocate,
                GetCurrentStream,
                ForLoop,
                ForLoop,
                Set,
                Deallocate,
                Allocate,
                GetCurrentStream,
                ForLoop,
                ForLoop,
                Deallocate
            ]
        );
        assert_close(
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            TOL,
            "ThreeSetOps",
        );
    }
}

#[test]
fn single_binary_op() {
    let f = cases::single_binary_op();
    for d in DEVICE_COUNTS {
        let (x, y) = (
            Tensor::randn(&[4, 5], F32, seed(d, 4)),
            Tensor::randn(&[4, 5], F32, seed(d, 5)),
        );
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Whole), (y.clone(), Give::Whole)],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        assert_eq!(
            main_loop_body(&r.program),
            [
                SetCurrentStream,
                AliasSelect,
                AliasSelect,
                AliasSelect,
                Binary,
                SetCurrentStream,
                Synchronize
            ]
        );
        let expected = RefArray::from_tensor(&x).zip(&RefArray::from_tensor(&y), |a, b| a + b);
        assert_close(&expected, &r.outputs[0], TOL, "SingleBinaryOp");
    }
}

#[test]
fn reduction() {
    let f = cases::reduction();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[6, 9], F32, seed(d, 6));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Whole)],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        assert_eq!(
            main_loop_body(&r.program),
            [
                SetCurrentStream,
                AliasSelect,
                AliasSelect,
                Reduction,
                SetCurrentStream,
                Synchronize
            ]
        );
        assert_close(
            &RefArray::from_tensor(&x).sum(1),
            &r.outputs[0],
            TOL,
            "Reduction",
        );
    }
}

#[test]
fn matmul_m() {
    let f = cases::matmul_m();
    for d in DEVICE_COUNTS {
        let (x, y) = (
            Tensor::randn(&[5, 4], F32, seed(d, 7)),
            Tensor::randn(&[4, 3], F32, seed(d, 8)),
        );
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Whole), (y.clone(), Give::Whole)],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        assert_eq!(
            main_loop_body(&r.program),
            [
                SetCurrentStream,
                AliasSelect,
                AliasSelect,
                Matmul,
                SetCurrentStream,
                Synchronize
            ]
        );
        let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
        assert_close(&expected, &r.outputs[0], TOL, "Matmul_M");
    }
}

// ---------------------------------------------------------------- collective-based pipelines (seed 000)

const COLLECTIVE_BODY: [NodeKind; 8] = [
    SetCurrentStream,
    AliasSelect,
    AliasSelect,
    Allocate,
    Communication,
    Wait,
    SetCurrentStream,
    Synchronize,
];

#[test]
fn stream_parallel_allgather() {
    let f = cases::stream_parallel_allgather();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[3, d, 4], F32, seed(d, 10));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(1))],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        if d > 1 {
            assert_eq!(main_loop_body(&r.program), COLLECTIVE_BODY);
        }
        assert_close(&RefArray::from_tensor(&x), &r.outputs[0], TOL, "Allgather");
    }
}

#[test]
fn stream_parallel_allreduce() {
    let f = cases::stream_parallel_allreduce();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[3, d, 5], F32, seed(d, 11));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(1))],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        if d > 1 {
            assert_eq!(main_loop_body(&r.program), COLLECTIVE_BODY);
        }
        assert_close(
            &RefArray::from_tensor(&x).sum(1),
            &r.outputs[0],
            TOL,
            "Allreduce",
        );
    }
}

#[test]
fn stream_parallel_reduce_scatter() {
    let f = cases::stream_parallel_reduce_scatter();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[2, d, d, 3], F32, seed(d, 12));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(1))],
            &[Take::Sharded(1)],
            &opts(),
        );
        assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        if d > 1 {
            assert_eq!(main_loop_body(&r.program), COLLECTIVE_BODY);
        }
        assert_close(
            &RefArray::from_tensor(&x).sum(1),
            &r.outputs[0],
            TOL,
            "ReduceScatter",
        );
    }
}

#[test]
fn ag_matmul_collective_pipeline() {
    let f = cases::ag_matmul();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[2, d, 3, 8], F32, seed(d, 13));
        let y = Tensor::randn(&[8, 5], F32, seed(d, 14));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(1)), (y.clone(), Give::Whole)],
            &[Take::Replicated],
            &opts(),
        );
        if d > 1 {
            assert_eq!(
                kinds(&r.program.body),
                [
                    Allocate,
                    Allocate,
                    GetCurrentStream,
                    ForLoop,
                    ForLoop,
                    Deallocate
                ]
            );
            assert_eq!(
                main_loop_body(&r.program),
                [
                    SetCurrentStream,
                    AliasSelect,
                    AliasSelect,
                    Allocate,
                    Communication,
                    Wait,
                    AliasSelect,
                    Matmul,
                    SetCurrentStream,
                    Synchronize
                ]
            );
        } else {
            // One device: nothing to gather, the matmul is streamed directly.
            assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        }
        let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
        assert_close(&expected, &r.outputs[0], TOL, "AG_matmul");
    }
}

#[test]
fn matmul_ar() {
    let f = cases::matmul_ar();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[3, d, 2, 4], F32, seed(d, 15));
        let y = Tensor::randn(&[d, 4, 5], F32, seed(d, 16));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(1)), (y.clone(), Give::Shard(0))],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(
            kinds(&r.program.body),
            [
                Allocate,
                Allocate,
                GetCurrentStream,
                ForLoop,
                ForLoop,
                Deallocate
            ]
        );
        if d > 1 {
            assert_eq!(
                main_loop_body(&r.program),
                [
                    SetCurrentStream,
                    AliasSelect,
                    AliasSelect,
                    Matmul,
                    AliasSelect,
                    Allocate,
                    Communication,
                    Wait,
                    SetCurrentStream,
                    Synchronize
                ]
            );
        }
        let expected = RefArray::from_tensor(&x)
            .matmul(&RefArray::from_tensor(&y))
            .sum(1);
        assert_close(&expected, &r.outputs[0], TOL, "matmul_AR");
    }
}

#[test]
fn matmul_rs_through_broadcast() {
    let f = cases::matmul_rs_through_broadcast();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[d, 2, d, 3, 4], F32, seed(d, 17));
        let y = Tensor::randn(&[d, 4, 5], F32, seed(d, 18));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0)), (y.clone(), Give::Shard(0))],
            &[Take::Sharded(1)],
            &opts(),
        );
        assert_eq!(
            kinds(&r.program.body),
            [
                Broadcast,
                Allocate,
                Allocate,
                GetCurrentStream,
                ForLoop,
                ForLoop,
                Deallocate
            ]
        );
        if d > 1 {
            assert_eq!(
                main_loop_body(&r.program),
                [
                    SetCurrentStream,
                    AliasSelect,
                    AliasSelect,
                    AliasSelect,
                    Matmul,
                    AliasSelect,
                    Allocate,
                    Communication,
                    Wait,
                    SetCurrentStream,
                    Synchronize
                ]
            );
        }
        let yb = RefArray::from_tensor(&y).unsqueeze(1).unsqueeze(1);
        let expected = RefArray::from_tensor(&x).matmul(&yb).sum(0);
        assert_close(&expected, &r.outputs[0], TOL, "matmul_RS_through_bcast");
    }
}

#[test]
fn ag_linear_with_bias() {
    let f = cases::ag_linear_with_bias();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[2, d, 3, 6], F32, seed(d, 19));
        let w = Tensor::randn(&[4, 6], F32, seed(d, 20));
        let bias = Tensor::randn(&[4], F32, seed(d, 21));
        let r = run(
            &f,
            d,
            &[
                (x.clone(), Give::Shard(1)),
                (w.clone(), Give::Whole),
                (bias.clone(), Give::Whole),
            ],
            &[Take::Replicated],
            &opts(),
        );
        if d > 1 {
            assert_eq!(
                main_loop_body(&r.program),
                [
                    SetCurrentStream,
                    AliasSelect,
                    AliasSelect,
                    Allocate,
                    Communication,
                    Wait,
                    AliasSelect,
                    Linear,
                    SetCurrentStream,
                    Synchronize
                ]
            );
        }
        let expected = RefArray::from_tensor(&x)
            .matmul(&RefArray::from_tensor(&w).transpose_last())
            .zip(&RefArray::from_tensor(&bias), |a, b| a + b);
        assert_close(&expected, &r.outputs[0], TOL, "AG_linear");
    }
}

// ---------------------------------------------------------------- P2P pipelines (seed 001)

#[test]
fn allgather_p2p() {
    let f = cases::allgather_p2p();
    for d in DEVICE_COUNTS {
        let x = Tensor::randn(&[d, 6], F32, seed(d, 22));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0))],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(kinds(&r.program.body), SYNC_LOOP_TOP);
        if d > 1 {
            assert_eq!(
                main_loop_body(&r.program),
                [
                    SetCurrentStream,
                    AliasSelect,
                    IfThenElse,
                    SetCurrentStream,
                    Synchronize
                ]
            );
        }
        assert_close(
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            TOL,
            "AllgatherP2p",
        );
    }
}

#[test]
fn ag_matmul_p2p_case() {
    for dtype in [DType::F32, DType::BF16] {
        let f = cases::ag_matmul_p2p(dtype);
        for d in DEVICE_COUNTS {
            let x = Tensor::randn(&[d, 4, 8], dtype, seed(d, 23));
            let y = Tensor::randn(&[8, 3], dtype, seed(d, 24));
            let r = run(
                &f,
                d,
                &[(x.clone(), Give::Shard(0)), (y.clone(), Give::Whole)],
                &[Take::Replicated],
                &opts(),
            );
            if d > 1 {
                assert_eq!(
                    kinds(&r.program.body),
                    [
                        Allocate,
                        Allocate,
                        GetCurrentStream,
                        ForLoop,
                        ForLoop,
                        Deallocate
                    ]
                );
                assert_eq!(
                    main_loop_body(&r.program),
                    [
                        SetCurrentStream,
                        AliasSelect,
                        IfThenElse,
                        AliasSelect,
                        Matmul,
                        SetCurrentStream,
                        Synchronize
                    ]
                );
            }
            let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
            let tol = if dtype == DType::F32 { TOL } else { 1e-2 };
            assert_close(&expected, &r.outputs[0], tol, "AG_matmul_P2p");
        }
    }
}

// ---------------------------------------------------------------- preallocated outputs and aliases

#[test]
fn preallocated_outputs_are_written_in_place() {
    let f = cases::ag_matmul_p2p(F32);
    for d in DEVICE_COUNTS {
        let world = fusion::World::local(d).unwrap();
        let exec = fusion::FusionExecutor::new(f.clone());
        let x = Tensor::randn(&[d, 4, 8], F32, seed(d, 25));
        let y = Tensor::randn(&[8, 3], F32, seed(d, 26));
        let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
        let res = world
            .run(|rank| {
                let a = rank.shard(&x, 0)?;
                let plain = exec.run_with(rank, &[&a, &y], None, &opts())?;
                let out = Tensor::full(&[d, 4, 3], F32, f32::NAN);
                let pre = exec.run_with(rank, &[&a, &y], Some(&[&out]), &opts())?;
                assert!(
                    pre.outputs[0].shares_storage(&out),
                    "the output is the given buffer"
                );
                assert_eq!(pre.stats.allocations + 1, plain.stats.allocations);
                Ok(out)
            })
            .unwrap();
        for out in res {
            assert_close(&expected, &out, TOL, "preallocated output");
        }
    }
}

#[test]
fn outputs_alias_inputs_without_copies() {
    // An output that is a view of an input (a select) is returned as that view.
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let t0 = b.input("t0", F32, &a).unwrap();
    let one = b.constant(1);
    let row = b.select(t0, 0, one).unwrap();
    b.output(row).unwrap();
    let f = b.build().unwrap();
    // An in-place update: t0 += t1, written into t0's buffer.
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let u0 = b.input("t0", F32, &a).unwrap();
    let u1 = b.input("t1", F32, &a).unwrap();
    let sum = b.add(u0, u1).unwrap();
    let sum = b.output(sum).unwrap();
    b.alias_output_to_input(sum, u0).unwrap();
    let g = b.build().unwrap();
    for d in DEVICE_COUNTS {
        let world = fusion::World::local(d).unwrap();
        let (ef, eg) = (
            fusion::FusionExecutor::new(f.clone()),
            fusion::FusionExecutor::new(g.clone()),
        );
        world
            .run(|rank| {
                let x = Tensor::randn(&[3, 4], F32, seed(d, 27 + rank.index() as u64));
                let rep = ef.run_with(rank, &[&x], None, &opts())?;
                assert!(rep.outputs[0].shares_storage(&x));
                assert_eq!(rep.stats.allocations, 0);
                assert_eq!(rep.outputs[0].to_f32_vec()?, x.select(0, 1)?.to_f32_vec()?);
                let y = Tensor::randn(&[3, 4], F32, 99);
                let before =
                    RefArray::from_tensor(&x).zip(&RefArray::from_tensor(&y), |a, b| a + b);
                let rep = eg.run_with(rank, &[&x, &y], None, &opts())?;
                assert!(rep.outputs[0].shares_storage(&x));
                assert_eq!(rep.stats.allocations, 0);
                assert_close(&before, &x, TOL, "in-place update");
                Ok(())
            })
            .unwrap();
    }
}

// ---------------------------------------------------------------- reshardings without streams

const RESHARD_TOP: [NodeKind; 3] = [Allocate, Communication, Wait];

fn comm_kind(r: &Run) -> fusion::core::hir::CommunicationKind {
    r.program
        .body
        .iter()
        .find_map(|n| match n {
            fusion::core::hir::Node::Communication(c) => Some(c.kind),
            _ => None,
        })
        .expect("a communication")
}

#[test]
fn reshard_allgather_allreduce_reduce_scatter_scatter() {
    use fusion::core::hir::CommunicationKind as K;
    for d in DEVICE_COUNTS.into_iter().filter(|&d| d > 1) {
        // Allgather
        let f = cases::reshard_allgather();
        let x = Tensor::randn(&[d, 5], F32, seed(d, 30));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0))],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(
            (kinds(&r.program.body), comm_kind(&r)),
            (RESHARD_TOP.to_vec(), K::Allgather)
        );
        assert_close(&RefArray::from_tensor(&x), &r.outputs[0], TOL, "Allgather");

        // Allreduce
        let f = cases::reshard_allreduce();
        let x = Tensor::randn(&[d, 5], F32, seed(d, 31));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0))],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(
            (kinds(&r.program.body), comm_kind(&r)),
            (RESHARD_TOP.to_vec(), K::Allreduce)
        );
        assert_close(
            &RefArray::from_tensor(&x).sum(0),
            &r.outputs[0],
            TOL,
            "Allreduce",
        );

        // ReduceScatter
        let f = cases::reshard_reduce_scatter();
        let x = Tensor::randn(&[d, d, 3], F32, seed(d, 32));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0))],
            &[Take::Sharded(0)],
            &opts(),
        );
        assert_eq!(
            (kinds(&r.program.body), comm_kind(&r)),
            (RESHARD_TOP.to_vec(), K::ReduceScatter)
        );
        assert_close(
            &RefArray::from_tensor(&x).sum(0),
            &r.outputs[0],
            TOL,
            "ReduceScatter",
        );

        // Scatter (from device 0, the first of the input's mesh)
        let f = cases::reshard_scatter();
        let x = Tensor::randn(&[d, 4], F32, seed(d, 33));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Whole)],
            &[Take::Sharded(0)],
            &opts(),
        );
        assert_eq!(
            (kinds(&r.program.body), comm_kind(&r)),
            (RESHARD_TOP.to_vec(), K::Scatter)
        );
        assert_close(&RefArray::from_tensor(&x), &r.outputs[0], TOL, "Scatter");
    }
}

#[test]
fn reshard_gather_broadcast_reduce_sendrecv() {
    use fusion::core::hir::CommunicationKind as K;
    for d in DEVICE_COUNTS.into_iter().filter(|&d| d > 1) {
        let all: Vec<usize> = (0..d).collect();
        // Gather to device 0
        let f = cases::reshard_gather();
        let x = Tensor::randn(&[d, 5], F32, seed(d, 34));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0))],
            &[Take::On(vec![0])],
            &opts(),
        );
        assert_eq!(
            (kinds(&r.program.body), comm_kind(&r)),
            (RESHARD_TOP.to_vec(), K::Gather)
        );
        assert_close(&RefArray::from_tensor(&x), &r.outputs[0], TOL, "Gather");

        // Broadcast from the last device to all
        let f = cases::reshard_broadcast(d - 1);
        let x = Tensor::randn(&[3, 4], F32, seed(d, 35));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::OnlyOn(vec![d - 1]))],
            &[Take::Replicated],
            &opts(),
        );
        assert_eq!(
            (kinds(&r.program.body), comm_kind(&r)),
            (RESHARD_TOP.to_vec(), K::Broadcast)
        );
        assert_close(&RefArray::from_tensor(&x), &r.outputs[0], TOL, "Broadcast");

        // Reduce to device 0
        let f = cases::reshard_reduce();
        let x = Tensor::randn(&[d, 6], F32, seed(d, 36));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0))],
            &[Take::On(vec![0])],
            &opts(),
        );
        assert_eq!(
            (kinds(&r.program.body), comm_kind(&r)),
            (RESHARD_TOP.to_vec(), K::Reduce)
        );
        assert_close(
            &RefArray::from_tensor(&x).sum(0),
            &r.outputs[0],
            TOL,
            "Reduce",
        );

        // SendRecv: sharded on the first half of the devices -> sharded on the second half
        // (halves of one device are not sharded: that case is a Broadcast).
        if d % 2 == 0 && d >= 4 {
            let h = d / 2;
            let (m1, m2): (Vec<usize>, Vec<usize>) = (all[..h].to_vec(), all[h..].to_vec());
            let f = cases::reshard_send_recv(&m1, &m2);
            let x = Tensor::randn(&[h, 5], F32, seed(d, 37));
            let r = run(
                &f,
                d,
                &[(x.clone(), Give::ShardOn(m1, 0))],
                &[Take::ShardedOn(m2, 0)],
                &opts(),
            );
            let mut expected_top = vec![Allocate];
            for _ in 0..h {
                expected_top.extend([Communication, Wait]);
            }
            assert_eq!(
                (kinds(&r.program.body), comm_kind(&r)),
                (expected_top, K::SendRecv)
            );
            assert_close(&RefArray::from_tensor(&x), &r.outputs[0], TOL, "SendRecv");
        }
    }
}
