//! Iteration domains: one per tensor axis, with an extent, a parallel type and a kind.

use std::fmt;

use super::scalar::ScalarId;

/// Index of an iteration domain in its fusion's arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IterDomainId(pub(crate) u32);

impl IterDomainId {
    /// Position in the arena.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// How an axis is distributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ParallelType {
    /// Not parallelized: every device and stream sees the whole axis.
    #[default]
    Serial,
    /// Sharded over the devices of the tensor's mesh; each device holds one index.
    DIDx,
    /// Produced chunk by chunk on a pool of streams (host-level pipelining).
    Stream,
}

impl ParallelType {
    /// Every parallel type (`fusion!` takes their names from here).
    pub const ALL: [ParallelType; 3] = [
        ParallelType::DIDx,
        ParallelType::Stream,
        ParallelType::Serial,
    ];

    /// Name used in the DSL (`DIDx`, `Stream`) and in messages.
    pub fn name(self) -> &'static str {
        match self {
            ParallelType::Serial => "Serial",
            ParallelType::DIDx => "DIDx",
            ParallelType::Stream => "Stream",
        }
    }

    fn ir_tag(self) -> &'static str {
        match self {
            ParallelType::Serial => "S",
            ParallelType::DIDx => "deviceIdx.x",
            ParallelType::Stream => "StreamIdx",
        }
    }
}

impl fmt::Display for ParallelType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether an axis is iterated, reduced away, or a size-1 broadcast.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum IterKind {
    #[default]
    Iteration,
    /// Reduced by the expression that defines the tensor; absent from its storage.
    Reduction,
    /// Extent 1, expanded against the other operand in elementwise ops.
    Broadcast,
}

/// One axis of a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct IterDomain {
    pub extent: ScalarId,
    pub parallel: ParallelType,
    pub kind: IterKind,
}

impl IterDomain {
    /// An iteration axis of the given extent, not parallelized.
    pub fn new(extent: ScalarId) -> Self {
        IterDomain {
            extent,
            parallel: ParallelType::Serial,
            kind: IterKind::Iteration,
        }
    }

    /// True for reduction axes, which tensors do not store.
    pub fn is_reduction(&self) -> bool {
        self.kind == IterKind::Reduction
    }

    pub(crate) fn prefix(&self) -> String {
        let k = match self.kind {
            IterKind::Iteration => "i",
            IterKind::Reduction => "r",
            IterKind::Broadcast => "b",
        };
        format!("{k}{}", self.parallel.ir_tag())
    }
}
