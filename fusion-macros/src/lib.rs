//! The `fusion!` procedural macro: `parse` -> `check` -> `expand`.
//!
//! ```text
//! fusion! {
//!     /// AllGather + matmul, pipelined over the devices with P2P transfers.
//!     pub fn ag_matmul<d, m, k, n>(
//!         a: Tensor<bf16, [d @ DIDx, m, k]>,
//!         b: Tensor<bf16, [k, n]>,
//!     ) -> Tensor<bf16, [d @ Stream, m, n]> {
//!         matmul(a, b)
//!     }
//! }
//! ```
//!
//! expands to a typed entry point `ag_matmul(rank, &a, &b) -> Result<Ranked<3>>` and a
//! module `ag_matmul` with the builder code (`build`), the shared executor and
//! option-taking runners. The checker runs `fusion_compiler`'s own builder and lowering check
//! at compile time and reports every independent mistake with a span on the culprit. This
//! crate has no runtime knowledge: the generated code calls the same builder through
//! `::fusion::__private`.

#![warn(clippy::too_many_lines)]

mod backward;
mod check;
mod expand;
mod parse;
mod span;
#[cfg(test)]
mod tests;

use proc_macro::TokenStream;

/// Defines fusions: multi-device tensor programs checked at compile time.
///
/// See the `fusion` crate's `docs/DSL.md` for the syntax, the ops and the rules.
#[proc_macro]
pub fn fusion(input: TokenStream) -> TokenStream {
    let block = match syn::parse::<parse::Block>(input) {
        Ok(b) => b,
        Err(e) => return e.to_compile_error().into(),
    };
    let mut out = proc_macro2::TokenStream::new();
    for (i, def) in block.fusions.iter().enumerate() {
        if block.fusions[..i].iter().any(|f| f.name == def.name) {
            let msg = format!(
                "a fusion named `{}` is already defined in this block; each fusion defines \
                 a function and a module of its name",
                def.name
            );
            out.extend(syn::Error::new(def.name.span(), msg).to_compile_error());
            continue;
        }
        match check::check(def) {
            Ok(checked) => out.extend(expand::expand(def, &checked)),
            Err(e) => {
                out.extend(e.to_compile_error());
                out.extend(expand::stub(def));
            }
        }
    }
    out.into()
}
