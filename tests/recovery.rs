//! A world that survives a bad input and handles driven from two threads at once, on
//! simulated devices: an error on one rank ends every peer's call at once; a call refused
//! before any data moves leaves the world healthy; a failed world recovers in place
//! (`World::recover`) and runs on with the same handles and weights; forwards held with
//! numbered steps (`Rank::lock_step`) run in the same order on every rank. The same in a
//! launched world of three processes (this binary's `child_*` functions are its ranks).

mod common;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::handles::{input, reference, row_parallel, weights, K, M};
use common::launch::{child_args, expect_success, in_child, launch, world_or_exit};
use fusion::prelude::*;

fusion! {
    /// Every rank gets every rank's block.
    pub fn gather_blocks<d, m, k>(x: Tensor<f32, [d @ DIDx, m, k]>) -> Tensor<f32, [d, m, k]> {
        set(x)
    }
}

/// Long enough that only a hang reaches it.
const TIMEOUT: Duration = Duration::from_secs(30);

/// How soon every rank must have its error once one rank failed.
const AT_ONCE: Duration = Duration::from_secs(1);

/// One rank's weights, kept across every call of a test (as a layer keeps them).
struct Weights {
    full: Tensor,
    mine: Ranked<3>,
}

impl Weights {
    fn new(rank: &Rank) -> Result<Weights> {
        let full = weights(rank.world_size());
        let mine = rank.shard(&full, 0)?.try_into()?;
        Ok(Weights { full, mine })
    }
}

/// The forward of step `step` on `rank`: a row-parallel product (an Allreduce) and an
/// Allgather of the input blocks, both checked against the host; a wrong value is an
/// error naming the step.
fn forward(rank: &Rank, w: &Weights, step: u64) -> Result<()> {
    let x = input(rank.world_size(), step as usize);
    let mine: Ranked<3> = rank.shard(&x, 0)?.try_into()?;
    let y = row_parallel(rank, &mine, &w.mine)?;
    let all = gather_blocks(rank, &mine)?;
    let (y, all) = (rank.to_host(&y)?.to_f32_vec()?, rank.to_host(&all)?);
    let want = reference(&x, &w.full);
    let close = |g: f32, e: f64| (g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs());
    let right_y = y.iter().zip(&want).all(|(g, e)| close(*g, *e));
    let right_all = all.to_f32_vec()? == x.to_f32_vec()?;
    if !(right_y && right_all) {
        return Err(Error::World(format!(
            "WRONG VALUE: rank {} step {step}",
            rank.index()
        )));
    }
    Ok(())
}

/// Makes a world of so many devices (simulated, or GPUs).
type Maker = fn(usize) -> World;

/// A world of `d` simulated devices.
fn simulated(d: usize) -> World {
    World::local(d).unwrap()
}

/// A world of `d` GPUs of this process (the GPU variants need that many).
fn gpus(d: usize) -> World {
    let visible = fusion::runtime::backend::cuda::device_count();
    assert!(
        visible >= d,
        "this test needs {d} CUDA GPUs, {visible} visible"
    );
    fusion::runtime::backend::cuda::cuda_world(Some(d)).unwrap()
}

/// A world of `d` simulated devices with the test timeout, its handles and weights.
fn world(d: usize) -> (World, Vec<Rank>, Vec<Weights>) {
    world_on(simulated, d)
}

/// A world from `make` of `d` devices with the test timeout, its handles and weights.
fn world_on(make: Maker, d: usize) -> (World, Vec<Rank>, Vec<Weights>) {
    let world = make(d).with_timeout(TIMEOUT);
    let ranks = world.ranks().unwrap();
    let weights = ranks.iter().map(|r| Weights::new(r).unwrap()).collect();
    (world, ranks, weights)
}

/// `calls` checked forwards on every rank, each rank from its own thread.
fn run_forwards(ranks: &[Rank], weights: &[Weights], first: u64, calls: u64) {
    std::thread::scope(|s| {
        for (rank, w) in ranks.iter().zip(weights) {
            s.spawn(move || {
                for step in first..first + calls {
                    forward(rank, w, step).unwrap();
                }
            });
        }
    });
}

#[test]
fn two_threads_on_one_handle_holding_numbered_steps_are_always_right() {
    two_threads_on_each_handle(simulated);
}

#[test]
#[ignore = "needs 4 CUDA GPUs; run with --ignored on a GPU machine"]
fn on_gpus_two_threads_on_one_handle_holding_numbered_steps_are_always_right() {
    two_threads_on_each_handle(gpus);
}

/// Two threads drive each handle of worlds of 2 and 4 devices through 1,000 numbered
/// steps of a two-fusion forward; every value is checked.
fn two_threads_on_each_handle(make: Maker) {
    for d in [2, 4] {
        let (_world, ranks, weights) = world_on(make, d);
        std::thread::scope(|s| {
            for (rank, w) in ranks.iter().zip(&weights) {
                s.spawn(move || two_threads_on_one_handle(rank, w, 1000));
            }
        });
    }
}

/// Two threads drive `rank` through `steps` numbered steps: one takes the even steps,
/// one the odd.
fn two_threads_on_one_handle(rank: &Rank, w: &Weights, steps: u64) {
    std::thread::scope(|s| {
        for parity in 0..2 {
            s.spawn(move || {
                for step in (parity..steps).step_by(2) {
                    let _step = rank.lock_step(step).unwrap();
                    forward(rank, w, step).unwrap();
                }
            });
        }
    });
}

/// A rank of a launched world whose handle two threads drive through 1,000 numbered
/// steps.
#[test]
#[ignore = "a rank process of `a_launched_world_of_three_driven_from_two_threads_per_rank_is_right`"]
fn child_two_threads() {
    assert!(
        in_child(),
        "run by a_launched_world_of_three_driven_from_two_threads_per_rank_is_right"
    );
    let world = world_or_exit();
    let rank = world.rank().unwrap();
    let w = Weights::new(&rank).unwrap();
    let started = Instant::now();
    two_threads_on_one_handle(&rank, &w, 1000);
    let took = started.elapsed();
    let token = Tensor::zeros(&[1], DType::F32);
    world.run(|rank| rank.gather_to_host(&token)).unwrap();
    println!(
        "TWO-THREADS-OK rank {}: 1000 steps in {took:?}",
        rank.index()
    );
}

#[test]
fn a_launched_world_of_three_driven_from_two_threads_per_rank_is_right() {
    if in_child() {
        return;
    }
    let ended = launch(
        3,
        &[0, 1, 2],
        &child_args("child_two_threads"),
        &[("FUSION_TIMEOUT", "30".into())],
        |_| Vec::new(),
        Duration::from_secs(120),
    );
    expect_success(&ended);
    for e in &ended {
        assert!(e.stdout.contains("TWO-THREADS-OK"), "{}", e.log());
    }
}

#[test]
fn a_step_is_held_once() {
    let (_world, ranks, _) = world(1);
    drop(ranks[0].lock_step(0).unwrap());
    let err = ranks[0].lock_step(0).unwrap_err().to_string();
    assert!(err.contains("step 0 was held already"), "{err}");
}

/// What one rank's call of a bad-input test ended with, and when.
struct Ended {
    result: Result<()>,
    at: Instant,
}

/// The row-parallel product of `x`, read back to the host: on a GPU the call only
/// enqueues its work, and the error of a failed world comes with the wait for the result.
fn row_parallel_read(rank: &Rank, x: &Ranked<3>, w: &Weights) -> Result<()> {
    let y = row_parallel(rank, x, &w.mine)?;
    rank.to_host(&y).map(|_| ())
}

/// Rank `bad` calls with a wrong `k` while the others call correctly; `peers_first`: the
/// peers enter their calls before rank `bad` makes its own, else after it has returned.
/// Returns every rank's outcome and when rank `bad` called.
fn one_bad_input(
    ranks: &[Rank],
    weights: &[Weights],
    bad: usize,
    peers_first: bool,
) -> (Vec<Ended>, Instant) {
    let d = ranks.len();
    let called = Barrier::new(d);
    let bad_called = std::sync::Mutex::new(None);
    let ended = std::thread::scope(|s| {
        let threads: Vec<_> = ranks
            .iter()
            .zip(weights)
            .map(|(rank, w)| {
                let (called, bad_called) = (&called, &bad_called);
                s.spawn(move || {
                    let me = rank.index();
                    let k = if me == bad { K + 1 } else { K };
                    let x: Ranked<3> = Tensor::randn(&[1, M, k], DType::F32, 5).try_into()?;
                    let x = rank.to_device(&x)?.try_into()?;
                    if me == bad {
                        if peers_first {
                            std::thread::sleep(Duration::from_millis(200));
                        }
                        *bad_called.lock().unwrap() = Some(Instant::now());
                        let result = row_parallel_read(rank, &x, w);
                        let at = Instant::now();
                        called.wait();
                        Ok(Ended { result, at })
                    } else {
                        if !peers_first {
                            called.wait();
                        }
                        let result = row_parallel_read(rank, &x, w);
                        let at = Instant::now();
                        if peers_first {
                            called.wait();
                        }
                        Ok(Ended { result, at })
                    }
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect::<Result<Vec<Ended>>>()
            .unwrap()
    });
    let bad_called = bad_called.into_inner().unwrap().unwrap();
    (ended, bad_called)
}

#[test]
fn a_bad_input_on_one_of_four_ranks_ends_every_call_at_once_and_the_world_recovers() {
    bad_input_on_one_of_four(simulated);
}

#[test]
#[ignore = "needs 4 CUDA GPUs; run with --ignored on a GPU machine"]
fn on_four_gpus_a_bad_input_ends_every_call_at_once_and_the_world_recovers() {
    bad_input_on_one_of_four(gpus);
}

/// Rank 2 of 4 passes a bad input while its peers wait in their call: every rank has its
/// error within a second, the world recovers in place, and 100 checked forwards follow.
fn bad_input_on_one_of_four(make: Maker) {
    let (world, ranks, weights) = world_on(make, 4);
    run_forwards(&ranks, &weights, 0, 3);
    // The peers are in their call, waiting for rank 2's data, when rank 2 finds its input
    // wrong: the world fails, every peer learns it at once.
    let (ended, bad_called) = one_bad_input(&ranks, &weights, 2, true);
    for (r, e) in ended.iter().enumerate() {
        let text = match &e.result {
            Ok(()) => panic!("rank {r}'s call succeeded"),
            Err(err) => err.to_string(),
        };
        if r == 2 {
            assert!(text.contains("`k`"), "rank 2: {text}");
        } else {
            assert!(
                matches!(&e.result, Err(Error::PeerFailed { failed_rank: 2, .. })),
                "rank {r}: {text}"
            );
        }
        let late = e.at.saturating_duration_since(bad_called);
        assert!(
            late < AT_ONCE,
            "rank {r} had its error {late:?} after rank 2 failed"
        );
    }
    assert_eq!(world.failure().map(|f| f.0), Some(2));
    let err = forward(&ranks[0], &weights[0], 9).unwrap_err().to_string();
    assert!(err.contains("World::recover"), "{err}");
    let started = Instant::now();
    world.recover().unwrap();
    let took = started.elapsed();
    assert!(world.failure().is_none());
    // Same handles, same weights, same programs: the next 100 forwards are right.
    run_forwards(&ranks, &weights, 100, 100);
    let kind = ranks[0].backend().name();
    println!("RECOVERY-TIME world of 4 {kind} devices: recovered in {took:?}");
}

#[test]
fn a_bad_input_found_before_any_peer_entered_is_refused_and_the_world_stays_healthy() {
    let (world, ranks, weights) = world(4);
    run_forwards(&ranks, &weights, 0, 2);
    let (ended, _) = one_bad_input(&ranks, &weights, 1, false);
    for (r, e) in ended.iter().enumerate() {
        match (&e.result, r) {
            (Err(Error::BadTensor { .. }), 1) => {}
            (
                Err(Error::CallRefused {
                    refused_by: 1,
                    reason,
                    ..
                }),
                _,
            ) if r != 1 => {
                assert!(reason.contains("`k`"), "rank {r}: {reason}");
            }
            (other, _) => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(world.failure().is_none(), "{:?}", world.failure());
    run_forwards(&ranks, &weights, 100, 100);
}

#[test]
fn the_same_bad_input_on_every_rank_leaves_the_world_healthy() {
    let (world, ranks, weights) = world(3);
    let results = world
        .run(|rank| {
            let w = &weights[rank.index()];
            let x: Ranked<3> = Tensor::randn(&[1, M, K + 1], DType::F32, 3).try_into()?;
            let x = rank.to_device(&x)?.try_into()?;
            Ok(row_parallel(rank, &x, &w.mine).map(|_| ()))
        })
        .unwrap();
    for (r, result) in results.iter().enumerate() {
        assert!(
            matches!(
                result,
                Err(Error::BadTensor { .. }) | Err(Error::CallRefused { .. })
            ),
            "rank {r}: {result:?}"
        );
    }
    assert!(world.failure().is_none(), "{:?}", world.failure());
    run_forwards(&ranks, &weights, 0, 10);
}

#[test]
fn an_application_error_raised_with_abort_ends_the_peers_calls_at_once() {
    let (world, ranks, weights) = world(4);
    run_forwards(&ranks, &weights, 0, 2);
    let aborted = std::sync::Mutex::new(None);
    let ended: Vec<(Result<()>, Instant)> = std::thread::scope(|s| {
        let threads: Vec<_> = ranks
            .iter()
            .zip(&weights)
            .map(|(rank, w)| {
                let aborted = &aborted;
                s.spawn(move || {
                    if rank.index() == 3 {
                        // The application finds its input wrong before calling.
                        std::thread::sleep(Duration::from_millis(200));
                        *aborted.lock().unwrap() = Some(Instant::now());
                        let e = rank.abort("the request's prompt is longer than the cache");
                        (Err(e), Instant::now())
                    } else {
                        (forward(rank, w, 7), Instant::now())
                    }
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let aborted = aborted.into_inner().unwrap().unwrap();
    for (r, (result, at)) in ended.iter().enumerate() {
        let text = format!("{:?}", result.as_ref().unwrap_err());
        assert!(text.contains("longer than the cache"), "rank {r}: {text}");
        assert!(at.saturating_duration_since(aborted) < AT_ONCE, "rank {r}");
    }
    world.recover().unwrap();
    run_forwards(&ranks, &weights, 100, 100);
}

#[test]
fn a_world_recovers_again_and_again() {
    recovers_again_and_again(simulated);
}

#[test]
#[ignore = "needs 4 CUDA GPUs; run with --ignored on a GPU machine"]
fn on_gpus_a_world_recovers_again_and_again() {
    recovers_again_and_again(gpus);
}

/// Five failures (raised with `abort`) and recoveries of one world of 2 devices, with
/// checked forwards after each.
fn recovers_again_and_again(make: Maker) {
    let (world, ranks, weights) = world_on(make, 2);
    for round in 0..5u64 {
        ranks[round as usize % 2].abort("a test failure");
        assert!(world.failure().is_some());
        world.recover().unwrap();
        run_forwards(&ranks, &weights, round * 10, 10);
    }
}

/// A rank of a launched world of three: a few good forwards, then rank 1 passes a bad
/// input while the others wait in their call; every rank must have its error within a
/// second, the world recovers, and the next 100 forwards are right.
#[test]
#[ignore = "a rank process of `a_launched_world_of_three_recovers_from_a_bad_input`"]
fn child_recovers() {
    assert!(
        in_child(),
        "run by a_launched_world_of_three_recovers_from_a_bad_input"
    );
    common::launch::backtrace_on_crash();
    let world = world_or_exit();
    let rank = world.rank().unwrap();
    let me = rank.index();
    let w = Weights::new(&rank).unwrap();
    for step in 0..3 {
        forward(&rank, &w, step).unwrap();
    }
    let k = if me == 1 { K + 1 } else { K };
    let x: Ranked<3> = Tensor::randn(&[1, M, k], DType::F32, 5).try_into().unwrap();
    let x: Ranked<3> = rank.to_device(&x).unwrap().try_into().unwrap();
    if me == 1 {
        std::thread::sleep(Duration::from_millis(300));
    }
    let started = Instant::now();
    let err = row_parallel_read(&rank, &x, &w).unwrap_err();
    let waited = started.elapsed();
    if me == 1 {
        assert!(err.to_string().contains("`k`"), "{err}");
    } else {
        assert!(
            matches!(&err, Error::PeerFailed { failed_rank: 1, .. }),
            "{err}"
        );
        // Rank 1 called 300 ms after the others; its failure reached them at once.
        assert!(waited < Duration::from_millis(300) + AT_ONCE, "{waited:?}");
    }
    let started = Instant::now();
    world.recover().unwrap();
    let took = started.elapsed();
    for step in 100..200 {
        forward(&rank, &w, step).unwrap();
    }
    // No process leaves (its goodbye makes rank 0's rendezvous act) before all are done.
    let token = Tensor::zeros(&[1], DType::F32);
    world.run(|rank| rank.gather_to_host(&token)).unwrap();
    println!("RECOVERED-OK rank {me}: error after {waited:?}, recovered in {took:?}");
}

#[test]
fn a_launched_world_of_three_recovers_from_a_bad_input() {
    if in_child() {
        return;
    }
    let ended = launch(
        3,
        &[0, 1, 2],
        &child_args("child_recovers"),
        &[("FUSION_TIMEOUT", "30".into())],
        |_| Vec::new(),
        Duration::from_secs(120),
    );
    expect_success(&ended);
    for e in &ended {
        assert!(e.stdout.contains("RECOVERED-OK"), "{}", e.log());
    }
}

#[test]
fn another_error_after_a_refused_call_still_fails_the_world() {
    let (world, ranks, weights) = world(2);
    let err = world
        .run(|rank| {
            let w = &weights[rank.index()];
            let x: Ranked<3> = Tensor::randn(&[1, M, K + 1], DType::F32, 3).try_into()?;
            let x = rank.to_device(&x)?.try_into()?;
            // The application swallows the refusal, then fails on its own.
            let _ = row_parallel(rank, &x, &w.mine);
            Err::<(), _>(Error::World("the application's own failure".into()))
        })
        .unwrap_err();
    assert!(err.to_string().contains("own failure"), "{err}");
    assert!(world.failure().is_some());
    world.recover().unwrap();
    run_forwards(&ranks, &weights, 0, 5);
}
