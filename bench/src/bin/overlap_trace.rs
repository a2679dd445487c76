//! Shows that communication and computation overlap: runs AllGather+matmul pipelined over
//! streams (the P2P pipeline and the collective pipeline), records a timeline of each
//! rank's communications and GEMMs, and reports the intervals where a transfer of one
//! chunk ran while the GEMM of another chunk computed.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin overlap_trace -- --devices 4 --trace-out trace.json
//! ```

use std::time::Instant;

use clap::Parser;
use fusion::compiler::builder::{Axis, FusionBuilder};
use fusion::compiler::ir::Fusion;
use fusion::runtime::trace::{busy_ms, chrome_trace, overlaps};
use fusion::{DType, ExecOptions, FusionExecutor, LowerOptions, Pipelining, Tensor, World};
use fusion_bench::cli::write_file;
use fusion_bench::finish::finish;

#[derive(Parser, Debug)]
struct Args {
    /// Devices (default: every GPU, else 4 simulated devices).
    #[arg(long)]
    devices: Option<usize>,
    /// Rows of A (all ranks together).
    #[arg(short, default_value_t = 8192)]
    m: usize,
    #[arg(short, default_value_t = 8192)]
    k: usize,
    #[arg(short, default_value_t = 8192)]
    n: usize,
    /// Chunks of the collective pipeline.
    #[arg(long, default_value_t = 4)]
    chunks: usize,
    #[arg(long, default_value_t = 4)]
    streams: usize,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// Write a Chrome trace (chrome://tracing, ui.perfetto.dev) of the P2P pipeline here.
    #[arg(long)]
    trace_out: Option<String>,
}

fn p2p_fusion(dt: DType) -> fusion::Result<Fusion> {
    let mut b = FusionBuilder::new();
    let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
    let a = b.input("a", dt, &[Axis::didx(d), Axis::serial(m), Axis::serial(k)])?;
    let w = b.input("b", dt, &[Axis::serial(k), Axis::serial(n)])?;
    let c = b.matmul(a, w)?;
    let c = b.declare(c, dt, &[Axis::stream(d), Axis::serial(m), Axis::serial(n)])?;
    b.output(c)?;
    Ok(b.build()?)
}

fn collective_fusion(dt: DType) -> fusion::Result<Fusion> {
    let mut b = FusionBuilder::new();
    let (s, d, m, k, n) = (
        b.symbol("s"),
        b.symbol("d"),
        b.symbol("m"),
        b.symbol("k"),
        b.symbol("n"),
    );
    let a = b.input(
        "a",
        dt,
        &[
            Axis::serial(s),
            Axis::didx(d),
            Axis::serial(m),
            Axis::serial(k),
        ],
    )?;
    let w = b.input("b", dt, &[Axis::serial(k), Axis::serial(n)])?;
    let c = b.matmul(a, w)?;
    let c = b.declare(
        c,
        dt,
        &[
            Axis::stream(s),
            Axis::serial(d),
            Axis::serial(m),
            Axis::serial(n),
        ],
    )?;
    b.output(c)?;
    Ok(b.build()?)
}

fn main() -> std::process::ExitCode {
    finish(run())
}

fn run() -> fusion::Result<()> {
    let args = Args::parse();
    let dt = DType::from_name(&args.dtype)
        .ok_or_else(|| fusion::Error::World(format!("unknown dtype {}", args.dtype)))?;
    let world = World::auto(args.devices)?;
    let d = world.size();
    if args.m % (d * args.chunks) != 0 {
        return Err(fusion::Error::World(format!(
            "m = {} must be divisible by devices x chunks = {}",
            args.m,
            d * args.chunks
        )));
    }
    println!(
        "backend {} devices {d} dtype {dt} m {} k {} n {}",
        world.backend().name(),
        args.m,
        args.k,
        args.n
    );
    let a_full = Tensor::randn(&[d, args.m / d, args.k], dt, 1);
    let b_full = Tensor::randn(&[args.k, args.n], dt, 2);
    let opts = ExecOptions {
        number_of_streams: args.streams,
        lower: LowerOptions {
            pipelines: fusion::PipelineOptions {
                pipelining: Pipelining::Always, // the pipelines are what it traces, at any size
                ..Default::default()
            },
            ..LowerOptions::default()
        },
        ..ExecOptions::default()
    };
    let traced = ExecOptions {
        trace: true,
        ..opts.clone()
    };
    for (name, fusion, chunks) in [
        ("P2P pipeline", p2p_fusion(dt)?, None),
        (
            "collective pipeline",
            collective_fusion(dt)?,
            Some(args.chunks),
        ),
    ] {
        let exec = FusionExecutor::new(fusion);
        let per_rank = world.run(|rank| {
            let a = match chunks {
                None => rank.shard(&a_full, 0)?,
                // [s, d, m/(s d), k]: this rank's rows split into s chunks.
                Some(s) => {
                    let local = a_full.shard(0, rank.index(), d)?.squeeze(0)?;
                    let chunked = local.contiguous_copy()?.split_axis(0, s)?.unsqueeze(1)?;
                    rank.to_device(&chunked.contiguous_copy()?)?
                }
            };
            let b = rank.to_device(&b_full)?;
            for _ in 0..3 {
                exec.run_with(rank, &[&a, &b], None, &opts)?;
            }
            rank.synchronize()?;
            let t0 = Instant::now();
            let report = exec.run_with(rank, &[&a, &b], None, &traced)?;
            let wall = t0.elapsed().as_secs_f64() * 1e3;
            Ok((rank.index(), report.trace.unwrap_or_default(), wall))
        })?;
        println!("== {name} ({} streams)", args.streams);
        for (r, events, wall) in &per_rank {
            let o = overlaps(events);
            let total = events.iter().map(|e| e.end_ms).fold(0.0, f64::max);
            println!(
                "rank {r}: {} events, comm busy {:.3} ms, compute busy {:.3} ms, span {:.3} ms (wall {wall:.3} ms), {} comm/compute overlaps{}",
                events.len(),
                busy_ms(events, true),
                busy_ms(events, false),
                total,
                o.len(),
                o.first().map_or(String::new(), |x| format!(
                    ", longest {:.3} ms: {} of chunk {:?} on stream {} while {} of chunk {:?} on stream {}",
                    x.ms, x.communication.name, x.communication.chunk, x.communication.stream, x.compute.name, x.compute.chunk, x.compute.stream
                ))
            );
        }
        if let (Some(path), None) = (&args.trace_out, chunks) {
            let ranks: Vec<(usize, Vec<_>)> =
                per_rank.iter().map(|(r, e, _)| (*r, e.clone())).collect();
            write_file(path, chrome_trace(&ranks))?;
            println!("wrote {path}");
        }
    }
    Ok(())
}
