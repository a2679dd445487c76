//! A GEMM with the Allreduce of its product in its epilogue (`Node::GemmAllreduce`,
//! `lower::gemm_allreduce`).
//!
//! Where the communicator runs the pair as one kernel ([`Communicator::gemm_allreduce`]) it
//! gets the GEMM's operands and the Allreduce's output, and the race checker sees the call
//! read the operands and write the output. Anywhere else (the CPU backend, operands the
//! kernel cannot take) the walk runs what the node replaced: the GEMM into a buffer of its
//! own, the Allreduce of it, and the buffer's release.
//!
//! [`Communicator::gemm_allreduce`]: crate::comm::Communicator::gemm_allreduce

use fusion_compiler::hir::{Communication, GemmAllreduce};
use fusion_compiler::ir::Expr;

use super::evaluator::Evaluator;
use crate::error::Result;

impl Evaluator<'_> {
    /// `GemmAllreduce`: one kernel where the communicator runs it, else the GEMM, then the
    /// Allreduce.
    pub(super) fn gemm_allreduce(&mut self, g: &GemmAllreduce) -> Result<()> {
        let c = &g.comm;
        if !c.team.contains(&self.ctx.rank) {
            return Ok(());
        }
        let [a, b] = g.gemm.inputs[..] else {
            return self.unfused(g);
        };
        let (a_t, b_t) = (self.get(a)?.clone(), self.get(b)?.clone());
        let addend = g.addend().map(|x| self.get(x).cloned()).transpose()?;
        let output = self.get_or_allocate(g.result())?;
        let start = self.mark()?;
        if !self
            .ctx
            .comm
            .gemm_allreduce(self.current, c, [&a_t, &b_t], addend.as_ref(), &output)?
        {
            return self.unfused(g);
        }
        self.traced(start, "GEMM + Allreduce", true)?;
        let reads: Vec<_> = [a, b].into_iter().chain(g.addend()).collect();
        self.record_access(&reads, &[g.result()])?;
        self.comm_streams.insert(c.id, self.current);
        Ok(())
    }

    /// The GEMM into a buffer of its own, the Allreduce of it, the buffer's release; then
    /// the residual add, if any, from a buffer of its own for the sum.
    fn unfused(&mut self, g: &GemmAllreduce) -> Result<()> {
        self.gemm_then_collective(&g.gemm, &g.comm)?;
        if let Some(add) = &g.residual {
            if let Some(&s) = self.comm_streams.get(&g.comm.id) {
                self.wait_for(s)?;
            }
            let start = self.mark()?;
            self.compute(add)?;
            self.record_access(&add.inputs, &[add.output])?;
            self.traced(start, &add.op.name(), false)?;
            self.deallocate(g.comm.output);
        }
        Ok(())
    }

    /// What a fused GEMM + collective node replaced, where no kernel runs it: the GEMM into
    /// a buffer of its own, the collective of it, the buffer's release.
    pub(super) fn gemm_then_collective(&mut self, gemm: &Expr, comm: &Communication) -> Result<()> {
        let start = self.mark()?;
        self.compute(gemm)?;
        self.record_access(&gemm.inputs, &[gemm.output])?;
        self.traced(start, &gemm.op.name(), false)?;
        self.communication(comm)?;
        self.deallocate(gemm.output);
        Ok(())
    }
}
