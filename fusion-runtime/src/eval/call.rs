//! What a call of the interpreter takes besides the program ([`CallContext`]) and what it
//! gives back ([`Execution`]: outputs, statistics, and the timelines of a traced call).

use fusion_compiler::hir::NodeKind;
use fusion_compiler::ir::TensorId;

use super::race::RaceCheck;
use crate::comm::Communicator;
use crate::device::Device;
use crate::streams::{StreamHandle, StreamLayout};
use crate::tensor::Tensor;

/// What one call did: allocations and memory high-water mark (bytes of buffers the call
/// allocated and had not yet released).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Buffers the call allocated.
    pub allocations: usize,
    /// Their bytes, in all.
    pub allocated_bytes: usize,
    /// The most bytes of them alive at once.
    pub peak_live_bytes: usize,
    /// Nodes run, loops and branches included, every iteration counted.
    pub nodes_executed: usize,
    /// Host time per kind of leaf node (not loops or branches), indexed by
    /// `NodeKind as usize`: where the interpreter's time goes (see [`Self::host_profile`]).
    pub host_by_kind: [HostTime; NodeKind::ALL.len()],
    /// A replayed call: the host time from the call's start to its graph launch (finding
    /// the program, allocating the outputs, matching the addresses), count 1.
    pub replay_setup: HostTime,
    /// A replayed call: the host time of its one graph launch (count 1), so that a call's
    /// host time splits into the setup, the launch and what follows.
    pub graph_launch: HostTime,
    /// A replayed call: the nodes of the graph it launched.
    pub graph_nodes: usize,
    /// A replayed call: `replay_setup` phase by phase.
    pub replay_phases: ReplayPhases,
}

/// Where a replayed call's host time before its graph launch goes, in nanoseconds: what
/// to shorten when calls are host-bound (e.g. eager decode steps).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplayPhases {
    /// Finding the call's fusion and lowered program, binding its dimensions (a steady
    /// call: matching its signature to a recent call's, which brings program and plan).
    pub program: u64,
    /// Entering the world's call ledger.
    pub ledger: u64,
    /// Finding the plan the call runs (0 for a steady call).
    pub plan: u64,
    /// The program's facts and the communicator's start of the call.
    pub begin: u64,
    /// The graph slot, the outputs and matching the call's addresses to a graph.
    pub slot: u64,
    /// Ordering the replay after the caller's stream.
    pub join: u64,
}

/// Host time spent on one kind of host-IR node during a call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTime {
    /// How many nodes of the kind ran.
    pub count: u32,
    /// Their host time, in all.
    pub nanos: u64,
}

impl ExecStats {
    /// The node kinds that ran, with their host time, most expensive first.
    pub fn host_profile(&self) -> Vec<(NodeKind, HostTime)> {
        let mut v: Vec<(NodeKind, HostTime)> = NodeKind::ALL
            .iter()
            .zip(self.host_by_kind)
            .filter(|(_, h)| h.count > 0)
            .map(|(&k, h)| (k, h))
            .collect();
        v.sort_by_key(|h| std::cmp::Reverse(h.1.nanos));
        v
    }
}

/// Everything a call needs besides the program.
pub struct CallContext<'a> {
    /// The calling rank's device.
    pub device: &'a dyn Device,
    /// The calling rank's communicator.
    pub comm: &'a dyn Communicator,
    /// The calling rank.
    pub rank: usize,
    /// The size of the worker stream pool (`numberOfStreams`).
    pub number_of_streams: usize,
    /// Record a timeline of communications and kernels (synchronizes at the end).
    pub trace: bool,
    /// Allocate the buffers peers copy into with [`DeviceLifecycle::allocate_shared`](crate::device::DeviceLifecycle::allocate_shared) (a launched
    /// world whose peers in other processes write into them).
    pub shared_receives: bool,
    /// The program's buffers that peers copy into and that it allocates itself
    /// ([`PeerCopyReceives::internal`](super::PeerCopyReceives::internal)): asked of the
    /// communicator's kept receive buffers ([`crate::comm::Capabilities::kept_receives`])
    /// first, so they are the same memory at every call.
    pub kept_receives: Option<&'a std::collections::HashSet<TensorId>>,
    /// Also record a host-side span for every node the call executes ([`HostSpan`]).
    pub trace_nodes: bool,
    /// Check the program's stream order ([`race`](super::race)): a race fails the call.
    pub race_check: bool,
}

impl CallContext<'_> {
    /// How the call numbers its streams: the main stream, `number_of_streams` pool streams,
    /// then the compute streams.
    pub fn streams(&self) -> StreamLayout {
        StreamLayout::new(self.number_of_streams)
    }
}

/// One interval of a traced call, in milliseconds from the call's start on this device.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// What ran: `Allgather`, `P2P group`, `Matmul`, ...
    pub name: String,
    /// Whether it moved data between devices (versus computing).
    pub communication: bool,
    /// The stream it ran on.
    pub stream: StreamHandle,
    /// The stream-loop index it belonged to, if any.
    pub chunk: Option<i64>,
    /// When it started.
    pub start_ms: f64,
    /// When it ended.
    pub end_ms: f64,
    /// The node that issued it (its pre-order index in the program), when the call
    /// traced its nodes.
    pub node: Option<usize>,
}

/// The host side of one executed node of a traced call: when the rank's thread ran it,
/// in milliseconds from the call's start on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct HostSpan {
    /// The node's pre-order index in the program (`for_each_node` order), so every
    /// execution of a loop body's node has the same id.
    pub node: usize,
    /// The node's kind.
    pub kind: NodeKind,
    /// The stream current when the node started.
    pub stream: StreamHandle,
    /// The stream-loop index it ran in, if any.
    pub chunk: Option<i64>,
    /// When the thread started it.
    pub start_ms: f64,
    /// When the thread finished it.
    pub end_ms: f64,
}

/// What one call returns: outputs, statistics, and the timelines when traced.
pub struct Execution {
    /// The outputs, in order (placeholders where this rank holds none).
    pub outputs: Vec<Tensor>,
    /// What the call did.
    pub stats: ExecStats,
    /// The device intervals, when traced.
    pub trace: Option<Vec<TraceEvent>>,
    /// One span per executed node, when `CallContext::trace_nodes` is set.
    pub host_trace: Option<Vec<HostSpan>>,
    /// The happens-before order of the call's accesses, when race checking.
    pub race: Option<RaceCheck>,
}
