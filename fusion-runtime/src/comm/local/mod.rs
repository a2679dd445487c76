//! In-process communicator for simulated devices: the ranks of a world are threads of
//! one process that meet on a shared [`LocalFabric`].
//!
//! Execution is synchronous (streams are ignored) and all data moves as f32, which is
//! lossless for every supported dtype. Collectives are rendezvous among `comm.team`,
//! matched by team and each rank's sequence number on that team, so consecutive
//! collectives pair up in program order and different teams do not interfere.
//! Point-to-point sends are buffered in FIFO mailboxes. A failed rank ([`LocalFabric::fail`],
//! [`Communicator::abort`]) or a wait past the fabric's timeout ends every wait with an
//! error instead of a hang.
//!
//! A rank passes `input` only where its role contributes (ignored otherwise) and gets data
//! only where its role receives and `output` is given. Inside a group, sends go out at once
//! and receives complete in `group_end`; collectives in a group run immediately.

mod compute;
mod fabric;
mod layout;
mod plan;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use fusion_core::hir::{CommBackend, Communication};

pub use fabric::LocalFabric;

use crate::backend::StreamHandle;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use fabric::{Block, Deposit};

/// One rank's endpoint to a [`LocalFabric`].
#[derive(Debug)]
pub struct LocalCommunicator {
    fabric: Arc<LocalFabric>,
    rank: usize,
    /// Next sequence number per team (the team as written in the collective).
    sequences: Mutex<HashMap<Vec<usize>, u64>>,
    /// Receives deferred to `group_end`, in issue order; `None` outside a group.
    group: Mutex<Option<Vec<(usize, Tensor)>>>,
}

impl LocalCommunicator {
    fn new(fabric: Arc<LocalFabric>, rank: usize) -> Self {
        LocalCommunicator {
            fabric,
            rank,
            sequences: Mutex::new(HashMap::new()),
            group: Mutex::new(None),
        }
    }

    /// The fabric this endpoint belongs to.
    pub fn fabric(&self) -> &Arc<LocalFabric> {
        &self.fabric
    }

    fn error(&self, reason: impl Into<String>) -> Error {
        Error::Communication {
            rank: self.rank,
            reason: reason.into(),
        }
    }

    fn check_rank(&self) -> Result<()> {
        if self.rank >= self.fabric.world_size() {
            return Err(self.error(format!(
                "rank {} is outside the world of {} ranks",
                self.rank,
                self.fabric.world_size()
            )));
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize, what: &str) -> Result<()> {
        self.check_rank()?;
        if peer == self.rank {
            return Err(self.error(format!("{what} with itself (peer {peer})")));
        }
        if peer >= self.fabric.world_size() {
            return Err(self.error(format!(
                "{what} with peer {peer}, outside the world of {} ranks",
                self.fabric.world_size()
            )));
        }
        Ok(())
    }

    fn next_sequence(&self, team: &[usize]) -> u64 {
        let mut seqs = self
            .sequences
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let seq = seqs.entry(team.to_vec()).or_insert(0);
        *seq += 1;
        *seq - 1
    }

    fn recv_now(&self, peer: usize, buf: &Tensor) -> Result<()> {
        let msg = self.fabric.take(peer, self.rank)?;
        if msg.data.len() != buf.numel() {
            return Err(self.error(format!(
                "recv from rank {peer}: the message has {} elements (shape {:?}) but the buffer \
                 has {} (shape {:?})",
                msg.data.len(),
                msg.shape,
                buf.numel(),
                buf.shape()
            )));
        }
        buf.write_f32(&msg.data)
            .map_err(|e| self.error(format!("recv from rank {peer}: {e}")))
    }
}

impl Communicator for LocalCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.fabric.world_size()
    }

    fn collective(
        &self,
        _stream: StreamHandle,
        comm: &Communication,
        input: Option<&Tensor>,
        output: Option<&Tensor>,
    ) -> Result<()> {
        let kind = comm.kind.name();
        self.check_rank()?;
        if !comm.team.contains(&self.rank) {
            return Err(self.error(format!(
                "{kind} on team {:?}: this rank is not in the team",
                comm.team
            )));
        }
        if let Some(r) = comm.team.iter().find(|&&r| r >= self.fabric.world_size()) {
            return Err(self.error(format!(
                "{kind} on team {:?}: rank {r} is outside the world of {} ranks",
                comm.team,
                self.fabric.world_size()
            )));
        }
        let mut members = Vec::with_capacity(comm.team.len());
        for &r in &comm.team {
            if !members.contains(&r) {
                members.push(r);
            }
        }
        let seq = self.next_sequence(&comm.team);
        let what = format!("{kind} #{seq} on team {:?}", comm.team);
        let signature = plan::signature(comm);
        let deposit = Deposit {
            signature: signature.clone(),
            contribution: plan::contribution(comm, self.rank, input),
        };
        let key = (comm.team.clone(), seq);
        let deposits = self
            .fabric
            .rendezvous(self.rank, &key, &members, deposit, &what)?;
        let fail = |reason: String| self.error(format!("{what}: {reason}"));
        compute::check_agreement(comm, self.rank, &signature, &deposits).map_err(fail)?;
        let Some(output) = output.filter(|_| plan::role(comm, self.rank).receives) else {
            return Ok(());
        };
        let expected = compute::output_shape(comm, &deposits).map_err(fail)?;
        if output.shape() != expected.as_slice() {
            return Err(fail(format!(
                "the output has shape {:?} but shape {expected:?} was expected",
                output.shape()
            )));
        }
        let data = compute::output_data(comm, self.rank, &expected, &deposits).map_err(fail)?;
        output.write_f32(&data).map_err(|e| fail(e.to_string()))
    }

    fn send(
        &self,
        _stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        _backend: CommBackend,
    ) -> Result<()> {
        self.check_peer(peer, "send")?;
        let data = buf
            .to_f32_vec()
            .map_err(|e| self.error(format!("send to rank {peer}: {e}")))?;
        let block = Block {
            shape: buf.shape().to_vec(),
            data,
        };
        self.fabric.post(self.rank, peer, block)
    }

    fn recv(
        &self,
        _stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        _backend: CommBackend,
    ) -> Result<()> {
        self.check_peer(peer, "recv")?;
        let mut group = self.group.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(pending) = group.as_mut() {
            pending.push((peer, buf.clone()));
            return Ok(());
        }
        drop(group);
        self.recv_now(peer, buf)
    }

    fn group_start(&self) -> Result<()> {
        let mut group = self.group.lock().unwrap_or_else(PoisonError::into_inner);
        if group.is_some() {
            return Err(self.error("group_start inside a group (groups do not nest)"));
        }
        *group = Some(Vec::new());
        Ok(())
    }

    fn group_end(&self) -> Result<()> {
        let pending = self
            .group
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| self.error("group_end without group_start"))?;
        for (peer, buf) in pending {
            self.recv_now(peer, &buf)?;
        }
        Ok(())
    }

    fn abort(&self, reason: &str) {
        self.fabric.fail(self.rank, reason);
    }

    fn exchange(&self, values: &[i64]) -> Result<Vec<Vec<i64>>> {
        self.check_rank()?;
        // Exchanges meet on their own key space (the empty team), in call order.
        let seq = self.next_sequence(&[]);
        let what = format!("metadata exchange #{seq}");
        let members: Vec<usize> = (0..self.fabric.world_size()).collect();
        // Each i64 travels as four exact 16-bit chunks.
        let data: Vec<f32> = values
            .iter()
            .flat_map(|&v| (0..4).map(move |i| ((v as u64 >> (16 * i)) & 0xFFFF) as f32))
            .collect();
        let deposit = Deposit {
            signature: "exchange".into(),
            contribution: Ok(Some(Arc::new(Block {
                shape: vec![data.len()],
                data,
            }))),
        };
        let deposits =
            self.fabric
                .rendezvous(self.rank, &(Vec::new(), seq), &members, deposit, &what)?;
        deposits
            .into_iter()
            .map(|(r, d)| match d.contribution {
                Ok(Some(block)) => Ok(block
                    .data
                    .chunks(4)
                    .map(|c| {
                        c.iter()
                            .enumerate()
                            .fold(0u64, |acc, (i, &x)| acc | ((x as u64) << (16 * i)))
                            as i64
                    })
                    .collect()),
                _ => Err(self.error(format!("{what}: rank {r} sent no values"))),
            })
            .collect()
    }
}
