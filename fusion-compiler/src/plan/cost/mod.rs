//! A cost model of a lowered program: a first estimate of its time from the GEMMs it
//! runs, the bytes it moves and the loop iterations it drives, against the rates of a
//! machine ([`MachineProfile`]). It orders the candidates of the plan space and picks
//! one where nothing is timed; it is not a simulation.
//!
//! Per node, at the call's extents: a GEMM takes `max(flops / gemm rate, bytes it reads
//! and writes / memory rate) + launch`; an NCCL or peer-memory collective `latency + bytes
//! on the wire / collective rate`. Transfers are counted at the receiver
//! (`transfers`): a group's receives from several peers run at once where they have a
//! copy stream each (or are one NCCL group), else one after another, and a pipeline's
//! single receives land in program order (the runtime makes each wait for the previous
//! one), so they add up; copy-engine collectives are such groups. Top-level nodes add up.
//! A stream loop is estimated iteration by iteration (its index bound, so that the
//! iteration that keeps its own chunk receives nothing) and its iterations flow through
//! two stages, compute and communication, in the order its body uses them (`pipeline`).
//! A gathered GEMM (launched before its loop, joined after it) runs beside the loop's
//! transfers: its join adds what is left of the GEMM after them, at least one block's
//! share (the last block's rows arrive last). A GEMM with the ReduceScatter in its
//! epilogue takes the longer of the two plus a share of the shorter.

mod pipeline;
mod transfers;

use crate::hir::{HostProgram, Node, P2PDirection, Transport};
use crate::ir::{IterKind, Op, ParallelType, ScalarId, TensorId};

/// The share of the shorter of its GEMM and its ReduceScatter that a GEMM with the
/// ReduceScatter in its epilogue ([`Node::GemmReduceScatter`]) adds to the longer: on 4
/// H100s it took 1.15-1.43x of the GEMM alone at D = 4, where the tiles alone take as long
/// as the GEMM, and 1.04-1.09x at D = 2 (docs/DECISIONS.md, "The storer warps take the
/// owners in turn").
pub const SCATTERED_GEMM_OVERLAP_LOSS: f64 = 0.25;

/// The rates the model charges, per device.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineProfile {
    /// Dense bf16/f16 GEMM rate, FLOP/s.
    pub gemm_flops: f64,
    /// Device memory bandwidth, bytes/s.
    pub memory_bytes: f64,
    /// One peer-to-peer copy's bandwidth when it is the only one into this device, bytes/s.
    pub link_bytes: f64,
    /// What copies from several peers at once into this device get together, bytes/s,
    /// where known (`None`: each runs at `link_bytes`).
    pub inbound_bytes: Option<f64>,
    /// A collective's bus bandwidth (bytes on the wire per second).
    pub collective_bytes: f64,
    /// A communication's fixed latency, seconds.
    pub latency: f64,
    /// A GEMM launch's fixed cost on the device, seconds.
    pub launch: f64,
    /// Host time per stream-loop iteration of a replayed call, seconds.
    pub host_per_iteration: f64,
    /// Where the numbers come from (printed with the plan).
    pub source: String,
}

impl MachineProfile {
    /// Hopper GPUs with NVLink (H100/H200), from the measurements of `docs/DECISIONS.md`
    /// and `docs/PERFORMANCE.md`: ~700 TFLOP/s bf16 GEMMs of the benchmark shapes; one
    /// copy-engine copy alone at ~330 GB/s (a D = 4 AllGather's 64 MiB chunks landed in
    /// order every ~0.19 ms on H200, and AG+GEMM 16384,8192,2048 ran 0.1 ms over its GEMMs
    /// on H100), three at once sharing ~290 GB/s (they landed together at 0.69 ms); NCCL
    /// collectives at ~300 GB/s bus bandwidth; 8 us per communication and 3 us of host
    /// time per replayed iteration.
    pub fn hopper() -> Self {
        MachineProfile {
            gemm_flops: 700e12,
            memory_bytes: 3.3e12,
            link_bytes: 330e9,
            inbound_bytes: Some(290e9),
            collective_bytes: 300e9,
            latency: 8e-6,
            launch: 4e-6,
            host_per_iteration: 3e-6,
            source: "Hopper defaults".into(),
        }
    }

    /// This profile with its GEMM rate replaced by a measured one.
    pub fn with_gemm_flops(mut self, flops: f64, source: &str) -> Self {
        if flops.is_finite() && flops > 0.0 {
            self.gemm_flops = flops;
            self.source = source.into();
        }
        self
    }
}

/// What the model estimates for one program.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    /// The whole call, seconds.
    pub seconds: f64,
    /// Its GEMMs alone, seconds.
    pub gemm_seconds: f64,
    /// Its communication alone, seconds.
    pub comm_seconds: f64,
    /// Stream-loop iterations it drives.
    pub iterations: usize,
}

impl Estimate {
    /// Communication alone, taking `s` seconds.
    fn comm(s: f64) -> Self {
        Estimate {
            seconds: s,
            comm_seconds: s,
            ..Estimate::default()
        }
    }
}

impl std::ops::AddAssign for Estimate {
    fn add_assign(&mut self, part: Estimate) {
        self.seconds += part.seconds;
        self.gemm_seconds += part.gemm_seconds;
        self.comm_seconds += part.comm_seconds;
        self.iterations += part.iterations;
    }
}

/// Estimates `program` with `leaf` giving the values of its leaf scalars (dimension
/// symbols, the rank, the stream count); an extent it cannot evaluate counts as 1.
pub fn estimate(
    program: &HostProgram,
    leaf: &dyn Fn(ScalarId) -> Option<i64>,
    profile: &MachineProfile,
) -> Estimate {
    let model = Model {
        program,
        leaf,
        profile,
        indices: Default::default(),
    };
    model.nodes(&program.body)
}

struct Model<'a> {
    program: &'a HostProgram,
    leaf: &'a dyn Fn(ScalarId) -> Option<i64>,
    profile: &'a MachineProfile,
    /// Loop indices bound while their loop's body is estimated (per iteration: extents of
    /// per-iteration slices and which branch runs depend on the index).
    indices: std::cell::RefCell<Vec<(ScalarId, i64)>>,
}

impl Model<'_> {
    /// `nodes` one after another; the receives of a coalesced group together.
    fn nodes(&self, nodes: &[Node]) -> Estimate {
        let mut total = Estimate::default();
        let mut group: Option<Vec<(f64, Transport)>> = None;
        // Gathered GEMMs launched and not yet joined: (id, seconds, time at the launch).
        let mut launched = Vec::new();
        for node in nodes {
            match node {
                Node::GatheredGemmLaunch(g) => {
                    // A gated product runs two GEMMs' work.
                    let gates = 1.0 + f64::from(u8::from(g.up.is_some()));
                    let s = gates * self.gemm(&[g.gathered, g.b], g.output, false);
                    launched.push((g.id, s, self.blocks(g.output), total.seconds));
                }
                Node::GatheredGemmJoin { id } => {
                    if let Some(i) = launched.iter().position(|l| l.0 == *id) {
                        let (_, s, blocks, at) = launched.remove(i);
                        let left = (s - (total.seconds - at)).max(s / blocks);
                        total += Estimate {
                            seconds: left,
                            gemm_seconds: s,
                            ..Estimate::default()
                        };
                    }
                }
                Node::StartCoalescing => group = Some(Vec::new()),
                Node::EndCoalescing { .. } => {
                    if let Some(g) = group.take() {
                        total += Estimate::comm(self.receive_group(&g));
                    }
                }
                Node::P2P(t) if t.direction == P2PDirection::Recv => {
                    let r = (self.bytes(t.buffer), t.transport);
                    match group.as_mut() {
                        Some(g) => g.push(r),
                        None => total += Estimate::comm(self.receive_group(&[r])),
                    }
                }
                _ => total += self.node(node),
            }
        }
        if let Some(g) = group {
            total += Estimate::comm(self.receive_group(&g));
        }
        total
    }

    fn value(&self, s: ScalarId) -> Option<i64> {
        let indices = self.indices.borrow();
        self.program.ir.evaluate(s, &|x| {
            (indices.iter().find(|(i, _)| *i == x).map(|(_, v)| *v)).or_else(|| (self.leaf)(x))
        })
    }

    /// Elements one rank stores of `t` (DIDx and broadcast axes count 1), and the product
    /// of its reduction axes' extents.
    fn elements(&self, t: TensorId) -> (f64, f64) {
        let f = &self.program.ir;
        let (mut stored, mut reduced) = (1.0, 1.0);
        for &a in &f.tensor(t).axes {
            let d = f.iter_domain(a);
            if d.parallel == ParallelType::DIDx || d.kind == IterKind::Broadcast {
                continue;
            }
            let v = self.value(d.extent).unwrap_or(1).max(1) as f64;
            if d.kind == IterKind::Reduction {
                reduced *= v;
            } else {
                stored *= v;
            }
        }
        (stored, reduced)
    }

    /// The extent of `t`'s axis 0 (a gathered GEMM's blocks), at least 1.
    fn blocks(&self, t: TensorId) -> f64 {
        let f = &self.program.ir;
        self.value(f.axis(t, 0).extent).unwrap_or(1).max(1) as f64
    }

    fn bytes(&self, t: TensorId) -> f64 {
        let size = self.program.ir.tensor(t).dtype.size_bytes() as f64;
        self.elements(t).0 * size
    }

    fn gemm(&self, inputs: &[TensorId], output: TensorId, summed: bool) -> f64 {
        let (out, reduced) = self.elements(output);
        let f = &self.program.ir;
        let last_of_a = || {
            inputs.first().map_or(1.0, |&a| {
                (f.visible_axes(a).last())
                    .and_then(|&pos| self.value(f.axis(a, pos).extent))
                    .unwrap_or(1)
                    .max(1) as f64
            })
        };
        // K: the output's reduction axis, or (a GEMM whose epilogue output has none) the
        // left operand's last axis; a GEMM summed over a batch axis (the output's reduction
        // axis then) runs K over every index of it.
        let k = match summed {
            true => reduced.max(1.0) * last_of_a(),
            false if reduced <= 1.0 => last_of_a(),
            false => reduced,
        };
        let flops = 2.0 * out * k;
        let moved: f64 = inputs.iter().map(|&t| self.bytes(t)).sum::<f64>() + self.bytes(output);
        (flops / self.profile.gemm_flops).max(moved / self.profile.memory_bytes)
            + self.profile.launch
    }

    fn node(&self, node: &Node) -> Estimate {
        let p = self.profile;
        match node {
            Node::Compute(e) if matches!(e.op, Op::Matmul | Op::Linear | Op::Gemm { .. }) => {
                let summed = matches!(&e.op, Op::Gemm { epilogue, .. } if epilogue.sums_batch);
                let s = self.gemm(&e.inputs, e.output, summed);
                Estimate {
                    seconds: s,
                    gemm_seconds: s,
                    ..Estimate::default()
                }
            }
            // Views: the runtime binds them to their input's memory (a permute left in a
            // program is read by GEMMs; its copies are `set`s).
            Node::Compute(e)
                if matches!(
                    e.op,
                    Op::Permute { .. }
                        | Op::Slice { .. }
                        | Op::Select { .. }
                        | Op::Split { .. }
                        | Op::Broadcast { .. }
                ) =>
            {
                Estimate::default()
            }
            Node::Compute(e) => {
                // Pointwise work and sums: bound by memory.
                let moved: f64 =
                    e.inputs.iter().map(|&t| self.bytes(t)).sum::<f64>() + self.bytes(e.output);
                Estimate {
                    seconds: moved / p.memory_bytes,
                    ..Estimate::default()
                }
            }
            Node::Communication(c) => Estimate::comm(self.collective(c)),
            // The model keeps the exchange after the GEMM (as measured at 32 rows, where it
            // adds most of an Allreduce; less below).
            Node::GemmAllreduce(g) => {
                let (gemm, comm) = (
                    self.gemm(&g.gemm.inputs, g.gemm.output, false),
                    self.collective(&g.comm),
                );
                // The residual's add reads its addend in the last store.
                let gemm = gemm + g.addend().map_or(0.0, |x| self.bytes(x) / p.memory_bytes);
                Estimate {
                    seconds: gemm + comm,
                    gemm_seconds: gemm,
                    comm_seconds: comm,
                    ..Estimate::default()
                }
            }
            // The tiles travel while the GEMM runs: the longer of the two, plus a share of
            // the shorter ([`SCATTERED_GEMM_OVERLAP_LOSS`]).
            Node::GemmReduceScatter(g) => {
                let (gemm, comm) = (
                    self.gemm(&g.gemm.inputs, g.gemm.output, false),
                    self.collective(&g.comm),
                );
                Estimate {
                    seconds: gemm.max(comm) + SCATTERED_GEMM_OVERLAP_LOSS * gemm.min(comm),
                    gemm_seconds: gemm,
                    comm_seconds: comm,
                    ..Estimate::default()
                }
            }
            Node::ForLoop(l) => self.stream_loop(l),
            Node::IfThenElse {
                cond,
                then_body,
                else_body,
            } => match self.value(*cond) {
                Some(v) => self.nodes(if v != 0 { then_body } else { else_body }),
                // The larger branch: the model does not know which one runs.
                None => {
                    let (a, b) = (self.nodes(then_body), self.nodes(else_body));
                    if a.seconds >= b.seconds {
                        a
                    } else {
                        b
                    }
                }
            },
            _ => Estimate::default(),
        }
    }
}

#[cfg(test)]
mod tests;
