//! candle's CUDA tensors as fusion tensors: the same device memory, kept alive by the
//! candle tensor; and fusion outputs in memory candle's device allocated, which becomes
//! candle storage after the call.

use std::any::Any;
use std::sync::Arc;

use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CudaDevice, CudaStorage, Storage};
use fusion_compiler::DType;
use fusion_runtime::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use fusion_runtime::tensor::DeviceBuffer;
use fusion_runtime::{ExecOptions, FusionExecutor, Rank, Tensor};
use half::{bf16, f16};

use crate::error::{Error, Result};

/// Device memory of candle's that fusion tensors view, kept alive by `holds`: a clone of
/// the candle tensor (holding its storage) for an input, the slice itself for a call's
/// output (until it moves into candle storage).
#[derive(Debug)]
struct CandleMemory<K> {
    holds: K,
    ptr: u64,
    bytes: usize,
    ordinal: usize,
}

impl<K: std::fmt::Debug + Send + Sync + 'static> DeviceBuffer for CandleMemory<K> {
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
        holds: owner.clone(),
        ptr,
        bytes,
        ordinal: ours.ordinal(),
    };
    Ok(Tensor::from_device(dtype, shape, Arc::new(memory)))
}

/// An output's memory, allocated by candle's device on its stream.
#[derive(Debug)]
enum Slice {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<bf16>),
    F16(CudaSlice<f16>),
}

/// Memory for an output of `dtype` and `numel` elements on candle's `device`.
fn allocate(device: &CudaDevice, dtype: DType, numel: usize) -> Result<CandleMemory<Slice>> {
    let stream = device.cuda_stream();
    let slice = match dtype {
        DType::F32 => Slice::F32(device.alloc_zeros::<f32>(numel)?),
        DType::BF16 => Slice::BF16(device.alloc_zeros::<bf16>(numel)?),
        DType::F16 => Slice::F16(device.alloc_zeros::<f16>(numel)?),
    };
    let (ptr, bytes) = match &slice {
        Slice::F32(s) => address(s, &stream),
        Slice::BF16(s) => address(s, &stream),
        Slice::F16(s) => address(s, &stream),
    };
    Ok(CandleMemory {
        holds: slice,
        ptr,
        bytes,
        ordinal: device.cuda_stream().context().ordinal(),
    })
}

/// The call of [`crate::call::run`] on candle's CUDA `device`: on its stream, every output
/// written into memory that device allocated, handed to candle afterwards (no copy).
pub(crate) fn run(
    rank: &Rank,
    exec: &FusionExecutor,
    inputs: &[&Tensor],
    device: &CudaDevice,
    options: &ExecOptions,
) -> Result<Vec<(Storage, Vec<usize>)>> {
    let stream = device.cuda_stream();
    let target = rank.on(&stream);
    let layouts = exec.output_layouts(&target, inputs, options)?;
    let mut memories = Vec::with_capacity(layouts.len());
    let mut outputs = Vec::with_capacity(layouts.len());
    for (k, layout) in layouts.into_iter().enumerate() {
        let Some((dtype, shape)) = layout else {
            return Err(Error::Unsupported(format!(
                "output {k} of fusion `{}` has no part on rank {}; a candle call takes \
                 outputs every rank holds",
                exec.name(),
                rank.index()
            )));
        };
        let memory = Arc::new(allocate(device, dtype, shape.iter().product())?);
        let buffer: Arc<dyn DeviceBuffer> = memory.clone();
        outputs.push(Tensor::from_device(dtype, &shape, buffer));
        memories.push((memory, shape));
    }
    let refs: Vec<&Tensor> = outputs.iter().collect();
    drop(exec.run_with(&target, inputs, Some(&refs), options)?);
    drop(refs);
    drop(outputs);
    (memories.into_iter().enumerate())
        .map(|(k, (memory, shape))| {
            let memory = Arc::try_unwrap(memory).map_err(|m| Error::Output {
                name: format!("{} output {k}", exec.name()),
                source: Box::new(fusion_runtime::Error::Tensor(format!(
                    "{} fusion tensor(s) still view it after the call",
                    Arc::strong_count(&m) - 1
                ))),
            })?;
            let storage = match memory.holds {
                Slice::F32(s) => CudaStorage::wrap_cuda_slice(s, device.clone()),
                Slice::BF16(s) => CudaStorage::wrap_cuda_slice(s, device.clone()),
                Slice::F16(s) => CudaStorage::wrap_cuda_slice(s, device.clone()),
            };
            Ok((Storage::Cuda(storage), shape))
        })
        .collect()
}
