//! Draws traced calls as an SVG timeline: one row per stream per rank, GEMMs and
//! transfers coloured by the chunk (stream-loop index) they belong to, a time axis in
//! milliseconds and a legend. Built with the `svg` crate.

use std::collections::BTreeSet;

use fusion::runtime::trace::TraceEvent;
use svg::node::element::{Definitions, Group, Line, Pattern, Rectangle, Text, Title};
use svg::Document;

/// Chunk colours (a qualitative palette); chunk `c` gets `PALETTE[c % len]`.
const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];
/// Work that belongs to no chunk, and kernels that are neither GEMMs nor transfers.
const OTHER: &str = "#9a9a9a";

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 170.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 64.0;
const ROW: f64 = 22.0;
const ROW_GAP: f64 = 4.0;
const RANK_GAP: f64 = 14.0;
const FONT: &str = "DejaVu Sans, Helvetica, Arial, sans-serif";

/// What one picture shows: a title line, a line of details, and every rank's events.
pub struct Timeline<'a> {
    pub title: &'a str,
    pub subtitle: &'a str,
    /// `(rank, device intervals)`, in ms from each rank's call start.
    pub ranks: &'a [(usize, Vec<TraceEvent>)],
}

/// How an event is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Gemm,
    Transfer,
    Other,
}

/// GEMMs (`matmul`, `linear`), transfers (communications), or other kernels.
pub fn kind(e: &TraceEvent) -> Kind {
    if e.communication {
        Kind::Transfer
    } else if e.name == "matmul" || e.name == "linear" {
        Kind::Gemm
    } else {
        Kind::Other
    }
}

fn colour(e: &TraceEvent) -> &'static str {
    match (kind(e), e.chunk) {
        (Kind::Other, _) | (_, None) => OTHER,
        (_, Some(c)) => PALETTE[c.rem_euclid(PALETTE.len() as i64) as usize],
    }
}

/// A round tick step giving about `target` ticks over `span`.
pub fn tick_step(span: f64, target: f64) -> f64 {
    if span <= 0.0 || !span.is_finite() {
        return 1.0;
    }
    let raw = span / target;
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag)
}

fn text(x: f64, y: f64, size: f64, anchor: &str, content: impl Into<String>) -> Text {
    Text::new(content)
        .set("x", x)
        .set("y", y)
        .set("font-size", size)
        .set("font-family", FONT)
        .set("text-anchor", anchor)
}

/// The hatching that marks transfers, one pattern per colour used.
fn hatch_id(colour: &str) -> String {
    format!("hatch{}", colour.trim_start_matches('#'))
}

fn hatch(colour: &str) -> Pattern {
    Pattern::new()
        .set("id", hatch_id(colour))
        .set("width", 6)
        .set("height", 6)
        .set("patternUnits", "userSpaceOnUse")
        .set("patternTransform", "rotate(45)")
        .add(
            Rectangle::new()
                .set("width", 6)
                .set("height", 6)
                .set("fill", colour)
                .set("fill-opacity", 0.35),
        )
        .add(
            Line::new()
                .set("x1", 0)
                .set("y1", 0)
                .set("x2", 0)
                .set("y2", 6)
                .set("stroke", colour)
                .set("stroke-width", 3),
        )
}

/// The SVG document of a timeline.
pub fn render(t: &Timeline<'_>) -> Document {
    let layout = Layout::new(t);
    let mut doc = Document::new();
    let mut defs = Definitions::new();
    let hatched: BTreeSet<&str> = t
        .ranks
        .iter()
        .flat_map(|(_, evs)| evs.iter())
        .filter(|e| kind(e) == Kind::Transfer)
        .map(colour)
        .collect();
    for c in &hatched {
        defs = defs.add(hatch(c));
    }
    doc = doc.add(defs);
    doc = doc.add(
        Rectangle::new()
            .set("width", WIDTH)
            .set("height", "100%")
            .set("fill", "white"),
    );
    doc = doc.add(text(LEFT, 24.0, 16.0, "start", t.title).set("font-weight", "bold"));
    doc = doc.add(text(LEFT, 44.0, 12.0, "start", t.subtitle).set("fill", "#444"));
    doc = doc.add(layout.row_labels());
    doc = doc.add(layout.time_axis());
    doc = doc.add(layout.events(t));
    let (legend, bottom) = layout.legend(t);
    let first = PALETTE[0];
    if !hatched.contains(first) {
        doc = doc.add(Definitions::new().add(hatch(first)));
    }
    doc = doc.add(legend);

    let height = bottom + 30.0;
    doc.set("viewBox", (0, 0, WIDTH, height))
        .set("width", WIDTH)
        .set("height", height)
}

/// Where a timeline's parts go: one row per rank and stream (rows of a rank together, a
/// gap between ranks), each row's top, and the time the plot's width spans.
struct Layout {
    /// `(rank, stream)` of each row, top to bottom.
    rows: Vec<(usize, usize)>,
    /// Each row's top.
    ys: Vec<f64>,
    /// Milliseconds across the plot.
    span: f64,
    /// Below the last row.
    plot_bottom: f64,
}

/// The plot's width.
const PLOT_W: f64 = WIDTH - LEFT - RIGHT;

impl Layout {
    fn new(t: &Timeline<'_>) -> Layout {
        let rows: Vec<(usize, usize)> = t
            .ranks
            .iter()
            .flat_map(|(r, evs)| {
                let streams: BTreeSet<usize> = evs.iter().map(|e| e.stream).collect();
                streams.into_iter().map(move |s| (*r, s))
            })
            .collect();
        let end_ms = t
            .ranks
            .iter()
            .flat_map(|(_, evs)| evs.iter().map(|e| e.end_ms))
            .fold(0.0f64, f64::max);
        let span = if end_ms > 0.0 { end_ms } else { 1.0 };
        let mut ys = Vec::with_capacity(rows.len());
        let mut y = TOP;
        for (i, &(r, _)) in rows.iter().enumerate() {
            if i > 0 && rows[i - 1].0 != r {
                y += RANK_GAP;
            }
            ys.push(y);
            y += ROW + ROW_GAP;
        }
        Layout {
            rows,
            ys,
            span,
            plot_bottom: y,
        }
    }

    /// The x of `ms` after the call's start.
    fn x_of(&self, ms: f64) -> f64 {
        LEFT + (ms / self.span).clamp(0.0, 1.0) * PLOT_W
    }

    /// Row backgrounds and labels.
    fn row_labels(&self) -> Group {
        let mut labels = Group::new().set("class", "rows");
        for (&(r, s), &y) in self.rows.iter().zip(&self.ys) {
            let label = if s == 0 {
                format!("rank {r} · stream 0 (caller)")
            } else {
                format!("rank {r} · stream {s}")
            };
            labels = labels
                .add(
                    Rectangle::new()
                        .set("x", LEFT)
                        .set("y", y)
                        .set("width", PLOT_W)
                        .set("height", ROW)
                        .set("fill", "#f3f3f3"),
                )
                .add(
                    text(LEFT - 8.0, y + ROW * 0.68, 12.0, "end", label).set("class", "row-label"),
                );
        }
        labels
    }

    /// Time axis: grid lines and labels in ms.
    fn time_axis(&self) -> Group {
        let (span, plot_bottom) = (self.span, self.plot_bottom);
        let step = tick_step(span, 10.0);
        let mut axis = Group::new().set("class", "axis");
        let mut tick = 0.0;
        while tick <= span * (1.0 + 1e-9) {
            let x = self.x_of(tick);
            axis = axis
                .add(
                    Line::new()
                        .set("x1", x)
                        .set("y1", TOP - 4.0)
                        .set("x2", x)
                        .set("y2", plot_bottom)
                        .set("stroke", "#d0d0d0")
                        .set("stroke-width", 1),
                )
                .add(text(
                    x,
                    plot_bottom + 14.0,
                    11.0,
                    "middle",
                    round_label(tick, step),
                ));
            tick += step;
        }
        axis.add(text(
            LEFT + PLOT_W / 2.0,
            plot_bottom + 32.0,
            12.0,
            "middle",
            "time from the call's start on each device (ms)",
        ))
    }

    /// The events: one rectangle each, on its rank's and stream's row.
    fn events(&self, t: &Timeline<'_>) -> Group {
        let mut events = Group::new().set("class", "events");
        for (rank, evs) in t.ranks {
            for e in evs {
                let Some(row) = self
                    .rows
                    .iter()
                    .position(|&(r, s)| r == *rank && s == e.stream)
                else {
                    continue;
                };
                let (x0, x1) = (self.x_of(e.start_ms), self.x_of(e.end_ms));
                let c = colour(e);
                let k = kind(e);
                let (fill, inset) = match k {
                    Kind::Transfer => (format!("url(#{})", hatch_id(c)), 2.0),
                    Kind::Gemm => (c.to_string(), 0.0),
                    Kind::Other => (c.to_string(), 5.0),
                };
                let chunk = e.chunk.map_or(String::new(), |c| format!(" of chunk {c}"));
                let tip = format!(
                    "rank {rank}, stream {}: {}{chunk}, {:.3}-{:.3} ms ({:.3} ms)",
                    e.stream,
                    e.name,
                    e.start_ms,
                    e.end_ms,
                    e.end_ms - e.start_ms
                );
                events = events.add(
                    Rectangle::new()
                        .set("class", "event")
                        .set("x", x0)
                        .set("y", self.ys[row] + inset)
                        .set("width", (x1 - x0).max(0.5))
                        .set("height", ROW - 2.0 * inset)
                        .set("fill", fill)
                        .set("stroke", c)
                        .set("stroke-width", if k == Kind::Transfer { 1.2 } else { 0.0 })
                        .add(Title::new(tip)),
                );
            }
        }
        events
    }

    /// Legend: the chunks' colours, then how GEMMs, transfers and other kernels look; and
    /// the top of its last line.
    fn legend(&self, t: &Timeline<'_>) -> (Group, f64) {
        let chunks: BTreeSet<i64> = t
            .ranks
            .iter()
            .flat_map(|(_, evs)| evs.iter())
            .filter(|e| kind(e) != Kind::Other)
            .filter_map(|e| e.chunk)
            .collect();
        let legend_y = self.plot_bottom + 52.0;
        let mut legend = Group::new().set("class", "legend");
        let mut x = LEFT;
        for &c in &chunks {
            let col = PALETTE[c.rem_euclid(PALETTE.len() as i64) as usize];
            legend = legend
                .add(swatch(x, legend_y, col.to_string(), col, 0.0))
                .add(text(
                    x + 20.0,
                    legend_y + 11.0,
                    12.0,
                    "start",
                    format!("chunk {c}"),
                ));
            x += 80.0;
        }
        let mut x = LEFT;
        let y2 = legend_y + 22.0;
        let first = PALETTE[0];
        for (fill, stroke, width, label) in [
            (first.to_string(), first, 0.0, "GEMM"),
            (
                format!("url(#{})", hatch_id(first)),
                first,
                1.2,
                "transfer (P2P copy or collective)",
            ),
            (
                OTHER.to_string(),
                OTHER,
                0.0,
                "other kernel (sum, copy, fused elementwise)",
            ),
        ] {
            legend = legend.add(swatch(x, y2, fill, stroke, width)).add(text(
                x + 20.0,
                y2 + 11.0,
                12.0,
                "start",
                label,
            ));
            x += 40.0 + 7.0 * label.len() as f64;
        }
        (legend, y2)
    }
}

fn swatch(x: f64, y: f64, fill: String, stroke: &str, width: f64) -> Rectangle {
    Rectangle::new()
        .set("x", x)
        .set("y", y)
        .set("width", 14)
        .set("height", 14)
        .set("fill", fill)
        .set("stroke", stroke)
        .set("stroke-width", width)
}

/// A tick value with as many decimals as its step needs.
fn round_label(v: f64, step: f64) -> String {
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    format!("{v:.decimals$}")
}
