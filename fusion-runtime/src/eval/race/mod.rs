//! A stream-order race checker for host programs.
//!
//! The CPU backend runs every stream in program order, so a missing `Synchronize` never
//! shows there; on a GPU it gives wrong numbers only sometimes. The checker models what
//! the CUDA backend guarantees, independently of the backend that runs the call, and
//! reports the first access that is not ordered after a conflicting one.
//!
//! The model, per rank (the evaluator calls the checker where it calls the device):
//! - A stream runs its work in the order it was enqueued. Stream 0 is the caller's; the
//!   pool streams are `1..=numberOfStreams`, the compute streams the ones after them.
//! - `waiter` waiting for `waitee` (`Synchronize`, and `Wait` on a communication, which
//!   the evaluator turns into the same event record + stream wait) orders everything
//!   enqueued on `waiter` afterwards after everything enqueued on `waitee` so far.
//!   Happens-before is tracked with one vector clock per stream.
//! - A compute node reads its operands and writes its result on the current stream. A
//!   collective reads its input and writes its output on the stream it was issued on; a
//!   P2P send reads its buffer and a receive writes it on the current stream; the
//!   transfers of a coalesced group run at `EndCoalescing` (each on the stream it was
//!   issued on), concurrently with each other. (Copy-engine transfers run on copy
//!   streams, but after the issuing stream's work so far and before its later work, which
//!   is the same order.)
//! - An allocation is stream-ordered on the stream current at the allocation: its memory
//!   may be reused from work still queued there, so it counts as a write of the whole
//!   buffer. `Deallocate` frees on the allocating stream (a write that every use must be
//!   ordered before), and nothing may touch the buffer afterwards; buffers the call
//!   allocated and neither freed nor returned are freed when the call ends, on their
//!   allocating streams.
//! - The caller's buffers (inputs, preallocated outputs) were written before the call on
//!   stream 0, and every access of the call must be ordered before the end of the call on
//!   stream 0 (the program joins every stream it used).
//!
//! A buffer region is a storage (an allocation) and the exact bytes a view covers
//! ([`Footprint`]): strided slices of one buffer that interleave do not conflict.
//! Per buffer the checker keeps the accesses not yet superseded by a covering write that
//! is ordered after them, and checks each new access against those that conflict with it.

mod footprint;
mod report;

use std::collections::HashMap;
use std::rc::Rc;

use fusion_compiler::hir::{HostProgram, Node};
use fusion_compiler::ir::{ScalarId, TensorId};

pub use crate::error::race::{AccessKind, RaceError, RaceSite};
pub use footprint::Footprint;
pub(crate) use report::Place;

use crate::streams::{StreamHandle, StreamLayout};
use crate::tensor::{Storage, Tensor};

/// The happens-before order of one checked call: for every event (access, allocation,
/// free, the call's start and end), its stream and vector clock. Two runs of programs
/// that make the same accesses order them identically exactly when these are equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaceCheck {
    events: Vec<(StreamHandle, Vec<u64>)>,
    accesses: usize,
}

impl RaceCheck {
    /// Buffer accesses checked (reads, writes, allocations, frees).
    pub fn accesses(&self) -> usize {
        self.accesses
    }

    /// Events recorded (nodes that touched memory on some stream, plus start and end).
    pub fn events(&self) -> usize {
        self.events.len()
    }

    /// Pairs of events `(a, b)`, `a` before `b` in program order, with `a` happening
    /// before `b`.
    pub fn ordered_pairs(&self) -> usize {
        let mut n = 0;
        for (j, (_, cb)) in self.events.iter().enumerate() {
            for (sa, ca) in &self.events[..j] {
                if cb[*sa] >= ca[*sa] {
                    n += 1;
                }
            }
        }
        n
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum StorageKey {
    Host(usize),
    Device(usize, u64),
}

fn storage_key(t: &Tensor) -> (StorageKey, usize) {
    match t.storage() {
        Storage::Host(h) => (
            StorageKey::Host(std::sync::Arc::as_ptr(h) as usize),
            h.len_bytes(),
        ),
        Storage::Device(b) => (StorageKey::Device(b.device(), b.ptr()), b.len_bytes()),
    }
}

struct Event {
    stream: StreamHandle,
    clock: Vec<u64>,
}

struct Access<'a> {
    event: usize,
    kind: AccessKind,
    tensor: TensorId,
    footprint: Footprint,
    place: Rc<Place<'a>>,
}

/// Who made a buffer.
#[derive(Clone, Copy)]
enum Origin {
    /// The caller: an input or preallocated output, first seen as this tensor.
    Caller(TensorId),
    /// This call, for this tensor, on this stream.
    Allocated(TensorId, StreamHandle),
}

struct Buffer<'a> {
    /// Keeps the storage alive for the call, so its address names it and nothing else.
    _storage: Storage,
    key: StorageKey,
    origin: Origin,
    bytes: usize,
    accesses: Vec<Access<'a>>,
    freed: Option<Access<'a>>,
}

/// A transfer of a coalesced group, run at `EndCoalescing`.
struct Pending<'a> {
    stream: StreamHandle,
    kind: AccessKind,
    tensor: TensorId,
    buffer: usize,
    footprint: Footprint,
    place: Rc<Place<'a>>,
}

/// The checker's state for one call on one rank.
pub(crate) struct RaceChecker<'a> {
    program: &'a HostProgram,
    rank: usize,
    /// One vector clock per stream handle.
    clocks: Vec<Vec<u64>>,
    events: Vec<Event>,
    buffers: Vec<Buffer<'a>>,
    by_storage: HashMap<StorageKey, usize>,
    /// The live buffer each tensor allocated.
    owned: HashMap<TensorId, usize>,
    place: Rc<Place<'a>>,
    group: Option<Vec<Pending<'a>>>,
    first: Option<RaceError>,
    accesses: usize,
}

impl<'a> RaceChecker<'a> {
    /// A checker for a call of `program` on `rank` whose streams are `streams`.
    pub(crate) fn new(program: &'a HostProgram, rank: usize, streams: StreamLayout) -> Self {
        let n = streams.count();
        let mut c = RaceChecker {
            program,
            rank,
            clocks: vec![vec![0; n]; n],
            events: Vec::new(),
            buffers: Vec::new(),
            by_storage: HashMap::new(),
            owned: HashMap::new(),
            place: Rc::new(Place::default()),
            group: None,
            first: None,
            accesses: 0,
        };
        // Event 0: the caller's work before the call, on stream 0.
        c.tick(0);
        c
    }

    /// The evaluator is about to run `node`.
    pub(crate) fn at(&mut self, node: &'a Node) {
        let loops = self.place.loops.clone();
        self.place = Rc::new(Place {
            node: Some(node),
            loops,
        });
    }

    /// A loop over `index` starts iteration `value` (`None`: the loop is done).
    pub(crate) fn iteration(&mut self, index: ScalarId, value: Option<i64>) {
        let mut loops = self.place.loops.clone();
        loops.retain(|l| l.0 != index);
        if let Some(v) = value {
            loops.push((index, v));
        }
        self.place = Rc::new(Place {
            node: self.place.node,
            loops,
        });
    }

    /// `waiter` waits for the work enqueued on `waitee` so far.
    pub(crate) fn stream_wait(&mut self, waiter: StreamHandle, waitee: StreamHandle) {
        if waiter == waitee || waiter >= self.clocks.len() || waitee >= self.clocks.len() {
            return;
        }
        let src = self.clocks[waitee].clone();
        for (a, b) in self.clocks[waiter].iter_mut().zip(src) {
            *a = (*a).max(b);
        }
    }

    /// `tensor` got a fresh buffer `t`, allocated on `stream`.
    pub(crate) fn allocated(&mut self, stream: StreamHandle, tensor: TensorId, t: &Tensor) {
        let (key, bytes) = storage_key(t);
        let id = self.buffers.len();
        self.buffers.push(Buffer {
            _storage: t.storage().clone(),
            key,
            origin: Origin::Allocated(tensor, stream),
            bytes,
            accesses: Vec::new(),
            freed: None,
        });
        self.by_storage.insert(key, id);
        self.owned.insert(tensor, id);
        self.whole_buffer(id, AccessKind::Allocate);
    }

    /// `Deallocate tensor`: frees its buffer on the allocating stream, if the call
    /// allocated one for it.
    pub(crate) fn deallocated(&mut self, tensor: TensorId) {
        if let Some(id) = self.owned.remove(&tensor) {
            self.free(id);
        }
    }

    fn free(&mut self, id: usize) {
        self.whole_buffer(id, AccessKind::Free);
    }

    /// An allocation or free of buffer `id` (one the call allocated), on its stream.
    fn whole_buffer(&mut self, id: usize, kind: AccessKind) {
        let Origin::Allocated(tensor, stream) = self.buffers[id].origin else {
            return;
        };
        let event = self.tick(stream);
        let access = Access {
            event,
            kind,
            tensor,
            footprint: Footprint::whole(self.buffers[id].bytes),
            place: self.place.clone(),
        };
        self.record(id, stream, access);
    }

    /// The current node reads `reads` and writes `writes` on `stream`, as one event.
    pub(crate) fn access(
        &mut self,
        stream: StreamHandle,
        reads: &[(TensorId, &Tensor)],
        writes: &[(TensorId, &Tensor)],
    ) {
        let event = self.tick(stream);
        let kinds = reads
            .iter()
            .map(|r| (AccessKind::Read, r))
            .chain(writes.iter().map(|w| (AccessKind::Write, w)));
        for (kind, &(tensor, t)) in kinds {
            let id = self.buffer_of(tensor, t);
            let place = self.place.clone();
            self.record(
                id,
                stream,
                Access {
                    event,
                    kind,
                    tensor,
                    footprint: Footprint::of(t),
                    place,
                },
            );
        }
    }

    /// A P2P transfer of `t` on `stream` (a receive writes it, a send reads it): now, or
    /// at `EndCoalescing` inside a group.
    pub(crate) fn transfer(
        &mut self,
        stream: StreamHandle,
        tensor: TensorId,
        t: &Tensor,
        receive: bool,
    ) {
        let kind = if receive {
            AccessKind::Write
        } else {
            AccessKind::Read
        };
        if self.group.is_none() {
            let (r, w) = if receive {
                (vec![], vec![(tensor, t)])
            } else {
                (vec![(tensor, t)], vec![])
            };
            return self.access(stream, &r, &w);
        }
        let buffer = self.buffer_of(tensor, t);
        let pending = Pending {
            stream,
            kind,
            tensor,
            buffer,
            footprint: Footprint::of(t),
            place: self.place.clone(),
        };
        if let Some(g) = self.group.as_mut() {
            g.push(pending);
        }
    }

    /// `StartCoalescing`.
    pub(crate) fn group_start(&mut self) {
        self.group = Some(Vec::new());
    }

    /// `EndCoalescing`: the group's transfers run, one event per stream they were issued
    /// on; two of them touching the same bytes, one writing, race.
    pub(crate) fn group_end(&mut self) {
        let group = self.group.take().unwrap_or_default();
        for (j, b) in group.iter().enumerate() {
            for a in &group[..j] {
                if self.first.is_none()
                    && a.buffer == b.buffer
                    && (a.kind.writes() || b.kind.writes())
                    && a.footprint.overlaps(&b.footprint)
                {
                    let region = self.region(a.buffer, &a.footprint.intersection(&b.footprint));
                    self.first = Some(RaceError::InGroup {
                        rank: self.rank,
                        later: self.site(b.kind, b.tensor, b.stream, &b.place),
                        earlier: self.site(a.kind, a.tensor, a.stream, &a.place),
                        region,
                    });
                }
            }
        }
        let mut events: Vec<(StreamHandle, usize)> = Vec::new();
        for p in group {
            let event = match events.iter().find(|e| e.0 == p.stream) {
                Some(&(_, e)) => e,
                None => {
                    let e = self.tick(p.stream);
                    events.push((p.stream, e));
                    e
                }
            };
            self.record(
                p.buffer,
                p.stream,
                Access {
                    event,
                    kind: p.kind,
                    tensor: p.tensor,
                    footprint: p.footprint,
                    place: p.place,
                },
            );
        }
    }

    /// Ends the call: every access must be joined into stream 0, and buffers the call
    /// allocated and neither freed nor returned in `outputs` are freed on their streams.
    /// Returns the first race of the call, or the order of its events.
    pub(crate) fn finish(mut self, outputs: &[Tensor]) -> Result<RaceCheck, Box<RaceError>> {
        self.place = Rc::new(Place::default());
        let end = self.tick(0);
        if self.first.is_none() {
            let mut worst: Option<(usize, usize, usize)> = None;
            for (id, b) in self.buffers.iter().enumerate() {
                if b.freed.is_some() {
                    continue;
                }
                for (k, a) in b.accesses.iter().enumerate() {
                    if !self.ordered(a.event, 0) && worst.is_none_or(|w| a.event < w.0) {
                        worst = Some((a.event, id, k));
                    }
                }
            }
            if let Some((_, id, k)) = worst {
                let a = &self.buffers[id].accesses[k];
                let stream = self.events[a.event].stream;
                self.first = Some(RaceError::NotJoined {
                    rank: self.rank,
                    access: self.site(a.kind, a.tensor, stream, &a.place),
                    region: self.region(id, &a.footprint),
                });
            }
        }
        let returned: Vec<StorageKey> = outputs.iter().map(|t| storage_key(t).0).collect();
        let implicit: Vec<usize> = (0..self.buffers.len())
            .filter(|&id| {
                let b = &self.buffers[id];
                matches!(b.origin, Origin::Allocated(..))
                    && b.freed.is_none()
                    && !returned.contains(&b.key)
            })
            .collect();
        for id in implicit {
            self.free(id);
        }
        match self.first {
            Some(e) => Err(Box::new(e)),
            None => {
                let _ = end;
                Ok(RaceCheck {
                    events: self
                        .events
                        .into_iter()
                        .map(|e| (e.stream, e.clock))
                        .collect(),
                    accesses: self.accesses,
                })
            }
        }
    }

    /// A new event on `stream`: the stream's own clock advances.
    fn tick(&mut self, stream: StreamHandle) -> usize {
        let stream = stream.min(self.clocks.len() - 1);
        self.clocks[stream][stream] += 1;
        self.events.push(Event {
            stream,
            clock: self.clocks[stream].clone(),
        });
        self.events.len() - 1
    }

    /// True when event `e` happens before the work enqueued on `stream` from now on.
    fn ordered(&self, e: usize, stream: StreamHandle) -> bool {
        let ev = &self.events[e];
        self.clocks[stream.min(self.clocks.len() - 1)][ev.stream] >= ev.clock[ev.stream]
    }

    /// Registers `t`, bound to `tensor` by the caller (an input or a preallocated
    /// output), as the caller's buffer, written before the call on stream 0.
    pub(crate) fn caller(&mut self, tensor: TensorId, t: &Tensor) {
        self.buffer_of(tensor, t);
    }

    /// The buffer behind `t`'s storage; a storage the call did not allocate is the
    /// caller's, written before the call.
    fn buffer_of(&mut self, tensor: TensorId, t: &Tensor) -> usize {
        let (key, bytes) = storage_key(t);
        if let Some(&id) = self.by_storage.get(&key) {
            return id;
        }
        let id = self.buffers.len();
        self.buffers.push(Buffer {
            _storage: t.storage().clone(),
            key,
            origin: Origin::Caller(tensor),
            bytes,
            accesses: vec![Access {
                event: 0,
                kind: AccessKind::Caller,
                tensor,
                footprint: Footprint::whole(bytes),
                place: Rc::new(Place::default()),
            }],
            freed: None,
        });
        self.by_storage.insert(key, id);
        id
    }

    /// Checks a new access of buffer `id` against the earlier ones, then records it.
    fn record(&mut self, id: usize, stream: StreamHandle, new: Access<'a>) {
        self.accesses += 1;
        if self.first.is_none() {
            self.first = self.check(id, stream, &new);
        }
        let b = &mut self.buffers[id];
        if new.kind == AccessKind::Free {
            b.accesses.clear();
            b.freed = Some(new);
            return;
        }
        if new.kind.writes() && self.first.is_none() {
            // Accesses this write covers and is ordered after can no longer race with
            // anything that this write does not race with too.
            let clocks = &self.clocks[stream];
            let events = &self.events;
            b.accesses.retain(|a| {
                let ev = &events[a.event];
                !(clocks[ev.stream] >= ev.clock[ev.stream] && new.footprint.covers(&a.footprint))
            });
        }
        b.accesses.push(new);
    }

    fn check(&self, id: usize, stream: StreamHandle, new: &Access<'a>) -> Option<RaceError> {
        let b = &self.buffers[id];
        let later = || self.site(new.kind, new.tensor, stream, &new.place);
        if let Some(f) = &b.freed {
            return Some(RaceError::UseAfterFree {
                rank: self.rank,
                later: later(),
                free: self.site(f.kind, f.tensor, self.events[f.event].stream, &f.place),
                region: self.region(id, &new.footprint),
            });
        }
        let conflict = b.accesses.iter().find(|a| {
            (a.kind.writes() || new.kind.writes())
                && !self.ordered(a.event, stream)
                && a.footprint.overlaps(&new.footprint)
        })?;
        Some(RaceError::Unordered {
            rank: self.rank,
            later: later(),
            earlier: self.site(
                conflict.kind,
                conflict.tensor,
                self.events[conflict.event].stream,
                &conflict.place,
            ),
            region: self.region(id, &conflict.footprint.intersection(&new.footprint)),
        })
    }

    fn site(
        &self,
        access: AccessKind,
        tensor: TensorId,
        stream: StreamHandle,
        place: &Place<'_>,
    ) -> RaceSite {
        let outside = match access {
            AccessKind::Caller => "the caller, before the call",
            _ => "the end of the call",
        };
        RaceSite {
            node: place.label(self.program, outside),
            tensor: self.program.ir.tensor_name(tensor),
            access,
            stream,
        }
    }

    /// `bytes [0, 16) of the buffer allocated for T4 on stream 0`.
    fn region(&self, id: usize, fp: &Footprint) -> String {
        let name = |t| self.program.ir.tensor_name(t);
        let b = &self.buffers[id];
        let whose = match b.origin {
            Origin::Caller(t) => format!("the caller's buffer of {} ({} bytes)", name(t), b.bytes),
            Origin::Allocated(t, s) => format!(
                "the buffer allocated for {} on stream {s} ({} bytes)",
                name(t),
                b.bytes
            ),
        };
        format!("{fp} of {whose}")
    }
}

#[cfg(test)]
mod tests {
    use crate::streams::StreamLayout;
    use fusion_compiler::builder::{Axis, FusionBuilder};
    use fusion_compiler::hir::HostProgram;
    use fusion_compiler::ir::{ParallelType, TensorId};
    use fusion_compiler::DType;

    use super::{AccessKind, RaceChecker, RaceError};
    use crate::tensor::Tensor;

    /// A program whose only use is naming tensor `x` in reports.
    fn program() -> (HostProgram, TensorId) {
        let mut b = FusionBuilder::new();
        let m = b.symbol("m");
        let axis = Axis {
            extent: m,
            parallel: ParallelType::Serial,
        };
        let x = b.input("x", DType::F32, &[axis]).unwrap();
        b.output(x).unwrap();
        (HostProgram::new(b.build().unwrap(), 1), x)
    }

    fn buffer() -> Tensor {
        Tensor::zeros(&[4, 6], DType::F32)
    }

    #[test]
    fn a_read_on_another_stream_needs_a_wait_after_the_write() {
        let (p, x) = program();
        let t = buffer();
        for wait in [false, true] {
            let mut c = RaceChecker::new(&p, 0, StreamLayout::new(2));
            c.allocated(1, x, &t);
            c.access(1, &[], &[(x, &t)]);
            if wait {
                c.stream_wait(2, 1);
            }
            c.access(2, &[(x, &t)], &[]);
            c.stream_wait(0, 2);
            c.stream_wait(0, 1);
            let r = c.finish(std::slice::from_ref(&t));
            match (wait, r.map_err(|e| *e)) {
                (true, Ok(order)) => assert_eq!(order.accesses(), 3),
                (false, Err(RaceError::Unordered { later, earlier, .. })) => {
                    assert_eq!((later.access, later.stream), (AccessKind::Read, 2));
                    assert_eq!((earlier.access, earlier.stream), (AccessKind::Write, 1));
                }
                (w, r) => panic!("wait {w}: {r:?}"),
            }
        }
    }

    #[test]
    fn reads_on_two_streams_do_not_conflict_and_interleaved_slices_do_not_overlap() {
        let (p, x) = program();
        let t = buffer();
        let mut c = RaceChecker::new(&p, 0, StreamLayout::new(2));
        c.stream_wait(1, 0);
        c.stream_wait(2, 0);
        // Columns 0..3 and 3..6 of every row: strided, interleaved, disjoint.
        let (left, right) = (t.narrow(1, 0, 3).unwrap(), t.narrow(1, 3, 3).unwrap());
        c.access(1, &[(x, &t)], &[]);
        c.access(2, &[(x, &t)], &[]);
        c.stream_wait(1, 2);
        c.stream_wait(2, 1);
        c.access(1, &[], &[(x, &left)]);
        c.access(2, &[], &[(x, &right)]);
        c.stream_wait(0, 1);
        c.stream_wait(0, 2);
        assert!(c.finish(&[]).is_ok());
        // Rows overlap every column: the same two writes on a column and a row race.
        let mut c = RaceChecker::new(&p, 0, StreamLayout::new(2));
        c.stream_wait(1, 0);
        c.stream_wait(2, 0);
        c.access(1, &[], &[(x, &left)]);
        c.access(2, &[], &[(x, &t.select(0, 2).unwrap())]);
        let err = c.finish(&[]).unwrap_err();
        assert!(
            err.to_string()
                .contains("bytes [48, 60) of the caller's buffer of x"),
            "{err}"
        );
    }

    #[test]
    fn allocations_and_frees_are_ordered_on_the_allocating_stream() {
        let (p, x) = program();
        let t = buffer();
        // Used on stream 1 without waiting for the allocation on stream 0.
        let mut c = RaceChecker::new(&p, 0, StreamLayout::new(1));
        c.allocated(0, x, &t);
        c.access(1, &[], &[(x, &t)]);
        let err = c.finish(&[]).unwrap_err();
        assert_eq!(err.earlier().unwrap().access, AccessKind::Allocate, "{err}");
        // Freed on stream 0 before stream 1's write is joined, then used after the free.
        let mut c = RaceChecker::new(&p, 0, StreamLayout::new(1));
        c.allocated(0, x, &t);
        c.stream_wait(1, 0);
        c.access(1, &[], &[(x, &t)]);
        c.deallocated(x);
        let err = c.finish(&[]).unwrap_err();
        assert_eq!(err.later().access, AccessKind::Free, "{err}");
        let mut c = RaceChecker::new(&p, 0, StreamLayout::new(1));
        c.allocated(0, x, &t);
        c.deallocated(x);
        c.access(0, &[(x, &t)], &[]);
        assert!(matches!(
            c.finish(&[]).map_err(|e| *e),
            Err(RaceError::UseAfterFree { .. })
        ));
        // Allocated on stream 1 and never freed nor returned: freed on stream 1 at the
        // end, after stream 0's read only if stream 1 waits for it.
        let mut c = RaceChecker::new(&p, 0, StreamLayout::new(1));
        c.stream_wait(1, 0);
        c.allocated(1, x, &t);
        c.access(1, &[], &[(x, &t)]);
        c.stream_wait(0, 1);
        c.access(0, &[(x, &t)], &[]);
        let err = c.finish(&[]).unwrap_err();
        assert_eq!(
            (err.later().access, err.later().stream),
            (AccessKind::Free, 1)
        );
    }

    #[test]
    fn unjoined_streams_and_overlapping_transfers_of_a_group_are_reported() {
        let (p, x) = program();
        let t = buffer();
        let mut c = RaceChecker::new(&p, 0, StreamLayout::new(1));
        c.stream_wait(1, 0);
        c.access(1, &[], &[(x, &t)]);
        assert!(matches!(
            c.finish(&[]).map_err(|e| *e),
            Err(RaceError::NotJoined { .. })
        ));
        let mut c = RaceChecker::new(&p, 0, StreamLayout::new(1));
        c.group_start();
        c.transfer(0, x, &t.select(0, 1).unwrap(), false);
        c.transfer(0, x, &t.narrow(0, 1, 2).unwrap(), true);
        c.group_end();
        assert!(matches!(
            c.finish(&[]).map_err(|e| *e),
            Err(RaceError::InGroup { .. })
        ));
    }

    #[test]
    fn a_redundant_wait_leaves_the_order_identical_and_a_needed_one_does_not() {
        let (p, x) = program();
        let t = buffer();
        let run = |extra_wait: bool, join: bool| {
            let mut c = RaceChecker::new(&p, 0, StreamLayout::new(1));
            c.stream_wait(1, 0);
            if extra_wait {
                c.stream_wait(1, 0);
            }
            c.access(1, &[(x, &t)], &[]);
            if join {
                c.stream_wait(0, 1);
            }
            c.finish(&[])
        };
        let base = run(false, true).unwrap();
        assert_eq!(run(true, true).unwrap(), base);
        assert!(base.ordered_pairs() >= 2 && base.events() == 3);
        assert!(run(false, false).is_err());
    }
}
