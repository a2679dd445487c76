//! One fusion call on candle tensors: the inputs viewed in place, the outputs as candle
//! storage the fusion wrote (no copies), on the CPU or on candle's CUDA stream.

use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, Storage};
use fusion_runtime::{ExecOptions, FusionExecutor, Rank, Tensor};
use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::input::input;

/// One output of a call: candle storage and the output's shape on this rank.
pub(crate) type Written = (Storage, Vec<usize>);

/// Runs `exec` on `rank` with candle tensors `inputs` (named `names` in errors) and
/// returns its outputs as candle tensors that own the memory the fusion wrote. The
/// tensors carry no gradient history: for training, see [`crate::Differentiable`]. On a
/// GPU the call runs on candle's stream of the inputs' device.
///
/// ```
/// use candle_core::{Device, Tensor as CandleTensor};
/// use fusion::prelude::*;
///
/// fusion! {
///     fn scale<n>(x: Tensor<f32, [n]>, y: Tensor<f32, [n]>) -> Tensor<f32, [n]> { x * y }
/// }
/// let x = CandleTensor::new(&[1f32, 2.0, 3.0], &Device::Cpu)?;
/// let y = World::local(1)?.run(|rank| {
///     let exec = scale::executor()?;
///     let out = fusion_candle::call(rank, exec, &[&x, &x], &ExecOptions::default())?;
///     Ok(out.into_iter().next())
/// })?;
/// assert_eq!(y[0].as_ref().unwrap().to_vec1::<f32>()?, [1.0, 4.0, 9.0]);
/// # Ok::<(), fusion_candle::Error>(())
/// ```
pub fn call(
    rank: &Rank,
    exec: &FusionExecutor,
    inputs: &[&candle_core::Tensor],
    options: &ExecOptions,
) -> Result<Vec<candle_core::Tensor>> {
    let names: Vec<String> = (0..inputs.len())
        .map(|i| format!("{} input {i}", exec.name()))
        .collect();
    let named: Vec<(&str, &candle_core::Tensor)> = names
        .iter()
        .map(String::as_str)
        .zip(inputs.iter().copied())
        .collect();
    let written = run(rank, exec, &named, options)?;
    Ok(written
        .into_iter()
        .map(|(s, shape)| candle_core::Tensor::from_storage(s, shape, BackpropOp::none(), false))
        .collect())
}

/// Runs `exec` on `rank` with the named candle tensors and returns what it wrote, as
/// candle storage on the inputs' device.
pub(crate) fn run(
    rank: &Rank,
    exec: &FusionExecutor,
    inputs: &[(&str, &candle_core::Tensor)],
    options: &ExecOptions,
) -> Result<Vec<Written>> {
    let device = match inputs.first() {
        Some((_, t)) => t.device().clone(),
        None => {
            return Err(Error::Unsupported(format!(
                "fusion `{}` has no inputs; a call on candle tensors needs one to know the \
                 device",
                exec.name()
            )))
        }
    };
    let views = inputs
        .iter()
        .map(|(name, t)| input(rank, name, t))
        .collect::<Result<Vec<Tensor>>>()?;
    let refs: Vec<&Tensor> = views.iter().collect();
    match &device {
        candle_core::Device::Cpu => run_host(rank, exec, &refs, options),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => crate::cuda::run(rank, exec, &refs, d, options),
        #[allow(unreachable_patterns)]
        other => Err(Error::Device {
            name: inputs[0].0.into(),
            found: format!("{:?}", other.location()),
            rank: rank.index(),
            wanted: crate::device::rank_device(rank),
        }),
    }
}

/// The CPU call: the runtime's output vectors move into candle storage.
fn run_host(
    rank: &Rank,
    exec: &FusionExecutor,
    inputs: &[&Tensor],
    options: &ExecOptions,
) -> Result<Vec<Written>> {
    let outputs = exec.run_with(rank, inputs, None, options)?.outputs;
    outputs
        .into_iter()
        .enumerate()
        .map(|(k, t)| {
            let shape = t.shape().to_vec();
            let taken = |e: fusion_runtime::Error| Error::Output {
                name: format!("{} output {k}", exec.name()),
                source: Box::new(e),
            };
            let storage = match t.dtype() {
                fusion_compiler::DType::F32 => {
                    CpuStorage::F32(t.into_host_vec::<f32>().map_err(taken)?)
                }
                fusion_compiler::DType::BF16 => {
                    CpuStorage::BF16(t.into_host_vec::<bf16>().map_err(taken)?)
                }
                fusion_compiler::DType::F16 => {
                    CpuStorage::F16(t.into_host_vec::<f16>().map_err(taken)?)
                }
            };
            Ok((Storage::Cpu(storage), shape))
        })
        .collect()
}
