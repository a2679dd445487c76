//! Source ranges for diagnostics.
//!
//! `proc_macro2::Span::join` is nightly-only, but `syn::Error::new_spanned` underlines from
//! the first token it is given to the last one. A [`SpanRange`] is two spans turned into
//! two tokens, so an error can cover `a + b` or `[m, n]` on stable Rust.

use proc_macro2::{Punct, Spacing, Span, TokenStream, TokenTree};
use quote::ToTokens;

/// The source range from `start` to `end` (inclusive).
#[derive(Clone, Copy, Debug)]
pub struct SpanRange {
    pub start: Span,
    pub end: Span,
}

impl SpanRange {
    /// One token's range.
    pub fn single(span: Span) -> Self {
        SpanRange {
            start: span,
            end: span,
        }
    }

    /// The range of some tokens (the call site if there are none).
    pub fn of(tokens: &impl ToTokens) -> Self {
        let mut iter = tokens.to_token_stream().into_iter();
        let Some(first) = iter.next() else {
            return SpanRange::single(Span::call_site());
        };
        let last = iter.last().unwrap_or_else(|| first.clone());
        SpanRange {
            start: first.span(),
            end: last.span(),
        }
    }

    /// From the start of `self` to the end of `other`.
    pub fn to(self, other: SpanRange) -> Self {
        SpanRange {
            start: self.start,
            end: other.end,
        }
    }

    /// An error underlining this range.
    pub fn error(self, message: impl std::fmt::Display) -> syn::Error {
        syn::Error::new_spanned(self, message)
    }
}

impl ToTokens for SpanRange {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        for span in [self.start, self.end] {
            let mut p = Punct::new('#', Spacing::Alone);
            p.set_span(span);
            tokens.extend([TokenTree::Punct(p)]);
        }
    }
}

/// Several independent errors as one (`None` if there are none), reported together.
pub fn combined(errors: Vec<syn::Error>) -> Option<syn::Error> {
    errors.into_iter().reduce(|mut all, e| {
        all.combine(e);
        all
    })
}
