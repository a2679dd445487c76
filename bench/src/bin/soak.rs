//! Soak: calls one small fusion many times and reports whether memory stays flat: host
//! RSS (`VmRSS` of `/proc/self/status`), each device's memory in use (`cuMemGetInfo`, and
//! the stream-ordered pool's used and reserved bytes) and the copy-engine transfer events
//! alive, at checkpoints, then the growth after the warm-up.
//!
//! Two phases: `--calls N` calls inside one `World::run` (checkpoints every N/10), then,
//! with `--runs R`, R runs of one call each (what a caller that opens a run per step
//! does; checkpoints every R/10). The first checkpoint of each phase is its baseline.
//! Exits with status 1 when host or device memory grew by more than `--limit-kb` after
//! it, or the events alive grew.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin soak -- --devices 2 --calls 10000 --runs 500
//! cargo run --release -p fusion-bench --bin soak -- --fusion collective --calls 100000 --json soak.jsonl
//! ```

use std::io::Write;

use clap::{Parser, ValueEnum};
use fusion::prelude::*;
use fusion::runtime::backend::DeviceMemory;
use fusion_bench::Dt;

fusion! {
    /// AllGather + GEMM as a P2P pipeline: chunk `i` arrives while chunk `i - 1` is
    /// multiplied.
    #[allow(dead_code)] // the soak calls `ag_gemm_p2p::call`, which takes options
    pub fn ag_gemm_p2p<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [d @ Stream, m, n]> {
        matmul(a, b)
    }

    /// AllGather + GEMM pipelined over `s` chunks with collectives.
    #[allow(dead_code)]
    pub fn ag_gemm_collective<T: Float, s, d, m, k, n>(
        a: Tensor<T, [s, d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [s @ Stream, d, m, n]> {
        matmul(a, b)
    }
}

/// Which fusion the soak calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Which {
    /// AllGather + GEMM, P2P pipeline (copy engines on GPUs).
    P2p,
    /// AllGather + GEMM, collective pipeline (NCCL Allgather per chunk on GPUs).
    Collective,
}

/// Calls a small fusion many times and reports host and device memory at checkpoints.
#[derive(Parser, Debug)]
struct Cli {
    /// Devices [default: every GPU, else 4 simulated CPU devices]
    #[arg(long)]
    devices: Option<usize>,
    /// The fusion
    #[arg(long, value_enum, default_value_t = Which::P2p)]
    fusion: Which,
    /// Element type
    #[arg(long, value_enum, default_value_t = Dt::Bf16)]
    dtype: Dt,
    /// Worker streams
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Calls inside one world run (0: skip this phase)
    #[arg(long, default_value_t = 10_000)]
    calls: usize,
    /// World runs of one call each (0: skip this phase)
    #[arg(long, default_value_t = 0)]
    runs: usize,
    /// Checkpoints per phase (the first is the baseline)
    #[arg(long, default_value_t = 10)]
    checkpoints: usize,
    /// Rows per device, contraction and columns of the GEMM
    #[arg(short, default_value_t = 64)]
    m: usize,
    #[arg(short, default_value_t = 128)]
    k: usize,
    #[arg(short, default_value_t = 128)]
    n: usize,
    /// Chunks of the collective pipeline
    #[arg(short, default_value_t = 2)]
    s: usize,
    /// Largest growth after the baseline accepted, in kB (host RSS and each device)
    #[arg(long, default_value_t = 1024)]
    limit_kb: u64,
    /// Also append every checkpoint to this file as a JSON line
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// Memory at one checkpoint.
#[derive(Clone, Debug)]
struct Checkpoint {
    phase: &'static str,
    /// Calls (or runs) done so far in this phase.
    done: usize,
    /// Each rank's process's resident set, in rank order (one process for every rank of
    /// a world of threads).
    rss_kb: Vec<Option<u64>>,
    devices: Vec<Option<DeviceMemory>>,
    events: usize,
    seconds: f64,
}

/// This process's resident set in kB (`VmRSS`), where `/proc` has it.
fn rss_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// One rank's inputs, on its device.
enum Inputs {
    P2p(Ranked<3>, Ranked<2>),
    Collective(Ranked<4>, Ranked<2>),
}

struct Soak {
    cli: Cli,
    a: Tensor,
    b: Tensor,
    opts: ExecOptions,
    start: std::time::Instant,
}

impl Soak {
    fn inputs(&self, rank: &Rank) -> fusion::Result<Inputs> {
        let axis = match self.cli.fusion {
            Which::P2p => 0,
            Which::Collective => 1,
        };
        let a = rank.shard(&self.a, axis)?;
        let b = rank.to_device(&self.b)?.try_into()?;
        Ok(match self.cli.fusion {
            Which::P2p => Inputs::P2p(a.try_into()?, b),
            Which::Collective => Inputs::Collective(a.try_into()?, b),
        })
    }

    /// One call; waits for the device so that the queue does not grow.
    fn call(&self, rank: &Rank, inputs: &Inputs) -> fusion::Result<()> {
        match inputs {
            Inputs::P2p(a, b) => drop(ag_gemm_p2p::call(rank, a, b, &self.opts)?),
            Inputs::Collective(a, b) => drop(ag_gemm_collective::call(rank, a, b, &self.opts)?),
        }
        rank.synchronize()
    }

    /// Every rank: reads its device's memory and its process's; rank 0 gathers them (which
    /// also lines the ranks up).
    fn checkpoint(
        &self,
        rank: &Rank,
        phase: &'static str,
        done: usize,
    ) -> fusion::Result<Option<Checkpoint>> {
        rank.synchronize()?;
        let mine = rank.device().memory()?;
        let mut encoded: Vec<i64> = vec![rss_kb().map_or(-1, |v| v as i64)];
        encoded.extend(match mine {
            Some(m) => [m.total, m.used, m.pool_used, m.pool_reserved].map(|x| x as i64),
            None => [-1; 4],
        });
        let all = rank.communicator().exchange(&encoded)?;
        if rank.index() != 0 {
            return Ok(None);
        }
        let known = |v: i64| (v >= 0).then_some(v as u64);
        let rss_kb = all
            .iter()
            .map(|v| v.first().and_then(|&x| known(x)))
            .collect();
        let devices = all
            .iter()
            .map(|v| {
                (v.len() == 5 && v[1] >= 0).then(|| DeviceMemory {
                    total: v[1] as usize,
                    used: v[2] as usize,
                    pool_used: v[3] as usize,
                    pool_reserved: v[4] as usize,
                })
            })
            .collect();
        Ok(Some(Checkpoint {
            phase,
            done,
            rss_kb,
            devices,
            events: fusion::runtime::comm::copy_engine_events_alive(),
            seconds: self.start.elapsed().as_secs_f64(),
        }))
    }

    /// `calls` calls in one run, a checkpoint every `calls / checkpoints`.
    fn calls_phase(&self, world: &World) -> fusion::Result<Vec<Checkpoint>> {
        let calls = self.cli.calls;
        let every = (calls / self.cli.checkpoints.max(1)).max(1);
        let per_rank = world.run(|rank| {
            let inputs = self.inputs(rank)?;
            let mut points = Vec::new();
            for i in 1..=calls {
                self.call(rank, &inputs)?;
                if i % every == 0 {
                    points.extend(self.checkpoint(rank, "calls", i)?);
                }
            }
            Ok(points)
        })?;
        Ok(per_rank.into_iter().next().unwrap_or_default())
    }

    /// `runs` world runs of one call each, a checkpoint every `runs / checkpoints`.
    fn runs_phase(&self, world: &World) -> fusion::Result<Vec<Checkpoint>> {
        let runs = self.cli.runs;
        let every = (runs / self.cli.checkpoints.max(1)).max(1);
        let mut points = Vec::new();
        for i in 1..=runs {
            let per_rank = world.run(|rank| {
                let inputs = self.inputs(rank)?;
                self.call(rank, &inputs)?;
                drop(inputs);
                if i % every == 0 {
                    return self.checkpoint(rank, "runs", i);
                }
                Ok(None)
            })?;
            points.extend(per_rank.into_iter().flatten());
        }
        Ok(points)
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn json_line(c: &Checkpoint, fusion: Which, backend: &str) -> String {
    let devices: Vec<String> = c
        .devices
        .iter()
        .map(|d| match d {
            Some(m) => format!(
                "{{\"total\": {}, \"used\": {}, \"pool_used\": {}, \"pool_reserved\": {}}}",
                m.total, m.used, m.pool_used, m.pool_reserved
            ),
            None => "null".into(),
        })
        .collect();
    let rss: Vec<String> = c
        .rss_kb
        .iter()
        .map(|r| r.map_or("null".into(), |v| v.to_string()))
        .collect();
    format!(
        "{{\"fusion\": \"{fusion:?}\", \"backend\": \"{backend}\", \"phase\": \"{}\", \"done\": {}, \
         \"rss_kb\": [{}], \"devices\": [{}], \"copy_engine_events\": {}, \"seconds\": {:.3}}}",
        c.phase,
        c.done,
        rss.join(", "),
        devices.join(", "),
        c.events,
        c.seconds
    )
}

/// The largest growth of any rank's process RSS from `base` to `c`, in kB.
fn rss_growth(c: &Checkpoint, base: &Checkpoint) -> Option<i64> {
    c.rss_kb
        .iter()
        .zip(&base.rss_kb)
        .filter_map(|(a, b)| Some((*a)? as i64 - (*b)? as i64))
        .max()
}

/// Prints a phase's table and its growth after the baseline; true when flat.
fn report(points: &[Checkpoint], unit: &str, limit_kb: u64) -> bool {
    let Some(base) = points.first() else {
        return true;
    };
    let n = base.devices.len();
    print!("  {unit:>8} {:>12} {:>9}", "host RSS kB", "+kB");
    for d in 0..n {
        print!(" {:>12} {:>9}", format!("dev{d} MiB"), format!("pool{d}"));
    }
    println!(" {:>7} {:>8}", "events", "seconds");
    for c in points {
        let rss = match c.rss_kb.first() {
            Some(Some(v)) => v.to_string(),
            _ => "-".into(),
        };
        let delta = rss_growth(c, base).map_or("-".into(), |g| format!("{g:+}"));
        print!("  {:>8} {rss:>12} {delta:>9}", c.done);
        for d in &c.devices {
            match d {
                Some(m) => print!(" {:>12.1} {:>9.1}", mib(m.used), mib(m.pool_reserved)),
                None => print!(" {:>12} {:>9}", "-", "-"),
            }
        }
        println!(" {:>7} {:>8.1}", c.events, c.seconds);
    }
    let last = points.last().expect("non-empty");
    let host = rss_growth(last, base).unwrap_or(0);
    let device_kb: Vec<i64> = last
        .devices
        .iter()
        .zip(&base.devices)
        .map(|(a, b)| match (a, b) {
            (Some(a), Some(b)) => (a.used as i64 - b.used as i64) / 1024,
            _ => 0,
        })
        .collect();
    let events = last.events as i64 - base.events as i64;
    let flat =
        host <= limit_kb as i64 && device_kb.iter().all(|&g| g <= limit_kb as i64) && events <= 0;
    println!(
        "  growth after the baseline ({} -> {} {unit}): host RSS {host:+} kB, devices {:?} kB, \
         copy-engine events {events:+}: {}",
        base.done,
        last.done,
        device_kb,
        if flat { "flat" } else { "NOT FLAT" }
    );
    flat
}

fn main() -> std::process::ExitCode {
    fusion_bench::finish::finish(run())
}

fn run() -> fusion::Result<()> {
    let cli = Cli::parse();
    let world = World::auto(cli.devices)?;
    let (d, m, k, n, s) = (world.size(), cli.m, cli.k, cli.n, cli.s);
    let dtype = cli.dtype.dtype();
    let a = match cli.fusion {
        Which::P2p => Tensor::randn(&[d, m, k], dtype, 1),
        Which::Collective => Tensor::randn(&[s, d, m, k], dtype, 1),
    };
    let soak = Soak {
        a,
        b: Tensor::randn(&[k, n], dtype, 2),
        opts: ExecOptions {
            number_of_streams: cli.streams,
            lower: fusion::LowerOptions {
                pipelines: fusion::PipelineOptions {
                    pipelining: fusion::Pipelining::Always, // the pipeline's calls are soaked
                    ..Default::default()
                },
                ..fusion::LowerOptions::default()
            },
            ..ExecOptions::default()
        },
        start: std::time::Instant::now(),
        cli,
    };
    let backend = world.backend().name();
    println!(
        "soak: AG+GEMM {:?} pipeline, backend {backend}, {d} devices, {}, m {m} k {k} n {n}, \
         {} streams",
        soak.cli.fusion, dtype, soak.cli.streams
    );
    let mut json = match &soak.cli.json {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| fusion::Error::World(format!("{}: {e}", p.display())))?,
        ),
        None => None,
    };
    let mut flat = true;
    for (phase, unit, count) in [
        ("calls", "calls", soak.cli.calls),
        ("runs", "runs", soak.cli.runs),
    ] {
        if count == 0 {
            continue;
        }
        let points = if phase == "calls" {
            println!("{count} calls in one world run:");
            soak.calls_phase(&world)?
        } else {
            println!("{count} world runs of one call each:");
            soak.runs_phase(&world)?
        };
        if let Some(f) = json.as_mut() {
            for c in &points {
                writeln!(f, "{}", json_line(c, soak.cli.fusion, backend))
                    .map_err(|e| fusion::Error::World(format!("writing JSON: {e}")))?;
            }
        }
        flat &= report(&points, unit, soak.cli.limit_kb);
    }
    if !flat {
        return Err(fusion::Error::World(format!(
            "memory grew by more than {} kB after the baseline",
            soak.cli.limit_kb
        )));
    }
    Ok(())
}
