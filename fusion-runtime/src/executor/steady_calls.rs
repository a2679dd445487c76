//! The steady call's shortcut: a rank that calls a fusion again with inputs of the same
//! dtypes, shapes and shard tags and the same options runs the program and plan its last
//! such call ran, without binding the inputs, looking the program up or asking the plan
//! choice again (on 4 H100s those two took 6-16 us of a replayed call's 9-22 us of setup in
//! a decode step, `bench/results/2026-11-27-0805-allreduce-blocks-candle-phases-h100x4/`).
//!
//! What the shortcut skips depends on nothing else: binding is a function of the inputs'
//! dtypes, shapes and shard tags, the program of those and the options, the plan of those
//! once decided. So a call is kept only where that holds: its plan was already decided
//! before it (no tuning in the call), and binding exchanged no extents with the peers
//! (every input on every rank; an exchange must run on every rank alike).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use fusion_compiler::DType;

use super::lowering::Lowered;
use super::options::ExecOptions;
use super::plan_choice::PlanReport;
use crate::comm::Communicator;
use crate::eval::SymbolBindings;
use crate::tensor::{ShardTag, Tensor};
use crate::world::Rank;

/// What a steady call runs: the program and plan of the last call with its signature.
pub(super) struct SteadyCall {
    /// The inputs' dtypes, shapes and shard tags, in order.
    inputs: Vec<(DType, Vec<usize>, Option<ShardTag>)>,
    /// The options the caller gave.
    given: ExecOptions,
    /// The call ledger's fingerprint of the prepared (unplanned) program.
    pub(super) fingerprint: Option<u64>,
    pub(super) symbols: SymbolBindings,
    /// The program of the chosen plan, and the options it runs with.
    pub(super) lowered: Lowered,
    pub(super) options: ExecOptions,
    pub(super) report: Option<Arc<PlanReport>>,
}

impl SteadyCall {
    /// A call of `inputs` with `given` options that ran `lowered` with `options`.
    pub(super) fn new(
        inputs: &[&Tensor],
        given: &ExecOptions,
        fingerprint: Option<u64>,
        symbols: SymbolBindings,
        lowered: Lowered,
        options: ExecOptions,
        report: Option<Arc<PlanReport>>,
    ) -> SteadyCall {
        SteadyCall {
            inputs: (inputs.iter())
                .map(|t| (t.dtype(), t.shape().to_vec(), t.shard_tag()))
                .collect(),
            given: given.clone(),
            fingerprint,
            symbols,
            lowered,
            options,
            report,
        }
    }

    /// Whether a call of `inputs` with `given` options has this call's signature.
    fn matches(&self, inputs: &[&Tensor], given: &ExecOptions) -> bool {
        self.inputs.len() == inputs.len()
            && (self.inputs.iter().zip(inputs)).all(|((dtype, shape, tag), t)| {
                *dtype == t.dtype() && shape.as_slice() == t.shape() && *tag == t.shard_tag()
            })
            && self.given == *given
    }
}

/// How many signatures a rank keeps (e.g. a prefill's and a decode step's, of each
/// token count served): the oldest goes first.
const KEPT_PER_RANK: usize = 8;

/// Each rank's last steady calls of distinct signatures, newest first, per world and
/// communicator (a recovered world's calls start afresh), with the communicator: those
/// of communicators that are gone (their `World::run` ended) are dropped when another
/// rank or world keeps its first, so a run per step does not keep every step's calls.
#[derive(Default)]
pub(super) struct SteadyCalls {
    last: Mutex<HashMap<(usize, u64, u64), RankCalls>>,
}

/// A rank's steady calls and its communicator.
type RankCalls = (Weak<dyn Communicator>, Vec<Arc<SteadyCall>>);

impl SteadyCalls {
    fn key(rank: &Rank) -> (usize, u64, u64) {
        (
            rank.index(),
            rank.world_shared().id,
            rank.communicator().instance(),
        )
    }

    /// How many calls are kept, over every rank and world.
    pub(super) fn len(&self) -> usize {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        last.values().map(|(_, calls)| calls.len()).sum()
    }

    /// The steady call of `rank` whose signature a call of `inputs` with `given` options
    /// has, if one is kept.
    pub(super) fn find(
        &self,
        rank: &Rank,
        inputs: &[&Tensor],
        given: &ExecOptions,
    ) -> Option<Arc<SteadyCall>> {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let (_, calls) = last.get(&Self::key(rank))?;
        calls.iter().find(|c| c.matches(inputs, given)).cloned()
    }

    /// Keeps `call` as `rank`'s newest steady call (in place of one of its signature).
    pub(super) fn keep(&self, rank: &Rank, call: Arc<SteadyCall>) {
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        let key = Self::key(rank);
        if !last.contains_key(&key) {
            last.retain(|_, (comm, _)| comm.strong_count() > 0);
        }
        let comm = Arc::downgrade(&rank.communicator());
        let (_, calls) = last.entry(key).or_insert_with(|| (comm, Vec::new()));
        calls.retain(|c| !(c.inputs == call.inputs && c.given == call.given));
        calls.insert(0, call);
        calls.truncate(KEPT_PER_RANK);
    }
}
