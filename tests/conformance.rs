//! Conformance suite of the engine: every case checks the host program's structure and
//! its numbers against an independent f64 reference, on 1, 2, 3, 4 and 8 simulated
//! devices. Case names follow nvFuser's tests behind the seeds.

mod common;

use common::cases::{self, axes, single_set_op};
use common::*;
use fusion::compiler::builder::FusionBuilder;
use fusion::compiler::hir::NodeKind::{self, *};
use fusion::compiler::ir::ParallelType;
use fusion::{DType, ExecOptions, Tensor};

/// The default options, with the stream-order race checker on (as for every case run
/// through `common::run`).
fn opts() -> ExecOptions {
    ExecOptions {
        race_check: true,
        ..ExecOptions::default()
    }
}

/// The input seed of a case: fixed by default, so that a failure reproduces; with
/// `FUSION_TEST_SEED` (the GPU scripts set a fresh one per run, and print it) every run
/// draws new inputs.
fn seed(d: usize, salt: u64) -> u64 {
    test_seed_base().wrapping_mul(1_000_003) + d as u64 * 1000 + salt
}

use ParallelType::Serial as S;

const SYNC_LOOP_TOP: [NodeKind; 4] = [Allocate, GetCurrentStream, ForLoop, ForLoop];

// ---------------------------------------------------------------- single-device stream lowering

#[test]
fn single_set_op_case() {
    let f = single_set_op();
    for d in device_counts() {
        let x = Tensor::randn(&[5, 3], test_dtype(), seed(d, 1));
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
            tolerance(),
            "SingleSetOp",
        );
    }
}

#[test]
fn two_set_ops_merge_loops() {
    let f = cases::two_set_ops();
    for d in device_counts() {
        let x = Tensor::randn(&[4, 6], test_dtype(), seed(d, 2));
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
        assert_close(
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            tolerance(),
            "TwoSetOps",
        );
    }
}

#[test]
fn three_set_ops_with_disjoint_for_loops() {
    let f = cases::three_set_ops_with_disjoint_for_loops();
    for d in device_counts() {
        let x = Tensor::randn(&[3, 7], test_dtype(), seed(d, 3));
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
            tolerance(),
            "ThreeSetOps",
        );
    }
}

#[test]
fn single_binary_op() {
    let f = cases::single_binary_op();
    for d in device_counts() {
        let (x, y) = (
            Tensor::randn(&[4, 5], test_dtype(), seed(d, 4)),
            Tensor::randn(&[4, 5], test_dtype(), seed(d, 5)),
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
        assert_close(&expected, &r.outputs[0], tolerance(), "SingleBinaryOp");
    }
}

#[test]
fn reduction() {
    let f = cases::reduction();
    for d in device_counts() {
        let x = Tensor::randn(&[6, 9], test_dtype(), seed(d, 6));
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
            tolerance(),
            "Reduction",
        );
    }
}

#[test]
fn matmul_m() {
    let f = cases::matmul_m();
    for d in device_counts() {
        let (x, y) = (
            Tensor::randn(&[5, 4], test_dtype(), seed(d, 7)),
            Tensor::randn(&[4, 3], test_dtype(), seed(d, 8)),
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
        assert_close(&expected, &r.outputs[0], tolerance(), "Matmul_M");
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
    for d in device_counts() {
        let x = Tensor::randn(&[3, d, 4], test_dtype(), seed(d, 10));
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
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            tolerance(),
            "Allgather",
        );
    }
}

#[test]
fn stream_parallel_allreduce() {
    let f = cases::stream_parallel_allreduce();
    for d in device_counts() {
        let x = Tensor::randn(&[3, d, 5], test_dtype(), seed(d, 11));
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
            tolerance(),
            "Allreduce",
        );
    }
}

#[test]
fn stream_parallel_reduce_scatter() {
    let f = cases::stream_parallel_reduce_scatter();
    for d in device_counts() {
        let x = Tensor::randn(&[2, d, d, 3], test_dtype(), seed(d, 12));
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
            tolerance(),
            "ReduceScatter",
        );
    }
}

#[test]
fn ag_matmul_collective_pipeline() {
    let f = cases::ag_matmul();
    for d in device_counts() {
        let x = Tensor::randn(&[2, d, 3, 8], test_dtype(), seed(d, 13));
        let y = Tensor::randn(&[8, 5], test_dtype(), seed(d, 14));
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
        assert_close(&expected, &r.outputs[0], tolerance(), "AG_matmul");
    }
}

#[test]
fn matmul_ar() {
    let f = cases::matmul_ar();
    for d in device_counts() {
        let x = Tensor::randn(&[3, d, 2, 4], test_dtype(), seed(d, 15));
        let y = Tensor::randn(&[d, 4, 5], test_dtype(), seed(d, 16));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(1)), (y.clone(), Give::Shard(0))],
            &[Take::Replicated],
            &opts(),
        );
        // On one device nothing is communicated: no join loop after the main loop.
        let mut expected_top = vec![Allocate, Allocate, GetCurrentStream, ForLoop, ForLoop];
        if d > 1 {
            expected_top.push(ForLoop);
        }
        expected_top.push(Deallocate);
        assert_eq!(kinds(&r.program.body), expected_top);
        if d > 1 {
            // Compute first: the GEMM on the caller's stream, the allreduce on the pool.
            assert_eq!(
                main_loop_body(&r.program),
                [
                    SetCurrentStream,
                    Synchronize,
                    AliasSelect,
                    AliasSelect,
                    Matmul,
                    SetCurrentStream,
                    Synchronize,
                    AliasSelect,
                    Allocate,
                    Communication,
                    Wait,
                    SetCurrentStream
                ]
            );
        }
        let expected = RefArray::from_tensor(&x)
            .matmul(&RefArray::from_tensor(&y))
            .sum(1);
        assert_close(&expected, &r.outputs[0], tolerance(), "matmul_AR");
    }
}

#[test]
fn matmul_rs_through_broadcast() {
    let f = cases::matmul_rs_through_broadcast();
    for d in device_counts() {
        let x = Tensor::randn(&[d, 2, d, 3, 4], test_dtype(), seed(d, 17));
        let y = Tensor::randn(&[d, 4, 5], test_dtype(), seed(d, 18));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0)), (y.clone(), Give::Shard(0))],
            &[Take::Sharded(1)],
            &opts(),
        );
        let mut expected_top = vec![
            Broadcast,
            Allocate,
            Allocate,
            GetCurrentStream,
            ForLoop,
            ForLoop,
        ];
        if d > 1 {
            expected_top.push(ForLoop);
        }
        expected_top.push(Deallocate);
        assert_eq!(kinds(&r.program.body), expected_top);
        if d > 1 {
            assert_eq!(
                main_loop_body(&r.program),
                [
                    SetCurrentStream,
                    Synchronize,
                    AliasSelect,
                    AliasSelect,
                    AliasSelect,
                    Matmul,
                    SetCurrentStream,
                    Synchronize,
                    AliasSelect,
                    Allocate,
                    Communication,
                    Wait,
                    SetCurrentStream
                ]
            );
        }
        let yb = RefArray::from_tensor(&y).unsqueeze(1).unsqueeze(1);
        let expected = RefArray::from_tensor(&x).matmul(&yb).sum(0);
        assert_close(
            &expected,
            &r.outputs[0],
            tolerance(),
            "matmul_RS_through_bcast",
        );
    }
}

#[test]
fn ag_linear_with_bias() {
    let f = cases::ag_linear_with_bias();
    for d in device_counts() {
        let x = Tensor::randn(&[2, d, 3, 6], test_dtype(), seed(d, 19));
        let w = Tensor::randn(&[4, 6], test_dtype(), seed(d, 20));
        let bias = Tensor::randn(&[4], test_dtype(), seed(d, 21));
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
        assert_close(&expected, &r.outputs[0], tolerance(), "AG_linear");
    }
}

// ---------------------------------------------------------------- P2P pipelines (seed 001)

#[test]
fn allgather_p2p() {
    let f = cases::allgather_p2p();
    for d in device_counts() {
        let x = Tensor::randn(&[d, 6], test_dtype(), seed(d, 22));
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
            tolerance(),
            "AllgatherP2p",
        );
    }
}

#[test]
fn ag_matmul_p2p_case() {
    // The suite's dtype, and bf16 besides (this case once ran only in f32 and bf16).
    let mut dtypes = vec![test_dtype()];
    if test_dtype() != DType::BF16 {
        dtypes.push(DType::BF16);
    }
    for dtype in dtypes {
        let f = cases::ag_matmul_p2p(dtype);
        for d in device_counts() {
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
                        IfThenElse,
                        AliasSelect,
                        Matmul,
                        SetCurrentStream,
                        Synchronize
                    ]
                );
                // The gathered chunks live in stream-buffer slots that only this loop
                // reads: the local chunk is used in place, without a copy.
                assert_eq!(local_chunk_branch(&r.program), [AliasSelect]);
            }
            let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance_for(dtype),
                "AG_matmul_P2p",
            );
        }
    }
}

// ---------------------------------------------------------------- preallocated outputs and aliases

#[test]
fn preallocated_outputs_are_written_in_place() {
    let f = cases::ag_matmul_p2p(test_dtype());
    for d in device_counts() {
        let world = world(d);
        let exec = fusion::FusionExecutor::new(f.clone());
        let x = Tensor::randn(&[d, 4, 8], test_dtype(), seed(d, 25));
        let y = Tensor::randn(&[8, 3], test_dtype(), seed(d, 26));
        let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
        let res = world
            .run(|rank| {
                let a = rank.shard(&x, 0)?;
                let b = rank.to_device(&y)?;
                let plain = exec.run_with(rank, &[&a, &b], None, &opts())?;
                // Poisoned: every element must be written.
                let out = rank.to_device(&Tensor::full(&[d, 4, 3], test_dtype(), f32::NAN))?;
                let pre = exec.run_with(rank, &[&a, &b], Some(&[&out]), &opts())?;
                assert!(
                    pre.outputs[0].shares_storage(&out),
                    "the output is the given buffer"
                );
                assert_eq!(pre.stats.allocations + 1, plain.stats.allocations);
                rank.to_host(&out)
            })
            .unwrap();
        for out in res {
            assert_close(&expected, &out, tolerance(), "preallocated output");
        }
    }
}

#[test]
fn outputs_alias_inputs_without_copies() {
    // An output that is a view of an input (a select) is returned as that view.
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let t0 = b.input("t0", test_dtype(), &a).unwrap();
    let one = b.constant(1);
    let row = b.select(t0, 0, one).unwrap();
    b.output(row).unwrap();
    let f = b.build().unwrap();
    // An in-place update: t0 += t1, written into t0's buffer.
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let u0 = b.input("t0", test_dtype(), &a).unwrap();
    let u1 = b.input("t1", test_dtype(), &a).unwrap();
    let sum = b.add(u0, u1).unwrap();
    let sum = b.output(sum).unwrap();
    b.alias_output_to_input(sum, u0).unwrap();
    let g = b.build().unwrap();
    for d in device_counts() {
        let world = world(d);
        let (ef, eg) = (
            fusion::FusionExecutor::new(f.clone()),
            fusion::FusionExecutor::new(g.clone()),
        );
        world
            .run(|rank| {
                let xh = Tensor::randn(&[3, 4], test_dtype(), seed(d, 27 + rank.index() as u64));
                let x = rank.to_device(&xh)?;
                let rep = ef.run_with(rank, &[&x], None, &opts())?;
                assert!(rep.outputs[0].shares_storage(&x));
                assert_eq!(rep.stats.allocations, 0);
                assert_eq!(
                    rank.to_host(&rep.outputs[0])?.to_f32_vec()?,
                    xh.select(0, 1)?.to_f32_vec()?
                );
                let yh = Tensor::randn(&[3, 4], test_dtype(), 99);
                let y = rank.to_device(&yh)?;
                let before =
                    RefArray::from_tensor(&xh).zip(&RefArray::from_tensor(&yh), |a, b| a + b);
                let rep = eg.run_with(rank, &[&x, &y], None, &opts())?;
                assert!(rep.outputs[0].shares_storage(&x));
                assert_eq!(rep.stats.allocations, 0);
                assert_close(&before, &rank.to_host(&x)?, tolerance(), "in-place update");
                Ok(())
            })
            .unwrap();
    }
}

// ---------------------------------------------------------------- reshardings without streams

const RESHARD_TOP: [NodeKind; 3] = [Allocate, Communication, Wait];

fn comm_kind(r: &Run) -> fusion::compiler::hir::CommunicationKind {
    r.program
        .body
        .iter()
        .find_map(|n| match n {
            fusion::compiler::hir::Node::Communication(c) => Some(c.kind),
            _ => None,
        })
        .expect("a communication")
}

#[test]
fn reshard_allgather_allreduce_reduce_scatter_scatter() {
    use fusion::compiler::hir::CommunicationKind as K;
    for d in device_counts().into_iter().filter(|&d| d > 1) {
        // Allgather
        let f = cases::reshard_allgather();
        let x = Tensor::randn(&[d, 5], test_dtype(), seed(d, 30));
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
        assert_close(
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            tolerance(),
            "Allgather",
        );

        // Allreduce
        let f = cases::reshard_allreduce();
        let x = Tensor::randn(&[d, 5], test_dtype(), seed(d, 31));
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
            tolerance(),
            "Allreduce",
        );

        // ReduceScatter
        let f = cases::reshard_reduce_scatter();
        let x = Tensor::randn(&[d, d, 3], test_dtype(), seed(d, 32));
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
            tolerance(),
            "ReduceScatter",
        );

        // Scatter (from device 0, the first of the input's mesh)
        let f = cases::reshard_scatter();
        let x = Tensor::randn(&[d, 4], test_dtype(), seed(d, 33));
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
        assert_close(
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            tolerance(),
            "Scatter",
        );
    }
}

#[test]
fn reshard_gather_broadcast_reduce_sendrecv() {
    use fusion::compiler::hir::CommunicationKind as K;
    for d in device_counts().into_iter().filter(|&d| d > 1) {
        let all: Vec<usize> = (0..d).collect();
        // Gather to device 0
        let f = cases::reshard_gather();
        let x = Tensor::randn(&[d, 5], test_dtype(), seed(d, 34));
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
        assert_close(
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            tolerance(),
            "Gather",
        );

        // Broadcast from the last device to all
        let f = cases::reshard_broadcast(d - 1);
        let x = Tensor::randn(&[3, 4], test_dtype(), seed(d, 35));
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
        assert_close(
            &RefArray::from_tensor(&x),
            &r.outputs[0],
            tolerance(),
            "Broadcast",
        );

        // Reduce to device 0
        let f = cases::reshard_reduce();
        let x = Tensor::randn(&[d, 6], test_dtype(), seed(d, 36));
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
            tolerance(),
            "Reduce",
        );

        // SendRecv: sharded on the first half of the devices -> sharded on the second half
        // (halves of one device are not sharded: that case is a Broadcast).
        if d % 2 == 0 && d >= 4 {
            let h = d / 2;
            let (m1, m2): (Vec<usize>, Vec<usize>) = (all[..h].to_vec(), all[h..].to_vec());
            let f = cases::reshard_send_recv(&m1, &m2);
            let x = Tensor::randn(&[h, 5], test_dtype(), seed(d, 37));
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
            assert_close(
                &RefArray::from_tensor(&x),
                &r.outputs[0],
                tolerance(),
                "SendRecv",
            );
        }
    }
}

// ---------------------------------------------------------------- P2P reduce-scatter, schedules, stream buffers

#[test]
fn matmul_rs_p2p_pipeline() {
    let f = cases::matmul_rs_p2p();
    // The direct pipeline (the default on other than 2 devices, see the next test).
    let direct = ExecOptions {
        lower: fusion::compiler::lower::LowerOptions {
            pipelines: fusion::PipelineOptions {
                reduce_scatter: fusion::compiler::lower::ReduceScatterPipeline::Direct,
                ..Default::default()
            },
            ..Default::default()
        },
        ..ExecOptions::default()
    };
    for d in device_counts() {
        let x = Tensor::randn(&[d, d, 3, 4], test_dtype(), seed(d, 40));
        let y = Tensor::randn(&[d, 4, 5], test_dtype(), seed(d, 41));
        let r = run(
            &f,
            d,
            &[(x.clone(), Give::Shard(0)), (y.clone(), Give::Shard(0))],
            &[Take::Sharded(0)],
            &direct,
        );
        if d > 1 {
            let main = main_loop_body(&r.program);
            assert_eq!(
                main,
                [
                    SetCurrentStream,
                    Synchronize,
                    AliasSelect,
                    AliasSelect,
                    AliasSelect,
                    Matmul,
                    SetCurrentStream,
                    Synchronize,
                    AliasSelect,
                    IfThenElse,
                    SetCurrentStream
                ]
            );
            let top = kinds(&r.program.body);
            assert!(
                top.contains(&Reduction),
                "the local sum follows the loop: {top:?}"
            );
            assert!(!top.contains(&Communication), "no collective: {top:?}");
        }
        let expected = RefArray::from_tensor(&x)
            .matmul(&RefArray::from_tensor(&y).unsqueeze(1))
            .sum(0);
        assert_close(&expected, &r.outputs[0], tolerance(), "matmul_RS_P2p");
    }
}

#[test]
fn seed_schedule_and_full_buffers_give_the_same_numbers() {
    let f = cases::ag_matmul_p2p(test_dtype());
    let seed_opts = ExecOptions {
        lower: fusion::compiler::lower::LowerOptions::plain(),
        ..ExecOptions::default()
    };
    for d in device_counts() {
        let x = Tensor::randn(&[d, 4, 8], test_dtype(), seed(d, 42));
        let y = Tensor::randn(&[8, 3], test_dtype(), seed(d, 43));
        let inputs = [(x.clone(), Give::Shard(0)), (y.clone(), Give::Whole)];
        let ring = run(&f, d, &inputs, &[Take::Replicated], &opts());
        let seeded = run(&f, d, &inputs, &[Take::Replicated], &seed_opts);
        let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
        assert_close(&expected, &ring.outputs[0], tolerance(), "ring schedule");
        assert_close(&expected, &seeded.outputs[0], tolerance(), "seed schedule");
    }
}

#[test]
fn stream_buffers_use_less_memory() {
    let f = cases::ag_matmul();
    let full = ExecOptions {
        number_of_streams: 2,
        lower: fusion::compiler::lower::LowerOptions {
            streams: fusion::StreamOptions {
                buffers: false,
                ..Default::default()
            },
            ..Default::default()
        },
        ..ExecOptions::default()
    };
    let slots = ExecOptions {
        number_of_streams: 2,
        ..ExecOptions::default()
    };
    for d in device_counts().into_iter().filter(|&d| d > 1) {
        let x = Tensor::randn(&[8, d, 2, 16], test_dtype(), seed(d, 44));
        let y = Tensor::randn(&[16, 4], test_dtype(), seed(d, 45));
        let inputs = [(x.clone(), Give::Shard(1)), (y.clone(), Give::Whole)];
        let a = run(&f, d, &inputs, &[Take::Replicated], &full);
        let b = run(&f, d, &inputs, &[Take::Replicated], &slots);
        assert!(
            b.stats[0].peak_live_bytes < a.stats[0].peak_live_bytes,
            "{} slots vs {} full",
            b.stats[0].peak_live_bytes,
            a.stats[0].peak_live_bytes
        );
        let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
        assert_close(
            &expected,
            &b.outputs[0],
            tolerance(),
            "AG_matmul with stream buffers",
        );
    }
}

#[test]
fn p2p_pipelines_over_nccl_and_the_copy_engine() {
    // Both P2P transports, named explicitly (the default is the copy engine): on GPUs the
    // NCCL one runs coalesced ncclSend/ncclRecv groups, the other peer copies; on the CPU
    // backend the in-process communicator carries both.
    use fusion::compiler::hir::Transport;
    let ag = cases::ag_matmul_p2p(test_dtype());
    let rs = cases::matmul_rs_p2p();
    for backend in [Transport::Nccl, Transport::CopyEngine] {
        let o = ExecOptions {
            lower: fusion::compiler::lower::LowerOptions {
                transports: fusion::TransportOptions {
                    p2p: backend,
                    ..Default::default()
                },
                ..Default::default()
            },
            ..ExecOptions::default()
        };
        let over = format!("over {}", backend.name());
        for d in device_counts() {
            let x = Tensor::randn(&[d, 4, 8], test_dtype(), seed(d, 46));
            let y = Tensor::randn(&[8, 3], test_dtype(), seed(d, 47));
            let r = run(
                &ag,
                d,
                &[(x.clone(), Give::Shard(0)), (y.clone(), Give::Whole)],
                &[Take::Replicated],
                &o,
            );
            if d > 1 {
                let text = r.program.to_string();
                assert!(
                    text.contains(&format!("backend={}", backend.name())),
                    "{text}"
                );
            }
            let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance(),
                &format!("AG_matmul_P2p {over}"),
            );
            let x = Tensor::randn(&[d, d, 3, 4], test_dtype(), seed(d, 48));
            let y = Tensor::randn(&[d, 4, 5], test_dtype(), seed(d, 49));
            let r = run(
                &rs,
                d,
                &[(x.clone(), Give::Shard(0)), (y.clone(), Give::Shard(0))],
                &[Take::Sharded(0)],
                &o,
            );
            let expected = RefArray::from_tensor(&x)
                .matmul(&RefArray::from_tensor(&y).unsqueeze(1))
                .sum(0);
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance(),
                &format!("matmul_RS_P2p {over}"),
            );
        }
    }
}

/// Runs `cases::matmul_rs_p2p()` on `d` devices with fresh `[d, d, rows, 4] x [d, 4, n]`
/// inputs (seeded by `salt`); returns the run and the f64 reference of the result.
fn run_matmul_rs(d: usize, rows: usize, n: usize, salt: u64, o: &ExecOptions) -> (Run, RefArray) {
    let x = Tensor::randn(&[d, d, rows, 4], test_dtype(), seed(d, salt));
    let y = Tensor::randn(&[d, 4, n], test_dtype(), seed(d, salt + 1));
    let r = run(
        &cases::matmul_rs_p2p(),
        d,
        &[(x.clone(), Give::Shard(0)), (y.clone(), Give::Shard(0))],
        &[Take::Sharded(0)],
        o,
    );
    let expected = RefArray::from_tensor(&x)
        .matmul(&RefArray::from_tensor(&y).unsqueeze(1))
        .sum(0);
    (r, expected)
}

#[test]
fn matmul_rs_p2p_subchunked_rounds() {
    // The direct pipeline in row ranges: `c` rounds over row ranges of every block, each
    // round summed inside the loop. Rows (5) that `c` does not divide give uneven ranges.
    for d in device_counts() {
        for (c, streams, compute_first) in [(2, 4, true), (3, 4, true), (2, 2, false)] {
            let o = ExecOptions {
                number_of_streams: streams,
                lower: fusion::compiler::lower::LowerOptions {
                    streams: fusion::StreamOptions {
                        compute_first,
                        ..Default::default()
                    },
                    pipelines: fusion::PipelineOptions {
                        reduce_scatter: fusion::compiler::lower::ReduceScatterPipeline::Direct,
                        reduce_scatter_subchunks: Some(c),
                        ..Default::default()
                    },
                    ..Default::default()
                },
                ..ExecOptions::default()
            };
            let (r, expected) = run_matmul_rs(d, 5, 3, 60 + c as u64, &o);
            let top = kinds(&r.program.body);
            assert!(
                !top.contains(&Reduction),
                "c = {c}: the sums run inside the loop: {top:?}"
            );
            let text = r.program.to_string();
            assert!(
                text.contains(&format!("{{( d * {c} )}}")),
                "c = {c}: the loop runs d * {c} iterations:\n{text}"
            );
            assert!(
                text.contains("slice"),
                "c = {c}: row ranges are views:\n{text}"
            );
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance(),
                &format!("matmul_RS_P2p in {c} rounds, {streams} streams"),
            );
        }
    }
}

#[test]
fn subchunked_reduce_scatter_uses_smaller_stream_buffers() {
    let with = |c: usize| ExecOptions {
        lower: fusion::compiler::lower::LowerOptions {
            pipelines: fusion::PipelineOptions {
                reduce_scatter: fusion::compiler::lower::ReduceScatterPipeline::Direct,
                reduce_scatter_subchunks: Some(c),
                ..Default::default()
            },
            ..Default::default()
        },
        ..ExecOptions::default()
    };
    for d in device_counts().into_iter().filter(|&d| d > 1) {
        // The same seed: the same inputs for both.
        let (whole, _) = run_matmul_rs(d, 8, 16, 70, &with(1));
        let (split, expected) = run_matmul_rs(d, 8, 16, 70, &with(4));
        assert!(
            split.stats[0].peak_live_bytes < whole.stats[0].peak_live_bytes,
            "{} in rounds vs {} whole",
            split.stats[0].peak_live_bytes,
            whole.stats[0].peak_live_bytes
        );
        assert_close(&expected, &split.outputs[0], tolerance(), "in 4 rounds");
    }
}

#[test]
fn matmul_rs_ring_pipeline_accumulates_in_the_gemm() {
    // The ring: each step's GEMM adds onto the running sum received from the next device
    // and passes it on; no sum kernel, the last GEMM finishes the sum that arrived into the
    // output block (`out = acc + a @ b`), so every transfer lands in the ring's own
    // buffer and none in the output. Also in
    // row ranges (5 rows in 2 and 3 ranges: uneven), and with fewer streams than needed
    // to keep every running sum's stream apart.
    // The GEMMs on the caller's stream, or taking turns on two compute streams; every call
    // checked for stream-order races.
    use fusion::compiler::lower::{LowerOptions, ReduceScatterPipeline};
    for d in device_counts() {
        for (c, streams, compute) in [
            (1, 4, 1),
            (2, 4, 1),
            (3, 4, 1),
            (2, 1, 1),
            (3, 2, 1),
            (1, 4, 2),
            (2, 4, 2),
            (3, 3, 2),
            (2, 1, 2),
        ] {
            let o = ExecOptions {
                number_of_streams: streams,
                lower: LowerOptions {
                    streams: fusion::StreamOptions {
                        ring_compute_streams: compute,
                        ..Default::default()
                    },
                    pipelines: fusion::PipelineOptions {
                        reduce_scatter: ReduceScatterPipeline::Ring,
                        reduce_scatter_subchunks: Some(c),
                        ..Default::default()
                    },
                    ..Default::default()
                },
                race_check: true,
                ..ExecOptions::default()
            };
            let (r, expected) = run_matmul_rs(d, 5, 3, 80 + c as u64, &o);
            let top = kinds(&r.program.body);
            assert!(!top.contains(&Reduction), "no sum kernel: {top:?}");
            let text = r.program.to_string();
            let sums = text
                .lines()
                .filter(|l| l.trim_start().starts_with("+ T"))
                .count();
            assert_eq!(
                sums, 2,
                "two accumulating matmuls (in place, and into the output):\n{text}"
            );
            let receives = fusion::runtime::eval::peer_copy_receives(&r.program);
            assert!(
                receives.external.is_empty() && receives.all_internal(),
                "{receives:?}"
            );
            assert!(!text.contains("reduction("), "no reduction kernel:\n{text}");
            assert_eq!(
                text.contains("ComputeStream"),
                compute == 2,
                "GEMMs on the compute streams only when asked for:\n{text}"
            );
            assert_close(
                &expected,
                &r.outputs[0],
                tolerance(),
                &format!(
                    "matmul_RS ring, {c} row ranges, {streams} streams, {compute} compute \
                     streams"
                ),
            );
        }
    }
}

#[test]
fn the_default_reduce_scatter_pipeline_is_the_ring_on_two_devices_only() {
    // Auto: the ring (2 row ranges, sums in the GEMM epilogue) on 2 devices, the direct
    // pipeline (one sum after the loop) on more.
    for d in device_counts().into_iter().filter(|&d| d > 1) {
        let (r, expected) = run_matmul_rs(d, 4, 3, 90, &opts());
        let text = r.program.to_string();
        let ring = text.lines().any(|l| l.trim_start().starts_with("+ T"));
        assert_eq!(ring, d == 2, "{d} devices:\n{text}");
        assert_eq!(
            kinds(&r.program.body).contains(&Reduction),
            d != 2,
            "{d} devices: a sum after the loop only in the direct pipeline"
        );
        assert_close(
            &expected,
            &r.outputs[0],
            tolerance(),
            "default matmul_RS_P2p",
        );
    }
}

// ---------------------------------------------------------------- launched worlds

/// The whole suite again with the ranks in separate processes (CPU backend, talking over
/// the TCP rendezvous), started with launcher variables as torchrun would: every case of
/// the launched size runs in each process, which checks every rank's part.
#[test]
fn the_suite_passes_with_ranks_in_2_3_and_4_processes() {
    if launched_size().is_some() {
        return; // a child: the suite's other tests are the work
    }
    for n in [2, 3, 4] {
        let ended = launch::launch(
            n,
            &(0..n).collect::<Vec<_>>(),
            &[
                "--test-threads=1",
                "--skip",
                "the_suite_passes_with_ranks_in",
            ],
            &[("FUSION_TIMEOUT", "30".to_string())],
            |_| Vec::new(),
            std::time::Duration::from_secs(240),
        );
        launch::expect_success(&ended);
        for e in &ended {
            assert!(
                e.stdout.contains("test result: ok") && !e.stdout.contains(" 0 passed"),
                "rank {} of {n} ran no tests:\n{}",
                e.rank,
                e.log()
            );
        }
    }
}
