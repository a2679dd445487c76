//! Tensor values of the IR.

use super::domain::IterDomainId;
use super::mesh::DeviceMesh;
use crate::dtype::DType;

/// Index of a tensor in its fusion's arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub(crate) u32);

impl TensorId {
    /// Position in the arena; also the `N` of `TN` in dumps.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The id at arena position `i` (for tables indexed by tensor).
    pub fn from_index(i: usize) -> Self {
        TensorId(i as u32)
    }
}

/// Where a host-IR tensor's storage comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MemoryType {
    /// Owns (or is given) a buffer: inputs, outputs, allocations (`_g_` in dumps).
    #[default]
    Global,
    /// A view of another tensor's buffer, e.g. a stream slice (`_l_` in dumps).
    Local,
}

/// A symbolic tensor: dtype, one iteration domain per axis, and the mesh it lives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorView {
    /// The name the user gave it (a DSL variable or builder argument), used in errors.
    pub name: Option<String>,
    pub dtype: DType,
    /// All axes, including reduction axes (which are not stored).
    pub axes: Vec<IterDomainId>,
    pub mesh: DeviceMesh,
    pub memory: MemoryType,
}
