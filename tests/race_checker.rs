//! The stream-order race checker (`fusion::runtime::eval::race`) over the lowered programs:
//!
//! - every conformance case under every lowering variant that applies to it (stream
//!   counts 1-4, stream buffers and compute-first streams on and off, both transports,
//!   both P2P schedules, the direct and ring reduce-scatter pipelines in 1-3 row ranges)
//!   runs with the checker on and reports nothing, with the right numbers;
//! - mutation tests: removing any single `Synchronize` or `Wait` node from a lowered
//!   program either makes the checker report a race, or provably changes nothing: the
//!   happens-before relation between all the call's accesses (every event's vector clock)
//!   is identical with and without the node. The one other outcome allowed is a removal
//!   that changes the order without a race in one instance while removing the same node
//!   of the same lowering is reported at another world size or stream count (a wait
//!   before reusing a stream-buffer slot that few chunks never reuse), and, in the
//!   one-device programs of communicating fusions (no pipelines: everything runs locally),
//!   a race-free change of order (counted and printed). Anything else fails the test, and
//!   so does a pipeline whose main loop loses no synchronization the checker catches.

mod common;

use std::collections::{HashMap, HashSet};

use common::variants::{catalog, variants, Case, Family};
use common::*;
use fusion::compiler::hir::{for_each_node, for_each_node_mut, HostProgram, Node};
use fusion::compiler::lower::lower;
use fusion::runtime::eval::race::{AccessKind, RaceError};
use fusion::runtime::eval::{bind_inputs, execute, CallContext, RaceCheck};
use fusion::{Error, ExecOptions, Tensor, World};

/// The worlds the variant grid and the mutations run on.
const GRID_DEVICES: [usize; 4] = [1, 2, 3, 4];

fn seed(d: usize) -> u64 {
    test_seed_base().wrapping_mul(1_000_003) + 500 + d as u64
}

#[test]
fn every_case_and_lowering_variant_runs_race_free() {
    let mut runs = 0;
    let mut programs = HashSet::new();
    let mut failures = Vec::new();
    for case in catalog() {
        for d in GRID_DEVICES.into_iter().filter(|&d| d >= case.min_devices) {
            if !runnable(d) {
                continue;
            }
            let inputs = (case.inputs)(d, seed(d));
            let full: Vec<Tensor> = inputs.iter().map(|i| i.0.clone()).collect();
            let expected = (case.reference)(&full);
            for (label, opts) in variants(case.family) {
                let what = format!("{} on {d} devices, {label}", case.name);
                runs += 1;
                match try_run(&(case.fusion)(), d, &inputs, &[(case.take)(d)], &opts) {
                    Ok(r) => {
                        programs.insert((r.program.to_string(), opts.number_of_streams));
                        assert_close(&expected, &r.outputs[0], tolerance(), &what);
                    }
                    Err(e) => failures.push(format!("{what}: {e}")),
                }
            }
        }
    }
    println!(
        "{runs} runs of {} distinct programs, race-checked",
        programs.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------- mutations

fn is_sync(n: &Node) -> bool {
    matches!(n, Node::Synchronize { .. } | Node::Wait { .. })
}

fn sync_count(nodes: &[Node]) -> usize {
    let mut n = 0;
    for_each_node(nodes, &mut |x| n += usize::from(is_sync(x)));
    n
}

/// `p` without its `k`-th synchronization node (`Synchronize` or `Wait`), counting in
/// the order `for_each_node_mut` visits node lists.
fn without_sync(p: &HostProgram, k: usize) -> HostProgram {
    let mut q = p.clone();
    let mut seen = 0;
    for_each_node_mut(&mut q.body, &mut |list| {
        let mut i = 0;
        while i < list.len() {
            if is_sync(&list[i]) {
                seen += 1;
                if seen == k + 1 {
                    list.remove(i);
                    continue;
                }
            }
            i += 1;
        }
        Ok(())
    })
    .expect("removing a node cannot fail");
    q
}

/// The synchronization nodes of `p`, in `without_sync`'s order.
fn sync_nodes(p: &HostProgram) -> Vec<Node> {
    let mut q = p.clone();
    let mut found = Vec::new();
    for_each_node_mut(&mut q.body, &mut |list| {
        found.extend(list.iter().filter(|n| is_sync(n)).cloned());
        Ok(())
    })
    .expect("visiting cannot fail");
    found
}

/// For each synchronization node, in `without_sync`'s order, the index of the
/// top-level node that holds it.
fn sync_owners(p: &HostProgram) -> Vec<usize> {
    // `for_each_node_mut` visits the top-level list first, then each top-level node's
    // nested lists in order: top-level syncs come first.
    let mut owners: Vec<usize> = p
        .body
        .iter()
        .enumerate()
        .filter(|(_, n)| is_sync(n))
        .map(|(i, _)| i)
        .collect();
    for (i, n) in p.body.iter().enumerate() {
        for child in n.children() {
            owners.extend(std::iter::repeat_n(i, sync_count(child)));
        }
    }
    owners
}

/// The top-level loop with the most nodes (the pipeline; the others set up or join
/// streams).
fn main_loop(p: &HostProgram) -> Option<usize> {
    p.body
        .iter()
        .enumerate()
        .filter(|(_, n)| matches!(n, Node::ForLoop(_)))
        .max_by_key(|(_, n)| {
            let mut c = 0;
            for_each_node(std::slice::from_ref(*n), &mut |_| c += 1);
            c
        })
        .map(|(i, _)| i)
}

/// Runs `p` on every rank of a world of `world`'s size with the race checker; the order
/// each rank checked. A fresh world each time: a race fails the world that found it, for
/// good, and the mutations below race on purpose.
fn run_checked(
    world: &World,
    p: &HostProgram,
    inputs: &[(Tensor, Give)],
    streams: usize,
) -> fusion::Result<Vec<RaceCheck>> {
    let world = World::local(world.size())?;
    world.run(|rank| {
        let local = distribute(rank, inputs)?;
        let refs: Vec<&Tensor> = local.iter().collect();
        let symbols = bind_inputs(&p.ir, &p.inputs, &refs, rank.index(), world.size())?;
        let comm = rank.communicator();
        let ctx = CallContext {
            device: rank.device(),
            comm: &*comm,
            rank: rank.index(),
            number_of_streams: streams,
            trace: false,
            trace_nodes: false,
            shared_receives: false,
            kept_receives: None,
            race_check: true,
        };
        let ex = execute(p, &ctx, &symbols, &refs, None)?;
        ex.race
            .ok_or_else(|| Error::World("the race checker did not run".into()))
    })
}

/// What removing one synchronization node did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// The checker reported a race.
    Caught,
    /// No race, and every event's vector clock is unchanged on every rank: the node was
    /// redundant.
    Redundant,
    /// No race, but the order changed: the node orders nothing that conflicts in this
    /// instance. It passes only if removing the same node of the same lowering is caught
    /// at another world size or stream count (e.g. a wait before reusing a stream-buffer
    /// slot that this many chunks never reuse).
    NeededElsewhere,
}

#[derive(Default)]
struct Tally {
    programs: usize,
    mutations: usize,
    caught: usize,
    redundant: usize,
    needed_elsewhere: usize,
    /// Race-free order changes in one-device programs of communicating families (which
    /// run everything locally and are not pipelines).
    one_device: usize,
}

/// One synchronization node of one lowering, across world sizes and stream counts: the
/// case, the lowering options, its index among the program's synchronization nodes, how
/// many there are, and its form.
type NodeKey = (String, String, usize, usize, String);

/// Every mutation of every distinct program of `family`'s cases and variants.
fn mutate_family(family: Family) -> Tally {
    let mut tally = Tally::default();
    let mut seen = HashSet::new();
    let mut problems = Vec::new();
    let mut by_node: HashMap<NodeKey, Vec<(Outcome, String)>> = HashMap::new();
    let cases: Vec<Case> = catalog()
        .into_iter()
        .filter(|c| c.family == family)
        .collect();
    for case in &cases {
        for d in GRID_DEVICES.into_iter().filter(|&d| d >= case.min_devices) {
            let world = World::local(d).expect("a simulated world");
            let inputs = (case.inputs)(d, seed(d));
            for (label, opts) in variants(family) {
                let p = lower(&(case.fusion)(), d, &opts.lower)
                    .unwrap_or_else(|e| panic!("{} on {d} devices, {label}: {e}", case.name))
                    .program;
                if !seen.insert((p.to_string(), opts.number_of_streams, d)) {
                    continue;
                }
                let what = format!("{} on {d} devices, {label}", case.name);
                // On one device a communicating pipeline degenerates to local work on
                // the caller's stream, which needs no synchronization.
                let pipelined = d > 1 || family == Family::Local;
                match check_mutations(&world, &p, &inputs, &opts, pipelined) {
                    Ok(outcomes) => {
                        tally.programs += 1;
                        let nodes = sync_nodes(&p);
                        for (k, outcome) in outcomes.into_iter().enumerate() {
                            tally.mutations += 1;
                            match outcome {
                                Outcome::Caught => tally.caught += 1,
                                Outcome::Redundant => tally.redundant += 1,
                                Outcome::NeededElsewhere if pipelined => {
                                    tally.needed_elsewhere += 1
                                }
                                Outcome::NeededElsewhere => {}
                            }
                            // A one-device program of a communicating family is no
                            // pipeline: its syncs must be caught or redundant only where
                            // it pipelines (below), not tied to other sizes' programs.
                            if outcome == Outcome::NeededElsewhere && !pipelined {
                                tally.one_device += 1;
                                continue;
                            }
                            let key = (
                                case.name.to_string(),
                                format!("{:?}", opts.lower),
                                k,
                                nodes.len(),
                                format!("{:?}", nodes[k]),
                            );
                            by_node
                                .entry(key)
                                .or_default()
                                .push((outcome, what.clone()));
                        }
                    }
                    Err(e) => problems.push(format!("{what}: {e}")),
                }
            }
        }
    }
    for ((_, _, k, _, node), outcomes) in &by_node {
        let caught = outcomes.iter().any(|o| o.0 == Outcome::Caught);
        for (o, what) in outcomes {
            if *o == Outcome::NeededElsewhere && !caught {
                problems.push(format!(
                    "{what}: removing synchronization node {k} ({node}) changes the \
                     happens-before order without a race report, and removing it is caught \
                     at no other world size or stream count"
                ));
            }
        }
    }
    println!(
        "{family:?}: {} programs, {} single-node removals: {} caught, {} provably redundant, \
         {} race-free here but caught at another world size or stream count, {} race-free \
         on one device",
        tally.programs,
        tally.mutations,
        tally.caught,
        tally.redundant,
        tally.needed_elsewhere,
        tally.one_device
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    tally
}

/// Removes each synchronization node of `p` in turn; returns what each removal did, or
/// what went wrong: another error than a race, or (when `pipelined`) a main loop none of
/// whose synchronizations the checker needs.
fn check_mutations(
    world: &World,
    p: &HostProgram,
    inputs: &[(Tensor, Give)],
    opts: &ExecOptions,
    pipelined: bool,
) -> Result<Vec<Outcome>, String> {
    let streams = opts.number_of_streams;
    let base = run_checked(world, p, inputs, streams)
        .map_err(|e| format!("the program itself fails: {e}"))?;
    let owners = sync_owners(p);
    let main = main_loop(p);
    let mut outcomes = Vec::new();
    let mut caught_in_main = 0;
    for (k, &owner) in owners.iter().enumerate() {
        let q = without_sync(p, k);
        let outcome = match run_checked(world, &q, inputs, streams) {
            Err(Error::Race(_)) => Outcome::Caught,
            Ok(order) if order == base => Outcome::Redundant,
            Ok(_) => Outcome::NeededElsewhere,
            Err(e) => return Err(format!("removing synchronization node {k}: {e}")),
        };
        caught_in_main += usize::from(outcome == Outcome::Caught && Some(owner) == main);
        outcomes.push(outcome);
    }
    if pipelined && main.is_some() && caught_in_main == 0 {
        return Err(format!(
            "no synchronization of the main loop is needed:\n{p}"
        ));
    }
    Ok(outcomes)
}

#[test]
fn mutations_of_local_stream_loops() {
    let t = mutate_family(Family::Local);
    assert!(t.caught > 0 && t.programs > 0);
}

#[test]
fn mutations_of_collective_pipelines() {
    let t = mutate_family(Family::Collective);
    assert!(t.caught > 0 && t.programs > 0);
}

#[test]
fn mutations_of_p2p_allgather_pipelines() {
    let t = mutate_family(Family::P2pAllgather);
    assert!(t.caught > 0 && t.programs > 0);
}

#[test]
fn mutations_of_layer_blocks() {
    let t = mutate_family(Family::Layers);
    assert!(t.caught > 0 && t.programs > 0);
}

#[test]
fn mutations_of_p2p_reduce_scatter_pipelines() {
    let t = mutate_family(Family::P2pReduceScatter);
    assert!(t.caught > 0 && t.programs > 0);
}

// ---------------------------------------------------------------- what a report says

/// The P2P allgather + GEMM pipeline on 2 devices and its inputs.
fn ag_matmul_p2p_on_two() -> (World, HostProgram, Vec<(Tensor, Give)>) {
    let f = cases::ag_matmul_p2p(test_dtype());
    let p = lower(&f, 2, &Default::default()).unwrap().program;
    let inputs = vec![
        (Tensor::randn(&[2, 4, 8], test_dtype(), 1), Give::Shard(0)),
        (Tensor::randn(&[8, 3], test_dtype(), 2), Give::Whole),
    ];
    (World::local(2).unwrap(), p, inputs)
}

#[test]
fn a_report_names_the_node_tensor_region_and_both_streams() {
    let (world, p, inputs) = ag_matmul_p2p_on_two();
    // Node 0: the first loop's `Synchronize Stream 0` (pool streams wait for the caller).
    let err = match run_checked(&world, &without_sync(&p, 0), &inputs, 4) {
        Err(Error::Race(e)) => *e,
        other => panic!("expected a race, got {other:?}"),
    };
    let (later, earlier) = (err.later(), err.earlier().expect("an earlier access"));
    assert!(later.node.contains("matmul"), "{err}");
    assert_eq!((later.access, later.stream), (AccessKind::Read, 1), "{err}");
    assert_eq!(
        (earlier.access, earlier.stream),
        (AccessKind::Caller, 0),
        "{err}"
    );
    let text = err.to_string();
    assert!(text.contains("StreamIdx = 0"), "the iteration: {text}");
    assert!(text.contains("bytes ["), "the region: {text}");
    assert!(text.contains("caller's buffer of a"), "the buffer: {text}");
    assert!(matches!(err, RaceError::Unordered { .. }), "{err}");
}

#[test]
fn a_missing_join_is_reported_at_the_end_of_the_call() {
    let (world, p, inputs) = ag_matmul_p2p_on_two();
    // Without the deallocation, the only use of the main loop's final join is that the
    // caller's stream is ordered after the output's writes.
    let mut q = p.clone();
    q.body.retain(|n| !matches!(n, Node::Deallocate { .. }));
    let main = main_loop(&q);
    let join = sync_nodes(&q)
        .iter()
        .zip(sync_owners(&q))
        .position(|(n, owner)| matches!(n, Node::Synchronize { .. }) && Some(owner) == main)
        .expect("the main loop joins its stream");
    let err = match run_checked(&world, &without_sync(&q, join), &inputs, 4) {
        Err(Error::Race(e)) => *e,
        other => panic!("expected a race, got {other:?}"),
    };
    // The first access the caller's stream is not ordered after: the first GEMM of the
    // loop, on pool stream 1.
    assert!(matches!(err, RaceError::NotJoined { .. }), "{err}");
    assert!(err.later().node.contains("matmul"), "{err}");
    assert_eq!(err.later().stream, 1, "{err}");
    assert!(err.earlier().is_none());
}

#[test]
fn the_options_flag_runs_the_checker_and_reports_its_order() {
    let (world, _, inputs) = ag_matmul_p2p_on_two();
    let exec = fusion::FusionExecutor::new(cases::ag_matmul_p2p(test_dtype()));
    for race_check in [false, true] {
        let opts = ExecOptions {
            race_check,
            ..ExecOptions::default()
        };
        let checked = world
            .run(|rank| {
                let local = distribute(rank, &inputs)?;
                let refs: Vec<&Tensor> = local.iter().collect();
                Ok(exec.run_with(rank, &refs, None, &opts)?.race)
            })
            .unwrap();
        for c in checked {
            match (race_check, c) {
                (true, Some(c)) => {
                    assert!(c.accesses() > 0 && c.ordered_pairs() > 0);
                    assert!(c.events() > 2, "more than the call's start and end");
                }
                (false, None) => {}
                (on, c) => panic!("race_check {on}: {c:?}"),
            }
        }
    }
}
