//! `fusion-compiler`: the fusion IR, its builder, the host IR, lowering and passes.
//!
//! No device code lives here: a [`hir::HostProgram`] is data that `fusion-runtime`
//! interprets on CPU threads or CUDA devices.
//!
//! ```
//! use fusion_compiler::{builder::{Axis, FusionBuilder}, lower::{lower, LowerOptions}, DType};
//!
//! let mut b = FusionBuilder::new();
//! let (d, m, k, n) = (b.symbol("d"), b.symbol("m"), b.symbol("k"), b.symbol("n"));
//! let a = b.input("a", DType::F32, &[Axis::didx(d), Axis::serial(m), Axis::serial(k)]).unwrap();
//! let w = b.input("w", DType::F32, &[Axis::serial(k), Axis::serial(n)]).unwrap();
//! let c = b.matmul(a, w).unwrap();
//! let c = b.declare(c, DType::F32, &[Axis::stream(d), Axis::serial(m), Axis::serial(n)]).unwrap();
//! b.output(c).unwrap();
//! let fusion = b.build().unwrap();
//! let lowered = lower(&fusion, 4, &LowerOptions::default()).unwrap();
//! assert!(lowered.program.to_string().contains("P2PCommunication"));
//! ```

#![warn(clippy::too_many_lines)]

pub mod autodiff;
pub mod builder;
mod dtype;
mod error;
pub mod generic;
pub mod hir;
pub mod ir;
pub mod lower;
mod options;
pub mod pass;
pub mod plan;
mod print;
pub mod resharding;
pub mod suggest;

pub use dtype::{DType, DTypeSpec};
pub use error::{AxisRef, Culprit, DTypeRef, Error, Result};
pub use print::{node_string, tensor_string};
