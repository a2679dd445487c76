//! A launched world with a job token (`FUSION_JOB_TOKEN`): only its own ranks join. Three
//! rank processes form a world and run fusions while a fourth process with a wrong token
//! and one with none try to join (before the world forms and while it runs), and raw
//! connections fuzz the handshake (truncated, oversized, replayed, garbage): each is
//! refused and named in rank 0's log, and no rank sees an error. Ranks that disagree on
//! the token fail at formation, saying so. As in `launched.rs`, each test starts this
//! binary's `child_*` functions (ignored when run directly) as the processes; the GPU
//! checks run the same children under torchrun (`scripts/gpu.sh token`).

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::launch::{
    child_args, free_port, in_child, join_and_report, launch_exe, start_exe, world_or_exit, Ended,
    Running, Vars,
};
use common::{cases, RefArray};
use fusion::{BackendKind, DType, ExecOptions, FusionExecutor, Tensor, World};

const LIMIT: Duration = Duration::from_secs(120);

/// Threads alive in this process (Linux; `None` elsewhere).
fn live_threads() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Threads:"))?;
    line["Threads:".len()..].trim().parse().ok()
}

/// Runs the AG+GEMM fusion on every local rank and checks its result; then every rank
/// says whether `stop` exists, and all learn whether any does (so all stop together).
fn call_and_ask(world: &World, exec: &FusionExecutor, salt: u64, stop: &Path) -> bool {
    let d = world.size();
    let x = Tensor::randn(&[d, 3, 5], DType::F32, 10 + salt);
    let y = Tensor::randn(&[5, 4], DType::F32, 20 + salt);
    let expected = RefArray::from_tensor(&x).matmul(&RefArray::from_tensor(&y));
    let flag = Tensor::full(&[1], DType::F32, if stop.exists() { 1.0 } else { 0.0 });
    let results = world
        .run(|rank| {
            let a = rank.shard(&x, 0)?;
            let b = rank.to_device(&y)?;
            let out = exec.run_with(rank, &[&a, &b], None, &ExecOptions::default())?;
            Ok((rank.to_host(&out.outputs[0])?, rank.gather_to_host(&flag)?))
        })
        .expect("no rank of the world sees an error");
    let mut any = false;
    for (out, flags) in results {
        common::assert_close(&expected, &out, 1e-5, "AG+GEMM in a world with a token");
        for f in flags {
            any |= f.to_f32_vec().expect("a flag")[0] > 0.0;
        }
    }
    any
}

/// A rank of a world with a job token: forms (printing the rendezvous address), then
/// runs checked calls until the file `FUSION_TEST_STOP` names exists. Rank 0 (the hub's
/// process) then checks that refused connections left no thread behind (CPU backend).
#[test]
#[ignore = "a rank process of the job-token tests (and of `scripts/gpu.sh token`)"]
fn child_guarded() {
    assert!(
        in_child(),
        "run by only_the_ranks_of_a_world_with_a_token_join"
    );
    let stop = PathBuf::from(std::env::var("FUSION_TEST_STOP").expect("FUSION_TEST_STOP"));
    let world = world_or_exit();
    let me = world.local_ranks()[0];
    let spec = world.launch_spec().expect("a launched world").clone();
    println!("FORMED rank {me} at {}", spec.rendezvous());
    let exec = FusionExecutor::new(cases::ag_matmul_p2p(DType::F32));
    call_and_ask(&world, &exec, 0, &stop);
    // The world's own threads exist by now (the first call made what calls make).
    let settled = live_threads();
    let mut calls = 1;
    let start = Instant::now();
    while !call_and_ask(&world, &exec, calls, &stop) {
        calls += 1;
        assert!(start.elapsed() < LIMIT, "never told to stop");
        std::thread::sleep(Duration::from_millis(20));
    }
    if me == 0 && world.backend() == BackendKind::Cpu {
        // Every refused connection's thread has ended (each ends with its handshake). The
        // count taken after the first call may include a refused connection's thread that
        // was still in its handshake then, so the count now may be lower, never higher.
        let waited = Instant::now();
        let over = || {
            live_threads()
                .zip(settled)
                .is_some_and(|(now, then)| now > then)
        };
        while over() && waited.elapsed() < Duration::from_secs(15) {
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            !over(),
            "threads left behind: {:?} now, {settled:?} after the first call",
            live_threads()
        );
    }
    // No rank leaves (its goodbye ends the hub's threads for it) before rank 0 counted.
    let barrier = Tensor::zeros(&[1], DType::F32);
    world.run(|rank| rank.gather_to_host(&barrier)).unwrap();
    println!("GUARDED-OK rank {me}: {} calls", calls + 1);
}

/// A process that tries to join the world its variables name: prints `JOINED` and exits 0
/// if it does, else prints the error and exits 2.
#[test]
#[ignore = "a process of the job-token tests that tries to join a world"]
fn child_tries_to_join() {
    assert!(in_child(), "run by the job-token tests");
    join_and_report();
}

/// The variables of a process of the world at `port` whose `FUSION_TEST_STOP` is `stop`,
/// with `token` (none: unset).
fn vars(port: u16, stop: &std::path::Path, token: Option<&str>) -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("FUSION_TIMEOUT", "30".to_string()),
        ("FUSION_MASTER_PORT", port.to_string()),
        ("FUSION_TEST_STOP", stop.display().to_string()),
    ];
    if let Some(t) = token {
        v.push(("FUSION_JOB_TOKEN", t.to_string()));
    }
    v
}

/// A process claiming rank 1 of the world of 3 at `port` with `token`: it must be refused.
fn intruder(port: u16, token: Option<&str>) -> Ended {
    let exe = std::env::current_exe().expect("the test binary");
    let stop = std::env::temp_dir();
    let mut ended = launch_exe(
        &exe,
        Vars::Fusion,
        3,
        &[1],
        &child_args("child_tries_to_join"),
        &vars(port, &stop, token),
        |_| Vec::new(),
        LIMIT,
    );
    ended.remove(0)
}

/// One frame's payload read from `s` (the wire of `comm/remote/wire.rs`: a `u32` length,
/// then the payload).
fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut payload = vec![0u8; u32::from_le_bytes(len) as usize];
    s.read_exact(&mut payload)?;
    Ok(payload)
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(payload);
    f
}

/// A genuine proof of `token`, recorded for a replay: a fake rendezvous challenges a
/// process given the token and keeps the frame it answers with.
fn recorded_proof(token: &str) -> Vec<u8> {
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = fake.local_addr().unwrap().port();
    let exe = std::env::current_exe().expect("the test binary");
    let victim = start_exe(
        &exe,
        Vars::Fusion,
        3,
        &[1],
        &child_args("child_tries_to_join"),
        &vars(port, &std::env::temp_dir(), Some(token)),
        |_| Vec::new(),
    );
    fake.set_nonblocking(true).unwrap();
    let start = Instant::now();
    let mut conn = loop {
        match fake.accept() {
            Ok((c, _)) => break c,
            Err(_) if start.elapsed() < LIMIT => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("the process given the token never came: {e}"),
        }
    };
    conn.set_nonblocking(false).unwrap();
    // CHALLENGE (8), mode 1 (a token), a nonce.
    let mut challenge = vec![8u8, 1];
    challenge.extend_from_slice(&[7; 32]);
    conn.write_all(&frame(&challenge)).unwrap();
    let proof = frame(&read_frame(&mut conn).expect("a proof"));
    drop(conn);
    let ended = victim.finish(LIMIT);
    assert_eq!(ended[0].code, Some(2), "{}", ended[0].log());
    proof
}

/// A raw connection to the rendezvous at `addr`: reads its challenge (if
/// `read_challenge`), sends `bytes`, and reads until the rendezvous closes it.
fn knock(addr: &str, read_challenge: bool, bytes: &[u8]) {
    let mut s = TcpStream::connect(addr).expect("the rendezvous");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    if read_challenge {
        read_frame(&mut s).expect("a challenge");
    }
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
}

/// Truncated, oversized, replayed and garbage handshakes on the rendezvous at `addr`,
/// whose world's token is `token` (for the replay of a genuine proof).
fn fuzz(addr: &str, token: &str) {
    // A proof's length (66), cut short by the end of the connection.
    knock(addr, true, &[66, 0, 0, 0, 8, 1, 5, 5]);
    knock(addr, false, &u32::MAX.to_le_bytes());
    knock(addr, true, &recorded_proof(token));
    knock(addr, false, b"GET / HTTP/1.1\r\nHost: rank0\r\n\r\n");
}

/// Fuzzes the handshake of the rendezvous at `FUSION_MASTER_ADDR:FUSION_MASTER_PORT`,
/// whose token is `FUSION_JOB_TOKEN`, as [`fuzz`] does: `scripts/gpu.sh token` runs it
/// beside a world under torchrun.
#[test]
#[ignore = "run by scripts/gpu.sh token beside a launched world"]
fn child_fuzzes() {
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let addr = format!(
        "{}:{}",
        var("FUSION_MASTER_ADDR"),
        var("FUSION_MASTER_PORT")
    );
    fuzz(&addr, &var("FUSION_JOB_TOKEN"));
    println!("FUZZ-DONE at {addr}");
}

/// Waits until each of `ranks` of `running` has formed its world.
fn formed(running: &mut Running, ranks: &[usize]) {
    for &r in ranks {
        assert!(
            running.wait_for_output(r, "FORMED", LIMIT),
            "rank {r} never formed its world"
        );
    }
}

#[test]
fn only_the_ranks_of_a_world_with_a_token_join() {
    if in_child() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let token = "the job's secret, 4f1c";
    let port = free_port();
    let stop = std::env::temp_dir().join(format!("fusion-job-token-{}", std::process::id()));
    let _ = std::fs::remove_file(&stop);
    let start = |ranks: &[usize]| {
        let args = child_args("child_guarded");
        let env = vars(port, &stop, Some(token));
        start_exe(&exe, Vars::Fusion, 3, ranks, &args, &env, |_| Vec::new())
    };
    // Rank 0's process first: the intruders knock before the world can form.
    let mut hub = start(&[0]);
    let mut intruders = vec![intruder(port, Some("a guess")), intruder(port, None)];
    let mut others = start(&[1, 2]);
    formed(&mut hub, &[0]);
    formed(&mut others, &[1, 2]);
    // While the world runs: the same again, and a fuzzed handshake.
    intruders.push(intruder(port, Some("a guess")));
    intruders.push(intruder(port, None));
    fuzz(&format!("127.0.0.1:{port}"), token);
    std::fs::write(&stop, b"").unwrap();
    let mut ended = hub.finish(LIMIT);
    ended.extend(others.finish(LIMIT));
    let _ = std::fs::remove_file(&stop);
    let logs: Vec<String> = ended.iter().chain(&intruders).map(Ended::log).collect();
    let logs = logs.join("\n");
    for e in &ended {
        assert_eq!(e.code, Some(0), "{logs}");
        assert!(e.stdout.contains("GUARDED-OK"), "{logs}");
    }
    for (i, e) in intruders.iter().enumerate() {
        let says = match i % 2 {
            0 => "job token differs from rank 0's",
            _ => "requires a job token",
        };
        assert_eq!(e.code, Some(2), "intruder {i}: {logs}");
        assert!(e.stderr.contains(says), "intruder {i}: {logs}");
    }
    // Rank 0's log names each refused connection and why.
    let hub_log = &ended[0].stderr;
    let count = |why: &str| hub_log.matches(why).count();
    assert_eq!(count("refused a connection from 127.0.0.1:"), 8, "{logs}");
    assert_eq!(
        count(": a wrong job token"),
        3,
        "two guesses, a replay: {logs}"
    );
    assert_eq!(count(": no job token"), 2, "{logs}");
    assert_eq!(count(": a truncated handshake message"), 1, "{logs}");
    assert_eq!(count(": an oversized handshake message"), 2, "{logs}");
}

#[test]
fn ranks_that_disagree_on_the_token_fail_at_formation_saying_so() {
    if in_child() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary");
    let ended = launch_exe(
        &exe,
        Vars::Fusion,
        3,
        &[0, 1, 2],
        &child_args("child_tries_to_join"),
        &[("FUSION_TIMEOUT", "3".into())],
        |r| {
            let token = if r == 2 { "rank 2's idea" } else { "the job's" };
            vec![("FUSION_JOB_TOKEN".into(), token.into())]
        },
        LIMIT,
    );
    let logs: Vec<String> = ended.iter().map(Ended::log).collect();
    let logs = logs.join("\n");
    for e in &ended {
        assert_eq!(e.code, Some(2), "{logs}");
        let says: &[&str] = match e.rank {
            // At once, naming the token.
            2 => &["job token differs from rank 0's", "FUSION_JOB_TOKEN"],
            // When the timeout ends, naming the missing rank and what was refused.
            _ => &[
                "rank 2 never arrived",
                "refused 1 connection: 1 for a wrong job token",
                "FUSION_JOB_TOKEN",
            ],
        };
        for s in says {
            assert!(e.stderr.contains(s), "rank {}: `{s}`: {logs}", e.rank);
        }
    }
    assert!(
        ended[2].seconds < ended[0].seconds,
        "rank 2 fails first: {logs}"
    );
}
