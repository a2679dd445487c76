//! The nodes of a fused AllGather+GEMM (`lower::gathered_gemm`): its launch, the blocks the
//! loop says have landed, and its join.
//!
//! A device that runs such a GEMM as one kernel ([`Device::launch_gathered_gemm`]) gets
//! the launch and every ready block, and the join is stream order. Any other device (the
//! CPU backend) gets nothing until the join, where every block's GEMM runs on the joining
//! stream: this rank's block from `own`, every other from its landed rows. Either way the
//! walk checks that each peer's block was said ready once, before the join, and the race
//! checker sees the GEMM read `own` and `b` and write the output from the launch on, read
//! each block where it is said ready, and read and write everything at the join.
//!
//! [`Device::launch_gathered_gemm`]: crate::device::Device::launch_gathered_gemm

use fusion_compiler::hir::{GatheredGemm, GatheredGemmId};
use fusion_compiler::ir::{Expr, Op, ScalarId, TensorId};

use super::compute::GemmExtras;
use super::evaluator::Evaluator;
use super::launched_gemm::Launched;
use crate::device::GatheredGemmCall;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Evaluator<'_> {
    /// `GatheredGemmLaunch`: binds the operands and launches the GEMM where the device runs
    /// it as one kernel.
    pub(super) fn gathered_gemm_launch(&mut self, g: &GatheredGemm) -> Result<()> {
        if !self.in_mesh[g.output.index()] {
            return Ok(());
        }
        let gathered = self.get_or_allocate(g.gathered)?;
        let output = self.get_or_allocate(g.output)?;
        let (own, b) = (self.get(g.own)?.clone(), self.get(g.b)?.clone());
        let (rank, world) = (self.ctx.rank, self.p.world_size);
        for (what, t) in [("gathered rows", &gathered), ("output", &output)] {
            if t.shape().first() != Some(&world) {
                return Err(self.gathered_error(
                    g.id,
                    format!("its {what} {:?} do not have one block per rank", t.shape()),
                ));
            }
        }
        let call = GatheredGemmCall {
            id: g.id.index(),
            gathered: &gathered,
            own: &own,
            b: &b,
            output: &output,
            rank,
            world,
        };
        let start = self.mark()?;
        let on_device = self.ctx.device.launch_gathered_gemm(self.current, &call)?;
        self.traced(start, "gathered GEMM launch", false)?;
        self.record_access(&[g.own, g.b], &[g.output])?;
        let mut ready = vec![false; world];
        ready[rank] = true;
        self.gathered.insert(
            g.id,
            Launched {
                node: g.clone(),
                stream: self.current,
                on_device,
                gathered,
                own,
                b,
                output,
                ready,
            },
        );
        Ok(())
    }

    /// `RowsReady`: block `block` of gathered GEMM `id` has landed.
    pub(super) fn rows_ready(&mut self, id: GatheredGemmId, block: ScalarId) -> Result<()> {
        let j = self.eval(block)?;
        let Some(l) = self.gathered.get_mut(&id) else {
            return Ok(()); // not on this rank's mesh
        };
        let fresh = usize::try_from(j)
            .ok()
            .and_then(|j| l.ready.get_mut(j))
            .is_some_and(|r| !std::mem::replace(r, true));
        let rows = match fresh {
            true => Some(l.gathered.select(0, j as usize)?),
            false => None,
        };
        let (on_device, gathered) = (l.on_device, l.node.gathered);
        let Some(rows) = rows else {
            let why = format!("block {j} was said ready twice, or is not a peer's block");
            return Err(self.gathered_error(id, why));
        };
        let j = j as usize;
        if on_device {
            self.ctx
                .device
                .gathered_rows_ready(self.current, id.index(), j)?;
        }
        if let Some(rc) = self.race.as_mut() {
            rc.access(self.current, &[(gathered, &rows)], &[]);
        }
        Ok(())
    }

    /// `GatheredGemmJoin`: the joining stream waits for the GEMM, or runs it here.
    pub(super) fn gathered_gemm_join(&mut self, id: GatheredGemmId) -> Result<()> {
        let Some(l) = self.gathered.remove(&id) else {
            return Ok(());
        };
        if let Some(j) = l.ready.iter().position(|r| !r) {
            let why = format!("joined before block {j} was said ready");
            return Err(self.gathered_error(id, why));
        }
        let g = &l.node;
        let blocks: Vec<Tensor> = (0..l.ready.len())
            .map(|j| match j == self.ctx.rank {
                true => Ok(l.own.clone()),
                false => l.gathered.select(0, j),
            })
            .collect::<Result<_>>()?;
        if l.on_device {
            if l.stream != self.current {
                self.ctx.device.stream_wait(self.current, l.stream)?;
                if let Some(rc) = self.race.as_mut() {
                    rc.stream_wait(self.current, l.stream);
                }
            }
        } else {
            let start = self.mark()?;
            let e = Expr {
                op: Op::Matmul,
                inputs: vec![g.gathered, g.b],
                output: g.output,
            };
            for (j, a) in blocks.iter().enumerate() {
                let dst = l.output.select(0, j)?;
                self.product(&e, (a, &l.b), dst, GemmExtras::default())?;
            }
            self.traced(start, "gathered GEMM", false)?;
        }
        if let Some(rc) = self.race.as_mut() {
            let mut reads: Vec<(TensorId, &Tensor)> = vec![(g.own, &l.own), (g.b, &l.b)];
            for (j, rows) in blocks.iter().enumerate() {
                if j != self.ctx.rank {
                    reads.push((g.gathered, rows));
                }
            }
            rc.access(self.current, &reads, &[(g.output, &l.output)]);
        }
        Ok(())
    }

    /// An error of gathered GEMM `id` on this rank: a program that breaks the fused form's
    /// rules.
    fn gathered_error(&self, id: GatheredGemmId, why: String) -> Error {
        Error::Internal(format!(
            "GatheredGemm {} on rank {}: {why}",
            id.index(),
            self.ctx.rank
        ))
    }
}
