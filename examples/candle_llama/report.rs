//! What a run prints: a header in every process, and in the process of rank 0 every
//! rank's median times, how the fusion calls ran, the check, and a table of one row per
//! kind of step (lines starting with `| `, for scripts to collect).

use fusion::prelude::*;

use crate::app::{Args, Mode, Plan};
use crate::calls::Replays;
use crate::config::Config;
use crate::layer::Form;
use crate::schedule::{RankRun, RankTimes};

/// The median of `v` (NaN when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Per step, the slowest rank's time; then the median over the steps.
pub fn slowest_median(ranks: &[RankTimes], times: fn(&RankTimes) -> &[f64]) -> f64 {
    let steps = ranks.iter().map(|r| times(r).len()).min().unwrap_or(0);
    median(
        (0..steps)
            .map(|i| ranks.iter().map(|r| times(r)[i]).fold(0.0, f64::max))
            .collect(),
    )
}

/// Prints the run's report (see the module documentation).
pub fn print(world: &World, args: &Args, plan: &Plan, cfg: Config, runs: &[RankRun]) {
    println!(
        "candle_llama: a Llama decoder layer in candle, {}",
        match plan.mode {
            Mode::Fusions => "its tensor-parallel parts as fusions",
            Mode::CandleTp => "candle's own tensor parallelism (all-reduce per block)",
            Mode::Candle => "candle alone on every rank",
        }
    );
    println!(
        "  backend {}, {} ranks ({} in this process), dtype {:?}",
        world.backend().name(),
        world.size(),
        runs.len(),
        args.dtype
    );
    println!(
        "  hidden {}, {} heads ({} KV) of {}, FFN {}; {} a step; prefill {} tokens ({} form, \
         {} times from an empty cache), {} decode steps of {} ({} form{})",
        cfg.hidden,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim(),
        cfg.ffn,
        match plan.layers {
            1 => "one layer".to_string(),
            n => format!("{n} layers (the same weights, a KV cache each)"),
        },
        plan.prefill,
        plan.prefill_form.name(),
        plan.prefill_reps(),
        plan.decode_steps(),
        plan.decode_tokens,
        plan.decode_form.name(),
        if plan.graph {
            ", recorded once and replayed"
        } else {
            ""
        },
    );
    let Some(first) = runs.iter().find(|r| r.index == 0) else {
        return;
    };
    let mut calls = (Replays::default(), Replays::default());
    for r in runs {
        calls.0.add(&r.prefill_calls);
        calls.1.add(&r.decode_calls);
    }
    let ranks = &first.ranks;
    if plan.prefill_reps() > 0 {
        step_lines("prefill", ranks, prefill_ms, &calls.0);
    }
    if plan.decode_steps() > 0 {
        step_lines("decode", ranks, decode_ms, &calls.1);
    }
    if let Some((nodes, calls, kinds)) = &first.graph {
        println!(
            "  the recorded decode step: one CUDA graph of {nodes} nodes, {calls} fusion calls \
             (by kind, child graphs' nodes counted in: {kinds})"
        );
    }
    println!(
        "  device-to-host copies by the runtime during the timed steps: {} (the check comes \
         after)",
        runs.iter().map(|r| r.host_copies).max().unwrap_or(0)
    );
    check_line(args, plan, first);
    table(plan, ranks);
}

/// A kind of step's medians per rank and how its fusion calls ran.
fn step_lines(what: &str, ranks: &[RankTimes], times: fn(&RankTimes) -> &[f64], calls: &Replays) {
    let per_rank: Vec<String> = ranks
        .iter()
        .enumerate()
        .map(|(i, r)| format!("rank {i} {:.3}", median(times(r).to_vec())))
        .collect();
    println!(
        "  {what}: median ms per step on each rank: {}; the slowest rank's, median over \
         steps: {:.3} ms",
        per_rank.join(", "),
        slowest_median(ranks, times)
    );
    if calls.calls > 0 {
        let eager = calls.eager_reasons();
        println!(
            "  {what}: {}/{} fusion calls replayed in this process ({} captured{}{})",
            calls.replayed,
            calls.calls,
            calls.captured,
            if eager.is_empty() { "" } else { "; eager: " },
            eager
        );
    }
}

/// The check's verdict.
fn check_line(args: &Args, plan: &Plan, first: &RankRun) {
    if first.errors.is_empty() {
        return;
    }
    let tolerance = crate::app::tolerance(args.dtype, plan.layers);
    let worst = first.errors.iter().copied().fold(0.0f64, f64::max);
    println!(
        "  check: max relative error {worst:.2e} over {} outputs against candle alone in f32, \
         timed prefills within {:.2e} of the first (tolerance {tolerance:.1e}): {}",
        first.errors.len(),
        first.rep_spread,
        if worst.max(first.rep_spread) <= tolerance {
            "ok"
        } else {
            "FAILED"
        }
    );
}

/// A kind of step's row of the table.
struct Kind {
    step: &'static str,
    form: Form,
    graph: bool,
    tokens: usize,
    times: fn(&RankTimes) -> &[f64],
    calls: fn(&RankTimes) -> (usize, usize),
}

fn prefill_ms(r: &RankTimes) -> &[f64] {
    &r.prefill_ms
}

fn decode_ms(r: &RankTimes) -> &[f64] {
    &r.decode_ms
}

/// The table: one row per kind of step.
fn table(plan: &Plan, ranks: &[RankTimes]) {
    println!(
        "| mode | step | form | graph | tokens | median ms (slowest rank) | fusion calls \
         replayed (all ranks) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut kinds = Vec::new();
    if plan.prefill_reps() > 0 {
        kinds.push(Kind {
            step: "prefill",
            form: plan.prefill_form,
            graph: false,
            tokens: plan.prefill,
            times: prefill_ms,
            calls: |r| r.prefill_calls,
        });
    }
    if plan.decode_steps() > 0 {
        kinds.push(Kind {
            step: "decode",
            form: plan.decode_form,
            graph: plan.graph,
            tokens: plan.decode_tokens,
            times: decode_ms,
            calls: |r| r.decode_calls,
        });
    }
    for k in kinds {
        let (all, replayed) = ranks
            .iter()
            .map(k.calls)
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        println!(
            "| {} | {} | {} | {} | {} | {:.3} | {replayed}/{all} |",
            plan.mode.name(),
            k.step,
            k.form.name(),
            if k.graph { "on" } else { "off" },
            k.tokens,
            slowest_median(ranks, k.times)
        );
    }
}
