//! How the layer calls its fusions: each call's activation and output at fixed addresses
//! (a slot per call and shape), so that the runtime replays the call's CUDA graph, and a
//! count of how every call ran.
//!
//! The runtime replays a call's graph only while the call's inputs and outputs sit where
//! they sat when it was captured. A candle activation is a fresh allocation every step, so
//! each call copies its activations into its slot's inputs (a few kilobytes when decoding)
//! and writes its output into the slot's `OutputBuffer`, which candle then reads in place;
//! an activation that is another call's output (the MLP call's residual `h`, the
//! attention-output call's) is read in place too, without a copy.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::time::Instant;

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use fusion::prelude::*;
use fusion::runtime::replay::ReplayStatus;
use fusion_candle::OutputBuffer;

/// How a set of fusion calls ran.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Replays {
    pub calls: usize,
    pub replayed: usize,
    /// Calls captured as a new graph (and launched).
    pub captured: usize,
    /// Calls that walked their program, by the runtime's reason.
    pub eager: BTreeMap<String, usize>,
}

impl Replays {
    /// Adds other calls' counts.
    pub fn add(&mut self, other: &Replays) {
        self.calls += other.calls;
        self.replayed += other.replayed;
        self.captured += other.captured;
        for (why, n) in &other.eager {
            *self.eager.entry(why.clone()).or_default() += n;
        }
    }

    /// Counts how a call ran.
    pub fn count(&mut self, status: &ReplayStatus) {
        self.calls += 1;
        match status {
            ReplayStatus::Replayed => self.replayed += 1,
            ReplayStatus::Captured(_) => self.captured += 1,
            ReplayStatus::Eager(why) => {
                let mut why = why.to_string();
                why.truncate(160);
                *self.eager.entry(why).or_default() += 1;
            }
        }
    }

    /// `calls` calls that all replayed (inside a replayed step graph).
    #[cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]
    pub fn all_replayed(calls: usize) -> Replays {
        Replays {
            calls,
            replayed: calls,
            ..Replays::default()
        }
    }

    /// The eager reasons in one line, most frequent first (empty when none).
    pub fn eager_reasons(&self) -> String {
        let mut v: Vec<(&String, &usize)> = self.eager.iter().collect();
        v.sort_by(|a, b| b.1.cmp(a.1));
        v.iter()
            .map(|(why, n)| format!("{n}x {why}"))
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// Host time of each fusion call of the timed steps (`--sections`), by call (its first
/// activation's name), in the order the calls first came: copying the activations into
/// the call's slot, and the call itself, in microseconds; of a replayed call also the
/// runtime's part before its graph launch (finding the program, matching addresses) and
/// the launch itself. It tells an eager step's host time in a call apart: candle's copies
/// against the runtime's call, and inside the call the runtime's work against CUDA's.
#[derive(Clone, Debug, Default)]
pub struct CallTimes(Vec<(&'static str, Vec<CallTime>)>);

/// One call's host time, microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallTime {
    /// Copying the activations into the call's slot.
    pub copies: f64,
    /// The call, from its start to its return.
    pub call: f64,
    /// Of a replayed call: from its start to its graph launch (0 otherwise).
    pub setup: f64,
    /// Of a replayed call: the graph launch (0 otherwise).
    pub launch: f64,
    /// Of a replayed call: its setup phase by phase, nanoseconds.
    pub phases: fusion::runtime::eval::ReplayPhases,
}

impl CallTimes {
    /// One call's times.
    pub fn add(&mut self, name: &'static str, time: CallTime) {
        let at = match self.0.iter().position(|(n, _)| *n == name) {
            Some(i) => i,
            None => {
                self.0.push((name, Vec::new()));
                self.0.len() - 1
            }
        };
        self.0[at].1.push(time);
    }

    /// No call was timed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Each call's median copies and call (and, where its calls replayed, the call's setup
    /// and launch) in one line.
    pub fn describe(&self, kind: &str) -> String {
        let median = |v: &[CallTime], f: fn(&CallTime) -> f64| {
            let mut v: Vec<f64> = v.iter().map(f).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
        };
        let calls: Vec<String> = (self.0.iter())
            .map(|(name, t)| {
                let replayed = match median(t, |t| t.launch) {
                    l if l > 0.0 => format!(
                        " (setup {:.1}: program {:.1} ledger {:.1} plan {:.1} begin {:.1} \
                         slot {:.1} join {:.1}; launch {l:.1})",
                        median(t, |t| t.setup),
                        median(t, |c| c.phases.program as f64 / 1e3),
                        median(t, |c| c.phases.ledger as f64 / 1e3),
                        median(t, |c| c.phases.plan as f64 / 1e3),
                        median(t, |c| c.phases.begin as f64 / 1e3),
                        median(t, |c| c.phases.slot as f64 / 1e3),
                        median(t, |c| c.phases.join as f64 / 1e3),
                    ),
                    _ => String::new(),
                };
                format!(
                    "{name} copies {:.1} call {:.1}{replayed} ({} calls)",
                    median(t, |t| t.copies),
                    median(t, |t| t.call),
                    t.len()
                )
            })
            .collect();
        format!(
            "  {kind} fusion calls' host time, median us: {}",
            calls.join(" | ")
        )
    }
}

/// A call's activation inputs and output, kept at one address across the steps of one
/// shape.
struct Slot {
    /// Each activation's buffer and the fusion input viewing it.
    inputs: Vec<(CTensor, fusion::Tensor)>,
    out: OutputBuffer,
}

/// A slot's key: the call's first activation's name, the layer, and every activation's
/// shape.
type SlotKey = (&'static str, usize, Vec<usize>);

/// The fusion calls of one rank's layer and how they ran.
pub struct FusionCalls {
    dtype: CDType,
    device: Device,
    slots: HashMap<SlotKey, Slot>,
    /// Every slot's output by its candle tensor (the one the calls hand back, the same
    /// tensor every step): a later call given it reads it in place instead of copying it
    /// into its own slot, since it sits at a fixed address too.
    outputs: HashMap<candle_core::TensorId, (SlotKey, fusion::Tensor)>,
    pub options: ExecOptions,
    /// Calls pass the activation itself, not a copy in their slot: while a step is being
    /// recorded into a graph of the caller's, whose addresses the capture fixes anyway
    /// (`graph.rs`), the copy would be one more node a step for each call.
    pub direct: bool,
    /// The layer whose calls come next (`--layers`): each layer's calls have slots of
    /// their own, since a layer reads the previous one's output in place.
    pub layer: usize,
    /// How the calls ran since the last [`FusionCalls::take`].
    replays: Replays,
    /// While set, each call's host time (`--sections`).
    pub times: Option<CallTimes>,
}

impl FusionCalls {
    /// Calls with activations and outputs in `dtype` on `device`.
    pub fn new(dtype: CDType, device: &Device) -> Self {
        FusionCalls {
            dtype,
            device: device.clone(),
            slots: HashMap::new(),
            outputs: HashMap::new(),
            options: ExecOptions::default(),
            direct: false,
            layer: 0,
            replays: Replays::default(),
            times: None,
        }
    }

    /// How the calls ran since the last take.
    pub fn take(&mut self) -> Replays {
        std::mem::take(&mut self.replays)
    }

    /// One fusion call: `acts` (this step's activations, each with its name in errors)
    /// and `weights` in, in the fusion's order (activations first), an output of
    /// `out_shape` back as a candle tensor, without copies between the libraries. On a GPU
    /// the activations and output live in the slot of this call, layer and shape (the first
    /// activation's name, [`FusionCalls::layer`] and every activation's shape), and the
    /// returned tensor shares the
    /// slot's output: read it before the next call of the same slot (candle's stream
    /// orders that).
    pub fn call(
        &mut self,
        call: &dyn CallTarget,
        exec: &FusionExecutor,
        acts: &[(&'static str, &CTensor)],
        weights: &[&fusion::Tensor],
        out_shape: &[usize],
    ) -> fusion_candle::Result<CTensor> {
        let rank = call.target().rank().clone();
        let name = acts.first().map_or("activation", |a| a.0);
        if self.device.is_cpu() {
            let start = Instant::now();
            let given = acts
                .iter()
                .map(|(n, a)| fusion_candle::input(&rank, n, a))
                .collect::<fusion_candle::Result<Vec<_>>>()?;
            let out = OutputBuffer::new(&rank, name, self.dtype, out_shape, &self.device)?;
            let mut inputs: Vec<&fusion::Tensor> = given.iter().collect();
            inputs.extend(weights);
            let copied = Instant::now();
            let report = exec.run_with(call, &inputs, Some(&[&out.tensor()]), &self.options)?;
            self.note_times(name, start, copied, &report.stats);
            self.replays.count(&report.replay);
            drop(report);
            return out.into_candle();
        }
        let dims: Vec<usize> = acts.iter().flat_map(|(_, a)| a.dims().to_vec()).collect();
        let key = (name, self.layer, dims);
        if !self.slots.contains_key(&key) {
            let mut inputs = Vec::new();
            for (n, a) in acts {
                let buffer = CTensor::zeros(a.dims(), self.dtype, &self.device)?;
                let view = fusion_candle::input(&rank, n, &buffer)?;
                inputs.push((buffer, view));
            }
            let out = OutputBuffer::new(&rank, name, self.dtype, out_shape, &self.device)?;
            (self.outputs).insert(out.shared()?.id(), (key.clone(), out.tensor()));
            self.slots.insert(key.clone(), Slot { inputs, out });
        }
        let slot = &self.slots[&key];
        let start = Instant::now();
        let direct = match self.direct {
            true => acts
                .iter()
                .map(|(n, a)| fusion_candle::input(&rank, n, &a.contiguous()?))
                .collect::<fusion_candle::Result<Vec<_>>>()?,
            false => Vec::new(),
        };
        let mut inputs: Vec<&fusion::Tensor> = Vec::new();
        if self.direct {
            inputs.extend(direct.iter());
        } else {
            for ((buffer, view), (_, a)) in slot.inputs.iter().zip(acts) {
                // Another call's output is read where it is (its slot's address is fixed
                // too); never this call's own, which the call writes.
                match self.outputs.get(&a.id()) {
                    Some((from, out)) if *from != key => inputs.push(out),
                    _ => {
                        buffer.slice_set(&a.contiguous()?, 0, 0)?;
                        inputs.push(view);
                    }
                }
            }
        }
        inputs.extend(weights);
        let copied = Instant::now();
        let report = exec.run_with(call, &inputs, Some(&[&slot.out.tensor()]), &self.options)?;
        let out = slot.out.shared();
        self.note_times(name, start, copied, &report.stats);
        self.replays.count(&report.replay);
        out
    }

    /// Notes a call's host time (while timing): copies from `start` to `copied`, the call
    /// from `copied` to now, and the runtime's split of a replayed call (`stats`).
    fn note_times(
        &mut self,
        name: &'static str,
        start: Instant,
        copied: Instant,
        stats: &fusion::runtime::eval::ExecStats,
    ) {
        if let Some(t) = self.times.as_mut() {
            let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
            t.add(
                name,
                CallTime {
                    copies: us(copied - start),
                    call: us(copied.elapsed()),
                    setup: stats.replay_setup.nanos as f64 / 1e3,
                    launch: stats.graph_launch.nanos as f64 / 1e3,
                    phases: stats.replay_phases,
                },
            );
        }
    }
}
