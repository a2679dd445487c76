//! Expansion: a checked fusion becomes
//!
//! - `fn name(rank, a: &Ranked<RA>, ..) -> Result<Ranked<RO>>`, the typed entry point (the
//!   rank is any `CallTarget`: a `Rank`, or a rank on the caller's stream), and
//! - `mod name { build, executor, program, run_with, call, lowering_count, INPUTS,
//!   DTYPE_PARAMS }`, the builder code and the options-taking runners; its executor is a
//!   `static` built at the first call, which lowers once per input shapes (and world,
//!   backend, options). With dtype parameters (`<T: Float, ..>`), `build` takes one
//!   `DType` per parameter and the executor is generic: each call binds the parameters
//!   from its inputs' dtypes, and each binding is built and lowered on its own.
//!
//! Literal-dim facts are re-checked with `static_assertions::const_assert!`. On errors,
//! [`stub`] emits the same items with the declared signature, so the caller type-checks and
//! only the real mistakes are reported.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::Ident;

use fusion_compiler::builder::LiteralFact;
use fusion_compiler::{DType, DTypeSpec};

use crate::check::emit::{self, fc, fr, hygienic, ranked};
use crate::check::Checked;
use crate::parse::FusionDef;

/// The expansion of a fusion that passed every check.
pub fn expand(def: &FusionDef, checked: &Checked) -> TokenStream {
    let build = build_fn(checked, &def.dtype_params);
    let mut asserts = static_asserts(checked);
    if let Some(wanted) = &checked.backward {
        asserts.extend(crate::backward::gradient_items(def, wanted, false));
    }
    items(def, build, asserts, false)
}

/// The entry point and module of a fusion with errors: same signatures, no body.
pub fn stub(def: &FusionDef) -> TokenStream {
    let fc = fc();
    let params = renamed_repeats(def.dtype_params.clone(), "__repeated_dtype");
    let build = quote! {
        #[allow(non_snake_case)]
        pub fn build(#(#params: #fc::DType),*) -> ::core::result::Result<#fc::ir::Fusion, #fc::Error> {
            ::core::panic!("this fusion did not compile")
        }
    };
    let backward = def.backward.as_ref().map(|attr| {
        let wanted = crate::parse::wanted_inputs(def, attr).unwrap_or_default();
        crate::backward::gradient_items(def, &wanted, true)
    });
    items(def, build, backward.unwrap_or_default(), true)
}

/// `names`, each repeat of an earlier name renamed `{prefix}{i}`: the checker reports a
/// repeat, and the stub's signature then adds no error of its own.
fn renamed_repeats(names: Vec<Ident>, prefix: &str) -> Vec<Ident> {
    let repeat = |i: usize| names[..i].contains(&names[i]);
    (0..names.len())
        .map(|i| match repeat(i) {
            true => format_ident!("{}{}", prefix, i, span = Span::mixed_site()),
            false => names[i].clone(),
        })
        .collect()
}

/// The single item, or the items as a tuple.
fn one_or_tuple(items: &[TokenStream]) -> TokenStream {
    match items {
        [one] => one.clone(),
        _ => quote!((#(#items),*)),
    }
}

/// How the module's `executor()` makes its executor: from `build()`, or with dtype
/// parameters a generic executor that builds once per binding of the inputs' dtypes.
fn make_executor(def: &FusionDef, input_names: &[String]) -> TokenStream {
    let (fc, fr) = (fc(), fr());
    let fusion_name = def.name.to_string();
    if def.dtype_params.is_empty() {
        return quote!(self::build().map(|f| #fr::FusionExecutor::new(f).with_name(#fusion_name)));
    }
    let dtype_params: Vec<String> = def.dtype_params.iter().map(|p| p.to_string()).collect();
    let n_dtype_params = dtype_params.len();
    let specs = def.params.iter().map(|p| {
        let name = p.ty.dtype.to_string();
        match def.dtype_params.iter().position(|t| *t == name) {
            Some(i) => quote!(#fc::generic::DTypeSpec::Param(#i)),
            None => {
                let d = DType::from_name(&name).unwrap_or(DType::F32);
                let d = emit::dtype(DTypeSpec::Fixed(d), &[]);
                quote!(#fc::generic::DTypeSpec::Fixed(#d))
            }
        }
    });
    let vars: Vec<Ident> = (0..n_dtype_params)
        .map(|i| format_ident!("__dtype{}", i, span = Span::mixed_site()))
        .collect();
    let dts = hygienic("__dtypes");
    quote! {
        #fc::generic::GenericFusion::new(
            &[#(#dtype_params),*],
            &[#((#input_names, #specs)),*],
            |#dts: &[#fc::DType]| match *#dts {
                [#(#vars),*] => self::build(#(#vars),*),
                _ => ::core::result::Result::Err(#fc::Error::Invalid(::std::format!(
                    "fusion `{}` takes {} dtype(s), got {}",
                    #fusion_name,
                    #n_dtype_params,
                    #dts.len()
                ))),
            },
        )
        .map(|g| #fr::FusionExecutor::generic(g).with_name(#fusion_name))
    }
}

/// The bodies of the module's `executor`, `program`, `run_with` and `call` (a panic each
/// in a stub).
fn runner_bodies(def: &FusionDef, params: &[Ident], stub: bool) -> [TokenStream; 4] {
    if stub {
        return std::array::from_fn(|_| quote!(::core::panic!("this fusion did not compile")));
    }
    let (fc, fr) = (fc(), fr());
    let (rank, options, outputs) = (hygienic("rank"), hygienic("options"), hygienic("outputs"));
    let (outs_arr, report) = (hygienic("__outs"), hygienic("__report"));
    let out_vars: Vec<Ident> = (0..def.outputs.len())
        .map(|i| format_ident!("__o{}", i, span = Span::mixed_site()))
        .collect();
    let vars: Vec<TokenStream> = out_vars.iter().map(|o| quote!(#o)).collect();
    let results: Vec<TokenStream> = (out_vars.iter())
        .map(|o| quote!(#fr::Ranked::from_output(#o)?))
        .collect();
    let (out_pat, result) = (one_or_tuple(&vars), one_or_tuple(&results));
    let input_names: Vec<String> = params.iter().map(|p| p.to_string()).collect();
    let make_executor = make_executor(def, &input_names);
    let inputs = quote!([#(#params.as_tensor()),*]);
    let (fusion_name, n_out) = (def.name.to_string(), out_vars.len());
    let executor = quote! {
        static EXECUTOR: ::std::sync::OnceLock<
            ::core::result::Result<#fr::FusionExecutor, #fc::Error>,
        > = ::std::sync::OnceLock::new();
        match EXECUTOR.get_or_init(|| #make_executor) {
            ::core::result::Result::Ok(e) => ::core::result::Result::Ok(e),
            ::core::result::Result::Err(e) => {
                ::core::result::Result::Err(#fr::Error::Core(::core::clone::Clone::clone(e)))
            }
        }
    };
    let program = quote!(self::executor()?.program(#rank, &#inputs, #options));
    let run = quote! {
        let #outs_arr = #outputs.map(|#out_pat| [#(#out_vars.as_tensor()),*]);
        self::executor()?.run_with(
            #rank,
            &#inputs,
            #outs_arr.as_ref().map(|o| &o[..]),
            #options,
        )
    };
    let call = quote! {
        let #report = self::run_with(#rank, #(#params,)* ::core::option::Option::None, #options)?;
        let [#(#out_vars),*]: [#fr::Tensor; #n_out] =
            #report.outputs.try_into().map_err(|v: ::std::vec::Vec<#fr::Tensor>| {
                #fr::Error::Arity {
                    what: ::std::format!("outputs of `{}`", #fusion_name),
                    expected: #n_out,
                    actual: v.len(),
                }
            })?;
        ::core::result::Result::Ok(#result)
    };
    [executor, program, run, call]
}

fn items(def: &FusionDef, build: TokenStream, asserts: TokenStream, stub: bool) -> TokenStream {
    let (fc, fr) = (fc(), fr());
    let (name, vis, attrs) = (&def.name, &def.vis, &def.attrs);
    let cfgs = def.attrs.iter().filter(|a| a.path().is_ident("cfg"));
    let (rank, options, outputs) = (hygienic("rank"), hygienic("options"), hygienic("outputs"));
    let params = renamed_repeats(
        def.params.iter().map(|p| p.name.clone()).collect(),
        "__repeated",
    );
    let param_tys: Vec<TokenStream> = (def.params.iter())
        .map(|p| ranked(p.ty.axes.len(), p.ty.span.start))
        .collect();
    let out_tys: Vec<TokenStream> = (def.outputs.iter())
        .map(|o| ranked(o.axes.len(), o.span.start))
        .collect();
    let out_refs: Vec<TokenStream> = out_tys.iter().map(|t| quote!(&#t)).collect();
    let (ret, out_refs) = (one_or_tuple(&out_tys), one_or_tuple(&out_refs));
    let [executor_body, program_body, run_body, call_body] = runner_bodies(def, &params, stub);
    let input_names: Vec<String> = params.iter().map(|p| p.to_string()).collect();
    let n_in = input_names.len();
    let mod_doc = format!(
        "The builder, executor and option-taking runners of the fusion [`{name}`](fn@{name})."
    );
    let dtype_params: Vec<String> = def.dtype_params.iter().map(|p| p.to_string()).collect();
    let n_dtype_params = dtype_params.len();
    let build_doc = if n_dtype_params == 0 {
        "Builds the fusion with the builder API, which checks every rule again.".to_string()
    } else {
        format!(
            "Builds the fusion for one dtype per dtype parameter ({}) with the builder API, \
             which checks every rule again.",
            dtype_params.join(", ")
        )
    };
    let entry = quote_spanned! {name.span()=>
        #(#attrs)*
        #[allow(clippy::too_many_arguments)]
        #vis fn #name(
            #rank: &impl #fr::CallTarget,
            #(#params: &#param_tys,)*
        ) -> #fr::Result<#ret> {
            #name::call(#rank, #(#params,)* &<#fr::ExecOptions as ::core::default::Default>::default())
        }
    };
    quote! {
        #entry

        #(#cfgs)*
        #[doc = #mod_doc]
        #[allow(dead_code, unused_variables, unreachable_code, clippy::all)]
        #vis mod #name {
            #[doc = #build_doc]
            #build

            /// The input names, in call order.
            pub const INPUTS: [&str; #n_in] = [#(#input_names),*];

            /// The dtype parameters (`T: Float`), in the order `build` takes them; a call
            /// binds each from the dtype of the inputs declared with it.
            pub const DTYPE_PARAMS: [&str; #n_dtype_params] = [#(#dtype_params),*];

            /// The shared executor, built at the first call; it caches one lowered program
            /// per dtype binding, input shapes, world size, backend and options.
            pub fn executor() -> #fr::Result<&'static #fr::FusionExecutor> {
                #executor_body
            }

            /// How many programs the executor has lowered so far.
            pub fn lowering_count() -> usize {
                self::executor().map_or(0, |e| e.lowering_count())
            }

            /// The host program for these inputs and options (lowered if needed).
            pub fn program(
                #rank: &impl #fr::CallTarget,
                #(#params: &#param_tys,)*
                #options: &#fr::ExecOptions,
            ) -> #fr::Result<::std::sync::Arc<#fc::hir::HostProgram>> {
                #program_body
            }

            /// Runs with options, optionally into preallocated outputs; returns the
            /// outputs and statistics.
            pub fn run_with(
                #rank: &impl #fr::CallTarget,
                #(#params: &#param_tys,)*
                #outputs: ::core::option::Option<#out_refs>,
                #options: &#fr::ExecOptions,
            ) -> #fr::Result<#fr::RunReport> {
                #run_body
            }

            /// Runs with options and returns the typed outputs.
            pub fn call(
                #rank: &impl #fr::CallTarget,
                #(#params: &#param_tys,)*
                #options: &#fr::ExecOptions,
            ) -> #fr::Result<#ret> {
                #call_body
            }

            #asserts
        }
    }
}

/// The generated `build`: the builder calls the checker made, in order.
fn build_fn(checked: &Checked, params: &[Ident]) -> TokenStream {
    let (fc, b, stmts) = (fc(), emit::builder(), &checked.stmts);
    quote! {
        #[allow(non_snake_case)]
        pub fn build(#(#params: #fc::DType),*) -> ::core::result::Result<#fc::ir::Fusion, #fc::Error> {
            let mut #b = #fc::builder::FusionBuilder::new();
            #(#stmts)*
            #b.build()
        }
    }
}

fn static_asserts(checked: &Checked) -> TokenStream {
    let mut seen: Vec<String> = Vec::new();
    let mut out = TokenStream::new();
    for (fact, span) in &checked.facts {
        let cond = match *fact {
            LiteralFact::Eq(a, b) => quote!(#a == #b),
            LiteralFact::Divides { n, by } => quote!(#by > 0 && #n % #by == 0),
            LiteralFact::Lt(a, b) => quote!(#a < #b),
            LiteralFact::Le(a, b) => quote!(#a <= #b),
        };
        let key = cond.to_string();
        if seen.contains(&key) {
            continue;
        }
        seen.push(key);
        out.extend(quote_spanned! {span.start=>
            ::fusion::__private::static_assertions::const_assert!(#cond);
        });
    }
    out
}
