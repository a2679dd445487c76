//! Whole collectives beside compute (`LowerOptions::streams.collectives_aside`): every
//! collective at the top level of a program (one a stream loop does not carry, e.g. every
//! collective of an unpipelined program) runs on the collectives stream, issued as early as
//! its input allows and waited for only where the main stream first needs it, so that the
//! compute between overlaps it. A training step's backward is the case: its gathers of dY
//! and x and its ReduceScatter of dx each have GEMMs that do not read them (the weight
//! gradients) to hide behind.
//!
//! The top-level nodes are scheduled anew, keeping every dependency (the memory a node reads
//! or writes, a view counting as the memory it may be bound to at that point; bindings;
//! stream captures; the pool's streams in program order). Ready nodes go in this order of preference: a collective
//! (issued at once); a node that needs no wait and leads to a collective not yet issued,
//! the one with the least work between it and the collective first (the dx GEMM before
//! the weight gradients, so that its ReduceScatter starts early); any node that needs no
//! wait; then the first ready node, after its waits. A node needs a wait
//! for each collective it depends on (it reads what the collective writes, writes what it
//! reads, or frees one of its buffers); reading the collective's input alongside it does
//! not. Nodes that communicate otherwise over NCCL (a transfer, a loop of NCCL transfers, a
//! fused GEMM with its collective) or switch streams at the top level stay where they are,
//! after every wait: one communicator is never driven from two streams at once.
//!
//! A collective runs as `SetCurrentStream(collectives)`, `Synchronize(main)` (its input is
//! ready), the collective, then `SetCurrentStream(mark)`, `Synchronize(collectives)`,
//! `SetCurrentStream(main)`: mark stream `k` (one of [`COLLECTIVE_MARKS`], in turn) then
//! stands for "this collective done", and its wait is `Synchronize(mark)` on the main
//! stream, which a collective issued after it does not delay.

use std::collections::{HashMap, HashSet};

use crate::hir::{
    CommId, HostProgram, Node, P2PDirection, StreamDef, StreamId, Transport, COLLECTIVE_MARKS,
};
use crate::ir::{Op, TensorId};

/// Runs every top-level collective of `program` aside (see the module documentation) when
/// `enabled`, noting how many.
pub fn choose_collectives_aside(program: &mut HostProgram, enabled: bool) {
    if !enabled {
        return;
    }
    // A node after one that leaves another stream current (a loop forking onto the pool)
    // runs on that stream: it keeps its place right after it. So do consecutive nodes
    // that drive the worker streams (a fork loop, its pipeline, its join loop): what the
    // pipeline's workers write is the main stream's only after the join.
    let body = &program.body;
    let glued: Vec<bool> = (0..body.len())
        .map(|i| {
            i > 0
                && (!leaves_main_current(program, &body[i - 1])
                    || (uses_workers(program, &body[i - 1]) && uses_workers(program, &body[i])))
        })
        .collect();
    let aside: Vec<CommId> = (program.body.iter().enumerate())
        .filter_map(|(i, n)| match n {
            Node::Communication(c)
                if !glued[i]
                    && program.body[i + 1..]
                        .iter()
                        .any(|w| matches!(w, Node::Wait { comm } if *comm == c.id)) =>
            {
                Some(c.id)
            }
            _ => None,
        })
        .collect();
    if aside.is_empty() {
        return;
    }
    let body = std::mem::take(&mut program.body);
    // Runs of glued nodes; the aside collectives' own waits go (the schedule places new
    // ones).
    let mut runs: Vec<Vec<Node>> = Vec::new();
    for (i, node) in body.into_iter().enumerate() {
        if matches!(&node, Node::Wait { comm } if aside.contains(comm)) {
            continue;
        }
        match runs.last_mut() {
            Some(run) if glued[i] => run.push(node),
            _ => runs.push(vec![node]),
        }
    }
    let mut views = HashMap::new();
    let items: Vec<Item> = (runs.into_iter())
        .map(|run| Item::new(run, program, &mut views, &aside))
        .collect();
    let streams = Streams {
        main: program.new_stream(StreamDef::Captured),
        collectives: program.new_stream(StreamDef::Collectives),
        marks: (0..COLLECTIVE_MARKS)
            .map(|k| program.new_stream(StreamDef::CollectiveMark(k)))
            .collect(),
    };
    program.body = schedule(items, &streams);
    program.notes.push(format!(
        "collectives aside: {} whole collective(s) on the collectives stream, waited for \
         where first needed (LowerOptions::streams.collectives_aside)",
        aside.len()
    ));
}

struct Streams {
    main: StreamId,
    collectives: StreamId,
    marks: Vec<StreamId>,
}

/// What a node's order depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Resource {
    /// An alias class, by its root tensor.
    Memory(TensorId),
    /// A tensor's binding (what a view or an allocation gives it).
    Binding(TensorId),
    /// A captured stream's binding.
    Captured(StreamId),
    /// The worker pool's and compute streams' queues.
    Workers,
    /// A communication's (or coalesced group's) completion, for its `Wait`.
    Done(CommId),
}

/// One top-level node with what it reads and writes.
struct Item {
    /// One node, or a node and those glued after it.
    nodes: Vec<Node>,
    reads: HashSet<Resource>,
    writes: HashSet<Resource>,
    /// Stays in place: after everything before it, before everything after it.
    barrier: bool,
    /// It is an aside collective.
    aside: bool,
}

impl Item {
    fn new(nodes: Vec<Node>, p: &HostProgram, views: &mut Views, aside: &[CommId]) -> Self {
        let mut it = Item {
            nodes,
            reads: HashSet::new(),
            writes: HashSet::new(),
            barrier: false,
            aside: false,
        };
        for n in &it.nodes {
            match n {
                Node::Communication(c) if aside.contains(&c.id) => it.aside = true,
                // At the top level these switch streams or group transfers: order-sensitive.
                Node::SetCurrentStream { .. }
                | Node::Synchronize { .. }
                | Node::StartCoalescing
                | Node::EndCoalescing { .. }
                | Node::P2P(_)
                | Node::Wait { .. } => it.barrier = true,
                _ => {}
            }
        }
        let mut effects = Effects {
            p,
            views: std::mem::take(views),
            reads: HashSet::new(),
            writes: HashSet::new(),
            nccl: false,
        };
        effects.of(&it.nodes);
        *views = effects.views;
        it.barrier |= effects.nccl && !it.aside;
        it.reads = effects.reads;
        it.writes = effects.writes;
        it
    }

    /// Whether it runs work on the device (a kernel, a GEMM, a loop), not a view, an
    /// allocation or a stream switch.
    fn is_work(&self) -> bool {
        self.nodes.iter().any(|n| match n {
            Node::Compute(e) => !e.op.is_view(),
            Node::Launch { .. } | Node::ForLoop(_) | Node::IfThenElse { .. } => true,
            _ => false,
        })
    }

    /// Whether `later` must stay after `self`.
    fn orders(&self, later: &Item) -> bool {
        self.barrier
            || later.barrier
            || !self.writes.is_disjoint(&later.reads)
            || !self.writes.is_disjoint(&later.writes)
            || !self.reads.is_disjoint(&later.writes)
    }
}

/// The memory each view may be, as the nodes so far bound it: a tensor absent here is its
/// own memory.
type Views = HashMap<TensorId, HashSet<TensorId>>;

/// What nodes read and write, walked in program order (each branch of an `IfThenElse`
/// with the views bound before it, the views of both after it).
struct Effects<'a> {
    p: &'a HostProgram,
    views: Views,
    reads: HashSet<Resource>,
    writes: HashSet<Resource>,
    /// It communicates over NCCL or through a fused GEMM's collective.
    nccl: bool,
}

impl Effects<'_> {
    fn memory(&self, t: TensorId) -> Vec<Resource> {
        match self.views.get(&t) {
            Some(m) => m.iter().map(|&x| Resource::Memory(x)).collect(),
            None => vec![Resource::Memory(t)],
        }
    }

    fn read(&mut self, t: TensorId) {
        self.reads.extend(self.memory(t));
        self.reads.insert(Resource::Binding(t));
    }

    fn write(&mut self, t: TensorId) {
        self.writes.extend(self.memory(t));
        self.reads.insert(Resource::Binding(t));
    }

    /// Binds `t` (a view, an allocation): what mentions it comes after.
    fn bind(&mut self, t: TensorId) {
        self.writes.insert(Resource::Binding(t));
    }

    /// Binds view `output` to the memory of `input`.
    fn view(&mut self, input: TensorId, output: TensorId) {
        self.read(input);
        self.bind(output);
        let memory: HashSet<TensorId> = match self.views.get(&input) {
            Some(m) => m.clone(),
            None => [input].into(),
        };
        self.views.insert(output, memory);
    }

    fn stream(&mut self, s: StreamId) {
        match self.p.streams[s.index()] {
            StreamDef::Captured => {
                self.reads.insert(Resource::Captured(s));
            }
            _ => {
                self.writes.insert(Resource::Workers);
            }
        }
    }

    fn of(&mut self, nodes: &[Node]) {
        for n in nodes {
            match n {
                // Fresh memory: only its binding orders it.
                Node::Allocate { tensor } => {
                    self.bind(*tensor);
                    self.views.remove(tensor);
                }
                Node::Deallocate { tensor } => {
                    self.write(*tensor);
                    self.bind(*tensor);
                }
                Node::AliasSelect { input, output, .. } => self.view(*input, *output),
                Node::Compute(e) if e.op.is_view() => match e.inputs.first() {
                    Some(&x) => self.view(x, e.output),
                    None => self.bind(e.output),
                },
                Node::Compute(e) => {
                    e.inputs.iter().for_each(|&t| self.read(t));
                    self.write(e.output);
                    if let Op::Gemm { epilogue, .. } = &e.op {
                        if epilogue.writes_aux() {
                            if let Some(&aux) = e.inputs.last() {
                                self.write(aux);
                            }
                        }
                    }
                }
                Node::Launch {
                    inputs, outputs, ..
                } => {
                    inputs.iter().for_each(|&t| self.read(t));
                    outputs.iter().for_each(|&t| self.write(t));
                }
                Node::Communication(c) => {
                    self.read(c.input);
                    self.write(c.output);
                    self.writes.insert(Resource::Done(c.id));
                    self.nccl |= c.transport == Transport::Nccl;
                }
                Node::P2P(x) => {
                    match x.direction {
                        P2PDirection::Send => self.read(x.buffer),
                        P2PDirection::Recv => self.write(x.buffer),
                    }
                    self.nccl |= x.transport == Transport::Nccl;
                }
                Node::EndCoalescing { id } => {
                    self.writes.insert(Resource::Done(*id));
                }
                Node::Wait { comm } => {
                    self.reads.insert(Resource::Done(*comm));
                }
                Node::GetCurrentStream { stream } => {
                    self.writes.insert(Resource::Captured(*stream));
                }
                Node::SetCurrentStream { stream } | Node::Synchronize { stream } => {
                    self.stream(*stream)
                }
                Node::StartCoalescing => {}
                Node::GatheredGemmLaunch(_)
                | Node::RowsReady { .. }
                | Node::GatheredGemmJoin { .. }
                | Node::GemmAllreduce(_)
                | Node::GemmReduceScatter(_) => self.nccl = true,
                Node::ForLoop(l) => self.of(&l.body),
                Node::IfThenElse {
                    then_body,
                    else_body,
                    ..
                } => {
                    let before = self.views.clone();
                    self.of(then_body);
                    let then_views = std::mem::replace(&mut self.views, before);
                    self.of(else_body);
                    for (t, m) in then_views {
                        self.views.entry(t).or_default().extend(m);
                    }
                }
            }
        }
    }
}

/// The schedule of `items` (see the module documentation).
fn schedule(items: Vec<Item>, s: &Streams) -> Vec<Node> {
    let n = items.len();
    let preds: Vec<Vec<usize>> = (0..n)
        .map(|j| (0..j).filter(|&i| items[i].orders(&items[j])).collect())
        .collect();
    // How much work (GEMMs, kernels, loops) stands between each node and the nearest aside
    // collective it leads to (`None`: it leads to none).
    let mut depth: Vec<Option<usize>> = vec![None; n];
    for j in (0..n).rev() {
        if items[j].aside {
            depth[j] = Some(0);
        }
        if let Some(dj) = depth[j] {
            for &i in &preds[j] {
                let d = dj + usize::from(items[i].is_work());
                depth[i] = Some(depth[i].map_or(d, |x| x.min(d)));
            }
        }
    }
    let mut done = vec![false; n];
    // Aside collectives issued: their mark stream, and whether waited for.
    let mut issued: HashMap<usize, (StreamId, bool)> = HashMap::new();
    let mut next_mark = 0;
    let mut out = vec![Node::GetCurrentStream { stream: s.main }];
    let mut nodes: Vec<Option<Vec<Node>>> = items.iter().map(|_| None).collect();
    let (aside, barrier): (Vec<bool>, Vec<bool>) =
        items.iter().map(|it| (it.aside, it.barrier)).unzip();
    for (k, it) in items.into_iter().enumerate() {
        nodes[k] = Some(it.nodes);
    }
    let unwaited = |j: usize, issued: &HashMap<usize, (StreamId, bool)>| -> Vec<usize> {
        let mut w: Vec<usize> = (preds[j].iter().copied())
            .filter(|i| issued.get(i).is_some_and(|x| !x.1))
            .collect();
        // A barrier waits for every collective in flight.
        if barrier[j] {
            w = (issued.iter())
                .filter(|(_, x)| !x.1)
                .map(|(&i, _)| i)
                .collect();
        }
        w.sort_unstable();
        w
    };
    for _ in 0..n {
        let ready: Vec<usize> = (0..n)
            .filter(|&j| !done[j] && preds[j].iter().all(|&i| done[i]))
            .collect();
        let free = |j: &usize| unwaited(*j, &issued).is_empty();
        let pick = (ready.iter().copied().find(|&j| aside[j]))
            .or_else(|| {
                (ready.iter().copied())
                    .filter(|j| free(j) && depth[*j].is_some())
                    .min_by_key(|&j| (depth[j], j))
            })
            .or_else(|| ready.iter().copied().find(free))
            .or_else(|| ready.first().copied())
            .expect("a dependency graph in program order always has a ready node");
        for i in unwaited(pick, &issued) {
            let (mark, waited) = issued.get_mut(&i).expect("an issued collective");
            out.push(Node::Synchronize { stream: *mark });
            *waited = true;
        }
        let mut run = nodes[pick].take().expect("each node is scheduled once");
        done[pick] = true;
        if aside[pick] {
            let node = run.pop().expect("an aside collective is a run of its own");
            let mark = s.marks[next_mark % s.marks.len()];
            next_mark += 1;
            out.extend([
                Node::SetCurrentStream {
                    stream: s.collectives,
                },
                Node::Synchronize { stream: s.main },
                node,
                Node::SetCurrentStream { stream: mark },
                Node::Synchronize {
                    stream: s.collectives,
                },
                Node::SetCurrentStream { stream: s.main },
            ]);
            issued.insert(pick, (mark, false));
        } else {
            out.append(&mut run);
        }
    }
    // The call ends when its collectives have.
    let mut left: Vec<(usize, StreamId)> = (issued.iter())
        .filter(|(_, x)| !x.1)
        .map(|(&i, x)| (i, x.0))
        .collect();
    left.sort_unstable();
    out.extend(
        left.into_iter()
            .map(|(_, stream)| Node::Synchronize { stream }),
    );
    out
}

/// Where the current stream is after a top-level node runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Current {
    /// The main stream (every captured stream of the program is the main stream: they
    /// are captured at the top level, where it is current).
    Main,
    /// Another one, or not known (a loop that may run no iteration, branches that differ).
    Other,
}

/// Whether the main stream is current again after `n` (it was before).
fn leaves_main_current(p: &HostProgram, n: &Node) -> bool {
    fn after(p: &HostProgram, nodes: &[Node], mut cur: Current) -> Current {
        for n in nodes {
            cur = match n {
                Node::SetCurrentStream { stream } => match p.streams[stream.index()] {
                    StreamDef::Captured => Current::Main,
                    _ => Current::Other,
                },
                Node::IfThenElse {
                    then_body,
                    else_body,
                    ..
                } => {
                    let (a, b) = (after(p, then_body, cur), after(p, else_body, cur));
                    if a == b {
                        a
                    } else {
                        Current::Other
                    }
                }
                Node::ForLoop(l) => {
                    if after(p, &l.body, cur) == cur {
                        cur
                    } else {
                        Current::Other
                    }
                }
                _ => cur,
            };
        }
        cur
    }
    after(p, std::slice::from_ref(n), Current::Main) == Current::Main
}

/// Whether `n` switches to or waits for a stream other than the main one (a pool or
/// compute stream), so that work may run on it.
fn uses_workers(p: &HostProgram, n: &Node) -> bool {
    let mut hit = false;
    crate::hir::for_each_node(std::slice::from_ref(n), &mut |m| {
        if let Node::SetCurrentStream { stream } | Node::Synchronize { stream } = m {
            hit |= p.streams[stream.index()] != StreamDef::Captured;
        }
    });
    hit
}
