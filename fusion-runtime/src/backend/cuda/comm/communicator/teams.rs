//! The NCCL communicator of a team: the world's when the team is every rank in order, else
//! one made the first time the team is used, from a unique id its first member makes and
//! shares with the others through the host-side endpoints (kept across runs).

use std::sync::PoisonError;

use super::CudaCommunicator;
use crate::backend::cuda::comm::nccl::{id_bytes, id_from_bytes, init_rank, unique_id, RawComm};
use crate::device::StreamHandle;
use crate::error::Result;

impl CudaCommunicator {
    /// The communicator of `team` (the world's when the team is every device in order).
    pub(super) fn comm(&self, team: &[usize]) -> Result<(RawComm, usize)> {
        self.health.check(self.rank)?;
        if let Some(why) = &self.state.unavailable {
            return Err(self.err(format!("no NCCL communicator: {why}")));
        }
        self.graph_fence.settle(&self.device)?;
        let index = team
            .iter()
            .position(|&r| r == self.rank)
            .ok_or_else(|| self.err(format!("rank {} is not in team {team:?}", self.rank)))?;
        if team.iter().copied().eq(0..self.world_size) {
            let c = self
                .state
                .world
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .ok_or_else(|| self.err("the NCCL communicator was aborted".into()))?;
            return Ok((c, index));
        }
        if let Some(&c) = self
            .state
            .teams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(team)
        {
            return Ok((c, index));
        }
        // The team's first member makes the id; every member gets it through the host.
        let mine = if index == 0 {
            id_bytes(&unique_id()?)
        } else {
            Vec::new()
        };
        let ids = self.host.share_bytes("nccl team id", team, &mine)?;
        let id = id_from_bytes(&ids[0])?;
        let c = init_rank(&self.device, id, team.len(), index)
            .map_err(|e| self.err(format!("the communicator of team {team:?}: {e}")))?;
        self.state
            .teams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(team.to_vec(), c);
        Ok((c, index))
    }

    /// The CUDA stream of stream handle `s`, as NCCL takes it.
    pub(super) fn stream(&self, s: StreamHandle) -> Result<cudarc::nccl::sys::cudaStream_t> {
        Ok(self.device.raw_stream(s)?.0 as cudarc::nccl::sys::cudaStream_t)
    }
}
