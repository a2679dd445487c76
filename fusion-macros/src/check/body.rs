//! Body expressions: variables, op calls and infix arithmetic, each a builder call.

use fusion_compiler::builder::FusionBuilder;
use fusion_compiler::ir::{BinaryOp, ReduceOp, ScalarId, TensorId, UnaryOp};
use fusion_compiler::DTypeSpec;
use proc_macro2::TokenStream;
use quote::quote;
use syn::{BinOp, Expr, ExprCall, Lit, UnOp};

use super::locate::{label, CallSpans};
use super::{emit, Checker};
use crate::span::SpanRange;
use fusion_compiler::suggest::suggest;

/// What an op of the DSL builds: one of `fusion_compiler`'s elementwise functions or
/// reductions, or the builder method of that name (`set`, `cast`, `matmul`, ..).
#[derive(Clone, Copy)]
enum Kind {
    Unary(UnaryOp),
    Binary(BinaryOp),
    Reduce(ReduceOp),
    Method(&'static str),
}

/// One op of the DSL: its name, what it builds, the argument list shown in messages,
/// and the least and most arguments it takes.
type OpSig = (&'static str, Kind, &'static str, usize, usize);

/// Every op the DSL knows; the elementwise functions and reductions are `fusion_compiler`'s.
fn ops() -> Vec<OpSig> {
    let method = |name, args, min, max| (name, Kind::Method(name), args, min, max);
    let mut v: Vec<OpSig> = vec![method("set", "x", 1, 1)];
    v.extend(UnaryOp::ALL.map(|u| (u.name(), Kind::Unary(u), "x", 1, 1)));
    v.push(method("cast", "x, dtype", 2, 2));
    v.extend(BinaryOp::ALL.map(|b| (b.name(), Kind::Binary(b), "a, b", 2, 2)));
    let axes = "x, axis or [axes]";
    v.extend(ReduceOp::ALL.map(|r| (r.name(), Kind::Reduce(r), axes, 2, 2)));
    v.extend([
        method("broadcast", "x, [flags]", 2, 2),
        method("matmul", "a, b", 2, 2),
        method("linear", "x, w, bias?", 2, 3),
        method("select", "x, axis, index", 3, 3),
        method("slice", "x, axis, start, stop", 4, 4),
        method("split", "x, axis, outer", 3, 3),
        method("transpose", "x, axis, axis", 3, 3),
        method("permute", "x, [axes]", 2, 2),
    ]);
    v
}

impl Checker {
    /// Evaluates an expression to a tensor; `None` after an error (already recorded).
    pub(super) fn eval(&mut self, e: &Expr) -> Option<TensorId> {
        let span = SpanRange::of(e);
        match e {
            Expr::Path(p) if p.qself.is_none() && p.path.get_ident().is_some() => {
                self.lookup(p.path.get_ident().expect("checked"))
            }
            Expr::Paren(p) => self.eval(&p.expr),
            Expr::Group(g) => self.eval(&g.expr),
            Expr::Call(call) => self.call(e, call),
            Expr::Binary(b) => {
                let op = match b.op {
                    BinOp::Add(_) => BinaryOp::Add,
                    BinOp::Sub(_) => BinaryOp::Sub,
                    BinOp::Mul(_) => BinaryOp::Mul,
                    BinOp::Div(_) => BinaryOp::Div,
                    _ => {
                        self.errors.push(SpanRange::of(&b.op).error(
                            "unsupported operator: fusions combine tensors with `+ - * /` and \
                             op calls such as `maximum(a, b)`",
                        ));
                        return None;
                    }
                };
                let ts = [self.eval(&b.left), self.eval(&b.right)];
                let spans = CallSpans::of(e, &[&b.left, &b.right]);
                self.apply(e, &spans, Kind::Binary(op), &ts, &[])
            }
            Expr::Unary(u) if matches!(u.op, UnOp::Neg(_)) => {
                let x = self.eval(&u.expr);
                let spans = CallSpans::of(e, &[&u.expr]);
                self.apply(e, &spans, Kind::Unary(UnaryOp::Neg), &[x], &[])
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
                let hint = if ops().iter().any(|o| o.0 == name) {
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

    fn lookup(&mut self, ident: &syn::Ident) -> Option<TensorId> {
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

    fn call(&mut self, e: &Expr, call: &ExprCall) -> Option<TensorId> {
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
        let all = ops();
        let Some(&(_, kind, sig, min, max)) = all.iter().find(|o| o.0 == name) else {
            let hint = if name == "min" {
                "; for the elementwise minimum use `minimum(a, b)` (there is no min reduction)"
                    .to_string()
            } else {
                match suggest(&name, all.iter().map(|o| o.0)) {
                    Some(s) => format!("; did you mean `{s}`?"),
                    None => {
                        let names: Vec<&str> = all.iter().map(|o| o.0).collect();
                        format!("; the ops are {}", names.join(", "))
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
        if args.len() < min || args.len() > max {
            let parens = SpanRange::single(call.paren_token.span.join());
            let want = if min == max {
                format!("{min} argument{}", if min == 1 { "" } else { "s" })
            } else {
                format!("{min} or {max} arguments")
            };
            self.errors.push(parens.error(format!(
                "`{name}` takes {want}, `{name}({sig})`, but {} {} given",
                args.len(),
                if args.len() == 1 { "was" } else { "were" }
            )));
            return None;
        }
        let spans = CallSpans::of(e, &args);
        // Every tensor operand and argument is looked at, so that all their errors are
        // reported, before the op is built.
        let tensors = match kind {
            Kind::Binary(_) | Kind::Method("matmul" | "linear") => args.len(),
            _ => 1,
        };
        let ts: Vec<Option<TensorId>> = args[..tensors].iter().map(|a| self.eval(a)).collect();
        self.apply(e, &spans, kind, &ts, &args[tensors..])
    }

    /// Builds op `kind` of tensor operands `ts` (`None` where one failed) and the other
    /// arguments `rest`, once all of them are looked at.
    fn apply(
        &mut self,
        e: &Expr,
        spans: &CallSpans,
        kind: Kind,
        ts: &[Option<TensorId>],
        rest: &[&Expr],
    ) -> Option<TensorId> {
        let fc = emit::fc();
        let t = |i: usize| ts.get(i).copied().flatten().map(emit::tensor);
        let (x, tx) = (ts[0], t(0));
        match kind {
            Kind::Method("set") => {
                let x = x?;
                self.op(e, spans, quote!(set(#tx)), |b| b.set(x))
            }
            Kind::Unary(u) => {
                let (x, v) = (x?, emit::variant(&u));
                let call = quote!(unary(#fc::ir::UnaryOp::#v, #tx));
                self.op(e, spans, call, |b| b.unary(u, x))
            }
            Kind::Binary(op) => {
                let (x, y, v, ty) = (x?, ts[1]?, emit::variant(&op), t(1));
                let call = quote!(binary(#fc::ir::BinaryOp::#v, #tx, #ty));
                self.op(e, spans, call, |b| b.binary(op, x, y))
            }
            Kind::Method("matmul") => {
                let (x, y, ty) = (x?, ts[1]?, t(1));
                self.op(e, spans, quote!(matmul(#tx, #ty)), |b| b.matmul(x, y))
            }
            Kind::Method("linear") => {
                let (x, w, tw) = (x?, ts[1]?, t(1));
                let bias = match ts.get(2) {
                    Some(bias) => Some((*bias)?),
                    None => None,
                };
                let tb = match t(2) {
                    Some(tb) => quote!(::core::option::Option::Some(#tb)),
                    None => quote!(::core::option::Option::None),
                };
                let call = quote!(linear(#tx, #tw, #tb));
                self.op(e, spans, call, |b| b.linear(x, w, bias))
            }
            Kind::Method("cast") => {
                let d = self.dtype_arg(rest[0]);
                let (x, d) = (x?, d?);
                let dt = emit::dtype(d, &self.dtype_params);
                self.op(e, spans, quote!(cast(#tx, #dt)), |b| b.cast(x, d))
            }
            Kind::Reduce(r) => {
                let axes = self.axes_arg(rest[0], r);
                let (x, axes, v) = (x?, axes?, emit::variant(&r));
                let call = quote!(reduce(#fc::ir::ReduceOp::#v, #tx, &[#(#axes),*]));
                self.op(e, spans, call, |b| b.reduce(r, x, &axes))
            }
            Kind::Method("broadcast") => {
                let flags = self.flags_arg(rest[0]);
                let (x, flags) = (x?, flags?);
                let call = quote!(broadcast(#tx, &[#(#flags),*]));
                self.op(e, spans, call, |b| b.broadcast(x, &flags))
            }
            Kind::Method("transpose") => {
                let (a, b) = (self.axis_arg(rest[0]), self.axis_arg(rest[1]));
                let (x, a, b) = (x?, a?, b?);
                self.op(e, spans, quote!(transpose(#tx, #a, #b)), |b_| {
                    b_.transpose(x, a, b)
                })
            }
            Kind::Method("permute") => {
                let perm = self.perm_arg(rest[0]);
                let (x, perm) = (x?, perm?);
                let call = quote!(permute(#tx, &[#(#perm),*]));
                self.op(e, spans, call, |b| b.permute(x, &perm))
            }
            Kind::Method(method) => {
                // The views: `select(x, axis, index)`, `slice(x, axis, start, stop)`,
                // `split(x, axis, outer)`.
                let axis = self.axis_arg(rest[0]);
                let dims: Vec<_> = rest[1..]
                    .iter()
                    .map(|a| self.resolve_dim(a, false, true))
                    .collect();
                let dims: Vec<ScalarId> = dims.into_iter().collect::<Option<_>>()?;
                let (x, axis) = (x?, axis?);
                let d: Vec<_> = dims.iter().map(|&d| self.emit_dim(d)).collect();
                let view: fn(&mut FusionBuilder, _, _, &[_]) -> _ = match method {
                    "select" => |b, x, a, d| b.select(x, a, d[0]),
                    "slice" => |b, x, a, d| b.slice(x, a, d[0], d[1]),
                    _ => |b, x, a, d| b.split(x, a, d[0]),
                };
                let method = syn::Ident::new(method, proc_macro2::Span::call_site());
                let call = quote!(#method(#tx, #axis, #(#d),*));
                self.op(e, spans, call, |b| view(b, x, axis, &dims))
            }
        }
    }

    /// One op as a builder call: checked now, repeated in `build()`; an unnamed result
    /// is called by its source in messages.
    fn op(
        &mut self,
        e: &Expr,
        spans: &CallSpans,
        call: TokenStream,
        f: impl FnOnce(&mut FusionBuilder) -> fusion_compiler::Result<TensorId>,
    ) -> Option<TensorId> {
        let before = self.b.fusion().tensor_count();
        let out = self.record(spans, call, f)?;
        if out.index() >= before && !self.named.contains(&out) {
            self.b.name(out, &label(e));
        }
        Some(out)
    }

    fn dtype_arg(&mut self, e: &Expr) -> Option<DTypeSpec> {
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

    fn axis_arg(&mut self, e: &Expr) -> Option<usize> {
        if let Expr::Lit(l) = e {
            if let Lit::Int(i) = &l.lit {
                if let Ok(v) = i.base10_parse::<usize>() {
                    return Some(v);
                }
            }
        }
        self.errors.push(
            SpanRange::of(e)
                .error("expected an axis index: a non-negative integer literal such as `1`"),
        );
        None
    }

    fn axes_arg(&mut self, e: &Expr, op: ReduceOp) -> Option<Vec<usize>> {
        match e {
            Expr::Lit(_) => self.axis_arg(e).map(|a| vec![a]),
            Expr::Array(a) if !a.elems.is_empty() => {
                let v: Vec<_> = a.elems.iter().map(|x| self.axis_arg(x)).collect();
                v.into_iter().collect()
            }
            _ => {
                let tensor = matches!(e, Expr::Path(_) | Expr::Call(_) | Expr::Binary(_));
                let hint = if op == ReduceOp::Max && tensor {
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

    /// A permutation: a list of axis indices, `[1, 0]`.
    fn perm_arg(&mut self, e: &Expr) -> Option<Vec<usize>> {
        if let Expr::Array(a) = e {
            let v: Vec<_> = a.elems.iter().map(|x| self.axis_arg(x)).collect();
            return v.into_iter().collect();
        }
        self.errors.push(SpanRange::of(e).error(
            "expected a permutation: the input's axes in the order of the result, such as \
             `[1, 0]` (`transpose(x, a, b)` swaps two)",
        ));
        None
    }

    fn flags_arg(&mut self, e: &Expr) -> Option<Vec<bool>> {
        let flag = |x: &Expr| match x {
            Expr::Lit(syn::ExprLit {
                lit: Lit::Bool(b), ..
            }) => Some(b.value),
            _ => None,
        };
        if let Expr::Array(a) = e {
            if let Some(f) = a.elems.iter().map(flag).collect() {
                return Some(f);
            }
        }
        self.errors.push(SpanRange::of(e).error(
            "expected broadcast flags, one per result axis: `[true, false, ..]` (`true` inserts \
             a new axis of extent 1)",
        ));
        None
    }
}
