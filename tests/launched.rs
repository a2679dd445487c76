//! Worlds across processes on the CPU backend: ranks started as separate processes with
//! launcher variables (as torchrun, srun or mpirun would), meeting over the TCP
//! rendezvous. Each test starts this binary's `child_*` functions (ignored when run
//! directly) as the ranks and checks what they did: a sub-world case, a rank that exits
//! early, a rank that never starts, mismatched world sizes and a port in use.

mod common;

use std::time::Duration;

use common::launch::{
    child_args, expect_success, in_child, join_and_report, launch, launch_exe, Ended, Vars,
};
use common::{cases, RefArray};
use fusion::runtime::world::LaunchSpec;
use fusion::{DType, Error, ExecOptions, FusionExecutor, Tensor, World};

const LIMIT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------- sub-worlds

/// Four processes split into two groups of two; both groups run the P2P AllGather+GEMM
/// fusion at once on their own inputs, then the whole world runs it again.
#[test]
#[ignore = "a rank process of `groups_of_a_launched_world_run_the_same_fusion_at_once`"]
fn child_subworlds() {
    assert!(
        in_child(),
        "run by groups_of_a_launched_world_run_the_same_fusion_at_once"
    );
    let world = World::from_env().unwrap();
    assert!(world.size() % 2 == 0, "an even world");
    let half = world.size() / 2;
    let me = world.local_ranks()[0];
    let groups = world.split(half).unwrap();
    assert_eq!(groups.len(), 1);
    let group = &groups[0];
    let g = me / half;
    let f = cases::ag_matmul_p2p(DType::F32);
    let exec = FusionExecutor::new(f);
    let check = |w: &World, salt: u64| {
        let d = w.size();
        let x = Tensor::randn(&[d, 3, 5], DType::F32, 100 + salt);
        let y = Tensor::randn(&[5, 4], DType::F32, 200 + salt);
        let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
        let outs = w
            .run(|rank| {
                let a = rank.shard(&x, 0)?;
                let b = rank.to_device(&y)?;
                let out = exec.run_with(rank, &[&a, &b], None, &ExecOptions::default())?;
                rank.to_host(&out.outputs[0])
            })
            .unwrap();
        for o in outs {
            common::assert_close(&expected, &o, 1e-5, "AG+GEMM in a launched (sub-)world");
        }
    };
    check(group, g as u64);
    assert_eq!(group.local_ranks(), vec![me % half]);
    check(&world, 7);
    println!("SUBWORLD-OK rank {me} group {g}");
}

#[test]
fn groups_of_a_launched_world_run_the_same_fusion_at_once() {
    if in_child() {
        return;
    }
    let ended = launch(
        4,
        &[0, 1, 2, 3],
        &child_args("child_subworlds"),
        &[("FUSION_TIMEOUT", "30".into())],
        |_| Vec::new(),
        LIMIT,
    );
    expect_success(&ended);
    for e in &ended {
        assert!(e.stdout.contains("SUBWORLD-OK"), "{}", e.log());
    }
}

// ---------------------------------------------------------------- a rank that exits early

/// Rank 1 exits (status 3) once the world has started; the others try a fusion and must
/// get an error naming rank 1, long before the timeout.
#[test]
#[ignore = "a rank process of `a_rank_that_exits_early_is_named_by_the_others`"]
fn child_exits_early() {
    assert!(
        in_child(),
        "run by a_rank_that_exits_early_is_named_by_the_others"
    );
    let world = World::from_env().unwrap();
    let me = world.local_ranks()[0];
    if me == 1 {
        if std::env::var("FUSION_TEST_CRASH").is_ok() {
            std::process::abort(); // no exit hooks, no goodbye: a crash
        }
        std::process::exit(3); // the exit hook says goodbye: the rank left cleanly
    }
    let exec = FusionExecutor::new(cases::ag_matmul_p2p(DType::F32));
    let d = world.size();
    let x = Tensor::randn(&[d, 3, 5], DType::F32, 1);
    let y = Tensor::randn(&[5, 4], DType::F32, 2);
    let started = std::time::Instant::now();
    let err = world
        .run(|rank| {
            let a = rank.shard(&x, 0)?;
            let b = rank.to_device(&y)?;
            exec.run_with(rank, &[&a, &b], None, &ExecOptions::default())
        })
        .expect_err("the call must fail: rank 1 is gone");
    match &err {
        Error::PeerFailed { failed_rank, .. } => assert_eq!(*failed_rank, 1, "{err}"),
        other => panic!("expected PeerFailed naming rank 1, got {other}"),
    }
    assert!(err.to_string().contains("rank 1"), "{err}");
    println!(
        "EARLY-EXIT-SEEN rank {me} after {:.2} s: {err}",
        started.elapsed().as_secs_f64()
    );
    // A crash fails the world for good; a clean exit only fails what needed rank 1.
    if std::env::var("FUSION_TEST_CRASH").is_ok() {
        assert!(world.run(|_| Ok(())).is_err());
    }
}

/// Runs `child_exits_early` on 3 ranks (with `extra` variables) and checks the others named
/// rank 1 quickly.
fn rank_one_leaves(extra: &[(&str, String)], expect_code: Option<i32>, says: &str) {
    let mut env = vec![("FUSION_TIMEOUT", "30".to_string())];
    env.extend(extra.iter().cloned());
    let ended = launch(
        3,
        &[0, 1, 2],
        &child_args("child_exits_early"),
        &env,
        |_| Vec::new(),
        LIMIT,
    );
    for e in &ended {
        match e.rank {
            1 => assert_eq!(e.code, expect_code, "{}", e.log()),
            _ => {
                assert_eq!(e.code, Some(0), "{}", e.log());
                assert!(e.stdout.contains("EARLY-EXIT-SEEN"), "{}", e.log());
                assert!(e.stdout.contains(says), "{}", e.log());
                assert!(e.seconds < 25.0, "took {:.1} s: {}", e.seconds, e.log());
            }
        }
    }
}

#[test]
fn a_rank_that_exits_early_is_named_by_the_others() {
    if in_child() {
        return;
    }
    rank_one_leaves(&[], Some(3), "has ended its part");
}

#[test]
fn a_rank_that_crashes_is_named_by_the_others() {
    if in_child() {
        return;
    }
    // SIGABRT: no exit status.
    rank_one_leaves(
        &[("FUSION_TEST_CRASH", "1".to_string())],
        None,
        "exited or crashed",
    );
}

// ---------------------------------------------------------------- bootstrap failures

/// Joins the world and reports success; the parent tests what goes wrong before that.
#[test]
#[ignore = "a rank process of the bootstrap-failure tests"]
fn child_joins() {
    assert!(in_child(), "run by the bootstrap-failure tests");
    join_and_report();
}

fn stderr_of(ended: &[Ended], rank: usize) -> &str {
    &ended
        .iter()
        .find(|e| e.rank == rank)
        .expect("rank ran")
        .stderr
}

#[test]
fn a_rank_that_never_starts_is_named_within_the_timeout() {
    if in_child() {
        return;
    }
    // Ranks 0 and 1 of 3 start; rank 2 never does.
    let ended = launch(
        3,
        &[0, 1],
        &child_args("child_joins"),
        &[("FUSION_TIMEOUT", "3".into())],
        |_| Vec::new(),
        LIMIT,
    );
    for e in &ended {
        assert_eq!(e.code, Some(2), "{}", e.log());
        assert!(e.seconds < 20.0, "took {:.1} s: {}", e.seconds, e.log());
    }
    let msg = stderr_of(&ended, 0);
    assert!(msg.contains("rank 2 never arrived"), "{msg}");
}

#[test]
fn mismatched_world_sizes_are_reported() {
    if in_child() {
        return;
    }
    let ended = launch(
        2,
        &[0, 1],
        &child_args("child_joins"),
        &[("FUSION_TIMEOUT", "10".into())],
        |r| {
            if r == 1 {
                vec![("FUSION_WORLD_SIZE".into(), "3".into())]
            } else {
                Vec::new()
            }
        },
        LIMIT,
    );
    for e in &ended {
        assert_eq!(e.code, Some(2), "{}", e.log());
        assert!(
            e.stderr.contains("world size of 3") && e.stderr.contains("rank 1"),
            "{}",
            e.log()
        );
    }
}

#[test]
fn a_port_in_use_is_reported() {
    if in_child() {
        return;
    }
    let taken = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let ended = launch(
        1,
        &[0],
        &child_args("child_joins"),
        &[
            ("FUSION_TIMEOUT", "5".into()),
            ("FUSION_MASTER_PORT", port.to_string()),
        ],
        |_| Vec::new(),
        LIMIT,
    );
    let e = &ended[0];
    assert_eq!(e.code, Some(2), "{}", e.log());
    assert!(
        e.stderr.contains(&format!("port {port} is in use")),
        "{}",
        e.log()
    );
}

#[test]
fn a_world_of_one_process_needs_no_peers() {
    if in_child() {
        return;
    }
    let ended = launch(
        1,
        &[0],
        &child_args("child_joins"),
        &[("FUSION_TIMEOUT", "10".into())],
        |_| Vec::new(),
        LIMIT,
    );
    expect_success(&ended);
    assert!(
        ended[0].stdout.contains("JOINED rank [0]"),
        "{}",
        ended[0].log()
    );
}

// ---------------------------------------------------------------- the examples

/// Every example, unchanged, as two processes with torchrun's variables: each prints the
/// same check as the single-process run, over every rank's output.
#[test]
fn the_examples_run_unchanged_under_a_launcher() {
    if in_child() {
        return;
    }
    // Test binaries live in target/<profile>/deps, examples in target/<profile>/examples.
    let exe = std::env::current_exe().expect("the test binary");
    let examples = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>")
        .join("examples");
    // Small sizes: what runs under the launcher is the point, and the examples check every
    // size against their f64 host loop (slow in a debug build at their default sizes).
    let gemm: &[&str] = &["-m", "32", "-k", "32", "-n", "32"];
    for (name, sizes) in [
        ("ag_matmul", gemm),
        ("matmul_ar", gemm),
        ("matmul_rs", gemm),
        ("allgather_p2p", &["-m", "4096"][..]),
        ("ag_matmul_p2p", gemm),
    ] {
        let path = examples.join(name);
        assert!(
            path.exists(),
            "{} is missing: `cargo test` builds the examples first",
            path.display()
        );
        let ended = launch_exe(
            &path,
            Vars::Torchrun,
            2,
            &[0, 1],
            &[&["--iters", "2"], sizes].concat(),
            &[("FUSION_TIMEOUT", "30".into())],
            |_| Vec::new(),
            LIMIT,
        );
        expect_success(&ended);
        for e in &ended {
            assert!(
                e.stdout.contains("launched by torchrun: 2 processes") && e.stdout.contains(": ok"),
                "{name}: {}",
                e.log()
            );
        }
    }
}

// ---------------------------------------------------------------- a process per node

/// Two processes with two simulated devices each (`FUSION_DEVICES_PER_PROCESS=2`): a world
/// of four ranks, two threads per process; global ranks are process * 2 + thread.
#[test]
#[ignore = "a rank process of `a_process_can_hold_several_ranks`"]
fn child_two_ranks_per_process() {
    assert!(in_child(), "run by a_process_can_hold_several_ranks");
    let world = World::from_env().unwrap();
    assert_eq!(world.size(), 4);
    let process = LaunchSpec::from_env().unwrap().unwrap().process;
    assert_eq!(world.local_ranks(), vec![2 * process, 2 * process + 1]);
    let exec = FusionExecutor::new(cases::ag_matmul_p2p(DType::F32));
    let x = Tensor::randn(&[4, 3, 5], DType::F32, 7);
    let y = Tensor::randn(&[5, 2], DType::F32, 8);
    let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
    let outs = world
        .run(|rank| {
            let a = rank.shard(&x, 0)?;
            let b = rank.to_device(&y)?;
            let out = exec.run_with(rank, &[&a, &b], None, &ExecOptions::default())?;
            rank.to_host(&out.outputs[0])
        })
        .unwrap();
    assert_eq!(outs.len(), 2);
    for o in outs {
        common::assert_close(&expected, &o, 1e-5, "AG+GEMM, two ranks per process");
    }
    println!("PER-NODE-OK process {process}");
}

#[test]
fn a_process_can_hold_several_ranks() {
    if in_child() {
        return;
    }
    let ended = launch(
        2,
        &[0, 1],
        &child_args("child_two_ranks_per_process"),
        &[
            ("FUSION_TIMEOUT", "30".into()),
            ("FUSION_DEVICES_PER_PROCESS", "2".into()),
        ],
        |_| Vec::new(),
        LIMIT,
    );
    expect_success(&ended);
    for e in &ended {
        assert!(e.stdout.contains("PER-NODE-OK"), "{}", e.log());
    }
}

// ---------------------------------------------------------------- rank handles

/// A process's rank handles kept in layers and driven from threads of its own, 1,000 calls
/// each with fresh inputs; after each thread's first call, nothing more is made (no thread,
/// no communicator). `FUSION_DEVICES_PER_PROCESS` ranks per process (1 or 2).
#[test]
#[ignore = "a rank process of `handles_of_a_launched_world_are_driven_from_threads`"]
fn child_handles_from_threads() {
    assert!(
        in_child(),
        "run by handles_of_a_launched_world_are_driven_from_threads"
    );
    use common::handles::{drive, weights, Layer};
    let world = World::from_env().unwrap();
    let process = LaunchSpec::from_env().unwrap().unwrap().process;
    let ranks = if world.local_ranks().len() == 1 {
        // One rank per process (torchrun's default): the process's handle, directly.
        vec![world.rank().unwrap()]
    } else {
        let err = world.rank().unwrap_err().to_string();
        assert!(err.contains("World::ranks"), "{err}");
        world.ranks().unwrap()
    };
    let layers = ranks
        .into_iter()
        .map(|r| Layer::new(r, &weights(world.size())).unwrap())
        .collect();
    let start = std::time::Instant::now();
    let (after_first, end) = drive(layers, 1000);
    // No process leaves (its goodbye makes rank 0's rendezvous act) before every process
    // has counted: a barrier over the world, after the counts.
    let token = Tensor::zeros(&[1], DType::F32);
    world.run(|rank| rank.gather_to_host(&token)).unwrap();
    assert_eq!(
        end, after_first,
        "calls on handles made threads or communicators"
    );
    println!(
        "HANDLES-OK process {process}: 1000 calls per rank in {:.1} s",
        start.elapsed().as_secs_f64()
    );
}

#[test]
fn handles_of_a_launched_world_are_driven_from_threads() {
    if in_child() {
        return;
    }
    for per_process in ["1", "2"] {
        let ended = launch(
            2,
            &[0, 1],
            &child_args("child_handles_from_threads"),
            &[
                ("FUSION_TIMEOUT", "30".into()),
                ("FUSION_DEVICES_PER_PROCESS", per_process.into()),
            ],
            |_| Vec::new(),
            LIMIT,
        );
        expect_success(&ended);
        for e in &ended {
            assert!(e.stdout.contains("HANDLES-OK"), "{}", e.log());
        }
    }
}
