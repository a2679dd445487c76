//! candle tensors in and out of fusions, without a copy.
//!
//! A model written with [candle](https://github.com/huggingface/candle) keeps its
//! activations and weights in `candle_core::Tensor`s. [`input`] makes a rank-local fusion
//! input that *views* a candle tensor's memory, and [`output`] turns a fusion output into a
//! candle tensor that *owns* the memory the fusion wrote, so a layer can hand its
//! tensor-parallel parts to fusions and keep everything else in candle:
//!
//! ```
//! use candle_core::{Device, Tensor as CandleTensor};
//! use fusion::prelude::*;
//!
//! fusion! {
//!     /// `relu(x @ w)`.
//!     pub fn layer<T: Float, m, k, n>(x: Tensor<T, [m, k]>, w: Tensor<T, [k, n]>) -> Tensor<T, [m, n]> {
//!         relu(matmul(x, w))
//!     }
//! }
//!
//! let world = World::local(1)?;
//! let x = CandleTensor::randn(0f32, 1.0, (4, 8), &Device::Cpu)?;
//! let w = CandleTensor::randn(0f32, 1.0, (8, 2), &Device::Cpu)?;
//! let y = world.run(|rank| {
//!     let xf = fusion_candle::input(rank, "x", &x)?.try_into()?; // views x's memory
//!     let wf = fusion_candle::input(rank, "w", &w)?.try_into()?;
//!     let y: Ranked<2> = layer(rank, &xf, &wf)?;
//!     Ok(fusion_candle::output(rank, "y", y.into_inner(), &Device::Cpu)?) // owns y's memory
//! })?;
//! let expected = x.matmul(&w)?.relu()?;
//! let diff = (&y[0] - &expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
//! assert!(diff < 1e-5);
//! # Ok::<(), fusion_candle::Error>(())
//! ```
//!
//! What is accepted, and what is refused with an [`Error`] that says what to do (never a
//! silent copy):
//!
//! - element types `f32`, `bf16`, `f16`; anything else: convert with `to_dtype` first;
//! - contiguous tensors that start at the beginning of their storage; a transposed or
//!   strided view: call `.contiguous()`; a view that starts inside its storage (made by
//!   `narrow`, `i`, `chunk`): call `.force_contiguous()` to give it storage of its own;
//! - a tensor on the device the rank runs on: a candle CPU tensor for a rank of simulated
//!   CPU devices.
//!
//! Who owns what, and for how long: an input holds a clone of the candle tensor (a
//! reference to its storage), so the memory outlives every view the runtime keeps; the
//! fusion only reads it. As with candle's own kernels, writing into a candle tensor in
//! place (`Var::set`, `slice_set`) while a fusion reads it is a race. [`output`] consumes
//! the fusion tensor and moves its memory into the candle tensor; it refuses while another
//! view of the output is alive, so the two libraries never share an output.
//!
//! Training: a [`Differentiable`] (made by [`differentiable!`] from a `#[backward]`
//! fusion) applies the fusion to candle tensors as a candle op whose gradient is the
//! derived backward fusion, so `loss.backward()` trains through tensor-parallel layers
//! (by default with the backward's saving form, which keeps the forward's GEMM results
//! in the op until the backward; [`BackwardForm`] says what the recomputing form trades);
//! [`call`] runs a fusion on candle tensors without a gradient.

#![warn(clippy::too_many_lines)]

mod call;
#[cfg(feature = "cuda")]
mod cuda;
mod device;
mod differentiable;
mod error;
mod input;
mod output;

pub use call::call;
pub use differentiable::{BackwardForm, Differentiable};
pub use error::{Error, Result};
pub use input::input;
#[cfg(feature = "cuda")]
pub use input::stream_of;
pub use output::{output, OutputBuffer};
