//! Replaying a rank's calls as device graphs: after the first (eager) call of a program,
//! the second is captured (CUDA graphs), and later calls launch the graph once instead of
//! walking the host program.
//!
//! A graph bakes in every address it touches, so a graph is kept per program and rank
//! together with the addresses of the call it captured: the inputs and the outputs (which
//! are allocated before the capture, outside the graph). A call whose inputs or outputs
//! sit elsewhere never replays that graph: it runs eagerly, and when the same new
//! addresses come twice in a row the graph is captured again for them. Stale pointers are
//! never replayed. Loops that drop their outputs before the next call get the same
//! addresses back from the allocator and replay every call.
//!
//! Programs that cannot be captured run eagerly, and [`ReplayStatus::Eager`] says why.

use std::fmt;

use fusion_compiler::hir::{for_each_node, HostProgram, Node};

use crate::comm::is_peer_copy;

use crate::device::{BackendKind, DeviceGraph};
use crate::eval::peer_copy_receives;

/// Why a call ran eagerly rather than from a graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EagerReason {
    /// `ExecOptions::graphs` is off.
    Disabled,
    /// The backend has no graphs (the CPU backend).
    Backend(BackendKind),
    /// The call is traced (its device markers are read after the call).
    Traced,
    /// The call is race-checked (the checker follows the host program as it runs).
    RaceChecked,
    /// The first call of a program runs eagerly: it compiles kernels and creates the
    /// library handles the capture must not create.
    FirstCall,
    /// An input lives on the host: its upload waits for the device.
    HostInput(String),
    /// Outputs alias inputs (written in place): the graph cannot own them.
    AliasedOutputs,
    /// Peer copies (copy-engine transfers) cannot be recorded, for this reason (they land
    /// in memory the caller owns, or the communicator hands them off on the host).
    PeerCopies(String),
    /// The inputs or outputs are not where the graph was captured; a new graph is captured
    /// if the same addresses come again.
    Moved,
    /// Capturing failed (the graph is not used for this program and rank again).
    CaptureFailed(String),
}

impl fmt::Display for EagerReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EagerReason::Disabled => {
                write!(f, "graphs are off (ExecOptions::graphs)")
            }
            EagerReason::Backend(k) => write!(f, "the {} backend has no graphs", k.name()),
            EagerReason::Traced => write!(f, "traced calls run eagerly"),
            EagerReason::RaceChecked => write!(f, "race-checked calls run eagerly"),
            EagerReason::FirstCall => {
                write!(
                    f,
                    "the first call runs eagerly (it compiles kernels and makes handles)"
                )
            }
            EagerReason::HostInput(t) => {
                write!(
                    f,
                    "input {t} is on the host (its upload waits for the device)"
                )
            }
            EagerReason::AliasedOutputs => write!(f, "outputs are written into inputs"),
            EagerReason::PeerCopies(why) => write!(
                f,
                "copy-engine transfers cannot be captured: {why} (lower with \
                 LowerOptions::transports.p2p = Nccl to replay this program)"
            ),
            EagerReason::Moved => write!(f, "the inputs or outputs moved since the capture"),
            EagerReason::CaptureFailed(e) => write!(f, "capturing failed: {e}"),
        }
    }
}

/// How a call ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayStatus {
    /// It walked the host program.
    Eager(EagerReason),
    /// It was captured as a graph of this many nodes, then launched.
    Captured(usize),
    /// It launched the graph captured earlier.
    Replayed,
}

/// Whether `program` could ever be captured on `backend` (what the communicator of a
/// rank allows is asked at run time, see [`crate::comm::Capabilities::capture`]).
pub fn capture_plan(
    program: &HostProgram,
    backend: BackendKind,
) -> std::result::Result<(), EagerReason> {
    if !backend.records_graphs() {
        return Err(EagerReason::Backend(backend));
    }
    if !program.aliases.is_empty() {
        return Err(EagerReason::AliasedOutputs);
    }
    if program.world_size > 1 {
        let receives = peer_copy_receives(program);
        if !receives.all_internal() {
            let names: Vec<String> = receives
                .external
                .iter()
                .map(|&t| program.ir.tensor_name(t))
                .collect();
            return Err(EagerReason::PeerCopies(format!(
                "they land in {}, which the caller owns and may move between calls",
                names.join(", ")
            )));
        }
    }
    Ok(())
}

/// Whether `program` has peer copies between ranks ([`crate::comm::is_peer_copy`]).
pub fn has_peer_copies(program: &HostProgram) -> bool {
    let mut found = false;
    if program.world_size > 1 {
        for_each_node(&program.body, &mut |n| match n {
            Node::P2P(p) if is_peer_copy(p.transport) => found = true,
            Node::Communication(c) if is_peer_copy(c.transport) => found = true,
            _ => {}
        });
    }
    found
}

/// Calls that allocate at most this many bytes (on any rank, in an eager call) are
/// captured with their buffers in an arena owned by the graph, instead of allocation
/// nodes in it: such nodes add a few microseconds to every launch, which matters for small
/// calls; the arena holds the sum of a call's buffers rather than their peak.
pub const CAPTURE_ARENA_LIMIT: usize = 64 << 20;

/// Graphs kept per program and rank (for alternating buffers, e.g. outputs kept while the
/// next call runs); the oldest goes first.
pub(crate) const GRAPHS_PER_SLOT: usize = 4;

/// Where a program and rank stand with graphs.
pub(crate) enum GraphSlot {
    /// No call yet.
    Fresh,
    /// One eager call done: the next is captured.
    Warm,
    /// Graphs, each for the addresses it was captured at (inputs, then outputs), oldest
    /// first; `pending` holds new addresses seen once since.
    Ready {
        graphs: Vec<(Vec<Address>, Box<dyn DeviceGraph>)>,
        pending: Option<Vec<Address>>,
    },
    /// This program never replays on this rank.
    Never(EagerReason),
}

/// Where a tensor sits: its address, shape and strides (a graph reads exactly these).
pub(crate) type Address = (u64, Vec<usize>, Vec<isize>);

/// What to do with a call, given the slot.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Run eagerly for this reason.
    Eager(EagerReason),
    /// Capture this call (then launch it).
    Capture,
    /// Launch the graph at this index of the slot.
    Launch(usize),
}

impl GraphSlot {
    /// The step for a call at `addresses`.
    pub(crate) fn step(&mut self, addresses: &[Address]) -> Step {
        match self {
            GraphSlot::Fresh => {
                *self = GraphSlot::Warm;
                Step::Eager(EagerReason::FirstCall)
            }
            GraphSlot::Warm => Step::Capture,
            GraphSlot::Never(r) => Step::Eager(r.clone()),
            GraphSlot::Ready { graphs, pending } => {
                if let Some(i) = graphs.iter().position(|(a, _)| a.as_slice() == addresses) {
                    *pending = None;
                    Step::Launch(i)
                } else if pending.as_deref() == Some(addresses) {
                    Step::Capture
                } else {
                    *pending = Some(addresses.to_vec());
                    Step::Eager(EagerReason::Moved)
                }
            }
        }
    }

    /// Keeps `graph`, captured at `addresses`.
    pub(crate) fn install(&mut self, addresses: Vec<Address>, graph: Box<dyn DeviceGraph>) {
        match self {
            GraphSlot::Ready { graphs, pending } => {
                if graphs.len() >= GRAPHS_PER_SLOT {
                    graphs.remove(0);
                }
                graphs.push((addresses, graph));
                *pending = None;
            }
            _ => {
                *self = GraphSlot::Ready {
                    graphs: vec![(addresses, graph)],
                    pending: None,
                }
            }
        }
    }

    /// The graph at `index` (from [`Step::Launch`]).
    pub(crate) fn graph(&self, index: usize) -> Option<&dyn DeviceGraph> {
        match self {
            GraphSlot::Ready { graphs, .. } => graphs.get(index).map(|(_, g)| g.as_ref()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct FakeGraph;
    impl DeviceGraph for FakeGraph {
        fn launch(&self, _on: Option<&crate::device::CallerStream>) -> crate::Result<()> {
            Ok(())
        }
        fn nodes(&self) -> usize {
            3
        }
        fn write_dot(&self, _path: &std::path::Path) -> crate::Result<()> {
            Ok(())
        }
    }

    fn at(p: u64) -> Vec<Address> {
        vec![(p, vec![2, 3], vec![3, 1])]
    }

    #[test]
    fn a_slot_warms_up_captures_replays_and_recaptures_for_new_addresses() {
        let mut s = GraphSlot::Fresh;
        assert_eq!(s.step(&at(1)), Step::Eager(EagerReason::FirstCall));
        assert_eq!(s.step(&at(1)), Step::Capture);
        s.install(at(1), Box::new(FakeGraph));
        assert_eq!(s.step(&at(1)), Step::Launch(0));
        assert_eq!(s.graph(0).map(|g| g.nodes()), Some(3));
        // Moved inputs never replay the old graph; the same new place twice recaptures.
        assert_eq!(s.step(&at(2)), Step::Eager(EagerReason::Moved));
        assert_eq!(s.step(&at(3)), Step::Eager(EagerReason::Moved));
        assert_eq!(s.step(&at(3)), Step::Capture);
        s.install(at(3), Box::new(FakeGraph));
        assert_eq!(s.step(&at(3)), Step::Launch(1));
        assert_eq!(
            s.step(&at(1)),
            Step::Launch(0),
            "the old graph still serves its place"
        );
        // Other strides at the same address are another place.
        assert_eq!(
            s.step(&[(1, vec![2, 3], vec![1, 2])]),
            Step::Eager(EagerReason::Moved)
        );
        // At most GRAPHS_PER_SLOT graphs; the oldest goes.
        for p in 10..10 + GRAPHS_PER_SLOT as u64 {
            s.install(at(p), Box::new(FakeGraph));
        }
        assert_eq!(s.step(&at(1)), Step::Eager(EagerReason::Moved));
        assert!(matches!(s.step(&at(10)), Step::Launch(_)));
        let why = EagerReason::PeerCopies("x".into());
        let mut never = GraphSlot::Never(why.clone());
        assert_eq!(never.step(&at(1)), Step::Eager(why));
    }

    #[test]
    fn reasons_say_what_to_do() {
        let text = EagerReason::PeerCopies("they land in T2".into()).to_string();
        assert!(text.contains("transports.p2p = Nccl"), "{text}");
        assert!(text.contains("land in T2"), "{text}");
        assert!(EagerReason::HostInput("a".into())
            .to_string()
            .contains("input a"));
        assert!(EagerReason::Backend(BackendKind::Cpu)
            .to_string()
            .contains("cpu backend"));
    }
}
