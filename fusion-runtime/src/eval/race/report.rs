//! What the race checker reports: the kinds of access, where an access happened, and the
//! errors naming both sides of a race.

use fusion_core::hir::{HostProgram, Node, P2PDirection};
use fusion_core::ir::ScalarId;

use crate::backend::StreamHandle;

/// How a node touches a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AccessKind {
    /// Reads it (an operand, a collective's input, a send).
    Read,
    /// Writes it (a result, a collective's output, a receive).
    Write,
    /// The stream-ordered allocation: the memory may still be in use by work before it on
    /// the allocating stream, so every use on another stream must be ordered after it.
    Allocate,
    /// The stream-ordered free, on the allocating stream: every use must be ordered
    /// before it.
    Free,
    /// The caller's buffer (an input, a preallocated output), written before the call on
    /// the caller's stream 0.
    Caller,
}

impl AccessKind {
    /// True for every kind but a read: two accesses conflict when either writes.
    pub fn writes(self) -> bool {
        self != AccessKind::Read
    }
}

impl std::fmt::Display for AccessKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AccessKind::Read => "read",
            AccessKind::Write => "write",
            AccessKind::Allocate => "allocation",
            AccessKind::Free => "free",
            AccessKind::Caller => "caller's write",
        })
    }
}

/// One side of a race: which node touched which tensor how, on which stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaceSite {
    /// The node in a short printed form, with the loop indices of its iteration.
    pub node: String,
    /// The tensor the node names (an input, a slice, a buffer).
    pub tensor: String,
    /// How the node touched it.
    pub access: AccessKind,
    /// The stream the access was enqueued on (0 is the caller's).
    pub stream: StreamHandle,
}

impl std::fmt::Display for RaceSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} by `{}` on stream {}",
            self.access, self.tensor, self.node, self.stream
        )
    }
}

/// A stream-order race found by the checker: the first access of the call that is not
/// ordered after a conflicting one (see `eval::race`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RaceError {
    /// Two accesses of overlapping bytes, at least one a write, with no happens-before
    /// between them.
    #[error("rank {rank}: the {later} is not ordered after the {earlier}; both touch {region}")]
    Unordered {
        /// The rank whose program races.
        rank: usize,
        /// The access found unordered.
        later: RaceSite,
        /// The conflicting access it is not ordered after.
        earlier: RaceSite,
        /// The bytes both touch, and whose buffer they are.
        region: String,
    },
    /// An access after the buffer's `Deallocate`.
    #[error("rank {rank}: the {later} comes after the {free} released {region}")]
    UseAfterFree {
        /// The rank whose program races.
        rank: usize,
        /// The access after the free.
        later: RaceSite,
        /// The free.
        free: RaceSite,
        /// The bytes the access touches, and whose buffer they are.
        region: String,
    },
    /// An access the caller's stream 0 is not ordered after when the call returns (the
    /// program does not join the stream it ran on).
    #[error(
        "rank {rank}: the {access} is not joined into the caller's stream 0 by the end of \
         the call ({region})"
    )]
    NotJoined {
        /// The rank whose program races.
        rank: usize,
        /// The first access stream 0 is not ordered after.
        access: RaceSite,
        /// The bytes it touches, and whose buffer they are.
        region: String,
    },
    /// Two transfers of one coalesced group that touch the same bytes, one writing: the
    /// transfers of a group run concurrently.
    #[error(
        "rank {rank}: the {later} and the {earlier} run concurrently in one coalesced group; \
         both touch {region}"
    )]
    InGroup {
        /// The rank whose program races.
        rank: usize,
        /// The later transfer of the group, in program order.
        later: RaceSite,
        /// The earlier one.
        earlier: RaceSite,
        /// The bytes both touch, and whose buffer they are.
        region: String,
    },
}

impl RaceError {
    /// The access that was found unordered (or unjoined).
    pub fn later(&self) -> &RaceSite {
        match self {
            RaceError::Unordered { later, .. }
            | RaceError::UseAfterFree { later, .. }
            | RaceError::InGroup { later, .. } => later,
            RaceError::NotJoined { access, .. } => access,
        }
    }

    /// The conflicting access it should have been ordered after, if any.
    pub fn earlier(&self) -> Option<&RaceSite> {
        match self {
            RaceError::Unordered { earlier, .. } | RaceError::InGroup { earlier, .. } => {
                Some(earlier)
            }
            RaceError::UseAfterFree { free, .. } => Some(free),
            RaceError::NotJoined { .. } => None,
        }
    }
}

/// Where the evaluator is: the node it runs and the indices of the loops around it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Place<'a> {
    /// `None` before the first node (the caller) and after the last (the call's end).
    pub node: Option<&'a Node>,
    pub loops: Vec<(ScalarId, i64)>,
}

impl Place<'_> {
    /// `T6 = matmul(T5, b) [StreamIdx = 2]`, or `outside` for a place without a node.
    pub fn label(&self, p: &HostProgram, outside: &str) -> String {
        let Some(node) = self.node else {
            return outside.to_string();
        };
        let mut s = node_label(p, node);
        if !self.loops.is_empty() {
            let idx: Vec<String> = self
                .loops
                .iter()
                .map(|&(i, v)| format!("{} = {v}", p.ir.display_scalar(i)))
                .collect();
            s.push_str(&format!(" [{}]", idx.join(", ")));
        }
        s
    }
}

/// A node in one line: its kind and the tensors it names.
fn node_label(p: &HostProgram, node: &Node) -> String {
    let name = |t| p.ir.tensor_name(t);
    let list = |ts: &[fusion_core::ir::TensorId]| -> String {
        ts.iter().map(|&t| name(t)).collect::<Vec<_>>().join(", ")
    };
    match node {
        Node::Compute(e) => format!("{} = {}({})", name(e.output), e.op.name(), list(&e.inputs)),
        Node::Launch {
            segment,
            inputs,
            outputs,
        } => format!(
            "({}) = Segment{}({})",
            list(outputs),
            segment.index(),
            list(inputs)
        ),
        Node::Communication(c) => format!(
            "Communication {} ({} {} -> {})",
            c.id.index(),
            c.kind.name(),
            name(c.input),
            name(c.output)
        ),
        Node::P2P(x) => {
            let (dir, to) = match x.direction {
                P2PDirection::Send => ("send", "to"),
                P2PDirection::Recv => ("recv", "from"),
            };
            format!(
                "P2PCommunication {} ({dir} {} {to} {})",
                x.id.index(),
                name(x.buffer),
                p.ir.display_scalar(x.peer)
            )
        }
        Node::Allocate { tensor } => format!("Allocate {}", name(*tensor)),
        Node::Deallocate { tensor } => format!("Deallocate {}", name(*tensor)),
        Node::EndCoalescing { id } => format!("EndCoalescing {}", id.index()),
        Node::Wait { comm } => format!("Wait Communication {}", comm.index()),
        Node::Synchronize { stream } => format!("Synchronize Stream {}", stream.index()),
        other => format!("{:?}", other.kind()),
    }
}
