//! Allgather and ReduceScatter over the copy engines: every block a peer-to-peer transfer
//! with its owner, run as one group of the rank's copy engine; the blocks land in buffers
//! kept from call to call where the copy engine keeps them.

use fusion_compiler::hir::{Communication, CommunicationKind};
use fusion_compiler::DType;

use super::buffers::axis_first;
use super::{Collective, CudaCommunicator};
use crate::device::{Device, Kernel, StreamHandle};
use crate::error::Result;
use crate::tensor::Tensor;

impl CudaCommunicator {
    /// Allgather or ReduceScatter over the copy engines: every member of the team must be
    /// one the copy engines reach (the world's transports say so when it lowers).
    pub(super) fn copy_engine_collective(&self, call: &Collective<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let kind = c.kind.name();
        if let Some(&p) = c
            .team
            .iter()
            .find(|&&p| p != self.rank && !self.by_copy_engine(p))
        {
            return Err(self.err(format!(
                "{kind} over the copy engines with rank {p}, which this world reaches through \
                 NCCL; lower with LowerOptions::transports.collectives = Nccl (the executor does \
                 on such worlds)"
            )));
        }
        let (Some(i), Some(o)) = (call.input, call.output) else {
            return Err(self.err(format!(
                "{kind} over the copy engines needs an input and an output on every rank"
            )));
        };
        match c.kind {
            CommunicationKind::Allgather => self.ce_allgather(s, c, i, o),
            _ => self.ce_reduce_scatter(s, c, i, o),
        }
    }

    /// Allgather over the copy engines: this rank's block is copied locally; every other
    /// block is a peer-to-peer transfer with its owner.
    fn ce_allgather(
        &self,
        s: StreamHandle,
        c: &Communication,
        input: &Tensor,
        output: &Tensor,
    ) -> Result<()> {
        let x = self.contiguous(s, &self.squeeze(input, c.in_sharded_axis, "Allgather")?)?;
        let o = c.out_sharded_axis.or(c.in_sharded_axis).unwrap_or(0);
        let view = axis_first(output, o)?;
        let (buf, back) = if view.is_contiguous() {
            (view.clone(), false)
        } else {
            (self.ce_alloc_receive(s, view.dtype(), view.shape())?, true)
        };
        let me = self.team_index(c);
        self.device.execute(
            s,
            Kernel::Copy {
                src: &x.reshape(buf.select(0, me)?.shape())?,
                dst: &buf.select(0, me)?,
            },
        )?;
        self.exchange_with_team(s, c, |_| Ok(x.clone()), |i| buf.select(0, i))?;
        if back {
            self.copy_back(s, &buf, &view)?;
        }
        Ok(())
    }

    /// ReduceScatter over the copy engines: each block goes to its owner, which sums the
    /// blocks it received with its own.
    fn ce_reduce_scatter(
        &self,
        s: StreamHandle,
        c: &Communication,
        input: &Tensor,
        output: &Tensor,
    ) -> Result<()> {
        let op = self.reduce_op(c)?;
        let x = self.squeeze(input, c.in_sharded_axis, "ReduceScatter")?;
        let sa = self.scatter_axis(c)?;
        let blocks = self.contiguous(s, &axis_first(&x, sa)?)?;
        let me = self.team_index(c);
        let slots = self.ce_alloc_receive(s, blocks.dtype(), blocks.shape())?;
        self.device.execute(
            s,
            Kernel::Copy {
                src: &blocks.select(0, me)?,
                dst: &slots.select(0, me)?,
            },
        )?;
        self.exchange_with_team(s, c, |i| blocks.select(0, i), |i| slots.select(0, i))?;
        // The squeezed output has one block's shape; the sum reads every slot.
        let out = self.squeeze(output, c.out_sharded_axis, "ReduceScatter")?;
        self.device.execute(
            s,
            Kernel::Reduce {
                op,
                src: &slots,
                dst: &out,
                axes: &[0],
            },
        )
    }

    /// Sends `send(i)` to every other member `i` of the team of `c` and receives `recv(i)`
    /// from it, as one group of copy-engine transfers.
    fn exchange_with_team(
        &self,
        s: StreamHandle,
        c: &Communication,
        send: impl Fn(usize) -> Result<Tensor>,
        recv: impl Fn(usize) -> Result<Tensor>,
    ) -> Result<()> {
        let mut transfers = Vec::new();
        for (i, &peer) in c.team.iter().enumerate() {
            if peer != self.rank {
                transfers.push(self.copy_engine.transfer(s, peer, &send(i)?, true, None)?);
                transfers.push(self.copy_engine.transfer(s, peer, &recv(i)?, false, None)?);
            }
        }
        self.copy_engine.run_group(&transfers)
    }

    /// A buffer a copy-engine collective receives into: kept from call to call where the
    /// copy engine keeps receive buffers ([`crate::comm::Capabilities::kept_receives`]).
    fn ce_alloc_receive(&self, s: StreamHandle, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        match self.copy_engine.landing_buffer(s, dtype, shape)? {
            Some(t) => Ok(t),
            None => self.alloc_receive(s, dtype, shape),
        }
    }

    /// This rank's place in the team of `c` (a copy-engine collective runs only on its team).
    fn team_index(&self, c: &Communication) -> usize {
        c.team
            .iter()
            .position(|&r| r == self.rank)
            .expect("in team")
    }
}
