//! Expansion of a `#[backward]` fusion's saving form (`fusion_compiler::autodiff::saving`):
//!
//! - `name::forward_saving(rank, inputs..) -> (outputs.., Saved)`: the forward, also
//!   returning the GEMM and reduction results its backward reads, kept in `name::Saved`
//!   (an opaque struct of this rank's tensors and the call they came from);
//! - `name::backward_saved(rank, &saved, inputs.., d_outputs..)`: the input gradients,
//!   from the saved values instead of recomputing them; a `Saved` of another rank, world
//!   or input shapes is an error;
//! - in `name::backward`: `derive_saving`, `saving_executors`, and the option-taking
//!   `forward_saving_call`, `forward_saving_program`, `saved_call`, `saved_program`.

use proc_macro2::TokenStream;
use quote::quote;

use super::sig::{body, Sig};
use crate::check::emit::{fc, fr, hygienic};
use crate::parse::FusionDef;

/// The items of the saving form: those of the fusion's module, and the runners of its
/// `backward` module.
pub fn saving_items(def: &FusionDef, sig: &Sig, stub: bool) -> (TokenStream, TokenStream) {
    let fr = fr();
    let rank = &sig.rank;
    let (params, param_tys) = (&sig.params, &sig.param_tys);
    let (grads_in, dy_tys, ret) = (&sig.grads_in, &sig.dy_tys, &sig.ret);
    let out_tys = &sig.out_tys;
    let saved = hygienic("saved");
    let forward_args = quote!(#rank: &impl #fr::CallTarget, #(#params: &#param_tys,)*);
    let forward_ret = quote!((#(#out_tys,)* Saved));
    let default = quote!(&<#fr::ExecOptions as ::core::default::Default>::default());
    let saved_struct = saved_struct(def);
    let top = quote! {
        #saved_struct

        /// The forward of the saving form: the fusion's outputs, and what
        /// [`backward_saved`] takes instead of recomputing it (the GEMM and reduction
        /// results the backward reads, in the layout the forward computed them). This is
        /// the forward training uses; the `Saved` holds that memory until it is dropped.
        #[allow(clippy::too_many_arguments)]
        pub fn forward_saving(#forward_args) -> #fr::Result<#forward_ret> {
            self::backward::forward_saving_call(#rank, #(#params,)* #default)
        }

        /// The input gradients (in `backward::GRADIENTS` order) from `saved` (what
        /// [`forward_saving`] returned for these inputs on this rank), the forward inputs
        /// and one gradient per output: no GEMM of the forward is computed again.
        #[allow(clippy::too_many_arguments)]
        pub fn backward_saved(#rank: &impl #fr::CallTarget, #saved: &Saved, #(#params: &#param_tys,)* #(#grads_in: &#dy_tys,)*) -> #fr::Result<#ret> {
            self::backward::saved_call(#rank, #saved, #(#params,)* #(#grads_in,)* #default)
        }
    };
    (top, runners(def, sig, stub))
}

/// `struct Saved` and its check.
fn saved_struct(def: &FusionDef) -> TokenStream {
    let fr = fr();
    let name = format!("{}::Saved", def.name);
    let doc = format!(
        "What [`forward_saving`] keeps for [`backward_saved`] on one rank: the saved \
         tensors (this rank's blocks of the GEMM and reduction results the backward of \
         `{}` reads) and the call they came from (rank, world size, input shapes), which \
         `backward_saved` checks. Keep it from the forward to the backward; dropping it \
         frees the memory.",
        def.name
    );
    quote! {
        #[doc = #doc]
        #[derive(Debug)]
        pub struct Saved {
            tensors: ::std::vec::Vec<#fr::Tensor>,
            rank: usize,
            world: usize,
            shapes: ::std::vec::Vec<::std::vec::Vec<usize>>,
        }

        impl Saved {
            /// This rank's saved tensors, in the order the saving backward takes them
            /// (`backward::derive_saving()`'s `saved`).
            pub fn tensors(&self) -> &[#fr::Tensor] {
                &self.tensors
            }

            /// The bytes the saved tensors hold on this rank.
            pub fn bytes(&self) -> usize {
                self.tensors.iter().map(|t| t.nbytes()).sum()
            }

            /// `Ok` when this comes from a forward call on `rank` with inputs of `shapes`.
            fn check(&self, rank: &#fr::Rank, shapes: &[&[usize]]) -> #fr::Result<()> {
                let same = self.rank == rank.index()
                    && self.world == rank.world_size()
                    && self.shapes.iter().map(|s| s.as_slice()).eq(shapes.iter().copied());
                if same {
                    return ::core::result::Result::Ok(());
                }
                ::core::result::Result::Err(#fr::Error::BadTensor {
                    tensor: ::std::string::String::from(#name),
                    axis: ::core::option::Option::None,
                    reason: ::std::format!(
                        "made by `forward_saving` on rank {} of {} with inputs of shapes {:?}, \
                         but this backward runs on rank {} of {} with inputs of shapes {:?}: \
                         pass the `Saved` of the forward call whose inputs these are",
                        self.rank, self.world, self.shapes,
                        rank.index(), rank.world_size(), shapes,
                    ),
                })
            }
        }
    }
}

/// The runners of the saving form, inside the fusion's `backward` module.
fn runners(def: &FusionDef, sig: &Sig, stub: bool) -> TokenStream {
    let (fc, fr) = (fc(), fr());
    let (rank, options) = (&sig.rank, &sig.options);
    let (params, param_tys) = (&sig.params, &sig.param_tys);
    let (grads_in, dy_tys, out_tys) = (&sig.grads_in, &sig.dy_tys, &sig.out_tys);
    let ret = &sig.ret;
    let (n_in, n_out) = (params.len(), grads_in.len());
    let (saved, prepared, picked) = (
        hygienic("saved"),
        hygienic("__prepared"),
        hygienic("__picked"),
    );
    let (forward_name, backward_name) = (
        format!("{}::forward_saving", def.name),
        format!("{}::backward_saved", def.name),
    );
    let forward_args = quote!(#rank: &impl #fr::CallTarget, #(#params: &#param_tys,)*);
    let saved_args = quote!(#rank: &impl #fr::CallTarget, #saved: &super::Saved, #(#params: &#param_tys,)* #(#grads_in: &#dy_tys,)*);
    let inputs = quote!([#(#params.as_tensor()),*]);
    let pick = quote! {
        let #prepared = self::saving_prepared()?;
        let __target = #fr::CallTarget::target(#rank);
        #saved.check(__target.rank(), &[#(#params.as_tensor().shape()),*])?;
        let __all: [&#fr::Tensor; #n_in + #n_out] =
            [#(#params.as_tensor(),)* #(#grads_in.as_tensor(),)*];
        let #picked = (#prepared.2.backward.inputs.iter()).map(|w| match *w {
            #fc::autodiff::BackwardInput::Primal(i) => ::core::result::Result::Ok(__all[i]),
            #fc::autodiff::BackwardInput::OutputGrad(o) => ::core::result::Result::Ok(__all[#n_in + o]),
            #fc::autodiff::BackwardInput::Saved(k) => #saved.tensors.get(k).ok_or_else(|| {
                #fr::Error::Internal(::std::format!("`{}` has no saved value {}", #backward_name, k))
            }),
        }).collect::<#fr::Result<::std::vec::Vec<&#fr::Tensor>>>()?;
    };
    let derive = sig.derive_body("saving", stub);
    let forward_program = body(
        stub,
        quote!(self::saving_prepared()?.0.program(#rank, &#inputs, #options)),
    );
    let forward_call = body(stub, forward_call(sig, &forward_name));
    let (saved_program, saved_call) =
        sig.runner_bodies(stub, &pick, &quote!(#prepared.1), &backward_name);
    quote! {
        /// Derives the saving form from the forward `build()`: the forward that also
        /// returns the saved values (`saved` says which of its outputs they are) and the
        /// backward that takes them.
        pub fn derive_saving() -> ::core::result::Result<#fc::autodiff::Saving, #fc::Error> {
            #derive
        }

        fn saving_prepared() -> #fr::Result<&'static (#fr::FusionExecutor, #fr::FusionExecutor, #fc::autodiff::Saving)> {
            static EXECUTORS: ::std::sync::OnceLock<
                ::core::result::Result<(#fr::FusionExecutor, #fr::FusionExecutor, #fc::autodiff::Saving), #fc::Error>,
            > = ::std::sync::OnceLock::new();
            let made = EXECUTORS.get_or_init(|| self::derive_saving().map(|s| (
                #fr::FusionExecutor::new(::core::clone::Clone::clone(&s.forward)).with_name(#forward_name),
                #fr::FusionExecutor::new(::core::clone::Clone::clone(&s.backward.fusion)).with_name(#backward_name),
                s,
            )));
            match made {
                ::core::result::Result::Ok(e) => ::core::result::Result::Ok(e),
                ::core::result::Result::Err(e) => {
                    ::core::result::Result::Err(#fr::Error::Core(::core::clone::Clone::clone(e)))
                }
            }
        }

        /// The saving form's shared executors, built at the first call: the forward that
        /// also returns the saved values, and the backward that takes them.
        pub fn saving_executors() -> #fr::Result<(&'static #fr::FusionExecutor, &'static #fr::FusionExecutor)> {
            self::saving_prepared().map(|p| (&p.0, &p.1))
        }

        /// The saving forward's host program for these inputs and options.
        pub fn forward_saving_program(#forward_args #options: &#fr::ExecOptions) -> #fr::Result<::std::sync::Arc<#fc::hir::HostProgram>> {
            #forward_program
        }

        /// Runs the saving forward with options: the outputs and the `Saved`.
        pub fn forward_saving_call(#forward_args #options: &#fr::ExecOptions) -> #fr::Result<(#(#out_tys,)* super::Saved)> {
            #forward_call
        }

        /// The saving backward's host program for these inputs and options.
        pub fn saved_program(#saved_args #options: &#fr::ExecOptions) -> #fr::Result<::std::sync::Arc<#fc::hir::HostProgram>> {
            #saved_program
        }

        /// Runs the saving backward with options and returns the input gradients.
        pub fn saved_call(#saved_args #options: &#fr::ExecOptions) -> #fr::Result<#ret> {
            #saved_call
        }
    }
}

/// The body of `forward_saving_call`: runs the saving forward, keeps the saved outputs
/// in a `Saved` and returns the fusion's own outputs typed, and it.
fn forward_call(sig: &Sig, name: &str) -> TokenStream {
    let fr = fr();
    let (rank, options, params) = (&sig.rank, &sig.options, &sig.params);
    let n_out = sig.grads_in.len();
    let outs: Vec<proc_macro2::Ident> = (0..n_out)
        .map(|o| quote::format_ident!("__o{}", o, span = proc_macro2::Span::mixed_site()))
        .collect();
    quote! {
        let __p = self::saving_prepared()?;
        let __report = __p.0.run_with(#rank, &[#(#params.as_tensor()),*], ::core::option::Option::None, #options)?;
        let mut __outputs = __report.outputs;
        let __missing = |k: usize| #fr::Error::Arity {
            what: ::std::format!("outputs of `{}`", #name),
            expected: k + 1,
            actual: k,
        };
        let __tensors = (__p.2.saved.iter())
            .map(|&o| __outputs.get(o).cloned().ok_or_else(|| __missing(__outputs.len())))
            .collect::<#fr::Result<::std::vec::Vec<#fr::Tensor>>>()?;
        __outputs.truncate(#n_out);
        let [#(#outs),*]: [#fr::Tensor; #n_out] =
            __outputs.try_into().map_err(|v: ::std::vec::Vec<#fr::Tensor>| __missing(v.len()))?;
        let __target = #fr::CallTarget::target(#rank);
        let __saved = super::Saved {
            tensors: __tensors,
            rank: __target.rank().index(),
            world: __target.rank().world_size(),
            shapes: ::std::vec![#(#params.as_tensor().shape().to_vec()),*],
        };
        ::core::result::Result::Ok((#(#fr::Ranked::from_output(#outs)?,)* __saved))
    }
}
