//! Collectives and transfers on NCCL. Every operation that writes a buffer goes through one
//! helper, [`CudaCommunicator::nccl_into`]: stage the destination (a contiguous buffer
//! NCCL can write), enqueue the NCCL call, copy the staged buffer back into the view. Each
//! operation supplies only what differs: its input, its destination and its NCCL call.

use std::sync::PoisonError;

use cudarc::nccl::result as nccl;
use cudarc::nccl::result::{NcclError, NcclStatus};
use cudarc::nccl::sys::cudaStream_t;
use fusion_compiler::hir::{Communication, CommunicationKind};

use super::buffers::axis_first;
use super::{Collective, CudaCommunicator};
use crate::backend::cuda::comm::nccl::{nccl_dtype, nccl_op, RawComm};
use crate::device::{Device, Kernel, StreamHandle};
use crate::error::Result;
use crate::tensor::Tensor;

/// What an NCCL call answers.
pub(super) type NcclResult = std::result::Result<NcclStatus, NcclError>;

/// One collective on NCCL: its stream, the communication, the team's communicator and
/// this rank's buffers.
#[derive(Clone, Copy)]
pub(super) struct NcclOp<'a> {
    pub(super) s: StreamHandle,
    pub(super) c: &'a Communication,
    pub(super) comm: RawComm,
    pub(super) stream: cudaStream_t,
    pub(super) input: Option<&'a Tensor>,
    pub(super) output: Option<&'a Tensor>,
}

impl NcclOp<'_> {
    /// The buffer `t` (this rank's input or output), or an error saying it is missing.
    fn need(&self, t: Option<&Tensor>, what: &str, comm: &CudaCommunicator) -> Result<Tensor> {
        t.cloned()
            .ok_or_else(|| comm.err(format!("{}: this rank has no {what}", self.c.kind.name())))
    }

    /// This rank's input, or an error saying it has none.
    fn need_input(&self, comm: &CudaCommunicator) -> Result<Tensor> {
        self.need(self.input, "input", comm)
    }

    /// This rank's output, or an error saying it has none.
    fn need_output(&self, comm: &CudaCommunicator) -> Result<Tensor> {
        self.need(self.output, "output", comm)
    }

    /// The place of rank `r` in the team, as NCCL numbers the team's members (0 for a rank
    /// outside it).
    pub(super) fn member(&self, r: usize) -> i32 {
        self.c.team.iter().position(|&x| x == r).unwrap_or(0) as i32
    }
}

/// NCCL's send of the contiguous buffer `buf` to member `peer` of `comm`'s team, on
/// `stream`.
pub(super) fn send(buf: &Tensor, peer: i32, comm: RawComm, stream: cudaStream_t) -> NcclResult {
    let (ptr, count, dtype) = (CudaCommunicator::ptr(buf), buf.numel(), buf.dtype());
    // SAFETY: a contiguous buffer of `count` elements, which the caller keeps alive until
    // NCCL has read it.
    unsafe { nccl::send(ptr, count, nccl_dtype(dtype), peer, comm.0, stream) }
}

/// NCCL's receive into the contiguous buffer `buf` from member `peer` of `comm`'s team, on
/// `stream`.
pub(super) fn recv(buf: &Tensor, peer: i32, comm: RawComm, stream: cudaStream_t) -> NcclResult {
    let (ptr, count, dtype) = (CudaCommunicator::ptr(buf), buf.numel(), buf.dtype());
    // SAFETY: a contiguous buffer of `count` elements, which the caller keeps alive until
    // NCCL has written it.
    unsafe { nccl::recv(ptr, count, nccl_dtype(dtype), peer, comm.0, stream) }
}

impl CudaCommunicator {
    /// Collective `c` on NCCL, on its team's communicator (Scatter and Gather, which NCCL
    /// lacks, as grouped sends and receives).
    pub(super) fn nccl_collective(&self, call: &Collective<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let (comm, _) = self.comm(&c.team)?;
        let call = NcclOp {
            s,
            c,
            comm,
            stream: self.stream(s)?,
            input: call.input,
            output: call.output,
        };
        match c.kind {
            CommunicationKind::Allgather => self.nccl_all_gather(&call),
            CommunicationKind::Allreduce | CommunicationKind::Reduce => self.nccl_reduce(&call),
            CommunicationKind::ReduceScatter => self.nccl_reduce_scatter(&call),
            CommunicationKind::Broadcast => self.nccl_broadcast(&call),
            CommunicationKind::Scatter => self.scatter(&call),
            CommunicationKind::Gather => self.gather(&call),
            CommunicationKind::SendRecv => self.nccl_send_recv(&call),
        }
    }

    /// Stage -> call -> copy back: NCCL writes `dst` itself when it is contiguous, else a
    /// contiguous staging buffer that is copied into `dst` on `s` after the call. `call`
    /// enqueues the NCCL operation (named `what` in errors) that writes the buffer it gets.
    fn nccl_into(
        &self,
        s: StreamHandle,
        dst: &Tensor,
        what: &str,
        call: impl FnOnce(&Tensor) -> NcclResult,
    ) -> Result<()> {
        let (buf, back) = self.receive_buffer(s, dst)?;
        call(&buf).map_err(|e| self.nccl_err(what, e))?;
        if back {
            self.copy_back(s, &buf, dst)?;
        }
        Ok(())
    }

    /// Allgather on NCCL: every block of the output in one call.
    fn nccl_all_gather(&self, call: &NcclOp<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let input = self.squeeze(&call.need_input(self)?, c.in_sharded_axis, c.kind.name())?;
        let x = self.contiguous(s, &input)?;
        let o = c.out_sharded_axis.or(c.in_sharded_axis).unwrap_or(0);
        let view = axis_first(&call.need_output(self)?, o)?;
        let (sendbuff, count, dtype) = (Self::ptr(&x), x.numel(), nccl_dtype(x.dtype()));
        let (comm, stream) = (call.comm.0, call.stream);
        // SAFETY: `x` has `count` elements, the buffer D times as many, both contiguous.
        self.nccl_into(s, &view, "ncclAllGather", |buf| unsafe {
            nccl::all_gather(sendbuff, Self::ptr(buf), count, dtype, comm, stream)
        })
    }

    /// Allreduce or Reduce on NCCL (a root outside the mesh contributes the identity).
    fn nccl_reduce(&self, call: &NcclOp<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let kind = c.kind.name();
        let in_mesh = c.mesh.contains(&self.rank);
        let op = self.reduce_op(c)?;
        let out = call.output.cloned();
        let x = if in_mesh {
            let input = self.squeeze(&call.need_input(self)?, c.in_sharded_axis, kind)?;
            self.contiguous(s, &input)?
        } else {
            // A root outside the mesh contributes the identity.
            let like = out
                .clone()
                .ok_or_else(|| self.err(format!("{kind}: root without output")))?;
            self.identity(s, &like, op)?
        };
        // Without an output (a Reduce's non-root), NCCL writes a scratch buffer.
        let dst = match out {
            Some(o) => o,
            None => self.device.allocate(s, x.dtype(), x.shape())?,
        };
        if dst.numel() != x.numel() {
            return Err(self.err(format!(
                "{kind}: input {:?} and output {:?} differ",
                x.shape(),
                dst.shape()
            )));
        }
        let (sendbuff, count, dtype) = (Self::ptr(&x), x.numel(), nccl_dtype(x.dtype()));
        let (comm, stream, op) = (call.comm.0, call.stream, nccl_op(op));
        let root = c.team.iter().position(|&r| Some(r) == c.root).unwrap_or(0) as i32;
        let all = c.kind == CommunicationKind::Allreduce;
        let what = if all { "nccl Allreduce" } else { "nccl Reduce" };
        // SAFETY: contiguous buffers of `count` elements each.
        self.nccl_into(s, &dst, what, |buf| unsafe {
            let recvbuff = Self::ptr(buf);
            if all {
                nccl::all_reduce(sendbuff, recvbuff, count, dtype, op, comm, stream)
            } else {
                nccl::reduce(sendbuff, recvbuff, count, dtype, op, root, comm, stream)
            }
        })
    }

    /// ReduceScatter on NCCL.
    fn nccl_reduce_scatter(&self, call: &NcclOp<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let kind = c.kind.name();
        let op = self.reduce_op(c)?;
        let x = self.squeeze(&call.need_input(self)?, c.in_sharded_axis, kind)?;
        let sa = self.scatter_axis(c)?;
        let x = self.contiguous(s, &axis_first(&x, sa)?)?;
        let o = self.squeeze(&call.need_output(self)?, c.out_sharded_axis, kind)?;
        let (sendbuff, dtype) = (Self::ptr(&x), nccl_dtype(x.dtype()));
        let (comm, stream, op) = (call.comm.0, call.stream, nccl_op(op));
        // SAFETY: `x` holds D blocks of the buffer's element count, contiguous.
        self.nccl_into(s, &o, "ncclReduceScatter", |buf| unsafe {
            let count = buf.numel();
            nccl::reduce_scatter(sendbuff, Self::ptr(buf), count, dtype, op, comm, stream)
        })
    }

    /// Broadcast on NCCL from the root.
    fn nccl_broadcast(&self, call: &NcclOp<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let root = c.team.iter().position(|&r| Some(r) == c.root).unwrap_or(0) as i32;
        let is_root = c.root == Some(self.rank);
        let x = if is_root {
            Some(self.contiguous(s, &call.need_input(self)?)?)
        } else {
            None
        };
        // A root without an output broadcasts from its (contiguous) input in place.
        let dst = match (call.output, &x) {
            (Some(o), _) => o,
            (None, Some(x)) => x,
            (None, None) => {
                return Err(self.err("Broadcast: a non-root rank without output".into()))
            }
        };
        let (comm, stream) = (call.comm.0, call.stream);
        // SAFETY: contiguous buffers of the buffer's element count.
        self.nccl_into(s, dst, "ncclBroadcast", |buf| unsafe {
            let (recvbuff, count, dtype) = (Self::ptr(buf), buf.numel(), nccl_dtype(buf.dtype()));
            let sendbuff = x.as_ref().map_or(recvbuff, Self::ptr);
            nccl::broadcast(sendbuff, recvbuff, count, dtype, root, comm, stream)
        })
    }

    /// SendRecv: an NCCL send on the sender, a receive on the receiver (a copy when they are one rank).
    fn nccl_send_recv(&self, call: &NcclOp<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let (sender, receiver) = (
            c.root.unwrap_or(usize::MAX),
            c.receiver.unwrap_or(usize::MAX),
        );
        if sender == receiver {
            if let (Some(i), Some(o)) = (call.input, call.output) {
                let src = self.contiguous(s, i)?.reshape(o.shape())?;
                self.device.execute(s, Kernel::Copy { src: &src, dst: o })?;
            }
            return Ok(());
        }
        if self.rank == sender {
            let x = self.contiguous(s, &call.need_input(self)?)?;
            send(&x, call.member(receiver), call.comm, call.stream)
                .map_err(|e| self.nccl_err("ncclSend", e))?;
        } else if self.rank == receiver {
            let o = call.need_output(self)?;
            self.nccl_into(s, &o, "ncclRecv", |buf| {
                recv(buf, call.member(sender), call.comm, call.stream)
            })?;
        }
        Ok(())
    }

    /// A send to world rank `peer` on NCCL (a P2P node's); in a coalescing group the
    /// buffer is kept until the group is issued.
    pub(super) fn nccl_send(&self, stream: StreamHandle, peer: usize, buf: &Tensor) -> Result<()> {
        let comm = self.world_comm_with(peer, "send to")?;
        let x = self.contiguous(stream, buf)?;
        let s = self.stream(stream)?;
        send(&x, peer as i32, comm, s).map_err(|e| self.nccl_err("ncclSend", e))?;
        if let Some(g) = self
            .group
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            g.keep.push(x);
        }
        Ok(())
    }

    /// A receive from world rank `peer` on NCCL (a P2P node's); in a coalescing group the
    /// copy from a staging buffer waits until the group is issued.
    pub(super) fn nccl_recv(&self, stream: StreamHandle, peer: usize, buf: &Tensor) -> Result<()> {
        let comm = self.world_comm_with(peer, "recv from")?;
        let (staged, back) = self.receive_buffer(stream, buf)?;
        let s = self.stream(stream)?;
        recv(&staged, peer as i32, comm, s).map_err(|e| self.nccl_err("ncclRecv", e))?;
        let mut group = self.group.lock().unwrap_or_else(PoisonError::into_inner);
        match (group.as_mut(), back) {
            (Some(g), true) => g.after.push((stream, staged, buf.clone())),
            (Some(g), false) => g.keep.push(staged),
            (None, true) => self.copy_back(stream, &staged, buf)?,
            (None, false) => {}
        }
        Ok(())
    }

    /// The world's NCCL communicator, for a transfer with world rank `peer` (`what`:
    /// "send to" or "recv from", for the error when `peer` is not a peer).
    fn world_comm_with(&self, peer: usize, what: &str) -> Result<RawComm> {
        if peer == self.rank || peer >= self.world_size {
            return Err(self.err(format!("{what} rank {peer}: not a peer")));
        }
        let (comm, _) = self.comm(&(0..self.world_size).collect::<Vec<_>>())?;
        Ok(comm)
    }
}
