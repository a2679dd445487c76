//! The timeline picture of the `timeline` tool (its renderer is included from there): one
//! row per stream per rank, one rectangle per device interval coloured by chunk, a time
//! axis and a legend, drawn from traces that went through the JSON files.

#[allow(dead_code)]
#[path = "../bench/src/bin/timeline/render.rs"]
mod render;

use std::collections::BTreeMap;

use fusion::prelude::*;
use fusion::runtime::trace::{device_events, TraceEvent};
use render::{render, tick_step, Timeline};
use svg::node::element::tag::{self, Type};
use svg::parser::Event;

fusion! {
    #[allow(dead_code)] // called through `run_with`, with options
    fn ag_gemm<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [d @ Stream, m, n]> {
        matmul(a, b)
    }
}

/// What a drawn SVG holds: event rectangles' fills, and every text.
fn parse(svg_text: &str) -> (Vec<String>, Vec<String>) {
    let (mut fills, mut texts) = (Vec::new(), Vec::new());
    let mut in_text = false;
    for event in svg::read(svg_text).unwrap() {
        match event {
            Event::Tag(name, _, attrs)
                if name == tag::Rectangle
                    && attrs.get("class").map(|c| c.to_string()).as_deref() == Some("event") =>
            {
                fills.push(attrs.get("fill").unwrap().to_string());
            }
            Event::Tag(name, ty, _) if name == tag::Text => in_text = ty == Type::Start,
            Event::Text(t) if in_text => texts.push(t.to_string()),
            _ => {}
        }
    }
    (fills, texts)
}

fn ev(name: &str, comm: bool, stream: usize, chunk: Option<i64>, a: f64, b: f64) -> TraceEvent {
    TraceEvent {
        name: name.into(),
        communication: comm,
        stream,
        chunk,
        start_ms: a,
        end_ms: b,
        node: None,
    }
}

#[test]
fn rows_per_stream_and_rank_rectangles_per_event_and_a_legend() {
    let ranks = vec![
        (
            0,
            vec![
                ev("matmul", false, 1, Some(0), 0.0, 0.4),
                ev("P2P group", true, 2, Some(1), 0.0, 0.3),
                ev("matmul", false, 2, Some(1), 0.3, 0.7),
            ],
        ),
        (
            1,
            vec![
                ev("matmul", false, 1, Some(0), 0.0, 0.4),
                ev("sum", false, 0, None, 0.7, 0.8),
            ],
        ),
    ];
    let doc = render(&Timeline {
        title: "t",
        subtitle: "s",
        ranks: &ranks,
    })
    .to_string();
    let (fills, texts) = parse(&doc);
    assert_eq!(fills.len(), 5, "one rectangle per interval");
    // Chunk 0's GEMMs share a colour, chunk 1's GEMM another; the transfer is hatched in
    // chunk 1's colour; the sum (no chunk) is grey.
    assert_eq!(fills[0], fills[3]);
    assert_ne!(fills[0], fills[2]);
    assert!(fills[1].starts_with("url(#hatch") && fills[1].contains(&fills[2][1..]));
    assert_eq!(fills[4], "#9a9a9a");
    for label in [
        "rank 0 · stream 1",
        "rank 0 · stream 2",
        "rank 1 · stream 0 (caller)",
        "rank 1 · stream 1",
        "chunk 0",
        "chunk 1",
        "GEMM",
        "time from the call's start on each device (ms)",
    ] {
        assert!(
            texts.iter().any(|t| t == label),
            "no text `{label}` in {texts:?}"
        );
    }
    assert!(
        texts.iter().any(|t| t == "0.8"),
        "the axis reaches the last interval"
    );
}

#[test]
fn tick_steps_are_round() {
    assert_eq!(tick_step(1.0, 10.0), 0.1);
    assert_eq!(tick_step(0.73, 10.0), 0.1);
    assert_eq!(tick_step(3.2, 10.0), 0.5);
    assert_eq!(tick_step(440.0, 10.0), 50.0);
}

#[test]
fn a_traced_pipeline_draws_from_its_trace_files() {
    let d = 2;
    let dir = std::env::temp_dir().join(format!("fusion-timeline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = ExecOptions {
        trace_dir: Some(dir.clone()),
        lower: LowerOptions {
            pipelines: fusion::PipelineOptions {
                pipelining: Pipelining::Always, // the pipeline at these small shapes
                ..Default::default()
            },
            ..LowerOptions::default()
        },
        ..ExecOptions::default()
    };
    let a = Tensor::randn(&[d, 4, 8], DType::F32, 1);
    let b = Tensor::randn(&[8, 3], DType::F32, 2);
    World::local(d)
        .unwrap()
        .run(|rank| {
            let a: Ranked<3> = rank.shard(&a, 0)?.try_into()?;
            let b: Ranked<2> = rank.to_device(&b)?.try_into()?;
            ag_gemm::run_with(rank, &a, &b, None, &opts)?;
            Ok(())
        })
        .unwrap();
    let mut ranks: BTreeMap<usize, Vec<TraceEvent>> = BTreeMap::new();
    for r in 0..d {
        let text = std::fs::read_to_string(dir.join(format!("ag_gemm-0000-rank{r}.json"))).unwrap();
        for (rank, e) in device_events(&serde_json::from_str(&text).unwrap()) {
            ranks.entry(rank).or_default().push(e);
        }
    }
    let ranks: Vec<(usize, Vec<TraceEvent>)> = ranks.into_iter().collect();
    let events: usize = ranks.iter().map(|r| r.1.len()).sum();
    let gemms = ranks
        .iter()
        .flat_map(|r| &r.1)
        .filter(|e| e.name == "matmul")
        .count();
    assert_eq!(gemms, d * d, "a GEMM per chunk on every rank");
    let (fills, texts) = parse(
        &render(&Timeline {
            title: "t",
            subtitle: "s",
            ranks: &ranks,
        })
        .to_string(),
    );
    assert_eq!(fills.len(), events);
    assert!(texts.iter().any(|t| t == "rank 1 · stream 2"), "{texts:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}
