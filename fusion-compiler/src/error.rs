//! Errors raised while building a fusion, lowering it, or running passes.
//!
//! Every variant names the tensor (by its user-given name when it has one) and, where it
//! applies, the axis, so that a message can be acted on without reading the IR. Errors of
//! a builder call also say which argument of the call is at fault ([`Culprit`]), and the
//! whole-fusion checks say which tensor or expression (`builder::Site`), so that a front end such
//! as `fusion!` can point at the source that caused them.

use thiserror::Error;

/// Result type of `fusion-compiler`.
pub type Result<T> = std::result::Result<T, Error>;

/// The part of a builder call an error is about. Arguments are counted as the builder
/// method takes them, leaving out a leading op kind (`ReduceOp`, `UnaryOp`, `BinaryOp`):
/// in `select(x, axis, index)` argument 0 is `x` and 2 is `index`; in
/// `declare(t, dtype, axes)` and `input(name, dtype, axes)` argument 2 is the axis list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Culprit {
    /// The call as a whole: its operands do not fit together.
    Call,
    /// One argument.
    Arg(usize),
    /// Element `index` of the list argument `arg` (an axis of a declared type, one of the
    /// axes a reduction lists).
    Element { arg: usize, index: usize },
    /// Arguments `first..=last` together (a slice's range).
    Args { first: usize, last: usize },
}

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
        culprit: Culprit,
    },
    /// An axis index does not exist on the tensor.
    #[error("{op}: axis {axis} is out of range for `{tensor}` of rank {rank}{}", axis_range(*.rank))]
    AxisOutOfRange {
        op: String,
        tensor: String,
        axis: i64,
        rank: usize,
        culprit: Culprit,
    },
    /// An argument that is not a tensor (an index, a range, a split factor, broadcast
    /// flags, a list of axes) does not fit the tensor it applies to.
    #[error("{op}: {reason}")]
    Argument {
        op: String,
        reason: String,
        culprit: Culprit,
    },
    /// Two extents that must be equal are not (or cannot be proven equal).
    #[error("{op}: {lhs} but {rhs}{hint}")]
    ExtentMismatch {
        op: String,
        lhs: Box<AxisRef>,
        rhs: Box<AxisRef>,
        /// What the op needs, starting with `; ` (or empty).
        hint: String,
        culprit: Culprit,
    },
    /// Operand dtypes disagree.
    #[error("{op}: {lhs} but {rhs}; convert one with `cast(x, {})`", lhs.dtype)]
    DTypeMismatch {
        op: String,
        lhs: Box<DTypeRef>,
        rhs: Box<DTypeRef>,
        culprit: Culprit,
    },
    /// A declared type (`declare`, an annotated `let`, a return type) disagrees with the
    /// inferred one.
    #[error("{reason}")]
    Declared {
        tensor: String,
        reason: String,
        culprit: Culprit,
    },
    /// A sharding or stream annotation breaks a rule (the compile-time rules of docs/DSL.md).
    #[error("`{tensor}`{}: {reason}", axis_suffix(*.axis))]
    Parallelization {
        tensor: String,
        axis: Option<usize>,
        reason: String,
        /// The argument at fault when a builder call raised it.
        culprit: Option<Culprit>,
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
    /// A pass name that no pass answers to: the name, the known names, and a suggestion
    /// (`; did you mean ..?`) or nothing.
    #[error("unknown pass `{0}` (known: {1}){2}")]
    UnknownPass(String, String, String),
    /// A pass failed on a program it should accept.
    #[error("pass `{pass}`: {reason}")]
    Pass { pass: &'static str, reason: String },
    /// A structural problem with the fusion (no outputs, an id from another fusion, ...).
    #[error("invalid fusion: {0}")]
    Invalid(String),
}

impl Error {
    /// The argument of the builder call that raised this error, when one did.
    pub fn culprit(&self) -> Option<Culprit> {
        match self {
            Error::Rank { culprit, .. }
            | Error::AxisOutOfRange { culprit, .. }
            | Error::Argument { culprit, .. }
            | Error::ExtentMismatch { culprit, .. }
            | Error::DTypeMismatch { culprit, .. }
            | Error::Declared { culprit, .. } => Some(*culprit),
            Error::Parallelization { culprit, .. } => *culprit,
            _ => None,
        }
    }

    /// The same error, blamed on `culprit` (for the variants that carry one).
    pub fn at(mut self, to: Culprit) -> Self {
        match &mut self {
            Error::Rank { culprit, .. }
            | Error::AxisOutOfRange { culprit, .. }
            | Error::Argument { culprit, .. }
            | Error::ExtentMismatch { culprit, .. }
            | Error::DTypeMismatch { culprit, .. }
            | Error::Declared { culprit, .. } => *culprit = to,
            Error::Parallelization { culprit, .. } => *culprit = Some(to),
            _ => {}
        }
        self
    }
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
            "axis {} of `{}` has extent `{}`",
            self.axis, self.tensor, self.extent
        )
    }
}

/// A named tensor and its dtype (a dtype's or a dtype parameter's name), for mismatch
/// errors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DTypeRef {
    pub tensor: String,
    pub dtype: String,
}

impl std::fmt::Display for DTypeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` is `{}`", self.tensor, self.dtype)
    }
}

fn axis_suffix(axis: Option<usize>) -> String {
    match axis {
        Some(a) => format!(" axis {a}"),
        None => String::new(),
    }
}

fn axis_range(rank: usize) -> String {
    match rank {
        0 => " (it has no axes)".into(),
        r => format!("; use an axis in 0..={}", r - 1),
    }
}
