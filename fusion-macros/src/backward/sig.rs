//! The signature every generated backward item shares: the forward inputs' and output
//! gradients' parameters and types, the gradients returned, the derivation's request.

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

    /// The body of a `derive` function: `fusion_compiler::autodiff::<derivation>` of the
    /// forward `build()` for every output and the wanted inputs (a panic in a stub).
    pub fn derive_body(&self, derivation: &str, stub: bool) -> TokenStream {
        let (fc, n_out, wanted) = (fc(), self.grads_in.len(), &self.wanted);
        let derivation = Ident::new(derivation, Span::call_site());
        body(
            stub,
            quote! {
                let __f = super::build()?;
                let __spec = #fc::autodiff::GradSpec {
                    outputs: (0..#n_out).collect(),
                    inputs: ::std::vec![#(#wanted),*],
                };
                #fc::autodiff::#derivation(&__f, &__spec).map_err(#fc::Error::from)
            },
        )
    }

    /// The bodies of a backward's `program` and `call` (panics in a stub): `pick` binds
    /// `__picked`, the backward's inputs, and `exec` is its executor; `call` returns the
    /// gradients typed, `name` naming the backward in errors.
    pub fn runner_bodies(
        &self,
        stub: bool,
        pick: &TokenStream,
        exec: &TokenStream,
        name: &str,
    ) -> (TokenStream, TokenStream) {
        let (rank, options, result) = (&self.rank, &self.options, &self.result);
        let (picked, report) = (hygienic("__picked"), hygienic("__report"));
        let program = quote! {
            #pick
            #exec.program(#rank, &#picked, #options)
        };
        let take = self.take_gradients(&report, name);
        let call = quote! {
            #pick
            let #report = #exec.run_with(#rank, &#picked, ::core::option::Option::None, #options)?;
            #take
            ::core::result::Result::Ok(#result)
        };
        (body(stub, program), body(stub, call))
    }

    /// Statements taking the gradients out of `report` (a backward's `RunReport`) into
    /// `vars`, named `name` in the arity error.
    fn take_gradients(&self, report: &Ident, name: &str) -> TokenStream {
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
