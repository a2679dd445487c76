//! Walking a program's nodes: loops and branches, streams and waits, allocations, views,
//! communications and compute, each timed (and traced when asked).

use std::time::Instant;

use fusion_compiler::hir::{Communication, Node, P2PDirection, P2P};
use fusion_compiler::ir::{Op, TensorId};

use super::call::HostSpan;
use super::evaluator::Evaluator;
use crate::error::{Error, Result};

impl<'a> Evaluator<'a> {
    pub(super) fn run_nodes(&mut self, nodes: &'a [Node]) -> Result<()> {
        for n in nodes {
            self.run_node(n)?;
        }
        Ok(())
    }

    fn run_node(&mut self, n: &'a Node) -> Result<()> {
        self.stats.nodes_executed += 1;
        if let Some(rc) = self.race.as_mut() {
            rc.at(n);
        }
        let id = match &self.node_ids {
            Some(ids) => ids.get(&(n as *const Node)).copied(),
            None => None,
        };
        let _scope = self
            .node_scopes
            .then(|| crate::observe::NodeScope::enter(n, id));
        if id.is_some() {
            return self.run_node_traced(n, id);
        }
        if matches!(n, Node::ForLoop(_) | Node::IfThenElse { .. }) {
            return self.run_node_untimed(n);
        }
        let start = Instant::now();
        let r = self.run_node_untimed(n);
        self.count_host_time(n, start.elapsed().as_nanos() as u64);
        r
    }

    fn count_host_time(&mut self, n: &Node, nanos: u64) {
        let h = &mut self.stats.host_by_kind[n.kind() as usize];
        h.count += 1;
        h.nanos += nanos;
    }

    /// Runs a node and records its host span (loops and branches span their bodies).
    fn run_node_traced(&mut self, n: &'a Node, id: Option<usize>) -> Result<()> {
        let (outer, chunk, stream) = (self.node, self.chunk, self.current);
        self.node = id;
        let start = Instant::now();
        let r = self.run_node_untimed(n);
        let end = Instant::now();
        self.node = outer;
        if !matches!(n, Node::ForLoop(_) | Node::IfThenElse { .. }) {
            self.count_host_time(n, (end - start).as_nanos() as u64);
        }
        let origin = self.host_origin;
        let ms = |t: Instant| (t - origin).as_secs_f64() * 1e3;
        if let Some(node) = id {
            self.host_spans.push(HostSpan {
                node,
                kind: n.kind(),
                stream,
                chunk,
                start_ms: ms(start),
                end_ms: ms(end),
            });
        }
        r
    }

    fn run_node_untimed(&mut self, n: &'a Node) -> Result<()> {
        match n {
            Node::Allocate { tensor } => {
                if self.in_mesh[tensor.index()] {
                    self.get_or_allocate(*tensor)?;
                }
            }
            Node::Deallocate { tensor } => self.deallocate(*tensor),
            Node::ForLoop(l) => {
                let (start, stop) = (self.eval(l.start)?, self.eval(l.stop)?);
                for i in start..stop {
                    self.leaves[l.index.index()] = Some(i);
                    self.chunk = Some(i);
                    if let Some(rc) = self.race.as_mut() {
                        rc.iteration(l.index, Some(i));
                    }
                    self.run_nodes(&l.body)?;
                }
                if let Some(rc) = self.race.as_mut() {
                    rc.iteration(l.index, None);
                }
                self.leaves[l.index.index()] = None;
                self.chunk = None;
            }
            Node::IfThenElse {
                cond,
                then_body,
                else_body,
            } => {
                if self.eval(*cond)? != 0 {
                    self.run_nodes(then_body)?;
                } else {
                    self.run_nodes(else_body)?;
                }
            }
            Node::GetCurrentStream { stream } => {
                self.streams[stream.index()] = Some(self.current);
            }
            Node::SetCurrentStream { stream } => {
                self.current = self.stream_of(*stream)?;
            }
            Node::Synchronize { stream } => {
                let s = self.stream_of(*stream)?;
                self.wait_for(s)?;
            }
            Node::AliasSelect {
                input,
                output,
                axis,
                index,
            } => {
                if self.in_mesh[input.index()] {
                    let stored = self.stored_axis(*input, *axis)?;
                    let i = self.eval(*index)?;
                    let v = self.get(*input)?.select(stored, i as usize)?;
                    self.tensors[output.index()] = Some(v);
                }
            }
            Node::Communication(c) => self.communication(c)?,
            Node::P2P(x) => self.p2p(x)?,
            Node::StartCoalescing => {
                self.group_start = self.mark()?;
                self.ctx.comm.group_start()?;
                if let Some(rc) = self.race.as_mut() {
                    rc.group_start();
                }
            }
            Node::EndCoalescing { id } => {
                self.ctx.comm.group_end()?;
                if let Some(rc) = self.race.as_mut() {
                    rc.group_end();
                }
                let start = self.group_start.take();
                self.traced(start, "P2P group", true)?;
                self.comm_streams.insert(*id, self.current);
            }
            Node::Wait { comm } => {
                if let Some(&s) = self.comm_streams.get(comm) {
                    self.wait_for(s)?;
                }
            }
            Node::Compute(e) => {
                let start = if e.op.is_view() { None } else { self.mark()? };
                self.compute(e)?;
                if !e.op.is_view() && self.in_mesh[e.output.index()] {
                    match (&e.op, e.inputs.split_last()) {
                        // A GEMM storing its pre-activation writes its last input.
                        (Op::Gemm { epilogue, .. }, Some((&aux, reads)))
                            if epilogue.writes_aux() =>
                        {
                            self.record_access(reads, &[e.output, aux])?;
                        }
                        _ => self.record_access(&e.inputs, &[e.output])?,
                    }
                }
                if start.is_some() {
                    self.traced(start, &e.op.name(), false)?;
                }
            }
            Node::Launch {
                segment,
                inputs: _,
                outputs,
            } => {
                let start = self.mark()?;
                self.launch(*segment, outputs)?;
                self.traced(start, "fused kernel", false)?;
            }
            Node::GatheredGemmLaunch(g) => self.gathered_gemm_launch(g)?,
            Node::RowsReady { id, block, piece } => self.rows_ready(*id, *block, *piece)?,
            Node::GatheredGemmJoin { id } => self.gathered_gemm_join(*id)?,
            Node::GemmAllreduce(g) => self.gemm_allreduce(g)?,
            Node::GemmReduceScatter(g) => self.gemm_reduce_scatter(g)?,
        }
        Ok(())
    }

    /// Releases `tensor`'s buffer.
    pub(super) fn deallocate(&mut self, tensor: TensorId) {
        if let Some(rc) = self.race.as_mut() {
            rc.deallocated(tensor);
        }
        self.tensors[tensor.index()] = None;
        self.live_bytes -= std::mem::take(&mut self.owned_bytes[tensor.index()]);
    }

    pub(super) fn communication(&mut self, c: &Communication) -> Result<()> {
        let rank = self.ctx.rank;
        if !c.team.contains(&rank) {
            return Ok(());
        }
        let input = if self.in_mesh[c.input.index()] {
            Some(self.get(c.input)?.clone())
        } else {
            None
        };
        let output = if self.in_mesh[c.output.index()] {
            Some(self.get_or_allocate(c.output)?)
        } else {
            None
        };
        let start = self.mark()?;
        self.ctx
            .comm
            .collective(self.current, c, input.as_ref(), output.as_ref())?;
        if let Some(rc) = self.race.as_mut() {
            let reads: Vec<_> = input.iter().map(|t| (c.input, t)).collect();
            let writes: Vec<_> = output.iter().map(|t| (c.output, t)).collect();
            rc.access(self.current, &reads, &writes);
        }
        self.traced(start, c.kind.name(), true)?;
        self.comm_streams.insert(c.id, self.current);
        Ok(())
    }

    fn p2p(&mut self, x: &P2P) -> Result<()> {
        let peer = self.eval(x.peer)?;
        if peer < 0 || peer as usize >= self.p.world_size {
            return Err(Error::Communication {
                rank: self.ctx.rank,
                reason: format!(
                    "P2P peer {peer} is outside the world of {}",
                    self.p.world_size
                ),
            });
        }
        let peer = peer as usize;
        let in_group = self.group_start.is_some();
        let start = if in_group { None } else { self.mark()? };
        let describe = || {
            let (what, to) = match x.direction {
                P2PDirection::Send => ("send", "to"),
                P2PDirection::Recv => ("receive", "from"),
            };
            let mut s = format!(
                "the P2P {what} of `{}` {to} rank {peer}",
                self.p.ir.tensor_name(x.buffer)
            );
            if let Some(i) = self.chunk {
                s.push_str(&format!(" in stream-loop iteration {i}"));
            }
            s
        };
        self.ctx.comm.describe_next_transfer(&describe);
        match x.direction {
            P2PDirection::Send => {
                let buf = self.get(x.buffer)?.clone();
                self.ctx.comm.send(self.current, peer, &buf, x.transport)?;
                if let Some(rc) = self.race.as_mut() {
                    rc.transfer(self.current, x.buffer, &buf, false);
                }
            }
            P2PDirection::Recv => {
                let buf = self.get_or_allocate(x.buffer)?;
                self.ctx.comm.recv(self.current, peer, &buf, x.transport)?;
                if let Some(rc) = self.race.as_mut() {
                    rc.transfer(self.current, x.buffer, &buf, true);
                }
            }
        }
        let name = match x.direction {
            P2PDirection::Send => "send",
            P2PDirection::Recv => "recv",
        };
        self.traced(start, name, true)?;
        self.comm_streams.insert(x.id, self.current);
        Ok(())
    }
}
