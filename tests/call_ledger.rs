//! Ranks of an in-process world that make different communicating calls under the same call
//! number fail at once, naming both calls (the call ledger), and a thread that holds a rank
//! across several calls (`Rank::lock`) keeps other threads' calls out of its step. The same
//! across the processes of a launched world on one host (this binary's `child_*` functions
//! are its ranks).

mod common;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::launch::{child_args, expect_success, in_child, launch, world_or_exit};
use fusion::prelude::*;

fusion! {
    /// Every rank gets the sum of the ranks' rows.
    pub fn ledger_allreduce<d, n>(x: Tensor<f32, [d @ DIDx, n]>) -> Tensor<f32, [n]> {
        sum(x, 0)
    }
}

fusion! {
    /// Every rank gets every rank's row.
    pub fn ledger_allgather<d, n>(x: Tensor<f32, [d @ DIDx, n]>) -> Tensor<f32, [d, n]> {
        set(x)
    }
}

const N: usize = 4;

/// Long enough that only a hang reaches it.
const TIMEOUT: Duration = Duration::from_secs(30);

fn world() -> World {
    World::local(2).unwrap().with_timeout(TIMEOUT)
}

/// The full input of step `seed`: `[2, N]`, one row per rank.
fn input(seed: u64) -> Tensor {
    Tensor::randn(&[2, N], DType::F32, seed)
}

/// One step on `rank`: the Allreduce then the Allgather of `x`, each checked.
fn step(rank: &Rank, x: &Tensor) -> Result<()> {
    let mine: Ranked<2> = rank.shard(x, 0)?.try_into()?;
    let sum = ledger_allreduce(rank, &mine)?;
    let sum = rank.to_host(&sum)?.to_f32_vec()?;
    let all = ledger_allgather(rank, &mine)?;
    let all = rank.to_host(&all)?.to_f32_vec()?;
    let full = x.to_f32_vec()?;
    let want: Vec<f32> = (0..N).map(|j| full[j] + full[N + j]).collect();
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5);
    if !close(&sum, &want) || !close(&all, &full) {
        return Err(Error::World(format!(
            "rank {}: wrong outputs",
            rank.index()
        )));
    }
    Ok(())
}

/// Asserts that every call failed with an error naming both fusions, before any timeout.
fn assert_named_both(results: &[Result<()>], started: Instant) {
    assert!(
        started.elapsed() < TIMEOUT / 2,
        "the ranks waited for a timeout"
    );
    for (i, r) in results.iter().enumerate() {
        let text = match r {
            Ok(()) => panic!("call {i} did not fail"),
            Err(e) => e.to_string(),
        };
        assert!(
            text.contains("`ledger_allreduce`") && text.contains("`ledger_allgather`"),
            "call {i}: {text}"
        );
        assert!(text.contains("rank.lock()"), "call {i}: {text}");
    }
}

#[test]
fn ranks_calling_two_fusions_in_different_orders_fail_naming_both() {
    let world = world();
    let ranks = world.ranks().unwrap();
    let x = input(1);
    let started = Instant::now();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let threads: Vec<_> = ranks
            .iter()
            .map(|rank| {
                let x = &x;
                s.spawn(move || -> Result<()> {
                    let mine: Ranked<2> = rank.shard(x, 0)?.try_into()?;
                    if rank.index() == 0 {
                        ledger_allreduce(rank, &mine)?;
                        ledger_allgather(rank, &mine)?;
                    } else {
                        ledger_allgather(rank, &mine)?;
                        ledger_allreduce(rank, &mine)?;
                    }
                    Ok(())
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert_named_both(&results, started);
    assert!(world.failure().is_some());
}

/// A rank of a launched world of three: even ranks call the Allreduce first, odd ranks the
/// Allgather; every rank's error must name both fusions, before any timeout.
#[test]
#[ignore = "a rank process of `processes_calling_two_fusions_in_different_orders_fail_naming_both`"]
fn child_different_orders() {
    assert!(
        in_child(),
        "run by processes_calling_two_fusions_in_different_orders_fail_naming_both"
    );
    let world = world_or_exit();
    let rank = world.rank().unwrap();
    let x = Tensor::randn(&[world.size(), N], DType::F32, 1);
    let started = Instant::now();
    let result = (|| -> Result<()> {
        let mine: Ranked<2> = rank.shard(&x, 0)?.try_into()?;
        let sum = |rank: &Rank| -> Result<()> {
            let y = ledger_allreduce(rank, &mine)?;
            rank.to_host(&y).map(drop)
        };
        let all = |rank: &Rank| -> Result<()> {
            let y = ledger_allgather(rank, &mine)?;
            rank.to_host(&y).map(drop)
        };
        if rank.index() % 2 == 0 {
            sum(&rank)?;
            all(&rank)
        } else {
            all(&rank)?;
            sum(&rank)
        }
    })();
    assert_named_both(&[result], started);
    println!("LEDGER-OK rank {}", rank.index());
}

#[test]
fn processes_calling_two_fusions_in_different_orders_fail_naming_both() {
    if in_child() {
        return;
    }
    let ended = launch(
        3,
        &[0, 1, 2],
        &child_args("child_different_orders"),
        &[("FUSION_TIMEOUT", "30".into())],
        |_| Vec::new(),
        Duration::from_secs(120),
    );
    expect_success(&ended);
    for e in &ended {
        assert!(e.stdout.contains("LEDGER-OK"), "{}", e.log());
    }
}

/// Two application threads drive the same handles, each a step of two calls per rank;
/// the first pauses between its calls on rank 0, and the second starts its step once the
/// first's first call is done on every rank (on rank 1 a little later, so that there the
/// first's second call goes first). Returns each (thread, rank)'s result.
fn two_threads_over_the_same_handles(hold: bool) -> Vec<Result<()>> {
    let world = world();
    let ranks = world.ranks().unwrap();
    let (first, second) = (input(2), input(3));
    let started_first = Barrier::new(ranks.len() * 2);
    std::thread::scope(|s| {
        let mut threads = Vec::new();
        for rank in &ranks {
            let (x, started_first) = (&first, &started_first);
            threads.push(s.spawn(move || {
                let _step = hold.then(|| rank.lock());
                let mine: Ranked<2> = rank.shard(x, 0)?.try_into()?;
                let sum = ledger_allreduce(rank, &mine);
                started_first.wait();
                sum?;
                let pause = Duration::from_millis(if rank.index() == 0 { 300 } else { 0 });
                std::thread::sleep(pause);
                ledger_allgather(rank, &mine).map(drop)
            }));
        }
        for rank in &ranks {
            let (x, started_first) = (&second, &started_first);
            threads.push(s.spawn(move || {
                started_first.wait();
                std::thread::sleep(Duration::from_millis(100 * rank.index() as u64));
                let _step = hold.then(|| rank.lock());
                step(rank, x)
            }));
        }
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

#[test]
fn two_threads_whose_calls_interleave_differently_on_the_ranks_fail_naming_both() {
    let started = Instant::now();
    let results = two_threads_over_the_same_handles(false);
    // Rank 0 ran the second thread's Allreduce where rank 1 ran the first's Allgather.
    assert_named_both(&results, started);
}

#[test]
fn holding_the_ranks_across_a_step_keeps_the_other_thread_out() {
    let results = two_threads_over_the_same_handles(true);
    for (i, r) in results.iter().enumerate() {
        assert!(r.is_ok(), "thread {} rank {}: {r:?}", i / 2, i % 2);
    }
}

#[test]
fn ranks_making_the_same_calls_pass_the_ledger_past_its_ring() {
    let world = world();
    // More communicating calls than the ledger's ring holds, on both orders of the pair.
    let results = world
        .run(|rank| {
            for call in 0..600 {
                step(rank, &input(100 + call % 3))?;
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(results.len(), 2);
    assert!(world.failure().is_none());
}
