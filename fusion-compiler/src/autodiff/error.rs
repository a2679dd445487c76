//! Why a backward could not be derived: an op without a derivative (naming the op and
//! the tensor it computes), a request that does not fit the fusion, or a builder error
//! while writing the backward.

use thiserror::Error;

use crate::ir::ExprId;

/// What went wrong while deriving a backward fusion.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AutodiffError {
    /// An expression on the path from a differentiated input to a differentiated output
    /// has no adjoint rule.
    #[error("cannot differentiate `{op}` computing `{tensor}`: {reason}")]
    NotDifferentiable {
        /// The op's DSL name (`max`, `select`, `gelu_grad`).
        op: String,
        /// The tensor the op computes (its user-given name when it has one).
        tensor: String,
        /// Why, and what to write instead where there is a way.
        reason: String,
        /// The expression in the forward fusion (a front end points at its source).
        expr: ExprId,
    },
    /// The request names outputs or inputs the fusion does not have, or asks for a
    /// gradient no requested output depends on.
    #[error("backward: {0}")]
    Request(String),
    /// Writing the backward fusion with the builder failed (a rule produced a layout the
    /// builder refuses).
    #[error("backward: {0}")]
    Build(#[from] crate::Error),
}

impl AutodiffError {
    /// The forward expression at fault, for errors about one.
    pub fn expr(&self) -> Option<ExprId> {
        match self {
            AutodiffError::NotDifferentiable { expr, .. } => Some(*expr),
            _ => None,
        }
    }
}

/// Result type of the reverse-mode pass.
pub type Result<T> = std::result::Result<T, AutodiffError>;

/// A derivation error as a `fusion_compiler::Error` (what executors and entry points
/// carry): a builder error as itself, the others as an invalid fusion.
impl From<AutodiffError> for crate::Error {
    fn from(e: AutodiffError) -> Self {
        match e {
            AutodiffError::Build(e) => e,
            e => crate::Error::Invalid(e.to_string()),
        }
    }
}
