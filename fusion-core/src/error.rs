//! Errors raised while building a fusion, lowering it, or running passes.
//!
//! Every variant names the tensor (by its user-given name when it has one) and, where it
//! applies, the axis, so that a message can be acted on without reading the IR.

use thiserror::Error;

/// Result type of `fusion-core`.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong while building, checking or lowering a fusion.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    /// An op got a tensor of the wrong rank.
    #[error("{op}: `{tensor}` has rank {actual}, expected {expected}")]
    Rank {
        op: String,
        tensor: String,
        expected: String,
        actual: usize,
    },
    /// An axis index does not exist on the tensor.
    #[error("{op}: axis {axis} is out of range for `{tensor}` of rank {rank}")]
    AxisOutOfRange {
        op: String,
        tensor: String,
        axis: i64,
        rank: usize,
    },
    /// Two extents that must be equal are not (or cannot be proven equal).
    #[error("{op}: {lhs} but {rhs}")]
    ExtentMismatch {
        op: String,
        lhs: Box<AxisRef>,
        rhs: Box<AxisRef>,
    },
    /// Operand dtypes disagree.
    #[error("{op}: `{lhs}` is {lhs_dtype} but `{rhs}` is {rhs_dtype}; insert a cast")]
    DTypeMismatch {
        op: String,
        lhs: String,
        lhs_dtype: &'static str,
        rhs: String,
        rhs_dtype: &'static str,
    },
    /// A sharding or stream annotation breaks a rule (DESIGN.md section 3).
    #[error("`{tensor}`{}: {reason}", axis_suffix(*.axis))]
    Parallelization {
        tensor: String,
        axis: Option<usize>,
        reason: String,
    },
    /// A resharding the lowering cannot turn into communications.
    #[error("cannot lower `{expr}`: {reason}")]
    Resharding { expr: String, reason: String },
    /// The stream lowering cannot host an expression in a stream loop.
    #[error("stream lowering: `{tensor}`{}: {reason}", axis_suffix(*.axis))]
    StreamLowering {
        tensor: String,
        axis: Option<usize>,
        reason: String,
    },
    /// A pass name that no pass answers to.
    #[error("unknown pass `{0}` (known: {1})")]
    UnknownPass(String, String),
    /// A pass failed on a program it should accept.
    #[error("pass `{pass}`: {reason}")]
    Pass { pass: &'static str, reason: String },
    /// A structural problem with the fusion (no outputs, an id from another fusion, ...).
    #[error("invalid fusion: {0}")]
    Invalid(String),
}

/// One axis of a named tensor, with its extent as text (for mismatch errors).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AxisRef {
    pub tensor: String,
    pub axis: usize,
    pub extent: String,
}

impl std::fmt::Display for AxisRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` axis {} has extent {}",
            self.tensor, self.axis, self.extent
        )
    }
}

fn axis_suffix(axis: Option<usize>) -> String {
    match axis {
        Some(a) => format!(" axis {a}"),
        None => String::new(),
    }
}
