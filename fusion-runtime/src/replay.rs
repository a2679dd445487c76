//! Replaying a rank's calls as device graphs: after the first (eager) call of a program,
//! the second is captured (CUDA graphs), and later calls launch the graph once instead of
//! walking the host program.
//!
//! A graph bakes in every address it touches, so a graph is kept per program and rank
//! together with the addresses of the call it captured: the inputs and the outputs (which
//! are allocated before the capture, outside the graph). A call whose inputs or outputs
//! sit elsewhere never replays that graph: it runs eagerly, and when the same new
//! addresses come back (among the last 128 sets seen) the graph is captured again for
//! them, so one fusion called from several places with buffers of its own (the layers of
//! a model) replays at each (up to 128 graphs a program and rank, keeping up to 1 GiB of
//! their own memory). Stale pointers are never replayed. Loops that drop their
//! outputs before the next call get the same addresses back from the allocator and replay
//! every call.
//!
//! Programs that cannot be captured run eagerly, and [`ReplayStatus::Eager`] says why.
//!
//! This module holds the state of one program and rank (`GraphSlot`: what the next call
//! does) and how a call ran; the executor's replay driver keeps the slots, captures and
//! launches; whether a program can be captured at all ([`capture_plan`]) is worked out once
//! per program with the rest of what the runtime knows of it, and re-exported here.

use crate::device::DeviceGraph;

pub use crate::program_facts::{capture_plan, has_peer_copies, EagerReason, CAPTURE_ARENA_LIMIT};

/// How a call ran.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplayStatus {
    /// It walked the host program.
    Eager(EagerReason),
    /// It was captured as a graph of this many nodes, then launched; on a stream the
    /// caller is capturing, recorded into the caller's graph (nothing ran).
    Captured(usize),
    /// It launched the graph captured earlier.
    Replayed,
}

/// Graphs kept per program and rank (one per place the program is called from with
/// buffers of its own, e.g. a layer's, or alternating outputs); the oldest goes first.
/// A model's layers call their fusions in turn, each with its own buffers: with fewer
/// graphs than layers every call would capture again (Llama-3-70B has 80 layers).
pub(crate) const GRAPHS_PER_SLOT: usize = 128;

/// Device memory the graphs of one program and rank may keep for themselves (their
/// capture arenas or allocation nodes, [`DeviceGraph::retained_bytes`]); beyond it the
/// oldest go first.
pub(crate) const GRAPH_BYTES_PER_SLOT: usize = 1 << 30;

/// New address sets a slot remembers: one seen again among them is captured.
pub(crate) const RECENT_ADDRESSES: usize = GRAPHS_PER_SLOT;

/// Where a program and rank stand with graphs.
pub(crate) enum GraphSlot {
    /// No call yet.
    Fresh,
    /// One eager call done: the next is captured.
    Warm,
    /// Graphs, each for the addresses it was captured at (inputs, then outputs), oldest
    /// first; `recent` holds new addresses seen once since, oldest first.
    Ready {
        graphs: Vec<(Vec<Address>, Box<dyn DeviceGraph>)>,
        recent: Vec<Vec<Address>>,
    },
    /// This program never replays on this rank.
    Never(EagerReason),
}

/// Where a tensor sits: its address, shape and strides (a graph reads exactly these).
pub(crate) type Address = (u64, Vec<usize>, Vec<isize>);

/// Something at an [`Address`]: a call's tensor, or an address kept in a slot. A call's
/// tensors are matched against a slot's addresses as they are, without copying their
/// shapes and strides (a replayed call's hot path); they are copied only to be kept.
pub(crate) trait Located {
    /// The address, shape and strides.
    fn location(&self) -> (u64, &[usize], &[isize]);

    /// The same as an owned [`Address`], to keep.
    fn address(&self) -> Address {
        let (ptr, shape, strides) = self.location();
        (ptr, shape.to_vec(), strides.to_vec())
    }
}

impl Located for Address {
    fn location(&self) -> (u64, &[usize], &[isize]) {
        (self.0, &self.1, &self.2)
    }
}

impl Located for &crate::tensor::Tensor {
    fn location(&self) -> (u64, &[usize], &[isize]) {
        (self.device_ptr().unwrap_or(0), self.shape(), self.strides())
    }
}

/// Whether `kept` are the places of `at`, one by one.
fn same_places<L: Located>(kept: &[Address], at: &[L]) -> bool {
    kept.len() == at.len() && (kept.iter().zip(at)).all(|(k, a)| k.location() == a.location())
}

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
    pub(crate) fn step<L: Located>(&mut self, addresses: &[L]) -> Step {
        match self {
            GraphSlot::Fresh => {
                *self = GraphSlot::Warm;
                Step::Eager(EagerReason::FirstCall)
            }
            GraphSlot::Warm => Step::Capture,
            GraphSlot::Never(r) => Step::Eager(r.clone()),
            GraphSlot::Ready { graphs, recent } => {
                if let Some(i) = graphs.iter().position(|(a, _)| same_places(a, addresses)) {
                    Step::Launch(i)
                } else if recent.iter().any(|a| same_places(a, addresses)) {
                    Step::Capture
                } else {
                    if recent.len() >= RECENT_ADDRESSES {
                        recent.remove(0);
                    }
                    recent.push(addresses.iter().map(Located::address).collect());
                    Step::Eager(EagerReason::Moved)
                }
            }
        }
    }

    /// Keeps `graph`, captured at `addresses`: the oldest graphs go while more than
    /// [`GRAPHS_PER_SLOT`] are kept or they keep more than [`GRAPH_BYTES_PER_SLOT`] (never
    /// the new one).
    pub(crate) fn install(&mut self, addresses: Vec<Address>, graph: Box<dyn DeviceGraph>) {
        match self {
            GraphSlot::Ready { graphs, recent } => {
                recent.retain(|a| *a != addresses);
                graphs.push((addresses, graph));
                let mut bytes: usize = graphs.iter().map(|(_, g)| g.retained_bytes()).sum();
                while graphs.len() > 1
                    && (graphs.len() > GRAPHS_PER_SLOT || bytes > GRAPH_BYTES_PER_SLOT)
                {
                    bytes -= graphs.remove(0).1.retained_bytes();
                }
            }
            _ => {
                *self = GraphSlot::Ready {
                    graphs: vec![(addresses, graph)],
                    recent: Vec::new(),
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

    /// A graph of 3 nodes keeping `0` bytes of device memory.
    struct FakeGraph(usize);
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
        fn retained_bytes(&self) -> usize {
            self.0
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
        s.install(at(1), Box::new(FakeGraph(0)));
        assert_eq!(s.step(&at(1)), Step::Launch(0));
        assert_eq!(s.graph(0).map(|g| g.nodes()), Some(3));
        // Moved inputs never replay the old graph; the same new place twice recaptures.
        assert_eq!(s.step(&at(2)), Step::Eager(EagerReason::Moved));
        assert_eq!(s.step(&at(3)), Step::Eager(EagerReason::Moved));
        assert_eq!(s.step(&at(3)), Step::Capture);
        s.install(at(3), Box::new(FakeGraph(0)));
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
            s.install(at(p), Box::new(FakeGraph(0)));
        }
        assert_eq!(s.step(&at(1)), Step::Eager(EagerReason::Moved));
        assert!(matches!(s.step(&at(10)), Step::Launch(_)));
        let why = EagerReason::PeerCopies("x".into());
        let mut never = GraphSlot::Never(why.clone());
        assert_eq!(never.step(&at(1)), Step::Eager(why));
    }

    #[test]
    fn one_fusion_called_from_several_places_replays_at_each() {
        // A model's layers call one fusion with buffers of their own, in turn: Llama-3-70B's
        // 80 (with 16 graphs a slot, as before 2026-11-27, every call captured again).
        let layers: Vec<u64> = (100..180).collect();
        assert!(layers.len() <= GRAPHS_PER_SLOT);
        let mut s = GraphSlot::Fresh;
        assert_eq!(s.step(&at(layers[0])), Step::Eager(EagerReason::FirstCall));
        assert_eq!(s.step(&at(layers[1])), Step::Capture);
        s.install(at(layers[1]), Box::new(FakeGraph(0)));
        let mut captured = 1;
        for step in 0..3 {
            for &p in &layers {
                match s.step(&at(p)) {
                    Step::Capture => {
                        s.install(at(p), Box::new(FakeGraph(0)));
                        captured += 1;
                    }
                    Step::Launch(_) => assert!(step > 0 || p == layers[1], "{p}"),
                    Step::Eager(r) => assert_eq!((step, r), (0, EagerReason::Moved), "{p}"),
                }
            }
        }
        assert_eq!(captured, layers.len());
        for &p in &layers {
            assert!(matches!(s.step(&at(p)), Step::Launch(_)), "{p}");
        }
    }

    #[test]
    fn graphs_that_keep_much_memory_are_fewer() {
        // Graphs of 300 MB arenas: the fourth pushes the slot over its bytes, the oldest
        // goes; a graph larger than the budget alone is still kept (the newest).
        let big = 300 << 20;
        let mut s = GraphSlot::Fresh;
        for p in 1..=4 {
            s.install(at(p), Box::new(FakeGraph(big)));
        }
        assert_eq!(s.step(&at(1)), Step::Eager(EagerReason::Moved));
        for p in 2..=4 {
            assert!(matches!(s.step(&at(p)), Step::Launch(_)), "{p}");
        }
        s.install(at(9), Box::new(FakeGraph(GRAPH_BYTES_PER_SLOT + 1)));
        assert!(matches!(s.step(&at(9)), Step::Launch(0)));
        assert_eq!(s.step(&at(4)), Step::Eager(EagerReason::Moved));
        // Graphs without arenas are bounded by their count alone.
        let mut s = GraphSlot::Fresh;
        for p in 0..GRAPHS_PER_SLOT as u64 + 1 {
            s.install(at(p), Box::new(FakeGraph(0)));
        }
        assert_eq!(s.step(&at(0)), Step::Eager(EagerReason::Moved));
        assert!(matches!(s.step(&at(1)), Step::Launch(0)));
    }

    #[test]
    fn a_calls_tensors_match_the_places_a_slot_keeps() {
        use crate::tensor::Tensor;
        let tensor = |p| {
            Tensor::from_device(
                fusion_compiler::DType::F32,
                &[2, 3],
                std::sync::Arc::new(crate::tensor::AddressOnly(p)),
            )
        };
        let (one, two) = (tensor(1), tensor(2));
        let mut s = GraphSlot::Fresh;
        assert_eq!(s.step(&[&one]), Step::Eager(EagerReason::FirstCall));
        assert_eq!(s.step(&[&one]), Step::Capture);
        // What the executor keeps for a capture: the tensor's place, copied.
        s.install(vec![(&one).address()], Box::new(FakeGraph(0)));
        assert_eq!(s.step(&[&one]), Step::Launch(0));
        assert_eq!(
            s.step(&at(1)),
            Step::Launch(0),
            "(1, [2, 3], [3, 1]) is that place"
        );
        assert_eq!(s.step(&[&two]), Step::Eager(EagerReason::Moved));
        // Another view at the same address, or one tensor more, is another place.
        let transposed = one.permute(&[1, 0]).unwrap();
        assert_eq!(s.step(&[&transposed]), Step::Eager(EagerReason::Moved));
        assert_eq!(s.step(&[&one, &one]), Step::Eager(EagerReason::Moved));
        // Seen again: captured.
        assert_eq!(s.step(&[&two]), Step::Capture);
    }
}
