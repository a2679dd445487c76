//! Starting a test binary as several processes of one launched world, the way torchrun
//! would (with the explicit `FUSION_*` launcher variables), and collecting what each said.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A free TCP port on this host (bound and released; good enough for one test).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// What one process did.
#[derive(Debug)]
pub struct Ended {
    pub rank: usize,
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub seconds: f64,
}

impl Ended {
    /// Both streams, for assertion messages.
    pub fn log(&self) -> String {
        format!(
            "--- rank {} (exit {:?}, {:.1} s) stdout:\n{}\n--- stderr:\n{}",
            self.rank, self.code, self.seconds, self.stdout, self.stderr
        )
    }
}

/// Starts this test binary once per rank in `ranks` of a world of `size` with `args`
/// (e.g. `--exact child --ignored`), the CPU backend, and `env` plus each rank's
/// `per_rank(rank)` variables; waits for all (killing any still running after `limit`).
pub fn launch(
    size: usize,
    ranks: &[usize],
    args: &[&str],
    env: &[(&str, String)],
    per_rank: impl Fn(usize) -> Vec<(String, String)>,
    limit: Duration,
) -> Vec<Ended> {
    let exe = std::env::current_exe().expect("the test binary");
    launch_exe(&exe, Vars::Fusion, size, ranks, args, env, per_rank, limit)
}

/// Which launcher's variables place the processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Vars {
    /// `FUSION_RANK`, `FUSION_WORLD_SIZE`, `FUSION_MASTER_*`.
    Fusion,
    /// torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_*`.
    Torchrun,
}

/// Like [`launch`], for any executable and either launcher's variables.
#[allow(clippy::too_many_arguments)]
pub fn launch_exe(
    exe: &std::path::Path,
    vars: Vars,
    size: usize,
    ranks: &[usize],
    args: &[&str],
    env: &[(&str, String)],
    per_rank: impl Fn(usize) -> Vec<(String, String)>,
    limit: Duration,
) -> Vec<Ended> {
    let port = free_port();
    let start = Instant::now();
    let mut children: Vec<(usize, Child)> = ranks
        .iter()
        .map(|&r| {
            let mut cmd = Command::new(exe);
            cmd.args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .env("FUSION_BACKEND", "cpu")
                .env("RUST_BACKTRACE", "0");
            for k in [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "SLURM_PROCID",
                "SLURM_STEP_NUM_TASKS",
                "FUSION_DEVICES",
                "FUSION_RANK",
                "FUSION_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE",
            ] {
                cmd.env_remove(k);
            }
            let (rank, world, addr, port_var) = match vars {
                Vars::Fusion => (
                    "FUSION_RANK",
                    "FUSION_WORLD_SIZE",
                    "FUSION_MASTER_ADDR",
                    "FUSION_MASTER_PORT",
                ),
                Vars::Torchrun => ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
            };
            cmd.env(rank, r.to_string())
                .env(world, size.to_string())
                .env(addr, "127.0.0.1")
                .env(port_var, port.to_string());
            if vars == Vars::Torchrun {
                cmd.env("LOCAL_RANK", r.to_string())
                    .env("LOCAL_WORLD_SIZE", size.to_string());
            }
            for (k, v) in env {
                cmd.env(k, v);
            }
            for (k, v) in per_rank(r) {
                cmd.env(k, v);
            }
            (r, cmd.spawn().expect("starting a rank process"))
        })
        .collect();
    // Drain the pipes on threads so a chatty child never blocks on a full pipe.
    let readers: Vec<_> = children
        .iter_mut()
        .map(|(_, c)| {
            let mut out = c.stdout.take().expect("piped");
            let mut err = c.stderr.take().expect("piped");
            (
                std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = std::io::Read::read_to_string(&mut out, &mut s);
                    s
                }),
                std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = std::io::Read::read_to_string(&mut err, &mut s);
                    s
                }),
            )
        })
        .collect();
    let mut codes: Vec<Option<(Option<i32>, f64)>> = vec![None; children.len()];
    while codes.iter().any(Option::is_none) {
        for (i, (_, c)) in children.iter_mut().enumerate() {
            if codes[i].is_none() {
                if let Ok(Some(status)) = c.try_wait() {
                    codes[i] = Some((status.code(), start.elapsed().as_secs_f64()));
                }
            }
        }
        if start.elapsed() > limit {
            for (i, (_, c)) in children.iter_mut().enumerate() {
                if codes[i].is_none() {
                    let _ = c.kill();
                    let _ = c.wait();
                    codes[i] = Some((None, start.elapsed().as_secs_f64()));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    children
        .into_iter()
        .zip(readers)
        .zip(codes)
        .map(|(((rank, _), (out, err)), code)| {
            let (code, seconds) = code.expect("waited");
            Ended {
                rank,
                code,
                stdout: out.join().unwrap_or_default(),
                stderr: err.join().unwrap_or_default(),
                seconds,
            }
        })
        .collect()
}

/// Panics with every process's log unless all exited with status 0.
pub fn expect_success(ended: &[Ended]) {
    if ended.iter().any(|e| e.code != Some(0)) {
        let logs: Vec<String> = ended.iter().map(Ended::log).collect();
        panic!("a rank process failed:\n{}", logs.join("\n"));
    }
}
