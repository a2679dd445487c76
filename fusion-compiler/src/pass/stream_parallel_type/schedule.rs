//! Which chunk each iteration of a stream loop handles and which peers it talks to.

use crate::hir::HostProgram;
use crate::ir::{NamedScalar, ScalarId, ScalarOp};
use crate::options::P2pSchedule;

/// Which chunk an iteration handles and which peers it talks to.
pub(super) struct Schedule {
    /// The chunk index (along the stream axis) of iteration `i`.
    pub(super) chunk: ScalarId,
    /// Peer that iteration `i` receives from / sends to.
    pub(super) recv_peer: ScalarId,
    pub(super) send_peer: ScalarId,
    pub(super) rank: ScalarId,
}

impl Schedule {
    pub(super) fn new(
        p: &mut HostProgram,
        kind: P2pSchedule,
        index: ScalarId,
        extent: ScalarId,
        allgather: bool,
        reduce_scatter: bool,
    ) -> Self {
        let rank = p.ir.named(NamedScalar::Rank);
        let ring = reduce_scatter || (allgather && kind == P2pSchedule::Ring);
        if !ring {
            return Schedule {
                chunk: index,
                recv_peer: index,
                send_peer: index,
                rank,
            };
        }
        let f = &mut p.ir;
        let r_plus_i = f.binary(ScalarOp::Add, rank, index);
        let r_plus_d = f.binary(ScalarOp::Add, rank, extent);
        if reduce_scatter {
            // Iteration i computes the partial chunk of device (rank + i + 1) % D and sends
            // it there; it receives device (rank + D - 1 - i) % D's partial of this device's
            // chunk. The local chunk comes last, so no transfer is left after the compute.
            let one = f.constant(1);
            let r_plus_i_plus_1 = f.binary(ScalarOp::Add, r_plus_i, one);
            let to = f.binary(ScalarOp::Mod, r_plus_i_plus_1, extent);
            let r_plus_d_minus_1 = f.binary(ScalarOp::Sub, r_plus_d, one);
            let r_plus_d_minus_1_minus_i = f.binary(ScalarOp::Sub, r_plus_d_minus_1, index);
            let from = f.binary(ScalarOp::Mod, r_plus_d_minus_1_minus_i, extent);
            Schedule {
                chunk: to,
                recv_peer: from,
                send_peer: to,
                rank,
            }
        } else {
            // Iteration i gathers the chunk of device down = (rank + D - i) % D from it, and
            // sends this device's chunk to up = (rank + i) % D, which gathers it now.
            let up = f.binary(ScalarOp::Mod, r_plus_i, extent);
            let r_plus_d_minus_i = f.binary(ScalarOp::Sub, r_plus_d, index);
            let down = f.binary(ScalarOp::Mod, r_plus_d_minus_i, extent);
            Schedule {
                chunk: down,
                recv_peer: down,
                send_peer: up,
                rank,
            }
        }
    }
}
