//! The host program: what runs on each device's host thread to drive streams,
//! allocations, compute and communication.
//!
//! One node set. Nodes reference tensors and scalars of the
//! program's own arena ([`HostProgram::ir`]); SSA holds: a slice is a new tensor aliasing
//! its parent, and no tensor has two defining nodes (except that `Allocate` of a tensor
//! already bound, e.g. to a slice, is a no-op, as in nvFuser).

use crate::error::Result;
use crate::ir::{DeviceMesh, Epilogue, Expr, Fusion, IterDomainId, ReduceOp, ScalarId, TensorId};

/// Index of a stream value of a host program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub(crate) u32);

impl StreamId {
    /// Position in [`HostProgram::streams`]; also the `N` of `Stream N` in dumps.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Where a stream value comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StreamDef {
    /// Bound by `GetCurrentStream` to the stream current at that point (the caller's).
    Captured,
    /// Worker stream `index` of the pool (`index` is evaluated, usually `i % numberOfStreams`).
    Pool(ScalarId),
    /// Compute stream `index` (below [`COMPUTE_STREAMS`]): streams apart from the pool, for
    /// GEMMs that take turns so that one's tail overlaps the next one's start without ever
    /// queueing behind a pool stream's transfers.
    Compute(ScalarId),
}

/// How many compute streams ([`StreamDef::Compute`]) a device has beside its pool.
pub const COMPUTE_STREAMS: usize = 2;

/// Identifies a communication (or a coalesced group) so that `Wait` can name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CommId(pub(crate) u32);

impl CommId {
    /// The number printed in dumps.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The collective kinds lowering produces (the table in [`crate::resharding`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CommunicationKind {
    Allgather,
    Allreduce,
    ReduceScatter,
    Scatter,
    Gather,
    Broadcast,
    Reduce,
    SendRecv,
}

impl CommunicationKind {
    /// Name in dumps.
    pub fn name(self) -> &'static str {
        match self {
            CommunicationKind::Allgather => "Allgather",
            CommunicationKind::Allreduce => "Allreduce",
            CommunicationKind::ReduceScatter => "ReduceScatter",
            CommunicationKind::Scatter => "Scatter",
            CommunicationKind::Gather => "Gather",
            CommunicationKind::Broadcast => "Broadcast",
            CommunicationKind::Reduce => "Reduce",
            CommunicationKind::SendRecv => "SendRecv",
        }
    }
}

/// Which transport carries a communication (a device kind is `BackendKind`, elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Transport {
    /// NCCL kernels (on the CPU backend: the in-process communicator).
    #[default]
    Nccl,
    /// Peer-to-peer memory copies on the copy engines (no SMs).
    CopyEngine,
    /// Kernels that read and write buffers of every rank mapped into each other's address
    /// space: small collectives in one launch of a few microseconds, with no host work.
    PeerMemory,
}

impl Transport {
    /// Name in dumps: `NCCL`, `CopyEngine` or `PeerMemory`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::Nccl => "NCCL",
            Transport::CopyEngine => "CopyEngine",
            Transport::PeerMemory => "PeerMemory",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which copy streams a rank's copy-engine transfers run on (chosen by
/// `TransportOptions::copy_streams`, kept by the program for the runtime). Neither wins
/// everywhere, so the plan choice tries both (docs/DECISIONS.md, "One copy stream per
/// peer").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum CopyStreams {
    /// A copy stream per peer: the blocks of one collective run on several copy engines
    /// at once.
    #[default]
    PerPeer,
    /// Every copy-engine transfer of the rank on one copy stream, one after another (it
    /// measured faster for AllGather+GEMM at 8192^3 on 4 devices).
    One,
    /// One copy stream, as [`CopyStreams::One`], and a rank's single receives no longer
    /// wait for the previous one to land: the senders' order keeps one inbound copy per
    /// rank at a time (each step of a P2P pipeline pairs the ranks), so the row ranges of a
    /// block land one after another at the link's rate, with no hand-off round trip
    /// between them.
    OneInSendOrder,
}

impl CopyStreams {
    /// Whether every copy of the rank runs on one copy stream.
    pub fn one(self) -> bool {
        matches!(self, CopyStreams::One | CopyStreams::OneInSendOrder)
    }
}

/// A collective between the devices of `team`.
///
/// Axis fields index the *stored* axes of a tensor (reduction axes excluded). Sharded
/// tensors hold one index (size 1) of their DIDx axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Communication {
    pub id: CommId,
    pub kind: CommunicationKind,
    /// Every participating device: the sharded mesh, then the root if it is not in it.
    pub team: Vec<usize>,
    /// The sharded side's devices in DIDx order (the order of chunks along the axis).
    pub mesh: Vec<usize>,
    /// Source of Scatter/Broadcast/SendRecv, destination of Gather/Reduce.
    pub root: Option<usize>,
    pub input: TensorId,
    pub output: TensorId,
    pub reduce_op: Option<ReduceOp>,
    /// What carries it.
    pub transport: Transport,
    /// The input's DIDx axis (gathered or reduced), if it has one.
    pub in_sharded_axis: Option<usize>,
    /// The input axis that is split among the receivers (Scatter, ReduceScatter).
    pub in_scatter_axis: Option<usize>,
    /// The output's DIDx axis, if it has one.
    pub out_sharded_axis: Option<usize>,
    /// For SendRecv: the receiving device.
    pub receiver: Option<usize>,
}

/// Direction of a point-to-point transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum P2PDirection {
    Send,
    Recv,
}

/// A point-to-point transfer of `buffer` with device `peer`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct P2P {
    pub id: CommId,
    pub direction: P2PDirection,
    pub buffer: TensorId,
    pub peer: ScalarId,
    /// What carries it.
    pub transport: Transport,
}

/// `for index in start..stop` over the stream axis `axis`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ForLoop {
    pub index: ScalarId,
    pub axis: IterDomainId,
    pub start: ScalarId,
    pub stop: ScalarId,
    pub body: Vec<Node>,
}

/// Index of a fused segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SegmentId(pub(crate) u32);

impl SegmentId {
    /// Position in [`HostProgram::segments`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// A group of elementwise expressions launched as one kernel. Tensors that are neither
/// inputs nor outputs of the segment never reach memory on backends that fuse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub exprs: Vec<Expr>,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
}

/// Identifies a fused AllGather+GEMM ([`GatheredGemm`]) of a program, so that its ready
/// blocks and its join can name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GatheredGemmId(pub(crate) u32);

impl GatheredGemmId {
    /// The number printed in dumps.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// `output = gathered @ b` as one persistent GEMM that runs while the stream loop after it
/// receives `gathered`'s blocks (`lower::gathered_gemm`): launched before the loop, told by
/// [`Node::RowsReady`] when each peer's block has landed, joined after the loop. Axis 0 of
/// `gathered` and of `output` holds one block per rank (rank order); this rank's block of
/// `gathered` is never written: the GEMM reads `own` in place instead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatheredGemm {
    pub id: GatheredGemmId,
    /// The gathered rows, one block per rank along axis 0.
    pub gathered: TensorId,
    /// This rank's block of rows, where it lives (the local shard).
    pub own: TensorId,
    /// The right operand, the same for every block.
    pub b: TensorId,
    /// The product, one block per rank along axis 0.
    pub output: TensorId,
    /// Row ranges per block, each said ready on its own ([`Node::RowsReady`]'s `piece`), so
    /// the GEMM starts on a block's first rows while its last are still arriving; 1: whole
    /// blocks.
    pub pieces: usize,
    /// What the GEMM applies to each block's product before storing it: a bias `[N]`
    /// (`bias`), at most one activation, and what it does with `aux`.
    pub epilogue: Epilogue,
    /// The epilogue's bias vector, when it has one.
    pub bias: Option<TensorId>,
    /// A gated product: `output = act(rows @ b) * (rows @ up)`, `up` shaped like `b` (the
    /// gated MLP's gate and up weights), `act` the epilogue's activation (no bias).
    pub up: Option<TensorId>,
    /// The epilogue's auxiliary matrix, one block per rank along axis 0 like `output`:
    /// written with the pre-activation, or read by a derivative that multiplies the
    /// product (`epilogue.aux` says which). Never with `up`.
    pub aux: Option<TensorId>,
}

/// `comm.output = Allreduce(gemm)` as one kernel per rank: a GEMM whose epilogue sends
/// each finished tile of its product to every rank and sums the ranks' tiles
/// (`lower::gemm_allreduce`). The product (`gemm.output`, the Allreduce's input) is never
/// stored whole; a device without the kernel runs the GEMM, then the Allreduce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmAllreduce {
    /// A plain product `[m, k] @ [k, n]` (no epilogue, bias or accumulation).
    pub gemm: Expr,
    /// The Allreduce of the product over the whole world, on `Transport::PeerMemory`.
    pub comm: Communication,
    /// A residual add of the sum, `x + comm.output` (either order) with `x` the same on
    /// every rank and shaped like the sum, done in the kernel's last store: its output is
    /// the node's result and `comm.output` is never stored (a device without the kernel
    /// runs the add after the Allreduce, into a buffer of its own for the sum).
    pub residual: Option<Expr>,
}

impl GemmAllreduce {
    /// What the node writes: the residual add's output, else the Allreduce's.
    pub fn result(&self) -> TensorId {
        self.residual
            .as_ref()
            .map_or(self.comm.output, |r| r.output)
    }

    /// The tensor the residual add reads besides the sum.
    pub fn addend(&self) -> Option<TensorId> {
        let r = self.residual.as_ref()?;
        r.inputs.iter().copied().find(|&t| t != self.comm.output)
    }
}

/// `comm.output = ReduceScatter(gemm)` as one kernel per rank: a persistent GEMM whose
/// epilogue adds each finished tile of its partial product into the rank that owns the
/// tile's rows (`lower::gemm_reduce_scatter`). The product (`gemm.output`, the
/// ReduceScatter's input) is never stored whole; a device without the kernel runs the GEMM,
/// then the ReduceScatter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GemmReduceScatter {
    /// A plain product `[m, k] @ [k, n]` (no epilogue, bias or accumulation).
    pub gemm: Expr,
    /// The summing ReduceScatter of the product over the whole world, rank j receiving rows
    /// [j m / D, (j + 1) m / D) of it.
    pub comm: Communication,
}

/// One instruction of a host program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    /// Binds a fresh buffer to `tensor`, unless it is already bound (then a no-op).
    Allocate {
        tensor: TensorId,
    },
    /// Releases `tensor`'s buffer.
    Deallocate {
        tensor: TensorId,
    },
    ForLoop(ForLoop),
    /// Runs `then_body` when `cond` evaluates to non-zero, else `else_body`.
    IfThenElse {
        cond: ScalarId,
        then_body: Vec<Node>,
        else_body: Vec<Node>,
    },
    /// Captures the current stream into `stream`.
    GetCurrentStream {
        stream: StreamId,
    },
    /// Makes `stream` current: later nodes enqueue on it.
    SetCurrentStream {
        stream: StreamId,
    },
    /// The current stream waits for the work enqueued so far on `stream` (event record +
    /// wait; the host does not block).
    Synchronize {
        stream: StreamId,
    },
    /// `output` is a view of `input` at `index` along axis `axis` (an index into `input`'s
    /// `axes`), without that axis.
    AliasSelect {
        input: TensorId,
        output: TensorId,
        axis: usize,
        index: ScalarId,
    },
    Communication(Communication),
    P2P(P2P),
    /// Opens a group of P2P transfers that start together (`ncclGroupStart`).
    StartCoalescing,
    /// Closes the group; `id` names it for `Wait`.
    EndCoalescing {
        id: CommId,
    },
    /// The current stream waits for communication (or group) `comm`.
    Wait {
        comm: CommId,
    },
    /// A compute op on the current stream.
    Compute(Expr),
    /// A fused segment on the current stream.
    Launch {
        segment: SegmentId,
        inputs: Vec<TensorId>,
        outputs: Vec<TensorId>,
    },
    /// Starts a fused AllGather+GEMM on the current stream; nothing after it may make a
    /// stream it waits on (through its ready blocks) wait for this one.
    GatheredGemmLaunch(GatheredGemm),
    /// On the current stream: the block of rank `block` of gathered GEMM `id` has landed,
    /// or with `piece`, that row range of it (of the GEMM's `pieces`); the GEMM may read
    /// those rows from now on.
    RowsReady {
        id: GatheredGemmId,
        block: ScalarId,
        piece: Option<ScalarId>,
    },
    /// The current stream waits for gathered GEMM `id` (its output is whole after it).
    GatheredGemmJoin {
        id: GatheredGemmId,
    },
    /// A GEMM and the Allreduce of its product as one kernel, on the current stream.
    GemmAllreduce(GemmAllreduce),
    /// A GEMM and the ReduceScatter of its product as one kernel, on the current stream.
    GemmReduceScatter(GemmReduceScatter),
}

/// The kind of a node, for structure checks (compute ops are told apart by their op).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeKind {
    Allocate,
    Deallocate,
    ForLoop,
    IfThenElse,
    GetCurrentStream,
    SetCurrentStream,
    Synchronize,
    AliasSelect,
    Communication,
    P2P,
    StartCoalescing,
    EndCoalescing,
    Wait,
    Set,
    Unary,
    Binary,
    Cast,
    Reduction,
    Broadcast,
    Matmul,
    Linear,
    Select,
    Slice,
    Split,
    Launch,
    Permute,
    GatheredGemmLaunch,
    RowsReady,
    GatheredGemmJoin,
    GemmAllreduce,
    GemmReduceScatter,
}

impl NodeKind {
    /// Every kind, in declaration order (`kind as usize` indexes it).
    pub const ALL: [NodeKind; 31] = [
        NodeKind::Allocate,
        NodeKind::Deallocate,
        NodeKind::ForLoop,
        NodeKind::IfThenElse,
        NodeKind::GetCurrentStream,
        NodeKind::SetCurrentStream,
        NodeKind::Synchronize,
        NodeKind::AliasSelect,
        NodeKind::Communication,
        NodeKind::P2P,
        NodeKind::StartCoalescing,
        NodeKind::EndCoalescing,
        NodeKind::Wait,
        NodeKind::Set,
        NodeKind::Unary,
        NodeKind::Binary,
        NodeKind::Cast,
        NodeKind::Reduction,
        NodeKind::Broadcast,
        NodeKind::Matmul,
        NodeKind::Linear,
        NodeKind::Select,
        NodeKind::Slice,
        NodeKind::Split,
        NodeKind::Launch,
        NodeKind::Permute,
        NodeKind::GatheredGemmLaunch,
        NodeKind::RowsReady,
        NodeKind::GatheredGemmJoin,
        NodeKind::GemmAllreduce,
        NodeKind::GemmReduceScatter,
    ];
}

impl Node {
    /// This node's kind.
    pub fn kind(&self) -> NodeKind {
        use crate::ir::Op;
        match self {
            Node::Allocate { .. } => NodeKind::Allocate,
            Node::Deallocate { .. } => NodeKind::Deallocate,
            Node::ForLoop(_) => NodeKind::ForLoop,
            Node::IfThenElse { .. } => NodeKind::IfThenElse,
            Node::GetCurrentStream { .. } => NodeKind::GetCurrentStream,
            Node::SetCurrentStream { .. } => NodeKind::SetCurrentStream,
            Node::Synchronize { .. } => NodeKind::Synchronize,
            Node::AliasSelect { .. } => NodeKind::AliasSelect,
            Node::Communication(_) => NodeKind::Communication,
            Node::P2P(_) => NodeKind::P2P,
            Node::StartCoalescing => NodeKind::StartCoalescing,
            Node::EndCoalescing { .. } => NodeKind::EndCoalescing,
            Node::Wait { .. } => NodeKind::Wait,
            Node::Launch { .. } => NodeKind::Launch,
            Node::GatheredGemmLaunch(_) => NodeKind::GatheredGemmLaunch,
            Node::RowsReady { .. } => NodeKind::RowsReady,
            Node::GatheredGemmJoin { .. } => NodeKind::GatheredGemmJoin,
            Node::GemmAllreduce(_) => NodeKind::GemmAllreduce,
            Node::GemmReduceScatter(_) => NodeKind::GemmReduceScatter,
            Node::Compute(e) => match e.op {
                Op::Set => NodeKind::Set,
                Op::Unary(_) => NodeKind::Unary,
                Op::Binary(_) => NodeKind::Binary,
                Op::Cast => NodeKind::Cast,
                Op::Reduction { .. } => NodeKind::Reduction,
                Op::Broadcast { .. } => NodeKind::Broadcast,
                Op::Matmul | Op::Gemm { linear: false, .. } => NodeKind::Matmul,
                Op::Linear | Op::Gemm { linear: true, .. } => NodeKind::Linear,
                Op::Select { .. } => NodeKind::Select,
                Op::Slice { .. } => NodeKind::Slice,
                Op::Split { .. } => NodeKind::Split,
                Op::Permute { .. } => NodeKind::Permute,
            },
        }
    }

    /// Nested node lists (loop body, if/else branches).
    pub fn children(&self) -> Vec<&Vec<Node>> {
        match self {
            Node::ForLoop(l) => vec![&l.body],
            Node::IfThenElse {
                then_body,
                else_body,
                ..
            } => vec![then_body, else_body],
            _ => vec![],
        }
    }

    /// Tensors this node reads or writes (not counting nested nodes).
    pub fn tensors(&self) -> Vec<TensorId> {
        match self {
            Node::Allocate { tensor } | Node::Deallocate { tensor } => vec![*tensor],
            Node::AliasSelect { input, output, .. } => vec![*input, *output],
            Node::Communication(c) => vec![c.input, c.output],
            Node::P2P(p) => vec![p.buffer],
            Node::Compute(e) => e.inputs.iter().copied().chain([e.output]).collect(),
            Node::Launch {
                inputs, outputs, ..
            } => inputs.iter().chain(outputs).copied().collect(),
            Node::GatheredGemmLaunch(g) => [g.gathered, g.own, g.b, g.output]
                .into_iter()
                .chain(g.bias)
                .chain(g.up)
                .chain(g.aux)
                .collect(),
            Node::GemmAllreduce(g) => g
                .gemm
                .inputs
                .iter()
                .copied()
                .chain(g.addend())
                .chain([g.result()])
                .collect(),
            Node::GemmReduceScatter(g) => g
                .gemm
                .inputs
                .iter()
                .copied()
                .chain([g.comm.output])
                .collect(),
            _ => vec![],
        }
    }
}

/// A lowered program for one fusion, world size and set of options; every rank runs it.
#[derive(Clone, Debug)]
pub struct HostProgram {
    /// The arena: the fusion's tensors plus those lowering created (slices, buffers).
    pub ir: Fusion,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    pub body: Vec<Node>,
    pub streams: Vec<StreamDef>,
    pub segments: Vec<Segment>,
    /// `(output, input)`: the output is written into the input's buffer.
    pub aliases: Vec<(TensorId, TensorId)>,
    /// Number of devices the program was lowered for.
    pub world_size: usize,
    /// Decisions lowering made from the call's shapes, printed as `//` lines under the
    /// program (e.g. whether its stream loops were pipelined, and why).
    pub notes: Vec<String>,
    /// Which copy streams the program's copy-engine transfers run on (what the runtime
    /// tells the communicator at each call; [`CopyStreams::PerPeer`] unless lowering
    /// chose one stream for a program that has copy-engine transfers).
    pub copy_streams: CopyStreams,
    next_comm: u32,
}

impl HostProgram {
    /// An empty program over `ir`'s tensors, with `ir`'s inputs and outputs.
    pub fn new(ir: Fusion, world_size: usize) -> Self {
        HostProgram {
            inputs: ir.inputs().to_vec(),
            outputs: ir.outputs().to_vec(),
            aliases: ir.aliases().to_vec(),
            ir,
            body: Vec::new(),
            streams: Vec::new(),
            segments: Vec::new(),
            world_size,
            notes: Vec::new(),
            copy_streams: CopyStreams::PerPeer,
            next_comm: 0,
        }
    }

    /// A new stream value.
    pub fn new_stream(&mut self, def: StreamDef) -> StreamId {
        let id = StreamId(self.streams.len() as u32);
        self.streams.push(def);
        id
    }

    /// A fresh communication id.
    pub fn new_comm_id(&mut self) -> CommId {
        let id = CommId(self.next_comm);
        self.next_comm += 1;
        id
    }

    /// Registers a fused segment.
    pub fn add_segment(&mut self, s: Segment) -> SegmentId {
        let id = SegmentId(self.segments.len() as u32);
        self.segments.push(s);
        id
    }

    /// Kinds of the top-level nodes, in order.
    pub fn top_level_kinds(&self) -> Vec<NodeKind> {
        self.body.iter().map(Node::kind).collect()
    }

    /// Number of nodes, nested ones included.
    pub fn node_count(&self) -> usize {
        let mut n = 0;
        for_each_node(&self.body, &mut |_| n += 1);
        n
    }

    /// Devices of a tensor's (resolved) mesh.
    pub fn mesh_of(&self, t: TensorId) -> Vec<usize> {
        match &self.ir.tensor(t).mesh {
            DeviceMesh::World => (0..self.world_size).collect(),
            DeviceMesh::Devices(d) => d.clone(),
        }
    }
}

/// Calls `f` on every node, parents before their nested nodes.
pub fn for_each_node(nodes: &[Node], f: &mut dyn FnMut(&Node)) {
    for n in nodes {
        f(n);
        for child in n.children() {
            for_each_node(child, f);
        }
    }
}

/// Calls `f` on every node list (the top level and every nested body), mutably.
pub fn for_each_node_mut(
    nodes: &mut Vec<Node>,
    f: &mut dyn FnMut(&mut Vec<Node>) -> Result<()>,
) -> Result<()> {
    f(nodes)?;
    for n in nodes.iter_mut() {
        match n {
            Node::ForLoop(l) => for_each_node_mut(&mut l.body, f)?,
            Node::IfThenElse {
                then_body,
                else_body,
                ..
            } => {
                for_each_node_mut(then_body, f)?;
                for_each_node_mut(else_body, f)?;
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod kind_tests {
    #[test]
    fn node_kinds_index_their_table() {
        for (i, k) in super::NodeKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i, "{k:?}");
        }
    }
}
