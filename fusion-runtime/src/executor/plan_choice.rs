//! Choosing a call's plan: which candidate of the plan space ([`fusion_compiler::plan`])
//! runs a fusion at a call's shapes, decided once per (fusion, dtypes, shapes, world) and
//! rank, the same on every rank.
//!
//! Only calls whose options leave the plan open (default `lower` and stream count) and that
//! communicate get a choice. Every candidate is lowered (once per process: the program
//! cache keeps each candidate's program, which the call path then finds there) and those
//! that give the same program are merged. Then, in order: the plan file, else the cost model
//! ([`PlanMode::Model`], or a call recorded into the caller's graph, where nothing can be
//! timed), else tuning ([`PlanMode::Tune`], [`tuning`]): every rank times each distinct
//! candidate with the call's own inputs (outputs discarded; back-to-back calls between
//! device markers), the ranks exchange their medians, and the candidate whose slowest
//! rank is fastest runs; rank 0 writes it to the plan file. Rank 0's plan file entry and
//! model order decide for every rank (one exchange), so every rank runs the same plan and
//! times the same candidates in the same order. The decision is kept per rank in the
//! executor. Where the time of a decision went, per phase, is in the report
//! ([`TuningPhases`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use fusion_compiler::hir::StreamDef;
use fusion_compiler::lower::LowerOptions;
use fusion_compiler::plan::{self, cost, Plan};
use serde_json::json;

use super::lowering::{Lowered, Prepared};
use super::options::{ExecOptions, PlanMode};
use super::plan_file;
use super::FusionExecutor;
use crate::config::{self, PlanSetting};
use crate::device::{BackendKind, CallerStream};
use crate::error::Result;
use crate::eval::bound_leaves;
use crate::tensor::Tensor;
use crate::world::Rank;

mod phases;
mod report;
mod tuning;

use phases::Phase;
pub use phases::TuningPhases;
pub use report::{CandidateReport, PlanReport, PlanSource};

/// Candidates timed at most, in the cost model's order.
const MAX_TUNED: usize = 32;

/// A call's plan: its program and options.
pub(super) struct Choice {
    pub(super) lowered: Lowered,
    pub(super) options: ExecOptions,
    pub(super) report: Option<Arc<PlanReport>>,
    /// The plan was known before the call (none left open, or decided earlier): a call
    /// of the same signature gets the same choice.
    pub(super) settled: bool,
}

/// What a decision is kept under: the call's dtypes and symbols, the rank and its world
/// (kept when the world recovers with new communicators).
type DecisionKey = (String, usize, u64);

/// The decisions of an executor, per key and rank.
#[derive(Default)]
pub(super) struct PlanChoices {
    decided: Mutex<HashMap<DecisionKey, (Plan, Arc<PlanReport>)>>,
    /// How many decisions timed candidates (for tests and benchmarks).
    tunings: std::sync::atomic::AtomicUsize,
}

/// The mode `options` asks for on `backend`: `None` when the plan is given.
fn mode(options: &ExecOptions, backend: BackendKind) -> Result<Option<PlanSetting>> {
    if options.lower != LowerOptions::default()
        || options.number_of_streams != plan::DEFAULT_STREAMS
    {
        return Ok(None);
    }
    let setting = match options.plan {
        PlanMode::Default => PlanSetting::Off,
        PlanMode::Model => PlanSetting::Model,
        PlanMode::Tune => PlanSetting::Tune,
        PlanMode::Auto => match config::plan()? {
            Some(s) => s,
            None if backend == BackendKind::Cuda => PlanSetting::Tune,
            None => PlanSetting::Off,
        },
    };
    Ok((setting != PlanSetting::Off).then_some(setting))
}

/// The call a plan is chosen for.
pub(super) struct PlanCall<'a> {
    pub(super) exec: &'a FusionExecutor,
    pub(super) rank: &'a Rank,
    /// The caller's stream, when the call was given one.
    pub(super) on: Option<&'a CallerStream>,
    /// The caller is capturing the call into its own graph: nothing can be timed.
    pub(super) recording: bool,
    pub(super) prepared: Prepared,
    pub(super) inputs: &'a [&'a Tensor],
    pub(super) options: &'a ExecOptions,
}

/// A distinct candidate: its plan, program, report line, what it is told apart by, and
/// its program text.
struct Distinct {
    plan: Plan,
    lowered: Lowered,
    report: CandidateReport,
    identity: (u64, usize),
    text: String,
}

impl PlanChoices {
    /// How many decisions timed their candidates.
    pub(super) fn tunings(&self) -> usize {
        self.tunings.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The plan of `call`, whose default program is `call.prepared`.
    pub(super) fn choose(&self, call: PlanCall<'_>) -> Result<Choice> {
        let (rank, options) = (call.rank, call.options);
        let open = rank.world_size() >= 2 && call.prepared.lowered.fingerprint.is_some();
        let setting = if open {
            mode(options, rank.backend())?
        } else {
            None
        };
        let Some(setting) = setting else {
            return Ok(Choice {
                lowered: call.prepared.lowered,
                options: options.clone(),
                report: None,
                settled: true,
            });
        };
        let key: DecisionKey = (
            format!(
                "{:?} {:?}",
                call.prepared.dtypes,
                call.prepared.symbols.entries()
            ),
            rank.index(),
            rank.world_shared().id,
        );
        let known = (self.decided.lock().unwrap_or_else(|p| p.into_inner()))
            .get(&key)
            .cloned();
        let settled = known.is_some();
        let (plan, report) = match known {
            Some(k) => k,
            None => {
                let decided = self.decide(&call, setting)?;
                (self.decided.lock().unwrap_or_else(|p| p.into_inner()))
                    .insert(key, decided.clone());
                decided
            }
        };
        let options = with_plan(options, &plan);
        let exec = call.exec;
        let lowered =
            (exec.programs).program_for_prepared(&exec.name, rank, &call.prepared, &options)?;
        Ok(Choice {
            lowered,
            options,
            report: Some(report),
            settled,
        })
    }

    /// Decides the plan of `call` (see the module's documentation for the order).
    fn decide(&self, call: &PlanCall<'_>, setting: PlanSetting) -> Result<(Plan, Arc<PlanReport>)> {
        let mut phases = TuningPhases::default();
        let rank = call.rank.index();
        let profile = phases.time(Phase::Probe, "all", rank, || world_profile(call))?;
        let mut distinct = lower_candidates(call, &profile, &mut phases)?;
        let mut report = PlanReport {
            plan: distinct[0].plan.name.clone(),
            source: PlanSource::OnlyCandidate,
            candidates: Vec::new(),
            tuning_ms: 0.0,
            phases,
            device_timed: false,
            profile: profile.source.clone(),
            warnings: Vec::new(),
        };
        if distinct.len() == 1 {
            return Ok(finish(call, report, distinct, 0));
        }
        // The plan file's entry and the model's order, rank 0's for every rank.
        let texts: Vec<&str> = distinct.iter().map(|d| d.text.as_str()).collect();
        let file_key = file_key(call, &texts);
        let path = call.options.plan_file.clone().or_else(config::plan_cache);
        let mine = match &path {
            Some(path) => file_choice(path, &file_key, &distinct, &mut report.warnings),
            None => -1,
        };
        for w in &report.warnings {
            tracing::warn!(rank = call.rank.index(), "{w}");
        }
        let (from_file, mut order) = agree(call, mine, model_order(&distinct))?;
        if let Some(i) = from_file {
            report.source = PlanSource::File;
            return Ok(finish(call, report, distinct, i));
        }
        if setting == PlanSetting::Model || call.recording {
            report.source = PlanSource::Model;
            return Ok(finish(call, report, distinct, order[0]));
        }
        order.truncate(MAX_TUNED);
        let started = Instant::now();
        let tuned = tuning::tune(call, &distinct, &order, &mut report.phases)?;
        report.device_timed = tuned.device_timed;
        for w in &tuned.warnings {
            tracing::warn!(rank, "{w}");
            report.warnings.push(w.clone());
        }
        for (j, &i) in order.iter().enumerate() {
            if tuned.rounds[j] > 0 {
                distinct[i].report.tuned_ms = Some(tuned.slowest[j] as f64 / 1e6);
                distinct[i].report.rounds = tuned.rounds[j];
            }
        }
        let best = tuned.best(&order);
        let pick = order[best];
        report.source = PlanSource::Tuned;
        self.tunings
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // The losers' graphs and buffers are of no further use on this rank.
        report.phases.time(Phase::Release, "all", rank, || {
            for (j, d) in distinct.iter().enumerate() {
                if j != pick {
                    call.exec.graphs.forget(call.rank, &d.lowered.program);
                }
            }
        });
        report.tuning_ms = started.elapsed().as_secs_f64() * 1e3;
        if let (0, Some(path)) = (rank, &path) {
            let tuned = (pick, tuned.slowest[best], tuned.device_timed);
            if let Err(w) = remember(call, path, &file_key, &distinct, tuned) {
                tracing::warn!("{w}");
                report.warnings.push(w);
            }
        }
        Ok(finish(call, report, distinct, pick))
    }
}

/// The distinct candidates in the order of the model's estimates (stable: the default
/// first among equals).
fn model_order(distinct: &[Distinct]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..distinct.len()).collect();
    order.sort_by(|&a, &b| (distinct[a].report.model_ms).total_cmp(&distinct[b].report.model_ms));
    order
}

/// Rank 0's plan file entry (`file`: an index into the candidates, or -1) and model order
/// (`order`), exchanged once, for every rank: the entry, if rank 0 has one, and the order
/// (each rank's model binds its own rank, so estimates may differ between ranks; the
/// plan, and the calls that tuning makes, must not).
fn agree(call: &PlanCall<'_>, file: i64, order: Vec<usize>) -> Result<(Option<usize>, Vec<usize>)> {
    let n = order.len();
    let mut mine = vec![file];
    mine.extend(order.iter().map(|&i| i as i64));
    let all = call.rank.communicator().exchange(&mine)?;
    let rank0 = all.into_iter().next().unwrap_or_default();
    let from_file = (rank0.first().copied())
        .filter(|&i| i >= 0 && (i as usize) < n)
        .map(|i| i as usize);
    let theirs: Vec<usize> = rank0.iter().skip(1).map(|&i| i as usize).collect();
    let mut sorted = theirs.clone();
    sorted.sort_unstable();
    let valid = sorted.len() == n && sorted.iter().enumerate().all(|(j, &i)| i == j);
    Ok((from_file, if valid { theirs } else { order }))
}

/// Every candidate of the plan space lowered for `call`, one per distinct program, with
/// the model's estimate; each candidate's time goes to `phases`. A candidate whose
/// lowering refuses this fusion is not one (lowering errors come before any
/// communication, on every rank alike).
fn lower_candidates(
    call: &PlanCall<'_>,
    profile: &cost::MachineProfile,
    phases: &mut TuningPhases,
) -> Result<Vec<Distinct>> {
    let mut distinct: Vec<Distinct> = Vec::new();
    for c in plan::candidates(call.rank.world_size()) {
        let name = c.name.clone();
        phases.time(Phase::Lowering, &name, call.rank.index(), || {
            add_candidate(call, profile, c, &mut distinct)
        });
    }
    if distinct.is_empty() {
        // The default always lowers (the call's own program did).
        return Err(crate::error::Error::World(
            "no candidate plan lowers this fusion".into(),
        ));
    }
    Ok(distinct)
}

/// Lowers candidate `c` for `call` (the program cache has it when another rank of this
/// process lowered it) and adds it to `distinct`, or to the candidate of its program
/// there; a candidate the lowering refuses is left out.
fn add_candidate(
    call: &PlanCall<'_>,
    profile: &cost::MachineProfile,
    c: Plan,
    distinct: &mut Vec<Distinct>,
) {
    let (exec, rank, prepared) = (call.exec, call.rank, &call.prepared);
    let o = with_plan(call.options, &c);
    let Ok(lowered) = (exec.programs).program_for_prepared(&exec.name, rank, prepared, &o) else {
        return;
    };
    let p = &lowered.program;
    let pooled = p.streams.iter().any(|s| matches!(s, StreamDef::Pool(_)));
    let streams = if pooled { c.number_of_streams } else { 0 };
    // Programs are told apart by their fingerprint (a hash of their text, computed once
    // when lowered), so that only distinct ones are printed here.
    let identity = (lowered.fingerprint.unwrap_or_else(|| text_hash(p)), streams);
    if let Some(d) = distinct.iter_mut().find(|d| d.identity == identity) {
        d.report.same_as.push(c.name.clone());
        return;
    }
    let leaves = bound_leaves(p, &prepared.symbols, rank.index(), c.number_of_streams);
    let est = cost::estimate(p, &|s| leaves.get(s.index()).copied().flatten(), profile);
    let report = CandidateReport {
        name: c.name.clone(),
        same_as: Vec::new(),
        model_ms: est.seconds * 1e3,
        tuned_ms: None,
        rounds: 0,
    };
    let text = format!("{p}\nstreams {streams}");
    distinct.push(Distinct {
        plan: c,
        lowered,
        report,
        identity,
        text,
    });
}

/// A hash of `program`'s text (its fingerprint, for a program that has none).
fn text_hash(program: &fusion_compiler::hir::HostProgram) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    program.to_string().hash(&mut h);
    h.finish()
}

/// This rank's plan file entry for `key`: the index of its candidate, or -1 (none, or
/// not to be trusted: the reason goes to `warnings`).
fn file_choice(
    path: &std::path::Path,
    key: &str,
    distinct: &[Distinct],
    warnings: &mut Vec<String>,
) -> i64 {
    match plan_file::load(path).and_then(|m| plan_file::entry(&m, key)) {
        Ok(Some(e)) => match distinct.iter().position(|d| d.plan.name == e.plan) {
            Some(i) => i as i64,
            None => {
                warnings.push(format!(
                    "plan file entry {key} names `{}`, not a candidate here; tuning again",
                    e.plan
                ));
                -1
            }
        },
        Ok(None) => -1,
        Err(w) => {
            warnings.push(w);
            -1
        }
    }
}

/// Writes the tuned plan `pick` (its time `ns`, device-timed or not) into the plan file
/// at `path`.
fn remember(
    call: &PlanCall<'_>,
    path: &std::path::Path,
    key: &str,
    distinct: &[Distinct],
    (pick, ns, device_timed): (usize, i64, bool),
) -> std::result::Result<(), String> {
    let entry = plan_file::FileEntry {
        plan: distinct[pick].plan.name.clone(),
        ms: ns as f64 / 1e6,
    };
    let default_ms = distinct[0]
        .report
        .tuned_ms
        .map_or(serde_json::Value::Null, |t| json!(t));
    let rank = call.rank;
    let extra = [
        ("fusion", json!(call.exec.name)),
        (
            "shapes",
            json!(format!("{:?}", call.prepared.symbols.entries())),
        ),
        (
            "world",
            json!(format!("{} x {:?}", rank.world_size(), rank.backend())),
        ),
        ("device", json!(rank.device().model())),
        ("default_ms", default_ms),
        ("timed", json!(if device_timed { "device" } else { "host" })),
    ];
    plan_file::store(path, key, &entry, &extra)
        .map_err(|e| format!("plan file {} not written: {e}", path.display()))
}

/// The decision for `pick`, its report completed; printed with `FUSION_DUMP=host_ir`
/// (rank 0).
fn finish(
    call: &PlanCall<'_>,
    mut report: PlanReport,
    distinct: Vec<Distinct>,
    pick: usize,
) -> (Plan, Arc<PlanReport>) {
    report.plan = distinct[pick].plan.name.clone();
    let plan = distinct[pick].plan.clone();
    let chosen = distinct[pick].lowered.program.clone();
    report.candidates = distinct.into_iter().map(|d| d.report).collect();
    let report = Arc::new(report);
    let dump = crate::config::DumpOptions::from_env().is_ok_and(|d| d.host_ir);
    if call.rank.index() == 0 && dump {
        eprintln!("// {}: {report}", call.exec.name);
        super::dumps::dump_program(&chosen, call.rank);
    }
    (plan, report)
}

/// The machine rates of `call`'s world, probed at its first decision on each rank (every
/// rank of a world decides its first plan at the same call): on CUDA the bf16 GEMM rate
/// of this device, agreed as the slowest rank's so that every rank's model orders the
/// candidates alike; the link rates are Hopper's. The CPU backend, and a call recorded
/// into the caller's capture (nothing can wait for the device), keep the defaults.
fn world_profile(call: &PlanCall<'_>) -> Result<cost::MachineProfile> {
    type Profiles = Mutex<HashMap<(u64, usize), cost::MachineProfile>>;
    static PROFILES: std::sync::OnceLock<Profiles> = std::sync::OnceLock::new();
    let rank = call.rank;
    let key = (rank.world_shared().id, rank.index());
    let profiles = PROFILES.get_or_init(Default::default);
    if let Some(p) = profiles.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(p.clone());
    }
    let base = cost::MachineProfile::hopper();
    if rank.backend() != BackendKind::Cuda || call.recording {
        return Ok(base);
    }
    let mine = probe_gemm_flops(rank)?;
    let all = rank.communicator().exchange(&[(mine / 1e9) as i64])?;
    let slowest = all
        .iter()
        .filter_map(|v| v.first())
        .copied()
        .min()
        .unwrap_or(0);
    let source = format!(
        "bf16 GEMM probed at {:.0} TFLOP/s (slowest rank), Hopper link rates",
        slowest as f64 / 1e3
    );
    let profile = base.with_gemm_flops(slowest as f64 * 1e9, &source);
    (profiles.lock().unwrap_or_else(|p| p.into_inner())).insert(key, profile.clone());
    Ok(profile)
}

/// Side of the square bf16 GEMM the probe times.
const PROBE_SIDE: usize = 4096;

/// This device's bf16 GEMM rate, FLOP/s: the median of 5 timed `PROBE_SIDE`^3 GEMMs on
/// random inputs after 2 warm-ups.
fn probe_gemm_flops(rank: &Rank) -> Result<f64> {
    use fusion_compiler::DType;
    let dev = rank.device();
    let n = PROBE_SIDE;
    let a = dev.upload(&Tensor::randn(&[n, n], DType::BF16, 0x5eed))?;
    let b = dev.upload(&Tensor::randn(&[n, n], DType::BF16, 0x5eee))?;
    let c = dev.allocate(0, DType::BF16, &[n, n])?;
    let gemm = || {
        dev.execute(
            0,
            crate::device::Kernel::Gemm {
                a: &a,
                b: &b,
                bias: None,
                accumulate: false,
                addend: None,
                epilogue: &[],
                dst: &c,
            },
        )
    };
    gemm()?;
    gemm()?;
    let mut ms = Vec::with_capacity(5);
    for _ in 0..5 {
        let start = dev.record_marker(0)?;
        gemm()?;
        let end = dev.record_marker(0)?;
        ms.push(dev.marker_elapsed_ms(start, end)?);
    }
    dev.clear_markers();
    ms.sort_by(f64::total_cmp);
    let flops = 2.0 * (n as f64).powi(3);
    Ok(flops / (ms[2].max(1e-6) * 1e-3))
}

/// `options` with `plan`'s lowering and stream count, and no further choosing.
fn with_plan(options: &ExecOptions, plan: &Plan) -> ExecOptions {
    ExecOptions {
        lower: plan.lower.clone(),
        number_of_streams: plan.number_of_streams,
        plan: PlanMode::Default,
        ..options.clone()
    }
}

/// The plan file's key of a decision: the build (and how it tunes), the fusion, dtypes
/// and shapes, the world and GPU, and the distinct candidate programs.
fn file_key(call: &PlanCall<'_>, programs: &[&str]) -> String {
    let (rank, prepared) = (call.rank, &call.prepared);
    let comm = rank.communicator();
    let caps = comm.capabilities();
    let fusion = prepared.fusion.to_string();
    let shapes = format!("{:?} {:?}", prepared.dtypes, prepared.symbols.entries());
    let world = format!(
        "{} ranks, {:?}, {}",
        rank.world_size(),
        rank.backend(),
        caps.transports.join("; ")
    );
    let device = rank.device().model();
    let revision = format!(
        "{} {} timing {}",
        env!("CARGO_PKG_VERSION"),
        plan::PLAN_SPACE_REVISION,
        tuning::TUNING_REVISION
    );
    let name = call.exec.name.as_str();
    let mut parts = vec![revision.as_str(), name, &fusion, &shapes, &world, &device];
    parts.extend_from_slice(programs);
    plan_file::stable_key(&parts)
}
