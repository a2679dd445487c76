//! The scalars and streams of a gather-scatter loop: the unit `i`, its step, rows and
//! chunk, those of the next unit, the ring's neighbours and the step predicates.

use crate::hir::{HostProgram, StreamId};
use crate::ir::{IterDomainId, NamedScalar, ScalarId, ScalarOp};
use crate::pass::stream_parallel_type::group::LoopGroup;

/// The scalars of the loop: the unit `i`, its step, rows and chunk, and those of the next
/// unit, the ring's neighbours and the step predicates.
pub(super) struct UnitScalars {
    pub(super) index: ScalarId,
    pub(super) rank: ScalarId,
    pub(super) zero: ScalarId,
    pub(super) one: ScalarId,
    pub(super) two: ScalarId,
    /// The number of row ranges per chunk, `c`.
    pub(super) count: ScalarId,
    pub(super) loop_axis: IterDomainId,
    pub(super) stop: ScalarId,
    /// Unit `i`: step `j = i / c`, rows `i % c`, chunk `(r + D - j) % D`.
    pub(super) step: ScalarId,
    pub(super) sub: ScalarId,
    pub(super) chunk: ScalarId,
    /// The pool stream of unit `i`, and its slot of the gathered rows (`i % 2`).
    pub(super) pool_index: ScalarId,
    pub(super) slot_index: ScalarId,
    /// Unit `i + 1`: rows, chunk, the device that gathers this device's rows then, its
    /// pool stream and its slot.
    pub(super) next_sub: ScalarId,
    pub(super) next_chunk: ScalarId,
    pub(super) next_up: ScalarId,
    pub(super) next_pool: ScalarId,
    pub(super) next_slot: ScalarId,
    /// Nonzero when unit `i + 1` gathers nothing (a local step, or the final one).
    pub(super) no_prefetch: ScalarId,
    pub(super) is_own: ScalarId,
    pub(super) is_final: ScalarId,
    pub(super) is_first_sum: ScalarId,
    /// The ring step of the running sum unit `i` adds onto (`j - 1`).
    pub(super) sum_step: ScalarId,
    /// The neighbours: running sums come from `r - 1` and go to `r + 1`.
    pub(super) from: ScalarId,
    pub(super) to: ScalarId,
    /// The pool stream of unit `i - c`, whose exchange received this unit's running sum.
    pub(super) arrived_index: ScalarId,
}

impl UnitScalars {
    pub(super) fn new(p: &mut HostProgram, g: &LoopGroup, c: usize) -> Self {
        let f = &mut p.ir;
        let index = f.loop_index("StreamIdx");
        let n = f.named(NamedScalar::NumberOfStreams);
        let rank = f.named(NamedScalar::Rank);
        let (zero, one, two) = (f.constant(0), f.constant(1), f.constant(2));
        let d = g.extent;
        let cc = f.constant(c as i64);
        let d_plus_1 = f.binary(ScalarOp::Add, d, one);
        let stop = f.binary(ScalarOp::Mul, d_plus_1, cc);
        let mut dom = f.iter_domain(g.axis).clone();
        dom.extent = stop;
        let loop_axis = f.add_iter_domain(dom);
        let rank_plus_d = f.binary(ScalarOp::Add, rank, d);
        let step = f.binary(ScalarOp::Div, index, cc);
        let sub = f.binary(ScalarOp::Mod, index, cc);
        let chunk = {
            let back = f.binary(ScalarOp::Sub, rank_plus_d, step);
            f.binary(ScalarOp::Mod, back, d)
        };
        let pool_index = f.binary(ScalarOp::Mod, index, n);
        let slot_index = f.binary(ScalarOp::Mod, index, two);
        let next = f.binary(ScalarOp::Add, index, one);
        let next_step = f.binary(ScalarOp::Div, next, cc);
        let next_sub = f.binary(ScalarOp::Mod, next, cc);
        let next_chunk = {
            let back = f.binary(ScalarOp::Sub, rank_plus_d, next_step);
            f.binary(ScalarOp::Mod, back, d)
        };
        let next_up = {
            let up = f.binary(ScalarOp::Add, rank, next_step);
            f.binary(ScalarOp::Mod, up, d)
        };
        let next_pool = f.binary(ScalarOp::Mod, next, n);
        let next_slot = f.binary(ScalarOp::Mod, next, two);
        // The next unit gathers unless it is a local step (0) or the final one (D);
        // next_step is at most D + 1 < 2 D, so `next_step / D` is 1 exactly there.
        let no_prefetch = {
            let local = f.binary(ScalarOp::Eq, next_step, zero);
            let past = f.binary(ScalarOp::Div, next_step, d);
            f.binary(ScalarOp::Add, local, past)
        };
        let is_own = f.binary(ScalarOp::Eq, step, zero);
        let is_final = f.binary(ScalarOp::Eq, step, d);
        let is_first_sum = f.binary(ScalarOp::Eq, step, one);
        let sum_step = f.binary(ScalarOp::Sub, step, one);
        let from = {
            let back = f.binary(ScalarOp::Sub, rank_plus_d, one);
            f.binary(ScalarOp::Mod, back, d)
        };
        let to = {
            let up = f.binary(ScalarOp::Add, rank, one);
            f.binary(ScalarOp::Mod, up, d)
        };
        // Kept non-negative: i + c (n - 1) = i - c mod n.
        let arrived_index = {
            let n1 = f.binary(ScalarOp::Sub, n, one);
            let cn1 = f.binary(ScalarOp::Mul, cc, n1);
            let back = f.binary(ScalarOp::Add, index, cn1);
            f.binary(ScalarOp::Mod, back, n)
        };
        UnitScalars {
            index,
            rank,
            zero,
            one,
            two,
            count: cc,
            loop_axis,
            stop,
            step,
            sub,
            chunk,
            pool_index,
            slot_index,
            next_sub,
            next_chunk,
            next_up,
            next_pool,
            next_slot,
            no_prefetch,
            is_own,
            is_final,
            is_first_sum,
            sum_step,
            from,
            to,
            arrived_index,
        }
    }
}

/// The streams of the loop: the caller's, the pool streams of units `i` and `i + 1`, and
/// the pool stream that received unit `i`'s running sum.
pub(super) struct UnitStreams {
    pub(super) original: StreamId,
    pub(super) worker: StreamId,
    pub(super) next_worker: StreamId,
    pub(super) arrived: StreamId,
}
