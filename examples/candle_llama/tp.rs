//! The all-reduce of candle's own tensor parallelism (`--candle-tp`), as candle's
//! `llama_multiprocess` example does it: a blocking NCCL all-reduce of each block's partial
//! sums, through cudarc, on candle's stream.

use candle_core::{Device, Tensor as CTensor};
use fusion::prelude::*;

/// Sums a partial result over the world's ranks.
pub type AllReduce = Box<dyn FnMut(CTensor) -> candle_core::Result<CTensor>>;

/// The all-reduce of `rank` for tensors on `device`: nothing to do on one rank, NCCL on
/// CUDA devices; on simulated CPU devices candle has no collective to call.
pub fn all_reduce(rank: &Rank, device: &Device) -> fusion_candle::Result<AllReduce> {
    if rank.world_size() == 1 {
        return Ok(Box::new(Ok));
    }
    #[cfg(feature = "candle-cuda")]
    if let Device::Cuda(cuda) = device {
        return nccl::all_reduce(rank, cuda);
    }
    let _ = device;
    Err(candle_core::Error::msg(format!(
        "--candle-tp on {} ranks needs CUDA devices and a build with the `candle-cuda` \
         feature: candle's tensor parallelism all-reduces through NCCL",
        rank.world_size()
    ))
    .into())
}

#[cfg(feature = "candle-cuda")]
mod nccl {
    use std::rc::Rc;

    use candle_core::backend::BackendStorage;
    use candle_core::{CpuStorage, CudaDevice, CudaStorage, CustomOp1, Layout, Shape};
    use fusion::prelude::*;
    use fusion::runtime::cudarc::nccl::safe::{Comm, Id, ReduceOp};
    use half::{bf16, f16};

    use super::AllReduce;

    /// One NCCL communicator per rank on candle's stream, from an id rank 0 makes and
    /// sends to the others through the world's host channel.
    pub fn all_reduce(rank: &Rank, device: &CudaDevice) -> fusion_candle::Result<AllReduce> {
        let mine: Vec<i64> = if rank.index() == 0 {
            let id = Id::new().map_err(nccl_err)?;
            id.internal()
                .chunks(8)
                .map(|c| i64::from_le_bytes(std::array::from_fn(|i| c[i] as u8)))
                .collect()
        } else {
            vec![0; 16]
        };
        let all = rank.communicator().exchange(&mine)?;
        let bytes: Vec<std::ffi::c_char> = all[0]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .map(|b| b as std::ffi::c_char)
            .collect();
        let id = Id::uninit(bytes.try_into().map_err(|_| {
            fusion_candle::Error::Internal("the NCCL id did not arrive whole".into())
        })?);
        let comm = Comm::from_rank(device.cuda_stream(), rank.index(), rank.world_size(), id)
            .map_err(nccl_err)?;
        let op = AllReduceOp(Rc::new(comm));
        Ok(Box::new(move |t: candle_core::Tensor| {
            t.apply_op1_no_bwd(&op)
        }))
    }

    fn nccl_err(e: fusion::runtime::cudarc::nccl::result::NcclError) -> fusion_candle::Error {
        fusion_candle::Error::Internal(format!("NCCL: {e:?}"))
    }

    /// The sum over ranks, as a candle op (what `llama_multiprocess` defines).
    struct AllReduceOp(Rc<Comm>);

    impl CustomOp1 for AllReduceOp {
        fn name(&self) -> &'static str {
            "nccl-all-reduce"
        }

        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("the NCCL all-reduce runs on CUDA tensors only")
        }

        fn cuda_fwd(
            &self,
            s: &CudaStorage,
            l: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let n = l.shape().elem_count();
            let dev = s.device().clone();
            if !l.is_contiguous() || l.start_offset() != 0 {
                candle_core::bail!("the all-reduce takes contiguous tensors from offset 0")
            }
            macro_rules! reduce {
                ($t:ty) => {{
                    let src = s.as_cuda_slice::<$t>()?;
                    // SAFETY: every element is written by the all-reduce before it is read.
                    let mut dst = unsafe { dev.alloc::<$t>(n) }?;
                    self.0
                        .all_reduce(&src.slice(..n), &mut dst, &ReduceOp::Sum)
                        .map_err(|e| candle_core::Error::Msg(format!("NCCL: {e:?}")))?;
                    CudaStorage::wrap_cuda_slice(dst, dev)
                }};
            }
            let out = match s.dtype() {
                candle_core::DType::F32 => reduce!(f32),
                candle_core::DType::BF16 => reduce!(bf16),
                candle_core::DType::F16 => reduce!(f16),
                other => candle_core::bail!("no all-reduce for {other:?}"),
            };
            Ok((out, l.shape().clone()))
        }
    }
}
