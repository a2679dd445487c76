//! What the runtime knows of a host program beyond its nodes, worked out once per program
//! ([`ProgramFacts`]), beside the analysis it is built from: where the program's peer
//! copies land ([`receives`]), whether it can be captured as a device graph ([`capture`]),
//! and the identity of a call of it.
//!
//! The executor keeps one [`ProgramFacts`] per cached program; the interpreter asks the
//! same analysis which buffers peers write into and numbers the nodes of traced calls.
//! Nothing here runs a program or touches a device.

mod capture;
mod receives;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use fusion_compiler::hir::{for_each_node, HostProgram, Node};
use fusion_compiler::DType;

pub(crate) use capture::recording_refused;
pub use capture::{capture_plan, EagerReason, CAPTURE_ARENA_LIMIT};
pub use receives::{
    has_peer_copies, peer_copy_receives, received_by_peer_copies, PeerCopyReceives,
};

use crate::device::BackendKind;
use crate::tensor::Tensor;

/// What a call needs to know about its program beyond the nodes, worked out once.
pub(crate) struct ProgramFacts {
    /// Where its peer copies land.
    pub(crate) receives: PeerCopyReceives,
    /// Whether it has peer copies between ranks.
    pub(crate) peer_copies: bool,
    /// A hash of its text (the same on every rank and process for the same program).
    text_hash: u64,
    /// Whether it can be captured as a device graph, worked out once: replayed calls
    /// must not walk the program.
    pub(crate) capture: std::result::Result<(), EagerReason>,
    /// The most bytes, and buffers, one eager call of it allocated on any rank (the
    /// evaluator's buffers): the size of a replayed call's arena.
    call_bytes: AtomicUsize,
    call_allocations: AtomicUsize,
    /// The most one eager call of it had its device hand out on any rank, the backend's
    /// own buffers included: the arena of a call recorded into the caller's capture.
    handed_out: capture::MostHandedOut,
}

impl ProgramFacts {
    /// The facts of `program` as it runs on `backend`.
    pub(crate) fn of(program: &HostProgram, backend: BackendKind) -> Self {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        program.to_string().hash(&mut h);
        ProgramFacts {
            receives: peer_copy_receives(program),
            peer_copies: has_peer_copies(program),
            text_hash: h.finish(),
            capture: capture_plan(program, backend),
            call_bytes: AtomicUsize::new(0),
            call_allocations: AtomicUsize::new(0),
            handed_out: Default::default(),
        }
    }

    /// Notes what an eager call allocated: `allocated_bytes` in `allocations` buffers.
    pub(crate) fn note_allocations(&self, allocated_bytes: usize, allocations: usize) {
        self.call_bytes
            .fetch_max(allocated_bytes, Ordering::Relaxed);
        self.call_allocations
            .fetch_max(allocations, Ordering::Relaxed);
    }

    /// The arena a captured call gets (see [`CAPTURE_ARENA_LIMIT`]): room for everything
    /// an eager call allocated, or 0 (no arena) for calls that allocate more than the limit
    /// or whose allocations are not known yet.
    pub(crate) fn arena_bytes(&self) -> usize {
        let (bytes, count) = (
            self.call_bytes.load(Ordering::Relaxed),
            self.call_allocations.load(Ordering::Relaxed),
        );
        if count == 0 || bytes > CAPTURE_ARENA_LIMIT {
            return 0;
        }
        crate::device::capture_arena_bytes(bytes, count)
    }

    /// The identity of a call with `inputs` on `number_of_streams` streams (see
    /// [`crate::comm::CallStart::identity`] and [`call_identity`]); `None` without peer
    /// copies.
    pub(crate) fn identity(&self, inputs: &[&Tensor], number_of_streams: usize) -> Option<u64> {
        self.peer_copies
            .then(|| call_identity(self.text_hash, number_of_streams, inputs))
    }
}

/// A call's identity: its program's text, the stream count (which the text leaves open and
/// which sizes the per-stream buffers), and the inputs' dtypes and shapes.
fn call_identity(text_hash: u64, number_of_streams: usize, inputs: &[&Tensor]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text_hash.hash(&mut h);
    number_of_streams.hash(&mut h);
    for t in inputs {
        dtype_code(t.dtype()).hash(&mut h);
        t.shape().hash(&mut h);
    }
    h.finish()
}

/// A dtype as a number, for the exchange between ranks (and a call's identity).
pub(crate) fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
    }
}

/// The dtype of a number from [`dtype_code`], if it is one.
pub(crate) fn dtype_from_code(c: i64) -> Option<DType> {
    [DType::F32, DType::BF16, DType::F16]
        .get(usize::try_from(c).ok()?)
        .copied()
}

/// Every node of `program` with its pre-order index (the ids of
/// [`HostSpan::node`](crate::eval::HostSpan::node)).
pub fn node_ids(program: &HostProgram) -> HashMap<*const Node, usize> {
    let mut ids = HashMap::new();
    for_each_node(&program.body, &mut |n| {
        let next = ids.len();
        ids.insert(n as *const Node, next);
    });
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_identities_differ_by_stream_count_and_inputs() {
        let a = Tensor::zeros(&[2, 8], DType::BF16);
        let b = Tensor::zeros(&[4, 8], DType::BF16);
        let id = |streams, t: &Tensor| call_identity(7, streams, &[t]);
        assert_eq!(id(2, &a), id(2, &a));
        assert_ne!(id(2, &a), id(4, &a), "the same text with more streams");
        assert_ne!(id(2, &a), id(2, &b), "other shapes");
        assert_ne!(id(2, &a), call_identity(8, 2, &[&a]), "another program");
    }
}
