//! `examples/candle_llama` on the CPU backend: the Llama layer with its tensor-parallel
//! parts as fusions, on 1, 2 and 4 simulated devices and as 2 launched processes, in f32
//! and bf16, in both forms for prefill and decode, with the decode step recorded once and
//! replayed (`--graph`: on the CPU its body runs again on the same fixed buffers), and
//! candle's own modes; every output (prefill and decode, with tokens that do and do not
//! divide by the rank count) within the dtype's tolerance of candle alone in f32; and the
//! step's own ops on the CPU (the KV-cache write at positions in any order, the fused
//! rotary embedding and RMSNorm, grouped attention) against candle's plain ones.

#[path = "../examples/candle_llama/app.rs"]
mod app;
#[path = "../examples/candle_llama/cache.rs"]
mod cache;
#[path = "../examples/candle_llama/calls.rs"]
mod calls;
mod common;
#[path = "../examples/candle_llama/config.rs"]
mod config;
#[path = "../examples/candle_llama/fusions.rs"]
mod fusions;
#[path = "../examples/candle_llama/graph.rs"]
mod graph;
#[path = "../examples/candle_llama/kernels.rs"]
mod kernels;
#[path = "../examples/candle_llama/layer.rs"]
mod layer;
#[path = "../examples/candle_llama/ops.rs"]
mod ops;
#[path = "../examples/candle_llama/reference.rs"]
mod reference;
#[path = "../examples/candle_llama/report.rs"]
mod report;
#[path = "../examples/candle_llama/schedule.rs"]
mod schedule;
#[path = "../examples/candle_llama/sections.rs"]
mod sections;
#[path = "../examples/candle_llama/tp.rs"]
mod tp;

use std::time::Duration;

use app::Args;
use candle_core::{Device, Tensor as CTensor};
use clap::Parser;
use common::launch::{expect_success, launch};
use fusion::runtime::world::LaunchSpec;

/// The example's arguments for a small run (24 prefill tokens timed 3 times, 3 decode
/// steps, unless `extra` says otherwise) on `devices` (`None`: the launcher's world),
/// with a weights file of its own.
fn args(devices: Option<usize>, extra: &[&str]) -> Args {
    let name: String = extra
        .concat()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect();
    let weights = std::env::temp_dir().join(format!(
        "fusion-test-llama-{}-{devices:?}-{name}.safetensors",
        std::process::id()
    ));
    let mut argv = vec!["candle_llama".to_string()];
    for (flag, value) in [
        ("--prefill", "24"),
        ("--prefill-reps", "3"),
        ("--decode-steps", "3"),
        ("--seed", "11"),
    ] {
        if !extra.contains(&flag) {
            argv.extend([flag.to_string(), value.to_string()]);
        }
    }
    argv.extend(["--weights".into(), weights.display().to_string()]);
    if let Some(d) = devices {
        argv.extend(["--devices".into(), d.to_string()]);
    }
    argv.extend(extra.iter().map(|s| s.to_string()));
    Args::try_parse_from(argv).unwrap()
}

/// Runs the example, panicking with what ran when it fails.
fn run(devices: usize, extra: &[&str]) {
    let args = args(Some(devices), extra);
    let weights = args.weights.clone();
    let ran = app::run(args);
    if let Some(w) = weights {
        let _ = std::fs::remove_file(w);
    }
    ran.unwrap_or_else(|e| panic!("{devices} devices, {extra:?}: {e}"));
}

fn in_child() -> bool {
    LaunchSpec::from_env().ok().flatten().is_some()
}

#[test]
fn the_layer_matches_candle_alone_on_1_2_and_4_devices() {
    if in_child() {
        return;
    }
    for d in [1, 2, 4] {
        for dtype in ["f32", "bf16"] {
            // The default forms (a prefill this short runs tensor-parallel), then the
            // sequence-parallel prefill with 3 tokens per decode step (its rows padded on 2
            // and 4 ranks).
            run(d, &["--dtype", dtype, "--decode-tokens", "1"]);
            let sp_prefill = ["--prefill-form", "sp", "--decode-tokens", "3"];
            run(d, &[&["--dtype", dtype][..], &sp_prefill[..]].concat());
        }
    }
}

#[test]
fn prefills_run_tensor_parallel_up_to_512_tokens_and_sequence_parallel_above() {
    use layer::Form;
    assert_eq!(Form::for_prefill(1), Form::Tp);
    assert_eq!(Form::for_prefill(512), Form::Tp);
    assert_eq!(Form::for_prefill(513), Form::Sp);
    assert_eq!(Form::for_prefill(2048), Form::Sp);
    let plan = |extra: &[&str]| args(Some(2), extra).plan().unwrap();
    assert_eq!(plan(&["--prefill", "512"]).prefill_form, Form::Tp);
    assert_eq!(plan(&["--prefill", "2048"]).prefill_form, Form::Sp);
    let asked = ["--prefill", "64", "--prefill-form", "sp"];
    assert_eq!(plan(&asked).prefill_form, Form::Sp);
    // Candle's modes have the tensor-parallel form only, whatever the length.
    assert_eq!(
        plan(&["--prefill", "2048", "--candle-tp"]).prefill_form,
        Form::Tp
    );
}

#[test]
fn both_forms_serve_prefill_and_decode() {
    if in_child() {
        return;
    }
    for d in [2, 4] {
        let sp_decode = ["--decode-form", "sp", "--prefill-form", "tp"];
        run(d, &[&sp_decode[..], &["--decode-tokens", "3"]].concat());
        let tp_only = [
            "--decode-form",
            "tp",
            "--prefill-form",
            "tp",
            "--prefill",
            "32",
        ];
        run(d, &tp_only);
    }
    // 1024 prefill tokens: the tensor-parallel projections in 4 pipelined chunks.
    run(
        2,
        &[
            "--prefill-form",
            "tp",
            "--prefill",
            "1024",
            "--prefill-reps",
            "1",
        ],
    );
}

#[test]
fn a_step_of_several_layers_matches_candle_alone() {
    // `--layers 3`: each step runs the layer three times, a KV cache each, and so does
    // the reference (one cache for every layer, on either side, fails the check).
    if in_child() {
        return;
    }
    assert_eq!(args(None, &["--layers", "3"]).plan().unwrap().layers, 3);
    assert!(Args::try_parse_from(["candle_llama", "--layers", "0"]).is_err());
    for d in [1, 2, 4] {
        run(d, &["--layers", "3", "--decode-tokens", "2"]);
    }
    let sp = [
        "--decode-form",
        "sp",
        "--prefill-form",
        "sp",
        "--decode-tokens",
        "3",
    ];
    run(2, &[&["--layers", "2"][..], &sp[..]].concat());
    run(2, &["--layers", "3", "--graph", "--dtype", "bf16"]);
    run(2, &["--layers", "2", "--candle-only"]);
}

#[test]
fn a_recorded_decode_step_replays_at_every_position() {
    if in_child() {
        return;
    }
    for d in [1, 2, 4] {
        for form in ["tp", "sp"] {
            run(
                d,
                &["--graph", "--decode-form", form, "--decode-tokens", "3"],
            );
        }
    }
    run(2, &["--graph", "--dtype", "bf16"]);
    run(2, &["--graph", "--candle-only"]);
    run(1, &["--graph", "--candle-tp"]);
}

#[test]
fn sections_time_every_part_of_each_step_in_order() {
    if in_child() {
        return;
    }
    let mut s = sections::Sections::new(&Device::Cpu);
    for _ in 0..3 {
        s.mark("first").unwrap();
        std::thread::sleep(Duration::from_millis(2));
        s.mark("second").unwrap();
        s.finish_step().unwrap();
    }
    let medians = s.medians();
    let names: Vec<_> = medians.iter().map(|p| p.name).collect();
    assert_eq!(names, ["first", "second"]);
    let times: Vec<_> = medians.iter().map(|p| (p.ms, p.host_ms)).collect();
    assert!(medians[0].ms >= 2.0 && medians[1].ms >= 0.0, "{times:?}");
    // On the CPU the marks are the host's clock: both times are the same.
    assert!(medians.iter().all(|p| p.ms == p.host_ms), "{times:?}");
    let line = sections::describe("decode", &medians);
    assert!(
        line.contains("decode sections") && line.contains("| second ") && line.contains("(host "),
        "{line}"
    );
    // The example with --sections, both forms and a recorded decode step.
    run(2, &["--sections", "--decode-form", "sp"]);
    run(2, &["--sections", "--graph"]);
}

#[test]
fn call_times_keep_each_calls_copies_and_call_apart_in_call_order() {
    if in_child() {
        return;
    }
    let mut t = calls::CallTimes::default();
    assert!(t.is_empty());
    let time = |copies, call, setup: f64, launch| calls::CallTime {
        copies,
        call,
        setup,
        launch,
        phases: fusion::runtime::eval::ReplayPhases {
            program: (setup * 500.0) as u64,
            join: 100,
            ..Default::default()
        },
    };
    for (copies, call) in [(3.0, 10.0), (1.0, 30.0), (2.0, 20.0)] {
        t.add("attention", time(copies, call, 0.0, 0.0));
        t.add("h_norm", time(10.0 * copies, 0.5, call / 10.0, copies));
    }
    let line = t.describe("decode");
    assert_eq!(
        line,
        "  decode fusion calls' host time, median us: attention copies 2.0 call 20.0 \
         (3 calls) | h_norm copies 20.0 call 0.5 (setup 2.0: program 1.0 ledger 0.0 plan 0.0 \
         begin 0.0 slot 0.0 join 0.1; launch 2.0) (3 calls)"
    );
}

#[test]
fn a_recorded_step_keeps_its_marks_for_every_replay() {
    if in_child() {
        return;
    }
    let mut s = sections::Sections::new(&Device::Cpu);
    s.begin_recording();
    s.mark("first").unwrap();
    s.mark("second").unwrap();
    s.end_recording().unwrap();
    // On the CPU a replay runs the recorded body again, marking as it goes.
    for _ in 0..3 {
        s.mark("first").unwrap();
        std::thread::sleep(Duration::from_millis(2));
        s.mark("second").unwrap();
        s.finish_replay().unwrap();
    }
    let medians = s.medians();
    let names: Vec<_> = medians.iter().map(|p| p.name).collect();
    assert_eq!(names, ["first", "second"]);
    assert!(medians[0].ms >= 2.0, "{:?}", medians[0].ms);
    // The recording's own marks are not a step: every part has the three replays' times.
    assert!(medians.iter().all(|p| p.ms == p.host_ms));
}

#[test]
fn candle_modes_have_the_tensor_parallel_form_only() {
    if in_child() {
        return;
    }
    run(2, &["--candle-only"]);
    run(1, &["--candle-tp"]);
    let err = app::run(args(Some(2), &["--candle-only", "--decode-form", "sp"]))
        .expect_err("candle has no sequence-parallel form");
    assert!(err.to_string().contains("--decode-form sp"), "{err}");
    let err = app::run(args(Some(2), &["--candle-tp"])).expect_err("no NCCL on the CPU");
    assert!(err.to_string().contains("candle-cuda"), "{err}");
}

/// The largest absolute difference between two tensors of one shape.
fn max_diff(a: &CTensor, b: &CTensor) -> f32 {
    (a - b)
        .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
        .unwrap()
}

fn randn(shape: &[usize]) -> CTensor {
    CTensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

#[test]
fn the_cache_write_puts_each_row_at_its_position() {
    let (kv, cap, hd) = (3, 9, 4);
    for positions in [vec![4u32], vec![6, 1, 3], vec![8, 0, 5, 2]] {
        let t = positions.len();
        let cache = CTensor::zeros((kv, cap, hd), candle_core::DType::F32, &Device::Cpu).unwrap();
        // The rows as a strided view (every other head of a wider tensor).
        let wide = randn(&[t, 2 * kv, hd]);
        let rows = wide.narrow(1, 0, kv).unwrap();
        let pos = CTensor::new(positions.as_slice(), &Device::Cpu).unwrap();
        kernels::write_rows(&cache, &rows, &pos).unwrap();
        let cache: Vec<Vec<Vec<f32>>> = cache.to_vec3().unwrap();
        let rows: Vec<Vec<Vec<f32>>> = rows.to_vec3().unwrap();
        for (g, head) in cache.iter().enumerate() {
            for (p, row) in head.iter().enumerate() {
                let want = match positions.iter().position(|&q| q as usize == p) {
                    Some(i) => rows[i][g].clone(),
                    None => vec![0.0; hd],
                };
                assert_eq!(row, &want, "head {g}, position {p}, {positions:?}");
            }
        }
    }
}

#[test]
fn grouped_attention_matches_the_repeated_one() {
    let (t, heads, kv, hd, keys) = (3, 8, 2, 16, 7);
    let q = randn(&[t, heads, hd]);
    // [kv, keys, hd] as the cache holds them (a narrowed view of a longer cache).
    let cache = || randn(&[kv, keys + 2, hd]).narrow(1, 0, keys).unwrap();
    let (k, v) = (cache(), cache());
    let mask = ops::causal_mask(t, keys, keys - t, &Device::Cpu).unwrap();
    let positions = cache::positions(keys - t, t, &Device::Cpu).unwrap();
    let grouped = ops::grouped_attention(&q, &k, &v, &positions, &mut |_| Ok(())).unwrap();
    let by_key = |x: &CTensor| x.transpose(0, 1).unwrap().contiguous().unwrap();
    let repeated = ops::attention(&q, &by_key(&k), &by_key(&v), &mask).unwrap();
    let diff = max_diff(&grouped, &repeated);
    assert!(diff < 1e-6, "grouped attention off by {diff}");
}

#[test]
fn the_fused_rope_and_rms_norm_match_candle_ops() {
    let (t, heads, hd, cap) = (3, 4, 8, 10);
    let positions = [7u32, 2, 9];
    let x = randn(&[t, 2 * heads, hd]).narrow(1, 1, heads).unwrap();
    let angles = ops::rope_angles(0..cap, hd, 10_000.0);
    let angles = CTensor::from_vec(angles, (cap, hd / 2), &Device::Cpu).unwrap();
    let table = CTensor::cat(&[angles.cos().unwrap(), angles.sin().unwrap()], 1).unwrap();
    let pos = CTensor::new(&positions[..], &Device::Cpu).unwrap();
    let fused = kernels::rope(&x, &pos, &table).unwrap();
    let pick = |c: usize| {
        let rows = table.narrow(1, c, hd / 2).unwrap().contiguous().unwrap();
        rows.index_select(&pos, 0)
            .unwrap()
            .reshape((t, 1, hd / 2))
            .unwrap()
    };
    let plain = ops::rotate(&x, &pick(0), &pick(hd / 2)).unwrap();
    assert!(max_diff(&fused, &plain) < 1e-6);
    let (h, w) = (randn(&[5, 32]), randn(&[32]));
    let fused = kernels::rms_norm(&h, &w, 1e-5).unwrap();
    let plain = ops::rms_norm(&h, &w, 1e-5).unwrap();
    assert!(max_diff(&fused, &plain) < 1e-5);
}

#[test]
#[ignore = "a rank process of `the_layer_matches_candle_alone_in_2_launched_processes`"]
fn child_llama() {
    assert!(
        in_child(),
        "run by the_layer_matches_candle_alone_in_2_launched_processes"
    );
    let dtype = std::env::var("LLAMA_DTYPE").unwrap_or_else(|_| "f32".into());
    let graph = std::env::var("LLAMA_GRAPH").is_ok_and(|g| g == "1");
    let mut extra = vec!["--dtype", dtype.as_str(), "--decode-tokens", "2"];
    // The sequence-parallel prefill across processes (its AllGather and ReduceScatter).
    extra.extend(["--prefill-form", "sp"]);
    extra.extend(graph.then_some("--graph"));
    app::run(args(None, &extra)).unwrap();
    println!("LLAMA-OK");
}

#[test]
fn the_layer_matches_candle_alone_in_2_launched_processes() {
    if in_child() {
        return;
    }
    // bf16 with the decode step recorded and replayed.
    for (dtype, graph) in [("f32", "0"), ("bf16", "1")] {
        let ended = launch(
            2,
            &[0, 1],
            &[
                "--exact",
                "child_llama",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ],
            &[
                ("FUSION_TIMEOUT", "60".into()),
                ("LLAMA_DTYPE", dtype.into()),
                ("LLAMA_GRAPH", graph.into()),
            ],
            |_| Vec::new(),
            Duration::from_secs(240),
        );
        expect_success(&ended);
        for e in &ended {
            assert!(e.stdout.contains("LLAMA-OK"), "{}", e.log());
            assert!(
                e.stdout.contains("2 ranks (1 in this process)"),
                "{}",
                e.log()
            );
        }
        // Rank 0 checks every step against the reference, says so, and prints every
        // rank's times in the table.
        for line in [
            "check: max relative error",
            "| fusions | decode | tp |",
            "rank 1 ",
        ] {
            assert!(ended[0].stdout.contains(line), "{line}: {}", ended[0].log());
        }
    }
}
