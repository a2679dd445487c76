//! `examples/candle_llama` on the CPU backend: the Llama layer with its tensor-parallel
//! parts as fusions, on 1, 2 and 4 simulated devices and as 2 launched processes, in f32
//! and bf16, every step (prefill and decode, with tokens that do and do not divide by the
//! rank count) within the dtype's tolerance of candle alone in f32.

#[path = "../examples/candle_llama/app.rs"]
mod app;
mod common;
#[path = "../examples/candle_llama/fusions.rs"]
mod fusions;
#[path = "../examples/candle_llama/layer.rs"]
mod layer;
#[path = "../examples/candle_llama/tp.rs"]
mod tp;

use std::time::Duration;

use app::{Args, Dt};
use common::launch::{expect_success, launch};
use fusion::runtime::world::LaunchSpec;

fn args(devices: Option<usize>, dtype: Dt, decode_tokens: usize) -> Args {
    let weights = std::env::temp_dir().join(format!(
        "fusion-test-llama-{}-{decode_tokens}.safetensors",
        std::process::id()
    ));
    Args {
        devices,
        dtype,
        prefill: 24,
        decode_steps: 3,
        decode_tokens,
        llama3_8b: false,
        weights: Some(weights),
        seed: 11,
        candle_tp: false,
        candle_only: false,
    }
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
        for dtype in [Dt::F32, Dt::Bf16] {
            // 3 tokens per decode step: padded on 2 and 4 ranks.
            for decode_tokens in [1, 3] {
                app::run(args(Some(d), dtype, decode_tokens)).unwrap_or_else(|e| {
                    panic!("{d} devices, {dtype:?}, {decode_tokens} tokens per step: {e}")
                });
            }
        }
    }
}

#[test]
#[ignore = "a rank process of `the_layer_matches_candle_alone_in_2_launched_processes`"]
fn child_llama() {
    assert!(
        in_child(),
        "run by the_layer_matches_candle_alone_in_2_launched_processes"
    );
    let dtype = match std::env::var("LLAMA_DTYPE").as_deref() {
        Ok("bf16") => Dt::Bf16,
        _ => Dt::F32,
    };
    app::run(args(None, dtype, 2)).unwrap();
    println!("LLAMA-OK");
}

#[test]
fn the_layer_matches_candle_alone_in_2_launched_processes() {
    if in_child() {
        return;
    }
    for dtype in ["f32", "bf16"] {
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
        // Rank 0 checks every step against the reference and says so.
        assert!(
            ended[0].stdout.contains("check: max relative error"),
            "{}",
            ended[0].log()
        );
    }
}
