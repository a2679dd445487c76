//! One measured variant: its options, its timed calls on one rank (device-event medians),
//! one more call for the output, the memory and host profile and a trace, the check
//! against the sequential result, and every rank's times gathered in rank order.

use fusion::compiler::hir::Transport;
use fusion::compiler::lower::{LowerOptions, Pipelining};
use fusion::{DType, ExecOptions, FusionExecutor, Rank, Result, Tensor};
use fusion_bench::fusions;
use fusion_bench::measure::{device_ms, rel_error};

use crate::Args;

/// What one rank measured for one variant.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    pub ms: f64,
    pub relerr: f64,
    pub peak_bytes: usize,
    pub nodes: usize,
    /// The timeline of one traced call, when this variant was asked for.
    pub trace: Option<Vec<fusion::runtime::trace::TraceEvent>>,
    /// Host time per node kind of that call: (kind, count, microseconds).
    pub host: Vec<(String, u32, f64)>,
    /// For a call whose plan was chosen: the plan, why, and the host time of its first
    /// call (which tuned it), ms.
    pub plan: Option<(String, String, f64)>,
}

/// One rank's samples, each with its variant's name.
pub type Samples = Vec<(String, Sample)>;

/// Every rank's (ms, relative error) of each variant in `samples`, in rank order: ranks in
/// other processes (a launched world) report theirs through the world.
pub fn gather_times(rank: &Rank, samples: &Samples) -> Result<Vec<Vec<(f64, f64)>>> {
    let flat: Vec<f32> = samples
        .iter()
        .flat_map(|(_, s)| [s.ms as f32, s.relerr as f32])
        .collect();
    let t = Tensor::from_f32(&[samples.len(), 2], &flat, DType::F32)?;
    rank.gather_to_host(&t)?
        .into_iter()
        .map(|t| {
            let v = t.to_f32_vec()?;
            Ok(v.chunks(2)
                .map(|c| (f64::from(c[0]), f64::from(c[1])))
                .collect())
        })
        .collect()
}

/// Options of one variant: `streams` worker streams, the transport of its P2P
/// transfers, stream lowering on or off (off: the sequential program) and per-iteration
/// stream buffers; pipelined at every size.
pub fn opts(
    streams: usize,
    backend: Transport,
    stream_lowering: bool,
    stream_buffers: bool,
) -> ExecOptions {
    // The pipelines are what it measures, at every size of its sweeps.
    let mut lower = LowerOptions::default()
        .with_transport(backend)
        .with_pipelining(Pipelining::Always);
    lower.streams.buffers = stream_buffers;
    if !stream_lowering {
        lower = lower.without_pass("StreamParallelType");
    }
    ExecOptions {
        number_of_streams: streams,
        lower,
        ..ExecOptions::default()
    }
}

/// The call a user gets: default options (the plan chosen per shape, tuned on GPUs at the
/// first call), the plan file at `plan_file` if given. Times the first call (tuning
/// included) on the host, then like every variant.
pub fn default_call(
    rank: &Rank,
    a: &Args,
    exec: &FusionExecutor,
    inputs: &[&Tensor],
    check: Check<'_>,
) -> Result<(Sample, Tensor)> {
    let o = default_options(a);
    rank.synchronize()?;
    let start = std::time::Instant::now();
    let first = exec.run_with(rank, inputs, None, &o)?;
    rank.synchronize()?;
    let first_ms = start.elapsed().as_secs_f64() * 1e3;
    let (mut sample, out) = variant(rank, a, exec, inputs, &o, check)?;
    sample.plan = Some(match &first.plan {
        Some(p) => (p.plan.clone(), format!("{:?}", p.source), first_ms),
        None => ("given".into(), "-".into(), first_ms),
    });
    Ok((sample, out))
}

/// The options of the default call (see [`default_call`]).
pub fn default_options(a: &Args) -> ExecOptions {
    ExecOptions {
        plan_file: a.plan_file.as_ref().map(std::path::PathBuf::from),
        ..ExecOptions::default()
    }
}

/// The default call against the fastest of `options` (named variants of the same fusion
/// and inputs, as this group measured them; rank 0's pick), timed in alternation: 5
/// rounds of `a.iters` calls of each, the median of each side's rounds. Two measurements
/// minutes apart drift by a few percent (clocks, temperature); alternating keeps that out
/// of the comparison. Rows `ab_default` and `ab_best` (the latter named in its sample's
/// plan field).
pub fn default_against_best(
    rank: &Rank,
    a: &Args,
    exec: &FusionExecutor,
    inputs: &[&Tensor],
    options: &[(String, ExecOptions)],
    measured: &Samples,
) -> Result<Samples> {
    let ms = |name: &str| {
        measured
            .iter()
            .find(|(n, _)| n == name)
            .map_or(f64::INFINITY, |(_, s)| s.ms)
    };
    let Some(mine) =
        (0..options.len()).min_by(|&i, &j| ms(&options[i].0).total_cmp(&ms(&options[j].0)))
    else {
        return Ok(Vec::new());
    };
    let pick = rank.communicator().exchange(&[mine as i64])?[0][0] as usize;
    let (name, best) = &options[pick.min(options.len() - 1)];
    let default = default_options(a);
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        x.push(device_ms(rank, a.iters, 2, || {
            exec.run_with(rank, inputs, None, &default).map(|_| ())
        })?);
        y.push(device_ms(rank, a.iters, 2, || {
            exec.run_with(rank, inputs, None, best).map(|_| ())
        })?);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(vec![
        (
            "ab_default".into(),
            Sample {
                ms: median(x),
                ..Sample::default()
            },
        ),
        (
            "ab_best".into(),
            Sample {
                ms: median(y),
                plan: Some((name.clone(), "alternating".into(), 0.0)),
                ..Sample::default()
            },
        ),
    ])
}

/// How a variant's output is compared: the error fusion, the reference, and a view of
/// the output in the reference's layout.
pub type Check<'a> = Option<(
    &'a FusionExecutor,
    &'a Tensor,
    &'a dyn Fn(&Tensor) -> Result<Tensor>,
)>;

/// Times `exec` on `inputs`, checks its output against the reference.
pub fn variant(
    rank: &Rank,
    a: &Args,
    exec: &FusionExecutor,
    inputs: &[&Tensor],
    o: &ExecOptions,
    check: Check<'_>,
) -> Result<(Sample, Tensor)> {
    let ms = device_ms(rank, a.iters, a.warmup, || {
        exec.run_with(rank, inputs, None, o).map(|_| ())
    })?;
    // One more call for the output (replayed where the timed calls were), one walked call
    // for the memory and host profile (a replayed call walks nothing; untraced: trace
    // markers would add host time), and one traced call when traces were asked for.
    let report = exec.run_with(rank, inputs, None, o)?;
    let walked = ExecOptions {
        graphs: false,
        ..o.clone()
    };
    let profile = exec.run_with(rank, inputs, None, &walked)?;
    let trace = if a.trace.is_empty() {
        None
    } else {
        let traced = ExecOptions {
            trace: true,
            ..o.clone()
        };
        exec.run_with(rank, inputs, None, &traced)?.trace
    };
    let out = report.outputs[0].clone();
    let relerr = match check {
        Some((err_exec, reference, view)) => rel_error(rank, err_exec, &view(&out)?, reference)?,
        None => 0.0,
    };
    Ok((
        Sample {
            ms,
            relerr,
            peak_bytes: profile.stats.peak_live_bytes,
            nodes: profile.stats.nodes_executed,
            trace,
            plan: None,
            host: profile
                .stats
                .host_profile()
                .into_iter()
                .map(|(k, h)| (format!("{k:?}"), h.count, h.nanos as f64 / 1e3))
                .collect(),
        },
        out,
    ))
}

/// The executors of every fusion the benchmark times, made once per run.
pub struct Execs {
    pub allgather: FusionExecutor,
    pub gemm: FusionExecutor,
    pub ag_p2p: FusionExecutor,
    pub ag_coll: FusionExecutor,
    pub reduce_scatter: FusionExecutor,
    pub rs_p2p: FusionExecutor,
    pub rs_coll: FusionExecutor,
    pub err: FusionExecutor,
}

impl Execs {
    /// Every fusion's executor in `dt`.
    pub fn new(dt: DType) -> Result<Execs> {
        Ok(Execs {
            allgather: FusionExecutor::new(fusions::allgather(dt)?),
            gemm: FusionExecutor::new(fusions::gemm(dt)?),
            ag_p2p: FusionExecutor::new(fusions::ag_matmul_p2p(dt)?),
            ag_coll: FusionExecutor::new(fusions::ag_matmul_collective(dt)?),
            reduce_scatter: FusionExecutor::new(fusions::reduce_scatter(dt)?),
            rs_p2p: FusionExecutor::new(fusions::matmul_rs_p2p(dt)?),
            rs_coll: FusionExecutor::new(fusions::matmul_rs_collective(dt)?),
            err: FusionExecutor::new(fusions::squared_error(dt)?),
        })
    }
}
