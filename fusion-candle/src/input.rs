//! Candle tensors as fusion inputs: views of their memory, host or CUDA, without copies.

use std::any::Any;
use std::sync::Arc;

use candle_core::{CpuStorage, Storage};
use fusion_runtime::tensor::HostElement;
use fusion_runtime::{Rank, Tensor};

#[cfg(feature = "cuda")]
use crate::cuda;
use crate::device::{check_device, rank_device};
use crate::error::{Error, Result};

/// A rank-local fusion input that views the memory of candle tensor `t` (no copy). `name`
/// is the tensor's name in errors. A CUDA tensor's memory is read on the device in the
/// order of the candle device's stream: call the fusion on that stream
/// (`&rank.on(&candle_device.cuda_stream())`, see `stream_of` with the `cuda` feature).
/// An error here comes before the call, so the peers do not know of it: tell them with
/// `rank.abort(..)` (their calls end at once) unless every rank gives up the call.
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
