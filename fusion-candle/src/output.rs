//! Fusion outputs written straight into memory candle owns.

use fusion_runtime::{Rank, Tensor};
use half::{bf16, f16};

use crate::device::check_device;
use crate::error::{Error, Result};

/// Memory for one fusion output that becomes a candle tensor without a copy: pass
/// [`OutputBuffer::tensor`] as the call's output (`run_with(.., Some(&[&out.tensor()]),
/// ..)`), then take the result with [`OutputBuffer::into_candle`]. On the CPU the runtime's
/// own vector moves into candle; on a GPU the memory is a candle tensor from the start
/// (made on the candle device's stream, which the call must then run on: `rank.on(..)`).
/// [`OutputBuffer::for_output`] sizes it from the fusion's output spec.
///
/// ```
/// use fusion::prelude::*;
/// use fusion_candle::OutputBuffer;
///
/// fusion! {
///     fn square<n>(x: Tensor<f32, [n]>) -> Tensor<f32, [n]> { x * x }
/// }
/// World::local(1)?.run(|rank| {
///     let x: Tensor1 = rank.to_device(&Tensor::from_f32(&[3], &[1.0, 2.0, 3.0], DType::F32)?)?
///         .try_into()?;
///     let exec = square::executor()?;
///     let opts = ExecOptions::default();
///     // This rank's shape of output 0, from the fusion's spec.
///     let layout = exec.output_layouts(rank, &[&x], &opts)?[0].clone().expect("on this rank");
///     let out = OutputBuffer::for_output(rank, "y", &layout, &candle_core::Device::Cpu)
///         .map_err(|e| fusion::Error::World(e.to_string()))?;
///     exec.run_with(rank, &[&x], Some(&[&out.tensor()]), &opts)?;
///     let y = out.into_candle().map_err(|e| fusion::Error::World(e.to_string()))?;
///     assert_eq!(y.to_vec1::<f32>().unwrap(), [1.0, 4.0, 9.0]);
///     Ok(())
/// })?;
/// # Ok::<(), fusion::Error>(())
/// ```
pub struct OutputBuffer {
    name: String,
    device: candle_core::Device,
    fusion: Tensor,
    /// On a GPU: the candle tensor the fusion tensor views.
    candle: Option<candle_core::Tensor>,
}

impl OutputBuffer {
    /// The output whose dtype and shape on `rank` are `layout` (from
    /// `FusionExecutor::output_layouts`), on candle device `device` (the rank's).
    pub fn for_output(
        rank: &Rank,
        name: &str,
        layout: &fusion_runtime::eval::OutputLayout,
        device: &candle_core::Device,
    ) -> Result<OutputBuffer> {
        let dtype = match layout.0 {
            fusion_compiler::DType::F32 => candle_core::DType::F32,
            fusion_compiler::DType::BF16 => candle_core::DType::BF16,
            fusion_compiler::DType::F16 => candle_core::DType::F16,
        };
        OutputBuffer::new(rank, name, dtype, &layout.1, device)
    }

    /// An output of `shape` and `dtype` (f32, bf16 or f16) for `rank`, on candle device
    /// `device` (the rank's). `name` names it in errors.
    pub fn new(
        rank: &Rank,
        name: &str,
        dtype: candle_core::DType,
        shape: &[usize],
        device: &candle_core::Device,
    ) -> Result<OutputBuffer> {
        check_device(name, &device.location(), rank)?;
        let numel: usize = shape.iter().product();
        let (fusion, candle) = match device {
            candle_core::Device::Cpu => {
                let t = match dtype {
                    candle_core::DType::F32 => Tensor::from_host_vec(shape, vec![0f32; numel]),
                    candle_core::DType::BF16 => {
                        Tensor::from_host_vec(shape, vec![bf16::ZERO; numel])
                    }
                    candle_core::DType::F16 => Tensor::from_host_vec(shape, vec![f16::ZERO; numel]),
                    other => {
                        return Err(Error::DType {
                            name: name.into(),
                            dtype: other,
                        })
                    }
                };
                (t?, None)
            }
            _ => {
                let t = candle_core::Tensor::zeros(shape, dtype, device)?;
                (crate::input::input(rank, name, &t)?, Some(t))
            }
        };
        Ok(OutputBuffer {
            name: name.into(),
            device: device.clone(),
            fusion,
            candle,
        })
    }

    /// The output as a fusion tensor (a view of the buffer; drop every clone of it, and
    /// the call's report, before [`OutputBuffer::into_candle`]).
    pub fn tensor(&self) -> Tensor {
        self.fusion.clone()
    }

    /// On a GPU, the output as a candle tensor that shares the buffer, which stays usable
    /// for the next call: a loop's output slot, written at the same address every step
    /// (so a replayed call finds it where its graph expects). The next call writing the
    /// buffer overwrites, in the order of candle's stream, what the returned tensor
    /// holds: enqueue whatever reads it before that call. On the CPU the runtime's memory
    /// moves into candle only once ([`OutputBuffer::into_candle`]): an error.
    pub fn shared(&self) -> Result<candle_core::Tensor> {
        self.candle.clone().ok_or_else(|| Error::Output {
            name: self.name.clone(),
            source: Box::new(fusion_runtime::Error::Tensor(
                "a CPU output buffer cannot be shared with candle; take it with into_candle".into(),
            )),
        })
    }

    /// The written output as a candle tensor, owning the buffer; an error while a fusion
    /// tensor over it is still alive (it could be written again).
    pub fn into_candle(self) -> Result<candle_core::Tensor> {
        match self.candle {
            None => {
                let rank_free = |e| Error::Output {
                    name: self.name.clone(),
                    source: Box::new(e),
                };
                let shape = self.fusion.shape().to_vec();
                let t = match self.fusion.dtype() {
                    fusion_compiler::DType::F32 => candle_core::Tensor::from_vec(
                        self.fusion.into_host_vec::<f32>().map_err(rank_free)?,
                        shape,
                        &self.device,
                    ),
                    fusion_compiler::DType::BF16 => candle_core::Tensor::from_vec(
                        self.fusion.into_host_vec::<bf16>().map_err(rank_free)?,
                        shape,
                        &self.device,
                    ),
                    fusion_compiler::DType::F16 => candle_core::Tensor::from_vec(
                        self.fusion.into_host_vec::<f16>().map_err(rank_free)?,
                        shape,
                        &self.device,
                    ),
                };
                Ok(t?)
            }
            Some(candle) => {
                let others = self
                    .fusion
                    .device_buffer()
                    .map_or(0, |b| std::sync::Arc::strong_count(b) - 1);
                if others > 0 {
                    return Err(Error::Output {
                        name: self.name,
                        source: Box::new(fusion_runtime::Error::Tensor(format!(
                            "{others} other fusion tensor(s) (views, clones or a call's \
                             report) still use this buffer; drop them first"
                        ))),
                    });
                }
                Ok(candle)
            }
        }
    }
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
        fusion_compiler::DType::F32 => {
            candle_core::Tensor::from_vec(t.into_host_vec::<f32>().map_err(taken)?, shape, device)
        }
        fusion_compiler::DType::BF16 => {
            candle_core::Tensor::from_vec(t.into_host_vec::<bf16>().map_err(taken)?, shape, device)
        }
        fusion_compiler::DType::F16 => {
            candle_core::Tensor::from_vec(t.into_host_vec::<f16>().map_err(taken)?, shape, device)
        }
    }?;
    Ok(tensor)
}
