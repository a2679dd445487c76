//! Where an error of `fusion_compiler` points in the source: the spans of each builder call
//! (the call, and each argument with its elements), and of each tensor the calls made.

use fusion_compiler::{Culprit, Error};
use syn::Expr;

use crate::span::SpanRange;

/// The source of one builder call: all of it, and each argument (with the elements of a
/// list argument), numbered as `fusion_compiler::Culprit` numbers them.
#[derive(Clone, Debug)]
pub struct CallSpans {
    pub whole: SpanRange,
    pub args: Vec<(SpanRange, Vec<SpanRange>)>,
}

impl CallSpans {
    /// An op written as a call or an operator with these operands and arguments.
    pub fn of(whole: &Expr, args: &[&Expr]) -> Self {
        let args = args
            .iter()
            .map(|a| {
                let elems = match a {
                    Expr::Array(list) => list.elems.iter().map(SpanRange::of).collect(),
                    e => vec![SpanRange::of(e)],
                };
                (SpanRange::of(a), elems)
            })
            .collect();
        CallSpans {
            whole: SpanRange::of(whole),
            args,
        }
    }

    /// The source the culprit stands for (the whole call when it names none).
    pub fn at(&self, culprit: Option<Culprit>) -> SpanRange {
        let arg = |i: usize| self.args.get(i);
        let found = match culprit {
            Some(Culprit::Arg(i)) => arg(i).map(|a| a.0),
            Some(Culprit::Element { arg: i, index }) => {
                arg(i).map(|a| a.1.get(index).copied().unwrap_or(a.0))
            }
            Some(Culprit::Args { first, last }) => {
                arg(first).zip(arg(last)).map(|(a, b)| a.0.to(b.0))
            }
            Some(Culprit::Call) | None => None,
        };
        found.unwrap_or(self.whole)
    }

    /// A builder error of this call, at its culprit.
    pub fn error(&self, e: &Error) -> syn::Error {
        self.at(e.culprit()).error(e)
    }
}

/// A short source form of an expression, to name the unnamed tensor it computes in
/// messages: `matmul(x, w)`, `a + b`, `broadcast(x, [..])`.
pub fn label(e: &Expr) -> String {
    let list =
        |args: &mut dyn Iterator<Item = &Expr>| args.map(label).collect::<Vec<_>>().join(", ");
    match e {
        Expr::Path(p) => p
            .path
            .get_ident()
            .map_or_else(|| "..".into(), |i| i.to_string()),
        Expr::Lit(l) => quote::quote!(#l).to_string(),
        Expr::Paren(p) => format!("({})", label(&p.expr)),
        Expr::Group(g) => label(&g.expr),
        Expr::Array(_) => "[..]".into(),
        Expr::Unary(u) => format!("-{}", label(&u.expr)),
        Expr::Binary(b) => {
            let op = &b.op;
            let op = quote::quote!(#op);
            format!("{} {op} {}", label(&b.left), label(&b.right))
        }
        Expr::Call(c) => format!("{}({})", label(&c.func), list(&mut c.args.iter())),
        _ => "..".into(),
    }
}
