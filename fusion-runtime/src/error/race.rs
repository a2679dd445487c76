//! What the race checker reports (`eval::race`): the kinds of access, where an access
//! happened, and the errors naming both sides of a race. Below [`super::Error`], which
//! carries a [`RaceError`].

use crate::streams::StreamHandle;

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
