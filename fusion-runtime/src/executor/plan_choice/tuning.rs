//! Timing the candidates of a plan choice on every rank ([`tune`]): each candidate's first
//! call checked against the reference candidate's on the device, then the agreeing
//! candidates warmed up (captured) and their batches sized, then rounds of one batch of
//! every candidate in turn, the medians exchanged and the slowest rank's kept. Each phase
//! of each candidate is a `tracing` span and adds to [`TuningPhases`].
//!
//! A candidate whose outputs disagree with the reference's (the unpipelined plan where it is
//! a candidate) on any rank is not timed and never chosen: a lowering bug that skips work
//! also runs fast, and tuning would otherwise pick it (it did: a row-range plan whose GEMM
//! rows were never written). The reference's own outputs are only as right as the
//! simplest plan; the tests check every candidate against host references. The outputs
//! are compared where they live ([`Device::discrepancy`]: two sums per output come back to
//! the host), not downloaded: on the backward benchmark's shapes the host comparison of
//! tens of millions of elements per output took seconds per candidate.
//!
//! A batch is timed the way the benchmarks time calls: back to back, by device markers
//! (CUDA events) recorded on the stream the calls end on, around the batch; the host waits
//! once per round, after every candidate's batch is queued. Host timing with a device
//! synchronization around each batch adds the device's idle gap and launch ramp to every
//! sample and ranked candidates of the gated MLP 2-4% differently from the benchmark
//! (`docs/DECISIONS.md`, "Plans"). Traced calls (`FUSION_TRACE`) read and clear the
//! device's markers themselves, so while tracing, batches are timed by the host as before.
//!
//! Every candidate is timed in the first [`FIRST_ROUNDS`] rounds; only those within
//! [`CLOSE`] of the fastest then (the slowest rank's faster sample) are timed in the
//! remaining rounds and can be chosen (`docs/DECISIONS.md`, "Plans": to be confirmed on
//! GPUs).

use std::time::{Duration, Instant};

use super::phases::{Phase, TuningPhases};
use super::{with_plan, Distinct, PlanCall};
use crate::config;
use crate::device::Device;
use crate::error::Result;
use crate::executor::lowering::Lowered;
use crate::executor::options::ExecOptions;
use crate::tensor::Tensor;

/// Bumped whenever how candidates are timed changes (part of the plan file's key, so that
/// plans tuned the old way are tuned again): 3, every candidate timed in the first rounds
/// and only those close to the fastest in the rest; 2, device markers around back-to-back
/// calls (1 was the host's clock around synchronized batches).
pub(super) const TUNING_REVISION: u32 = 3;
/// Samples per candidate timed to the end (the median counts).
pub(super) const SAMPLES: usize = 7;
/// Rounds that time every candidate.
const FIRST_ROUNDS: usize = 2;
/// How much slower than the fastest candidate (each one's faster sample of the first
/// rounds, the slowest rank's) a candidate may be and still be timed in the remaining
/// rounds.
const CLOSE: f64 = 1.15;
/// A sample lasts about this long (calls are batched up to it).
const SAMPLE_TARGET: Duration = Duration::from_millis(3);
/// Calls per batch at most.
const MAX_BATCH: f64 = 50.0;
/// How far (relative error) a candidate's outputs may be from the reference candidate's:
/// plans sum in different orders, which in bf16 moves results by ~1e-2 at most; a plan
/// that skips work is off by far more (or NaN).
const AGREEMENT: f64 = 5e-2;

/// What tuning found, per candidate of the order: the slowest rank's median time per call
/// (ns, `i64::MAX` for one that disagreed), how many rounds timed it (0 for one that
/// disagreed), whether samples were device-timed, and a warning per candidate that
/// disagreed.
pub(super) struct Tuned {
    pub slowest: Vec<i64>,
    pub rounds: Vec<usize>,
    pub device_timed: bool,
    pub warnings: Vec<String>,
}

impl Tuned {
    /// The position in `order` (the distinct candidates timed, as [`tune`] got them) of
    /// the candidate to run: the fastest of those timed in every round, the first
    /// distinct candidate among equals.
    pub(super) fn best(&self, order: &[usize]) -> usize {
        (0..self.slowest.len())
            .filter(|&j| self.rounds[j] == SAMPLES)
            .min_by_key(|&j| (self.slowest[j], order[j]))
            .unwrap_or(0)
    }
}

/// How samples are timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Clock {
    /// Device markers around back-to-back calls, one host wait per round.
    Device,
    /// The host's clock, the device synchronized before and after each batch.
    Host,
}

/// The candidates `order` of `call` timed on every rank, each phase's host time added to
/// `phases`. Every candidate's first call is compared with the reference's; those that
/// agree on every rank are captured and their batches sized; then [`SAMPLES`] rounds
/// time one batch of every candidate still timed in turn (so that the machine's drift
/// over the tuning, clocks and temperature, a few percent over minutes, falls on all
/// candidates alike), each round starting at the next candidate (so that none always
/// comes first). Every rank runs the same calls in the same order.
pub(super) fn tune(
    call: &PlanCall<'_>,
    distinct: &[Distinct],
    order: &[usize],
    phases: &mut TuningPhases,
) -> Result<Tuned> {
    // Traced calls read and clear the device's markers.
    let clock = if config::trace_dir().is_some() {
        Clock::Host
    } else {
        Clock::Device
    };
    let rank = call.rank.index();
    // The reference first: every other candidate's first outputs are compared with its.
    let reference = order
        .iter()
        .position(|&i| distinct[i].plan.name == "unpipelined")
        .unwrap_or(0);
    let mut timers: Vec<CandidateTimer<'_>> = (order.iter())
        .map(|&i| CandidateTimer::new(call, &distinct[i]))
        .collect();
    let disagreements = first_calls(call, &timers, reference, phases)?;
    // A candidate wrong on any rank is dropped on every rank.
    let mine: Vec<i64> = (disagreements.iter())
        .map(|d| i64::from(d.is_some()))
        .collect();
    let wrong = phases.time(Phase::Comparison, "all", rank, || slowest_of(call, &mine))?;
    let mut warnings = Vec::new();
    for (j, &i) in order.iter().enumerate() {
        if wrong[j] != 0 {
            let here = disagreements[j].as_deref().unwrap_or("on another rank");
            warnings.push(format!(
                "plan candidate `{}` gave other outputs than `{}` ({here}): not chosen; \
                 please report this lowering bug",
                distinct[i].plan.name, distinct[order[reference]].plan.name
            ));
        }
    }
    let live: Vec<usize> = (0..timers.len()).filter(|&j| wrong[j] == 0).collect();
    for &j in &live {
        let t = &mut timers[j];
        phases.time(Phase::Capture, t.name, rank, || t.run_to_end())?;
        phases.time(Phase::Sizing, t.name, rank, || t.size_batch(clock))?;
    }
    let live_timers: Vec<&CandidateTimer<'_>> = live.iter().map(|&j| &timers[j]).collect();
    let samples = time_rounds(call, &live_timers, clock, phases)?;
    let rounds: Vec<usize> = samples.iter().map(Vec::len).collect();
    let medians: Vec<i64> = samples
        .into_iter()
        .map(|mut s| {
            s.sort_by(f64::total_cmp);
            (s[s.len() / 2] as i64).max(1)
        })
        .collect();
    let live_slowest = slowest_of(call, &medians)?;
    let mut tuned = Tuned {
        slowest: vec![i64::MAX; timers.len()],
        rounds: vec![0; timers.len()],
        device_timed: clock == Clock::Device,
        warnings,
    };
    for (k, &j) in live.iter().enumerate() {
        tuned.slowest[j] = live_slowest[k];
        tuned.rounds[j] = rounds[k];
    }
    Ok(tuned)
}

/// Every candidate's first call (the reference's first), its outputs compared with the
/// reference's on the device; why each disagrees, if it does.
fn first_calls(
    call: &PlanCall<'_>,
    timers: &[CandidateTimer<'_>],
    reference: usize,
    phases: &mut TuningPhases,
) -> Result<Vec<Option<String>>> {
    let (device, rank) = (call.rank.device(), call.rank.index());
    let first = &timers[reference];
    let expected = phases.time(Phase::FirstCall, first.name, rank, || first.run_to_end())?;
    let mut why = vec![None; timers.len()];
    for (j, t) in timers.iter().enumerate() {
        if j == reference {
            continue;
        }
        let outputs = phases.time(Phase::FirstCall, t.name, rank, || t.run_to_end())?;
        why[j] = phases.time(Phase::Comparison, t.name, rank, || {
            disagreement(device, &outputs, &expected)
        })?;
    }
    Ok(why)
}

/// Why `outputs` (a candidate's) disagree with `expected` (the reference candidate's), if
/// they do: an output off by more than [`AGREEMENT`] (relative Frobenius error, summed on
/// `device`), not finite, or of another shape.
fn disagreement(
    device: &dyn Device,
    outputs: &[Tensor],
    expected: &[Tensor],
) -> Result<Option<String>> {
    if outputs.len() != expected.len() {
        let why = format!("{} outputs, not {}", outputs.len(), expected.len());
        return Ok(Some(why));
    }
    for (k, (got, want)) in outputs.iter().zip(expected).enumerate() {
        if got.shape() != want.shape() {
            let why = format!(
                "output {k} of shape {:?}, not {:?}",
                got.shape(),
                want.shape()
            );
            return Ok(Some(why));
        }
        // Both empty (a rank outside the output's mesh): nothing to compare.
        if got.numel() == 0 {
            continue;
        }
        let e = device.discrepancy(got, want)?.relative();
        if e > AGREEMENT || e.is_nan() {
            return Ok(Some(format!("output {k} off by {e:.2e}")));
        }
    }
    Ok(None)
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

/// Each of `timers`' samples on this rank (time per call, ns): [`FIRST_ROUNDS`] rounds of
/// every timer, then the rest of [`SAMPLES`] rounds of those within [`CLOSE`] of the
/// fastest (each one's faster sample, the slowest rank's, so that every rank times the
/// same).
fn time_rounds(
    call: &PlanCall<'_>,
    timers: &[&CandidateTimer<'_>],
    clock: Clock,
    phases: &mut TuningPhases,
) -> Result<Vec<Vec<f64>>> {
    let rank = call.rank.index();
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(SAMPLES); timers.len()];
    let mut among: Vec<usize> = (0..timers.len()).collect();
    for round in 0..SAMPLES {
        if round == FIRST_ROUNDS {
            among = phases.time(Phase::Round, "all", rank, || {
                close_to_fastest(call, &samples)
            })?;
        }
        let k = among.len();
        let turn: Vec<usize> = (0..k).map(|j| among[(round + j) % k]).collect();
        let times = phases.time(Phase::Round, "all", rank, || {
            time_round(call, timers, &turn, clock)
        })?;
        for (&j, t) in turn.iter().zip(times) {
            samples[j].push(t);
        }
    }
    Ok(samples)
}

/// The candidates whose faster sample so far (the slowest rank's) is within [`CLOSE`] of
/// the fastest's.
fn close_to_fastest(call: &PlanCall<'_>, samples: &[Vec<f64>]) -> Result<Vec<usize>> {
    let mine: Vec<i64> = (samples.iter())
        .map(|s| (s.iter().copied().fold(f64::INFINITY, f64::min) as i64).max(1))
        .collect();
    let early = slowest_of(call, &mine)?;
    let fastest = early.iter().copied().min().unwrap_or(0) as f64;
    Ok((0..early.len())
        .filter(|&j| early[j] as f64 <= CLOSE * fastest)
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

/// One candidate being timed on this rank: its name, options and the batch of calls a
/// sample times. Its calls are not traced (their outputs are discarded).
struct CandidateTimer<'a> {
    call: &'a PlanCall<'a>,
    name: &'a str,
    lowered: &'a Lowered,
    options: ExecOptions,
    batch: u32,
}

impl<'a> CandidateTimer<'a> {
    /// The timer of `candidate`, batches of one call until [`CandidateTimer::size_batch`].
    fn new(call: &'a PlanCall<'a>, candidate: &'a Distinct) -> Self {
        let options = ExecOptions {
            trace: false,
            trace_dir: None,
            ..with_plan(call.options, &candidate.plan)
        };
        CandidateTimer {
            call,
            name: &candidate.plan.name,
            lowered: &candidate.lowered,
            options,
            batch: 1,
        }
    }

    /// One call of the candidate; its outputs.
    fn run(&self) -> Result<Vec<Tensor>> {
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
            [start; 4],
        )?;
        Ok(execution.outputs)
    }

    /// One call, waited for on the device (so that its phase counts its device time); its
    /// outputs. The first call of a candidate walks its program, the second captures it.
    fn run_to_end(&self) -> Result<Vec<Tensor>> {
        let outputs = self.run()?;
        self.call.rank.device().synchronize()?;
        Ok(outputs)
    }

    /// Times one call with `clock` and sizes the batch from the slowest rank's time (so
    /// that every rank runs as many calls) to about [`SAMPLE_TARGET`].
    fn size_batch(&mut self, clock: Clock) -> Result<()> {
        let one = match clock {
            Clock::Host => self.host_sample()?,
            Clock::Device => self.device_sample()?,
        };
        let mine = (one as i64).max(1000);
        let slowest = slowest_of(self.call, &[mine])?[0];
        let per_call = Duration::from_nanos(slowest.max(1) as u64);
        self.batch =
            (SAMPLE_TARGET.as_secs_f64() / per_call.as_secs_f64()).clamp(1.0, MAX_BATCH) as u32;
        Ok(())
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
    use crate::backend::cpu::CpuDevice;
    use fusion_compiler::DType;

    fn f32s(shape: &[usize], v: &[f32]) -> Tensor {
        Tensor::from_f32(shape, v, DType::F32).unwrap()
    }

    /// The comparison on the device (here the CPU backend's) flags what the host
    /// comparison (`Tensor::rel_error`) flagged, by the same numbers.
    #[test]
    fn outputs_agree_within_rounding_and_not_beyond() {
        let dev = CpuDevice::new(0);
        let a = Tensor::randn(&[8, 16], DType::F32, 1);
        let v = a.to_f32_vec().unwrap();
        let agree = |got: Tensor| disagreement(&dev, &[got], std::slice::from_ref(&a)).unwrap();
        let scaled: Vec<f32> = v.iter().map(|x| x * 1.001).collect();
        assert_eq!(agree(f32s(&[8, 16], &scaled)), None);
        // Rows never written (zeros), or NaN, or infinite, or another shape: a
        // disagreement.
        let mut half = v.clone();
        half[64..].iter_mut().for_each(|x| *x = 0.0);
        let half = f32s(&[8, 16], &half);
        let host = half.rel_error(&a).unwrap();
        let why = agree(half).unwrap();
        assert_eq!(why, format!("output 0 off by {host:.2e}"));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = v.clone();
            x[3] = bad;
            let why = agree(f32s(&[8, 16], &x)).unwrap();
            assert_eq!(why, "output 0 off by inf", "{bad}");
        }
        assert!(agree(Tensor::randn(&[4, 16], DType::F32, 1)).is_some());
        assert!(disagreement(&dev, &[], std::slice::from_ref(&a))
            .unwrap()
            .is_some());
        // A NaN in the reference is a disagreement too.
        let mut r = v.clone();
        r[5] = f32::NAN;
        let nan_ref = f32s(&[8, 16], &r);
        let why = disagreement(&dev, std::slice::from_ref(&a), &[nan_ref]).unwrap();
        assert!(why.is_some());
        // Ranks outside an output's mesh hold empty placeholders: they agree.
        let empty = [Tensor::placeholder(DType::F32)];
        assert_eq!(disagreement(&dev, &empty, &empty).unwrap(), None);
    }

    /// The device's sums give `Tensor::rel_error`'s number for bf16 and strided views.
    #[test]
    fn device_sums_match_the_host_relative_error() {
        let dev = CpuDevice::new(0);
        let want = Tensor::randn(&[6, 10], DType::BF16, 2);
        let noisy: Vec<f32> = (want.to_f32_vec().unwrap().iter().enumerate())
            .map(|(i, x)| x + 0.01 * ((i % 7) as f32 - 3.0))
            .collect();
        let got = Tensor::from_f32(&[6, 10], &noisy, DType::BF16).unwrap();
        let (gt, wt) = (
            got.permute(&[1, 0]).unwrap(),
            want.permute(&[1, 0]).unwrap(),
        );
        for (g, w) in [(&got, &want), (&gt, &wt)] {
            let host = g.rel_error(w).unwrap();
            let device = dev.discrepancy(g, w).unwrap().relative();
            assert!((host - device).abs() <= 1e-12 * host, "{host} vs {device}");
        }
        assert!(dev.discrepancy(&got, &gt).is_err(), "shapes differ");
        let zeros = Tensor::zeros(&[3], DType::F32);
        let d = dev
            .discrepancy(&f32s(&[3], &[3.0, 4.0, 0.0]), &zeros)
            .unwrap();
        assert_eq!(d.relative(), 5.0, "against zeros: the difference's norm");
    }

    #[test]
    fn only_candidates_timed_to_the_end_are_chosen() {
        let tuned = Tuned {
            slowest: vec![900, 1000, i64::MAX, 1000],
            rounds: vec![FIRST_ROUNDS, SAMPLES, 0, SAMPLES],
            device_timed: true,
            warnings: Vec::new(),
        };
        assert_eq!(tuned.best(&[0, 1, 2, 3]), 1, "of those timed to the end");
        assert_eq!(
            tuned.best(&[0, 3, 2, 1]),
            3,
            "the first distinct one of equals"
        );
    }
}
