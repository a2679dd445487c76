//! One rank's run: the layer, a warm-up, the timed prefill steps (each from an empty
//! cache), the timed decode steps (eager, or replays of the recorded step with `--graph`),
//! then the check of every output against candle alone in f32 and the exchange of every
//! rank's times.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use fusion::prelude::*;

use crate::app::{Mode, Plan};
use crate::cache::positions;
use crate::calls::{CallTimes, Replays};
use crate::config::{self, Config};
use crate::graph::StepGraph;
use crate::layer::{Form, Part, RankLayer, StepIn};
use crate::reference::Reference;
use crate::sections::{describe, Sections};
use crate::tp::{self, AllReduce};

/// What every rank runs.
pub struct Setup<'a> {
    pub plan: Plan,
    pub cfg: Config,
    pub dtype: CDType,
    pub weights: &'a Path,
    /// Every token of every step, `[tokens, hidden]` f32 on the host: the prefill's, then
    /// each decode step's.
    pub inputs: &'a CTensor,
}

/// One rank's times and call counts, as every rank learns them.
#[derive(Clone, Debug, Default)]
pub struct RankTimes {
    pub prefill_ms: Vec<f64>,
    pub decode_ms: Vec<f64>,
    /// Fusion calls (all, replayed) of the timed prefill and decode steps.
    pub prefill_calls: (usize, usize),
    pub decode_calls: (usize, usize),
}

/// What one rank measured and checked.
pub struct RankRun {
    pub index: usize,
    /// How this rank's fusion calls ran in the timed prefill and decode steps.
    pub prefill_calls: Replays,
    pub decode_calls: Replays,
    /// Nodes of the recorded decode step, the fusion calls in it and its nodes by kind,
    /// child graphs' counted in (`--graph` on a GPU).
    pub graph: Option<(usize, usize, String)>,
    /// Every rank's times, in rank order.
    pub ranks: Vec<RankTimes>,
    /// Relative error of every checked output (rank 0 only): the first prefill, then
    /// every decode step.
    pub errors: Vec<f64>,
    /// The largest relative difference of a timed prefill's output from the first's.
    pub rep_spread: f64,
    /// Tensors the runtime copied from a device to the host during the timed steps.
    pub host_copies: u64,
}

/// One step's input for this rank, on its device.
struct StepData {
    /// Every token (`Form::Tp`) or this rank's padded rows (`Form::Sp`), in the dtype.
    x: CTensor,
    /// `[tokens]` `u32`.
    positions: CTensor,
    start: usize,
    tokens: usize,
    form: Form,
}

impl StepData {
    /// Tokens `start..start + tokens` of `s.inputs` for `rank` in `form`.
    fn new(
        s: &Setup,
        rank: &Rank,
        device: &Device,
        form: Form,
        start: usize,
        tokens: usize,
    ) -> candle_core::Result<Self> {
        let all = s.inputs.narrow(0, start, tokens)?;
        let x = match form {
            Form::Tp => all,
            Form::Sp => {
                let (d, m) = (rank.world_size(), tokens.div_ceil(rank.world_size()));
                all.pad_with_zeros(0, 0, d * m - tokens)?
                    .narrow(0, rank.index() * m, m)?
            }
        };
        Ok(StepData {
            x: x.to_dtype(s.dtype)?.to_device(device)?.force_contiguous()?,
            positions: positions(start, tokens, device)?,
            start,
            tokens,
            form,
        })
    }

    /// The step, reading the cache up to its last token.
    fn step_in(&self) -> StepIn<'_> {
        StepIn {
            x: &self.x,
            positions: &self.positions,
            keys: self.start + self.tokens,
        }
    }
}

/// Times steps alike on every rank: every rank starts a step together (a host exchange,
/// outside the time), and a step ends when candle's stream and the rank's own streams
/// are idle.
struct Clock<'a> {
    rank: &'a Rank,
    device: &'a Device,
}

impl Clock<'_> {
    fn time<T>(
        &self,
        step: impl FnOnce() -> fusion_candle::Result<T>,
    ) -> fusion_candle::Result<(T, f64)> {
        self.rank.communicator().exchange(&[])?;
        let start = Instant::now();
        let out = step()?;
        self.device.synchronize()?;
        self.rank.synchronize()?;
        Ok((out, start.elapsed().as_secs_f64() * 1e3))
    }
}

/// This rank's part of the run.
pub fn run_rank(rank: &Rank, s: &Setup) -> fusion_candle::Result<RankRun> {
    let plan = s.plan;
    let device = candle_device(rank)?;
    let weights = config::load_weights(s.weights, &Device::Cpu)?;
    let mut layer = make_layer(rank, s, &weights, &device)?;
    #[cfg(feature = "candle-cuda")]
    let stream = fusion_candle::stream_of(&device);
    #[cfg(feature = "candle-cuda")]
    let on = stream.as_ref().map(|st| rank.on(st));
    #[cfg(feature = "candle-cuda")]
    let call: &dyn CallTarget = match &on {
        Some(on) => on,
        None => rank,
    };
    #[cfg(not(feature = "candle-cuda"))]
    let call: &dyn CallTarget = rank;
    // Every step's input on the device before anything is timed.
    let (p, t) = (plan.prefill, plan.decode_tokens);
    let prefill = (plan.prefill_reps() > 0)
        .then(|| StepData::new(s, rank, &device, plan.prefill_form, 0, p))
        .transpose()?;
    let decode = (0..plan.decode_steps())
        .map(|i| StepData::new(s, rank, &device, plan.decode_form, p + i * t, t))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let graph = warm_up(&mut layer, call, &plan, prefill.as_ref(), &decode, &device)?;
    // The recorded step's marks (`--graph --sections`), kept for its replays.
    let recorded_sections = layer.sections.take();
    device.synchronize()?;
    rank.synchronize()?;
    let clock = Clock {
        rank,
        device: &device,
    };
    let copies = || fusion::runtime::counters::counters().device_to_host_copies;
    let before = copies();
    let mut prefilled = Prefilled::default();
    let sections = |on: bool| on.then(|| Sections::new(&device));
    layer.sections = sections(plan.sections && prefill.is_some());
    layer.calls.times = plan.sections.then(CallTimes::default);
    if let Some(p) = &prefill {
        prefilled = time_prefill(&mut layer, call, &clock, p, plan.prefill_reps())?;
    }
    let prefill_sections = layer.sections.take();
    let prefill_calls = layer.calls.times.take();
    layer.calls.times = plan.sections.then(CallTimes::default);
    layer.sections = match graph {
        Some(_) => recorded_sections,
        None => sections(plan.sections && !decode.is_empty()),
    };
    let decoded = time_decode(&mut layer, call, &clock, &decode, graph.as_ref())?;
    for (kind, s, calls) in [
        ("prefill", prefill_sections, prefill_calls),
        ("decode", layer.sections.take(), layer.calls.times.take()),
    ] {
        if let Some(s) = s {
            println!("rank {}: {}", rank.index(), describe(kind, &s.medians()));
        }
        if let Some(c) = calls.filter(|c| !c.is_empty()) {
            println!("rank {}: {}", rank.index(), c.describe(kind));
        }
    }
    let host_copies = copies() - before;
    let first = prefilled.first.take().into_iter().zip(&prefill);
    let outputs = first.chain(decoded.outputs.into_iter().zip(&decode));
    let errors = check(rank, s, &weights, &device, outputs)?;
    let ranks = exchange_times(
        rank,
        &prefilled.ms,
        &decoded.ms,
        &prefilled.calls,
        &decoded.calls,
    )?;
    Ok(RankRun {
        index: rank.index(),
        prefill_calls: prefilled.calls,
        decode_calls: decoded.calls,
        graph: graph.as_ref().and_then(StepGraph::size),
        ranks,
        errors,
        rep_spread: prefilled.spread,
        host_copies,
    })
}

/// The candle device of a rank: the CPU for simulated devices; for the rank on GPU `n`,
/// `cuda:n` on a stream of its own (a non-blocking stream can be captured while other
/// threads of the process use their GPUs), without cudarc's per-buffer events.
fn candle_device(rank: &Rank) -> fusion_candle::Result<Device> {
    match rank.backend() {
        BackendKind::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "candle-cuda")]
        BackendKind::Cuda => {
            let device = Device::new_cuda_with_stream(rank.device().ordinal())?;
            if let Device::Cuda(d) = &device {
                // SAFETY: candle's work for this rank is all on this device's one stream
                // (fusion calls order themselves after it), so the events would order
                // nothing; tensors made before this call (none yet) would keep theirs.
                unsafe { d.disable_event_tracking() };
            }
            Ok(device)
        }
        #[allow(unreachable_patterns)]
        other => Err(candle_core::Error::msg(format!(
            "the {} backend needs a build with the `candle-cuda` feature",
            other.name()
        ))
        .into()),
    }
}

/// The layer under test for this rank: its part, and what sums its row-parallel
/// projections.
fn make_layer(
    rank: &Rank,
    s: &Setup,
    weights: &std::collections::HashMap<String, CTensor>,
    device: &Device,
) -> fusion_candle::Result<RankLayer> {
    let mine = Part {
        index: rank.index(),
        count: rank.world_size(),
    };
    let identity: AllReduce = Box::new(Ok);
    let (part, fusions_of, all_reduce) = match s.plan.mode {
        Mode::Fusions => (mine, Some(rank), identity),
        Mode::CandleTp => (mine, None, tp::all_reduce(rank, device)?),
        Mode::Candle => (Part { index: 0, count: 1 }, None, identity),
    };
    let capacity = s.plan.capacity();
    RankLayer::new(
        s.cfg,
        weights,
        part,
        s.dtype,
        device,
        capacity,
        s.plan.layers,
        fusions_of,
        all_reduce,
    )
}

/// Runs every kind of step once before the timing (kernels compiled and loaded, GEMM
/// plans, lowering, the fusions' graphs captured at the second call of each shape): a
/// prefill and two decode steps, or, with `--graph`, the decode step recorded after its
/// own warm-up runs. The steps write keys and values that the timed steps write again
/// before anything reads them.
fn warm_up(
    layer: &mut RankLayer,
    call: &dyn CallTarget,
    plan: &Plan,
    prefill: Option<&StepData>,
    decode: &[StepData],
    device: &Device,
) -> fusion_candle::Result<Option<StepGraph>> {
    if let Some(p) = prefill {
        layer.forward(call, p.form, &p.step_in())?;
    }
    let graph = match decode.first() {
        Some(d) if plan.graph => Some(StepGraph::record(
            layer,
            call,
            d.form,
            &d.x,
            &d.positions,
            device,
            plan.sections,
        )?),
        _ => {
            for d in decode.iter().take(2) {
                layer.forward(call, d.form, &d.step_in())?;
            }
            None
        }
    };
    layer.calls.take();
    Ok(graph)
}

/// The timed prefill steps.
#[derive(Default)]
struct Prefilled {
    ms: Vec<f64>,
    calls: Replays,
    /// The first step's output (checked against the reference).
    first: Option<CTensor>,
    spread: f64,
}

/// `reps` prefill steps, each from an empty cache (position 0); every output after the
/// first is compared with the first on the device, after its timing.
fn time_prefill(
    layer: &mut RankLayer,
    call: &dyn CallTarget,
    clock: &Clock,
    p: &StepData,
    reps: usize,
) -> fusion_candle::Result<Prefilled> {
    let mut out = Prefilled::default();
    for _ in 0..reps {
        let (y, ms) = clock.time(|| layer.forward(call, p.form, &p.step_in()))?;
        if let Some(s) = layer.sections.as_mut() {
            s.finish_step()?;
        }
        out.ms.push(ms);
        out.calls.add(&layer.calls.take());
        match &out.first {
            None => out.first = Some(y.copy()?),
            Some(first) => out.spread = out.spread.max(relative_error(&y, first)?),
        }
    }
    Ok(out)
}

/// The timed decode steps.
struct Decoded {
    ms: Vec<f64>,
    calls: Replays,
    outputs: Vec<CTensor>,
}

/// Every decode step, eagerly or as a replay of `graph`; a replay's output is copied out
/// of the graph's buffer after its timing.
fn time_decode(
    layer: &mut RankLayer,
    call: &dyn CallTarget,
    clock: &Clock,
    decode: &[StepData],
    graph: Option<&StepGraph>,
) -> fusion_candle::Result<Decoded> {
    let mut out = Decoded {
        ms: Vec::new(),
        calls: Replays::default(),
        outputs: Vec::new(),
    };
    for d in decode {
        let ((y, calls), ms) = clock.time(|| match graph {
            Some(g) => Ok((None, g.replay(layer, call, &d.x, &d.positions)?)),
            None => {
                let y = layer.forward(call, d.form, &d.step_in())?;
                Ok((Some(y), layer.calls.take()))
            }
        })?;
        if let Some(s) = layer.sections.as_mut() {
            match graph {
                Some(_) => s.finish_replay()?,
                None => s.finish_step()?,
            }
        }
        out.ms.push(ms);
        out.calls.add(&calls);
        let y = match (y, graph) {
            // A copy: a step's output may be a fusion call's slot, which the next step
            // rewrites (made after the timing, like a replay's).
            (Some(y), _) => y.copy()?,
            (None, g) => g
                .ok_or_else(|| fusion_candle::Error::Internal("a replay without a graph".into()))?
                .output()?,
        };
        out.outputs.push(y);
    }
    Ok(out)
}

/// Every output against the reference (candle alone, f32, on rank 0's device), in step
/// order: rows of a sequence-parallel output are gathered from every rank first (every
/// rank takes part); rank 0 compares. Returns the relative errors (none elsewhere).
fn check<'a>(
    rank: &Rank,
    s: &Setup,
    weights: &std::collections::HashMap<String, CTensor>,
    device: &Device,
    outputs: impl Iterator<Item = (CTensor, &'a StepData)>,
) -> fusion_candle::Result<Vec<f64>> {
    let mut reference = (rank.index() == 0)
        .then(|| Reference::new(s.cfg, weights, s.plan.layers, CDType::F32, device))
        .transpose()?;
    let mut errors = Vec::new();
    for (y, step) in outputs {
        let got = match step.form {
            Form::Sp => Some(gather_rows(rank, &y, step.tokens, s.cfg.hidden)?),
            Form::Tp => reference
                .is_some()
                .then(|| y.to_device(&Device::Cpu))
                .transpose()?,
        };
        if let (Some(reference), Some(got)) = (reference.as_mut(), got) {
            let x = s.inputs.narrow(0, step.start, step.tokens)?;
            let want = reference.forward(&x.to_device(device)?)?;
            errors.push(relative_error(&got, &want.to_device(&Device::Cpu)?)?);
        }
    }
    Ok(errors)
}

/// The first `tokens` rows of a sequence-parallel output, gathered from every rank.
fn gather_rows(
    rank: &Rank,
    y: &CTensor,
    tokens: usize,
    hidden: usize,
) -> fusion_candle::Result<CTensor> {
    let mine = fusion_candle::input(rank, "y", y)?;
    let parts = rank.gather_to_host(&mine)?;
    let rows = parts
        .iter()
        .map(|p| {
            let v = p.to_f32_vec()?;
            Ok(CTensor::from_vec(v, (p.shape()[0], hidden), &Device::Cpu)?)
        })
        .collect::<fusion_candle::Result<Vec<_>>>()?;
    Ok(CTensor::cat(&rows, 0)?.narrow(0, 0, tokens)?)
}

/// `‖got − want‖ / ‖want‖`, summed in f64 on the tensors' device.
fn relative_error(got: &CTensor, want: &CTensor) -> candle_core::Result<f64> {
    let f64_of = |t: &CTensor| t.to_dtype(CDType::F32)?.to_dtype(CDType::F64);
    let (got, want) = (f64_of(got)?, f64_of(want)?);
    let diff = (&got - &want)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    let norm = want.sqr()?.sum_all()?.to_scalar::<f64>()?;
    Ok((diff / norm.max(f64::MIN_POSITIVE)).sqrt())
}

/// Every rank's times and call counts (a host exchange among the ranks).
fn exchange_times(
    rank: &Rank,
    prefill_ms: &[f64],
    decode_ms: &[f64],
    prefill: &Replays,
    decode: &Replays,
) -> fusion_candle::Result<Vec<RankTimes>> {
    let ns = |ms: &f64| (ms * 1e6).round() as i64;
    let mut mine = vec![
        prefill.calls as i64,
        prefill.replayed as i64,
        decode.calls as i64,
        decode.replayed as i64,
        prefill_ms.len() as i64,
    ];
    mine.extend(prefill_ms.iter().chain(decode_ms).map(ns));
    let all = rank.communicator().exchange(&mine)?;
    Ok(all
        .iter()
        .map(|v| {
            let (head, times) = v.split_at(5.min(v.len()));
            let count = |i: usize| head.get(i).copied().unwrap_or(0) as usize;
            let ms: Vec<f64> = times.iter().map(|&n| n as f64 / 1e6).collect();
            let (p, d) = ms.split_at(count(4).min(ms.len()));
            RankTimes {
                prefill_ms: p.to_vec(),
                decode_ms: d.to_vec(),
                prefill_calls: (count(0), count(1)),
                decode_calls: (count(2), count(3)),
            }
        })
        .collect())
}
