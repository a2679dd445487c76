//! Body expressions: variables, op calls and infix arithmetic, checked op by op.

use syn::{BinOp, Expr, ExprCall, Lit, UnOp};

use super::dims::DimId;
use super::model::{Binary, DType, Reduce, Tid, Unary};
use super::{Checker, Step};
use crate::parse::dim_from_expr;
use crate::span::{suggest, SpanRange};

/// One op of the DSL: its name and the argument list shown in messages.
struct OpSig {
    name: &'static str,
    args: &'static str,
    min: usize,
    max: usize,
}

const fn sig(name: &'static str, args: &'static str, min: usize, max: usize) -> OpSig {
    OpSig {
        name,
        args,
        min,
        max,
    }
}

/// Every op the DSL knows.
const OPS: &[OpSig] = &[
    sig("set", "x", 1, 1),
    sig("relu", "x", 1, 1),
    sig("gelu", "x", 1, 1),
    sig("neg", "x", 1, 1),
    sig("exp", "x", 1, 1),
    sig("tanh", "x", 1, 1),
    sig("sigmoid", "x", 1, 1),
    sig("abs", "x", 1, 1),
    sig("sqrt", "x", 1, 1),
    sig("gelu_tanh", "x", 1, 1),
    sig("silu", "x", 1, 1),
    sig("cast", "x, dtype", 2, 2),
    sig("add", "a, b", 2, 2),
    sig("sub", "a, b", 2, 2),
    sig("mul", "a, b", 2, 2),
    sig("div", "a, b", 2, 2),
    sig("maximum", "a, b", 2, 2),
    sig("minimum", "a, b", 2, 2),
    sig("sum", "x, axis or [axes]", 2, 2),
    sig("max", "x, axis or [axes]", 2, 2),
    sig("broadcast", "x, [flags]", 2, 2),
    sig("matmul", "a, b", 2, 2),
    sig("linear", "x, w, bias?", 2, 3),
    sig("select", "x, axis, index", 3, 3),
    sig("slice", "x, axis, start, stop", 4, 4),
    sig("split", "x, axis, outer", 3, 3),
];

fn unary(name: &str) -> Option<Unary> {
    Some(match name {
        "relu" => Unary::Relu,
        "gelu" => Unary::Gelu,
        "neg" => Unary::Neg,
        "exp" => Unary::Exp,
        "tanh" => Unary::Tanh,
        "sigmoid" => Unary::Sigmoid,
        "abs" => Unary::Abs,
        "sqrt" => Unary::Sqrt,
        "gelu_tanh" => Unary::GeluTanh,
        "silu" => Unary::Silu,
        _ => return None,
    })
}

fn binary(name: &str) -> Option<Binary> {
    Some(match name {
        "add" => Binary::Add,
        "sub" => Binary::Sub,
        "mul" => Binary::Mul,
        "div" => Binary::Div,
        "maximum" => Binary::Max,
        "minimum" => Binary::Min,
        _ => return None,
    })
}

impl Checker {
    /// Evaluates an expression to a tensor; `None` after an error (already recorded).
    pub(super) fn eval(&mut self, e: &Expr) -> Option<Tid> {
        let span = SpanRange::of(e);
        match e {
            Expr::Path(p) if p.qself.is_none() && p.path.get_ident().is_some() => {
                self.lookup(p.path.get_ident().expect("checked"))
            }
            Expr::Paren(p) => self.eval(&p.expr),
            Expr::Group(g) => self.eval(&g.expr),
            Expr::Call(call) => self.call(call),
            Expr::Binary(b) => {
                let op = match b.op {
                    BinOp::Add(_) => Binary::Add,
                    BinOp::Sub(_) => Binary::Sub,
                    BinOp::Mul(_) => Binary::Mul,
                    BinOp::Div(_) => Binary::Div,
                    _ => {
                        self.errors.push(SpanRange::of(&b.op).error(
                            "unsupported operator: fusions combine tensors with `+ - * /` and \
                             op calls such as `maximum(a, b)`",
                        ));
                        return None;
                    }
                };
                let (l, r) = (self.eval(&b.left), self.eval(&b.right));
                let (l, r) = (l?, r?);
                let res = self.m.binary(op, l, r, span);
                self.op_result(res)
            }
            Expr::Unary(u) if matches!(u.op, UnOp::Neg(_)) => {
                let x = self.eval(&u.expr)?;
                let res = self.m.unary(Unary::Neg, x, span);
                self.op_result(res)
            }
            Expr::Lit(_) => {
                self.errors.push(span.error(
                    "expected a tensor, found a literal: fusions compute on tensors only \
                     (scalar constants are not supported)",
                ));
                None
            }
            Expr::Tuple(_) => {
                self.errors.push(span.error(
                    "a tuple of tensors can only be returned, as the last expression of the \
                     fusion",
                ));
                None
            }
            Expr::MethodCall(mc) => {
                let name = mc.method.to_string();
                let hint = if OPS.iter().any(|o| o.name == name) {
                    format!("; write `{name}(x, ..)`")
                } else {
                    String::new()
                };
                self.errors.push(span.error(format!(
                    "method calls are not supported in a fusion: ops are functions{hint}"
                )));
                None
            }
            _ => {
                self.errors.push(span.error(
                    "not supported in a fusion: expected a tensor name, an op call such as \
                     `matmul(a, b)`, or `+ - * /` of tensors",
                ));
                None
            }
        }
    }

    fn lookup(&mut self, ident: &syn::Ident) -> Option<Tid> {
        let name = ident.to_string();
        if let Some(v) = self.vars.iter().rev().find(|v| v.name == name) {
            return v.value;
        }
        let msg = if self.dims.contains_key(&name) {
            format!(
                "`{name}` is a dimension symbol, not a tensor; tensors are the fusion's \
                 parameters and `let` bindings"
            )
        } else {
            let hint = match suggest(&name, self.vars.iter().map(|v| v.name.as_str())) {
                Some(s) => format!("; did you mean `{s}`?"),
                None => "; tensors are the fusion's parameters and `let` bindings before this \
                         point"
                    .into(),
            };
            format!("cannot find tensor `{name}` in this fusion{hint}")
        };
        self.errors.push(syn::Error::new(ident.span(), msg));
        None
    }

    /// Records a successful op's step, or its error.
    fn op_result(&mut self, r: syn::Result<Tid>) -> Option<Tid> {
        match r {
            Ok(out) => {
                let e = self.m.exprs.last().expect("an op adds an expression");
                debug_assert_eq!(e.output, out);
                self.steps.push(Step::Op {
                    out,
                    op: e.op.clone(),
                    inputs: e.inputs.clone(),
                });
                Some(out)
            }
            Err(e) => {
                self.errors.push(e);
                None
            }
        }
    }

    fn call(&mut self, call: &ExprCall) -> Option<Tid> {
        let span = SpanRange::of(call);
        let func = match &*call.func {
            Expr::Path(p) if p.qself.is_none() && p.path.get_ident().is_some() => {
                p.path.get_ident().expect("checked").clone()
            }
            f => {
                self.errors
                    .push(SpanRange::of(f).error("expected an op name such as `matmul` or `relu`"));
                return None;
            }
        };
        let name = func.to_string();
        let Some(op) = OPS.iter().find(|o| o.name == name) else {
            let hint = if name == "min" {
                "; for the elementwise minimum use `minimum(a, b)` (there is no min reduction)"
                    .to_string()
            } else {
                match suggest(&name, OPS.iter().map(|o| o.name)) {
                    Some(s) => format!("; did you mean `{s}`?"),
                    None => {
                        let all: Vec<&str> = OPS.iter().map(|o| o.name).collect();
                        format!("; the ops are {}", all.join(", "))
                    }
                }
            };
            self.errors.push(syn::Error::new(
                func.span(),
                format!("unknown op `{name}`{hint}"),
            ));
            // Still check the arguments: their mistakes are independent.
            for a in &call.args {
                if !matches!(a, Expr::Lit(_) | Expr::Array(_)) {
                    self.eval(a);
                }
            }
            return None;
        };
        let args: Vec<&Expr> = call.args.iter().collect();
        if args.len() < op.min || args.len() > op.max {
            let parens = SpanRange::single(call.paren_token.span.join());
            let want = if op.min == op.max {
                format!("{} argument{}", op.min, if op.min == 1 { "" } else { "s" })
            } else {
                format!("{} or {} arguments", op.min, op.max)
            };
            self.errors.push(parens.error(format!(
                "`{name}` takes {want}, `{name}({})`, but {} {} given",
                op.args,
                args.len(),
                if args.len() == 1 { "was" } else { "were" }
            )));
            return None;
        }
        if let Some(u) = unary(&name) {
            let x = self.eval(args[0])?;
            let r = self.m.unary(u, x, span);
            return self.op_result(r);
        }
        if let Some(b) = binary(&name) {
            let (x, y) = (self.eval(args[0]), self.eval(args[1]));
            let r = self.m.binary(b, x?, y?, span);
            return self.op_result(r);
        }
        let r = match name.as_str() {
            "set" => {
                let x = self.eval(args[0])?;
                self.m.set(x, span)
            }
            "cast" => {
                let x = self.eval(args[0]);
                let dt = self.dtype_arg(args[1]);
                self.m.cast(x?, dt?, span)
            }
            "sum" | "max" => {
                let x = self.eval(args[0]);
                let axes = self.axes_arg(args[1], &name);
                let op = if name == "sum" {
                    Reduce::Sum
                } else {
                    Reduce::Max
                };
                self.m.reduce(op, x?, &axes?, span)
            }
            "broadcast" => {
                let x = self.eval(args[0]);
                let flags = self.flags_arg(args[1]);
                self.m.broadcast(x?, &flags?, SpanRange::of(args[1]), span)
            }
            "matmul" => {
                let (a, b) = (self.eval(args[0]), self.eval(args[1]));
                self.m.matmul(a?, b?, span)
            }
            "linear" => {
                let (x, w) = (self.eval(args[0]), self.eval(args[1]));
                let bias = args.get(2).map(|b| self.eval(b));
                let bias = match bias {
                    Some(None) => return None,
                    Some(Some(b)) => Some(b),
                    None => None,
                };
                self.m.linear(x?, w?, bias, span)
            }
            "select" => {
                let x = self.eval(args[0]);
                let axis = self.axis_arg(args[1]);
                let index = self.dim_arg(args[2]);
                self.m.select(x?, axis?, index?, span)
            }
            "slice" => {
                let x = self.eval(args[0]);
                let axis = self.axis_arg(args[1]);
                let start = self.dim_arg(args[2]);
                let stop = self.dim_arg(args[3]);
                self.m.slice(x?, axis?, start?, stop?, span)
            }
            "split" => {
                let x = self.eval(args[0]);
                let axis = self.axis_arg(args[1]);
                let outer = self.dim_arg(args[2]);
                self.m.split(x?, axis?, outer?, span)
            }
            other => unreachable!("op table and dispatch disagree on `{other}`"),
        };
        self.op_result(r)
    }

    fn dtype_arg(&mut self, e: &Expr) -> Option<DType> {
        if let Expr::Path(p) = e {
            if let Some(i) = p.path.get_ident() {
                return self.resolve_dtype(i);
            }
        }
        self.errors.push(SpanRange::of(e).error(
            "expected an element type to cast to: `f32`, `bf16`, `f16` or a dtype parameter",
        ));
        None
    }

    fn axis_arg(&mut self, e: &Expr) -> Option<(usize, SpanRange)> {
        if let Expr::Lit(l) = e {
            if let Lit::Int(i) = &l.lit {
                if let Ok(v) = i.base10_parse::<usize>() {
                    return Some((v, SpanRange::single(i.span())));
                }
            }
        }
        self.errors.push(
            SpanRange::of(e)
                .error("expected an axis index: a non-negative integer literal such as `1`"),
        );
        None
    }

    fn axes_arg(&mut self, e: &Expr, op: &str) -> Option<Vec<(usize, SpanRange)>> {
        match e {
            Expr::Lit(_) => self.axis_arg(e).map(|a| vec![a]),
            Expr::Array(a) if !a.elems.is_empty() => {
                let v: Vec<_> = a.elems.iter().map(|x| self.axis_arg(x)).collect();
                v.into_iter().collect()
            }
            _ => {
                let tensor = matches!(e, Expr::Path(_) | Expr::Call(_) | Expr::Binary(_));
                let hint = if op == "max" && tensor {
                    "; `max` reduces over axes: for the elementwise maximum of two tensors use \
                     `maximum(a, b)`"
                } else {
                    ""
                };
                self.errors.push(SpanRange::of(e).error(format!(
                    "expected the axes to reduce: an index (`1`) or a non-empty list (`[0, 2]`){hint}"
                )));
                None
            }
        }
    }

    fn flags_arg(&mut self, e: &Expr) -> Option<Vec<bool>> {
        if let Expr::Array(a) = e {
            let flags: Option<Vec<bool>> = a
                .elems
                .iter()
                .map(|x| match x {
                    Expr::Lit(l) => match &l.lit {
                        Lit::Bool(b) => Some(b.value),
                        _ => None,
                    },
                    _ => None,
                })
                .collect();
            if let Some(f) = flags {
                return Some(f);
            }
        }
        self.errors.push(SpanRange::of(e).error(
            "expected broadcast flags, one per result axis: `[true, false, ..]` (`true` inserts \
             a new axis of extent 1)",
        ));
        None
    }

    fn dim_arg(&mut self, e: &Expr) -> Option<(DimId, SpanRange)> {
        match dim_from_expr(e) {
            Ok(d) => self
                .resolve_dim(&d, false, true)
                .map(|id| (id, SpanRange::of(e))),
            Err(err) => {
                self.errors.push(err);
                None
            }
        }
    }
}
