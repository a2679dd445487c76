//! The fault suite: a rank that never sends, a rank that panics in the middle of a
//! pipeline, and a process killed (SIGKILL) or frozen (SIGSTOP) in the middle of a call in
//! a launched world. Each must end in errors on the other ranks within the world's timeout
//! (`FUSION_TIMEOUT`, 3 s here unless set), naming the rank at fault, with no hang and no
//! process left behind.
//!
//! Everywhere on simulated devices and launched CPU processes. With `FUSION_BACKEND=cuda`
//! (`scripts/gpu.sh faults`) the same cases run on GPUs: two ranks on two GPUs, or sharing
//! the one GPU there is (`cuda_world_sharing_gpus`; launched processes through
//! `launched_world_sharing_gpus`), the AG+GEMM copy-engine pipeline replayed as a graph
//! where the world replays (two GPUs: its device then waits on flags, which the watchdog
//! over device waits bounds).

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::launch::{start_exe, Ended, Vars};
use common::{always_pipelined, cases};
use fusion::runtime::backend::cuda::{a_device_is_stuck, device_count};
use fusion::runtime::backend::cuda::{
    cuda_world, cuda_world_sharing_gpus, launched_world_sharing_gpus,
};
use fusion::runtime::world::LaunchSpec;
use fusion::{DType, Error, FusionExecutor, Rank, Tensor, World};

/// The world's timeout: `FUSION_TIMEOUT`, else 3 s.
fn timeout() -> Duration {
    std::env::var("FUSION_TIMEOUT")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(Duration::from_secs(3), Duration::from_secs_f64)
}

/// How long after the fault the others' errors may come: the timeout and 5 s.
fn deadline() -> Duration {
    timeout() + Duration::from_secs(5)
}

fn on_gpus() -> bool {
    std::env::var("FUSION_BACKEND").as_deref() == Ok("cuda")
}

/// Two ranks: simulated devices, or (`FUSION_BACKEND=cuda`) two GPUs, or two ranks
/// sharing the one visible GPU.
fn two_ranks() -> World {
    let world = if !on_gpus() {
        World::local(2)
    } else if device_count() >= 2 {
        cuda_world(Some(2))
    } else {
        cuda_world_sharing_gpus(2)
    };
    world.expect("a world of two ranks").with_timeout(timeout())
}

/// The AG+GEMM P2P pipeline and its inputs on `rank` (bf16 on GPUs).
struct Pipeline {
    exec: FusionExecutor,
    x: Tensor,
    y: Tensor,
}

impl Pipeline {
    fn new(d: usize) -> Pipeline {
        let dt = if on_gpus() { DType::BF16 } else { DType::F32 };
        Pipeline {
            exec: FusionExecutor::new(cases::ag_matmul_p2p(dt)),
            x: Tensor::randn(&[d, 64, 32], dt, 11),
            y: Tensor::randn(&[32, 48], dt, 12),
        }
    }

    /// One call, its output read back (so the call's device work is waited for). The
    /// P2P pipeline at any size (by default small chunks would get one Allgather).
    fn call(&self, rank: &Rank, inputs: &[Tensor]) -> fusion::Result<()> {
        let refs: Vec<&Tensor> = inputs.iter().collect();
        let report = self.exec.run_with(rank, &refs, None, &always_pipelined())?;
        rank.to_host(&report.outputs[0])?;
        Ok(())
    }

    fn inputs(&self, rank: &Rank) -> fusion::Result<Vec<Tensor>> {
        Ok(vec![rank.shard(&self.x, 0)?, rank.to_device(&self.y)?])
    }
}

/// A device of a failed world that never drained would be reported here.
fn no_device_stuck() {
    assert!(
        !a_device_is_stuck(),
        "a device closed with work that never finished"
    );
}

#[test]
fn a_rank_that_never_sends_fails_its_peer_within_the_timeout() {
    let world = two_ranks();
    let p = Pipeline::new(2);
    let stopped = Mutex::new(None::<Instant>);
    let result = world.run(|rank| {
        let inputs = p.inputs(rank)?;
        // Together first (on two GPUs the third call is replayed from a graph).
        for _ in 0..3 {
            p.call(rank, &inputs)?;
        }
        rank.communicator().exchange(&[])?;
        if rank.index() == 1 {
            *stopped.lock().unwrap() = Some(Instant::now());
            return Ok(()); // rank 1 never sends again
        }
        p.call(rank, &inputs)
    });
    let waited = stopped.lock().unwrap().expect("rank 1 stopped").elapsed();
    let err = result.expect_err("rank 0 waits for a rank that never sends");
    let text = err.to_string();
    println!(
        "never sends: error after {:.2} s: {text}",
        waited.as_secs_f64()
    );
    assert!(
        matches!(err, Error::Timeout { rank: 0, .. }),
        "rank 0's wait timed out: {text}"
    );
    assert!(text.contains("rank 1"), "the peer is named: {text}");
    assert!(waited < deadline(), "took {waited:?}: {text}");
    drop(world);
    no_device_stuck();
}

#[test]
fn a_rank_that_panics_in_the_middle_of_a_pipeline_fails_its_peer() {
    let world = two_ranks();
    let p = Pipeline::new(2);
    let panicked = Mutex::new(None::<Instant>);
    let start = Instant::now();
    let result = world.run(|rank| {
        let inputs = p.inputs(rank)?;
        for call in 0..20 {
            if rank.index() == 1 && call == 5 {
                *panicked.lock().unwrap() = Some(Instant::now());
                panic!("rank 1 stops in the middle of the pipeline");
            }
            // Not read back: rank 0 runs ahead into calls rank 1 never joins (replayed
            // from graphs on two GPUs, its device waiting on their flags).
            let refs: Vec<&Tensor> = inputs.iter().collect();
            p.exec.run_with(rank, &refs, None, &always_pipelined())?;
        }
        rank.synchronize()
    });
    let err = result.expect_err("rank 1 panicked");
    let after = panicked
        .lock()
        .unwrap()
        .map_or(start.elapsed(), |t| t.elapsed());
    println!(
        "panic: run ended {:.2} s after it: {err}",
        after.as_secs_f64()
    );
    assert!(
        matches!(&err, Error::Panic { rank: 1, message } if message.contains("middle of the pipeline")),
        "{err}"
    );
    assert!(after < deadline(), "took {after:?}");
    drop(world);
    no_device_stuck();
}

// ---------------------------------------------------------------- launched processes

fn in_child() -> bool {
    LaunchSpec::from_env().ok().flatten().is_some()
}

/// Processes of the launched cases: three on the CPU, two on GPUs (one GPU is enough:
/// they share it).
fn processes() -> usize {
    if on_gpus() {
        2
    } else {
        3
    }
}

/// Calls the AG+GEMM pipeline until the world fails, then reports the error and how long
/// after the call that failed began (the parent stops or kills rank 1 meanwhile).
#[test]
#[ignore = "a rank process of the launched fault tests"]
fn child_calls_until_the_world_fails() {
    assert!(in_child(), "run by the launched fault tests");
    let world = if on_gpus() {
        launched_world_sharing_gpus()
    } else {
        World::from_env()
    }
    .unwrap_or_else(|e| {
        eprintln!("JOIN-ERROR: {e}");
        std::process::exit(2)
    });
    let me = world.local_ranks()[0];
    let p = Pipeline::new(world.size());
    let started = Instant::now();
    let last_call = Mutex::new(Instant::now());
    let result = world.run(|rank| {
        let inputs = p.inputs(rank)?;
        for call in 0u64.. {
            *last_call.lock().unwrap() = Instant::now();
            p.call(rank, &inputs)?;
            if call == 3 {
                println!("CALLING rank {me}");
            }
            if started.elapsed() > Duration::from_secs(300) {
                return Err(Error::World("the parent never stopped rank 1".into()));
            }
        }
        Ok(())
    });
    let err = result.expect_err("the world fails");
    let since = last_call.lock().unwrap().elapsed();
    println!(
        "FAULT-SEEN rank {me} {:.3} s into its last call: {err}",
        since.as_secs_f64()
    );
}

/// Seconds into its last call when `e` saw the fault, from its `FAULT-SEEN` line.
fn seen_after(e: &Ended) -> f64 {
    let line = e
        .stdout
        .lines()
        .find(|l| l.starts_with("FAULT-SEEN"))
        .unwrap_or_else(|| panic!("no FAULT-SEEN line: {}", e.log()));
    line.split_whitespace()
        .nth(3)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no seconds in `{line}`"))
}

/// Starts the processes, waits until rank 1 is calling, sends it `signal`, and checks the
/// other ranks' errors and exits; returns their logs.
fn rank_one_gets(signal: &str) -> Vec<Ended> {
    let n = processes();
    let exe = std::env::current_exe().expect("the test binary");
    let backend = if on_gpus() { "cuda" } else { "cpu" };
    let mut running = start_exe(
        &exe,
        Vars::Fusion,
        n,
        &(0..n).collect::<Vec<_>>(),
        &[
            "--exact",
            "child_calls_until_the_world_fails",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ],
        &[
            ("FUSION_TIMEOUT", timeout().as_secs_f64().to_string()),
            ("FUSION_BACKEND", backend.to_string()),
        ],
        |_| Vec::new(),
    );
    if !running.wait_for_output(1, "CALLING", Duration::from_secs(60)) {
        let logs: Vec<String> = running
            .finish(Duration::ZERO)
            .iter()
            .map(Ended::log)
            .collect();
        panic!("rank 1 never got to its calls:\n{}", logs.join("\n"));
    }
    // Mid-call: the ranks call without pause, so the signal lands inside one.
    std::thread::sleep(Duration::from_millis(50));
    running.signal(1, signal);
    let at = running.seconds();
    // Every other rank must end by itself; the frozen one is killed once they have.
    let ended = running.finish_when(deadline() * 4, |rank, _| rank != 1 || signal != "STOP");
    for e in ended.iter().filter(|e| e.rank != 1) {
        assert_eq!(e.code, Some(0), "{}", e.log());
        let seen = seen_after(e);
        if let Some(line) = e.stdout.lines().find(|l| l.starts_with("FAULT-SEEN")) {
            println!("{signal}: {line}");
        }
        println!(
            "{signal}: rank {} saw it {seen:.2} s into its call and exited {:.2} s after the \
             signal",
            e.rank,
            e.seconds - at
        );
        assert!(
            seen < deadline().as_secs_f64(),
            "rank {} saw the fault {seen:.1} s into its call: {}",
            e.rank,
            e.log()
        );
        assert!(
            e.stdout.contains("rank 1"),
            "the error names rank 1: {}",
            e.log()
        );
        // The process ends after its error (rank 0's rendezvous waits at most the timeout
        // for the goodbyes of ranks that are gone).
        assert!(
            e.seconds - at < (timeout() * 2 + Duration::from_secs(5)).as_secs_f64(),
            "rank {} exited {:.1} s after the signal: {}",
            e.rank,
            e.seconds - at,
            e.log()
        );
    }
    ended
}

#[test]
fn a_process_killed_in_the_middle_of_a_call_fails_the_others() {
    if in_child() {
        return;
    }
    let ended = rank_one_gets("KILL");
    let killed = ended.iter().find(|e| e.rank == 1).expect("rank 1");
    assert_eq!(killed.code, None, "killed by a signal: {}", killed.log());
    for e in ended.iter().filter(|e| e.rank != 1) {
        assert!(e.stdout.contains("exited or crashed"), "{}", e.log());
    }
}

#[test]
fn a_process_frozen_in_the_middle_of_a_call_fails_the_others_after_the_timeout() {
    if in_child() {
        return;
    }
    let ended = rank_one_gets("STOP");
    let frozen = ended.iter().find(|e| e.rank == 1).expect("rank 1");
    assert_eq!(
        frozen.code,
        None,
        "killed after the others ended: {}",
        frozen.log()
    );
    for e in ended.iter().filter(|e| e.rank != 1) {
        assert!(
            e.stdout.contains("timed out") || e.stdout.contains("abandoned"),
            "{}",
            e.log()
        );
    }
}
