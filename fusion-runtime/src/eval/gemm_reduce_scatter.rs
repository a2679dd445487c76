//! A GEMM with the ReduceScatter of its product in its epilogue (`Node::GemmReduceScatter`,
//! `lower::gemm_reduce_scatter`).
//!
//! Where the device runs the pair as one kernel ([`Device::launch_scattered_gemm`], over
//! the links of a world whose ranks reach each other's memory:
//! [`Communicator::scatter_links`]) it gets the GEMM's operands and the ReduceScatter's
//! output, and the race checker sees the call read the operands and write the output.
//! Anywhere else (the CPU backend, operands the kernel cannot take, a world of several
//! processes) the walk runs what the node replaced: the GEMM into a buffer of its own, the
//! ReduceScatter of it, and the buffer's release.
//!
//! [`Device::launch_scattered_gemm`]: crate::device::Device::launch_scattered_gemm
//! [`Communicator::scatter_links`]: crate::comm::Communicator::scatter_links

use fusion_compiler::hir::GemmReduceScatter;

use super::evaluator::Evaluator;
use crate::device::ScatteredGemmCall;
use crate::error::Result;

impl Evaluator<'_> {
    /// `GemmReduceScatter`: one kernel where the device runs it, else the GEMM, then the
    /// ReduceScatter.
    pub(super) fn gemm_reduce_scatter(&mut self, g: &GemmReduceScatter) -> Result<()> {
        let c = &g.comm;
        let Some(rank) = c.team.iter().position(|&r| r == self.ctx.rank) else {
            return Ok(());
        };
        let (Some(links), &[a, b]) = (self.ctx.comm.scatter_links(), &g.gemm.inputs[..]) else {
            return self.scattered_apart(g);
        };
        let (a_t, b_t) = (self.get(a)?.clone(), self.get(b)?.clone());
        let output = self.get_or_allocate(c.output)?;
        let call = ScatteredGemmCall {
            a: &a_t,
            b: &b_t,
            output: &output,
            rank,
            world: c.team.len(),
        };
        let start = self.mark()?;
        if !self
            .ctx
            .device
            .launch_scattered_gemm(self.current, &call, &links)?
        {
            return self.scattered_apart(g);
        }
        self.traced(start, "GEMM + ReduceScatter", true)?;
        self.record_access(&[a, b], &[c.output])?;
        self.comm_streams.insert(c.id, self.current);
        Ok(())
    }

    /// The GEMM into a buffer of its own, the ReduceScatter of it, the buffer's release.
    fn scattered_apart(&mut self, g: &GemmReduceScatter) -> Result<()> {
        self.gemm_then_collective(&g.gemm, &g.comm)
    }
}
