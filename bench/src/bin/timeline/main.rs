//! The overlap as a picture: runs the AllGather + GEMM and the GEMM + ReduceScatter P2P
//! pipelines traced on the default world and draws each call as an SVG timeline (one row
//! per stream per rank, GEMMs and transfers coloured by chunk, time in ms). The traces
//! are written as Chrome trace JSON next to the pictures (`<out>/json/`, open them in
//! ui.perfetto.dev); `--from-json DIR` draws the pictures again from such files.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin timeline -- --out timeline          # on the GPUs
//! cargo run --release -p fusion-bench --bin timeline -- --from-json timeline/json --out timeline
//! ```

mod render;

use std::path::{Path, PathBuf};

use clap::Parser;
use fusion::prelude::*;
use fusion::runtime::trace::{busy_ms, device_events, overlaps, TraceEvent};
use fusion_bench::finish::finish;
use render::{render, Timeline};

fusion! {
    /// AllGather + GEMM as a P2P pipeline: `c[r] = a[r] @ b` for every device's rows `r`.
    #[allow(dead_code)] // called through `run_with`, with options
    pub fn ag_gemm<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [d @ Stream, m, n]> {
        matmul(a, b)
    }

    /// GEMM + ReduceScatter as a P2P pipeline: each device multiplies its block of `k`
    /// for every output block and the partial sums meet at the block's owner.
    #[allow(dead_code)] // called through `run_with`, with options
    pub fn gemm_rs<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, d, m, k]>,
        b: Tensor<T, [d @ DIDx, k, n]>,
    ) -> Tensor<T, [d @ DIDx, m, n]> {
        let partial: Tensor<T, [d @ DIDx, d @ Stream, m, n]> =
            matmul(a, broadcast(b, [false, true, false, false]));
        sum(partial, 0)
    }
}

#[derive(Parser, Debug)]
struct Args {
    /// Devices [default: every GPU, else 4 simulated devices]
    #[arg(long)]
    devices: Option<usize>,
    /// Rows of the whole problem, M [default: 8192 on GPUs, 512 on simulated devices]
    #[arg(short)]
    m: Option<usize>,
    /// Contracted dimension of the whole problem, K [default: as M]
    #[arg(short)]
    k: Option<usize>,
    /// Columns, N [default: as M]
    #[arg(short)]
    n: Option<usize>,
    /// Element type
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Size of the worker stream pool
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Untraced calls before the traced one
    #[arg(long, default_value_t = 3)]
    warmups: usize,
    /// Where the pictures go (and the traces, in `json/`)
    #[arg(long, default_value = "timeline")]
    out: PathBuf,
    /// Draw from the trace files in this directory instead of running (the last call of
    /// each fusion)
    #[arg(long)]
    from_json: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    finish(run())
}

fn io(what: &str, path: &Path, e: impl std::fmt::Display) -> fusion::Error {
    fusion::Error::World(format!("{what} {}: {e}", path.display()))
}

/// One pipeline's traced call: each rank's device intervals.
struct Traced {
    name: &'static str,
    title: &'static str,
    ranks: Vec<(usize, Vec<TraceEvent>)>,
}

fn run() -> fusion::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.out).map_err(|e| io("creating", &args.out, e))?;
    let (traced, details) = match &args.from_json {
        Some(dir) => (from_files(dir)?, format!("drawn from {}", dir.display())),
        None => run_pipelines(&args)?,
    };
    for t in &traced {
        for (r, events) in &t.ranks {
            let o = overlaps(events);
            println!(
                "{} rank {r}: {} intervals, transfers busy {:.3} ms, compute busy {:.3} ms, \
                 {} transfer/compute overlaps",
                t.name,
                events.len(),
                busy_ms(events, true),
                busy_ms(events, false),
                o.len()
            );
        }
        let doc = render(&Timeline {
            title: t.title,
            subtitle: &details,
            ranks: &t.ranks,
        });
        let path = args.out.join(format!("{}.svg", t.name));
        svg::save(&path, &doc).map_err(|e| io("writing", &path, e))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn run_pipelines(args: &Args) -> fusion::Result<(Vec<Traced>, String)> {
    let dt = DType::from_name(&args.dtype)
        .ok_or_else(|| fusion::Error::World(format!("unknown dtype {}", args.dtype)))?;
    let world = World::auto(args.devices)?;
    let d = world.size();
    let default = if world.backend() == BackendKind::Cuda {
        8192
    } else {
        512
    };
    let m = args.m.unwrap_or(default);
    let (k, n) = (args.k.unwrap_or(m), args.n.unwrap_or(m));
    if m % d != 0 || k % d != 0 {
        return Err(fusion::Error::World(format!(
            "M = {m} and K = {k} must be divisible by the {d} devices"
        )));
    }
    let json = args.out.join("json");
    let plain = ExecOptions {
        number_of_streams: args.streams,
        lower: fusion::LowerOptions {
            pipelines: fusion::PipelineOptions {
                pipelining: fusion::Pipelining::Always, // the pipelines are what it draws
                ..Default::default()
            },
            ..fusion::LowerOptions::default()
        },
        ..ExecOptions::default()
    };
    let traced = ExecOptions {
        trace_dir: Some(json.clone()),
        ..plain.clone()
    };
    let device = world
        .run(|rank| {
            #[cfg(feature = "cuda")]
            if let Ok(ctx) = rank.cuda_context() {
                return Ok(ctx.name().unwrap_or_else(|_| "GPU".into()));
            }
            let _ = rank;
            Ok("simulated device".to_string())
        })?
        .remove(0);
    let details = format!(
        "{d} x {device} ({} backend), {dt}, M = {m}, K = {k}, N = {n}, {} streams, \
         default options otherwise",
        world.backend().name(),
        args.streams,
    );

    // AllGather + GEMM: a [M, K] row-sharded, b [K, N] replicated.
    let a = Tensor::randn(&[d, m / d, k], dt, 1);
    let b = Tensor::randn(&[k, n], dt, 2);
    let ag = world.run(|rank| {
        let a: Ranked<3> = rank.shard(&a, 0)?.try_into()?;
        let b: Ranked<2> = rank.to_device(&b)?.try_into()?;
        for _ in 0..args.warmups {
            ag_gemm::run_with(rank, &a, &b, None, &plain)?;
        }
        rank.synchronize()?;
        let report = ag_gemm::run_with(rank, &a, &b, None, &traced)?;
        Ok((rank.index(), report.trace.unwrap_or_default()))
    })?;

    // GEMM + ReduceScatter: a [M, K] and b [K, N] sharded on K; each device keeps M / d rows.
    let a = Tensor::randn(&[d, d, m / d, k / d], dt, 3);
    let b = Tensor::randn(&[d, k / d, n], dt, 4);
    let rs = world.run(|rank| {
        let a: Ranked<4> = rank.shard(&a, 0)?.try_into()?;
        let b: Ranked<3> = rank.shard(&b, 0)?.try_into()?;
        for _ in 0..args.warmups {
            gemm_rs::run_with(rank, &a, &b, None, &plain)?;
        }
        rank.synchronize()?;
        let report = gemm_rs::run_with(rank, &a, &b, None, &traced)?;
        Ok((rank.index(), report.trace.unwrap_or_default()))
    })?;
    Ok((
        vec![
            Traced {
                name: "ag_gemm",
                title: "AllGather + GEMM, P2P pipeline: chunk i+1 arrives while chunk i is multiplied",
                ranks: ag,
            },
            Traced {
                name: "gemm_rs",
                title: "GEMM + ReduceScatter, P2P pipeline: chunk i is sent while chunk i+1 is multiplied",
                ranks: rs,
            },
        ],
        details,
    ))
}

/// The last traced call of each pipeline in `dir` (files `<fusion>-<call>-rank<r>.json`).
fn from_files(dir: &Path) -> fusion::Result<Vec<Traced>> {
    let mut out = Vec::new();
    for (name, title) in [
        ("ag_gemm", "AllGather + GEMM, P2P pipeline"),
        ("gemm_rs", "GEMM + ReduceScatter, P2P pipeline"),
    ] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io("reading", dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|f| f.to_str())
                    .is_some_and(|f| f.starts_with(&format!("{name}-")) && f.ends_with(".json"))
            })
            .collect();
        files.sort();
        // The names sort by call, then rank: keep the last call's files.
        let last_call = files
            .last()
            .and_then(|p| p.file_name()?.to_str()?.split('-').nth(1).map(String::from));
        let mut ranks = Vec::new();
        for path in &files {
            let call = path.file_name().and_then(|f| f.to_str()?.split('-').nth(1));
            if call != last_call.as_deref() {
                continue;
            }
            let text = std::fs::read_to_string(path).map_err(|e| io("reading", path, e))?;
            let trace: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| io("parsing", path, e))?;
            let events = device_events(&trace);
            if let Some(&(rank, _)) = events.first() {
                ranks.push((rank, events.into_iter().map(|(_, e)| e).collect()));
            }
        }
        if !ranks.is_empty() {
            ranks.sort_by_key(|r: &(usize, Vec<TraceEvent>)| r.0);
            out.push(Traced { name, title, ranks });
        }
    }
    Ok(out)
}
