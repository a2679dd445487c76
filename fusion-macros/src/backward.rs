//! Expansion of the backward opt-in: `#[backward]` on a fusion (or `#[backward(x, w)]`,
//! the inputs that want gradients; all by default; parsed in `parse`, and derived once at
//! compile time by `check`, which reports an op it cannot differentiate on its source)
//! generates `name::backward(rank, inputs.., d_outputs..)` returning the input
//! gradients, with the module `name::backward` (`derive`, `executor`, `program`, `call`,
//! `lowering_count`, `INPUTS`, `GRADIENTS`) beside it. The backward is derived again from
//! `build()` at its first call; it takes every forward input (and reads the ones the
//! derivation lists) and one gradient per output.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::Ident;

use crate::check::emit::{fc, fr, hygienic, ranked};
use crate::parse::FusionDef;

/// `fn backward` and `mod backward` inside the fusion's module (`wanted`: input indices).
pub fn gradient_items(def: &FusionDef, wanted: &[usize], stub: bool) -> TokenStream {
    let (fc, fr) = (fc(), fr());
    let params: Vec<Ident> = (0..def.params.len())
        .map(|i| format_ident!("__x{}", i, span = Span::mixed_site()))
        .collect();
    let grads_in: Vec<Ident> = (0..def.outputs.len())
        .map(|o| format_ident!("__dy{}", o, span = Span::mixed_site()))
        .collect();
    let param_ty = |i: usize| ranked(def.params[i].ty.axes.len(), def.params[i].ty.span.start);
    let param_tys: Vec<TokenStream> = (0..def.params.len()).map(param_ty).collect();
    let dy_tys: Vec<TokenStream> = (def.outputs.iter())
        .map(|o| ranked(o.axes.len(), o.span.start))
        .collect();
    let out_tys: Vec<TokenStream> = wanted.iter().map(|&i| param_ty(i)).collect();
    let ret = match out_tys.as_slice() {
        [one] => one.clone(),
        more => quote!((#(#more),*)),
    };
    let (n_in, n_out, n_grads) = (params.len(), grads_in.len(), wanted.len());
    let mut names: Vec<String> = def.params.iter().map(|p| p.name.to_string()).collect();
    names.extend((0..n_out).map(|o| match n_out {
        1 => "d_output".to_string(),
        _ => format!("d_output{o}"),
    }));
    let grad_names: Vec<String> = (wanted.iter())
        .map(|&i| format!("d_{}", def.params[i].name))
        .collect();
    let name = format!("{}::backward", def.name);
    let (rank, options) = (hygienic("rank"), hygienic("options"));
    let (prepared, picked, report) = (
        hygienic("__prepared"),
        hygienic("__picked"),
        hygienic("__report"),
    );
    let vars: Vec<Ident> = (0..n_grads)
        .map(|k| format_ident!("__g{}", k, span = Span::mixed_site()))
        .collect();
    let result = match vars.as_slice() {
        [one] => quote!(#fr::Ranked::from_output(#one)?),
        more => quote!((#(#fr::Ranked::from_output(#more)?),*)),
    };
    let args =
        quote!(#rank: &impl #fr::CallTarget, #(#params: &#param_tys,)* #(#grads_in: &#dy_tys,)*);
    let pick = quote! {
        let #prepared = self::prepared()?;
        let __all: [&#fr::Tensor; #n_in + #n_out] =
            [#(#params.as_tensor(),)* #(#grads_in.as_tensor(),)*];
        let #picked: ::std::vec::Vec<&#fr::Tensor> = #prepared.1.iter().map(|w| match *w {
            #fc::autodiff::BackwardInput::Primal(i) => __all[i],
            #fc::autodiff::BackwardInput::OutputGrad(o) => __all[#n_in + o],
        }).collect();
    };
    let body = |b: TokenStream| match stub {
        true => quote!(::core::panic!("this fusion did not compile")),
        false => b,
    };
    let derive = body(quote! {
        let __f = super::build()?;
        let __spec = #fc::autodiff::GradSpec {
            outputs: (0..#n_out).collect(),
            inputs: ::std::vec![#(#wanted),*],
        };
        #fc::autodiff::backward(&__f, &__spec).map_err(#fc::Error::from)
    });
    let program = body(quote! {
        #pick
        #prepared.0.program(#rank, &#picked, #options)
    });
    let call = body(quote! {
        #pick
        let #report = #prepared.0.run_with(#rank, &#picked, ::core::option::Option::None, #options)?;
        let [#(#vars),*]: [#fr::Tensor; #n_grads] =
            #report.outputs.try_into().map_err(|v: ::std::vec::Vec<#fr::Tensor>| {
                #fr::Error::Arity {
                    what: ::std::format!("outputs of `{}`", #name),
                    expected: #n_grads,
                    actual: v.len(),
                }
            })?;
        ::core::result::Result::Ok(#result)
    });
    quote! {
        /// The input gradients (in `backward::GRADIENTS` order) from the forward inputs
        /// and one gradient per output (`backward::INPUTS`), by the derived backward
        /// fusion.
        #[allow(clippy::too_many_arguments)]
        pub fn backward(#args) -> #fr::Result<#ret> {
            self::backward::call(#rank, #(#params,)* #(#grads_in,)* &<#fr::ExecOptions as ::core::default::Default>::default())
        }

        /// The derived backward fusion: its derivation, shared executor and runners.
        pub mod backward {
            /// What `call` takes after the rank: every forward input, then one gradient
            /// per output.
            pub const INPUTS: [&str; #n_in + #n_out] = [#(#names),*];

            /// The input gradients `call` returns, in order.
            pub const GRADIENTS: [&str; #n_grads] = [#(#grad_names),*];

            /// Derives the backward from the forward `build()` (which inputs it reads
            /// again is in the result's `inputs`).
            pub fn derive() -> ::core::result::Result<#fc::autodiff::Backward, #fc::Error> {
                #derive
            }

            fn prepared() -> #fr::Result<&'static (#fr::FusionExecutor, ::std::vec::Vec<#fc::autodiff::BackwardInput>)> {
                static EXECUTOR: ::std::sync::OnceLock<
                    ::core::result::Result<(#fr::FusionExecutor, ::std::vec::Vec<#fc::autodiff::BackwardInput>), #fc::Error>,
                > = ::std::sync::OnceLock::new();
                match EXECUTOR.get_or_init(|| self::derive().map(|b| (#fr::FusionExecutor::new(b.fusion).with_name(#name), b.inputs))) {
                    ::core::result::Result::Ok(e) => ::core::result::Result::Ok(e),
                    ::core::result::Result::Err(e) => {
                        ::core::result::Result::Err(#fr::Error::Core(::core::clone::Clone::clone(e)))
                    }
                }
            }

            /// The backward's shared executor, built at the first call.
            pub fn executor() -> #fr::Result<&'static #fr::FusionExecutor> {
                self::prepared().map(|p| &p.0)
            }

            /// How many programs the backward's executor has lowered so far.
            pub fn lowering_count() -> usize {
                self::executor().map_or(0, |e| e.lowering_count())
            }

            /// The backward's host program for these inputs and options.
            pub fn program(#args #options: &#fr::ExecOptions) -> #fr::Result<::std::sync::Arc<#fc::hir::HostProgram>> {
                #program
            }

            /// Runs the backward with options and returns the input gradients.
            pub fn call(#args #options: &#fr::ExecOptions) -> #fr::Result<#ret> {
                #call
            }
        }
    }
}
