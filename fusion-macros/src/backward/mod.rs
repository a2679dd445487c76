//! Expansion of the backward opt-in: `#[backward]` on a fusion (or `#[backward(x, w)]`,
//! the inputs that want gradients; all by default; parsed in `parse`, and derived once at
//! compile time by `check`, which reports an op it cannot differentiate on its source)
//! generates, inside the fusion's module:
//!
//! - `name::backward(rank, inputs.., d_outputs..)`, the recomputing form, returning the
//!   input gradients, with the module `name::backward` (`derive`, `executor`, `program`,
//!   `call`, `lowering_count`, `INPUTS`, `GRADIENTS`) beside it;
//! - the saving form (`saving`): `name::forward_saving` and `name::backward_saved`.
//!
//! `sig` holds what the generated items of both forms share (parameters, types, the
//! derivation's request).
//!
//! The backward is derived again from `build()` at its first call; it takes every forward
//! input (and reads the ones the derivation lists) and one gradient per output.

mod saving;
mod sig;

use proc_macro2::TokenStream;
use quote::quote;

use crate::check::emit::{fc, fr, hygienic};
use crate::parse::FusionDef;
use sig::Sig;

/// `fn backward` and `mod backward` inside the fusion's module (`wanted`: input indices),
/// with the saving form's items.
pub fn gradient_items(def: &FusionDef, wanted: &[usize], stub: bool) -> TokenStream {
    let (fc, fr) = (fc(), fr());
    let sig = Sig::new(def, wanted);
    let (params, grads_in) = (&sig.params, &sig.grads_in);
    let (n_in, n_out, n_grads) = (params.len(), grads_in.len(), wanted.len());
    let (names, grad_names) = (&sig.input_names, &sig.grad_names);
    let name = format!("{}::backward", def.name);
    let (rank, options, ret) = (&sig.rank, &sig.options, &sig.ret);
    let (prepared, picked) = (hygienic("__prepared"), hygienic("__picked"));
    let args = sig.args();
    let pick = quote! {
        let #prepared = self::prepared()?;
        let __all: [&#fr::Tensor; #n_in + #n_out] =
            [#(#params.as_tensor(),)* #(#grads_in.as_tensor(),)*];
        let #picked = (#prepared.1.iter()).map(|w| match *w {
            #fc::autodiff::BackwardInput::Primal(i) => ::core::result::Result::Ok(__all[i]),
            #fc::autodiff::BackwardInput::OutputGrad(o) => ::core::result::Result::Ok(__all[#n_in + o]),
            #fc::autodiff::BackwardInput::Saved(_) => ::core::result::Result::Err(#fr::Error::Internal(
                ::std::format!("`{}` reads a saved value", #name),
            )),
        }).collect::<#fr::Result<::std::vec::Vec<&#fr::Tensor>>>()?;
    };
    let derive = sig.derive_body("backward", stub);
    let (program, call) = sig.runner_bodies(stub, &pick, &quote!(#prepared.0), &name);
    let (saving, saving_runners) = saving::saving_items(def, &sig, stub);
    quote! {
        /// The input gradients (in `backward::GRADIENTS` order) from the forward inputs
        /// and one gradient per output (`backward::INPUTS`), by the derived backward
        /// fusion in its recomputing form: it recomputes every forward value it reads (the
        /// GEMMs included), so nothing is kept from the forward. Training uses the saving
        /// form, `forward_saving` and `backward_saved`, which computes no GEMM twice.
        #[allow(clippy::too_many_arguments)]
        pub fn backward(#args) -> #fr::Result<#ret> {
            self::backward::call(#rank, #(#params,)* #(#grads_in,)* &<#fr::ExecOptions as ::core::default::Default>::default())
        }

        #saving

        /// The derived backward fusion: its derivation, shared executor and runners (the
        /// recomputing form), and the saving form's.
        pub mod backward {
            /// What `call` takes after the rank: every forward input, then one gradient
            /// per output.
            pub const INPUTS: [&str; #n_in + #n_out] = [#(#names),*];

            /// The input gradients `call` returns, in order.
            pub const GRADIENTS: [&str; #n_grads] = [#(#grad_names),*];

            /// Derives the recomputing backward from the forward `build()` (which inputs
            /// it reads again is in the result's `inputs`).
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

            /// The recomputing backward's shared executor, built at the first call.
            pub fn executor() -> #fr::Result<&'static #fr::FusionExecutor> {
                self::prepared().map(|p| &p.0)
            }

            /// How many programs the recomputing backward's executor has lowered so far.
            pub fn lowering_count() -> usize {
                self::executor().map_or(0, |e| e.lowering_count())
            }

            /// The recomputing backward's host program for these inputs and options.
            pub fn program(#args #options: &#fr::ExecOptions) -> #fr::Result<::std::sync::Arc<#fc::hir::HostProgram>> {
                #program
            }

            /// Runs the recomputing backward with options and returns the input gradients.
            pub fn call(#args #options: &#fr::ExecOptions) -> #fr::Result<#ret> {
                #call
            }

            #saving_runners
        }
    }
}
