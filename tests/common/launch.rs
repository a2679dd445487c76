//! Starting a test binary as several processes of one launched world, the way torchrun
//! would (with the explicit `FUSION_*` launcher variables), and collecting what each said.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A free TCP port on this host (bound and released; good enough for one test).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The arguments that run only the ignored test `name` of a test binary, as a child
/// process (its output uncaptured).
pub fn child_args(name: &str) -> Vec<&str> {
    vec![
        "--exact",
        name,
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ]
}

/// Prints a backtrace of the thread that crashes (a segmentation fault or an abort) before
/// the process ends with the signal, so that a rank process's crash says where it was.
pub fn backtrace_on_crash() {
    extern "C" fn on_crash(signal: libc::c_int) {
        let trace = std::backtrace::Backtrace::force_capture();
        eprintln!(
            "CRASH: signal {signal} on thread {:?}\n{trace}",
            std::thread::current().name()
        );
        // SAFETY: back to the default action, then the same signal again: the process ends
        // as it would have.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
    }
    for signal in [libc::SIGSEGV, libc::SIGBUS, libc::SIGABRT] {
        // SAFETY: installing a handler for a fatal signal (diagnostics only).
        unsafe {
            libc::signal(signal, on_crash as *const () as libc::sighandler_t);
        }
    }
}

/// Whether this process was started as a rank of a launched world (launcher variables).
pub fn in_child() -> bool {
    fusion::runtime::world::LaunchSpec::from_env()
        .ok()
        .flatten()
        .is_some()
}

/// The launched world this process is a rank of; when it cannot be made, prints
/// `JOIN-ERROR: <error>` and exits with status 2 (what the bootstrap tests look for).
pub fn world_or_exit() -> fusion::World {
    fusion::World::from_env().unwrap_or_else(|e| {
        eprintln!("JOIN-ERROR: {e}");
        std::process::exit(2)
    })
}

/// Joins the launched world ([`world_or_exit`]), gathers a value from every rank, and
/// prints `JOINED rank [..]`.
pub fn join_and_report() {
    use fusion::{DType, Tensor};
    let world = world_or_exit();
    let all = world
        .run(|rank| rank.gather_to_host(&Tensor::full(&[1], DType::F32, rank.index() as f32)))
        .unwrap();
    assert_eq!(all[0].len(), world.size());
    println!("JOINED rank {:?}", world.local_ranks());
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
    start_exe(exe, vars, size, ranks, args, env, per_rank).finish(limit)
}

/// Processes of a launched world that are still running: their output so far can be read
/// and they can be signalled before [`Running::finish`] collects them.
pub struct Running {
    start: Instant,
    children: Vec<(usize, Child)>,
    /// Each process's stdout and stderr so far, read on threads as it comes.
    output: Vec<(Said, Said)>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

/// What one stream of a process has said so far.
type Said = Arc<Mutex<String>>;

/// Copies everything `from` says into `into`, as it comes.
fn collect(
    mut from: impl Read + Send + 'static,
    into: Arc<Mutex<String>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = from.read(&mut buf) {
            if n == 0 {
                break;
            }
            into.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    })
}

impl Running {
    /// The index in this launch of `rank`.
    fn position(&self, rank: usize) -> usize {
        self.children
            .iter()
            .position(|(r, _)| *r == rank)
            .expect("a launched rank")
    }

    /// `rank`'s process id.
    pub fn pid(&self, rank: usize) -> u32 {
        self.children[self.position(rank)].1.id()
    }

    /// Waits until `rank`'s stdout contains `needle` (false after `limit`, or once the
    /// process has exited without saying it).
    pub fn wait_for_output(&mut self, rank: usize, needle: &str, limit: Duration) -> bool {
        let i = self.position(rank);
        let said =
            |o: &Arc<Mutex<String>>| o.lock().unwrap_or_else(|p| p.into_inner()).contains(needle);
        let start = Instant::now();
        while start.elapsed() < limit {
            if said(&self.output[i].0) {
                return true;
            }
            if matches!(self.children[i].1.try_wait(), Ok(Some(_))) {
                std::thread::sleep(Duration::from_millis(100)); // its last output
                return said(&self.output[i].0);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Sends `signal` (`KILL`, `STOP`, `CONT`, ...) to `rank`'s process.
    pub fn signal(&self, rank: usize, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid(rank).to_string())
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -{signal} of rank {rank}: {status}");
    }

    /// Seconds since the processes started.
    pub fn seconds(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// Waits until every process has exited or `until(rank)` says to stop waiting for it
    /// (for a process the test froze); kills what is still running after `limit`, then
    /// every process not yet ended (so none outlives the test), and collects them all.
    pub fn finish_when(
        mut self,
        limit: Duration,
        mut keep_waiting: impl FnMut(usize, &[Option<(Option<i32>, f64)>]) -> bool,
    ) -> Vec<Ended> {
        let mut codes: Vec<Option<(Option<i32>, f64)>> = vec![None; self.children.len()];
        loop {
            for (i, (_, c)) in self.children.iter_mut().enumerate() {
                if codes[i].is_none() {
                    if let Ok(Some(status)) = c.try_wait() {
                        codes[i] = Some((status.code(), self.start.elapsed().as_secs_f64()));
                    }
                }
            }
            let waiting: Vec<usize> = (0..self.children.len())
                .filter(|&i| codes[i].is_none())
                .collect();
            let go_on = waiting
                .iter()
                .any(|&i| keep_waiting(self.children[i].0, &codes));
            if waiting.is_empty() || !go_on || self.start.elapsed() > limit {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for (i, (_, c)) in self.children.iter_mut().enumerate() {
            if codes[i].is_none() {
                let _ = c.kill();
                let _ = c.wait();
                codes[i] = Some((None, self.start.elapsed().as_secs_f64()));
            }
        }
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        self.children
            .iter()
            .zip(&self.output)
            .zip(codes)
            .map(|(((rank, _), (out, err)), code)| {
                let (code, seconds) = code.expect("waited");
                let text =
                    |s: &Arc<Mutex<String>>| s.lock().unwrap_or_else(|p| p.into_inner()).clone();
                Ended {
                    rank: *rank,
                    code,
                    stdout: text(out),
                    stderr: text(err),
                    seconds,
                }
            })
            .collect()
    }

    /// Waits for every process (killing any still running after `limit`).
    pub fn finish(self, limit: Duration) -> Vec<Ended> {
        self.finish_when(limit, |_, _| true)
    }
}

/// Starts `exe` once per rank in `ranks` of a world of `size` (see [`launch_exe`]).
pub fn start_exe(
    exe: &std::path::Path,
    vars: Vars,
    size: usize,
    ranks: &[usize],
    args: &[&str],
    env: &[(&str, String)],
    per_rank: impl Fn(usize) -> Vec<(String, String)>,
) -> Running {
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
                "FUSION_JOB_TOKEN",
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
    let mut output = Vec::new();
    let mut readers = Vec::new();
    for (_, c) in children.iter_mut() {
        let (out, err) = (
            Arc::new(Mutex::new(String::new())),
            Arc::new(Mutex::new(String::new())),
        );
        readers.push(collect(c.stdout.take().expect("piped"), out.clone()));
        readers.push(collect(c.stderr.take().expect("piped"), err.clone()));
        output.push((out, err));
    }
    Running {
        start,
        children,
        output,
        readers,
    }
}

/// Panics with every process's log unless all exited with status 0.
pub fn expect_success(ended: &[Ended]) {
    if ended.iter().any(|e| e.code != Some(0)) {
        let logs: Vec<String> = ended.iter().map(Ended::log).collect();
        panic!("a rank process failed:\n{}", logs.join("\n"));
    }
}
