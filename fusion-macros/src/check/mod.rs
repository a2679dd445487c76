//! Checking: resolves names and types, then drives `fusion_compiler`'s own `FusionBuilder`
//! op by op (with the dtype parameters symbolic) and its lowerability check, so the rules
//! applied here are the ones the fusion is built and lowered with. Each builder error
//! becomes a `syn::Error` at the source of the argument it blames ([`locate`]); each
//! successful call is recorded as the statement of the generated `build()` that makes it
//! again ([`emit`]).
//!
//! Errors are collected, not returned at the first: a failing expression yields no tensor
//! (or, under an annotation, a poisoned stand-in of the declared type) and everything
//! depending on it stays quiet, so independent mistakes are all reported.

mod body;
pub mod emit;
pub mod locate;

use std::collections::{HashMap, HashSet};

use fusion_compiler::builder::Site;
use fusion_compiler::builder::{Axis, FusionBuilder, LiteralFact};
use fusion_compiler::ir::{DeviceMesh, ParallelType, Scalar, ScalarId, ScalarOp, TensorId};
use fusion_compiler::{DType, DTypeSpec};
use proc_macro2::TokenStream;
use quote::quote;
use syn::{Expr, Ident};

use crate::parse::{FusionDef, TensorType, DTYPE_BOUND};
use crate::span::{combined, SpanRange};
use fusion_compiler::suggest::suggest;
use locate::CallSpans;

/// A fusion that passed every check: the statements of its `build()` and the literal
/// facts its checks relied on (asserted again with `static_assertions`).
pub struct Checked {
    pub stmts: Vec<TokenStream>,
    pub facts: Vec<(LiteralFact, SpanRange)>,
    /// With `#[backward]`: the inputs that want gradients.
    pub backward: Option<Vec<usize>>,
}

/// Checks one fusion; all independent errors are combined into one.
pub fn check(def: &FusionDef) -> Result<Checked, syn::Error> {
    let params: Vec<String> = def.dtype_params.iter().map(|p| p.to_string()).collect();
    let params: Vec<&str> = params.iter().map(String::as_str).collect();
    let mut c = Checker {
        b: FusionBuilder::with_dtype_params(&params),
        dtype_params: def.dtype_params.clone(),
        ..Checker::default()
    };
    c.run(def);
    if c.errors.is_empty() {
        for (site, e) in fusion_compiler::lower::check(c.b.fusion()) {
            let span = c.site(site);
            c.errors.push(span.error(e));
        }
    }
    let backward = match &def.backward {
        Some(attr) if c.errors.is_empty() => c.backward(def, attr),
        _ => None,
    };
    match combined(c.errors) {
        Some(e) => Err(e),
        None => Ok(Checked {
            stmts: c.stmts,
            facts: c.facts,
            backward,
        }),
    }
}

/// A name in scope: what it is bound to (`None` after an error) and where.
struct Var {
    name: String,
    value: Option<TensorId>,
    what: &'static str,
}

/// A resolved `Tensor<dtype, [axes], mesh = ..>` and its source, as the arguments of
/// `input_on(name, dtype, axes, mesh)` and `declare_on(t, dtype, axes, mesh)`.
#[derive(Clone)]
struct Declared {
    dtype: DTypeSpec,
    axes: Vec<Axis>,
    mesh: DeviceMesh,
    spans: CallSpans,
}

#[derive(Default)]
struct Checker {
    b: FusionBuilder,
    dtype_params: Vec<Ident>,
    errors: Vec<syn::Error>,
    /// The generic dimension symbols.
    dims: HashMap<String, ScalarId>,
    /// Symbols that some input's shape binds at call time.
    bound: HashSet<String>,
    vars: Vec<Var>,
    /// The statements of `build()`, and the extents they have defined.
    stmts: Vec<TokenStream>,
    emitted: HashSet<ScalarId>,
    /// The source of the call that made each tensor, and of each tensor's declaration.
    made: HashMap<TensorId, SpanRange>,
    decls: HashMap<TensorId, CallSpans>,
    /// Tensors named by the source (parameters, `let`s, outputs), as `build()` names them.
    named: HashSet<TensorId>,
    facts: Vec<(LiteralFact, SpanRange)>,
}

impl Checker {
    /// Derives the backward `#[backward]` asks for in both forms, as the generated code
    /// will; an op without a derivative is an error on its source. Returns the wanted
    /// inputs.
    fn backward(
        &mut self,
        def: &FusionDef,
        attr: &crate::parse::BackwardAttr,
    ) -> Option<Vec<usize>> {
        let wanted = crate::parse::wanted_inputs(def, attr)
            .map_err(|e| self.errors.push(e))
            .ok()?;
        if !def.dtype_params.is_empty() {
            self.errors.push(attr.span.error(
                "`#[backward]` does not take a fusion generic over dtypes yet; write the \
                 fusion with concrete dtypes",
            ));
            return None;
        }
        let spec = fusion_compiler::autodiff::GradSpec {
            outputs: (0..def.outputs.len()).collect(),
            inputs: wanted.clone(),
        };
        // The saving form is derived too (as its first call will): it fails where the
        // recomputing one does, so it is asked only once that one passed.
        let f = self.b.fusion();
        let derived = fusion_compiler::autodiff::backward(f, &spec)
            .and_then(|_| fusion_compiler::autodiff::saving(f, &spec));
        match derived {
            Ok(_) => Some(wanted),
            Err(e) => {
                let at = e.expr().map_or(attr.span, |id| self.site(Site::Expr(id)));
                self.errors.push(at.error(e));
                None
            }
        }
    }

    fn run(&mut self, def: &FusionDef) {
        if def.outputs.is_empty() {
            self.errors.push(syn::Error::new(
                def.name.span(),
                format!(
                    "fusion `{}` returns nothing; a fusion returns at least one tensor",
                    def.name
                ),
            ));
        }
        for d in &def.dims {
            let name = d.to_string();
            if self.dims.contains_key(&name) {
                self.errors.push(syn::Error::new(
                    d.span(),
                    format!("dimension `{name}` is declared twice; each symbol appears once"),
                ));
                continue;
            }
            let id = self.b.symbol(&name);
            self.dims.insert(name, id);
        }
        for (i, t) in def.dtype_params.iter().enumerate() {
            let name = t.to_string();
            if self.dims.contains_key(&name) || def.dtype_params[..i].iter().any(|u| *u == name) {
                self.errors.push(syn::Error::new(
                    t.span(),
                    format!("`{name}` is declared twice; each generic parameter appears once"),
                ));
            }
        }
        let mut input_dtypes = Vec::new();
        for p in &def.params {
            let decl = self.resolve_type(&p.ty, SpanRange::single(p.name.span()));
            let value = decl.and_then(|d| {
                input_dtypes.push(d.dtype);
                for a in &d.axes {
                    self.bound.extend(symbols(self.b.fusion(), a.extent));
                }
                let name = p.name.to_string();
                let call = self.declaration("input_on", quote!(#name), &d);
                let t = self.record(&d.spans, call, |b| {
                    b.input_on(&name, d.dtype, &d.axes, d.mesh.clone())
                })?;
                self.decls.insert(t, d.spans.clone());
                self.named.insert(t);
                Some(t)
            });
            self.bind(&p.name, value, "a parameter");
        }
        for (i, t) in def.dtype_params.iter().enumerate() {
            let unresolved = input_dtypes.len() < def.params.len();
            let repeated = def.dtype_params[..i].contains(t);
            if !unresolved && !repeated && !input_dtypes.contains(&DTypeSpec::Param(i)) {
                self.errors.push(syn::Error::new(
                    t.span(),
                    format!(
                        "dtype parameter `{t}` is not the element type of any input, so a call \
                         cannot bind it; declare an input as `Tensor<{t}, [..]>` or remove it"
                    ),
                ));
            }
        }
        let body = match &def.body {
            Ok(b) => b,
            Err(e) => {
                self.errors.push(e.clone());
                return;
            }
        };
        for l in &body.lets {
            let before = self.b.fusion().tensor_count();
            let mut value = self.eval(&l.expr);
            if let Some(ty) = &l.ty {
                let decl = self.resolve_type(ty, SpanRange::of(&l.expr));
                value = match (value, decl) {
                    (Some(t), Some(d)) => {
                        // Messages about the annotation name the new binding.
                        if !self.named.contains(&t) {
                            self.b.name(t, &l.name.to_string());
                        }
                        self.annotate(t, &d)
                    }
                    // Keep checking what follows with the declared type.
                    (None, Some(d)) => self.b.poisoned(d.dtype, &d.axes, d.mesh).ok(),
                    (_, None) => None,
                };
            }
            if let Some(t) = value {
                if t.index() >= before || !self.named.contains(&t) {
                    self.name(t, &l.name.to_string());
                }
            }
            self.bind(&l.name, value, "an earlier `let`");
        }
        self.returns(def, &body.tail);
    }

    /// Applies the return type to the returned tensors and marks them as outputs.
    fn returns(&mut self, def: &FusionDef, tail: &syn::Expr) {
        let elems: Vec<&syn::Expr> = match tail {
            syn::Expr::Tuple(t) => t.elems.iter().collect(),
            e => vec![e],
        };
        let values: Vec<Option<TensorId>> = elems.iter().map(|e| self.eval(e)).collect();
        let decls: Vec<Option<Declared>> = elems
            .iter()
            .zip(&def.outputs)
            .map(|(e, ty)| self.resolve_type(ty, SpanRange::of(e)))
            .collect();
        if def.outputs.is_empty() {
            return; // reported: a fusion returns at least one tensor
        }
        if values.len() != def.outputs.len() {
            self.errors.push(SpanRange::of(tail).error(format!(
                "this returns {} tensor(s), but the return type of `{}` declares {}",
                values.len(),
                def.name,
                def.outputs.len()
            )));
            return;
        }
        let n = values.len();
        for (i, (v, d)) in values.into_iter().zip(decls).enumerate() {
            let (Some(t), Some(d)) = (v, d) else { continue };
            let Some(t) = self.annotate(t, &d) else {
                continue;
            };
            let s = emit::tensor(t);
            let Some(out) = self.record(&d.spans, quote!(output(#s)), |b| b.output(t)) else {
                continue;
            };
            if !self.named.contains(&out) {
                let name = if n == 1 {
                    "output".to_string()
                } else {
                    format!("output{i}")
                };
                self.name(out, &name);
            }
        }
    }

    /// `declare_on` (which keeps `t` when it already has exactly this layout).
    fn annotate(&mut self, t: TensorId, d: &Declared) -> Option<TensorId> {
        let s = emit::tensor(t);
        let call = self.declaration("declare_on", quote!(#s), d);
        let out = self.record(&d.spans, call, |b| {
            b.declare_on(t, d.dtype, &d.axes, d.mesh.clone())
        })?;
        self.decls.insert(out, d.spans.clone());
        Some(out)
    }

    /// `input_on(first, dtype, axes, mesh)` or `declare_on(..)` as tokens.
    fn declaration(&mut self, method: &str, first: TokenStream, d: &Declared) -> TokenStream {
        for a in &d.axes {
            self.emit_dim(a.extent);
        }
        let method = Ident::new(method, proc_macro2::Span::call_site());
        let (dt, axes, mesh) = (
            emit::dtype(d.dtype, &self.dtype_params),
            emit::axes(&d.axes),
            emit::mesh(&d.mesh),
        );
        quote!(#method(#first, #dt, #axes, #mesh))
    }

    /// Makes one builder call. On success, records the statement that makes it again in
    /// `build()` (`let __tN = __builder.<call>?;`); on failure, the error at its culprit.
    /// The tensors it makes and the facts it relies on take the call's source.
    fn record(
        &mut self,
        spans: &CallSpans,
        call: TokenStream,
        f: impl FnOnce(&mut FusionBuilder) -> fusion_compiler::Result<TensorId>,
    ) -> Option<TensorId> {
        let (tensors, facts) = (self.b.fusion().tensor_count(), self.b.literal_facts().len());
        let result = f(&mut self.b);
        for i in tensors..self.b.fusion().tensor_count() {
            self.made.insert(TensorId::from_index(i), spans.whole);
        }
        let new = self.b.literal_facts()[facts..].iter();
        self.facts.extend(new.map(|&f| (f, spans.whole)));
        match result {
            Ok(t) => {
                let (t_ident, b) = (emit::tensor(t), emit::builder());
                self.stmts.push(quote!(let #t_ident = #b.#call?;));
                Some(t)
            }
            Err(e) => {
                self.errors.push(spans.error(&e));
                None
            }
        }
    }

    /// Defines an extent (and what it is made of) in `build()`, once.
    fn emit_dim(&mut self, id: ScalarId) -> Ident {
        let ident = emit::dim(id);
        if !self.emitted.insert(id) {
            return ident;
        }
        let b = emit::builder();
        let value = match self.b.fusion().scalar_node(id).clone() {
            Scalar::Const(v) => quote!(#b.constant(#v)),
            Scalar::Symbol(s) => quote!(#b.symbol(#s)),
            Scalar::Binary(op, x, y) => {
                let (x, y, op) = (self.emit_dim(x), self.emit_dim(y), emit::variant(&op));
                let fc = emit::fc();
                quote!(#b.scalar_op(#fc::ir::ScalarOp::#op, #x, #y))
            }
            other => unreachable!("a DSL extent is a symbol, a literal or arithmetic: {other:?}"),
        };
        self.stmts.push(quote!(let #ident = #value;));
        ident
    }

    /// The source behind a whole-fusion problem: the declared axis (or type) of a
    /// declared tensor, else the call that made the tensor or the expression.
    fn site(&self, site: Site) -> SpanRange {
        let call_site = SpanRange::single(proc_macro2::Span::call_site());
        let made = |t| self.made.get(&t).copied().unwrap_or(call_site);
        match site {
            Site::Tensor { tensor, axis } => match (self.decls.get(&tensor), axis) {
                (Some(d), Some(index)) => {
                    d.at(Some(fusion_compiler::Culprit::Element { arg: 2, index }))
                }
                (Some(d), None) => d.whole,
                (None, _) => made(tensor),
            },
            Site::Expr(e) => made(self.b.fusion().expr(e).output),
        }
    }

    fn name(&mut self, t: TensorId, name: &str) {
        self.b.name(t, name);
        self.named.insert(t);
        let (t, b) = (emit::tensor(t), emit::builder());
        self.stmts.push(quote!(#b.name(#t, #name);));
    }

    fn bind(&mut self, ident: &Ident, value: Option<TensorId>, what: &'static str) {
        let name = ident.to_string();
        if let Some(prev) = self.vars.iter().find(|v| v.name == name) {
            self.errors.push(syn::Error::new(
                ident.span(),
                format!(
                    "`{name}` is already bound by {}; fusion bindings cannot be shadowed \
                     (tensors are named after them in errors and dumps), so pick another name",
                    prev.what
                ),
            ));
        }
        self.vars.push(Var { name, value, what });
    }

    /// `Tensor<dtype, [axes], mesh = ..>` with names resolved; `None` after errors.
    /// `first` is the source of what the type applies to (a parameter, a value).
    fn resolve_type(&mut self, ty: &TensorType, first: SpanRange) -> Option<Declared> {
        let mut ok = true;
        let dtype = self.resolve_dtype(&ty.dtype);
        ok &= dtype.is_some();
        let mut axes = Vec::new();
        for a in &ty.axes {
            let e = self.resolve_dim(&a.dim, true, false);
            let p = match &a.parallel {
                None => Some(ParallelType::Serial),
                Some(p) => self.resolve_par(p),
            };
            match (e, p) {
                (Some(extent), Some(parallel)) => axes.push(Axis { extent, parallel }),
                _ => ok = false,
            }
        }
        let devices = ty.mesh.iter().flat_map(|m| &m.devices);
        let mesh = match &ty.mesh {
            None => DeviceMesh::World,
            Some(_) => DeviceMesh::devices(devices.clone().map(|d| d.0).collect::<Vec<_>>()),
        };
        let device_spans = devices.map(|d| SpanRange::single(d.1)).collect();
        let axis_spans = ty.axes.iter().map(|a| a.span).collect();
        let mesh_span = ty.mesh.as_ref().map_or(ty.span, |m| m.span);
        let spans = CallSpans {
            whole: ty.span,
            args: vec![
                (first, vec![]),
                (SpanRange::single(ty.dtype.span()), vec![]),
                (ty.axes_span, axis_spans),
                (mesh_span, device_spans),
            ],
        };
        let dtype = dtype?;
        ok.then_some(Declared {
            dtype,
            axes,
            mesh,
            spans,
        })
    }

    /// `f32`, `bf16`, `f16` or one of the fusion's dtype parameters; `None` after an error.
    fn resolve_dtype(&mut self, i: &Ident) -> Option<DTypeSpec> {
        let name = i.to_string();
        if let Some(d) = DType::from_name(&name) {
            return Some(DTypeSpec::Fixed(d));
        }
        if let Some(p) = self.dtype_params.iter().position(|p| *p == name) {
            return Some(DTypeSpec::Param(p));
        }
        let params: Vec<String> = self.dtype_params.iter().map(|p| p.to_string()).collect();
        let known = ["f32", "bf16", "f16"]
            .into_iter()
            .chain(params.iter().map(String::as_str));
        let hint = match suggest(&name, known) {
            Some(s) => format!("; did you mean `{s}`?"),
            None if self.dims.contains_key(&name) => format!(
                "; `{name}` is a dimension symbol: declare a dtype parameter as `{name}: \
                 {DTYPE_BOUND}`"
            ),
            None if name.starts_with(|c: char| c.is_ascii_uppercase()) => format!(
                "; to make it a dtype parameter, declare it in the fusion's generics as \
                 `{name}: {DTYPE_BOUND}`"
            ),
            None => "; the element types are `f32`, `bf16` and `f16`, or a dtype parameter \
                     (`T: Float` in the generics)"
                .into(),
        };
        self.errors.push(syn::Error::new(
            i.span(),
            format!("unknown element type `{name}`{hint}"),
        ));
        None
    }

    fn resolve_par(&mut self, p: &Ident) -> Option<ParallelType> {
        let s = p.to_string();
        let all = ParallelType::ALL;
        if let Some(&found) = all.iter().find(|t| t.name() == s) {
            return Some(found);
        }
        let hint = if s.starts_with("DID") {
            "; only `DIDx` exists: the device mesh is 1-D".to_string()
        } else {
            match suggest(&s, all.iter().map(|t| t.name())) {
                Some(x) => format!("; did you mean `{x}`?"),
                None => "; an axis is `@ DIDx` (sharded over the devices), `@ Stream` \
                         (pipelined over streams), or serial (no `@`)"
                    .into(),
            }
        };
        self.errors.push(syn::Error::new(
            p.span(),
            format!("unknown parallel type `{s}`{hint}"),
        ));
        None
    }

    /// Resolves an extent: a symbol, an integer, or `+ - * /` of them. `positive`:
    /// literals must be at least 1 (axis extents). `bound`: symbols must be extents of
    /// some input (scalar op arguments).
    fn resolve_dim(&mut self, e: &Expr, positive: bool, bound: bool) -> Option<ScalarId> {
        let error = |span: SpanRange, msg: String| span.error(msg);
        let at = SpanRange::of(e);
        let result = match e {
            Expr::Paren(p) => return self.resolve_dim(&p.expr, positive, bound),
            Expr::Group(g) => return self.resolve_dim(&g.expr, positive, bound),
            Expr::Path(p) if p.path.get_ident().is_some() => {
                let name = p.path.get_ident().expect("checked").to_string();
                match self.dims.get(&name) {
                    None => {
                        let hint = match suggest(&name, self.dims.keys().map(String::as_str)) {
                            Some(s) => format!("; did you mean `{s}`?"),
                            None => format!(
                                "; declare it in the fusion's generics, e.g. `fn f<.., {name}>`"
                            ),
                        };
                        let what = if self.vars.iter().any(|v| v.name == name) {
                            format!("`{name}` is a tensor, not a dimension symbol")
                        } else {
                            format!("unknown dimension `{name}`")
                        };
                        Err(error(at, format!("{what}{hint}")))
                    }
                    Some(_) if bound && !self.bound.contains(&name) => Err(error(
                        at,
                        format!(
                            "dimension `{name}` is not an extent of any input, so its value is \
                             unknown when the fusion runs; use a dimension of an input or a \
                             literal"
                        ),
                    )),
                    Some(&id) => Ok(id),
                }
            }
            Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Int(i),
                ..
            }) => match i.base10_parse::<i64>() {
                Ok(v) if positive && v < 1 => Err(error(
                    at,
                    format!("extent {v} is not positive; an axis has extent 1 or more"),
                )),
                Ok(v) => Ok(self.b.constant(v)),
                Err(e) => Err(e),
            },
            Expr::Binary(b) if scalar_op(&b.op).is_some() => {
                let x = self.resolve_dim(&b.left, false, bound);
                let y = self.resolve_dim(&b.right, false, bound);
                let op = scalar_op(&b.op).expect("checked");
                return Some(self.b.scalar_op(op, x?, y?));
            }
            _ => Err(error(
                at,
                "expected a dimension: a symbol from the fusion's generics (`m`), an integer \
                 (`1024`), or `+ - * /` of them"
                    .into(),
            )),
        };
        result.map_err(|e| self.errors.push(e)).ok()
    }
}

/// The extent arithmetic of `+ - * /`.
fn scalar_op(op: &syn::BinOp) -> Option<ScalarOp> {
    Some(match op {
        syn::BinOp::Add(_) => ScalarOp::Add,
        syn::BinOp::Sub(_) => ScalarOp::Sub,
        syn::BinOp::Mul(_) => ScalarOp::Mul,
        syn::BinOp::Div(_) => ScalarOp::Div,
        _ => return None,
    })
}

/// The dimension symbols an extent mentions.
fn symbols(f: &fusion_compiler::ir::Fusion, id: ScalarId) -> Vec<String> {
    match f.scalar_node(id) {
        Scalar::Symbol(s) => vec![s.clone()],
        Scalar::Binary(_, a, b) => [symbols(f, *a), symbols(f, *b)].concat(),
        _ => vec![],
    }
}
