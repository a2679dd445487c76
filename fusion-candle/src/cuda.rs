//! candle's CUDA tensors as fusion tensors: the same device memory, kept alive by the
//! candle tensor.

use std::any::Any;
use std::sync::Arc;

use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::CudaStorage;
use fusion_compiler::DType;
use fusion_runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use fusion_runtime::tensor::DeviceBuffer;
use fusion_runtime::{Rank, Tensor};

use crate::error::{Error, Result};

/// Device memory of a candle tensor, which `_owner` (a clone of that tensor, holding its
/// storage) keeps alive as long as any fusion tensor views it.
#[derive(Debug)]
struct CandleMemory {
    _owner: candle_core::Tensor,
    ptr: u64,
    bytes: usize,
    ordinal: usize,
}

impl DeviceBuffer for CandleMemory {
    fn ptr(&self) -> u64 {
        self.ptr
    }
    fn len_bytes(&self) -> usize {
        self.bytes
    }
    fn device(&self) -> usize {
        self.ordinal
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The address and size of a candle CUDA slice (ordered on `stream`, candle's own).
fn address<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> (u64, usize) {
    let (ptr, _sync) = slice.device_ptr(stream);
    (ptr, slice.num_bytes())
}

/// A fusion tensor of `shape` over the device memory of candle tensor `owner`, whose
/// storage is `storage` (checked: contiguous from offset 0, on the rank's device).
pub(crate) fn view(
    rank: &Rank,
    name: &str,
    shape: &[usize],
    storage: &CudaStorage,
    owner: &candle_core::Tensor,
) -> Result<Tensor> {
    let stream = storage.device.cuda_stream();
    let ours = rank.cuda_context()?;
    if stream.context().cu_ctx() != ours.cu_ctx() {
        return Err(Error::Device {
            name: name.into(),
            found: format!(
                "another CUDA context of device {} (not the primary context)",
                stream.context().ordinal()
            ),
            rank: rank.index(),
            wanted: format!(
                "the primary context of cuda:{} (candle_core::Device::new_cuda({}))",
                ours.ordinal(),
                ours.ordinal()
            ),
        });
    }
    let (dtype, (ptr, bytes)) = match &storage.slice {
        CudaStorageSlice::F32(s) => (DType::F32, address(s, &stream)),
        CudaStorageSlice::BF16(s) => (DType::BF16, address(s, &stream)),
        CudaStorageSlice::F16(s) => (DType::F16, address(s, &stream)),
        _ => {
            return Err(Error::DType {
                name: name.into(),
                dtype: owner.dtype(),
            })
        }
    };
    let numel: usize = shape.iter().product();
    if numel * dtype.size_bytes() > bytes {
        return Err(Error::Internal(format!(
            "candle tensor `{name}`: {bytes} bytes of storage for shape {shape:?}"
        )));
    }
    let memory = CandleMemory {
        _owner: owner.clone(),
        ptr,
        bytes,
        ordinal: ours.ordinal(),
    };
    Ok(Tensor::from_device(dtype, shape, Arc::new(memory)))
}
