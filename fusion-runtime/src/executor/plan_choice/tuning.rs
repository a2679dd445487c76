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
//! Calls are timed the way the benchmarks time them: each call on its own, this rank's
//! device idle and the ranks met on the host first, by device markers (CUDA events)
//! recorded on the stream the call ends on; a sample is the median of a batch of such
//! calls. Batches timed back to back ranked the MLP block's plans up to 5% differently
//! from the benchmarks' calls (a plan whose tail overlaps the next call's head looks
//! faster back to back), and host timing with a device synchronization around each batch
//! 2-4% differently (`docs/DECISIONS.md`, "Plans"). Traced calls (`FUSION_TRACE`) read and
//! clear the device's markers themselves, so while tracing, batches are timed by the host
//! as before.
//!
//! Every candidate is timed in the first [`FIRST_ROUNDS`] rounds; only those within
//! [`CLOSE`] of the fastest then (the slowest rank's faster sample) are timed in the
//! remaining rounds and can be chosen (`docs/DECISIONS.md`, "Plans": to be confirmed on
//! GPUs). Where others' medians end within [`TIE`] of the fastest's, those few are timed
//! [`TIE_ROUNDS`] rounds more and decided on all their samples: single samples at D = 4
//! spread by several percent, and the candidates closest to each other are the ones a
//! spread flips.

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
/// plans tuned the old way are tuned again): 4, each call timed on its own after the ranks
/// meet (was: batches back to back), and ties timed longer; 3, every candidate timed
/// in the first rounds and only those close to the fastest in the rest; 2, device markers
/// around back-to-back calls (1 was the host's clock around synchronized batches).
pub(super) const TUNING_REVISION: u32 = 4;
/// Samples per candidate timed to the end (the median counts).
pub(super) const SAMPLES: usize = 7;
/// How close to the fastest median (the slowest rank's) a candidate's must be for the two
/// to count as tied and be timed [`TIE_ROUNDS`] rounds more.
const TIE: f64 = 1.03;
/// Rounds more for the tied candidates.
const TIE_ROUNDS: usize = 6;
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
    /// the candidate to run: the fastest of those timed in every round (where some were
    /// tied and timed longer, of those: the others were 3% slower before, and their
    /// earlier samples do not share the tie rounds' moment of the machine's drift), the
    /// first distinct candidate among equals.
    pub(super) fn best(&self, order: &[usize]) -> usize {
        let most = self.rounds.iter().copied().max().unwrap_or(0).max(SAMPLES);
        (0..self.slowest.len())
            .filter(|&j| self.rounds[j] == most)
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
    let mut samples = time_rounds(call, &live_timers, clock, phases)?;
    let mut live_slowest = slowest_of(call, &medians(&samples))?;
    let tied = tied_with_fastest(&live_slowest, &samples);
    if tied.len() > 1 {
        for round in 0..TIE_ROUNDS {
            let k = tied.len();
            let turn: Vec<usize> = (0..k).map(|j| tied[(round + j) % k]).collect();
            let times = phases.time(Phase::Round, "all", rank, || {
                time_round(&live_timers, &turn, clock)
            })?;
            for (&j, t) in turn.iter().zip(times) {
                samples[j].push(t);
            }
        }
        live_slowest = slowest_of(call, &medians(&samples))?;
    }
    let rounds: Vec<usize> = samples.iter().map(Vec::len).collect();
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
            time_round(timers, &turn, clock)
        })?;
        for (&j, t) in turn.iter().zip(times) {
            samples[j].push(t);
        }
    }
    Ok(samples)
}

/// Each candidate's median sample (ns, at least 1).
fn medians(samples: &[Vec<f64>]) -> Vec<i64> {
    (samples.iter())
        .map(|s| {
            let mut s = s.clone();
            s.sort_by(f64::total_cmp);
            (s[s.len() / 2] as i64).max(1)
        })
        .collect()
}

/// The candidates timed in every round whose median (`slowest`: the slowest rank's) is
/// within [`TIE`] of the fastest such median; the same on every rank.
fn tied_with_fastest(slowest: &[i64], samples: &[Vec<f64>]) -> Vec<usize> {
    let full = |j: &usize| samples[*j].len() == SAMPLES;
    let Some(fastest) = (0..slowest.len()).filter(full).map(|j| slowest[j]).min() else {
        return Vec::new();
    };
    (0..slowest.len())
        .filter(full)
        .filter(|&j| slowest[j] as f64 <= TIE * fastest as f64)
        .collect()
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
/// ns. With the device clock each call runs on its own as the benchmarks time it (this
/// rank's device idle, the ranks met on the host, markers around the call) and a timer's
/// sample is the median of its batch's calls.
fn time_round(timers: &[&CandidateTimer<'_>], turn: &[usize], clock: Clock) -> Result<Vec<f64>> {
    if clock == Clock::Host {
        return (turn.iter()).map(|&j| timers[j].host_sample()).collect();
    }
    (turn.iter())
        .map(|&j| timers[j].isolated_sample())
        .collect()
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

    /// The median device time of the batch's calls, ns, each call on its own: this rank's
    /// device idle and every rank met on the host before it, markers around it.
    fn isolated_sample(&self) -> Result<f64> {
        let (device, on) = (self.call.rank.device(), self.call.on);
        let mut marks = Vec::with_capacity(self.batch as usize);
        for _ in 0..self.batch {
            device.synchronize()?;
            self.call.rank.communicator().exchange(&[])?;
            let start = device.record_call_marker(on)?;
            self.run()?;
            marks.push((start, device.record_call_marker(on)?));
        }
        device.synchronize()?;
        let times = (marks.iter())
            .map(|&(a, b)| device.marker_elapsed_ms(a, b).map(|ms| ms * 1e6))
            .collect::<Result<Vec<f64>>>();
        device.clear_markers();
        let mut times = times?;
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
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

    /// Candidates timed to the end within 3% of the fastest median are tied; one dropped
    /// after the first rounds is not, however fast its samples; a lone fastest ties with
    /// nothing.
    #[test]
    fn ties_are_the_full_candidates_within_three_percent_of_the_fastest() {
        let full = vec![1.0; SAMPLES];
        let early = vec![1.0; FIRST_ROUNDS];
        let samples = vec![full.clone(), full.clone(), early, full.clone(), full];
        let slowest = [1000, 1029, 900, 1031, 1010];
        assert_eq!(tied_with_fastest(&slowest, &samples), vec![0, 1, 4]);
        assert_eq!(tied_with_fastest(&[1000, 1100], &samples[..2]), vec![0]);
        assert_eq!(medians(&[vec![3.0, 1.0, 2.0], vec![0.2]]), vec![2, 1]);
    }

    /// After tie rounds only the tied candidates are chosen from, even where an untied
    /// one's earlier median came out lower; without ties, every candidate timed in all 7.
    #[test]
    fn the_choice_after_tie_rounds_is_among_the_tied() {
        let tuned = |slowest: Vec<i64>, rounds: Vec<usize>| Tuned {
            slowest,
            rounds,
            device_timed: true,
            warnings: Vec::new(),
        };
        let tied = SAMPLES + TIE_ROUNDS;
        let t = tuned(
            vec![1641, 1639, 1673, 1500],
            vec![tied, SAMPLES, tied, FIRST_ROUNDS],
        );
        assert_eq!(t.best(&[0, 1, 2, 3]), 0);
        let t = tuned(vec![1641, 1639, 1500], vec![SAMPLES, SAMPLES, FIRST_ROUNDS]);
        assert_eq!(t.best(&[0, 1, 2]), 1);
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
