//! The plan a call runs when its options leave it open: the plan space enumerated on 1, 2,
//! 3, 4 and 8 simulated devices with every candidate computing the unpipelined result;
//! tuning that gives every rank the same plan; the plan file read by a later executor
//! (as a second process would) so that nothing is timed again; untrusted files ignored
//! with a warning; the cost model's pick; options set by hand kept as the plan; the
//! device markers tuning times calls with and the device comparison it checks outputs
//! with; where a decision's time went (its phases), and each candidate lowered once.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::cases;
use common::*;
use fusion::compiler::ir::{Fusion, UnaryOp};
use fusion::compiler::lower::Pipelining;
use fusion::compiler::plan;
use fusion::{DType, ExecOptions, FusionExecutor, PlanMode, PlanReport, PlanSource, Tensor};

/// A fusion of the suite with its inputs (full tensors and how ranks get them) and how
/// its output is assembled.
struct Case {
    name: &'static str,
    fusion: Fusion,
    inputs: Vec<(Tensor, Give)>,
    take: Take,
}

fn cases_for(d: usize, salt: u64) -> Vec<Case> {
    let dt = DType::F32;
    let r = |shape: &[usize], s: u64| Tensor::randn(shape, dt, salt * 101 + s + d as u64);
    let (m, k, n, f) = (4, 6, 5, 3);
    vec![
        Case {
            name: "ag_matmul",
            fusion: cases::ag_matmul_p2p(dt),
            inputs: vec![
                (r(&[d, m, k], 1), Give::Shard(0)),
                (r(&[k, n], 2), Give::Whole),
            ],
            take: Take::Replicated,
        },
        Case {
            name: "matmul_rs",
            fusion: cases::matmul_rs_p2p(),
            inputs: vec![
                (r(&[d, d, m, k], 3), Give::Shard(0)),
                (r(&[d, k, n], 4), Give::Shard(0)),
            ],
            take: Take::Sharded(0),
        },
        Case {
            name: "mlp",
            fusion: cases::tp_mlp(dt, UnaryOp::Gelu),
            inputs: vec![
                (r(&[d, m, k], 5), Give::Shard(0)),
                (r(&[d, k, f], 6), Give::Shard(0)),
                (r(&[d, f, k], 7), Give::Shard(0)),
            ],
            take: Take::Sharded(0),
        },
    ]
}

/// Runs `exec` on `d` devices with `options`; the assembled output and every rank's plan.
fn run_case(
    exec: &FusionExecutor,
    d: usize,
    case: &Case,
    options: &ExecOptions,
) -> (Tensor, Vec<Option<Arc<PlanReport>>>) {
    let world = world(d);
    let per_rank = world
        .run(|rank| {
            let local = distribute(rank, &case.inputs)?;
            let refs: Vec<&Tensor> = local.iter().collect();
            let report = exec.run_with(rank, &refs, None, options)?;
            Ok((rank.to_host(&report.outputs[0])?, report.plan))
        })
        .unwrap_or_else(|e| panic!("{} on {d} devices: {e}", case.name));
    let parts: Vec<Tensor> = per_rank.iter().map(|p| p.0.clone()).collect();
    let out = match case.take {
        Take::Replicated => parts[0].clone(),
        ref t => assemble(&parts, t),
    };
    (out, per_rank.into_iter().map(|p| p.1).collect())
}

fn close(a: &Tensor, b: &Tensor, what: &str) {
    let (a, b) = (a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap());
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
            "{what}: [{i}] {x} vs {y}"
        );
    }
}

/// A plan file of its own for each test.
fn plan_file(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fusion-plans-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir.join("plans.json")
}

fn tuned(file: &std::path::Path) -> ExecOptions {
    ExecOptions {
        plan: PlanMode::Tune,
        plan_file: Some(file.to_path_buf()),
        ..ExecOptions::default()
    }
}

#[test]
fn every_candidate_computes_the_unpipelined_result() {
    for d in device_counts() {
        for case in cases_for(d, 1) {
            let exec = FusionExecutor::new(case.fusion.clone());
            let mut whole = ExecOptions::default();
            whole.lower.pipelines.pipelining = Pipelining::Never;
            let (want, _) = run_case(&exec, d, &case, &whole);
            let mut programs = std::collections::BTreeSet::new();
            for p in plan::candidates(d) {
                // As the plan space gives it, and pipelined at these small shapes too.
                for always in [false, true] {
                    let mut lower = p.lower.clone();
                    if always {
                        lower.pipelines.pipelining = Pipelining::Always;
                    }
                    // Run as given: nothing chosen (on GPUs the default mode would tune).
                    let o = ExecOptions {
                        lower,
                        number_of_streams: p.number_of_streams,
                        race_check: true,
                        plan: PlanMode::Default,
                        ..ExecOptions::default()
                    };
                    // A candidate that does not apply to this fusion is refused by the
                    // lowering (and skipped by the plan choice).
                    let program = world(d).run(|rank| {
                        let local = distribute(rank, &case.inputs)?;
                        let refs: Vec<&Tensor> = local.iter().collect();
                        Ok(exec.program(rank, &refs, &o)?.to_string())
                    });
                    let Ok(program) = program else {
                        continue;
                    };
                    programs.insert(program[0].clone());
                    let (got, _) = run_case(&exec, d, &case, &o);
                    let what = format!(
                        "{} on {d} devices, plan {} (always {always})",
                        case.name, p.name
                    );
                    close(&got, &want, &what);
                }
            }
            if d > 1 {
                assert!(
                    programs.len() >= 3,
                    "{} on {d} devices: {} distinct programs",
                    case.name,
                    programs.len()
                );
            }
        }
    }
}

#[test]
fn tuning_gives_every_rank_one_plan_and_keeps_it() {
    let file = plan_file("tuning");
    for d in [2, 4].into_iter().filter(|&d| runnable(d)) {
        for case in cases_for(d, 2) {
            let exec = FusionExecutor::new(case.fusion.clone()).with_name(case.name);
            let mut whole = ExecOptions::default();
            whole.lower.pipelines.pipelining = Pipelining::Never;
            let (want, _) = run_case(&exec, d, &case, &whole);
            let (got, plans) = run_case(&exec, d, &case, &tuned(&file));
            close(&got, &want, case.name);
            let first = plans[0].clone().expect("a plan report");
            assert_eq!(first.source, PlanSource::Tuned, "{first}");
            assert!(first.candidates.len() > 1, "{first}");
            assert!(
                first.candidates.iter().all(|c| c.tuned_ms.is_some()),
                "{first}"
            );
            assert!(first.tuning_ms > 0.0);
            // Back-to-back calls between device markers (host instants on the CPU
            // backend), unless traced calls need the markers.
            let traced = std::env::var_os("FUSION_TRACE").is_some();
            assert_eq!(first.device_timed, !traced, "{first}");
            for p in &plans {
                assert_eq!(
                    p.as_ref().unwrap().plan,
                    first.plan,
                    "every rank runs one plan"
                );
            }
            let text = first.to_string();
            assert!(text.contains(&format!("plan: {}", first.plan)), "{text}");
            let clock = if traced { "host-timed" } else { "device-timed" };
            assert!(text.contains(clock), "{text}");
            phases_add_up(&first);
            assert_eq!(exec.tunings(), d, "each rank decided once");
            // Later calls of the shape keep the decision.
            let (again, plans) = run_case(&exec, d, &case, &tuned(&file));
            close(&again, &want, case.name);
            assert_eq!(exec.tunings(), d);
            assert_eq!(plans[1].as_ref().unwrap().plan, first.plan);
        }
    }
}

/// The report says where the tuning's time went: every phase of a tuned decision took
/// time, the timed phases make up the tuning time, and the text prints them; candidates
/// were timed in the first rounds at least, and the chosen one in all (and in the tie
/// rounds where it was tied).
fn phases_add_up(report: &PlanReport) {
    let p = &report.phases;
    let timed = [
        p.first_calls_ms,
        p.comparison_ms,
        p.capture_ms,
        p.sizing_ms,
        p.rounds_ms,
    ];
    assert!(
        p.lowering_ms > 0.0 && timed.iter().all(|&ms| ms > 0.0),
        "{report}"
    );
    let sum: f64 = timed.iter().sum::<f64>() + p.release_ms;
    assert!(sum <= report.tuning_ms * 1.001 + 0.01, "{sum} of {report}");
    let text = report.to_string();
    for phase in [
        "//   phases: ",
        "lowering ",
        "first calls ",
        "comparison ",
        "capture ",
        "batch sizing ",
        "rounds ",
    ] {
        assert!(text.contains(phase), "{phase}: {text}");
    }
    assert!(report.candidates.iter().all(|c| c.rounds >= 2), "{report}");
    let chosen = (report.candidates.iter())
        .find(|c| c.name == report.plan)
        .expect("the chosen candidate");
    // Every round, and 6 more where another candidate's median was within 3% of its own.
    assert!([7, 13].contains(&chosen.rounds), "{report}");
}

/// Each candidate is lowered once per process (the ranks share the executor's programs),
/// and the call path runs the chosen candidate's program from the cache: later calls
/// lower nothing.
#[test]
fn each_candidate_is_lowered_once() {
    let file = plan_file("lowered-once");
    let d = 2;
    let case = cases_for(d, 8).remove(2);
    let exec = FusionExecutor::new(case.fusion.clone()).with_name(case.name);
    run_case(&exec, d, &case, &tuned(&file));
    let lowered = exec.lowering_count();
    assert!(
        (2..=plan::candidates(d).len()).contains(&lowered),
        "{lowered} lowerings for {} candidates",
        plan::candidates(d).len()
    );
    run_case(&exec, d, &case, &tuned(&file));
    assert_eq!(exec.lowering_count(), lowered, "nothing lowered again");
}

#[test]
fn a_later_process_reads_the_plan_file_and_tunes_nothing() {
    let file = plan_file("second");
    let d = 2;
    for case in cases_for(d, 3) {
        let first = FusionExecutor::new(case.fusion.clone()).with_name(case.name);
        let (want, plans) = run_case(&first, d, &case, &tuned(&file));
        let chosen = plans[0].as_ref().unwrap().plan.clone();
        assert!(file.exists(), "rank 0 wrote {}", file.display());
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("\"timed\""), "{text}");
        // A new executor knows nothing: like a second process, it has only the file.
        let second = FusionExecutor::new(case.fusion.clone()).with_name(case.name);
        let (got, plans) = run_case(&second, d, &case, &tuned(&file));
        close(&got, &want, case.name);
        assert_eq!(second.tunings(), 0, "nothing timed");
        for p in &plans {
            let p = p.as_ref().unwrap();
            assert_eq!(p.source, PlanSource::File, "{p}");
            assert_eq!(p.plan, chosen);
        }
    }
}

#[test]
fn untrusted_plan_files_are_ignored_with_a_warning() {
    let file = plan_file("untrusted");
    let d = 2;
    let case = cases_for(d, 4).remove(0);
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    std::fs::write(&file, "{ this is not json").unwrap();
    let exec = FusionExecutor::new(case.fusion.clone()).with_name(case.name);
    let (_, plans) = run_case(&exec, d, &case, &tuned(&file));
    let p = plans[0].as_ref().unwrap();
    assert_eq!(p.source, PlanSource::Tuned, "{p}");
    assert!(
        p.warnings.iter().any(|w| w.contains("not JSON")),
        "{:?}",
        p.warnings
    );
    // The file was replaced by a good one; now make its entry name a plan that is not a
    // candidate (a stale entry): it is not trusted either.
    let text = std::fs::read_to_string(&file).unwrap();
    let stale = text.replace(
        &format!("\"plan\": \"{}\"", p.plan),
        "\"plan\": \"no_such_plan\"",
    );
    assert_ne!(stale, text, "{text}");
    std::fs::write(&file, stale).unwrap();
    let again = FusionExecutor::new(case.fusion.clone()).with_name(case.name);
    let (_, plans) = run_case(&again, d, &case, &tuned(&file));
    let p = plans[0].as_ref().unwrap();
    assert_eq!(p.source, PlanSource::Tuned, "{p}");
    assert!(
        p.warnings.iter().any(|w| w.contains("no_such_plan")),
        "{:?}",
        p.warnings
    );
    // Another version of the format is not read either.
    std::fs::write(
        &file,
        r#"{"format": "fusion-plans", "version": 0, "entries": {}}"#,
    )
    .unwrap();
    let third = FusionExecutor::new(case.fusion.clone()).with_name(case.name);
    let (_, plans) = run_case(&third, d, &case, &tuned(&file));
    let p = plans[0].as_ref().unwrap();
    assert!(
        p.warnings.iter().any(|w| w.contains("version")),
        "{:?}",
        p.warnings
    );
}

#[test]
fn the_model_picks_without_timing() {
    for d in [2, 3, 4, 8].into_iter().filter(|&d| runnable(d)) {
        for case in cases_for(d, 5) {
            let exec = FusionExecutor::new(case.fusion.clone());
            // A plan file of its own that nothing wrote: the model decides.
            let o = ExecOptions {
                plan: PlanMode::Model,
                plan_file: Some(plan_file(&format!("model-{d}-{}", case.name))),
                ..ExecOptions::default()
            };
            let mut whole = ExecOptions::default();
            whole.lower.pipelines.pipelining = Pipelining::Never;
            let (want, _) = run_case(&exec, d, &case, &whole);
            let (got, plans) = run_case(&exec, d, &case, &o);
            close(&got, &want, case.name);
            assert_eq!(exec.tunings(), 0);
            let first = plans[0].as_ref().unwrap();
            assert!(
                matches!(first.source, PlanSource::Model | PlanSource::OnlyCandidate),
                "{first}"
            );
            assert!(first.candidates.iter().all(|c| c.model_ms > 0.0), "{first}");
            for p in &plans {
                assert_eq!(p.as_ref().unwrap().plan, first.plan);
            }
        }
    }
}

#[test]
fn options_set_by_hand_are_the_plan() {
    let d = 2;
    let case = cases_for(d, 6).remove(1);
    let exec = FusionExecutor::new(case.fusion.clone());
    let mut by_hand = ExecOptions {
        plan: PlanMode::Tune,
        ..ExecOptions::default()
    };
    by_hand.lower.pipelines.pipelining = Pipelining::Always;
    let (_, plans) = run_case(&exec, d, &case, &by_hand);
    assert!(plans.iter().all(Option::is_none));
    let streams = ExecOptions {
        plan: PlanMode::Tune,
        number_of_streams: 2,
        ..ExecOptions::default()
    };
    let (_, plans) = run_case(&exec, d, &case, &streams);
    assert!(plans.iter().all(Option::is_none));
    assert_eq!(exec.tunings(), 0);
    // On the CPU backend the default mode chooses nothing (unless FUSION_PLAN says so).
    if std::env::var_os("FUSION_PLAN").is_none()
        && std::env::var("FUSION_BACKEND").as_deref() != Ok("cuda")
    {
        let (_, plans) = run_case(&exec, d, &case, &ExecOptions::default());
        assert!(plans.iter().all(Option::is_none));
    }
}

#[test]
fn the_trace_file_says_which_plan_ran() {
    let file = plan_file("trace");
    let dir = file.parent().unwrap().join("traces");
    let d = 2;
    let case = cases_for(d, 7).remove(2);
    let exec = FusionExecutor::new(case.fusion.clone()).with_name("traced_mlp");
    let o = ExecOptions {
        trace_dir: Some(dir.clone()),
        ..tuned(&file)
    };
    let (_, plans) = run_case(&exec, d, &case, &o);
    let chosen = plans[0].as_ref().unwrap().plan.clone();
    let traces: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(traces.len(), d, "one trace per rank");
    for t in traces {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(t.path()).unwrap()).unwrap();
        let plan = v["otherData"]["plan"].as_str().unwrap();
        assert!(plan.starts_with(&format!("plan: {chosen} (")), "{plan}");
    }
}

/// The markers tuning times a batch of calls with: on the stream a call ends on (the main
/// stream without a caller's stream), the time between two of them in ms.
#[test]
fn call_markers_time_what_runs_between_them() {
    let times = world(1)
        .run(|rank| {
            let device = rank.device();
            let start = device.record_call_marker(None)?;
            std::thread::sleep(std::time::Duration::from_millis(5));
            let end = device.record_call_marker(None)?;
            let ms = device.marker_elapsed_ms(start, end)?;
            let back = device.marker_elapsed_ms(end, start)?;
            device.clear_markers();
            Ok((ms, back))
        })
        .unwrap();
    let (ms, back) = times[0];
    assert!((4.0..1000.0).contains(&ms), "{ms} ms");
    assert!(back <= 0.0, "{back} ms");
}

/// The comparison tuning runs on the device (`Device::discrepancy`) gives what the host's
/// `Tensor::rel_error` gives: for contiguous tensors of each dtype (on GPUs, the kernel),
/// for a transposed view (copied first), against zeros, and infinite for a NaN or an
/// infinity on either side.
#[test]
fn the_device_comparison_matches_the_host_one() {
    if !runnable(1) {
        return;
    }
    world(1)
        .run(|rank| {
            let device = rank.device();
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let want = Tensor::randn(&[257, 33], dtype, 11);
                let noisy: Vec<f32> = (want.to_f32_vec()?.iter().enumerate())
                    .map(|(i, x)| x * (1.0 + 0.02 * ((i % 5) as f32 - 2.0)))
                    .collect();
                let got = Tensor::from_f32(&[257, 33], &noisy, dtype)?;
                let (g, w) = (rank.to_device(&got)?, rank.to_device(&want)?);
                let (gt, wt) = (g.permute(&[1, 0])?, w.permute(&[1, 0])?);
                let host = got.rel_error(&want)?;
                for (a, b) in [(&g, &w), (&gt, &wt)] {
                    let e = device.discrepancy(a, b)?.relative();
                    assert!((e - host).abs() <= 1e-9 * host, "{dtype}: {e} vs {host}");
                }
                let zeros = rank.to_device(&Tensor::zeros(&[257, 33], dtype))?;
                let e = device.discrepancy(&g, &zeros)?.relative();
                let norm = got.rel_error(&Tensor::zeros(&[257, 33], dtype))?;
                assert!((e - norm).abs() <= 1e-9 * norm, "{dtype}: {e} vs {norm}");
                for bad in [f32::NAN, f32::INFINITY] {
                    let mut v = noisy.clone();
                    v[4000] = bad;
                    let b = rank.to_device(&Tensor::from_f32(&[257, 33], &v, dtype)?)?;
                    let one = device.discrepancy(&b, &w)?.relative();
                    let other = device.discrepancy(&w, &b)?.relative();
                    assert_eq!((one, other), (f64::INFINITY, f64::INFINITY), "{dtype}");
                }
            }
            assert!(device
                .discrepancy(
                    &Tensor::zeros(&[2], DType::F32),
                    &Tensor::zeros(&[3], DType::F32)
                )
                .is_err());
            Ok(())
        })
        .unwrap();
}
