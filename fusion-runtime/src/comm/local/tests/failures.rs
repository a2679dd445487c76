//! Failures, timeouts and mismatches end every wait with an error, never a hang.

use fusion_compiler::hir::Transport;
use std::time::{Duration, Instant};

use fusion_compiler::hir::{Communication, CommunicationKind as K};
use fusion_compiler::ir::ReduceOp;
use fusion_compiler::DType;

use super::{comm, input, run_world, world, LONG, SHORT};
use crate::comm::Communicator;
use crate::error::Error;
use crate::tensor::Tensor;

fn allreduce(n: usize) -> Communication {
    Communication {
        in_sharded_axis: Some(0),
        reduce_op: Some(ReduceOp::Sum),
        ..comm(K::Allreduce, &world(n), &world(n))
    }
}

#[test]
fn a_failed_rank_releases_every_waiter_quickly() {
    let c = allreduce(3);
    let start = Instant::now();
    let (fabric, outs) = run_world(3, LONG, |cm| match cm.rank() {
        0 => {
            std::thread::sleep(Duration::from_millis(100));
            cm.abort("boom");
            vec![]
        }
        1 => {
            let y = Tensor::zeros(&[2], DType::F32);
            let first = cm.collective(0, &c, Some(&Tensor::zeros(&[1, 2], DType::F32)), Some(&y));
            // Later waits fail at once too.
            let later = cm.recv(0, 2, &y, Transport::Nccl);
            vec![first, later]
        }
        _ => vec![cm.recv(0, 0, &Tensor::zeros(&[2], DType::F32), Transport::Nccl)],
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    for res in outs[1].iter().chain(&outs[2]) {
        match res {
            Err(Error::PeerFailed {
                failed_rank: 0,
                reason,
                ..
            }) => assert_eq!(reason, "boom"),
            other => panic!("expected PeerFailed, got {other:?}"),
        }
    }
    assert_eq!(fabric.failure(), Some((0, "boom".to_string())));
}

#[test]
fn a_missing_rank_times_out() {
    let c = allreduce(2);
    let start = Instant::now();
    let (_, outs) = run_world(2, Duration::from_millis(200), |cm| {
        if cm.rank() == 1 {
            return vec![];
        }
        let y = Tensor::zeros(&[2], DType::F32);
        vec![
            cm.collective(0, &c, Some(&Tensor::zeros(&[1, 2], DType::F32)), Some(&y)),
            cm.recv(0, 1, &y, Transport::Nccl),
        ]
    });
    let elapsed = start.elapsed();
    assert!(
        elapsed >= Duration::from_millis(400) && elapsed < Duration::from_secs(5),
        "{elapsed:?}"
    );
    match &outs[0][0] {
        Err(Error::Timeout { rank: 0, what, .. }) => {
            assert!(
                what.contains("Allreduce") && what.contains("[0, 1]") && what.contains("ranks [1]"),
                "{what}"
            )
        }
        other => panic!("expected Timeout, got {other:?}"),
    }
    match &outs[0][1] {
        Err(Error::Timeout { what, .. }) => assert!(what.contains("recv from rank 1"), "{what}"),
        other => panic!("expected Timeout, got {other:?}"),
    }
}

#[test]
fn a_wrong_output_shape_fails_only_that_rank() {
    let c = Communication {
        in_sharded_axis: Some(0),
        out_sharded_axis: Some(0),
        ..comm(K::Allgather, &world(2), &world(2))
    };
    let (_, outs) = run_world(2, SHORT, |cm| {
        let shape: &[usize] = if cm.rank() == 1 { &[3, 3] } else { &[2, 3] };
        let y = Tensor::zeros(shape, DType::F32);
        cm.collective(0, &c, Some(&input(30, cm.rank(), &[1, 3])), Some(&y))
    });
    assert!(outs[0].is_ok(), "{:?}", outs[0]);
    match &outs[1] {
        Err(e @ Error::Communication { rank: 1, .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("Allgather") && msg.contains("[3, 3]") && msg.contains("[2, 3]"),
                "{msg}"
            );
        }
        other => panic!("expected a Communication error, got {other:?}"),
    }
}

/// Runs `c` on a world of `n` where `input_of(rank)` is each rank's input; every rank
/// must fail with a Communication error mentioning `needle`.
fn all_fail(
    n: usize,
    c: &Communication,
    input_of: impl Fn(usize) -> Option<Tensor> + Sync,
    needle: &str,
) {
    let (_, outs) = run_world(n, SHORT, |cm| {
        let y = Tensor::zeros(&[4], DType::F32);
        cm.collective(0, c, input_of(cm.rank()).as_ref(), Some(&y))
    });
    for (r, res) in outs.iter().enumerate() {
        match res {
            Err(e @ Error::Communication { .. }) => {
                assert!(e.to_string().contains(needle), "rank {r}: {e}")
            }
            other => panic!("rank {r}: expected a Communication error, got {other:?}"),
        }
    }
}

#[test]
fn mismatched_or_bad_inputs_fail_every_rank() {
    let c = allreduce(3);
    let shape = |r: usize| if r == 2 { vec![1, 5] } else { vec![1, 4] };
    all_fail(
        3,
        &c,
        |r| Some(Tensor::zeros(&shape(r), DType::F32)),
        "rank 2's input has shape [1, 5]",
    );
    let shape = |r: usize| if r == 1 { vec![2, 4] } else { vec![1, 4] };
    all_fail(
        3,
        &c,
        |r| Some(Tensor::zeros(&shape(r), DType::F32)),
        "size 1 at its sharded axis 0",
    );
    all_fail(
        3,
        &c,
        |r| (r != 0).then(|| Tensor::zeros(&[1, 4], DType::F32)),
        "rank 0 could not take part",
    );
}

#[test]
fn ranks_calling_different_collectives_all_fail() {
    let reduce = allreduce(2);
    let gather = Communication {
        in_sharded_axis: Some(0),
        out_sharded_axis: Some(0),
        ..comm(K::Allgather, &world(2), &world(2))
    };
    let (_, outs) = run_world(2, SHORT, |cm| {
        let (c, y) = if cm.rank() == 0 {
            (&reduce, Tensor::zeros(&[4], DType::F32))
        } else {
            (&gather, Tensor::zeros(&[2, 4], DType::F32))
        };
        cm.collective(0, c, Some(&Tensor::zeros(&[1, 4], DType::F32)), Some(&y))
    });
    for res in &outs {
        assert!(
            matches!(res, Err(e @ Error::Communication { .. }) if e.to_string().contains("disagree")),
            "{res:?}"
        );
    }
}

#[test]
fn a_rank_outside_the_team_or_world_is_refused() {
    let c = allreduce(2);
    let (_, outs) = run_world(3, SHORT, |cm| {
        if cm.rank() == 2 {
            let y = Tensor::zeros(&[4], DType::F32);
            return cm
                .collective(0, &c, Some(&Tensor::zeros(&[1, 4], DType::F32)), Some(&y))
                .is_err();
        }
        true
    });
    assert!(outs[2]);
    let fabric = crate::comm::local::LocalFabric::new(2, SHORT);
    let stray = fabric.communicator(5);
    assert!(stray
        .send(0, 0, &Tensor::zeros(&[1], DType::F32), Transport::Nccl)
        .is_err());
}
