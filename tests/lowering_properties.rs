//! Property tests of lowering (the `proptest` crate): random shapes, device counts 1-8,
//! stream counts 1-4 and lowering options for every supported pattern, built through the
//! `FusionBuilder`, run on simulated devices with the stream-order race checker on, and
//! checked against the f64 reference of `tests/common/reference.rs`:
//!
//! - the pipelines: AllGather + GEMM (collective and P2P, also with a linear and bias),
//!   GEMM + AllReduce, GEMM + ReduceScatter (collective, and P2P direct and ring in row
//!   ranges), and the sequence-parallel MLP block (both pipelines in one loop);
//! - the collectives in stream loops and on their own, and the reshardings (scatter,
//!   gather, broadcast and reduce from random roots, send/receive between random meshes);
//! - chains of elementwise ops, sharded or not, with random Stream axes;
//! - random shardings of a copy or a sum, some of which lowering cannot do: those must
//!   fail with one of the documented errors (`Parallelization`, `Resharding`,
//!   `StreamLowering` and the builder's shape errors), never with a panic.
//!
//! About 1,050 cases per run (random inputs; `PROPTEST_RNG_SEED=n` repeats a run). A
//! failure prints the smallest failing case proptest found.

mod common;

use std::cell::Cell;
use std::fmt::Debug;

use common::cases::{self, axes};
use common::*;
use fusion::compiler::builder::FusionBuilder;
use fusion::compiler::hir::Transport;
use fusion::compiler::ir::{BinaryOp, DeviceMesh, Fusion, ParallelType, TensorId, UnaryOp};
use fusion::compiler::lower::{LowerOptions, P2pSchedule, ReduceScatterPipeline};
use fusion::{DType, Error, ExecOptions, Tensor};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

/// What one generated case did.
enum Verdict {
    /// It lowered, ran race-free and matched the reference.
    Ran,
    /// The builder or the lowering rejected it with a documented error.
    Rejected,
}

/// Runs `cases` cases of `strategy` through `check`; at least `min_ran` of every 100
/// must run (not be rejected), so the property tests the runtime and not only errors.
/// The cases are f32: under another `FUSION_TEST_DTYPE` (the conformance suite's
/// reruns) this does nothing.
fn property<T: Debug + Clone>(
    name: &str,
    cases: u32,
    min_ran: u32,
    strategy: impl Strategy<Value = T>,
    check: impl Fn(T) -> Result<Verdict, TestCaseError>,
) {
    if test_dtype() != DType::F32 {
        println!("{name}: skipped, the cases are f32");
        return;
    }
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let (ran, rejected) = (Cell::new(0u32), Cell::new(0u32));
    let result = runner.run(&strategy, |case| {
        match check(case)? {
            Verdict::Ran => ran.set(ran.get() + 1),
            Verdict::Rejected => rejected.set(rejected.get() + 1),
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    println!(
        "{name}: {} cases ran and matched, {} rejected with a documented error",
        ran.get(),
        rejected.get()
    );
    assert!(
        ran.get() * 100 >= min_ran * (ran.get() + rejected.get()),
        "{name}: too few cases ran"
    );
}

/// The errors lowering (and the builder) document for fusions they cannot handle.
fn documented(e: &fusion::compiler::Error) -> bool {
    use fusion::compiler::Error as E;
    matches!(
        e,
        E::Parallelization { .. }
            | E::Resharding { .. }
            | E::StreamLowering { .. }
            | E::Rank { .. }
            | E::AxisOutOfRange { .. }
            | E::ExtentMismatch { .. }
            | E::DTypeMismatch { .. }
            | E::Argument { .. }
            | E::Declared { .. }
    )
}

/// One generated case, ready to run: the fusion, its full inputs and how each reaches
/// the ranks, how its output is assembled, and the f64 reference.
struct Plan {
    fusion: Fusion,
    inputs: Vec<(Tensor, Give)>,
    take: Take,
    expected: RefArray,
}

/// Runs `plan` on `d` devices with `streams` worker streams and `lower` (race checker
/// on) and compares its output with the reference; `case` names it in failures.
fn run_plan(
    plan: Plan,
    d: usize,
    streams: usize,
    lower: &LowerOptions,
    case: &dyn Debug,
) -> Result<Verdict, TestCaseError> {
    let opts = ExecOptions {
        number_of_streams: streams,
        lower: lower.clone(),
        ..ExecOptions::default()
    };
    match try_run(&plan.fusion, d, &plan.inputs, &[plan.take], &opts) {
        Ok(r) => {
            let e = scaled_error(&plan.expected, &r.outputs[0]);
            prop_assert!(
                e < tolerance_for(DType::F32),
                "{case:?}: relative error {e:.3e}\n{}",
                r.program
            );
            Ok(Verdict::Ran)
        }
        Err(Error::Core(e)) if documented(&e) => Ok(Verdict::Rejected),
        Err(e) => Err(TestCaseError::fail(format!("{case:?}: {e}"))),
    }
}

/// The Frobenius error of `got` relative to `expected`'s norm, or to the norm of an
/// array of ones where that is larger: inputs are standard normal, so a chain that
/// cancels to (nearly) zero is judged on the scale of its inputs, not of its rounding.
fn scaled_error(expected: &RefArray, got: &Tensor) -> f64 {
    assert_eq!(got.shape(), expected.shape.as_slice(), "shape mismatch");
    let v = got.to_f32_vec().expect("a host tensor");
    if v.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0.0, v.len() as f64);
    let mut norm = 0.0;
    for (g, r) in v.iter().zip(&expected.data) {
        num += (*g as f64 - r).powi(2);
        norm += r * r;
    }
    den = f64::max(den, norm);
    (num / den.max(1e-300)).sqrt()
}

/// A rejected build must be a documented error too.
fn built<T>(r: Result<T, fusion::compiler::Error>) -> Result<Option<T>, TestCaseError> {
    match r {
        Ok(f) => Ok(Some(f)),
        Err(e) if documented(&e) => Ok(None),
        Err(e) => Err(TestCaseError::fail(format!("builder: {e}"))),
    }
}

fn lower_options() -> impl Strategy<Value = LowerOptions> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        0..3usize,
        0..4usize,
        1..4usize,
        any::<bool>(),
    )
        .prop_map(
            |(buffers, first, p2p_nccl, coll_ce, mesh_order, pipeline, chunks, compute, peer)| {
                LowerOptions {
                    transports: fusion::TransportOptions {
                        p2p: if p2p_nccl {
                            Transport::Nccl
                        } else {
                            Transport::CopyEngine
                        },
                        collectives: if coll_ce {
                            Transport::CopyEngine
                        } else {
                            Transport::Nccl
                        },
                        peer_memory: if peer {
                            fusion::PeerMemoryCollectives::UpTo(usize::MAX)
                        } else {
                            fusion::PeerMemoryCollectives::Never
                        },
                        ..Default::default()
                    },
                    streams: fusion::StreamOptions {
                        buffers,
                        compute_first: first,
                        ring_compute_streams: compute,
                    },
                    pipelines: fusion::PipelineOptions {
                        p2p_schedule: if mesh_order {
                            P2pSchedule::MeshOrder
                        } else {
                            P2pSchedule::Ring
                        },
                        reduce_scatter: [
                            ReduceScatterPipeline::Auto,
                            ReduceScatterPipeline::Direct,
                            ReduceScatterPipeline::Ring,
                        ][pipeline],
                        reduce_scatter_subchunks: (chunks > 0).then_some(chunks),
                        ..Default::default()
                    },
                    ..LowerOptions::default()
                }
            },
        )
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, seed)
}

fn r(t: &Tensor) -> RefArray {
    RefArray::from_tensor(t)
}

// ---------------------------------------------------------------- pipelines

#[derive(Clone, Copy, Debug)]
enum Pipeline {
    AgGemm,
    AgGemmP2p,
    AgLinear,
    GemmAr,
    GemmRsCollective,
    GemmRsP2p,
    /// The sequence-parallel MLP block: both pipelines in one loop.
    TpMlp,
}

#[derive(Clone, Debug)]
struct PipelineCase {
    pipeline: Pipeline,
    d: usize,
    s: usize,
    m: usize,
    k: usize,
    n: usize,
    streams: usize,
    lower: LowerOptions,
    seed: u64,
}

fn pipeline_cases() -> impl Strategy<Value = PipelineCase> {
    use Pipeline::*;
    (
        prop::sample::select(vec![
            AgGemm,
            AgGemmP2p,
            AgLinear,
            GemmAr,
            GemmRsCollective,
            GemmRsP2p,
            TpMlp,
        ]),
        1..=8usize,
        (1..=4usize, 1..=6usize, 1..=5usize, 1..=4usize),
        1..=4usize,
        lower_options(),
        any::<u64>(),
    )
        .prop_map(
            |(pipeline, d, (s, m, k, n), streams, lower, seed)| PipelineCase {
                pipeline,
                d,
                s,
                m,
                k,
                n,
                streams,
                lower,
                seed,
            },
        )
}

fn check_pipeline(c: PipelineCase) -> Result<Verdict, TestCaseError> {
    let PipelineCase {
        d,
        s,
        m,
        k,
        n,
        seed,
        ..
    } = c;
    let x = |shape: &[usize]| randn(shape, seed);
    let y = |shape: &[usize]| randn(shape, seed ^ 0x5555);
    let (fusion, inputs, take, expected) = match c.pipeline {
        Pipeline::AgGemm => {
            let (a, b) = (x(&[s, d, m, k]), y(&[k, n]));
            let e = r(&a).matmul(&r(&b));
            let i = vec![(a, Give::Shard(1)), (b, Give::Whole)];
            (cases::ag_matmul(), i, Take::Replicated, e)
        }
        Pipeline::AgGemmP2p => {
            let (a, b) = (x(&[d, m, k]), y(&[k, n]));
            let e = r(&a).matmul(&r(&b));
            let i = vec![(a, Give::Shard(0)), (b, Give::Whole)];
            (cases::ag_matmul_p2p(DType::F32), i, Take::Replicated, e)
        }
        Pipeline::AgLinear => {
            let (a, w, bias) = (x(&[s, d, m, k]), y(&[n, k]), randn(&[n], seed ^ 7));
            let e = r(&a)
                .matmul(&r(&w).transpose_last())
                .zip(&r(&bias), |p, q| p + q);
            let i = vec![(a, Give::Shard(1)), (w, Give::Whole), (bias, Give::Whole)];
            (cases::ag_linear_with_bias(), i, Take::Replicated, e)
        }
        Pipeline::GemmAr => {
            let (a, b) = (x(&[s, d, m, k]), y(&[d, k, n]));
            let e = r(&a).matmul(&r(&b)).sum(1);
            let i = vec![(a, Give::Shard(1)), (b, Give::Shard(0))];
            (cases::matmul_ar(), i, Take::Replicated, e)
        }
        Pipeline::GemmRsCollective => {
            let (a, b) = (x(&[d, s, d, m, k]), y(&[d, k, n]));
            let e = r(&a).matmul(&r(&b).unsqueeze(1).unsqueeze(1)).sum(0);
            let i = vec![(a, Give::Shard(0)), (b, Give::Shard(0))];
            (cases::matmul_rs_through_broadcast(), i, Take::Sharded(1), e)
        }
        Pipeline::GemmRsP2p => {
            let (a, b) = (x(&[d, d, m, k]), y(&[d, k, n]));
            let e = r(&a).matmul(&r(&b).unsqueeze(1)).sum(0);
            let i = vec![(a, Give::Shard(0)), (b, Give::Shard(0))];
            (cases::matmul_rs_p2p(), i, Take::Sharded(0), e)
        }
        Pipeline::TpMlp => {
            let (x, w1, w2) = (x(&[d, m, k]), y(&[d, k, n]), randn(&[d, n, k], seed ^ 9));
            let h = r(&x).unsqueeze(1).matmul(&r(&w1));
            let e = h.map(|v| v.max(0.0)).matmul(&r(&w2)).sum(1);
            let i = vec![
                (x, Give::Shard(0)),
                (w1, Give::Shard(0)),
                (w2, Give::Shard(0)),
            ];
            (
                cases::tp_mlp(DType::F32, UnaryOp::Relu),
                i,
                Take::Sharded(0),
                e,
            )
        }
    };
    let plan = Plan {
        fusion,
        inputs,
        take,
        expected,
    };
    let mut lower = c.lower.clone();
    if matches!(c.pipeline, Pipeline::TpMlp) {
        // The block's gather-scatter loop needs both (lowering says so otherwise).
        lower.streams.buffers = true;
        lower.streams.compute_first = true;
    }
    run_plan(plan, c.d, c.streams, &lower, &c)
}

#[test]
fn pipelines_match_the_reference() {
    property("pipelines", 400, 100, pipeline_cases(), check_pipeline);
}

// ---------------------------------------------------------------- collectives, reshardings

#[derive(Clone, Debug)]
enum Collective {
    StreamAllgather,
    StreamAllreduce,
    StreamReduceScatter,
    Allgather,
    Allreduce,
    ReduceScatter,
    Scatter,
    Gather,
    Broadcast { root: usize },
    Reduce,
    SendRecv { from: Vec<usize>, to: Vec<usize> },
}

#[derive(Clone, Debug)]
struct CollectiveCase {
    op: Collective,
    d: usize,
    s: usize,
    m: usize,
    streams: usize,
    lower: LowerOptions,
    seed: u64,
}

fn collective_cases() -> impl Strategy<Value = CollectiveCase> {
    use Collective::*;
    let simple = prop::sample::select(vec![
        StreamAllgather,
        StreamAllreduce,
        StreamReduceScatter,
        Allgather,
        Allreduce,
        ReduceScatter,
        Scatter,
        Gather,
        Reduce,
    ]);
    let world = 1..=8usize;
    let op_and_d = prop_oneof![
        6 => (simple, world).prop_map(|(op, d)| (op, d)),
        1 => (1..=8usize).prop_flat_map(|d| (0..d).prop_map(move |root| (Broadcast { root }, d))),
        1 => (2..=8usize).prop_flat_map(|d| {
            (1..=d / 2, Just((0..d).collect::<Vec<_>>()).prop_shuffle()).prop_map(
                move |(h, perm)| {
                    let (from, to) = (perm[..h].to_vec(), perm[h..2 * h].to_vec());
                    (SendRecv { from, to }, d)
                },
            )
        }),
    ];
    (
        op_and_d,
        1..=4usize,
        1..=5usize,
        1..=4usize,
        lower_options(),
        any::<u64>(),
    )
        .prop_map(|((op, d), s, m, streams, lower, seed)| CollectiveCase {
            op,
            d,
            s,
            m,
            streams,
            lower,
            seed,
        })
}

fn check_collective(c: CollectiveCase) -> Result<Verdict, TestCaseError> {
    let CollectiveCase { d, s, m, seed, .. } = c;
    let x = |shape: &[usize]| randn(shape, seed);
    let (fusion, input, take, expected) = match &c.op {
        Collective::StreamAllgather => {
            let a = x(&[s, d, m]);
            let e = r(&a);
            (
                cases::stream_parallel_allgather(),
                (a, Give::Shard(1)),
                Take::Replicated,
                e,
            )
        }
        Collective::StreamAllreduce => {
            let a = x(&[s, d, m]);
            let e = r(&a).sum(1);
            (
                cases::stream_parallel_allreduce(),
                (a, Give::Shard(1)),
                Take::Replicated,
                e,
            )
        }
        Collective::StreamReduceScatter => {
            let a = x(&[s, d, d, m]);
            let e = r(&a).sum(1);
            let f = cases::stream_parallel_reduce_scatter();
            (f, (a, Give::Shard(1)), Take::Sharded(1), e)
        }
        Collective::Allgather => {
            let a = x(&[d, m]);
            let e = r(&a);
            (
                cases::reshard_allgather(),
                (a, Give::Shard(0)),
                Take::Replicated,
                e,
            )
        }
        Collective::Allreduce => {
            let a = x(&[d, m]);
            let e = r(&a).sum(0);
            (
                cases::reshard_allreduce(),
                (a, Give::Shard(0)),
                Take::Replicated,
                e,
            )
        }
        Collective::ReduceScatter => {
            let a = x(&[d, d, m]);
            let e = r(&a).sum(0);
            (
                cases::reshard_reduce_scatter(),
                (a, Give::Shard(0)),
                Take::Sharded(0),
                e,
            )
        }
        Collective::Scatter => {
            let a = x(&[d, m]);
            let e = r(&a);
            (
                cases::reshard_scatter(),
                (a, Give::Whole),
                Take::Sharded(0),
                e,
            )
        }
        Collective::Gather => {
            let a = x(&[d, m]);
            let e = r(&a);
            (
                cases::reshard_gather(),
                (a, Give::Shard(0)),
                Take::On(vec![0]),
                e,
            )
        }
        Collective::Broadcast { root } => {
            let a = x(&[s, m]);
            let e = r(&a);
            let f = cases::reshard_broadcast(*root);
            (f, (a, Give::OnlyOn(vec![*root])), Take::Replicated, e)
        }
        Collective::Reduce => {
            let a = x(&[d, m]);
            let e = r(&a).sum(0);
            (
                cases::reshard_reduce(),
                (a, Give::Shard(0)),
                Take::On(vec![0]),
                e,
            )
        }
        Collective::SendRecv { from, to } => {
            let a = x(&[from.len(), m]);
            let e = r(&a);
            let f = cases::reshard_send_recv(from, to);
            let give = Give::ShardOn(from.clone(), 0);
            (f, (a, give), Take::ShardedOn(to.clone(), 0), e)
        }
    };
    let plan = Plan {
        fusion,
        inputs: vec![input],
        take,
        expected,
    };
    run_plan(plan, c.d, c.streams, &c.lower, &c)
}

#[test]
fn collectives_and_reshardings_match_the_reference() {
    property(
        "collectives and reshardings",
        250,
        100,
        collective_cases(),
        check_collective,
    );
}

// ---------------------------------------------------------------- elementwise chains

/// The second operand of a binary op in a chain.
#[derive(Clone, Copy, Debug)]
enum Operand {
    /// The other input, of the first input's shape.
    Other,
    /// A `[n]` input broadcast over the leading axes.
    Row,
    /// The value `k` steps back in the chain (the first input if there is none).
    Earlier(usize),
}

#[derive(Clone, Copy, Debug)]
enum Step {
    Unary(UnaryOp),
    Binary(BinaryOp, Operand),
}

#[derive(Clone, Debug)]
struct ChainCase {
    d: usize,
    sharded: bool,
    m: usize,
    n: usize,
    /// Each step, and whether its result has a Stream axis.
    steps: Vec<(Step, bool)>,
    streams: usize,
    lower: LowerOptions,
    seed: u64,
}

fn steps() -> impl Strategy<Value = Vec<(Step, bool)>> {
    let unary = prop::sample::select(vec![
        UnaryOp::Neg,
        UnaryOp::Relu,
        UnaryOp::Abs,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
    ])
    .prop_map(Step::Unary);
    let operand = prop_oneof![
        Just(Operand::Other),
        Just(Operand::Row),
        (1..4usize).prop_map(Operand::Earlier),
    ];
    let binary = (
        prop::sample::select(vec![
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Max,
            BinaryOp::Min,
        ]),
        operand,
    )
        .prop_map(|(op, x)| Step::Binary(op, x));
    prop::collection::vec((prop_oneof![unary, binary], any::<bool>()), 1..=5)
}

fn chain_cases() -> impl Strategy<Value = ChainCase> {
    (
        1..=8usize,
        any::<bool>(),
        (1..=6usize, 1..=5usize),
        steps(),
        1..=4usize,
        lower_options(),
        any::<u64>(),
    )
        .prop_map(
            |(d, sharded, (m, n), steps, streams, lower, seed)| ChainCase {
                d,
                sharded,
                m,
                n,
                steps,
                streams,
                lower,
                seed,
            },
        )
}

fn unary_ref(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        other => unreachable!("not generated: {other:?}"),
    }
}

fn binary_ref(op: BinaryOp, a: f64, b: f64) -> f64 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Max => a.max(b),
        BinaryOp::Min => a.min(b),
        BinaryOp::Div => a / b,
    }
}

/// The chain's fusion: inputs `x`, `y` (`[d @ DIDx, m, n]` or `[m, n]`) and `row` (`[n]`).
fn chain_fusion(c: &ChainCase) -> Result<Fusion, fusion::compiler::Error> {
    let mut b = FusionBuilder::new();
    let spec: &[(&str, ParallelType)] = if c.sharded {
        &[("d", Dx), ("m", S), ("n", S)]
    } else {
        &[("m", S), ("n", S)]
    };
    let rank = spec.len();
    let a = axes(&mut b, spec);
    let x = b.input("x", DType::F32, &a)?;
    let y = b.input("y", DType::F32, &a)?;
    let ra = axes(&mut b, &[("n", S)]);
    let row = b.input("row", DType::F32, &ra)?;
    let mut flags = vec![true; rank];
    flags[rank - 1] = false;
    let row = b.broadcast(row, &flags)?;
    let stream_axis = rank - 2;
    let mut values: Vec<TensorId> = vec![x];
    for &(step, stream) in &c.steps {
        let last = *values.last().expect("the chain starts with x");
        let v = match step {
            Step::Unary(op) => b.unary(op, last)?,
            Step::Binary(op, operand) => {
                let other = match operand {
                    Operand::Other => y,
                    Operand::Row => row,
                    Operand::Earlier(k) => values[values.len().saturating_sub(k + 1)],
                };
                b.binary(op, last, other)?
            }
        };
        if stream {
            b.parallelize(v, stream_axis, St)?;
        }
        values.push(v);
    }
    let out = *values.last().expect("at least one step");
    b.output(out)?;
    b.build()
}

fn check_chain(c: ChainCase) -> Result<Verdict, TestCaseError> {
    let Some(fusion) = built(chain_fusion(&c))? else {
        return Ok(Verdict::Rejected);
    };
    let shape: Vec<usize> = if c.sharded {
        vec![c.d, c.m, c.n]
    } else {
        vec![c.m, c.n]
    };
    let (x, y, row) = (
        randn(&shape, c.seed),
        randn(&shape, c.seed ^ 0x77),
        randn(&[c.n], c.seed ^ 0x99),
    );
    let mut values = vec![r(&x)];
    for &(step, _) in &c.steps {
        let last = values.last().expect("the chain starts with x").clone();
        let v = match step {
            Step::Unary(op) => last.map(|v| unary_ref(op, v)),
            Step::Binary(op, operand) => {
                let other = match operand {
                    Operand::Other => r(&y),
                    Operand::Row => r(&row),
                    Operand::Earlier(k) => values[values.len().saturating_sub(k + 1)].clone(),
                };
                last.zip(&other, |a, b| binary_ref(op, a, b))
            }
        };
        values.push(v);
    }
    let expected = values.pop().expect("at least one step");
    let give = if c.sharded {
        Give::Shard(0)
    } else {
        Give::Whole
    };
    let take = if c.sharded {
        Take::Sharded(0)
    } else {
        Take::Replicated
    };
    let inputs = vec![(x, give.clone()), (y, give), (row, Give::Whole)];
    let plan = Plan {
        fusion,
        inputs,
        take,
        expected,
    };
    run_plan(plan, c.d, c.streams, &c.lower, &c)
}

#[test]
fn elementwise_chains_match_the_reference() {
    property("elementwise chains", 250, 100, chain_cases(), check_chain);
}

// ---------------------------------------------------------------- random shardings

/// A copy (`set`) or a sum over axis `sum` of `x [d, m]` (the `d` axis at `d_axis`),
/// with random parallel types on both sides and a random output mesh.
#[derive(Clone, Debug)]
struct ShardingCase {
    d: usize,
    m: usize,
    d_axis: usize,
    input_sharded: bool,
    sum: Option<usize>,
    /// Per output axis: 0 serial, 1 DIDx, 2 Stream.
    out: Vec<u8>,
    /// The output lives on devices `0..k` instead of the whole world.
    out_mesh: Option<usize>,
    streams: usize,
    lower: LowerOptions,
    seed: u64,
}

fn sharding_cases() -> impl Strategy<Value = ShardingCase> {
    (
        1..=8usize,
        1..=5usize,
        0..2usize,
        any::<bool>(),
        prop_oneof![2 => Just(None), 1 => (0..2usize).prop_map(Some)],
        prop::collection::vec(0..3u8, 2),
        prop_oneof![3 => Just(None), 1 => (1..=8usize).prop_map(Some)],
        1..=4usize,
        lower_options(),
        any::<u64>(),
    )
        .prop_map(
            |(d, m, d_axis, input_sharded, sum, out, out_mesh, streams, lower, seed)| {
                ShardingCase {
                    d,
                    m,
                    d_axis,
                    input_sharded,
                    sum,
                    out,
                    out_mesh: out_mesh.map(|k| k.min(d)),
                    streams,
                    lower,
                    seed,
                }
            },
        )
}

/// The parallel type a code of [`ShardingCase::out`] stands for.
fn parallel(code: u8) -> ParallelType {
    match code {
        1 => Dx,
        2 => St,
        _ => S,
    }
}

fn sharding_fusion(c: &ShardingCase) -> Result<Fusion, fusion::compiler::Error> {
    let mut b = FusionBuilder::new();
    let names = if c.d_axis == 0 {
        ["d", "m"]
    } else {
        ["m", "d"]
    };
    let in_spec: Vec<(&str, ParallelType)> = names
        .iter()
        .map(|&n| (n, if n == "d" && c.input_sharded { Dx } else { S }))
        .collect();
    let a = axes(&mut b, &in_spec);
    let x = b.input("x", DType::F32, &a)?;
    let (y, out_names): (TensorId, Vec<&str>) = match c.sum {
        None => (b.set(x)?, names.to_vec()),
        Some(axis) => {
            let mut rest = names.to_vec();
            rest.remove(axis);
            (b.sum(x, &[axis])?, rest)
        }
    };
    let spec: Vec<(&str, ParallelType)> = out_names
        .iter()
        .zip(&c.out)
        .map(|(&n, &p)| (n, parallel(p)))
        .collect();
    let oa = axes(&mut b, &spec);
    let y = b.declare(y, DType::F32, &oa)?;
    if let Some(k) = c.out_mesh {
        b.set_mesh(y, DeviceMesh::devices((0..k).collect::<Vec<_>>()));
    }
    b.output(y)?;
    b.build()
}

fn check_sharding(c: ShardingCase) -> Result<Verdict, TestCaseError> {
    let Some(fusion) = built(sharding_fusion(&c))? else {
        return Ok(Verdict::Rejected);
    };
    let shape = if c.d_axis == 0 {
        [c.d, c.m]
    } else {
        [c.m, c.d]
    };
    let x = randn(&shape, c.seed);
    let expected = match c.sum {
        None => r(&x),
        Some(a) => r(&x).sum(a),
    };
    let give = if c.input_sharded {
        Give::Shard(c.d_axis)
    } else {
        Give::Whole
    };
    let out_rank = if c.sum.is_some() { 1 } else { 2 };
    let sharded_axis = c.out[..out_rank].iter().position(|&p| p == 1);
    let take = match (c.out_mesh, sharded_axis) {
        (None, None) => Take::Replicated,
        (None, Some(a)) => Take::Sharded(a),
        (Some(k), None) => Take::On((0..k).collect()),
        (Some(k), Some(a)) => Take::ShardedOn((0..k).collect(), a),
    };
    let plan = Plan {
        fusion,
        inputs: vec![(x, give)],
        take,
        expected,
    };
    run_plan(plan, c.d, c.streams, &c.lower, &c)
}

#[test]
fn random_shardings_lower_or_fail_cleanly() {
    property(
        "random shardings",
        150,
        25,
        sharding_cases(),
        check_sharding,
    );
}
