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

use fusion_compiler::hir::{Communication, Transport};

pub use fabric::{Block, Deposit, Fabric, LocalFabric, SlotKey};

use crate::comm::{Capabilities, Communicator};
use crate::device::StreamHandle;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Where a rank sits: its index and the size of its (sub-)world, the key space of that
/// world on the fabric, and its rank in the launched world (named in failure reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Membership {
    /// The rank in its (sub-)world.
    pub rank: usize,
    /// Ranks in that world.
    pub size: usize,
    /// The world's key space on the fabric (0: the launched world).
    pub space: u64,
    /// The rank in the launched world.
    pub world_rank: usize,
}

impl Membership {
    /// Rank `rank` of a world of `size` that is the whole launched world (space 0).
    pub fn whole(rank: usize, size: usize) -> Membership {
        Membership {
            rank,
            size,
            space: 0,
            world_rank: rank,
        }
    }
}

/// One rank's endpoint to a [`Fabric`].
#[derive(Debug)]
pub struct LocalCommunicator {
    fabric: Arc<dyn Fabric>,
    member: Membership,
    rank: usize,
    /// Next sequence number per team (the team as written in the collective).
    sequences: Mutex<HashMap<Vec<usize>, u64>>,
    /// Receives deferred to `group_end`, in issue order; `None` outside a group.
    group: Mutex<Option<Vec<(usize, Tensor)>>>,
}

impl LocalFabric {
    /// The endpoint of rank `rank` (a rank outside the world gets one whose calls fail).
    pub fn communicator(self: &Arc<Self>, rank: usize) -> LocalCommunicator {
        LocalCommunicator::new(
            Arc::clone(self) as Arc<dyn Fabric>,
            Membership::whole(rank, self.world_size()),
        )
    }
}

impl LocalCommunicator {
    /// The endpoint of `member` on `fabric`.
    pub fn new(fabric: Arc<dyn Fabric>, member: Membership) -> Self {
        crate::counters::communicators_created(1);
        LocalCommunicator {
            fabric,
            member,
            rank: member.rank,
            sequences: Mutex::new(HashMap::new()),
            group: Mutex::new(None),
        }
    }

    /// The fabric this endpoint belongs to.
    pub fn fabric(&self) -> &Arc<dyn Fabric> {
        &self.fabric
    }

    /// Where this endpoint's rank sits.
    pub fn membership(&self) -> Membership {
        self.member
    }

    fn world_size_(&self) -> usize {
        self.member.size
    }

    /// A rendezvous of `members` (ranks of this world) in a key space of their own
    /// (`tag`), each giving `data`; returns every member's data in `members` order.
    /// Every member must call it with the same `tag` and `members`, in the same order
    /// relative to its other such calls.
    pub fn share(&self, tag: &str, members: &[usize], data: Block) -> Result<Vec<Block>> {
        self.check_rank()?;
        let mut team: Vec<usize> = vec![usize::MAX];
        team.extend_from_slice(members);
        let seq = self.next_sequence(&team);
        let what = format!("{tag} #{seq} among ranks {members:?}");
        let deposit = Deposit {
            signature: tag.to_string(),
            contribution: Ok(Some(Arc::new(data))),
        };
        let key = SlotKey {
            space: self.member.space,
            team,
            seq,
        };
        let deposits = self
            .fabric
            .rendezvous(self.rank, &key, members, deposit, &what)?;
        deposits
            .into_iter()
            .map(|(r, d)| {
                if d.signature != tag {
                    return Err(
                        self.error(format!("{what}: rank {r} called {} instead", d.signature))
                    );
                }
                match d.contribution {
                    Ok(Some(b)) => Ok(Arc::unwrap_or_clone(b)),
                    _ => Err(self.error(format!("{what}: rank {r} gave nothing"))),
                }
            })
            .collect()
    }

    /// [`Self::share`] of raw bytes (each byte travels as one exact f32).
    pub fn share_bytes(&self, tag: &str, members: &[usize], bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let block = Block {
            shape: vec![bytes.len()],
            data: bytes.iter().map(|&b| b as f32).collect(),
        };
        Ok(self
            .share(tag, members, block)?
            .into_iter()
            .map(|b| b.data.iter().map(|&x| x as u8).collect())
            .collect())
    }

    fn error(&self, reason: impl Into<String>) -> Error {
        Error::Communication {
            rank: self.rank,
            reason: reason.into(),
        }
    }

    fn check_rank(&self) -> Result<()> {
        if self.rank >= self.world_size_() {
            return Err(self.error(format!(
                "rank {} is outside the world of {} ranks",
                self.rank,
                self.world_size_()
            )));
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize, what: &str) -> Result<()> {
        self.check_rank()?;
        if peer == self.rank {
            return Err(self.error(format!("{what} with itself (peer {peer})")));
        }
        if peer >= self.world_size_() {
            return Err(self.error(format!(
                "{what} with peer {peer}, outside the world of {} ranks",
                self.world_size_()
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
        let msg = self.fabric.take(self.member.space, peer, self.rank)?;
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

    fn capabilities(&self) -> &Capabilities {
        static SIMULATED: std::sync::OnceLock<Capabilities> = std::sync::OnceLock::new();
        SIMULATED.get_or_init(Capabilities::simulated)
    }

    fn world_size(&self) -> usize {
        self.world_size_()
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
        if let Some(r) = comm.team.iter().find(|&&r| r >= self.world_size_()) {
            return Err(self.error(format!(
                "{kind} on team {:?}: rank {r} is outside the world of {} ranks",
                comm.team,
                self.world_size_()
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
        let key = SlotKey {
            space: self.member.space,
            team: comm.team.clone(),
            seq,
        };
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
        _transport: Transport,
    ) -> Result<()> {
        self.check_peer(peer, "send")?;
        let data = buf
            .to_f32_vec()
            .map_err(|e| self.error(format!("send to rank {peer}: {e}")))?;
        let block = Block {
            shape: buf.shape().to_vec(),
            data,
        };
        self.fabric.post(self.member.space, self.rank, peer, block)
    }

    fn recv(
        &self,
        _stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        _transport: Transport,
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
        self.fabric.fail(self.member.world_rank, reason);
    }

    fn abort_for(&self, failed_rank: usize, reason: &str) {
        self.fabric.fail(failed_rank, reason);
    }

    fn recover(&self) -> Result<()> {
        if self.member.space != 0 {
            return Err(self.error(
                "a world split from another recovers with it: recover the world it was \
                 split from, then split it again",
            ));
        }
        self.fabric.recover(self.member.world_rank)?;
        self.sequences
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        *self.group.lock().unwrap_or_else(PoisonError::into_inner) = None;
        Ok(())
    }

    fn host_allgather(&self, block: Block) -> Result<Vec<Block>> {
        let members: Vec<usize> = (0..self.world_size_()).collect();
        self.share("host allgather", &members, block)
    }

    fn exchange(&self, values: &[i64]) -> Result<Vec<Vec<i64>>> {
        self.check_rank()?;
        // Exchanges meet on their own key space (the empty team), in call order.
        let seq = self.next_sequence(&[]);
        let what = format!("metadata exchange #{seq}");
        let members: Vec<usize> = (0..self.world_size_()).collect();
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
        let key = SlotKey {
            space: self.member.space,
            team: Vec::new(),
            seq,
        };
        let deposits = self
            .fabric
            .rendezvous(self.rank, &key, &members, deposit, &what)?;
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
