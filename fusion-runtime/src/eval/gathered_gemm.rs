//! The nodes of a fused AllGather+GEMM (`lower::gathered_gemm`): its launch, the blocks the
//! loop says have landed, and its join.
//!
//! A device that runs such a GEMM as one kernel ([`Device::launch_gathered_gemm`]) gets
//! the launch and every ready block, and the join is stream order. Any other device (the
//! CPU backend) gets nothing until the join, where every block's GEMM runs on the joining
//! stream: this rank's block from `own`, every other from its landed rows. Either way the
//! walk checks that each peer's block was said ready once, before the join, and the race
//! checker sees the GEMM read `own`, `b` (and the epilogue's bias, or an auxiliary matrix
//! it reads) and write the output (and an auxiliary matrix it writes) from the launch on, read
//! each block where it is said ready, and read and write everything at the join.
//!
//! [`Device::launch_gathered_gemm`]: crate::device::Device::launch_gathered_gemm

use fusion_compiler::hir::{GatheredGemm, GatheredGemmId};
use fusion_compiler::ir::{BinaryOp, EpilogueAux, Expr, Op, ScalarId, TensorId, UnaryOp};
use fusion_compiler::DType;

use super::compute::GemmExtras;
use super::evaluator::Evaluator;
use super::launched_gemm::Launched;
use crate::device::{GatheredGemmCall, Kernel};
use crate::error::{Error, Result};
use crate::fused_programs::{PointwiseInstr, PointwiseProgram};
use crate::tensor::Tensor;

impl Evaluator<'_> {
    /// `GatheredGemmLaunch`: binds the operands and launches the GEMM where the device runs
    /// it as one kernel.
    pub(super) fn gathered_gemm_launch(&mut self, g: &GatheredGemm) -> Result<()> {
        if !self.in_mesh[g.output.index()] {
            return Ok(());
        }
        let gathered = self.get_or_allocate(g.gathered)?;
        let output = blocks_first(self.get_or_allocate(g.output)?, self.p.world_size)?;
        let (own, b) = (self.get(g.own)?.clone(), self.get(g.b)?.clone());
        let bias = match g.bias {
            Some(t) => {
                let e = Expr {
                    op: Op::Matmul,
                    inputs: vec![g.gathered, g.b, t],
                    output: g.output,
                };
                Some(self.row_vector(&e, t)?)
            }
            None => None,
        };
        let up = g.up.map(|t| self.get(t).cloned()).transpose()?;
        let aux = match (g.aux, g.epilogue.aux) {
            (Some(t), Some(mode)) => Some((
                blocks_first(self.get_or_allocate(t)?, self.p.world_size)?,
                mode,
            )),
            (None, None) => None,
            _ => {
                return Err(self.gathered_error(
                    g.id,
                    "its auxiliary matrix and its epilogue's mode do not come together".into(),
                ))
            }
        };
        let activation = match g.epilogue.activations.as_slice() {
            [] => None,
            [a] => Some(*a),
            more => {
                return Err(self.gathered_error(
                    g.id,
                    format!("its epilogue has {} activations (at most one)", more.len()),
                ))
            }
        };
        let (rank, world) = (self.ctx.rank, self.p.world_size);
        if let Some((x, _)) = &aux {
            if x.shape() != output.shape() {
                return Err(self.gathered_error(
                    g.id,
                    format!(
                        "its auxiliary matrix {:?} is not shaped like its output {:?}",
                        x.shape(),
                        output.shape()
                    ),
                ));
            }
        }
        for (what, t) in [("gathered rows", &gathered), ("output", &output)] {
            if t.shape().first() != Some(&world) {
                return Err(self.gathered_error(
                    g.id,
                    format!("its {what} {:?} do not have one block per rank", t.shape()),
                ));
            }
        }
        let pieces = g.pieces.max(1);
        let call = GatheredGemmCall {
            id: g.id.index(),
            gathered: &gathered,
            own: &own,
            b: &b,
            output: &output,
            rank,
            world,
            pieces,
            bias: bias.as_ref(),
            activation,
            up: up.as_ref(),
            aux: aux.as_ref().map(|(x, mode)| (x, *mode)),
        };
        let start = self.mark()?;
        let on_device = self.ctx.device.launch_gathered_gemm(self.current, &call)?;
        self.traced(start, "gathered GEMM launch", false)?;
        let mut reads = vec![g.own, g.b];
        reads.extend(g.bias);
        reads.extend(g.up);
        let mut writes = vec![g.output];
        match g.epilogue.aux {
            Some(EpilogueAux::PreActivation) => writes.extend(g.aux),
            Some(EpilogueAux::Derivative(_)) => reads.extend(g.aux),
            None => {}
        }
        self.record_access(&reads, &writes)?;
        let mut ready = vec![false; world * pieces];
        ready[rank * pieces..(rank + 1) * pieces].fill(true);
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
                bias,
                up,
                aux,
                ready,
            },
        );
        Ok(())
    }

    /// `RowsReady`: block `block` of gathered GEMM `id` has landed, or row range `piece`
    /// of it.
    pub(super) fn rows_ready(
        &mut self,
        id: GatheredGemmId,
        block: ScalarId,
        piece: Option<ScalarId>,
    ) -> Result<()> {
        let j = self.eval(block)?;
        let q = piece.map(|q| self.eval(q)).transpose()?.unwrap_or(0);
        let Some(l) = self.gathered.get_mut(&id) else {
            return Ok(()); // not on this rank's mesh
        };
        let pieces = l.node.pieces.max(1);
        let word = usize::try_from(j)
            .ok()
            .zip(usize::try_from(q).ok())
            .filter(|&(_, q)| q < pieces && (piece.is_some() || pieces == 1))
            .map(|(j, q)| j * pieces + q);
        let fresh = word
            .and_then(|w| l.ready.get_mut(w))
            .is_some_and(|r| !std::mem::replace(r, true));
        let rows = match fresh {
            true => Some(piece_rows(
                &l.gathered.select(0, j as usize)?,
                q as usize,
                pieces,
            )?),
            false => None,
        };
        let (on_device, gathered) = (l.on_device, l.node.gathered);
        let Some(rows) = rows else {
            let why = format!(
                "block {j}, piece {q} (of {pieces}) was said ready twice, or is not a \
                 peer's row range"
            );
            return Err(self.gathered_error(id, why));
        };
        if let (true, Some(word)) = (on_device, word) {
            self.ctx
                .device
                .gathered_rows_ready(self.current, id.index(), word)?;
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
        if let Some(w) = l.ready.iter().position(|r| !r) {
            let pieces = l.node.pieces.max(1);
            let why = format!(
                "joined before block {}, piece {} was said ready",
                w / pieces,
                w % pieces
            );
            return Err(self.gathered_error(id, why));
        }
        let g = &l.node;
        let world = l.ready.len() / l.node.pieces.max(1);
        let blocks: Vec<Tensor> = (0..world)
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
            // The weights with no more axes than a block's rows (a broadcast operand's
            // base keeps its DIDx axis, stored with extent 1).
            let rank = blocks.first().map_or(2, Tensor::rank);
            let b = unit_axes_dropped(l.b.clone(), rank)?;
            let up =
                l.up.clone()
                    .map(|u| unit_axes_dropped(u, rank))
                    .transpose()?;
            for (j, a) in blocks.iter().enumerate() {
                let dst = l.output.select(0, j)?;
                match &up {
                    Some(up) => {
                        self.gated_product(&e, a, (&b, up), &g.epilogue.activations, dst)?
                    }
                    None => {
                        let aux = match &l.aux {
                            Some((x, mode)) => Some((x.select(0, j)?, *mode)),
                            None => None,
                        };
                        let extras = GemmExtras {
                            bias: l.bias.as_ref(),
                            epilogue: &g.epilogue.activations,
                            aux,
                            ..GemmExtras::default()
                        };
                        self.product(&e, (a, &b), dst, extras)?;
                    }
                }
            }
            self.traced(start, "gathered GEMM", false)?;
        }
        if let Some(rc) = self.race.as_mut() {
            let mut reads: Vec<(TensorId, &Tensor)> = vec![(g.own, &l.own), (g.b, &l.b)];
            if let (Some(id), Some(t)) = (g.bias, l.bias.as_ref()) {
                reads.push((id, t));
            }
            if let (Some(id), Some(t)) = (g.up, l.up.as_ref()) {
                reads.push((id, t));
            }
            for (j, rows) in blocks.iter().enumerate() {
                if j != self.ctx.rank {
                    reads.push((g.gathered, rows));
                }
            }
            let mut writes: Vec<(TensorId, &Tensor)> = vec![(g.output, &l.output)];
            if let (Some(id), Some((x, mode))) = (g.aux, l.aux.as_ref()) {
                match mode {
                    EpilogueAux::PreActivation => writes.push((id, x)),
                    EpilogueAux::Derivative(_) => reads.push((id, x)),
                }
            }
            rc.access(self.current, &reads, &writes);
        }
        Ok(())
    }

    /// `dst = act(a @ b) * (a @ up)` where no kernel runs the gated product: both products
    /// in f32, then one pointwise pass rounding once to `dst`'s dtype.
    fn gated_product(
        &mut self,
        e: &Expr,
        a: &Tensor,
        (b, up): (&Tensor, &Tensor),
        activations: &[UnaryOp],
        dst: Tensor,
    ) -> Result<()> {
        let gate = self
            .ctx
            .device
            .allocate(self.current, DType::F32, dst.shape())?;
        let value = self
            .ctx
            .device
            .allocate(self.current, DType::F32, dst.shape())?;
        self.product(e, (a, b), gate.clone(), GemmExtras::default())?;
        self.product(e, (a, up), value.clone(), GemmExtras::default())?;
        let mut instrs: Vec<PointwiseInstr> = Vec::new();
        let mut reg = 0;
        for &op in activations {
            instrs.push(PointwiseInstr::Unary(op, reg));
            reg = 1 + instrs.len();
        }
        instrs.push(PointwiseInstr::Binary(BinaryOp::Mul, reg, 1));
        instrs.push(PointwiseInstr::Round(dst.dtype(), 1 + instrs.len()));
        let out = 1 + instrs.len();
        let prog = PointwiseProgram {
            shape: dst.shape().to_vec(),
            inputs: vec![gate, value],
            instrs,
            outputs: vec![(dst, out)],
        };
        self.ctx
            .device
            .execute(self.current, Kernel::Pointwise(&prog))
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

/// Row range `piece` of `pieces` of a block `[.., rows, K]` (ranges as the lowering's row
/// ranges split them: `piece * rows / pieces..(piece + 1) * rows / pieces`).
fn piece_rows(block: &Tensor, piece: usize, pieces: usize) -> Result<Tensor> {
    if pieces == 1 {
        return Ok(block.clone());
    }
    let axis = block.rank().saturating_sub(2);
    let rows = block.shape()[axis];
    let (start, stop) = (piece * rows / pieces, (piece + 1) * rows / pieces);
    block.narrow(axis, start, stop - start)
}

/// `t` without its leading extent-1 axes: an output that keeps DIDx axes before its block
/// axis (`[d @ DIDx, d @ Stream, m, n]`, the lowering's `out_axis`) stores them with extent
/// 1, so its blocks follow them. (In a world of one nothing is stripped.)
fn blocks_first(mut t: Tensor, world: usize) -> Result<Tensor> {
    while world > 1 && t.shape().len() > 1 && t.shape()[0] == 1 {
        t = t.squeeze(0)?;
    }
    Ok(t)
}

/// `t` without leading extent-1 axes beyond `rank` axes.
fn unit_axes_dropped(mut t: Tensor, rank: usize) -> Result<Tensor> {
    while t.rank() > rank && t.shape()[0] == 1 {
        t = t.squeeze(0)?;
    }
    Ok(t)
}
