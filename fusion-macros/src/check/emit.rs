//! Tokens of the generated `build()`: the checker records each builder call it made as
//! the statement that makes it again, with these names for tensors, extents and dtypes.

use std::fmt::Debug;

use fusion_compiler::builder::Axis;
use fusion_compiler::ir::{DeviceMesh, ScalarId, TensorId};
use fusion_compiler::DTypeSpec;
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::Ident;

/// `fusion_compiler` as the generated code reaches it.
pub fn fc() -> TokenStream {
    quote!(::fusion::__private::fusion_compiler)
}

/// A name the generated code uses for itself (mixed-site hygiene: it cannot clash with the
/// user's names).
pub fn hygienic(name: &str) -> Ident {
    Ident::new(name, Span::mixed_site())
}

/// `Ranked<N>`, spanned on the DSL type it stands for (so rustc's notes point there).
pub fn ranked(axes: usize, span: Span) -> TokenStream {
    quote::quote_spanned!(span=> ::fusion::__private::fusion_runtime::Ranked<#axes>)
}

/// The path of `fusion_runtime` as the facade re-exports it (generated entry points).
pub fn fr() -> TokenStream {
    quote!(::fusion::__private::fusion_runtime)
}

/// The builder variable of the generated `build()`.
pub fn builder() -> Ident {
    Ident::new("__builder", Span::mixed_site())
}

/// The variable holding a tensor.
pub fn tensor(t: TensorId) -> Ident {
    format_ident!("__t{}", t.index(), span = Span::mixed_site())
}

/// The variable holding an extent.
pub fn dim(d: ScalarId) -> Ident {
    format_ident!("__d{}", d.index(), span = Span::mixed_site())
}

/// A unit variant of a `fusion_compiler` enum (`Relu`, `DIDx`, `BF16`), named as its `Debug`
/// output names it, so that the expansion follows `fusion_compiler` without a table here.
pub fn variant(v: &impl Debug) -> Ident {
    format_ident!("{}", format!("{v:?}"))
}

/// A dtype: a constant, or the parameter of `build` it stands for.
pub fn dtype(d: DTypeSpec, params: &[Ident]) -> TokenStream {
    let fc = fc();
    match d {
        DTypeSpec::Fixed(d) => {
            let v = variant(&d);
            quote!(#fc::DType::#v)
        }
        DTypeSpec::Param(i) => {
            let p = &params[i];
            quote!(#p)
        }
    }
}

/// `&[Axis { extent: __d3, parallel: ParallelType::DIDx }, ..]`.
pub fn axes(axes: &[Axis]) -> TokenStream {
    let fc = fc();
    let list = axes.iter().map(|a| {
        let (d, p) = (dim(a.extent), variant(&a.parallel));
        quote!(#fc::builder::Axis { extent: #d, parallel: #fc::ir::ParallelType::#p })
    });
    quote!(&[#(#list),*])
}

/// A mesh.
pub fn mesh(m: &DeviceMesh) -> TokenStream {
    let fc = fc();
    match m {
        DeviceMesh::World => quote!(#fc::ir::DeviceMesh::World),
        DeviceMesh::Devices(d) => quote!(#fc::ir::DeviceMesh::devices([#(#d),*])),
    }
}
