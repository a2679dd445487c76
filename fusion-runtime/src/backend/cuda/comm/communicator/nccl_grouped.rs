//! Scatter and Gather, which NCCL lacks: one NCCL group of sends and receives between the
//! root and the mesh, and the root's own block copied locally.

use cudarc::nccl::result as nccl;

use super::buffers::axis_first;
use super::nccl_ops::{recv, send, NcclOp};
use super::CudaCommunicator;
use crate::device::{Device, Kernel};
use crate::error::Result;

impl NcclOp<'_> {
    /// The root of Scatter or Gather, or an error saying it has none.
    fn need_root(&self, comm: &CudaCommunicator) -> Result<usize> {
        let kind = self.c.kind.name();
        self.c
            .root
            .ok_or_else(|| comm.err(format!("{kind} without a root")))
    }

    /// The place of rank `root` in the mesh (the block it owns).
    fn root_block(&self, root: usize) -> usize {
        self.c
            .mesh
            .iter()
            .position(|&r| r == root)
            .expect("root in mesh")
    }
}

impl CudaCommunicator {
    /// Enqueues the NCCL calls of `body` as one group (`ncclGroupStart` ... `ncclGroupEnd`).
    fn nccl_group(&self, body: impl FnOnce() -> Result<()>) -> Result<()> {
        nccl::group_start().map_err(|e| self.nccl_err("ncclGroupStart", e))?;
        body()?;
        nccl::group_end().map_err(|e| self.nccl_err("ncclGroupEnd", e))?;
        Ok(())
    }

    /// Scatter, which NCCL lacks: grouped sends from the root, a receive elsewhere.
    pub(super) fn scatter(&self, call: &NcclOp<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let root = call.need_root(self)?;
        let output = || {
            let o = call
                .output
                .ok_or_else(|| self.err("Scatter: no output".into()))?;
            self.squeeze(o, c.out_sharded_axis, "Scatter")
        };
        let mut after = Vec::new();
        let mut keep = Vec::new();
        self.nccl_group(|| {
            if self.rank == root {
                let x = call
                    .input
                    .ok_or_else(|| self.err("Scatter: the root has no input".into()))?;
                let sa = c.in_scatter_axis.unwrap_or(0);
                let blocks = self.contiguous(s, &axis_first(x, sa)?)?;
                for (i, &r) in c.mesh.iter().enumerate() {
                    let block = blocks.select(0, i)?;
                    if r == self.rank {
                        continue;
                    }
                    send(&block, call.member(r), call.comm, call.stream)
                        .map_err(|e| self.nccl_err("ncclSend (scatter)", e))?;
                }
                keep.push(blocks);
            }
            if c.mesh.contains(&self.rank) && self.rank != root {
                let o = output()?;
                let (buf, back) = self.receive_buffer(s, &o)?;
                recv(&buf, call.member(root), call.comm, call.stream)
                    .map_err(|e| self.nccl_err("ncclRecv (scatter)", e))?;
                if back {
                    after.push((buf, o));
                } else {
                    keep.push(buf);
                }
            }
            Ok(())
        })?;
        if self.rank == root && c.mesh.contains(&root) {
            let blocks = &keep[0];
            let i = call.root_block(root);
            let o = output()?;
            self.device.execute(
                s,
                Kernel::Copy {
                    src: &blocks.select(0, i)?,
                    dst: &o,
                },
            )?;
        }
        for (buf, o) in after {
            self.copy_back(s, &buf, &o)?;
        }
        Ok(())
    }

    /// Gather, which NCCL lacks: grouped receives on the root, a send elsewhere.
    pub(super) fn gather(&self, call: &NcclOp<'_>) -> Result<()> {
        let (s, c) = (call.s, call.c);
        let root = call.need_root(self)?;
        let mut keep = Vec::new();
        let staged = if self.rank == root {
            let out = call
                .output
                .ok_or_else(|| self.err("Gather: the root has no output".into()))?;
            let o = c.out_sharded_axis.or(c.in_sharded_axis).unwrap_or(0);
            let view = axis_first(out, o)?;
            Some((self.receive_buffer(s, &view)?, view))
        } else {
            None
        };
        let x = if c.mesh.contains(&self.rank) {
            let input = call
                .input
                .ok_or_else(|| self.err("Gather: no input".into()))?;
            Some(self.contiguous(s, &self.squeeze(input, c.in_sharded_axis, "Gather")?)?)
        } else {
            None
        };
        self.nccl_group(|| {
            if let Some(((buf, _), _)) = &staged {
                for (i, &r) in c.mesh.iter().enumerate() {
                    if r == self.rank {
                        continue;
                    }
                    let block = buf.select(0, i)?;
                    recv(&block, call.member(r), call.comm, call.stream)
                        .map_err(|e| self.nccl_err("ncclRecv (gather)", e))?;
                }
            }
            if let (Some(x), false) = (&x, self.rank == root) {
                send(x, call.member(root), call.comm, call.stream)
                    .map_err(|e| self.nccl_err("ncclSend (gather)", e))?;
                keep.push(x.clone());
            }
            Ok(())
        })?;
        if let Some(((buf, back), view)) = staged {
            if let Some(x) = &x {
                let i = call.root_block(root);
                self.device.execute(
                    s,
                    Kernel::Copy {
                        src: x,
                        dst: &buf.select(0, i)?,
                    },
                )?;
            }
            if back {
                self.copy_back(s, &buf, &view)?;
            }
        }
        Ok(())
    }
}
