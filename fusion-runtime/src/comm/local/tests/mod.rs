//! Tests: one thread per rank on a shared fabric, outputs checked against references
//! computed directly from every rank's input with tensor views.

mod collectives;
mod failures;
mod p2p;

use std::sync::Arc;
use std::time::Duration;

use fusion_compiler::hir::{Communication, CommunicationKind, HostProgram, Transport};
use fusion_compiler::ir::{DeviceMesh, Fusion, MemoryType, ReduceOp, TensorView};
use fusion_compiler::DType;

use super::{LocalCommunicator, LocalFabric};
use crate::tensor::Tensor;

/// A collective of `kind` on `team` and `mesh` with no optional fields set.
fn comm(kind: CommunicationKind, team: &[usize], mesh: &[usize]) -> Communication {
    let mut ir = Fusion::new();
    let view = TensorView {
        name: None,
        dtype: DType::F32,
        axes: vec![],
        mesh: DeviceMesh::World,
        memory: MemoryType::Global,
    };
    let input = ir.add_tensor(view.clone());
    let output = ir.add_tensor(view);
    let id = HostProgram::new(ir, 1).new_comm_id();
    Communication {
        id,
        kind,
        team: team.to_vec(),
        mesh: mesh.to_vec(),
        root: None,
        input,
        output,
        reduce_op: None,
        transport: Transport::Nccl,
        in_sharded_axis: None,
        in_scatter_axis: None,
        out_sharded_axis: None,
        receiver: None,
    }
}

/// `0..n`.
fn world(n: usize) -> Vec<usize> {
    (0..n).collect()
}

/// Runs `body` on one thread per rank of a fresh fabric; returns the fabric and each
/// rank's result in rank order.
fn run_world<T: Send>(
    n: usize,
    timeout: Duration,
    body: impl Fn(&LocalCommunicator) -> T + Sync,
) -> (Arc<LocalFabric>, Vec<T>) {
    let fabric = LocalFabric::new(n, timeout);
    let body = &body;
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let c = fabric.communicator(r);
                s.spawn(move || body(&c))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    });
    (fabric, results)
}

const LONG: Duration = Duration::from_secs(20);
const SHORT: Duration = Duration::from_secs(2);

/// Rank `rank`'s random input for test case `case`.
fn input(case: u64, rank: usize, shape: &[usize]) -> Tensor {
    Tensor::randn(shape, DType::F32, case * 1000 + rank as u64)
}

/// Elementwise reduction over `parts` in order, in f64 (what every rank must compute).
fn reduce_ref(op: ReduceOp, parts: &[Vec<f32>]) -> Vec<f32> {
    (0..parts[0].len())
        .map(|i| {
            parts
                .iter()
                .fold(op.init(), |acc, p| op.combine(acc, p[i] as f64)) as f32
        })
        .collect()
}

/// `blocks` written one after another into size-1 slices along `axis` of a new tensor.
fn stack_ref(blocks: &[Tensor], axis: usize, shape: &[usize]) -> Vec<f32> {
    let t = Tensor::zeros(shape, DType::F32);
    for (i, b) in blocks.iter().enumerate() {
        t.narrow(axis, i, 1)
            .unwrap()
            .write_f32(&b.to_f32_vec().unwrap())
            .unwrap();
    }
    t.to_f32_vec().unwrap()
}
