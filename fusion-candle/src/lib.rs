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

#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod output;

use candle_core::{CpuStorage, DeviceLocation, Storage};
use fusion_runtime::tensor::HostElement;
use fusion_runtime::{BackendKind, Rank, Tensor};
use half::{bf16, f16};
use std::any::Any;
use std::sync::Arc;

pub use error::{Error, Result};
pub use output::OutputBuffer;

/// A rank-local fusion input that views the memory of candle tensor `t` (no copy). `name`
/// is the tensor's name in errors. A CUDA tensor's memory is read on the device in the
/// order of the candle device's stream: call the fusion on that stream
/// (`&rank.on(&candle_device.cuda_stream())`, see `stream_of` with the `cuda` feature).
pub fn input(rank: &Rank, name: &str, t: &candle_core::Tensor) -> Result<Tensor> {
    check_device(name, &t.device().location(), rank)?;
    check_layout(name, t)?;
    let shape = t.dims().to_vec();
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => match cpu {
            CpuStorage::F32(v) => view_host(name, &shape, v, t),
            CpuStorage::BF16(v) => view_host(name, &shape, v, t),
            CpuStorage::F16(v) => view_host(name, &shape, v, t),
            _ => Err(Error::DType {
                name: name.into(),
                dtype: t.dtype(),
            }),
        },
        #[cfg(feature = "cuda")]
        Storage::Cuda(cuda) => cuda::view(rank, name, &shape, cuda, t),
        #[allow(unreachable_patterns)]
        _ => Err(Error::Device {
            name: name.into(),
            found: format!("{:?}", t.device().location()),
            rank: rank.index(),
            wanted: rank_device(rank),
        }),
    }
}

/// The candle CUDA stream of `device`, for calls in its order (`&rank.on(&stream)`);
/// `None` for the CPU.
#[cfg(feature = "cuda")]
pub fn stream_of(
    device: &candle_core::Device,
) -> Option<Arc<fusion_runtime::cudarc::driver::CudaStream>> {
    match device {
        candle_core::Device::Cuda(d) => Some(d.cuda_stream()),
        _ => None,
    }
}

/// Contiguous from the start of its storage, or the error that says what to do.
fn check_layout(name: &str, t: &candle_core::Tensor) -> Result<()> {
    let layout = t.layout();
    if !layout.is_contiguous() {
        return Err(Error::NotContiguous {
            name: name.into(),
            shape: t.dims().to_vec(),
            stride: layout.stride().to_vec(),
        });
    }
    if layout.start_offset() != 0 {
        return Err(Error::StorageOffset {
            name: name.into(),
            offset: layout.start_offset(),
        });
    }
    Ok(())
}

/// A candle tensor on the CPU that owns the memory of host output `t` of a fusion (no
/// copy). The output must be whole (not a view of part of a buffer) and no other view of
/// it alive. Outputs on a GPU are written into candle's memory instead: [`OutputBuffer`].
pub fn output(
    rank: &Rank,
    name: &str,
    t: Tensor,
    device: &candle_core::Device,
) -> Result<candle_core::Tensor> {
    check_device(name, &device.location(), rank)?;
    if !device.is_cpu() || !t.is_host() {
        return Err(Error::Device {
            name: name.into(),
            found: format!("{:?}", device.location()),
            rank: rank.index(),
            wanted: "the CPU (a fusion output on a GPU is written into an OutputBuffer)".into(),
        });
    }
    let shape = t.shape().to_vec();
    let taken = |e: fusion_runtime::Error| Error::Output {
        name: name.into(),
        source: Box::new(e),
    };
    let tensor = match t.dtype() {
        fusion_core::DType::F32 => {
            candle_core::Tensor::from_vec(t.into_host_vec::<f32>().map_err(taken)?, shape, device)
        }
        fusion_core::DType::BF16 => {
            candle_core::Tensor::from_vec(t.into_host_vec::<bf16>().map_err(taken)?, shape, device)
        }
        fusion_core::DType::F16 => {
            candle_core::Tensor::from_vec(t.into_host_vec::<f16>().map_err(taken)?, shape, device)
        }
    }?;
    Ok(tensor)
}

/// A read-only host tensor over `data`, which candle tensor `owner` keeps alive.
fn view_host<T: HostElement>(
    name: &str,
    shape: &[usize],
    data: &[T],
    owner: &candle_core::Tensor,
) -> Result<Tensor> {
    let numel: usize = shape.iter().product();
    if data.len() < numel {
        return Err(Error::Internal(format!(
            "candle tensor `{name}`: storage of {} elements for shape {shape:?}",
            data.len()
        )));
    }
    let keep: Arc<dyn Any + Send + Sync> = Arc::new(owner.clone());
    // SAFETY: `data` is the vector inside the storage that `keep` (a clone of the candle
    // tensor, holding a reference to that storage) keeps alive; candle never resizes or
    // replaces a storage's vector, and the first `numel` elements are the tensor's (it is
    // contiguous from offset 0). The runtime only reads it (writes are refused); a candle
    // in-place write during a call would race, as it would with candle's own kernels.
    let tensor = unsafe { Tensor::from_foreign_host(shape, data.as_ptr(), numel, keep) };
    tensor.map_err(|e| Error::Internal(format!("candle tensor `{name}`: {e}")))
}

/// The device a rank's tensors live on, in words.
fn rank_device(rank: &Rank) -> String {
    match rank.backend() {
        BackendKind::Cpu => "the CPU (a simulated device)".into(),
        BackendKind::Cuda => format!("cuda:{}", rank.device().ordinal()),
    }
}

/// Whether a candle tensor at `location` can be a tensor of `rank`'s device.
fn check_device(name: &str, location: &DeviceLocation, rank: &Rank) -> Result<()> {
    if location_matches(location, rank.backend(), rank.device().ordinal()) {
        Ok(())
    } else {
        Err(Error::Device {
            name: name.into(),
            found: format!("{location:?}"),
            rank: rank.index(),
            wanted: rank_device(rank),
        })
    }
}

/// The rule of [`check_device`]: CPU tensors for simulated CPU devices, `cuda:n` tensors
/// for the rank on GPU `n`.
fn location_matches(location: &DeviceLocation, backend: BackendKind, ordinal: usize) -> bool {
    match (location, backend) {
        (DeviceLocation::Cpu, BackendKind::Cpu) => true,
        (DeviceLocation::Cuda { gpu_id }, BackendKind::Cuda) => *gpu_id == ordinal,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_match_by_backend_and_ordinal() {
        let cuda = |gpu_id| DeviceLocation::Cuda { gpu_id };
        assert!(location_matches(&DeviceLocation::Cpu, BackendKind::Cpu, 3));
        assert!(location_matches(&cuda(1), BackendKind::Cuda, 1));
        assert!(
            !location_matches(&cuda(0), BackendKind::Cuda, 1),
            "another GPU"
        );
        assert!(
            !location_matches(&cuda(0), BackendKind::Cpu, 0),
            "GPU tensor, CPU rank"
        );
        assert!(!location_matches(
            &DeviceLocation::Cpu,
            BackendKind::Cuda,
            0
        ));
        let metal = DeviceLocation::Metal { gpu_id: 0 };
        assert!(!location_matches(&metal, BackendKind::Cpu, 0));
    }
}
