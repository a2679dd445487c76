//! The [`Communicator`] and [`CommLifecycle`] implementations of the CUDA communicator: collectives run on the
//! transport their node names ([`CudaCommunicator::run_collective`]), sends and receives
//! on the copy engines or NCCL as their P2P node says, coalescing groups span both.

use std::sync::PoisonError;

use cudarc::nccl::result as nccl;
use fusion_compiler::hir::{Communication, Transport};

use super::{Collective, CudaCommunicator, Group};
use crate::comm::{CallStart, Capabilities, CommLifecycle, Communicator};
use crate::device::{ScatterLinks, StreamHandle};
use crate::error::Result;
use crate::tensor::Tensor;

impl Communicator for CudaCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn collective(
        &self,
        stream: StreamHandle,
        comm: &Communication,
        input: Option<&Tensor>,
        output: Option<&Tensor>,
    ) -> Result<()> {
        self.run_collective(&Collective {
            s: stream,
            c: comm,
            input,
            output,
        })
    }

    fn scatter_links(&self) -> Option<ScatterLinks> {
        self.peer_memory.as_ref()?.scatter_links()
    }

    fn gemm_allreduce(
        &self,
        stream: StreamHandle,
        comm: &Communication,
        operands: [&Tensor; 2],
        residual: Option<&Tensor>,
        output: &Tensor,
    ) -> Result<bool> {
        self.peer_memory_gemm(stream, comm, operands, residual, output)
    }

    fn send(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        transport: Transport,
    ) -> Result<()> {
        self.point_to_point(stream, peer, buf, transport, true)
    }

    fn recv(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        transport: Transport,
    ) -> Result<()> {
        self.point_to_point(stream, peer, buf, transport, false)
    }

    fn group_start(&self) -> Result<()> {
        let mut group = self.group.lock().unwrap_or_else(PoisonError::into_inner);
        if group.is_some() {
            return Err(self.err("nested coalescing groups".into()));
        }
        nccl::group_start().map_err(|e| self.nccl_err("ncclGroupStart", e))?;
        *group = Some(Group::default());
        Ok(())
    }

    fn group_end(&self) -> Result<()> {
        let g = self
            .group
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| self.err("EndCoalescing without StartCoalescing".into()))?;
        nccl::group_end().map_err(|e| self.nccl_err("ncclGroupEnd", e))?;
        for (s, staged, dst) in g.after {
            self.copy_back(s, &staged, &dst)?;
        }
        drop(g.keep);
        self.copy_engine.run_group(&g.copies)
    }

    fn abort(&self, reason: &str) {
        self.health.fail(self.rank, reason);
        self.host.abort(reason);
        // Before NCCL's abort, which frees device memory and so waits for the device.
        self.copy_engine.release_device_waits();
        self.state.abort_all();
    }

    fn abort_for(&self, failed_rank: usize, reason: &str) {
        self.health.fail(failed_rank, reason);
        self.host.abort_for(failed_rank, reason);
        self.copy_engine.release_device_waits();
        self.state.abort_all();
    }

    fn recover(&self) -> Result<()> {
        // The host fabric first: a barrier of every rank of the world (none is in a call any
        // more) that starts its new generation. Then this rank stops what may still wait:
        // its NCCL communicators (if the failure has not aborted them) and its device-side
        // waits, and its device drains. The last barrier: no device of the world runs when
        // the world builds its new communicators and zeroes the flags peers write into.
        self.host.recover()?;
        self.copy_engine.release_device_waits();
        self.state.abort_all();
        self.device.drain_after_failure()?;
        self.host.exchange(&[]).map(|_| ())
    }

    fn exchange(&self, values: &[i64]) -> Result<Vec<Vec<i64>>> {
        self.host.exchange(values)
    }

    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn host_allgather(&self, block: crate::comm::Block) -> Result<Vec<crate::comm::Block>> {
        self.host.host_allgather(block)
    }

    fn lifecycle(&self) -> Option<&dyn CommLifecycle> {
        Some(self)
    }
}

/// Transfers numbered per call by the copy engines, NCCL kept off a running graph, the next
/// transfer named for a timeout, and the instance number graphs are kept under.
impl CommLifecycle for CudaCommunicator {
    fn begin_call(&self, call: &CallStart) -> Result<()> {
        self.copy_engine.begin_call(call);
        Ok(())
    }

    fn graph_launched(&self) -> Result<()> {
        if self.state.unavailable.is_some() {
            return Ok(());
        }
        self.graph_fence.launched();
        Ok(())
    }

    fn describe_next_transfer(&self, what: &dyn Fn() -> String) {
        *self
            .next_label
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(what().into());
    }

    fn instance(&self) -> u64 {
        self.instance
    }
}
