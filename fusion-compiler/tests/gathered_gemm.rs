//! The AllGather + GEMM loop as one persistent GEMM (`LowerOptions::pipelines.gathered_gemm`,
//! `lower::gathered_gemm`): the fused program's shape (an insta snapshot at 4 devices),
//! where the rewrite applies (bf16 and f16, stream buffers on and off, either chunk order,
//! the column-parallel form with a DIDx weight, row ranges said ready one by one, the gated
//! MLP's gate and up products as one gated GEMM, a saved pre-activation) and where
//! it leaves the program as it was (f32, NCCL transfers, an epilogue, gathered rows read
//! elsewhere, the option off), and the plan candidates that ask for it. (The MLP block, whose loop also
//! reduce-scatters, is checked in the workspace's `tests/gathered_gemm.rs`.)

use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{for_each_node, CopyStreams, HostProgram, Node, NodeKind, Transport};
use fusion_compiler::ir::{Fusion, Op, UnaryOp};
use fusion_compiler::lower::{lower, LowerOptions, P2pSchedule, Pipelining};
use fusion_compiler::plan::{candidates, find, PLAN_SPACE_REVISION};
use fusion_compiler::DType;

/// `[d @ Stream, m, n] = act(matmul(x [d @ DIDx, m, k], w [k, n]))`, or without `act`
/// the plain AllGather + GEMM; with `keep_rows` the gathered rows are an output too.
fn ag_matmul(dt: DType, act: Option<UnaryOp>, keep_rows: bool) -> Fusion {
    let mut b = FusionBuilder::new();
    let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
    let x = b
        .input("x", dt, &[Axis::didx(d), Axis::serial(m), Axis::serial(k)])
        .unwrap();
    let w = b
        .input("w", dt, &[Axis::serial(k), Axis::serial(n)])
        .unwrap();
    let a = if keep_rows {
        let rows = b.set(x).unwrap();
        let rows = b
            .declare(
                rows,
                dt,
                &[Axis::stream(d), Axis::serial(m), Axis::serial(k)],
            )
            .unwrap();
        b.output(rows).unwrap();
        rows
    } else {
        x
    };
    let mut c = b.matmul(a, w).unwrap();
    if let Some(act) = act {
        c = b.unary(act, c).unwrap();
    }
    let out = [Axis::stream(d), Axis::serial(m), Axis::serial(n)];
    let c = b.declare(c, dt, &out).unwrap();
    b.output(c).unwrap();
    b.build().unwrap()
}

/// The column-parallel projection of the MLP block's first half: `AG(x) W1`, W1 split by
/// columns, every row of this device's column block `[d@Stream, d@DIDx, m, f]`; with
/// `weights_broadcast`, W1 broadcast instead of x, `matmul(x, broadcast(w1))` into
/// `[d@DIDx, d@Stream, m, f]` (the Stream axis second); `act` applied to the product.
fn column_parallel_as(dt: DType, weights_broadcast: bool, act: Option<UnaryOp>) -> Fusion {
    let mut b = FusionBuilder::new();
    let (d, m, h, f) = (b.symbol("d"), b.symbol("m"), b.symbol("h"), b.symbol("f"));
    let x = b
        .input("x", dt, &[Axis::didx(d), Axis::serial(m), Axis::serial(h)])
        .unwrap();
    let w = b
        .input("w1", dt, &[Axis::didx(d), Axis::serial(h), Axis::serial(f)])
        .unwrap();
    let flags = [false, true, false, false];
    let (y, blocks) = if weights_broadcast {
        let wb = b.broadcast(w, &flags).unwrap();
        (b.matmul(x, wb).unwrap(), [Axis::didx(d), Axis::stream(d)])
    } else {
        let rows = b.broadcast(x, &flags).unwrap();
        (b.matmul(rows, w).unwrap(), [Axis::stream(d), Axis::didx(d)])
    };
    let y = match act {
        Some(act) => b.unary(act, y).unwrap(),
        None => y,
    };
    let out = [blocks[0], blocks[1], Axis::serial(m), Axis::serial(f)];
    let y = b.declare(y, dt, &out).unwrap();
    b.output(y).unwrap();
    b.build().unwrap()
}

fn column_parallel(dt: DType) -> Fusion {
    column_parallel_as(dt, false, None)
}

/// The gated MLP's column-parallel half: `silu(AG(x) Wg) * (AG(x) Wu)`, every row of this
/// device's column block `[d@Stream, d@DIDx, m, f]`.
fn gated_half(dt: DType) -> Fusion {
    let mut b = FusionBuilder::new();
    let (d, m, h, f) = (b.symbol("d"), b.symbol("m"), b.symbol("h"), b.symbol("f"));
    let x = b
        .input("x", dt, &[Axis::didx(d), Axis::serial(m), Axis::serial(h)])
        .unwrap();
    let w = [Axis::didx(d), Axis::serial(h), Axis::serial(f)];
    let (wg, wu) = (
        b.input("wg", dt, &w).unwrap(),
        b.input("wu", dt, &w).unwrap(),
    );
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    let gate = b.matmul(rows, wg).unwrap();
    let gate = b.unary(UnaryOp::Silu, gate).unwrap();
    let up = b.matmul(rows, wu).unwrap();
    let y = b.mul(gate, up).unwrap();
    let out = [
        Axis::stream(d),
        Axis::didx(d),
        Axis::serial(m),
        Axis::serial(f),
    ];
    let y = b.declare(y, dt, &out).unwrap();
    b.output(y).unwrap();
    b.build().unwrap()
}

/// Pipelined options with the gathered GEMM asked for (`fused`).
fn options(fused: bool) -> LowerOptions {
    let mut o = LowerOptions::default().with_pipelining(Pipelining::Always);
    o.pipelines.gathered_gemm = fused;
    o
}

fn program(f: &Fusion, world: usize, o: &LowerOptions) -> HostProgram {
    lower(f, world, o).unwrap().program
}

/// How many nodes of each fused kind, and whether any GEMM is left.
fn fused_shape(p: &HostProgram) -> ([usize; 3], bool) {
    let mut counts = [0; 3];
    let mut gemms = false;
    for_each_node(&p.body, &mut |n| match n.kind() {
        NodeKind::GatheredGemmLaunch => counts[0] += 1,
        NodeKind::RowsReady => counts[1] += 1,
        NodeKind::GatheredGemmJoin => counts[2] += 1,
        NodeKind::Matmul | NodeKind::Linear => gemms = true,
        _ => {}
    });
    (counts, gemms)
}

/// Asserts that `fused` lowers `f` exactly as without the option.
fn unchanged(f: &Fusion, world: usize, fused: &LowerOptions, what: &str) {
    let mut off = fused.clone();
    off.pipelines.gathered_gemm = false;
    let (a, b) = (program(f, world, fused), program(f, world, &off));
    assert_eq!(a.to_string(), b.to_string(), "{what}");
}

#[test]
fn the_fused_program_at_four_devices() {
    let p = program(&ag_matmul(DType::BF16, None, false), 4, &options(true));
    insta::assert_snapshot!(p.to_string());
}

#[test]
fn the_loop_keeps_its_copies_and_loses_its_gemms() {
    for dt in [DType::BF16, DType::F16] {
        for buffers in [true, false] {
            for schedule in [P2pSchedule::Ring, P2pSchedule::MeshOrder] {
                for world in [2, 3, 4, 8] {
                    let mut o = options(true);
                    o.streams.buffers = buffers;
                    o.pipelines.p2p_schedule = schedule;
                    let p = program(&ag_matmul(dt, None, false), world, &o);
                    let what = format!("{dt} buffers {buffers} {schedule:?} on {world}");
                    assert_eq!(fused_shape(&p), ([1, 1, 1], false), "{what}:\n{p}");
                    let text = p.to_string();
                    // No copy of the own block: the GEMM reads it in place.
                    assert!(!text.contains("= Set("), "{what}:\n{text}");
                    assert_eq!(text.matches("backend=CopyEngine").count(), 2, "{what}");
                    assert!(p.notes.iter().any(|n| n.starts_with("GatheredGemm 0 of")));
                    // The launch comes after the fork loop, the join right after the loop.
                    let kinds = p.top_level_kinds();
                    let launch = kinds
                        .iter()
                        .position(|k| *k == NodeKind::GatheredGemmLaunch)
                        .unwrap();
                    assert_eq!(kinds[launch - 1], NodeKind::SetCurrentStream, "{what}");
                    assert_eq!(kinds[launch - 3], NodeKind::ForLoop, "{what}");
                    assert_eq!(kinds[launch + 1], NodeKind::ForLoop, "{what}");
                    assert_eq!(kinds[launch + 2], NodeKind::GatheredGemmJoin, "{what}");
                }
            }
        }
    }
}

#[test]
fn the_column_parallel_projection_is_fused() {
    for dt in [DType::BF16, DType::F16] {
        let p = program(&column_parallel(dt), 4, &options(true));
        assert_eq!(fused_shape(&p), ([1, 1, 1], false), "{p}");
    }
}

#[test]
fn the_projection_with_its_weights_broadcast_is_fused_reading_the_weights() {
    // The loop binds W1's broadcast view and writes the output's blocks on its second
    // axis: the kernel reads W1 itself, and the view is gone from the loop.
    let p = program(
        &column_parallel_as(DType::BF16, true, None),
        4,
        &options(true),
    );
    assert_eq!(fused_shape(&p), ([1, 1, 1], false), "{p}");
    let mut b = None;
    for_each_node(&p.body, &mut |n| {
        if let Node::GatheredGemmLaunch(g) = n {
            b = Some(g.b);
        }
    });
    assert_eq!(b, Some(p.inputs[1]), "{p}");
    // No view of the broadcast weights is bound any more (the unfused loop binds one).
    let views_of_broadcast = |p: &HostProgram| {
        let mut broadcast = None;
        let mut views = 0;
        for_each_node(&p.body, &mut |n| match n {
            Node::Compute(e) if matches!(e.op, Op::Broadcast { .. }) => broadcast = Some(e.output),
            Node::AliasSelect { input, .. } if Some(*input) == broadcast => views += 1,
            _ => {}
        });
        views
    };
    let unfused = program(
        &column_parallel_as(DType::BF16, true, None),
        4,
        &options(false),
    );
    assert_eq!(views_of_broadcast(&unfused), 1, "{unfused}");
    assert_eq!(views_of_broadcast(&p), 0, "{p}");
    // In row ranges too, with and without stream buffers.
    for buffers in [true, false] {
        let mut o = options(true);
        o.streams.buffers = buffers;
        o.pipelines.allgather_subchunks = Some(2);
        let p = program(&column_parallel_as(DType::BF16, true, None), 4, &o);
        assert_eq!(
            fused_shape(&p),
            ([1, 1, 1], false),
            "buffers {buffers}:\n{p}"
        );
        assert!(p.to_string().contains("pieces = 2"), "{p}");
        assert_eq!(views_of_broadcast(&p), 0, "{p}");
    }
}

#[test]
fn loops_it_does_not_fit_keep_their_pipeline() {
    let bf16 = ag_matmul(DType::BF16, None, false);
    unchanged(
        &ag_matmul(DType::F32, None, false),
        4,
        &options(true),
        "f32",
    );
    let nccl = options(true).with_transport(Transport::Nccl);
    unchanged(&bf16, 4, &nccl, "NCCL transfers");
    let exp = ag_matmul(DType::BF16, Some(UnaryOp::Exp), false);
    unchanged(&exp, 4, &options(true), "an activation the kernel lacks");
    let kept = ag_matmul(DType::BF16, None, true);
    unchanged(&kept, 4, &options(true), "gathered rows read elsewhere");
    // Without the option nothing changes, and nothing is noted.
    let off = program(&bf16, 4, &options(false));
    assert_eq!(fused_shape(&off).0, [0, 0, 0]);
    assert!(off.notes.iter().all(|n| !n.contains("GatheredGemm")));
}

#[test]
fn an_activation_goes_into_the_kernels_epilogue() {
    for act in [
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Relu,
    ] {
        let p = program(&ag_matmul(DType::BF16, Some(act), false), 4, &options(true));
        assert_eq!(fused_shape(&p), ([1, 1, 1], false), "{act:?}:\n{p}");
        let launch = p.body.iter().find_map(|n| match n {
            Node::GatheredGemmLaunch(g) => Some(g),
            _ => None,
        });
        let g = launch.unwrap();
        assert_eq!(g.epilogue.activations, vec![act], "{p}");
        assert!(!g.epilogue.bias && g.bias.is_none(), "{p}");
    }
}

#[test]
fn a_saved_pre_activation_goes_into_the_kernels_epilogue_with_whole_blocks() {
    // The saving forward of `gelu_tanh(AG(x) W1)` keeps H for its backward: the GEMM's
    // epilogue stores it (an auxiliary matrix), and the gathered GEMM takes that too;
    // told of row ranges it leaves the loop as it was.
    use fusion_compiler::autodiff::{saving, GradSpec};
    use fusion_compiler::ir::EpilogueAux;
    let f = column_parallel_as(DType::BF16, false, Some(UnaryOp::GeluTanh));
    let forward = saving(&f, &GradSpec::all(&f)).unwrap().forward;
    let p = program(&forward, 4, &options(true));
    assert_eq!(fused_shape(&p), ([1, 1, 1], false), "{p}");
    let g = (p.body.iter())
        .find_map(|n| match n {
            Node::GatheredGemmLaunch(g) => Some(g),
            _ => None,
        })
        .unwrap();
    assert_eq!(g.epilogue.aux, Some(EpilogueAux::PreActivation), "{p}");
    assert_eq!(g.epilogue.activations, vec![UnaryOp::GeluTanh], "{p}");
    let aux = g.aux.expect("the launch names its auxiliary matrix");
    assert!(
        forward.outputs().contains(&aux),
        "H is the saved output:\n{p}"
    );
    let mut ranges = options(true);
    ranges.pipelines.allgather_subchunks = Some(2);
    unchanged(&forward, 4, &ranges, "row ranges with an auxiliary matrix");
}

#[test]
fn the_gated_program_at_four_devices() {
    let p = program(&gated_half(DType::BF16), 4, &options(true));
    insta::assert_snapshot!(p.to_string());
}

#[test]
fn the_gated_products_become_one_gated_gemm() {
    for buffers in [true, false] {
        for world in [2, 3, 4, 8] {
            let mut o = options(true);
            o.streams.buffers = buffers;
            let p = program(&gated_half(DType::BF16), world, &o);
            let what = format!("buffers {buffers}, {world} devices:\n{p}");
            assert_eq!(fused_shape(&p), ([1, 1, 1], false), "{what}");
            let g = (p.body.iter())
                .find_map(|n| match n {
                    Node::GatheredGemmLaunch(g) => Some(g),
                    _ => None,
                })
                .unwrap();
            assert!(g.up.is_some() && g.bias.is_none(), "{what}");
            assert_eq!(g.epilogue.activations, vec![UnaryOp::Silu], "{what}");
            // The gate, its activation and the up product are never made.
            let mut pointwise = 0;
            for_each_node(&p.body, &mut |n| {
                pointwise += usize::from(matches!(n.kind(), NodeKind::Unary | NodeKind::Binary));
            });
            assert_eq!(pointwise, 0, "{what}");
        }
    }
    unchanged(&gated_half(DType::F32), 4, &options(true), "f32 gated");
}

#[test]
fn two_loops_get_two_gemms() {
    // Two AllGather + GEMM outputs from separate inputs: two loops, two fused GEMMs.
    let dt = DType::F16;
    let mut b = FusionBuilder::new();
    let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
    let mut outs = Vec::new();
    for name in ["x", "y"] {
        let x = b
            .input(name, dt, &[Axis::didx(d), Axis::serial(m), Axis::serial(k)])
            .unwrap();
        let w = b
            .input(
                &format!("w_{name}"),
                dt,
                &[Axis::serial(k), Axis::serial(n)],
            )
            .unwrap();
        let c = b.matmul(x, w).unwrap();
        let out = [Axis::stream(d), Axis::serial(m), Axis::serial(n)];
        outs.push(b.declare(c, dt, &out).unwrap());
    }
    for c in outs {
        b.output(c).unwrap();
    }
    let p = program(&b.build().unwrap(), 2, &options(true));
    let ids: Vec<usize> = p
        .body
        .iter()
        .filter_map(|n| match n {
            Node::GatheredGemmLaunch(g) => Some(g.id.index()),
            _ => None,
        })
        .collect();
    assert_eq!(ids, vec![0, 1], "{p}");
    assert_eq!(fused_shape(&p), ([2, 2, 2], false));
}

#[test]
fn the_plan_space_has_the_candidates() {
    assert_eq!(PLAN_SPACE_REVISION, 19);
    // (name, row ranges, scattered too, copies in the senders' order)
    let fused = [
        ("gathered_gemm", None, false, false),
        ("gathered_gemm_rows2", Some(2), false, false),
        ("gathered_gemm_send_order_rows4", Some(4), false, true),
        ("gathered_scattered_gemm", None, true, false),
    ];
    for d in [2, 3, 4, 8] {
        for (name, rows, scattered, send_order) in fused {
            let p = find(d, name).unwrap();
            assert!(p.lower.pipelines.gathered_gemm);
            assert_eq!(p.lower.pipelines.allgather_subchunks, rows, "{name}");
            assert_eq!(p.lower.pipelines.scattered_gemm, scattered, "{name}");
            let order = if send_order {
                CopyStreams::OneInSendOrder
            } else {
                CopyStreams::PerPeer
            };
            assert_eq!(p.lower.transports.copy_streams, order, "{name}");
            let mut back = p.lower.clone();
            back.pipelines.gathered_gemm = false;
            back.pipelines.allgather_subchunks = None;
            back.pipelines.scattered_gemm = false;
            back.transports.copy_streams = CopyStreams::PerPeer;
            assert_eq!(back, LowerOptions::default());
        }
        let others = candidates(d)
            .into_iter()
            .filter(|c| !fused.iter().any(|f| f.0 == c.name));
        assert!(others.into_iter().all(|c| !c.lower.pipelines.gathered_gemm));
    }
    assert!(find(1, "gathered_gemm").is_none());
    assert!(find(4, "gathered_gemm_rows4").is_none());
}

#[test]
fn row_ranges_are_said_ready_one_by_one() {
    for dt in [DType::BF16, DType::F16] {
        for buffers in [true, false] {
            for world in [2, 3, 4, 8] {
                for c in [2, 4] {
                    let mut o = options(true);
                    o.streams.buffers = buffers;
                    o.pipelines.allgather_subchunks = Some(c);
                    let p = program(&ag_matmul(dt, None, false), world, &o);
                    let what = format!("{dt} buffers {buffers} on {world}, {c} ranges");
                    assert_eq!(fused_shape(&p), ([1, 1, 1], false), "{what}:\n{p}");
                    let text = p.to_string();
                    assert!(!text.contains("= Set("), "{what}:\n{text}");
                    assert!(text.contains(&format!("pieces = {c}")), "{what}:\n{text}");
                    let piece = format!("piece ( StreamIdx % {c} )");
                    assert!(text.contains(&piece), "{what}:\n{text}");
                    // Every range lands in the gathered block of every rank's rows (no slots).
                    assert!(!text.contains("numberOfStreams *"), "{what}:\n{text}");
                    assert!(p
                        .notes
                        .iter()
                        .any(|n| n.contains(&format!("in {c} row ranges"))));
                }
            }
        }
    }
}

#[test]
fn the_fused_program_in_row_ranges_at_four_devices() {
    let mut o = options(true);
    o.pipelines.allgather_subchunks = Some(2);
    let p = program(&ag_matmul(DType::BF16, None, false), 4, &o);
    insta::assert_snapshot!(p.to_string());
}
