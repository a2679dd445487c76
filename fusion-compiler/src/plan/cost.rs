//! A cost model of a lowered program: a first estimate of its time from the GEMMs it
//! runs, the bytes it moves and the loop iterations it drives, against the rates of a
//! machine ([`MachineProfile`]). It orders the candidates of the plan space and picks
//! one where nothing is timed; it is not a simulation.
//!
//! Per node, at the call's extents: a GEMM takes `max(flops / gemm rate, bytes it reads
//! and writes / memory rate) + launch`; a collective takes `latency + bytes on the wire /
//! collective rate`, a P2P transfer `latency + bytes / link rate` (counted at the
//! receiver). Top-level nodes add up. A stream loop of `n` iterations whose body both
//! computes and communicates overlaps them: `max(n g, n c) + min(g, c) + n h` for per
//! iteration GEMM time `g`, transfer time `c` and host time `h`; a loop that only does one
//! of them adds up.

use crate::hir::{CommunicationKind, HostProgram, Node, P2PDirection};
use crate::ir::{IterKind, Op, ParallelType, ScalarId, TensorId};

/// The rates the model charges, per device.
#[derive(Clone, Debug, PartialEq)]
pub struct MachineProfile {
    /// Dense bf16/f16 GEMM rate, FLOP/s.
    pub gemm_flops: f64,
    /// Device memory bandwidth, bytes/s.
    pub memory_bytes: f64,
    /// One peer-to-peer copy's bandwidth, bytes/s.
    pub link_bytes: f64,
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
    /// and `docs/PERFORMANCE.md`: ~700 TFLOP/s bf16 GEMMs of the benchmark shapes, one
    /// copy-engine stream per peer at ~130 GB/s, NCCL collectives at ~300 GB/s bus
    /// bandwidth, 8 us per communication and 3 us of host time per replayed iteration.
    pub fn hopper() -> Self {
        MachineProfile {
            gemm_flops: 700e12,
            memory_bytes: 3.3e12,
            link_bytes: 130e9,
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
    /// Loop indices bound while their loop's body is estimated (at its first iteration,
    /// the representative one: extents of per-iteration slices depend on the index).
    indices: std::cell::RefCell<Vec<(ScalarId, i64)>>,
}

impl Model<'_> {
    /// `nodes` one after another.
    fn nodes(&self, nodes: &[Node]) -> Estimate {
        let mut total = Estimate::default();
        for node in nodes {
            total += self.node(node);
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

    fn bytes(&self, t: TensorId) -> f64 {
        let size = self.program.ir.tensor(t).dtype.size_bytes() as f64;
        self.elements(t).0 * size
    }

    fn gemm(&self, inputs: &[TensorId], output: TensorId) -> f64 {
        let (out, reduced) = self.elements(output);
        // K: the output's reduction axis, or (a GEMM whose epilogue output has none) the
        // left operand's last axis.
        let k = match inputs.first() {
            Some(&a) if reduced <= 1.0 => {
                let f = &self.program.ir;
                (f.visible_axes(a).last())
                    .and_then(|&pos| self.value(f.axis(a, pos).extent))
                    .unwrap_or(1)
                    .max(1) as f64
            }
            _ => reduced,
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
                let s = self.gemm(&e.inputs, e.output);
                Estimate {
                    seconds: s,
                    gemm_seconds: s,
                    ..Estimate::default()
                }
            }
            // A permute left in a program is a view read by GEMMs (its copies are `set`s).
            Node::Compute(e) if matches!(e.op, Op::Permute { .. }) => Estimate::default(),
            Node::Compute(e) => {
                // Pointwise work and sums: bound by memory.
                let moved: f64 =
                    e.inputs.iter().map(|&t| self.bytes(t)).sum::<f64>() + self.bytes(e.output);
                Estimate {
                    seconds: moved / p.memory_bytes,
                    ..Estimate::default()
                }
            }
            Node::Communication(c) => {
                let d = c.team.len().max(1) as f64;
                let bytes = self.bytes(c.input).max(self.bytes(c.output));
                let wire = match c.kind {
                    CommunicationKind::Allreduce => 2.0 * bytes * (d - 1.0) / d,
                    CommunicationKind::Allgather | CommunicationKind::ReduceScatter => {
                        bytes * (d - 1.0) / d
                    }
                    _ => bytes,
                };
                let s = p.latency + wire / p.collective_bytes;
                Estimate {
                    seconds: s,
                    comm_seconds: s,
                    ..Estimate::default()
                }
            }
            Node::P2P(t) if t.direction == P2PDirection::Recv => {
                let s = p.latency + self.bytes(t.buffer) / p.link_bytes;
                Estimate {
                    seconds: s,
                    comm_seconds: s,
                    ..Estimate::default()
                }
            }
            Node::ForLoop(l) => {
                let (start, stop) = (self.value(l.start), self.value(l.stop));
                let n = match (start, stop) {
                    (Some(a), Some(b)) if b > a => (b - a) as usize,
                    _ => 1,
                };
                self.indices
                    .borrow_mut()
                    .push((l.index, start.unwrap_or(0)));
                let body = self.nodes(&l.body);
                self.indices.borrow_mut().pop();
                let (g, c) = (body.gemm_seconds, body.comm_seconds);
                let nf = n as f64;
                let other = body.seconds - g - c;
                let overlapped = if g > 0.0 && c > 0.0 {
                    (nf * g).max(nf * c) + g.min(c)
                } else {
                    nf * (g + c)
                };
                Estimate {
                    seconds: overlapped + nf * (other + p.host_per_iteration),
                    gemm_seconds: nf * g,
                    comm_seconds: nf * c,
                    iterations: n + n * body.iterations,
                }
            }
            Node::IfThenElse {
                then_body,
                else_body,
                ..
            } => {
                // The larger branch: the model does not know which one runs.
                let (a, b) = (self.nodes(then_body), self.nodes(else_body));
                if a.seconds >= b.seconds {
                    a
                } else {
                    b
                }
            }
            _ => Estimate::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builder::{Axis, FusionBuilder};
    use crate::ir::Fusion;
    use crate::lower::{lower_for_shapes, LowerOptions, Pipelining};
    use crate::DType;

    /// `[d @ Stream, m, n] = matmul(a [d @ DIDx, m, k], b [k, n])` at m = 4096 per device,
    /// k = 8192, n = `n` on 4 devices: its estimates pipelined and not.
    fn ag_gemm(n: i64) -> (Estimate, Estimate) {
        let mut b = FusionBuilder::new();
        let (d, m, k, nn) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
        let a = b
            .input(
                "a",
                DType::BF16,
                &[Axis::didx(d), Axis::serial(m), Axis::serial(k)],
            )
            .unwrap();
        let w = b
            .input("b", DType::BF16, &[Axis::serial(k), Axis::serial(nn)])
            .unwrap();
        let c = b.matmul(a, w).unwrap();
        let c = b
            .declare(
                c,
                DType::BF16,
                &[Axis::stream(d), Axis::serial(m), Axis::serial(nn)],
            )
            .unwrap();
        b.output(c).unwrap();
        let f = b.build().unwrap();
        let values = [(d, 4), (m, 4096), (k, 8192), (nn, n)];
        pipelined_and_whole(&f, &values)
    }

    /// The estimates of `f` on 4 devices at the symbol values `values`, pipelined and not
    /// (4 pool streams, rank 0).
    fn pipelined_and_whole(f: &Fusion, values: &[(ScalarId, i64)]) -> (Estimate, Estimate) {
        let extent = |s: ScalarId| values.iter().find(|(x, _)| *x == s).map(|(_, v)| *v);
        let profile = MachineProfile::hopper();
        let est = |pipelining| {
            let o = LowerOptions::default().with_pipelining(pipelining);
            let p = lower_for_shapes(f, 4, &o, &extent).unwrap().program;
            let leaf = |s: ScalarId| {
                extent(s).or(match p.ir.scalar_node(s) {
                    crate::ir::Scalar::Named(crate::ir::NamedScalar::NumberOfStreams) => Some(4),
                    crate::ir::Scalar::Named(crate::ir::NamedScalar::Rank) => Some(0),
                    _ => None,
                })
            };
            estimate(&p, &leaf, &profile)
        };
        (est(Pipelining::Always), est(Pipelining::Never))
    }

    #[test]
    fn a_big_pipeline_hides_its_transfers() {
        let (piped, whole) = ag_gemm(8192);
        // 2 * 16384 * 8192 * 8192 FLOP at 700 TFLOP/s: 3.1 ms of GEMMs in both.
        assert!((piped.gemm_seconds - whole.gemm_seconds).abs() / whole.gemm_seconds < 0.05);
        assert!(piped.comm_seconds > 0.0 && whole.comm_seconds > 0.0);
        assert!(piped.iterations >= 4, "{piped:?}");
        assert_eq!(whole.iterations, 0);
        assert!(piped.seconds < whole.seconds, "{piped:?} vs {whole:?}");
        assert!(piped.seconds >= piped.gemm_seconds);
    }

    #[test]
    fn gemm_time_grows_with_the_problem() {
        let (small, _) = ag_gemm(1024);
        let (big, _) = ag_gemm(8192);
        assert!(big.gemm_seconds > 4.0 * small.gemm_seconds);
    }

    /// The sequence-parallel MLP block (`ReduceScatter(gelu(AllGather(x) W1) W2)`) on 4
    /// devices, m = 4096 rows per device, h = 8192, f = 7168 per device: its pipelined loop
    /// runs the same GEMMs as the unpipelined program, in pieces whose rows depend on the
    /// loop index (the model binds it).
    #[test]
    fn a_gather_scatter_loop_counts_all_its_gemms() {
        use crate::ir::UnaryOp;
        let mut b = FusionBuilder::new();
        let (d, m, h, f) = (b.symbol("d"), b.symbol("m"), b.symbol("h"), b.symbol("f"));
        let dt = DType::BF16;
        let x = b
            .input("x", dt, &[Axis::didx(d), Axis::serial(m), Axis::serial(h)])
            .unwrap();
        let w1 = b
            .input("w1", dt, &[Axis::didx(d), Axis::serial(h), Axis::serial(f)])
            .unwrap();
        let w2 = b
            .input("w2", dt, &[Axis::didx(d), Axis::serial(f), Axis::serial(h)])
            .unwrap();
        let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
        let up = b.matmul(rows, w1).unwrap();
        let act = b.unary(UnaryOp::GeluTanh, up).unwrap();
        let ta = [
            Axis::stream(d),
            Axis::didx(d),
            Axis::serial(m),
            Axis::serial(f),
        ];
        let act = b.declare(act, dt, &ta).unwrap();
        let p = b.matmul(act, w2).unwrap();
        let tp = [
            Axis::stream(d),
            Axis::didx(d),
            Axis::serial(m),
            Axis::serial(h),
        ];
        let p = b.declare(p, dt, &tp).unwrap();
        let y = b.sum(p, &[1]).unwrap();
        let ty = [Axis::didx(d), Axis::serial(m), Axis::serial(h)];
        let y = b.declare(y, dt, &ty).unwrap();
        b.output(y).unwrap();
        let fusion = b.build().unwrap();
        let values = [(d, 4), (m, 4096), (h, 8192), (f, 7168)];
        let (piped, whole) = pipelined_and_whole(&fusion, &values);
        // 2 GEMMs of 2 * 16384 * 8192 * 7168 FLOP: about 5.5 ms at 700 TFLOP/s.
        assert!(whole.gemm_seconds > 4e-3, "{whole:?}");
        let ratio = piped.gemm_seconds / whole.gemm_seconds;
        assert!((0.9..1.3).contains(&ratio), "{piped:?} vs {whole:?}");
        assert!(piped.iterations >= 8, "{piped:?}");
    }

    #[test]
    fn a_measured_rate_replaces_the_default() {
        let p = MachineProfile::hopper().with_gemm_flops(500e12, "probed");
        assert_eq!(p.gemm_flops, 500e12);
        assert_eq!(p.source, "probed");
        let same = MachineProfile::hopper().with_gemm_flops(f64::NAN, "bad");
        assert_eq!(same, MachineProfile::hopper());
    }
}
