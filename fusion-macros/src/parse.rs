//! Parsing: `fusion! { ... }` tokens into a small AST.
//!
//! ```text
//! block   := fusion*                (an attr may be `#[backward]` or `#[backward(input,*)]`)
//! fusion  := attr* vis `fn` name (`<` generic,* `>`)? `(` (name `:` type),* `)` `->` ret `{` body `}`
//! generic := dim-symbol | dtype-param `:` `Float`
//! ret     := type | `(` type,* `)`
//! type    := `Tensor` `<` (dtype | dtype-param) `,` `[` axis,* `]` (`,` `mesh` `=` `[` int,* `]`)? `>`
//! axis    := dim (`@` parallel)?
//! dim     := symbol | int | dim (`+`|`-`|`*`|`/`) dim | `(` dim `)` (a Rust expression)
//! body    := (`let` name (`:` type)? `=` expr `;`)* expr
//! ```
//!
//! Body expressions stay `syn::Expr`; the checker interprets them. A fusion's body is
//! parsed on its own, so a syntax error there still leaves the signature for the stub
//! entry point that keeps follow-on errors away.

use proc_macro2::{Span, TokenStream};
use syn::parse::{Parse, ParseStream};
use syn::{bracketed, parenthesized, Attribute, Ident, LitInt, Token, Visibility};

use crate::span::SpanRange;

/// Everything inside `fusion! { ... }`.
pub struct Block {
    pub fusions: Vec<FusionDef>,
}

/// One `fn` of the block.
pub struct FusionDef {
    /// Outer attributes, doc comments included (carried to the entry point).
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub name: Ident,
    /// The generic dimension symbols.
    pub dims: Vec<Ident>,
    /// The generic dtype parameters (`T: Float`), in order.
    pub dtype_params: Vec<Ident>,
    pub params: Vec<Param>,
    /// The declared output types (one, or a tuple).
    pub outputs: Vec<TensorType>,
    /// The body, parsed separately so that a syntax error there keeps the signature.
    pub body: syn::Result<Body>,
    /// `#[backward]`: generate the backward (taken out of `attrs`).
    pub backward: Option<BackwardAttr>,
}

/// One input: `name: Tensor<..>`.
pub struct Param {
    pub name: Ident,
    pub ty: TensorType,
}

/// `Tensor<dtype, [axes], mesh = [devices]>`.
#[derive(Clone)]
pub struct TensorType {
    pub dtype: Ident,
    pub axes: Vec<AxisSpec>,
    /// The `[...]` axis list.
    pub axes_span: SpanRange,
    pub mesh: Option<MeshSpec>,
    /// From `Tensor` to the closing `>`.
    pub span: SpanRange,
}

/// One axis: an extent and an optional `@ Parallel`. The extent is an expression the
/// checker reads: a symbol, an integer, or `+ - * /` of them.
#[derive(Clone)]
pub struct AxisSpec {
    pub dim: syn::Expr,
    pub parallel: Option<Ident>,
    pub span: SpanRange,
}

/// `mesh = [0, 1]`: the devices a tensor lives on.
#[derive(Clone)]
pub struct MeshSpec {
    pub devices: Vec<(usize, Span)>,
    pub span: SpanRange,
}

/// `let` statements and the returned expression.
pub struct Body {
    pub lets: Vec<Let>,
    pub tail: syn::Expr,
}

/// `let name: Type = expr;`
pub struct Let {
    pub name: Ident,
    pub ty: Option<TensorType>,
    pub expr: syn::Expr,
    /// The closing `;`.
    pub semi: Span,
}

impl Parse for Block {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut fusions = Vec::new();
        while !input.is_empty() {
            fusions.push(input.parse()?);
        }
        Ok(Block { fusions })
    }
}

impl Parse for FusionDef {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut attrs = input.call(Attribute::parse_outer)?;
        let backward = take_attr(&mut attrs)?;
        let vis: Visibility = input.parse()?;
        if !input.peek(Token![fn]) {
            return Err(input.error(
                "expected `fn`: a `fusion!` block holds fusions written as \
                 `fn name<dims>(inputs) -> outputs { body }`",
            ));
        }
        input.parse::<Token![fn]>()?;
        let name: Ident = input.parse()?;
        let (dims, dtype_params) = parse_generics(input)?;
        let content;
        parenthesized!(content in input);
        let param = |input: ParseStream| {
            let name: Ident = input.parse()?;
            input.parse::<Token![:]>()?;
            Ok(Param {
                name,
                ty: input.parse()?,
            })
        };
        let params = content
            .parse_terminated(param, Token![,])?
            .into_iter()
            .collect();
        if !input.peek(Token![->]) {
            return Err(syn::Error::new(
                name.span(),
                format!(
                    "fusion `{name}` needs a return type: `-> Tensor<dtype, [axes]>`, or a tuple \
                     of them for several outputs"
                ),
            ));
        }
        input.parse::<Token![->]>()?;
        let outputs = if input.peek(syn::token::Paren) {
            let content;
            parenthesized!(content in input);
            let list = content.parse_terminated(TensorType::parse, Token![,])?;
            list.into_iter().collect()
        } else {
            vec![input.parse()?]
        };
        let content;
        let brace = syn::braced!(content in input);
        let tokens: TokenStream = content.parse()?;
        let body = if tokens.is_empty() {
            Err(syn::Error::new(
                brace.span.join(),
                "a fusion's body ends with the expression it returns (a tensor, or a tuple of \
                 tensors)",
            ))
        } else {
            syn::parse2::<Body>(tokens)
        };
        Ok(FusionDef {
            attrs,
            vis,
            name,
            dims,
            dtype_params,
            params,
            outputs,
            body,
            backward,
        })
    }
}

/// The bound that makes a generic parameter a dtype parameter: `T: Float`.
pub const DTYPE_BOUND: &str = "Float";

/// `<T: Float, d, m, k>`: dimension symbols, and dtype parameters (with the bound).
fn parse_generics(input: ParseStream) -> syn::Result<(Vec<Ident>, Vec<Ident>)> {
    let (mut dims, mut dtypes) = (Vec::new(), Vec::new());
    if !input.peek(Token![<]) {
        return Ok((dims, dtypes));
    }
    input.parse::<Token![<]>()?;
    while !input.peek(Token![>]) {
        if input.peek(syn::Lifetime) || input.peek(Token![const]) {
            return Err(input.error(
                "the generic parameters of a fusion are dimension symbols (`m`) and dtype \
                 parameters (`T: Float`), as in `<T: Float, m, n, k>`",
            ));
        }
        let d: Ident = input.parse().map_err(|e| {
            syn::Error::new(
                e.span(),
                "expected a dimension symbol (`m`) or a dtype parameter (`T: Float`): the \
                 generic parameters of a fusion look like `<T: Float, m, n, k>`",
            )
        })?;
        if input.peek(Token![:]) {
            input.parse::<Token![:]>()?;
            let bound: Ident = input.parse().map_err(|e| {
                syn::Error::new(
                    e.span(),
                    format!("expected `{DTYPE_BOUND}`: a dtype parameter is `{d}: {DTYPE_BOUND}`"),
                )
            })?;
            if bound != DTYPE_BOUND {
                return Err(syn::Error::new(
                    bound.span(),
                    format!(
                        "unknown bound `{bound}`; a dtype parameter is written `{d}: \
                         {DTYPE_BOUND}` (any of `f32`, `bf16`, `f16`, bound by the inputs' \
                         dtypes at each call), and a dimension symbol has no bound"
                    ),
                ));
            }
            dtypes.push(d);
        } else {
            dims.push(d);
        }
        if input.peek(Token![>]) {
            break;
        }
        input.parse::<Token![,]>()?;
    }
    input.parse::<Token![>]>()?;
    Ok((dims, dtypes))
}

impl Parse for TensorType {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let kw: Ident = input.parse().map_err(|e| {
            syn::Error::new(e.span(), "expected a tensor type `Tensor<dtype, [axes]>`")
        })?;
        if kw != "Tensor" {
            return Err(syn::Error::new(
                kw.span(),
                format!("expected a tensor type `Tensor<dtype, [axes]>`, found `{kw}`"),
            ));
        }
        input.parse::<Token![<]>()?;
        let dtype: Ident = input.parse().map_err(|e| {
            syn::Error::new(
                e.span(),
                "expected an element type: `f32`, `bf16`, `f16` or a dtype parameter",
            )
        })?;
        input.parse::<Token![,]>()?;
        let content;
        let bracket = bracketed!(content in input);
        let axes_span = SpanRange::single(bracket.span.join());
        let axes = content.parse_terminated(parse_axis, Token![,])?;
        let axes = axes.into_iter().collect();
        let mut mesh = None;
        if input.peek(Token![,]) {
            input.parse::<Token![,]>()?;
            if !input.peek(Token![>]) {
                mesh = Some(parse_mesh(input)?);
                if input.peek(Token![,]) {
                    input.parse::<Token![,]>()?;
                }
            }
        }
        let close: Token![>] = input.parse()?;
        Ok(TensorType {
            dtype,
            axes,
            axes_span,
            mesh,
            span: SpanRange {
                start: kw.span(),
                end: close.span,
            },
        })
    }
}

fn parse_mesh(input: ParseStream) -> syn::Result<MeshSpec> {
    let kw: Ident = input.parse()?;
    if kw != "mesh" {
        return Err(syn::Error::new(
            kw.span(),
            format!("expected `mesh = [devices]` after the axes, found `{kw}`"),
        ));
    }
    input.parse::<Token![=]>()?;
    let content;
    let bracket = bracketed!(content in input);
    let list = content.parse_terminated(LitInt::parse, Token![,])?;
    let mut devices = Vec::new();
    for lit in list {
        devices.push((lit.base10_parse::<usize>()?, lit.span()));
    }
    Ok(MeshSpec {
        devices,
        span: SpanRange::single(kw.span()).to(SpanRange::single(bracket.span.join())),
    })
}

fn parse_axis(input: ParseStream) -> syn::Result<AxisSpec> {
    let dim: syn::Expr = input.parse()?;
    let mut span = SpanRange::of(&dim);
    let parallel = if input.peek(Token![@]) {
        input.parse::<Token![@]>()?;
        let p: Ident = input.parse().map_err(|e| {
            syn::Error::new(
                e.span(),
                "expected a parallel type after `@`: `DIDx` or `Stream`",
            )
        })?;
        span = span.to(SpanRange::single(p.span()));
        Some(p)
    } else {
        None
    };
    Ok(AxisSpec {
        dim,
        parallel,
        span,
    })
}

impl Parse for Body {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let mut lets = Vec::new();
        loop {
            if input.peek(Token![let]) {
                lets.push(input.parse()?);
                continue;
            }
            if input.is_empty() {
                let at = lets.last().map_or_else(Span::call_site, |l: &Let| l.semi);
                return Err(syn::Error::new(
                    at,
                    "a fusion's body ends with the expression it returns (a tensor, or a tuple \
                     of tensors); add it after the last `let`",
                ));
            }
            let tail: syn::Expr = input.parse()?;
            if input.peek(Token![;]) {
                let semi: Token![;] = input.parse()?;
                let msg = if input.is_empty() {
                    "remove this `;`: the last expression of a fusion is what it returns"
                } else {
                    "only `let` statements come before the returned expression"
                };
                return Err(syn::Error::new(semi.span, msg));
            }
            if !input.is_empty() {
                return Err(input
                    .error("expected the end of the fusion: the returned expression comes last"));
            }
            return Ok(Body { lets, tail });
        }
    }
}

impl Parse for Let {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        input.parse::<Token![let]>()?;
        if input.peek(Token![mut]) {
            return Err(input.error("fusion bindings are immutable: remove `mut`"));
        }
        if !input.peek(Ident) {
            return Err(input.error("expected a name: each `let` binds one tensor"));
        }
        let name: Ident = input.parse()?;
        let ty = if input.peek(Token![:]) {
            input.parse::<Token![:]>()?;
            Some(input.parse()?)
        } else {
            None
        };
        input.parse::<Token![=]>()?;
        let expr: syn::Expr = input.parse()?;
        let semi: Token![;] = input.parse()?;
        Ok(Let {
            name,
            ty,
            expr,
            semi: semi.span,
        })
    }
}

/// The `#[backward]` attribute of a fusion.
pub struct BackwardAttr {
    pub span: SpanRange,
    /// The inputs named in `#[backward(..)]`, or `None` for all.
    pub inputs: Option<Vec<Ident>>,
}

/// Takes `#[backward]` / `#[backward(a, b)]` out of `attrs` (the rest go to the entry
/// point).
pub fn take_attr(attrs: &mut Vec<Attribute>) -> syn::Result<Option<BackwardAttr>> {
    let Some(i) = attrs.iter().position(|a| a.path().is_ident("backward")) else {
        return Ok(None);
    };
    let a = attrs.remove(i);
    let inputs = match &a.meta {
        syn::Meta::Path(_) => None,
        syn::Meta::List(l) => Some(
            l.parse_args_with(
                syn::punctuated::Punctuated::<Ident, syn::Token![,]>::parse_terminated,
            )?
            .into_iter()
            .collect(),
        ),
        syn::Meta::NameValue(_) => {
            return Err(syn::Error::new_spanned(
                &a,
                "write `#[backward]` (gradients for every input) or `#[backward(x, w)]` (for \
                 these inputs)",
            ))
        }
    };
    Ok(Some(BackwardAttr {
        span: SpanRange::of(&a),
        inputs,
    }))
}

/// The indices of the inputs `#[backward]` wants gradients for, or an error at an
/// unknown name.
pub fn wanted_inputs(def: &FusionDef, attr: &BackwardAttr) -> Result<Vec<usize>, syn::Error> {
    let Some(names) = &attr.inputs else {
        return Ok((0..def.params.len()).collect());
    };
    names
        .iter()
        .map(|n| {
            def.params.iter().position(|p| p.name == *n).ok_or_else(|| {
                syn::Error::new(
                    n.span(),
                    format!("`{n}` is not an input of `{}`; name inputs here", def.name),
                )
            })
        })
        .collect()
}
