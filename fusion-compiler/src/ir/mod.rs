//! The fusion IR: an arena of scalars, iteration domains, tensors and expressions,
//! addressed by typed ids rather than pointers.

mod axis_map;
mod domain;
mod fusion;
mod linear;
mod mesh;
mod op;
mod scalar;
mod tensor;

pub use axis_map::{axis_map, AxisMap};
pub use domain::{IterDomain, IterDomainId, IterKind, ParallelType};
pub use fusion::Fusion;
pub use mesh::DeviceMesh;
pub use op::{BinaryOp, Epilogue, EpilogueAux, Expr, ExprId, Op, ReduceOp, UnaryOp};
pub use scalar::{NamedScalar, Scalar, ScalarDisplay, ScalarId, ScalarOp};
pub use tensor::{MemoryType, TensorId, TensorView};
