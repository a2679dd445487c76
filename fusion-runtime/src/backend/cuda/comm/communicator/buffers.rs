//! Buffers as the transports need them: NCCL and the copy engines take contiguous buffers
//! laid out block by block, so views that are not get a staging buffer and a copy kernel
//! on the same stream; the pieces of a collective's layout (squeezed sharded axis, scatter
//! axis, reduction) read off its node.

use std::ffi::c_void;

use fusion_compiler::hir::Communication;
use fusion_compiler::ir::ReduceOp;
use fusion_compiler::DType;

use super::CudaCommunicator;
use crate::device::{Device, DeviceLifecycle, Kernel, StreamHandle};
use crate::error::Result;
use crate::tensor::Tensor;

/// `t` with axis `axis` moved to the front.
pub(super) fn axis_first(t: &Tensor, axis: usize) -> Result<Tensor> {
    let mut perm = vec![axis];
    perm.extend((0..t.rank()).filter(|&d| d != axis));
    t.permute(&perm)
}

impl CudaCommunicator {
    /// `t` if contiguous, else a contiguous copy enqueued on `s`.
    pub(super) fn contiguous(&self, s: StreamHandle, t: &Tensor) -> Result<Tensor> {
        if t.is_contiguous() {
            return Ok(t.clone());
        }
        let c = self.device.allocate(s, t.dtype(), t.shape())?;
        self.device.execute(s, Kernel::Copy { src: t, dst: &c })?;
        Ok(c)
    }

    /// A contiguous buffer to receive into for `dst`, and whether it must be copied back.
    pub(super) fn receive_buffer(&self, s: StreamHandle, dst: &Tensor) -> Result<(Tensor, bool)> {
        if dst.is_contiguous() {
            return Ok((dst.clone(), false));
        }
        Ok((self.alloc_receive(s, dst.dtype(), dst.shape())?, true))
    }

    /// A buffer peers write into (shareable with other processes where they are).
    pub(super) fn alloc_receive(
        &self,
        s: StreamHandle,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        if self.copy_engine.has_ipc_peers() {
            self.device.allocate_shared(s, dtype, shape)
        } else {
            self.device.allocate(s, dtype, shape)
        }
    }

    /// Copies the staged buffer `staged` into `dst` on `s`.
    pub(super) fn copy_back(&self, s: StreamHandle, staged: &Tensor, dst: &Tensor) -> Result<()> {
        self.device.execute(s, Kernel::Copy { src: staged, dst })
    }

    /// `t`'s device address as NCCL takes it (null for a tensor without one).
    pub(super) fn ptr(t: &Tensor) -> *mut c_void {
        t.device_ptr()
            .map_or(std::ptr::null_mut(), |p| p as *mut c_void)
    }

    /// `t` without its axis `axis` (the sharded one), if given; `what` names the call in errors.
    pub(super) fn squeeze(&self, t: &Tensor, axis: Option<usize>, what: &str) -> Result<Tensor> {
        match axis {
            Some(a) => t.squeeze(a).map_err(|e| self.err(format!("{what}: {e}"))),
            None => Ok(t.clone()),
        }
    }

    /// A buffer shaped like `like` filled with the reduction's identity.
    pub(super) fn identity(&self, s: StreamHandle, like: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let t = self.device.allocate(s, like.dtype(), like.shape())?;
        let value = match op {
            ReduceOp::Sum => 0.0,
            ReduceOp::Max => f32::NEG_INFINITY,
        };
        let one = {
            let mut cache = (self.identities.lock()).unwrap_or_else(|p| p.into_inner());
            match cache.get(&(like.dtype(), op)) {
                Some(t) => t.clone(),
                None => {
                    let t = self
                        .device
                        .upload(&Tensor::full(&[1], like.dtype(), value))?;
                    cache.insert((like.dtype(), op), t.clone());
                    t
                }
            }
        };
        let src = one.reshape(&[])?.expand(like.shape())?;
        self.device
            .execute(s, Kernel::Copy { src: &src, dst: &t })?;
        Ok(t)
    }

    /// The reduction of collective `c`, or an error naming its kind.
    pub(super) fn reduce_op(&self, c: &Communication) -> Result<ReduceOp> {
        c.reduce_op
            .ok_or_else(|| self.err(format!("{} without a reduce op", c.kind.name())))
    }

    /// The axis ReduceScatter `c` splits among the team, in its input once the sharded axis
    /// is squeezed.
    pub(super) fn scatter_axis(&self, c: &Communication) -> Result<usize> {
        let sa = c
            .in_scatter_axis
            .ok_or_else(|| self.err("ReduceScatter without a scatter axis".into()))?;
        Ok(match c.in_sharded_axis {
            Some(a) if sa > a => sa - 1,
            _ => sa,
        })
    }
}
