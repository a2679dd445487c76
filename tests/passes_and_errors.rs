//! Pass framework, lowering cache, and errors (build time, lowering time, call time).

mod common;

use std::time::{Duration, Instant};

use common::*;
use fusion::compiler::builder::{Axis, FusionBuilder};
use fusion::compiler::hir::{for_each_node, Node, NodeKind};
use fusion::compiler::ir::{Fusion, ParallelType};
use fusion::compiler::lower::{lower, LowerOptions};
use fusion::{DType, Error, ExecOptions, FusionExecutor, Tensor};

const F32: DType = DType::F32;

fn sym_axes(b: &mut FusionBuilder, spec: &[(&str, ParallelType)]) -> Vec<Axis> {
    spec.iter()
        .map(|&(s, p)| Axis {
            extent: b.symbol(s),
            parallel: p,
        })
        .collect()
}

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

fn ag_matmul_p2p() -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = sym_axes(&mut b, &[("d", Dx), ("m", S), ("k", S)]);
    let tb = sym_axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("a", F32, &ta).unwrap();
    let w = b.input("b", F32, &tb).unwrap();
    let c = b.matmul(x, w).unwrap();
    let o = sym_axes(&mut b, &[("d", St), ("m", S), ("n", S)]);
    let c = b.declare(c, F32, &o).unwrap();
    b.output(c).unwrap();
    b.build().unwrap()
}

fn ag_matmul_collective() -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = sym_axes(&mut b, &[("s", S), ("d", Dx), ("m", S), ("k", S)]);
    let tb = sym_axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("a", F32, &ta).unwrap();
    let w = b.input("b", F32, &tb).unwrap();
    let c = b.matmul(x, w).unwrap();
    let o = sym_axes(&mut b, &[("s", St), ("d", S), ("m", S), ("n", S)]);
    let c = b.declare(c, F32, &o).unwrap();
    b.output(c).unwrap();
    b.build().unwrap()
}

fn has_for_loop(nodes: &[Node]) -> bool {
    let mut found = false;
    for_each_node(nodes, &mut |n| found |= n.kind() == NodeKind::ForLoop);
    found
}

#[test]
fn disabling_stream_parallel_type_gives_the_non_overlapped_program_and_the_same_numbers() {
    let no_streams = ExecOptions {
        lower: LowerOptions::default().without_pass("StreamParallelType"),
        ..ExecOptions::default()
    };
    for d in device_counts() {
        // P2P pipeline without streams: one allgather, then one matmul.
        let x = Tensor::randn(&[d, 3, 4], F32, 40 + d as u64);
        let y = Tensor::randn(&[4, 5], F32, 41);
        let inputs = [(x.clone(), Give::Shard(0)), (y.clone(), Give::Whole)];
        let f = ag_matmul_p2p();
        let with = run(&f, d, &inputs, &[Take::Replicated], &ExecOptions::default());
        let without = run(&f, d, &inputs, &[Take::Replicated], &no_streams);
        assert!(d == 1 || has_for_loop(&with.program.body));
        assert!(!has_for_loop(&without.program.body));
        let expected_top: Vec<NodeKind> = if d > 1 {
            vec![
                NodeKind::Allocate,
                NodeKind::Communication,
                NodeKind::Wait,
                NodeKind::Matmul,
                NodeKind::Deallocate,
            ]
        } else {
            vec![NodeKind::Matmul]
        };
        assert_eq!(kinds(&without.program.body), expected_top);
        // Bit-equal on the CPU; the GPU may pick other GEMM algorithms per shape.
        assert_close(
            &RefArray::from_tensor(&without.outputs[0]),
            &with.outputs[0],
            1e-6,
            "same numbers with and without stream lowering",
        );
        // Collective pipeline without streams.
        let x = Tensor::randn(&[2, d, 3, 4], F32, 42 + d as u64);
        let inputs = [(x, Give::Shard(1)), (y.clone(), Give::Whole)];
        let f = ag_matmul_collective();
        let with = run(&f, d, &inputs, &[Take::Replicated], &ExecOptions::default());
        let without = run(&f, d, &inputs, &[Take::Replicated], &no_streams);
        assert!(!has_for_loop(&without.program.body));
        assert_eq!(
            with.outputs[0].to_f32_vec().unwrap(),
            without.outputs[0].to_f32_vec().unwrap()
        );
    }
}

/// relu -> neg -> exp -> tanh -> sigmoid: one buffer each (with fusion disabled).
fn chain() -> Fusion {
    use fusion::compiler::ir::UnaryOp::*;
    let mut b = FusionBuilder::new();
    let a = sym_axes(&mut b, &[("m", S), ("n", S)]);
    let x = b.input("x", F32, &a).unwrap();
    let mut t = x;
    for op in [Relu, Neg, Exp, Tanh, Sigmoid] {
        t = b.unary(op, t).unwrap();
    }
    b.output(t).unwrap();
    b.build().unwrap()
}

#[test]
fn insert_deallocations_lowers_peak_memory_and_never_frees_outputs() {
    let f = chain();
    let unfused = LowerOptions::default().without_pass("FuseElementwise");
    let no_dealloc = ExecOptions {
        lower: unfused.clone().without_pass("InsertDeallocations"),
        ..ExecOptions::default()
    };
    let dealloc = ExecOptions {
        lower: unfused,
        ..ExecOptions::default()
    };
    for d in device_counts() {
        let x = Tensor::randn(&[64, 32], F32, 50 + d as u64);
        let with = run(
            &f,
            d,
            &[(x.clone(), Give::Whole)],
            &[Take::Replicated],
            &dealloc,
        );
        let without = run(
            &f,
            d,
            &[(x.clone(), Give::Whole)],
            &[Take::Replicated],
            &no_dealloc,
        );
        let (pw, pwo) = (
            with.stats[0].peak_live_bytes,
            without.stats[0].peak_live_bytes,
        );
        assert!(
            pw < pwo,
            "peak with deallocations {pw} must be below {pwo} without"
        );
        assert_eq!(
            with.stats[0].allocated_bytes,
            without.stats[0].allocated_bytes
        );
        assert_eq!(
            with.outputs[0].to_f32_vec().unwrap(),
            without.outputs[0].to_f32_vec().unwrap()
        );
        let p = &with.program;
        let mut freed = Vec::new();
        for_each_node(&p.body, &mut |n| {
            if let Node::Deallocate { tensor } = n {
                freed.push(*tensor);
            }
        });
        assert!(!freed.is_empty());
        for t in freed {
            assert!(
                !p.outputs.contains(&t) && !p.inputs.contains(&t),
                "never frees inputs or outputs"
            );
        }
        let expected = RefArray::from_tensor(&x).map(|v| {
            let v = -(v.max(0.0));
            let v = v.exp().tanh();
            1.0 / (1.0 + (-v).exp())
        });
        assert_close(&expected, &with.outputs[0], 1e-5, "chain");
    }
}

#[test]
fn the_second_call_with_the_same_shapes_does_not_lower_again() {
    let f = ag_matmul_p2p();
    for d in [2, 4].into_iter().filter(|&d| runnable(d)) {
        let world = world(d);
        let exec = FusionExecutor::new(f.clone());
        // The default plan, fixed: on GPUs a call with the plan left open lowers every
        // candidate of the plan space at its first call of a shape (tests/plan_choice.rs).
        let fixed = fusion::ExecOptions {
            plan: fusion::PlanMode::Default,
            ..Default::default()
        };
        world
            .run(|rank| {
                let y = Tensor::randn(&[4, 5], F32, 1);
                let x = Tensor::randn(&[d, 3, 4], F32, 2);
                let a = rank.shard(&x, 0)?;
                exec.run_with(rank, &[&a, &y], None, &fixed)?;
                exec.run_with(rank, &[&a, &y], None, &fixed)?;
                Ok(())
            })
            .unwrap();
        assert_eq!(
            exec.lowering_count(),
            1,
            "lowered once for all ranks and both calls"
        );
        world
            .run(|rank| {
                let y = Tensor::randn(&[4, 7], F32, 1);
                let x = Tensor::randn(&[d, 6, 4], F32, 2);
                exec.run_with(rank, &[&rank.shard(&x, 0)?, &y], None, &fixed)?;
                Ok(())
            })
            .unwrap();
        assert_eq!(exec.lowering_count(), 2, "new shapes lower again");
    }
}

// ---------------------------------------------------------------- call-time errors

fn call_error(
    d: usize,
    make: impl Fn(&fusion::Rank) -> fusion::Result<Vec<Tensor>> + Sync,
) -> Error {
    let world = world(d);
    let exec = FusionExecutor::new(ag_matmul_p2p());
    let start = Instant::now();
    let err = world
        .run(|rank| {
            let inputs = make(rank)?;
            let refs: Vec<&Tensor> = inputs.iter().collect();
            exec.run(rank, &refs)
        })
        .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "errors come back without waiting for timeouts"
    );
    err
}

#[test]
fn bad_inputs_name_the_tensor_and_axis() {
    let d = 4;
    if !runnable(d) {
        return;
    }
    let x = Tensor::randn(&[d, 3, 4], F32, 60);
    let y = Tensor::randn(&[4, 5], F32, 61);
    // wrong extent of `b` axis 0 (k = 4 from `a`)
    let err = call_error(d, |r| {
        Ok(vec![r.shard(&x, 0)?, Tensor::randn(&[6, 5], F32, 1)])
    });
    assert!(
        matches!(&err, Error::BadTensor { tensor, axis: Some(0), .. } if tensor == "b"),
        "{err}"
    );
    assert!(err.to_string().contains("k"), "{err}");
    // wrong dtype
    let err = call_error(d, |r| {
        Ok(vec![
            r.shard(&x, 0)?,
            Tensor::randn(&[4, 5], DType::BF16, 1),
        ])
    });
    assert!(
        matches!(&err, Error::BadTensor { tensor, axis: None, .. } if tensor == "b"),
        "{err}"
    );
    assert!(err.to_string().contains("bf16"), "{err}");
    // wrong rank
    let err = call_error(d, |r| {
        Ok(vec![r.shard(&x, 0)?, Tensor::randn(&[4, 5, 1], F32, 1)])
    });
    assert!(err.to_string().contains("rank"), "{err}");
    // the full tensor instead of this rank's shard
    let err = call_error(d, |_| Ok(vec![x.clone(), y.clone()]));
    assert!(
        matches!(&err, Error::BadTensor { tensor, axis: Some(0), .. } if tensor == "a"),
        "{err}"
    );
    // another rank's shard
    let err = call_error(d, |r| {
        let wrong = x.shard(0, (r.index() + 1) % d, d)?;
        Ok(vec![wrong, y.clone()])
    });
    assert!(
        matches!(&err, Error::BadTensor { tensor, axis: Some(0), .. } if tensor == "a"),
        "{err}"
    );
    assert!(err.to_string().contains("shard"), "{err}");
    // wrong number of inputs
    let err = call_error(d, |r| Ok(vec![r.shard(&x, 0)?]));
    assert!(
        matches!(
            err,
            Error::Arity {
                expected: 2,
                actual: 1,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_world_size_that_does_not_divide_a_sharded_extent_is_an_error() {
    if !runnable(4) {
        return;
    }
    let world = world(4);
    let full = Tensor::randn(&[10, 3], F32, 62);
    let err = world.run(|rank| rank.shard_split(&full, 0)).unwrap_err();
    assert!(
        matches!(&err, Error::BadTensor { axis: Some(0), .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("not divisible by the world size 4"),
        "{err}"
    );
}

#[test]
fn an_error_on_one_rank_makes_the_others_return_instead_of_waiting() {
    let d = 4;
    if !runnable(d) {
        return;
    }
    let x = Tensor::randn(&[d, 3, 4], F32, 63);
    let y = Tensor::randn(&[4, 5], F32, 64);
    // Rank 2 passes a bad `b`; the other ranks enter the P2P pipeline and would wait for it.
    let err = call_error(d, |r| {
        let b = if r.index() == 2 {
            Tensor::randn(&[9, 5], F32, 1)
        } else {
            y.clone()
        };
        Ok(vec![r.shard(&x, 0)?, b])
    });
    assert!(
        matches!(&err, Error::BadTensor { tensor, .. } if tensor == "b"),
        "the root cause is returned: {err}"
    );
}

#[test]
fn a_panicking_rank_is_reported_and_does_not_hang_the_others() {
    let d = 3;
    if !runnable(d) {
        return;
    }
    let world = world(d);
    let exec = FusionExecutor::new(ag_matmul_p2p());
    let x = Tensor::randn(&[d, 3, 4], F32, 65);
    let y = Tensor::randn(&[4, 5], F32, 66);
    let start = Instant::now();
    let err = world
        .run(|rank| {
            if rank.index() == 1 {
                panic!("user code failed");
            }
            exec.run(rank, &[&rank.shard(&x, 0)?, &y])
        })
        .unwrap_err();
    assert!(
        matches!(&err, Error::Panic { rank: 1, message } if message.contains("user code failed")),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn wrong_preallocated_output_is_an_error() {
    let d = 2;
    if !runnable(d) {
        return;
    }
    let world = world(d);
    let exec = FusionExecutor::new(ag_matmul_p2p());
    let x = Tensor::randn(&[d, 3, 4], F32, 67);
    let y = Tensor::randn(&[4, 5], F32, 68);
    let err = world
        .run(|rank| {
            let out = Tensor::zeros(&[d, 3, 6], F32);
            exec.run_into(rank, &[&rank.shard(&x, 0)?, &y], &[&out])
        })
        .unwrap_err();
    assert!(err.to_string().contains("preallocated output"), "{err}");
}

#[test]
fn a_result_sharded_over_an_extent_other_than_the_mesh_size_is_a_sharding_error() {
    // `x [m, n]` copied into `y [m @ DIDx, n]`: the inputs bind m = 3, but a DIDx axis
    // spans the mesh (1 or 2 devices here). Found by the property tests: this used to
    // fail inside a copy kernel at run time.
    let mut b = FusionBuilder::new();
    let a = sym_axes(&mut b, &[("m", S), ("n", S)]);
    let x = b.input("x", F32, &a).unwrap();
    let y = b.set(x).unwrap();
    let o = sym_axes(&mut b, &[("m", Dx), ("n", S)]);
    let y = b.declare(y, F32, &o).unwrap();
    b.name(y, "y");
    b.output(y).unwrap();
    let f = b.build().unwrap();
    for d in [1, 2].into_iter().filter(|&d| runnable(d)) {
        let x = Tensor::randn(&[3, 4], F32, 69);
        let err = try_run(
            &f,
            d,
            &[(x, Give::Whole)],
            &[Take::Sharded(0)],
            &ExecOptions::default(),
        )
        .err()
        .expect("an error");
        match &err {
            Error::Core(fusion::compiler::Error::Parallelization {
                tensor,
                axis,
                reason,
                ..
            }) => {
                assert_eq!((tensor.as_str(), *axis), ("y", Some(0)), "{err}");
                assert!(reason.contains(&format!("over {d} devices")), "{err}");
                assert!(reason.contains("m is 3"), "{err}");
            }
            _ => panic!("{err}"),
        }
    }
}

#[test]
fn a_didx_to_stream_pipeline_that_also_shards_another_axis_is_a_resharding_error() {
    // `x [d, d @ DIDx]` copied into `y [d @ DIDx, d @ Stream]`: the DIDx axis becomes the
    // Stream axis (the P2P pipeline) while the other axis becomes sharded: two shardings
    // change at once. Found by the property tests: this used to lower, then fail in a
    // receive of the wrong size.
    let mut b = FusionBuilder::new();
    let a = sym_axes(&mut b, &[("d", S), ("d", Dx)]);
    let x = b.input("x", F32, &a).unwrap();
    let y = b.set(x).unwrap();
    let o = sym_axes(&mut b, &[("d", Dx), ("d", St)]);
    let y = b.declare(y, F32, &o).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    for d in [2, 3].into_iter().filter(|&d| runnable(d)) {
        let x = Tensor::randn(&[d, d], F32, 70);
        let err = try_run(
            &f,
            d,
            &[(x, Give::Shard(1))],
            &[Take::Sharded(0)],
            &ExecOptions::default(),
        )
        .err()
        .expect("an error");
        assert!(
            matches!(&err, Error::Core(fusion::compiler::Error::Resharding { reason, .. })
                if reason.contains("two shardings")),
            "{err}"
        );
    }
}

/// In launched GPU worlds the buffers peers write into come from memory they can map: the
/// evaluator finds them through views (a running sum's slot, its row range) and inside
/// branches (the ring's exchange runs in the `else` of its last-step test).
#[test]
fn copy_engine_receive_buffers_are_found_through_views_and_branches() {
    use fusion::runtime::eval::received_by_peer_copies;
    let f = cases::matmul_rs_p2p();
    for d in [2, 3] {
        let options = LowerOptions::default();
        let p = lower(&f, d, &options).unwrap().program;
        let roots = received_by_peer_copies(&p);
        // The ring (the default on 2 devices) receives every step into its running sums,
        // never into the output (its last GEMM finishes the last sum there).
        if d == 2 {
            assert!(
                !roots.contains(&p.outputs[0]),
                "the output never receives: {p}"
            );
            assert_eq!(roots.len(), 1, "the running sums receive: {roots:?}\n{p}");
        }
        // Every root is allocated by the program (never an input, never a view).
        for r in &roots {
            assert!(!p.inputs.contains(r), "an input is not a receive buffer");
        }
        let mut allocated = std::collections::HashSet::new();
        for_each_node(&p.body, &mut |n| {
            if let Node::Allocate { tensor } = n {
                allocated.insert(*tensor);
            }
        });
        assert!(
            roots.iter().all(|r| allocated.contains(r)),
            "roots {roots:?} are allocations"
        );
        assert!(!roots.is_empty(), "the pipeline receives on {d} devices");
    }
    // Over NCCL nothing needs shared memory.
    let options = LowerOptions {
        transports: fusion::TransportOptions {
            p2p: fusion::compiler::hir::Transport::Nccl,
            ..Default::default()
        },
        ..LowerOptions::default()
    };
    let p = lower(&f, 2, &options).unwrap().program;
    assert!(received_by_peer_copies(&p).is_empty());
}
