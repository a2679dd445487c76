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
//! The backward is derived again from `build()` at its first call; it takes every forward
//! input (and reads the ones the derivation lists) and one gradient per output.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use syn::Ident;

use crate::check::emit::{fc, fr, hygienic, ranked};
use crate::parse::FusionDef;

/// The names and types every generated backward item shares.
pub struct Sig {
    /// The forward inputs' parameters (`__x0`, ..) and types.
    pub params: Vec<Ident>,
    pub param_tys: Vec<TokenStream>,
    /// The output gradients' parameters (`__dy0`, ..) and types.
    pub grads_in: Vec<Ident>,
    pub dy_tys: Vec<TokenStream>,
    /// The forward's outputs' types.
    pub out_tys: Vec<TokenStream>,
    /// What a backward returns: the wanted inputs' gradients (one, or a tuple).
    pub ret: TokenStream,
    /// The gradients' variables and the expression returning them typed.
    pub vars: Vec<Ident>,
    pub result: TokenStream,
    /// The wanted inputs' indices.
    pub wanted: Vec<usize>,
    /// `backward::GRADIENTS` and `backward::INPUTS`.
    pub grad_names: Vec<String>,
    pub input_names: Vec<String>,
    /// The hygienic `rank` and `options` parameters.
    pub rank: Ident,
    pub options: Ident,
}

impl Sig {
    /// The signature of `def`'s backward for the inputs `wanted`.
    pub fn new(def: &FusionDef, wanted: &[usize]) -> Sig {
        let fr = fr();
        let params: Vec<Ident> = (0..def.params.len())
            .map(|i| format_ident!("__x{}", i, span = Span::mixed_site()))
            .collect();
        let grads_in: Vec<Ident> = (0..def.outputs.len())
            .map(|o| format_ident!("__dy{}", o, span = Span::mixed_site()))
            .collect();
        let param_ty = |i: usize| ranked(def.params[i].ty.axes.len(), def.params[i].ty.span.start);
        let out_tys: Vec<TokenStream> = (def.outputs.iter())
            .map(|o| ranked(o.axes.len(), o.span.start))
            .collect();
        let grad_tys: Vec<TokenStream> = wanted.iter().map(|&i| param_ty(i)).collect();
        let ret = match grad_tys.as_slice() {
            [one] => one.clone(),
            more => quote!((#(#more),*)),
        };
        let n_out = def.outputs.len();
        let mut input_names: Vec<String> = def.params.iter().map(|p| p.name.to_string()).collect();
        input_names.extend((0..n_out).map(|o| match n_out {
            1 => "d_output".to_string(),
            _ => format!("d_output{o}"),
        }));
        let vars: Vec<Ident> = (0..wanted.len())
            .map(|k| format_ident!("__g{}", k, span = Span::mixed_site()))
            .collect();
        let result = match vars.as_slice() {
            [one] => quote!(#fr::Ranked::from_output(#one)?),
            more => quote!((#(#fr::Ranked::from_output(#more)?),*)),
        };
        Sig {
            param_tys: (0..def.params.len()).map(param_ty).collect(),
            dy_tys: out_tys.clone(),
            out_tys,
            params,
            grads_in,
            ret,
            vars,
            result,
            wanted: wanted.to_vec(),
            grad_names: (wanted.iter())
                .map(|&i| format!("d_{}", def.params[i].name))
                .collect(),
            input_names,
            rank: hygienic("rank"),
            options: hygienic("options"),
        }
    }

    /// `rank, inputs.., d_outputs..,` as parameters.
    pub fn args(&self) -> TokenStream {
        let (fr, rank) = (fr(), &self.rank);
        let (params, param_tys) = (&self.params, &self.param_tys);
        let (grads_in, dy_tys) = (&self.grads_in, &self.dy_tys);
        quote!(#rank: &impl #fr::CallTarget, #(#params: &#param_tys,)* #(#grads_in: &#dy_tys,)*)
    }

    /// The derivation's `GradSpec`: every output, the wanted inputs.
    pub fn spec(&self) -> TokenStream {
        let (fc, n_out, wanted) = (fc(), self.grads_in.len(), &self.wanted);
        quote! {
            #fc::autodiff::GradSpec {
                outputs: (0..#n_out).collect(),
                inputs: ::std::vec![#(#wanted),*],
            }
        }
    }

    /// Statements taking the gradients out of `report` (a backward's `RunReport`) into
    /// `vars`, named `name` in the arity error.
    pub fn take_gradients(&self, report: &Ident, name: &str) -> TokenStream {
        let (fr, vars, n) = (fr(), &self.vars, self.vars.len());
        quote! {
            let [#(#vars),*]: [#fr::Tensor; #n] =
                #report.outputs.try_into().map_err(|v: ::std::vec::Vec<#fr::Tensor>| {
                    #fr::Error::Arity {
                        what: ::std::format!("outputs of `{}`", #name),
                        expected: #n,
                        actual: v.len(),
                    }
                })?;
        }
    }
}

/// A body, or a panic in a stub.
pub fn body(stub: bool, b: TokenStream) -> TokenStream {
    match stub {
        true => quote!(::core::panic!("this fusion did not compile")),
        false => b,
    }
}

/// `fn backward` and `mod backward` inside the fusion's module (`wanted`: input indices),
/// with the saving form's items.
pub fn gradient_items(def: &FusionDef, wanted: &[usize], stub: bool) -> TokenStream {
    let (fc, fr) = (fc(), fr());
    let sig = Sig::new(def, wanted);
    let (params, grads_in) = (&sig.params, &sig.grads_in);
    let (n_in, n_out, n_grads) = (params.len(), grads_in.len(), wanted.len());
    let (names, grad_names) = (&sig.input_names, &sig.grad_names);
    let name = format!("{}::backward", def.name);
    let (rank, options, ret, result) = (&sig.rank, &sig.options, &sig.ret, &sig.result);
    let (prepared, picked, report) = (
        hygienic("__prepared"),
        hygienic("__picked"),
        hygienic("__report"),
    );
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
    let spec = sig.spec();
    let derive = body(
        stub,
        quote! {
            let __f = super::build()?;
            #fc::autodiff::backward(&__f, &#spec).map_err(#fc::Error::from)
        },
    );
    let program = body(
        stub,
        quote! {
            #pick
            #prepared.0.program(#rank, &#picked, #options)
        },
    );
    let take = sig.take_gradients(&report, &name);
    let call = body(
        stub,
        quote! {
            #pick
            let #report = #prepared.0.run_with(#rank, &#picked, ::core::option::Option::None, #options)?;
            #take
            ::core::result::Result::Ok(#result)
        },
    );
    let (saving, saving_runners) = crate::saving::saving_items(def, &sig, stub);
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
