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

/// Collects errors; several independent ones are reported together.
#[derive(Default)]
pub struct Errors {
    list: Vec<syn::Error>,
}

impl Errors {
    /// Records an error.
    pub fn push(&mut self, e: syn::Error) {
        self.list.push(e);
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// All errors as one (`None` if there are none).
    pub fn combined(self) -> Option<syn::Error> {
        let mut iter = self.list.into_iter();
        let mut first = iter.next()?;
        for e in iter {
            first.combine(e);
        }
        Some(first)
    }
}

/// The closest candidate to `name` by edit distance, when it is close enough to be a typo.
pub fn suggest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    // One-letter names (dimension symbols, mostly) are only corrected for case: any other
    // letter is one edit away, which says nothing.
    let short = name.chars().count() == 1;
    let limit = (name.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .filter(|c| *c != name && (!short || c.eq_ignore_ascii_case(name)))
        .map(|c| (edit_distance(name, c), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Levenshtein distance where swapping two adjacent characters counts as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions_catch_typos_only() {
        let ops = ["relu", "gelu", "matmul", "sum", "sigmoid"];
        assert_eq!(suggest("rleu", ops), Some("relu"));
        assert_eq!(suggest("matmull", ops), Some("matmul"));
        assert_eq!(suggest("sigmod", ops), Some("sigmoid"));
        assert_eq!(suggest("softmax", ops), None);
        assert_eq!(suggest("q", ["m", "n", "k"]), None);
        assert_eq!(suggest("M", ["m", "n", "k"]), Some("m"));
        assert_eq!(edit_distance("abc", "abc"), 0);
        assert_eq!(edit_distance("ab", "ba"), 1);
    }
}
