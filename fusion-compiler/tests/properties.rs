//! Properties of lowering from `fusion-compiler` alone (the `proptest` crate), on random
//! copies, reductions and elementwise ops between random shardings, Stream axes and meshes:
//!
//! - what `lower::check` rejects without the world size (what `fusion!` rejects at compile
//!   time) fails to lower on every world of 2 to 8 devices that holds its meshes: the
//!   compile-time rule never rejects a fusion that runs;
//! - building and lowering succeed or fail with a documented error, never with a panic or
//!   another error.
//!
//! The numbers of lowered programs are checked by the runtime's property tests
//! (`tests/lowering_properties.rs` of the `fusion` crate). `PROPTEST_RNG_SEED=n` repeats a
//! run.

use std::cell::Cell;

use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::ir::{DeviceMesh, Fusion, ParallelType, ReduceOp, UnaryOp};
use fusion_compiler::lower::{check, lower, LowerOptions};
use fusion_compiler::{DType, Error};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// A mesh: every device, or `k` devices starting at `first`.
#[derive(Clone, Debug)]
enum Mesh {
    World,
    Range { first: usize, k: usize },
}

impl Mesh {
    fn ir(&self) -> DeviceMesh {
        match *self {
            Mesh::World => DeviceMesh::World,
            Mesh::Range { first, k } => DeviceMesh::devices((first..first + k).collect::<Vec<_>>()),
        }
    }

    /// The smallest world that holds the mesh.
    fn needs(&self) -> usize {
        match *self {
            Mesh::World => 0,
            Mesh::Range { first, k } => first + k,
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Set,
    Relu,
    Sum(usize),
}

/// One fusion: an input of `rank` axes (axis `i` of extent `d` where `d_extent[i]`, else
/// its own symbol), sharded on `in_didx`, and one op whose result is declared with
/// `out_didx` and `out_stream` on `out_mesh`.
#[derive(Clone, Debug)]
struct Case {
    rank: usize,
    d_extent: Vec<bool>,
    in_didx: Option<usize>,
    in_mesh: Mesh,
    kind: Kind,
    out_didx: Option<usize>,
    out_stream: Option<usize>,
    out_mesh: Mesh,
}

fn mesh() -> impl Strategy<Value = Mesh> {
    prop_oneof![
        2 => Just(Mesh::World),
        3 => (0..3usize, 1..4usize).prop_map(|(first, k)| Mesh::Range { first, k }),
    ]
}

fn case() -> impl Strategy<Value = Case> {
    (2..=3usize).prop_flat_map(|rank| {
        let axis = proptest::option::of(0..rank);
        (
            proptest::collection::vec(any::<bool>(), rank),
            axis.clone(),
            mesh(),
            prop_oneof![
                Just(Kind::Set),
                Just(Kind::Relu),
                (0..rank).prop_map(Kind::Sum)
            ],
            proptest::option::of(0..rank - 1),
            axis,
            mesh(),
        )
            .prop_map(
                move |(d_extent, in_didx, in_mesh, kind, out_didx, out_stream, out_mesh)| Case {
                    rank,
                    d_extent,
                    in_didx,
                    in_mesh,
                    kind,
                    out_didx,
                    out_stream,
                    out_mesh,
                },
            )
    })
}

fn build(c: &Case) -> fusion_compiler::Result<Fusion> {
    let mut b = FusionBuilder::new();
    let extents: Vec<_> = (0..c.rank)
        .map(|i| match c.d_extent[i] {
            true => b.symbol("d"),
            false => b.symbol(&format!("n{i}")),
        })
        .collect();
    let layout = |extents: &[_], didx: Option<usize>, stream: Option<usize>| -> Vec<Axis> {
        extents
            .iter()
            .enumerate()
            .map(|(i, &extent)| Axis {
                extent,
                parallel: match i {
                    i if Some(i) == didx => ParallelType::DIDx,
                    i if Some(i) == stream => ParallelType::Stream,
                    _ => ParallelType::Serial,
                },
            })
            .collect()
    };
    let x = b.input_on(
        "x",
        DType::F32,
        &layout(&extents, c.in_didx, None),
        c.in_mesh.ir(),
    )?;
    let (y, out_extents) = match c.kind {
        Kind::Set => (b.set(x)?, extents.clone()),
        Kind::Relu => (b.unary(UnaryOp::Relu, x)?, extents.clone()),
        Kind::Sum(a) => {
            let mut kept = extents.clone();
            kept.remove(a);
            (b.reduce(ReduceOp::Sum, x, &[a])?, kept)
        }
    };
    let axes = layout(&out_extents, c.out_didx, c.out_stream);
    let y = b.declare_on(y, DType::F32, &axes, c.out_mesh.ir())?;
    b.output(y)?;
    b.build()
}

/// The errors building and lowering document for fusions they cannot handle.
fn documented(e: &Error) -> bool {
    matches!(
        e,
        Error::Parallelization { .. }
            | Error::Resharding { .. }
            | Error::StreamLowering { .. }
            | Error::Rank { .. }
            | Error::AxisOutOfRange { .. }
            | Error::Argument { .. }
            | Error::ExtentMismatch { .. }
            | Error::Declared { .. }
    )
}

#[test]
fn what_check_rejects_never_lowers_and_nothing_panics() {
    let mut runner = TestRunner::new(Config {
        cases: 1000,
        failure_persistence: None,
        ..Config::default()
    });
    let (lowered, rejected_early) = (Cell::new(0u32), Cell::new(0u32));
    let result = runner.run(&case(), |c| {
        let f = match build(&c) {
            Ok(f) => f,
            Err(e) => {
                prop_assert!(documented(&e), "{c:?}: the builder says {e}");
                return Ok(());
            }
        };
        let found = check(&f);
        if !found.is_empty() {
            rejected_early.set(rejected_early.get() + 1);
        }
        for d in c.in_mesh.needs().max(c.out_mesh.needs()).max(2)..=8 {
            match lower(&f, d, &LowerOptions::default()) {
                Ok(_) => {
                    prop_assert!(
                        found.is_empty(),
                        "{c:?}: {d} devices lower it, but the check rejects it: {found:?}"
                    );
                    lowered.set(lowered.get() + 1);
                }
                Err(e) => prop_assert!(documented(&e), "{c:?} on {d} devices: {e}"),
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!(
        "{} lowerings succeeded; {} fusions rejected before the world size was known",
        lowered.get(),
        rejected_early.get()
    );
    assert!(lowered.get() > 300, "too few cases lowered");
    assert!(rejected_early.get() > 20, "too few cases rejected early");
}
