//! Checking: resolves names and types, infers every tensor's shape and sharding the way
//! the builder will, and records the builder calls the expansion emits (a [`Step`] list).
//!
//! Errors are collected, not returned at the first: a failing expression yields no tensor
//! and everything depending on it stays quiet, so independent mistakes are all reported.

pub mod annotate;
mod body;
pub mod dims;
pub mod model;
pub mod ops;
mod rules;

use std::collections::{HashMap, HashSet};

use syn::Ident;

use crate::parse::{Dim, FusionDef, TensorType};
use crate::span::{suggest, Errors, SpanRange};
use annotate::Declared;
use dims::DimId;
use model::{DType, Mesh, Model, Op, Par, Tid};

/// One builder call of the generated `build()`.
#[derive(Clone, Debug)]
pub enum Step {
    /// `let out = b.input(name, ..)` (or `input_on` with a mesh).
    Input {
        out: Tid,
        name: String,
        decl: Declared,
    },
    /// `let out = b.<op>(inputs..)`.
    Op { out: Tid, op: Op, inputs: Vec<Tid> },
    /// `let out = b.declare(src, ..)`, then `b.set_mesh(out, ..)` if the mesh changes.
    Declare {
        out: Tid,
        src: Tid,
        decl: Declared,
        set_mesh: bool,
    },
    /// `b.name(t, name)`.
    Name { t: Tid, name: String },
    /// `let out = b.output(src)`.
    Output { out: Tid, src: Tid },
}

/// A fusion that passed every check: the model and the builder calls that rebuild it.
pub struct Checked {
    pub model: Model,
    pub steps: Vec<Step>,
}

/// Checks one fusion; all independent errors are combined into one.
pub fn check(def: &FusionDef) -> Result<Checked, syn::Error> {
    let mut c = Checker {
        m: Model::default(),
        errors: Errors::default(),
        dims: HashMap::new(),
        bound: HashSet::new(),
        vars: Vec::new(),
        steps: Vec::new(),
    };
    c.run(def);
    if c.errors.is_empty() {
        c.m.validate(&mut c.errors);
    }
    if c.errors.is_empty() {
        c.m.check_lowerable(&mut c.errors);
    }
    match c.errors.combined() {
        Some(e) => Err(e),
        None => Ok(Checked {
            model: c.m,
            steps: c.steps,
        }),
    }
}

/// A name in scope: what it is bound to (`None` after an error) and where.
struct Var {
    name: String,
    value: Option<Tid>,
    what: &'static str,
}

struct Checker {
    m: Model,
    errors: Errors,
    /// The generic dimension symbols.
    dims: HashMap<String, DimId>,
    /// Symbols that some input's shape binds at call time.
    bound: HashSet<String>,
    vars: Vec<Var>,
    steps: Vec<Step>,
}

impl Checker {
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
            let id = self.m.dims.symbol(&name);
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
            self.m.dtype_params.push(name);
        }
        let mut input_dtypes = Vec::new();
        for p in &def.params {
            let decl = self.resolve_type(&p.ty);
            input_dtypes.extend(decl.as_ref().map(|d| d.dtype));
            if let Some(d) = &decl {
                for &(e, _, _) in &d.axes {
                    let mut syms = Vec::new();
                    self.m.dims.symbols(e, &mut syms);
                    self.bound.extend(syms);
                }
            }
            let value = decl.and_then(|d| {
                let name = p.name.to_string();
                match self.m.input(&name, &d) {
                    Ok(t) => {
                        self.steps.push(Step::Input {
                            out: t,
                            name,
                            decl: d,
                        });
                        Some(t)
                    }
                    Err(e) => {
                        self.errors.push(e);
                        None
                    }
                }
            });
            self.bind(&p.name, value, "a parameter");
        }
        for (i, t) in def.dtype_params.iter().enumerate() {
            let unresolved = input_dtypes.len() < def.params.len();
            if !unresolved && !input_dtypes.contains(&DType::Param(i)) {
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
            let before = self.m.tensors.len();
            let value = self.eval(&l.expr);
            let value = match &l.ty {
                None => value,
                Some(ty) => {
                    let decl = self.resolve_type(ty);
                    match (value, decl) {
                        (Some(t), Some(d)) => {
                            // Messages about the annotation name the new binding.
                            if self.m.tv(t).name.is_none() {
                                self.m.tv_mut(t).name = Some(l.name.to_string());
                            }
                            self.annotate(t, &d)
                        }
                        // Keep checking what follows with the declared type.
                        (None, Some(d)) => Some(self.recover(&d)),
                        (_, None) => None,
                    }
                }
            };
            if let Some(t) = value {
                if t.0 >= before || self.m.tv(t).name.is_none() {
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
        let values: Vec<Option<Tid>> = elems.iter().map(|e| self.eval(e)).collect();
        let decls: Vec<Option<Declared>> =
            def.outputs.iter().map(|ty| self.resolve_type(ty)).collect();
        if decls.is_empty() {
            return; // reported: a fusion returns at least one tensor
        }
        if values.len() != decls.len() {
            self.errors.push(SpanRange::of(tail).error(format!(
                "this returns {} tensor(s), but the return type of `{}` declares {}",
                values.len(),
                def.name,
                decls.len()
            )));
            return;
        }
        let n = values.len();
        for (i, (v, d)) in values.into_iter().zip(decls).enumerate() {
            let (Some(t), Some(d)) = (v, d) else { continue };
            let Some(t) = self.annotate(t, &d) else {
                continue;
            };
            match self.m.output(t, d.span) {
                Ok(out) => {
                    self.steps.push(Step::Output { out, src: t });
                    if self.m.tv(out).name.is_none() {
                        let name = if n == 1 {
                            "output".to_string()
                        } else {
                            format!("output{i}")
                        };
                        self.name(out, &name);
                    }
                }
                Err(e) => self.errors.push(e),
            }
        }
    }

    /// `declare` unless the tensor already has exactly this annotation.
    fn annotate(&mut self, t: Tid, d: &Declared) -> Option<Tid> {
        if self.m.already_has(t, d) {
            return Some(t);
        }
        let set_mesh = self.m.tv(t).mesh != d.mesh;
        match self.m.declare(t, d) {
            Ok(out) => {
                self.steps.push(Step::Declare {
                    out,
                    src: t,
                    decl: d.clone(),
                    set_mesh,
                });
                Some(out)
            }
            Err(e) => {
                self.errors.push(e);
                None
            }
        }
    }

    /// A stand-in tensor of the declared type after an error (never expanded).
    fn recover(&mut self, d: &Declared) -> Tid {
        let axes = d
            .axes
            .iter()
            .map(|&(e, p, s)| model::Ax {
                extent: e,
                par: p,
                kind: model::Kind::Iter,
                origin: Some(s),
            })
            .collect();
        let t = self
            .m
            .new_tensor(d.dtype, axes, d.mesh.clone(), d.span, "let");
        self.m.declared.push(t);
        t
    }

    fn name(&mut self, t: Tid, name: &str) {
        self.m.tv_mut(t).name = Some(name.to_string());
        self.steps.push(Step::Name {
            t,
            name: name.to_string(),
        });
    }

    fn bind(&mut self, ident: &Ident, value: Option<Tid>, what: &'static str) {
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
    fn resolve_type(&mut self, ty: &TensorType) -> Option<Declared> {
        let mut ok = true;
        let dtype = self.resolve_dtype(&ty.dtype);
        ok &= dtype.is_some();
        let mut axes = Vec::new();
        for a in &ty.axes {
            let e = self.resolve_dim(&a.dim, true, false);
            let p = match &a.parallel {
                None => Some(Par::Serial),
                Some(p) => self.resolve_par(p),
            };
            match (e, p) {
                (Some(e), Some(p)) => axes.push((e, p, a.span)),
                _ => ok = false,
            }
        }
        let mesh = match &ty.mesh {
            None => Mesh::World,
            Some(m) => {
                if m.devices.is_empty() {
                    ok = false;
                    self.errors.push(m.span.error(
                        "a mesh lists at least one device; leave `mesh` out for every device",
                    ));
                }
                for (i, &(d, s)) in m.devices.iter().enumerate() {
                    if m.devices[..i].iter().any(|x| x.0 == d) {
                        ok = false;
                        self.errors.push(syn::Error::new(
                            s,
                            format!("device {d} is listed twice; a mesh lists distinct devices"),
                        ));
                    }
                }
                Mesh::Devices(m.devices.iter().map(|x| x.0).collect())
            }
        };
        let dtype = dtype?;
        ok.then(|| Declared {
            dtype,
            dtype_span: SpanRange::single(ty.dtype.span()),
            axes,
            axes_span: ty.axes_span,
            mesh,
            span: ty.span,
        })
    }

    /// `f32`, `bf16`, `f16` or one of the fusion's dtype parameters; `None` after an error.
    fn resolve_dtype(&mut self, i: &Ident) -> Option<DType> {
        let name = i.to_string();
        if let Some(d) = DType::from_name(&name) {
            return Some(d);
        }
        if let Some(p) = self.m.dtype_params.iter().position(|p| *p == name) {
            return Some(DType::Param(p));
        }
        let known = DType::NAMES
            .iter()
            .copied()
            .chain(self.m.dtype_params.iter().map(String::as_str));
        let hint = match suggest(&name, known) {
            Some(s) => format!("; did you mean `{s}`?"),
            None if self.dims.contains_key(&name) => format!(
                "; `{name}` is a dimension symbol: declare a dtype parameter as `{name}: {}`",
                crate::parse::DTYPE_BOUND
            ),
            None if name.starts_with(|c: char| c.is_ascii_uppercase()) => format!(
                "; to make it a dtype parameter, declare it in the fusion's generics as \
                 `{name}: {}`",
                crate::parse::DTYPE_BOUND
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

    fn resolve_par(&mut self, p: &Ident) -> Option<Par> {
        let s = p.to_string();
        match s.as_str() {
            "DIDx" => Some(Par::DIDx),
            "Stream" => Some(Par::Stream),
            "Serial" => Some(Par::Serial),
            _ => {
                let hint = if s.starts_with("DID") {
                    "; only `DIDx` exists: the device mesh is 1-D".to_string()
                } else {
                    match suggest(&s, ["DIDx", "Stream", "Serial"]) {
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
        }
    }

    /// Resolves an extent. `positive`: literals must be at least 1 (axis extents).
    /// `bound`: symbols must be extents of some input (scalar op arguments).
    fn resolve_dim(&mut self, d: &Dim, positive: bool, bound: bool) -> Option<DimId> {
        match d {
            Dim::Sym(i) => {
                let name = i.to_string();
                let Some(&id) = self.dims.get(&name) else {
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
                    self.errors
                        .push(syn::Error::new(i.span(), format!("{what}{hint}")));
                    return None;
                };
                if bound && !self.bound.contains(&name) {
                    self.errors.push(syn::Error::new(
                        i.span(),
                        format!(
                            "dimension `{name}` is not an extent of any input, so its value is \
                             unknown when the fusion runs; use a dimension of an input or a \
                             literal"
                        ),
                    ));
                    return None;
                }
                Some(id)
            }
            Dim::Lit { value, span } => {
                if positive && *value < 1 {
                    self.errors.push(syn::Error::new(
                        *span,
                        format!("extent {value} is not positive; an axis has extent 1 or more"),
                    ));
                    return None;
                }
                Some(self.m.dims.constant(*value))
            }
            Dim::Bin { op, lhs, rhs, .. } => {
                let a = self.resolve_dim(lhs, false, bound);
                let b = self.resolve_dim(rhs, false, bound);
                Some(self.m.dims.binary(*op, a?, b?))
            }
        }
    }
}
