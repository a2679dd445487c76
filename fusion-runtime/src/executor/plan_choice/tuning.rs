//! Timing the candidates of a plan choice on every rank ([`tune`]): each candidate warmed
//! up, its first outputs checked against the reference candidate's, and its batch sized,
//! then rounds of one batch of every candidate in turn, the medians exchanged and the
//! slowest rank's kept.
//!
//! A candidate whose outputs disagree with the reference's (the unpipelined plan where it is
//! a candidate) on any rank is not timed and never chosen: a lowering bug that skips work
//! also runs fast, and tuning would otherwise pick it (it did: a row-range plan whose GEMM
//! rows were never written). The reference's own outputs are only as right as the
//! simplest plan; the tests check every candidate against host references.
//!
//! A batch is timed the way the benchmarks time calls: back to back, by device markers
//! (CUDA events) recorded on the stream the calls end on, around the batch; the host waits
//! once per round, after every candidate's batch is queued. Host timing with a device
//! synchronization around each batch adds the device's idle gap and launch ramp to every
//! sample and ranked candidates of the gated MLP 2-4% differently from the benchmark
//! (`docs/DECISIONS.md`, "Plans"). Traced calls (`FUSION_TRACE`) read and clear the
//! device's markers themselves, so while tracing, batches are timed by the host as before.

use std::time::{Duration, Instant};

use super::{with_plan, Distinct, PlanCall};
use crate::config;
use crate::error::Result;
use crate::executor::lowering::Lowered;
use crate::executor::options::ExecOptions;

/// Bumped whenever how candidates are timed changes (part of the plan file's key, so that
/// plans tuned the old way are tuned again): 2, device markers around back-to-back calls
/// (1 was the host's clock around synchronized batches).
pub(super) const TUNING_REVISION: u32 = 2;
/// Samples per timed candidate (the median counts).
const SAMPLES: usize = 7;
/// A sample lasts about this long (calls are batched up to it).
const SAMPLE_TARGET: Duration = Duration::from_millis(3);
/// Calls per batch at most.
const MAX_BATCH: f64 = 50.0;
/// How far (relative error) a candidate's outputs may be from the reference candidate's:
/// plans sum in different orders, which in bf16 moves results by ~1e-2 at most; a plan
/// that skips work is off by far more (or NaN).
const AGREEMENT: f64 = 5e-2;

/// What tuning found: the slowest rank's median time per call of each candidate (ns,
/// `i64::MAX` for one that disagreed), whether samples were device-timed, and a warning
/// per candidate that disagreed.
pub(super) struct Tuned {
    pub slowest: Vec<i64>,
    pub device_timed: bool,
    pub warnings: Vec<String>,
}

/// How samples are timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Clock {
    /// Device markers around back-to-back calls, one host wait per round.
    Device,
    /// The host's clock, the device synchronized before and after each batch.
    Host,
}

/// The candidates `order` of `call` timed on every rank: the slowest rank's median time
/// per call of each, ns, in that order, and whether the samples were device-timed. Every
/// candidate is warmed up (walked, captured) and its batch sized first; then [`SAMPLES`]
/// rounds time one batch of every candidate in turn (so that the machine's drift over the
/// tuning, clocks and temperature, a few percent over minutes, falls on all candidates
/// alike), each round starting at the next candidate (so that none always comes first).
/// Every rank runs the same calls in the same order.
pub(super) fn tune(call: &PlanCall<'_>, distinct: &[Distinct], order: &[usize]) -> Result<Tuned> {
    // Traced calls read and clear the device's markers.
    let clock = if config::trace_dir().is_some() {
        Clock::Host
    } else {
        Clock::Device
    };
    // The reference first: every other candidate's first outputs are compared with its.
    let reference = order
        .iter()
        .position(|&i| distinct[i].plan.name == "unpipelined")
        .unwrap_or(0);
    let (reference_timer, expected) =
        CandidateTimer::new(call, &distinct[order[reference]], clock)?;
    let mut timers: Vec<Option<CandidateTimer<'_>>> = Vec::with_capacity(order.len());
    let mut disagreements: Vec<Option<String>> = Vec::with_capacity(order.len());
    let mut reference_timer = Some(reference_timer);
    for (j, &i) in order.iter().enumerate() {
        if j == reference {
            timers.push(reference_timer.take());
            disagreements.push(None);
            continue;
        }
        let (timer, outputs) = CandidateTimer::new(call, &distinct[i], clock)?;
        disagreements.push(disagreement(&outputs, &expected));
        timers.push(Some(timer));
    }
    // A candidate wrong on any rank is dropped on every rank.
    let mine: Vec<i64> = disagreements
        .iter()
        .map(|d| i64::from(d.is_some()))
        .collect();
    let wrong = slowest_of(call, &mine)?;
    let mut warnings = Vec::new();
    for (j, &i) in order.iter().enumerate() {
        if wrong[j] != 0 {
            timers[j] = None;
            let here = disagreements[j].as_deref().unwrap_or("on another rank");
            warnings.push(format!(
                "plan candidate `{}` gave other outputs than `{}` ({here}): not chosen;                  please report this lowering bug",
                distinct[i].plan.name,
                distinct[order[reference]].plan.name
            ));
        }
    }
    let live: Vec<usize> = (0..timers.len()).filter(|&j| timers[j].is_some()).collect();
    let live_timers: Vec<&CandidateTimer<'_>> =
        live.iter().filter_map(|&j| timers[j].as_ref()).collect();
    let n = live_timers.len();
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(SAMPLES); n];
    for round in 0..SAMPLES {
        let turn: Vec<usize> = (0..n).map(|j| (round + j) % n).collect();
        let times = time_round(call, &live_timers, &turn, clock)?;
        for (&j, t) in turn.iter().zip(times) {
            samples[j].push(t);
        }
    }
    let medians: Vec<i64> = samples
        .into_iter()
        .map(|mut s| {
            s.sort_by(f64::total_cmp);
            (s[s.len() / 2] as i64).max(1)
        })
        .collect();
    let live_slowest = slowest_of(call, &medians)?;
    let mut slowest = vec![i64::MAX; timers.len()];
    for (&j, t) in live.iter().zip(live_slowest) {
        slowest[j] = t;
    }
    Ok(Tuned {
        slowest,
        device_timed: clock == Clock::Device,
        warnings,
    })
}

/// Why `outputs` (a candidate's, on the host) disagree with `expected` (the reference
/// candidate's), if they do: an output off by more than [`AGREEMENT`], not finite, or of
/// another shape.
fn disagreement(
    outputs: &[crate::tensor::Tensor],
    expected: &[crate::tensor::Tensor],
) -> Option<String> {
    if outputs.len() != expected.len() {
        return Some(format!("{} outputs, not {}", outputs.len(), expected.len()));
    }
    for (k, (got, want)) in outputs.iter().zip(expected).enumerate() {
        match got.rel_error(want) {
            Ok(e) if e <= AGREEMENT => {}
            Ok(e) => return Some(format!("output {k} off by {e:.2e}")),
            Err(e) => return Some(format!("output {k}: {e}")),
        }
    }
    None
}

/// The slowest rank's value of each of `mine` (every rank gives as many).
fn slowest_of(call: &PlanCall<'_>, mine: &[i64]) -> Result<Vec<i64>> {
    let all = call.rank.communicator().exchange(mine)?;
    Ok((0..mine.len())
        .map(|j| {
            all.iter()
                .filter_map(|v| v.get(j))
                .copied()
                .max()
                .unwrap_or(i64::MAX)
        })
        .collect())
}

/// One round: a batch of each timer of `turn`, in that order; the time per call of each,
/// ns. With the device clock the ranks start together, one untimed call of the first
/// candidate leads in (so that the first batch does not carry the ranks' start skew), the
/// batches are queued back to back between markers and the host waits once, at the end.
fn time_round(
    call: &PlanCall<'_>,
    timers: &[&CandidateTimer<'_>],
    turn: &[usize],
    clock: Clock,
) -> Result<Vec<f64>> {
    if clock == Clock::Host {
        return (turn.iter()).map(|&j| timers[j].host_sample()).collect();
    }
    let device = call.rank.device();
    call.rank.communicator().exchange(&[])?;
    if let Some(&first) = turn.first() {
        timers[first].run()?;
    }
    let mut marks = Vec::with_capacity(turn.len());
    for &j in turn {
        let start = device.record_call_marker(call.on)?;
        timers[j].run_batch()?;
        marks.push((start, device.record_call_marker(call.on)?));
    }
    let times = (turn.iter().zip(&marks))
        .map(|(&j, &(a, b))| {
            let ms = device.marker_elapsed_ms(a, b)?;
            Ok(ms * 1e6 / f64::from(timers[j].batch))
        })
        .collect::<Result<Vec<f64>>>();
    device.clear_markers();
    times
}

/// One candidate being timed on this rank: its options and the batch of calls a sample
/// times.
struct CandidateTimer<'a> {
    call: &'a PlanCall<'a>,
    lowered: &'a Lowered,
    options: ExecOptions,
    batch: u32,
}

impl<'a> CandidateTimer<'a> {
    /// Warms `candidate` up (a walked call and a captured one), times one call with
    /// `clock` and sizes the batch from the slowest rank's time, so that every rank runs
    /// as many calls; with the first call's outputs, on the host. Its calls are not
    /// traced (their later outputs are discarded).
    fn new(
        call: &'a PlanCall<'a>,
        candidate: &'a Distinct,
        clock: Clock,
    ) -> Result<(Self, Vec<crate::tensor::Tensor>)> {
        let options = ExecOptions {
            trace: false,
            trace_dir: None,
            ..with_plan(call.options, &candidate.plan)
        };
        let mut timer = CandidateTimer {
            call,
            lowered: &candidate.lowered,
            options,
            batch: 1,
        };
        let first = (timer.run()?.iter())
            .map(|t| call.rank.to_host(t))
            .collect::<Result<Vec<_>>>()?;
        timer.run()?;
        let one = match clock {
            Clock::Host => timer.host_sample()?,
            Clock::Device => timer.device_sample()?,
        };
        let mine = (one as i64).max(1000);
        let slowest = slowest_of(call, &[mine])?[0];
        let per_call = Duration::from_nanos(slowest.max(1) as u64);
        timer.batch =
            (SAMPLE_TARGET.as_secs_f64() / per_call.as_secs_f64()).clamp(1.0, MAX_BATCH) as u32;
        Ok((timer, first))
    }

    /// One call of the candidate; its outputs.
    fn run(&self) -> Result<Vec<crate::tensor::Tensor>> {
        let c = self.call;
        let (p, start) = (&self.lowered.program, Instant::now());
        let symbols = &c.prepared.symbols;
        let (execution, _, _) = (c.exec).execute_from(
            c.rank,
            c.on.cloned(),
            p,
            symbols,
            c.inputs,
            None,
            &self.options,
            start,
        )?;
        Ok(execution.outputs)
    }

    /// The batch's calls, back to back.
    fn run_batch(&self) -> Result<()> {
        for _ in 0..self.batch {
            self.run()?;
        }
        Ok(())
    }

    /// The device time per call of one batch, ns, by markers around it.
    fn device_sample(&self) -> Result<f64> {
        let device = self.call.rank.device();
        let start = device.record_call_marker(self.call.on)?;
        self.run_batch()?;
        let end = device.record_call_marker(self.call.on)?;
        let ms = device.marker_elapsed_ms(start, end);
        device.clear_markers();
        Ok(ms? * 1e6 / f64::from(self.batch))
    }

    /// The host time per call of one batch, ns, between device synchronizations.
    fn host_sample(&self) -> Result<f64> {
        let device = self.call.rank.device();
        device.synchronize()?;
        let t = Instant::now();
        self.run_batch()?;
        device.synchronize()?;
        Ok(t.elapsed().as_secs_f64() * 1e9 / f64::from(self.batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;
    use fusion_compiler::DType;

    #[test]
    fn outputs_agree_within_rounding_and_not_beyond() {
        let a = Tensor::randn(&[8, 16], DType::F32, 1);
        let v = a.to_f32_vec().unwrap();
        let scaled: Vec<f32> = v.iter().map(|x| x * 1.001).collect();
        let near = Tensor::from_f32(&[8, 16], &scaled, DType::F32).unwrap();
        assert_eq!(disagreement(&[near], std::slice::from_ref(&a)), None);
        // Rows never written (zeros), or NaN, or another shape: a disagreement.
        let mut half = v.clone();
        half[64..].iter_mut().for_each(|x| *x = 0.0);
        let half = Tensor::from_f32(&[8, 16], &half, DType::F32).unwrap();
        let why = disagreement(&[half], std::slice::from_ref(&a)).unwrap();
        assert!(why.starts_with("output 0 off by"), "{why}");
        let mut nan = v;
        nan[3] = f32::NAN;
        let nan = Tensor::from_f32(&[8, 16], &nan, DType::F32).unwrap();
        assert!(disagreement(&[nan], std::slice::from_ref(&a)).is_some());
        let other = Tensor::randn(&[4, 16], DType::F32, 1);
        assert!(disagreement(&[other], std::slice::from_ref(&a)).is_some());
        assert!(disagreement(&[], std::slice::from_ref(&a)).is_some());
    }
}
