//! The CUDA communicator (one thread per GPU of this process; the world may span
//! processes and hosts): NCCL for collectives and NCCL P2P, the copy engines for the
//! transfers a program lowers onto them.
//!
//! Every call enqueues on the stream the host program chose. The world communicator comes
//! from `ncclCommInitAll` (every rank in this process) or `ncclCommInitRank` with the
//! unique id rank 0 shared at bootstrap; a team that is not the whole world gets its own
//! communicator the first time it is used, from a unique id its first member makes and
//! shares with the others through the host-side endpoints. A transfer runs on the
//! transport its node names: the world decided when it was made whether its pairs have
//! copy engines (`world::routes`), and the executor lowered the program accordingly.
//! NCCL needs contiguous buffers laid out block by block, so views that are not get a
//! staging buffer and a copy kernel on the same stream. Scatter and Gather, which NCCL
//! lacks, are grouped sends and receives.

use std::ffi::c_void;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::nccl::result as nccl;
use fusion_compiler::hir::{Communication, CommunicationKind, Transport};
use fusion_compiler::ir::ReduceOp;
use fusion_compiler::DType;

use super::copy_engine::{CopyEngine, Transfer};
use super::nccl::{
    id_bytes, id_from_bytes, init_rank, nccl_dtype, nccl_err, nccl_op, unique_id, NcclRankState,
    RawComm,
};
use super::nccl_graphs::GraphFence;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::comm::local::LocalCommunicator;
use crate::comm::{is_peer_copy, Capabilities, Communicator, KeptReceives, PeerCopies};
use crate::device::{Device, Kernel, StreamHandle};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// `t` with axis `axis` moved to the front.
fn axis_first(t: &Tensor, axis: usize) -> Result<Tensor> {
    let mut perm = vec![axis];
    perm.extend((0..t.rank()).filter(|&d| d != axis));
    t.permute(&perm)
}

/// One rank's endpoint in a CUDA world: NCCL for collectives and NCCL P2P, the copy
/// engines for transfers the program lowers onto them.
pub struct CudaCommunicator {
    rank: usize,
    world_size: usize,
    device: Arc<CudaDevice>,
    state: Arc<NcclRankState>,
    host: Arc<LocalCommunicator>,
    health: Arc<WorldHealth>,
    copy_engine: CopyEngine,
    group: Mutex<Option<Group>>,
    /// See [`Communicator::instance`].
    instance: u64,
    /// The last graph launch, which NCCL calls outside graphs wait for.
    graph_fence: GraphFence,
    /// What the next send or receive is in the program (see
    /// [`Communicator::describe_next_transfer`]); taken by that send or receive.
    next_label: Mutex<Option<Arc<str>>>,
    /// What this communicator can do (see [`Communicator::capabilities`]).
    capabilities: Capabilities,
}

/// Work that must happen after a group's transfers are issued.
#[derive(Default)]
struct Group {
    /// (stream, staging buffer, destination view): copies after receives.
    after: Vec<(StreamHandle, Tensor, Tensor)>,
    /// Buffers that must stay alive until the group is issued.
    keep: Vec<Tensor>,
    /// Copy-engine transfers, issued at the group's end.
    copies: Vec<Transfer>,
}

/// One collective on NCCL: its stream, the communication, the team's communicator and
/// this rank's buffers.
#[derive(Clone, Copy)]
struct NcclOp<'a> {
    s: StreamHandle,
    c: &'a Communication,
    comm: RawComm,
    stream: cudarc::nccl::sys::cudaStream_t,
    input: Option<&'a Tensor>,
    output: Option<&'a Tensor>,
}

impl NcclOp<'_> {
    /// The buffer `t` (this rank's input or output), or an error saying it is missing.
    fn need(&self, t: Option<&Tensor>, what: &str, comm: &CudaCommunicator) -> Result<Tensor> {
        t.cloned()
            .ok_or_else(|| comm.err(format!("{}: this rank has no {what}", self.c.kind.name())))
    }
}

impl CudaCommunicator {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        world_size: usize,
        device: Arc<CudaDevice>,
        state: Arc<NcclRankState>,
        host: Arc<LocalCommunicator>,
        health: Arc<WorldHealth>,
        copy_engine: CopyEngine,
        peer_copies: PeerCopies,
        transports: Vec<String>,
    ) -> Self {
        crate::counters::communicators_created(1);
        let kept = copy_engine.kept_receives();
        let capabilities = Capabilities {
            peer_copies,
            capture: copy_engine.capture_support(),
            shared_receives: copy_engine.has_ipc_peers(),
            kept_receives: kept.map(|k| k as Arc<dyn KeptReceives>),
            transports,
        };
        CudaCommunicator {
            rank,
            world_size,
            device,
            state,
            host,
            health,
            copy_engine,
            group: Mutex::new(None),
            instance: crate::comm::next_instance(),
            graph_fence: GraphFence::new(),
            next_label: Mutex::new(None),
            capabilities,
        }
    }

    /// A copy-engine transfer: deferred to the group's end, or issued now.
    fn copy_transfer(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        sending: bool,
    ) -> Result<()> {
        if peer == self.rank || peer >= self.world_size {
            return Err(self.err(format!("copy-engine transfer with rank {peer}: not a peer")));
        }
        if !self.by_copy_engine(peer) {
            return Err(self.err(format!(
                "the program asks for a copy-engine transfer with rank {peer}, which this \
                 world reaches through NCCL (its transports: {}); run it through the \
                 executor, which lowers onto the world's transports, or lower with \
                 LowerOptions::transports.p2p = Nccl",
                self.capabilities.transports.join("; ")
            )));
        }
        let label = self
            .next_label
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let t = self
            .copy_engine
            .transfer(stream, peer, buf, sending, label)?;
        let mut group = self.group.lock().unwrap_or_else(PoisonError::into_inner);
        match group.as_mut() {
            Some(g) => {
                g.copies.push(t);
                Ok(())
            }
            None => {
                drop(group);
                self.copy_engine.run_group(&[t])
            }
        }
    }

    /// Drops the description of a send or receive that NCCL carries (it is for copy-engine
    /// transfers only; a later collective's transfers must not take it).
    fn forget_label(&self) {
        self.next_label
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    /// Whether the copy engines reach `peer` (a GPU of this process, or of another process
    /// of this host over CUDA IPC).
    fn by_copy_engine(&self, peer: usize) -> bool {
        self.copy_engine.reaches_in_process(peer) || self.copy_engine.reaches_over_ipc(peer)
    }

    fn err(&self, reason: String) -> Error {
        Error::Communication {
            rank: self.rank,
            reason,
        }
    }

    fn nccl_err(&self, what: &str, e: nccl::NcclError) -> Error {
        nccl_err(&format!("rank {}: {what}", self.rank), e)
    }

    /// The communicator of `team` (the world's when the team is every device in order).
    fn comm(&self, team: &[usize]) -> Result<(RawComm, usize)> {
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

    fn stream(&self, s: StreamHandle) -> Result<cudarc::nccl::sys::cudaStream_t> {
        Ok(self.device.raw_stream(s)?.0 as cudarc::nccl::sys::cudaStream_t)
    }

    /// `t` if contiguous, else a contiguous copy enqueued on `s`.
    fn contiguous(&self, s: StreamHandle, t: &Tensor) -> Result<Tensor> {
        if t.is_contiguous() {
            return Ok(t.clone());
        }
        let c = self.device.allocate(s, t.dtype(), t.shape())?;
        self.device.execute(s, Kernel::Copy { src: t, dst: &c })?;
        Ok(c)
    }

    /// A contiguous buffer to receive into for `dst`, and whether it must be copied back.
    fn receive_buffer(&self, s: StreamHandle, dst: &Tensor) -> Result<(Tensor, bool)> {
        if dst.is_contiguous() {
            return Ok((dst.clone(), false));
        }
        Ok((self.alloc_receive(s, dst.dtype(), dst.shape())?, true))
    }

    /// A buffer peers write into (shareable with other processes where they are).
    fn alloc_receive(&self, s: StreamHandle, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        if self.copy_engine.has_ipc_peers() {
            self.device.allocate_shared(s, dtype, shape)
        } else {
            self.device.allocate(s, dtype, shape)
        }
    }

    /// A buffer a copy-engine collective receives into: kept from call to call where the
    /// copy engine keeps receive buffers ([`Communicator::landing_buffer`]).
    fn ce_alloc_receive(&self, s: StreamHandle, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        match self.copy_engine.landing_buffer(s, dtype, shape)? {
            Some(t) => Ok(t),
            None => self.alloc_receive(s, dtype, shape),
        }
    }

    fn copy_back(&self, s: StreamHandle, staged: &Tensor, dst: &Tensor) -> Result<()> {
        self.device.execute(s, Kernel::Copy { src: staged, dst })
    }

    fn ptr(t: &Tensor) -> *mut c_void {
        t.device_ptr()
            .map_or(std::ptr::null_mut(), |p| p as *mut c_void)
    }

    fn squeeze(&self, t: &Tensor, axis: Option<usize>, what: &str) -> Result<Tensor> {
        match axis {
            Some(a) => t.squeeze(a).map_err(|e| self.err(format!("{what}: {e}"))),
            None => Ok(t.clone()),
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
        let me = c
            .team
            .iter()
            .position(|&r| r == self.rank)
            .expect("in team");
        self.device.execute(
            s,
            Kernel::Copy {
                src: &x.reshape(buf.select(0, me)?.shape())?,
                dst: &buf.select(0, me)?,
            },
        )?;
        let mut transfers = Vec::new();
        for (i, &peer) in c.team.iter().enumerate() {
            if peer != self.rank {
                transfers.push(self.copy_engine.transfer(s, peer, &x, true, None)?);
                transfers.push(self.copy_engine.transfer(
                    s,
                    peer,
                    &buf.select(0, i)?,
                    false,
                    None,
                )?);
            }
        }
        self.copy_engine.run_group(&transfers)?;
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
        let op = c
            .reduce_op
            .ok_or_else(|| self.err("ReduceScatter without a reduce op".into()))?;
        let x = self.squeeze(input, c.in_sharded_axis, "ReduceScatter")?;
        let sa = c
            .in_scatter_axis
            .ok_or_else(|| self.err("ReduceScatter without a scatter axis".into()))?;
        let sa = match c.in_sharded_axis {
            Some(a) if sa > a => sa - 1,
            _ => sa,
        };
        let blocks = self.contiguous(s, &axis_first(&x, sa)?)?;
        let me = c
            .team
            .iter()
            .position(|&r| r == self.rank)
            .expect("in team");
        let slots = self.ce_alloc_receive(s, blocks.dtype(), blocks.shape())?;
        self.device.execute(
            s,
            Kernel::Copy {
                src: &blocks.select(0, me)?,
                dst: &slots.select(0, me)?,
            },
        )?;
        let mut transfers = Vec::new();
        for (i, &peer) in c.team.iter().enumerate() {
            if peer != self.rank {
                transfers.push(self.copy_engine.transfer(
                    s,
                    peer,
                    &blocks.select(0, i)?,
                    true,
                    None,
                )?);
                transfers.push(self.copy_engine.transfer(
                    s,
                    peer,
                    &slots.select(0, i)?,
                    false,
                    None,
                )?);
            }
        }
        self.copy_engine.run_group(&transfers)?;
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

    fn run_collective(
        &self,
        s: StreamHandle,
        c: &Communication,
        input: Option<&Tensor>,
        output: Option<&Tensor>,
    ) -> Result<()> {
        if is_peer_copy(c.transport)
            && matches!(
                c.kind,
                CommunicationKind::Allgather | CommunicationKind::ReduceScatter
            )
        {
            return self.copy_engine_collective(s, c, input, output);
        }
        let (comm, _) = self.comm(&c.team)?;
        let call = NcclOp {
            s,
            c,
            comm,
            stream: self.stream(s)?,
            input,
            output,
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

    /// Allgather or ReduceScatter over the copy engines: every member of the team must be
    /// one the copy engines reach (the world's transports say so when it lowers).
    fn copy_engine_collective(
        &self,
        s: StreamHandle,
        c: &Communication,
        input: Option<&Tensor>,
        output: Option<&Tensor>,
    ) -> Result<()> {
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
        let (Some(i), Some(o)) = (input, output) else {
            return Err(self.err(format!(
                "{kind} over the copy engines needs an input and an output on every rank"
            )));
        };
        match c.kind {
            CommunicationKind::Allgather => self.ce_allgather(s, c, i, o),
            _ => self.ce_reduce_scatter(s, c, i, o),
        }
    }

    /// Allgather on NCCL: every block of the output in one call.
    fn nccl_all_gather(&self, call: &NcclOp<'_>) -> Result<()> {
        let NcclOp {
            s,
            c,
            comm,
            stream,
            input,
            output,
        } = *call;
        let kind = c.kind.name();
        let need = |t: Option<&Tensor>, what: &str| call.need(t, what, self);
        let x = self.contiguous(
            s,
            &self.squeeze(&need(input, "input")?, c.in_sharded_axis, kind)?,
        )?;
        let out = need(output, "output")?;
        let o = c.out_sharded_axis.or(c.in_sharded_axis).unwrap_or(0);
        let view = axis_first(&out, o)?;
        let (buf, back) = self.receive_buffer(s, &view)?;
        // SAFETY: `x` has `numel` elements, `buf` D times as many, both contiguous.
        unsafe {
            nccl::all_gather(
                Self::ptr(&x),
                Self::ptr(&buf),
                x.numel(),
                nccl_dtype(x.dtype()),
                comm.0,
                stream,
            )
        }
        .map_err(|e| self.nccl_err("ncclAllGather", e))?;
        if back {
            self.copy_back(s, &buf, &view)?;
        }
        Ok(())
    }

    /// Allreduce or Reduce on NCCL (a root outside the mesh contributes the identity).
    fn nccl_reduce(&self, call: &NcclOp<'_>) -> Result<()> {
        let NcclOp {
            s,
            c,
            comm,
            stream,
            input,
            output,
        } = *call;
        let kind = c.kind.name();
        let need = |t: Option<&Tensor>, what: &str| call.need(t, what, self);
        let in_mesh = c.mesh.contains(&self.rank);
        let op = c
            .reduce_op
            .ok_or_else(|| self.err(format!("{kind} without a reduce op")))?;
        let out = output.cloned();
        let x = if in_mesh {
            self.contiguous(
                s,
                &self.squeeze(&need(input, "input")?, c.in_sharded_axis, kind)?,
            )?
        } else {
            // A root outside the mesh contributes the identity.
            let like = out
                .clone()
                .ok_or_else(|| self.err(format!("{kind}: root without output")))?;
            self.identity(s, &like, op)?
        };
        let (buf, back) = match &out {
            Some(o) => self.receive_buffer(s, o)?,
            None => (self.device.allocate(s, x.dtype(), x.shape())?, false),
        };
        if buf.numel() != x.numel() {
            return Err(self.err(format!(
                "{kind}: input {:?} and output {:?} differ",
                x.shape(),
                buf.shape()
            )));
        }
        // SAFETY: contiguous buffers of `numel` elements each.
        unsafe {
            if c.kind == CommunicationKind::Allreduce {
                nccl::all_reduce(
                    Self::ptr(&x),
                    Self::ptr(&buf),
                    x.numel(),
                    nccl_dtype(x.dtype()),
                    nccl_op(op),
                    comm.0,
                    stream,
                )
            } else {
                let root = c.team.iter().position(|&r| Some(r) == c.root).unwrap_or(0);
                nccl::reduce(
                    Self::ptr(&x),
                    Self::ptr(&buf),
                    x.numel(),
                    nccl_dtype(x.dtype()),
                    nccl_op(op),
                    root as i32,
                    comm.0,
                    stream,
                )
            }
        }
        .map_err(|e| self.nccl_err(&format!("nccl {kind}"), e))?;
        if let (true, Some(o)) = (back, &out) {
            self.copy_back(s, &buf, o)?;
        }
        Ok(())
    }

    /// ReduceScatter on NCCL.
    fn nccl_reduce_scatter(&self, call: &NcclOp<'_>) -> Result<()> {
        let NcclOp {
            s,
            c,
            comm,
            stream,
            input,
            output,
        } = *call;
        let kind = c.kind.name();
        let need = |t: Option<&Tensor>, what: &str| call.need(t, what, self);
        let op = c
            .reduce_op
            .ok_or_else(|| self.err("ReduceScatter without a reduce op".into()))?;
        let x = self.squeeze(&need(input, "input")?, c.in_sharded_axis, kind)?;
        let sa = c
            .in_scatter_axis
            .ok_or_else(|| self.err("ReduceScatter without a scatter axis".into()))?;
        let sa = match c.in_sharded_axis {
            Some(a) if sa > a => sa - 1,
            _ => sa,
        };
        let x = self.contiguous(s, &axis_first(&x, sa)?)?;
        let out = need(output, "output")?;
        let o = self.squeeze(&out, c.out_sharded_axis, kind)?;
        let (buf, back) = self.receive_buffer(s, &o)?;
        // SAFETY: `x` holds D blocks of `buf.numel()` elements, contiguous.
        unsafe {
            nccl::reduce_scatter(
                Self::ptr(&x),
                Self::ptr(&buf),
                buf.numel(),
                nccl_dtype(x.dtype()),
                nccl_op(op),
                comm.0,
                stream,
            )
        }
        .map_err(|e| self.nccl_err("ncclReduceScatter", e))?;
        if back {
            self.copy_back(s, &buf, &o)?;
        }
        Ok(())
    }

    /// Broadcast on NCCL from the root.
    fn nccl_broadcast(&self, call: &NcclOp<'_>) -> Result<()> {
        let NcclOp {
            s,
            c,
            comm,
            stream,
            input,
            output,
        } = *call;
        let need = |t: Option<&Tensor>, what: &str| call.need(t, what, self);
        let root = c.team.iter().position(|&r| Some(r) == c.root).unwrap_or(0);
        let is_root = c.root == Some(self.rank);
        let x = if is_root {
            Some(self.contiguous(s, &need(input, "input")?)?)
        } else {
            None
        };
        let (buf, back) = match (output, &x) {
            (Some(o), _) => self.receive_buffer(s, o)?,
            (None, Some(x)) => (x.clone(), false),
            (None, None) => {
                return Err(self.err("Broadcast: a non-root rank without output".into()))
            }
        };
        let send = x.as_ref().map_or(Self::ptr(&buf), Self::ptr);
        // SAFETY: contiguous buffers of `buf.numel()` elements.
        unsafe {
            nccl::broadcast(
                send,
                Self::ptr(&buf),
                buf.numel(),
                nccl_dtype(buf.dtype()),
                root as i32,
                comm.0,
                stream,
            )
        }
        .map_err(|e| self.nccl_err("ncclBroadcast", e))?;
        if let (true, Some(o)) = (back, output) {
            self.copy_back(s, &buf, o)?;
        }
        Ok(())
    }

    /// SendRecv: an NCCL send on the sender, a receive on the receiver (a copy when they are one rank).
    fn nccl_send_recv(&self, call: &NcclOp<'_>) -> Result<()> {
        let NcclOp {
            s,
            c,
            comm,
            stream,
            input,
            output,
        } = *call;
        let need = |t: Option<&Tensor>, what: &str| call.need(t, what, self);
        let (sender, receiver) = (
            c.root.unwrap_or(usize::MAX),
            c.receiver.unwrap_or(usize::MAX),
        );
        if sender == receiver {
            if let (Some(i), Some(o)) = (input, output) {
                let src = self.contiguous(s, i)?.reshape(o.shape())?;
                self.device.execute(s, Kernel::Copy { src: &src, dst: o })?;
            }
            return Ok(());
        }
        let peer = |r: usize| c.team.iter().position(|&x| x == r).unwrap_or(0) as i32;
        if self.rank == sender {
            let x = self.contiguous(s, &need(input, "input")?)?;
            // SAFETY: contiguous send buffer.
            unsafe {
                nccl::send(
                    Self::ptr(&x),
                    x.numel(),
                    nccl_dtype(x.dtype()),
                    peer(receiver),
                    comm.0,
                    stream,
                )
            }
            .map_err(|e| self.nccl_err("ncclSend", e))?;
        } else if self.rank == receiver {
            let o = need(output, "output")?;
            let (buf, back) = self.receive_buffer(s, &o)?;
            // SAFETY: contiguous receive buffer.
            unsafe {
                nccl::recv(
                    Self::ptr(&buf),
                    buf.numel(),
                    nccl_dtype(buf.dtype()),
                    peer(sender),
                    comm.0,
                    stream,
                )
            }
            .map_err(|e| self.nccl_err("ncclRecv", e))?;
            if back {
                self.copy_back(s, &buf, &o)?;
            }
        }
        Ok(())
    }

    /// A buffer shaped like `like` filled with the reduction's identity.
    fn identity(&self, s: StreamHandle, like: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let t = self.device.allocate(s, like.dtype(), like.shape())?;
        let value = match op {
            ReduceOp::Sum => 0.0,
            ReduceOp::Max => f32::NEG_INFINITY,
        };
        let host = Tensor::full(&[1], like.dtype(), value);
        let one = self.device.upload(&host)?;
        let src = one.reshape(&[])?.expand(like.shape())?;
        self.device
            .execute(s, Kernel::Copy { src: &src, dst: &t })?;
        Ok(t)
    }

    /// Scatter, which NCCL lacks: grouped sends from the root, a receive elsewhere.
    fn scatter(&self, call: &NcclOp<'_>) -> Result<()> {
        let NcclOp {
            s,
            c,
            comm,
            stream,
            input,
            output,
        } = *call;
        let root = c
            .root
            .ok_or_else(|| self.err("Scatter without a root".into()))?;
        let peer = |r: usize| c.team.iter().position(|&x| x == r).unwrap_or(0) as i32;
        let dt = |t: &Tensor| nccl_dtype(t.dtype());
        let mut after = Vec::new();
        let mut keep = Vec::new();
        nccl::group_start().map_err(|e| self.nccl_err("ncclGroupStart", e))?;
        if self.rank == root {
            let x = input.ok_or_else(|| self.err("Scatter: the root has no input".into()))?;
            let sa = c.in_scatter_axis.unwrap_or(0);
            let blocks = self.contiguous(s, &axis_first(x, sa)?)?;
            for (i, &r) in c.mesh.iter().enumerate() {
                let block = blocks.select(0, i)?;
                if r == self.rank {
                    continue;
                }
                // SAFETY: a contiguous block of the staged input.
                unsafe {
                    nccl::send(
                        Self::ptr(&block),
                        block.numel(),
                        dt(&block),
                        peer(r),
                        comm.0,
                        stream,
                    )
                }
                .map_err(|e| self.nccl_err("ncclSend (scatter)", e))?;
            }
            keep.push(blocks);
        }
        if c.mesh.contains(&self.rank) && self.rank != root {
            let o = self.squeeze(
                output.ok_or_else(|| self.err("Scatter: no output".into()))?,
                c.out_sharded_axis,
                "Scatter",
            )?;
            let (buf, back) = self.receive_buffer(s, &o)?;
            // SAFETY: a contiguous receive buffer.
            unsafe {
                nccl::recv(
                    Self::ptr(&buf),
                    buf.numel(),
                    dt(&buf),
                    peer(root),
                    comm.0,
                    stream,
                )
            }
            .map_err(|e| self.nccl_err("ncclRecv (scatter)", e))?;
            if back {
                after.push((buf, o));
            } else {
                keep.push(buf);
            }
        }
        nccl::group_end().map_err(|e| self.nccl_err("ncclGroupEnd", e))?;
        if self.rank == root && c.mesh.contains(&root) {
            let blocks = &keep[0];
            let i = c
                .mesh
                .iter()
                .position(|&r| r == root)
                .expect("root in mesh");
            let o = self.squeeze(
                output.ok_or_else(|| self.err("Scatter: no output".into()))?,
                c.out_sharded_axis,
                "Scatter",
            )?;
            self.device.execute(
                s,
                Kernel::Copy {
                    src: &blocks.select(0, i)?,
                    dst: &o,
                },
            )?;
        }
        for (buf, o) in after {
            self.copy_back(s, &buf, &o)?;
        }
        Ok(())
    }

    /// Gather, which NCCL lacks: grouped receives on the root, a send elsewhere.
    fn gather(&self, call: &NcclOp<'_>) -> Result<()> {
        let NcclOp {
            s,
            c,
            comm,
            stream,
            input,
            output,
        } = *call;
        let root = c
            .root
            .ok_or_else(|| self.err("Gather without a root".into()))?;
        let peer = |r: usize| c.team.iter().position(|&x| x == r).unwrap_or(0) as i32;
        let mut keep = Vec::new();
        let staged = if self.rank == root {
            let out = output.ok_or_else(|| self.err("Gather: the root has no output".into()))?;
            let o = c.out_sharded_axis.or(c.in_sharded_axis).unwrap_or(0);
            let view = axis_first(out, o)?;
            Some((self.receive_buffer(s, &view)?, view))
        } else {
            None
        };
        let x = if c.mesh.contains(&self.rank) {
            Some(self.contiguous(
                s,
                &self.squeeze(
                    input.ok_or_else(|| self.err("Gather: no input".into()))?,
                    c.in_sharded_axis,
                    "Gather",
                )?,
            )?)
        } else {
            None
        };
        nccl::group_start().map_err(|e| self.nccl_err("ncclGroupStart", e))?;
        if let Some(((buf, _), _)) = &staged {
            for (i, &r) in c.mesh.iter().enumerate() {
                if r == self.rank {
                    continue;
                }
                let block = buf.select(0, i)?;
                // SAFETY: a contiguous block of the receive buffer.
                unsafe {
                    nccl::recv(
                        Self::ptr(&block),
                        block.numel(),
                        nccl_dtype(block.dtype()),
                        peer(r),
                        comm.0,
                        stream,
                    )
                }
                .map_err(|e| self.nccl_err("ncclRecv (gather)", e))?;
            }
        }
        if let (Some(x), false) = (&x, self.rank == root) {
            // SAFETY: a contiguous send buffer.
            unsafe {
                nccl::send(
                    Self::ptr(x),
                    x.numel(),
                    nccl_dtype(x.dtype()),
                    peer(root),
                    comm.0,
                    stream,
                )
            }
            .map_err(|e| self.nccl_err("ncclSend (gather)", e))?;
            keep.push(x.clone());
        }
        nccl::group_end().map_err(|e| self.nccl_err("ncclGroupEnd", e))?;
        if let Some(((buf, back), view)) = staged {
            if let Some(x) = &x {
                let i = c
                    .mesh
                    .iter()
                    .position(|&r| r == root)
                    .expect("root in mesh");
                self.device.execute(
                    s,
                    Kernel::Copy {
                        src: x,
                        dst: &buf.select(0, i)?,
                    },
                )?;
            }
            if back {
                self.copy_back(s, &buf, &view)?;
            }
        }
        Ok(())
    }
}

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
        self.run_collective(stream, comm, input, output)
    }

    fn send(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        transport: Transport,
    ) -> Result<()> {
        if is_peer_copy(transport) {
            return self.copy_transfer(stream, peer, buf, true);
        }
        self.forget_label();
        if peer == self.rank || peer >= self.world_size {
            return Err(self.err(format!("send to rank {peer}: not a peer")));
        }
        let (comm, _) = self.comm(&(0..self.world_size).collect::<Vec<_>>())?;
        let x = self.contiguous(stream, buf)?;
        let s = self.stream(stream)?;
        // SAFETY: a contiguous send buffer, kept alive until the group is issued.
        unsafe {
            nccl::send(
                Self::ptr(&x),
                x.numel(),
                nccl_dtype(x.dtype()),
                peer as i32,
                comm.0,
                s,
            )
        }
        .map_err(|e| self.nccl_err("ncclSend", e))?;
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

    fn recv(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        transport: Transport,
    ) -> Result<()> {
        if is_peer_copy(transport) {
            return self.copy_transfer(stream, peer, buf, false);
        }
        self.forget_label();
        if peer == self.rank || peer >= self.world_size {
            return Err(self.err(format!("recv from rank {peer}: not a peer")));
        }
        let (comm, _) = self.comm(&(0..self.world_size).collect::<Vec<_>>())?;
        let (staged, back) = self.receive_buffer(stream, buf)?;
        let s = self.stream(stream)?;
        // SAFETY: a contiguous receive buffer, kept alive until the group is issued.
        unsafe {
            nccl::recv(
                Self::ptr(&staged),
                staged.numel(),
                nccl_dtype(staged.dtype()),
                peer as i32,
                comm.0,
                s,
            )
        }
        .map_err(|e| self.nccl_err("ncclRecv", e))?;
        let mut group = self.group.lock().unwrap_or_else(PoisonError::into_inner);
        match (group.as_mut(), back) {
            (Some(g), true) => g.after.push((stream, staged, buf.clone())),
            (Some(g), false) => g.keep.push(staged),
            (None, true) => self.copy_back(stream, &staged, buf)?,
            (None, false) => {}
        }
        Ok(())
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

    fn describe_next_transfer(&self, what: &dyn Fn() -> String) {
        *self
            .next_label
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(what().into());
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

    fn exchange(&self, values: &[i64]) -> Result<Vec<Vec<i64>>> {
        self.host.exchange(values)
    }

    fn capabilities(&self) -> &Capabilities {
        &self.capabilities
    }

    fn graph_launched(&self) -> Result<()> {
        if self.state.unavailable.is_some() {
            return Ok(());
        }
        self.graph_fence.launched();
        Ok(())
    }

    fn begin_call(&self, call: &crate::comm::CallStart) -> Result<()> {
        self.copy_engine.begin_call(call);
        Ok(())
    }

    fn instance(&self) -> u64 {
        self.instance
    }

    fn host_allgather(&self, block: crate::comm::Block) -> Result<Vec<crate::comm::Block>> {
        self.host.host_allgather(block)
    }
}
