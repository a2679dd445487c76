//! Allreduce, Allgather and ReduceScatter over peer memory: the same buffer layout as on
//! NCCL (contiguous, block by block; views staged and copied back on the same stream),
//! then one kernel ([`crate::backend::cuda::comm::peer_memory`]); and an Allreduce of a
//! GEMM's product in the GEMM's epilogue, where its operands fit the kernel.

use fusion_compiler::hir::{Communication, CommunicationKind, Transport};

use super::buffers::axis_first;
use super::{Collective, CudaCommunicator};
use crate::backend::cuda::comm::peer_memory::{GemmCall, PeerCall};
use crate::device::StreamHandle;
use crate::error::Result;
use crate::tensor::Tensor;

/// Rows and columns of `t` where it is one row-major matrix (every leading extent 1,
/// contiguous, 16-byte aligned) on a device.
fn matrix(t: &Tensor) -> Option<(usize, usize, u64)> {
    let shape = t.shape();
    let [lead @ .., rows, cols] = shape else {
        return None;
    };
    let ptr = t.device_ptr()?;
    (lead.iter().all(|&e| e == 1) && t.is_contiguous() && ptr % 16 == 0)
        .then_some((*rows, *cols, ptr))
}

impl CudaCommunicator {
    /// Collective `call` over peer memory.
    pub(super) fn peer_memory_collective(&self, call: &Collective<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let kind = c.kind.name();
        let Some(pm) = self.peer_memory.as_ref() else {
            return Err(self.err(format!(
                "the program puts a {kind} on peer memory, which this world has not mapped \
                 (its ranks do not all reach each other's memory); run it through the \
                 executor, which lowers onto the world's transports, or lower with \
                 LowerOptions::transports.peer_memory = Never"
            )));
        };
        let (Some(input), Some(output)) = (call.input, call.output) else {
            return Err(self.err(format!(
                "{kind} over peer memory needs an input and an output on every rank"
            )));
        };
        let (x, dst) = match c.kind {
            CommunicationKind::Allreduce => (
                self.squeeze(input, c.in_sharded_axis, kind)?,
                output.clone(),
            ),
            CommunicationKind::Allgather => {
                let o = c.out_sharded_axis.or(c.in_sharded_axis).unwrap_or(0);
                (
                    self.squeeze(input, c.in_sharded_axis, kind)?,
                    axis_first(output, o)?,
                )
            }
            _ => {
                let x = self.squeeze(input, c.in_sharded_axis, kind)?;
                let sa = self.scatter_axis(c)?;
                (
                    axis_first(&x, sa)?,
                    self.squeeze(output, c.out_sharded_axis, kind)?,
                )
            }
        };
        let x = self.contiguous(s, &x)?;
        let expected = match c.kind {
            CommunicationKind::Allreduce => x.numel(),
            CommunicationKind::Allgather => x.numel() * self.world_size,
            _ => x.numel() / self.world_size,
        };
        if dst.numel() != expected || x.dtype() != dst.dtype() {
            return Err(self.err(format!(
                "{kind} over peer memory: input {:?} {} and output {:?} {} do not match on \
                 {} ranks",
                x.shape(),
                x.dtype(),
                dst.shape(),
                dst.dtype(),
                self.world_size
            )));
        }
        // The kernels move 16 bytes at a time where both sides are aligned, else elements.
        let (buf, back) = self.receive_buffer(s, &dst)?;
        let elements = match c.kind {
            CommunicationKind::Allgather => x.numel(),
            _ => buf.numel(),
        };
        let raw = self.device.raw_stream(s)?;
        pm.launch(
            &self.device,
            raw,
            PeerCall {
                kind: c.kind,
                dtype: x.dtype(),
                input: x.device_ptr().unwrap_or(0),
                output: buf.device_ptr().unwrap_or(0),
                elements,
            },
        )?;
        if back {
            self.copy_back(s, &buf, &dst)?;
        }
        Ok(())
    }

    /// `comm`, the Allreduce of `operands[0] @ operands[1]`, as one kernel writing
    /// `output`; false (nothing enqueued) where the world has no peer memory, the device
    /// predates compute capability 8.0 or the operands do not fit the kernel.
    pub(super) fn peer_memory_gemm(
        &self,
        s: StreamHandle,
        comm: &Communication,
        [a, b]: [&Tensor; 2],
        residual: Option<&Tensor>,
        output: &Tensor,
    ) -> Result<bool> {
        let Some(pm) = self.peer_memory.as_ref() else {
            return Ok(false);
        };
        if comm.kind != CommunicationKind::Allreduce || comm.transport != Transport::PeerMemory {
            return Ok(false);
        }
        let ampere = self
            .device
            .shared()
            .ctx
            .compute_capability()
            .is_ok_and(|(major, _)| major >= 8);
        let (Some((m, k, x)), Some((k2, n, w)), Some((m2, n2, y))) =
            (matrix(a), matrix(b), matrix(output))
        else {
            return Ok(false);
        };
        let dtype = a.dtype();
        let same = b.dtype() == dtype && output.dtype() == dtype;
        // The residual as the output is: [m, n], contiguous, of the same dtype.
        let r = match residual {
            None => 0,
            Some(t) => match matrix(t) {
                Some((rm, rn, ptr)) if (rm, rn) == (m2, n2) && t.dtype() == dtype => ptr,
                _ => return Ok(false),
            },
        };
        let call = GemmCall {
            dtype,
            x,
            w,
            y,
            r,
            m,
            k,
            n,
        };
        if !ampere || !same || (k2, m2, n2) != (k, m, n) || !pm.takes_gemm(&call) {
            return Ok(false);
        }
        let raw = self.device.raw_stream(s)?;
        pm.launch_gemm(&self.device, raw, call)?;
        Ok(true)
    }
}
