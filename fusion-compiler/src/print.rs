//! Text form of host programs, shaped like nvFuser's `NVFUSER_DUMP=host_ir` listings:
//!
//! ```text
//! %HostIrContainer { (T0_g_float[iS0{i0}, iS1{i2}] (DeviceMesh{0 1})) -> (...) :
//!   T1_g_float[...] = ALLOCATE(buffer=T1_g_float[...], mem_type=global, size=( i0 * i2 ), ...)
//!   FOR StreamIdx in iStreamIdx2{i0}:
//!     ...
//! } // %HostIrContainer
//! ```

use std::fmt::{self, Write};

use crate::hir::{Communication, HostProgram, Node, P2PDirection, StreamDef, StreamId, P2P};
use crate::ir::{Epilogue, Expr, Fusion, IterKind, MemoryType, Op, ParallelType, TensorId};

/// `T3_g_float[iS0{i0}, ideviceIdx.x1{d}] (DeviceMesh{0 1 2 3})`.
pub fn tensor_string(f: &Fusion, t: TensorId) -> String {
    let tv = f.tensor(t);
    let mem = match tv.memory {
        MemoryType::Global => "g",
        MemoryType::Local => "l",
    };
    let axes: Vec<String> = tv
        .axes
        .iter()
        .map(|&d| {
            let dom = f.iter_domain(d);
            format!(
                "{}{}{{{}}}",
                dom.prefix(),
                d.index(),
                f.display_scalar(dom.extent)
            )
        })
        .collect();
    format!(
        "T{}_{}_{}[{}] ({})",
        t.index(),
        mem,
        tv.dtype.ir_name(),
        axes.join(", "),
        tv.mesh
    )
}

/// Number of elements a device stores, as a scalar expression string.
fn local_size(f: &Fusion, t: TensorId) -> String {
    let mut parts = Vec::new();
    for &d in &f.tensor(t).axes {
        let dom = f.iter_domain(d);
        if dom.kind != IterKind::Iteration || dom.parallel == ParallelType::DIDx {
            continue;
        }
        parts.push(dom.extent);
    }
    if parts.is_empty() {
        return "1".into();
    }
    let mut s = f.display_scalar(parts[0]).to_string();
    for &p in &parts[1..] {
        s = format!("( {s} * {} )", f.display_scalar(p));
    }
    s
}

fn expr_string(f: &Fusion, e: &Expr, indent: &str) -> String {
    let t = |x: TensorId| tensor_string(f, x);
    let out = t(e.output);
    let rhs = match &e.op {
        Op::Set => format!("Set( {}, cache_op=Streaming )", t(e.inputs[0])),
        Op::Unary(u) => format!("{}( {} )", u.name(), t(e.inputs[0])),
        Op::Binary(b) => match b.infix() {
            Some(sym) => format!("{}\n{indent}   {sym} {}", t(e.inputs[0]), t(e.inputs[1])),
            None => format!("{}( {}, {} )", b.name(), t(e.inputs[0]), t(e.inputs[1])),
        },
        Op::Cast => format!(
            "cast( {}, dtype={} )",
            t(e.inputs[0]),
            f.tensor(e.output).dtype.ir_name()
        ),
        Op::Reduction { op, axes } => format!(
            "reduction( {}, op = {}, axes = {:?}, initial value = float({}), allreduce = false )",
            t(e.inputs[0]),
            match op {
                crate::ir::ReduceOp::Sum => "add",
                crate::ir::ReduceOp::Max => "max",
            },
            axes,
            op.init()
        ),
        Op::Broadcast { flags } => {
            let fl: Vec<&str> = flags
                .iter()
                .map(|&b| if b { "true" } else { "false" })
                .collect();
            format!(
                "broadcast( {}, flags = {{{}}} )",
                t(e.inputs[0]),
                fl.join(", ")
            )
        }
        Op::Matmul => {
            let mut s = format!(
                "matmul({},\n{indent}            {})",
                t(e.inputs[0]),
                t(e.inputs[1])
            );
            if let Some(&c) = e.inputs.get(2) {
                let _ = write!(s, "\n{indent}         + {}", t(c));
            }
            s
        }
        Op::Gemm { linear, epilogue } => {
            let name = if *linear { "linear" } else { "matmul" };
            let mut s = format!(
                "{name}({},\n{indent}            {}",
                t(e.inputs[0]),
                t(e.inputs[1])
            );
            if epilogue.bias {
                let _ = write!(s, ",\n{indent}            bias = {}", t(e.inputs[2]));
            }
            if let (Some(_), Some(&x)) = (epilogue.aux, e.inputs.last()) {
                let _ = write!(s, ",\n{indent}            aux = {}", t(x));
            }
            let _ = write!(
                s,
                " )\n{indent}     epilogue( {} ) -> {}",
                epilogue.describe(),
                f.tensor(e.output).dtype.ir_name()
            );
            s
        }
        Op::Linear => {
            let mut s = format!(
                "linear({},\n{indent}            {}",
                t(e.inputs[0]),
                t(e.inputs[1])
            );
            if let Some(&b) = e.inputs.get(2) {
                let _ = write!(s, ",\n{indent}            {}", t(b));
            }
            s.push_str(" )");
            s
        }
        Op::Select { axis, index } => format!(
            "select( {}, axis = {axis}, index = {} )",
            t(e.inputs[0]),
            f.display_scalar(*index)
        ),
        Op::Slice { axis, start, stop } => format!(
            "slice( {}, axis = {axis}, range = {}..{} )",
            t(e.inputs[0]),
            f.display_scalar(*start),
            f.display_scalar(*stop)
        ),
        Op::Split { axis, outer } => format!(
            "split( {}, axis = {axis}, outer = {} )",
            t(e.inputs[0]),
            f.display_scalar(*outer)
        ),
        Op::Permute { perm } => format!("permute( {}, perm = {perm:?} )", t(e.inputs[0])),
    };
    format!("{out}\n{indent}   = {rhs}")
}

fn stream_string(p: &HostProgram, s: StreamId) -> String {
    match &p.streams[s.index()] {
        StreamDef::Captured => format!("Stream {}", s.index()),
        StreamDef::Pool(i) => format!("Stream {}", p.ir.display_scalar(*i)),
        StreamDef::Compute(i) => format!("ComputeStream {}", p.ir.display_scalar(*i)),
    }
}

fn comm_string(p: &HostProgram, c: &Communication) -> String {
    let team: Vec<String> = c.team.iter().map(|d| d.to_string()).collect();
    let mut s = format!(
        "Communication {} (type={}, team=({})",
        c.id.index(),
        c.kind.name(),
        team.join(" ")
    );
    if let Some(r) = c.root {
        let _ = write!(s, ", root={r}");
    }
    if let Some(op) = c.reduce_op {
        let _ = write!(s, ", red_op={}", op.name());
    }
    let _ = write!(
        s,
        ", input={}, output={}, backend={})",
        tensor_string(&p.ir, c.input),
        tensor_string(&p.ir, c.output),
        c.transport.name()
    );
    s
}

fn p2p_string(p: &HostProgram, x: &P2P) -> String {
    let ty = match x.direction {
        P2PDirection::Send => "send",
        P2PDirection::Recv => "recv",
    };
    format!(
        "P2PCommunication {} (type={ty}, buffer={}, peer={}, backend={})",
        x.id.index(),
        tensor_string(&p.ir, x.buffer),
        p.ir.display_scalar(x.peer),
        x.transport.name()
    )
}

fn write_nodes(p: &HostProgram, nodes: &[Node], depth: usize, out: &mut String) {
    let indent = "  ".repeat(depth);
    let f = &p.ir;
    for n in nodes {
        match n {
            Node::Allocate { tensor } => {
                let ts = tensor_string(f, *tensor);
                let _ = writeln!(
                    out,
                    "{indent}{ts} = ALLOCATE(buffer={ts}, mem_type=global, size={}, zero_init=false, resets_to_zero=false)",
                    local_size(f, *tensor)
                );
            }
            Node::Deallocate { tensor } => {
                let _ = writeln!(out, "{indent}Deallocate {}", tensor_string(f, *tensor));
            }
            Node::ForLoop(l) => {
                let dom = f.iter_domain(l.axis);
                let _ = writeln!(
                    out,
                    "{indent}FOR {} in {}{}{{{}}}:",
                    f.display_scalar(l.index),
                    dom.prefix(),
                    l.axis.index(),
                    f.display_scalar(dom.extent)
                );
                write_nodes(p, &l.body, depth + 1, out);
            }
            Node::IfThenElse {
                cond,
                then_body,
                else_body,
            } => {
                let _ = writeln!(out, "{indent}IF Manual {}:", f.display_scalar(*cond));
                write_nodes(p, then_body, depth + 1, out);
                if !else_body.is_empty() {
                    let _ = writeln!(out, "{indent}ELSE:");
                    write_nodes(p, else_body, depth + 1, out);
                }
            }
            Node::GetCurrentStream { stream } => {
                let _ = writeln!(
                    out,
                    "{indent}GetCurrentStream into {}",
                    stream_string(p, *stream)
                );
            }
            Node::SetCurrentStream { stream } => {
                let _ = writeln!(
                    out,
                    "{indent}SetCurrentStream to {}",
                    stream_string(p, *stream)
                );
            }
            Node::Synchronize { stream } => {
                let _ = writeln!(out, "{indent}Synchronize {}", stream_string(p, *stream));
            }
            Node::AliasSelect {
                input,
                output,
                axis,
                index,
            } => {
                let d = f.tensor(*input).axes[*axis];
                let dom = f.iter_domain(d);
                let _ = writeln!(
                    out,
                    "{indent}{}\n{indent}   = HirAliasSelect( {}, axis = {}{}{{{}}}, index = {} )",
                    tensor_string(f, *output),
                    tensor_string(f, *input),
                    dom.prefix(),
                    d.index(),
                    f.display_scalar(dom.extent),
                    f.display_scalar(*index)
                );
            }
            Node::Communication(c) => {
                let _ = writeln!(out, "{indent}{}", comm_string(p, c));
            }
            Node::P2P(x) => {
                let _ = writeln!(out, "{indent}{}", p2p_string(p, x));
            }
            Node::StartCoalescing => {
                let _ = writeln!(out, "{indent}StartCoalescing");
            }
            Node::EndCoalescing { id } => {
                let _ = writeln!(out, "{indent}EndCoalescing {}", id.index());
            }
            Node::Wait { comm } => {
                let _ = writeln!(out, "{indent}Wait Communication {}", comm.index());
            }
            Node::Compute(e) => {
                let _ = writeln!(out, "{indent}{}", expr_string(f, e, &indent));
            }
            Node::Launch {
                segment,
                inputs,
                outputs,
            } => {
                let list = |ts: &[TensorId]| -> String {
                    ts.iter()
                        .map(|&t| format!("{}, ", tensor_string(f, t)))
                        .collect()
                };
                let _ = writeln!(
                    out,
                    "{indent}Launch (Segment{}, Inputs:{{{}}}, Outputs:{{{}}})",
                    segment.index(),
                    list(inputs),
                    list(outputs)
                );
            }
            Node::GatheredGemmLaunch(_)
            | Node::RowsReady { .. }
            | Node::GatheredGemmJoin { .. }
            | Node::GemmAllreduce(_)
            | Node::GemmReduceScatter(_) => {
                let _ = writeln!(out, "{indent}{}", fused_gemm_string(p, n, &indent));
            }
        }
    }
}

/// A gathered GEMM's node (its launch on two lines, the second indented by `indent`), or a
/// GEMM with the Allreduce or ReduceScatter of its product in its epilogue (the GEMM, then
/// the collective, on lines of their own).
fn fused_gemm_string(p: &HostProgram, n: &Node, indent: &str) -> String {
    let f = &p.ir;
    match n {
        Node::GemmAllreduce(g) => {
            let mut s = format!(
                "GemmAllreduce: the Allreduce in the epilogue of\n{indent}  {}\n{indent}  {}",
                expr_string(f, &g.gemm, &format!("{indent}  ")),
                comm_string(p, &g.comm)
            );
            if let Some(r) = &g.residual {
                let inner = format!("{indent}  ");
                s += &format!(
                    "\n{inner}then, in its last store,\n{inner}{}",
                    expr_string(f, r, &inner)
                );
            }
            s
        }
        Node::GemmReduceScatter(g) => format!(
            "GemmReduceScatter: the ReduceScatter in the epilogue of\n{indent}  {}\n{indent}  {}",
            expr_string(f, &g.gemm, &format!("{indent}  ")),
            comm_string(p, &g.comm)
        ),
        Node::GatheredGemmLaunch(g) => format!(
            "{}\n{indent}   = GatheredGemm {} launch( gathered = {}, own = {}, b = {}{}{}{}{}{} )",
            tensor_string(f, g.output),
            g.id.index(),
            tensor_string(f, g.gathered),
            tensor_string(f, g.own),
            tensor_string(f, g.b),
            match g.up {
                Some(u) => format!(", gated by up = {}", tensor_string(f, u)),
                None => String::new(),
            },
            match g.bias {
                Some(b) => format!(", bias = {}", tensor_string(f, b)),
                None => String::new(),
            },
            match g.aux {
                Some(x) => format!(", aux = {}", tensor_string(f, x)),
                None => String::new(),
            },
            match g.epilogue == Epilogue::default() {
                true => String::new(),
                false => format!(", epilogue( {} )", g.epilogue.describe()),
            },
            match g.pieces {
                1 => String::new(),
                n => format!(", pieces = {n}"),
            }
        ),
        Node::RowsReady { id, block, piece } => format!(
            "RowsReady GatheredGemm {}, block {}{}",
            id.index(),
            f.display_scalar(*block),
            piece.map_or(String::new(), |q| format!(
                ", piece {}",
                f.display_scalar(q)
            ))
        ),
        Node::GatheredGemmJoin { id } => format!("Join GatheredGemm {}", id.index()),
        _ => String::new(),
    }
}

/// One node as text, on one line: a leaf node as in the program dump, a loop or a branch
/// by its header (`FOR i in ...:`, `IF Manual ...:`) without its body.
pub fn node_string(p: &HostProgram, n: &Node) -> String {
    let mut out = String::new();
    match n {
        Node::ForLoop(l) => {
            let header = Node::ForLoop(crate::hir::ForLoop {
                index: l.index,
                axis: l.axis,
                start: l.start,
                stop: l.stop,
                body: Vec::new(),
            });
            write_nodes(p, std::slice::from_ref(&header), 0, &mut out);
        }
        Node::IfThenElse { cond, .. } => {
            let header = Node::IfThenElse {
                cond: *cond,
                then_body: Vec::new(),
                else_body: Vec::new(),
            };
            write_nodes(p, std::slice::from_ref(&header), 0, &mut out);
        }
        leaf => write_nodes(p, std::slice::from_ref(leaf), 0, &mut out),
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl fmt::Display for HostProgram {
    fn fmt(&self, fmt: &mut fmt::Formatter<'_>) -> fmt::Result {
        let f = &self.ir;
        let ins: Vec<String> = self.inputs.iter().map(|&t| tensor_string(f, t)).collect();
        let outs: Vec<String> = self.outputs.iter().map(|&t| tensor_string(f, t)).collect();
        let mut s = format!(
            "%HostIrContainer {{ ({}) -> ({}) :\n",
            ins.join(", "),
            outs.join(", ")
        );
        write_nodes(self, &self.body, 1, &mut s);
        for (i, seg) in self.segments.iter().enumerate() {
            let _ = writeln!(s, "Segment{i}: {{");
            for e in &seg.exprs {
                let _ = writeln!(s, "  {}", expr_string(f, e, "  "));
            }
            let _ = writeln!(s, "}} // Segment{i}");
        }
        s.push_str("} // %HostIrContainer\n");
        for note in &self.notes {
            let _ = writeln!(s, "// {note}");
        }
        fmt.write_str(&s)
    }
}

impl fmt::Display for Fusion {
    fn fmt(&self, fmt: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ins: Vec<String> = self
            .inputs()
            .iter()
            .map(|&t| tensor_string(self, t))
            .collect();
        let outs: Vec<String> = self
            .outputs()
            .iter()
            .map(|&t| tensor_string(self, t))
            .collect();
        writeln!(
            fmt,
            "%Fusion {{ ({}) -> ({}) :",
            ins.join(", "),
            outs.join(", ")
        )?;
        for e in self.exprs() {
            writeln!(fmt, "  {}", expr_string(self, e, "  "))?;
        }
        writeln!(fmt, "}} // %Fusion")
    }
}
