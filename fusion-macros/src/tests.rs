//! Unit tests of parse -> check -> expand on source text (no compiler run; the trybuild
//! suite in the `fusion` crate checks spans and the generated code end to end).

use crate::check::{check, Step};
use crate::parse::Block;

fn block(src: &str) -> Block {
    syn::parse_str(src).unwrap_or_else(|e| panic!("parse error: {e}"))
}

/// The messages of the first fusion's errors (empty when it checks).
fn errors(src: &str) -> Vec<String> {
    match check(&block(src).fusions[0]) {
        Ok(_) => vec![],
        Err(e) => e.into_iter().map(|e| e.to_string()).collect(),
    }
}

fn one_error(src: &str) -> String {
    let e = errors(src);
    assert_eq!(e.len(), 1, "expected one error, got {e:#?}");
    e[0].clone()
}

fn expansion(src: &str) -> String {
    let b = block(src);
    let c = check(&b.fusions[0]).unwrap_or_else(|e| panic!("{e}"));
    crate::expand::expand(&b.fusions[0], &c).to_string()
}

#[test]
fn independent_errors_are_all_reported() {
    let e = errors(
        "fn f<m, n>(a: Tensor<f32, [m, q]>, b: Tensor<f64, [m, n]>) -> Tensor<f32, [m, n]> {
            let x = rleu(b);
            let y = relu(zz);
            x
        }",
    );
    assert_eq!(e.len(), 4, "{e:#?}");
    assert!(e[0].contains("unknown dimension `q`"));
    assert!(e[1].contains("unknown element type `f64`"));
    assert!(e[2].contains("unknown op `rleu`; did you mean `relu`?"));
    assert!(e[3].contains("cannot find tensor `zz`"));
}

#[test]
fn a_failed_let_keeps_its_declared_type() {
    // `h` fails, but its annotation lets `h + c` be checked (and found wrong).
    let e = errors(
        "fn f<m, n, k>(a: Tensor<f32, [m, n]>, c: Tensor<f32, [m, k]>) -> Tensor<f32, [m, n]> {
            let h: Tensor<f32, [m, n]> = unknown(a);
            h + c
        }",
    );
    assert_eq!(e.len(), 2, "{e:#?}");
    assert!(e[1].contains("axis 1 of `h` has extent `n` but axis 1 of `c` has extent `k`"));
}

#[test]
fn shapes_follow_the_builder() {
    // Batched matmul broadcasting, linear, reductions, views and dim arithmetic all check.
    let ok = errors(
        "fn f<b, m, k, n>(
            x: Tensor<f32, [b, 1, m, k]>,
            y: Tensor<f32, [4, k, n]>,
            w: Tensor<f32, [n, k]>,
            v: Tensor<f32, [n]>,
        ) -> (Tensor<f32, [b, 4, m, n]>, Tensor<f32, [b, m]>, Tensor<f32, [2, k / 2]>, Tensor<f32, [n - 1]>) {
            let p = matmul(x, y);
            let l: Tensor<f32, [b, 1, m, n]> = linear(x, w, v);
            let r = max(sum(l, 1), [2]);
            (p + l, r, split(select(select(select(x, 0, 0), 0, 0), 0, 0), 0, 2), slice(v, 0, 1, n))
        }",
    );
    assert!(ok.is_empty(), "{ok:#?}");
}

#[test]
fn op_argument_errors() {
    let bad_flags = one_error(
        "fn f<m>(x: Tensor<f32, [m]>) -> Tensor<f32, [1, 1, m]> { broadcast(x, [true, false, false]) }",
    );
    assert!(bad_flags.contains("these flags keep 2 axes"), "{bad_flags}");
    let max2 = one_error(
        "fn f<m>(a: Tensor<f32, [m]>, b: Tensor<f32, [m]>) -> Tensor<f32, [m]> { max(a, b) }",
    );
    assert!(max2.contains("use `maximum(a, b)`"), "{max2}");
    let select = one_error("fn f(x: Tensor<f32, [4, 8]>) -> Tensor<f32, [8]> { select(x, 0, 4) }");
    assert!(select.contains("index 4 is out of range"), "{select}");
    let slice =
        one_error("fn f(x: Tensor<f32, [4, 8]>) -> Tensor<f32, [4, 3]> { slice(x, 1, 6, 9) }");
    assert!(slice.contains("6..9 does not fit"), "{slice}");
    let unbound =
        one_error("fn f<m, s>(x: Tensor<f32, [m]>) -> Tensor<f32, [s, m / s]> { split(x, 0, s) }");
    assert!(unbound.contains("not an extent of any input"), "{unbound}");
    let dtype = one_error(
        "fn f<m>(a: Tensor<f32, [m]>, b: Tensor<bf16, [m]>) -> Tensor<f32, [m]> { a * b }",
    );
    assert!(dtype.contains("convert one with `cast(x, f32)`"), "{dtype}");
    let cast = one_error("fn f<m>(a: Tensor<f32, [m]>) -> Tensor<f32, [m]> { cast(a, f8) }");
    assert!(cast.contains("unknown element type `f8`"), "{cast}");
    let declared = one_error("fn f<m>(a: Tensor<f32, [m]>) -> Tensor<bf16, [m]> { relu(a) }");
    assert!(
        declared.contains("declared element type `bf16`"),
        "{declared}"
    );
}

#[test]
fn sharding_rules() {
    let par = one_error("fn f<d>(a: Tensor<f32, [d @ DIDy]>) -> Tensor<f32, [d]> { a }");
    assert!(par.contains("only `DIDx` exists"), "{par}");
    let mesh = one_error(
        "fn f(a: Tensor<f32, [3 @ DIDx, 4], mesh = [0, 1]>) -> Tensor<f32, [3, 4]> { a }",
    );
    assert!(
        mesh.contains("DIDx extent 3 differs from the size of the mesh [0, 1]"),
        "{mesh}"
    );
    let dup = one_error("fn f<m>(a: Tensor<f32, [m], mesh = [0, 0]>) -> Tensor<f32, [m]> { a }");
    assert!(dup.contains("device 0 is listed twice"), "{dup}");
    let stream_sum = one_error(
        "fn f<s, m>(a: Tensor<f32, [s, m]>) -> Tensor<f32, [m]> {
            let b: Tensor<f32, [s @ Stream, m]> = relu(a);
            sum(b, 0)
        }",
    );
    assert!(
        stream_sum.contains("reduction over a Stream axis"),
        "{stream_sum}"
    );
    let view = one_error(
        "fn f<d, m>(a: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [m]> { select(a, 0, 0) }",
    );
    assert!(view.contains("select: axis 0 of `a` is DIDx"), "{view}");
    let contraction = one_error(
        "fn f<d, m>(a: Tensor<f32, [m, d @ DIDx]>, b: Tensor<f32, [d, m]>) -> Tensor<f32, [m, m]> {
            matmul(a, b)
        }",
    );
    assert!(contraction.contains("DIDx-sharded"), "{contraction}");
}

#[test]
fn reshardings_that_cannot_lower() {
    // A reduction that keeps the input's sharded axis but shards another in its result.
    let red = one_error(
        "fn f<d, m>(a: Tensor<f32, [d @ DIDx, d, m]>) -> Tensor<f32, [d, d @ DIDx]> { sum(a, 2) }",
    );
    assert!(red.contains("two shardings would change at once"), "{red}");
    // A compute op whose input must move its DIDx axis.
    let mm = one_error(
        "fn f<d, k, n>(a: Tensor<f32, [d @ DIDx, d, k]>, b: Tensor<f32, [k, n]>) -> Tensor<f32, [d, d @ DIDx, n]> {
            matmul(a, b)
        }",
    );
    assert!(mm.contains("cannot lower `matmul`"), "{mm}");
    // DIDx -> Stream across different meshes.
    let p2p = one_error(
        "fn f<m>(a: Tensor<f32, [2 @ DIDx, m], mesh = [0, 1]>) -> Tensor<f32, [2 @ Stream, m], mesh = [2, 3]> {
            a
        }",
    );
    assert!(p2p.contains("same mesh"), "{p2p}");
    // Sharded-to-sharded over meshes of different sizes.
    let sizes = one_error(
        "fn f<h, g, m>(a: Tensor<f32, [h @ DIDx, m], mesh = [0, 1]>) -> Tensor<f32, [h @ DIDx, m], mesh = [1, 2, 3]> {
            a
        }",
    );
    assert!(sizes.contains("meshes of one size"), "{sizes}");
    // These lower: an Allgather, a Scatter, a P2P pipeline.
    for ok in [
        "fn f<d, m>(a: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [d, m]> { a }",
        "fn f<d, m>(a: Tensor<f32, [d, m]>) -> Tensor<f32, [d @ DIDx, m]> { a }",
        "fn f<d, m>(a: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [d @ Stream, m]> { a }",
    ] {
        assert!(errors(ok).is_empty(), "{ok}: {:?}", errors(ok));
    }
}

#[test]
fn parse_errors_are_specific() {
    let e = syn::parse_str::<Block>("fn f<m>(a: Tensor<f32, [m]>) { a }")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("needs a return type"), "{e}");
    let e = syn::parse_str::<Block>("fn f<m>(a: Vec<f32>) -> Tensor<f32, [m]> { a }")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("expected a tensor type"), "{e}");
    let b = block("fn f<m>(a: Tensor<f32, [m]>) -> Tensor<f32, [m]> { let b = relu(a); }");
    let e = b.fusions[0].body.as_ref().err().unwrap().to_string();
    assert!(e.contains("ends with the expression it returns"), "{e}");
    let b = block("fn f<m>(a: Tensor<f32, [m]>) -> Tensor<f32, [m]> { relu(a); }");
    let e = b.fusions[0].body.as_ref().err().unwrap().to_string();
    assert!(e.contains("remove this `;`"), "{e}");
}

#[test]
fn annotations_that_change_nothing_add_no_copy() {
    let b = block(
        "fn f<m, n>(a: Tensor<f32, [m, n]>) -> Tensor<f32, [m @ Stream, n]> {
            let y: Tensor<f32, [m @ Stream, n]> = relu(a);
            let z: Tensor<f32, [m @ Stream, n]> = y;
            z
        }",
    );
    let c = check(&b.fusions[0]).unwrap();
    assert_eq!(c.model.tensors.len(), 2, "a, relu(a): no copies");
    let declares = c
        .steps
        .iter()
        .filter(|s| matches!(s, Step::Declare { .. }))
        .count();
    assert_eq!(declares, 1);
    // Re-annotating with another layout copies.
    let b = block(
        "fn f<m, n>(a: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
            let y: Tensor<f32, [m @ Stream, n]> = relu(a);
            y
        }",
    );
    assert_eq!(check(&b.fusions[0]).unwrap().model.tensors.len(), 3);
}

#[test]
fn literal_dims_become_static_assertions() {
    let x = expansion(
        "fn f(a: Tensor<f32, [8, 16]>, b: Tensor<f32, [16, 4]>) -> Tensor<f32, [8, 2, 2]> {
            split(matmul(a, b), 1, 2)
        }",
    );
    assert!(x.contains("const_assert ! (16i64 == 16i64)"), "{x}");
    assert!(
        x.contains("const_assert ! (2i64 > 0 && 4i64 % 2i64 == 0)"),
        "{x}"
    );
    assert!(!x.contains("symbol ("), "no dimension symbols here: {x}");
    assert!(x.contains("constant (8i64)"));
}

#[test]
fn expansion_calls_the_builder_in_order() {
    let x = expansion(
        "pub fn f<m, n>(a: Tensor<f32, [m, n]>, v: Tensor<f32, [n]>) -> Tensor<f32, [m @ Stream, n]> {
            let h = a + v;
            relu(h)
        }",
    );
    let order = [
        "input (\"a\"",
        "input (\"v\"",
        "binary (",
        "name (",
        "unary (",
        "declare (",
        "output (",
        "name (",
    ];
    let mut at = 0;
    for needle in order {
        let pos = x[at..]
            .find(needle)
            .unwrap_or_else(|| panic!("`{needle}` missing after {at} in {x}"));
        at += pos + needle.len();
    }
    assert!(x.contains("pub fn f ("), "{x}");
    assert!(x.contains("pub mod f"), "{x}");
}

#[test]
fn signature_mistakes() {
    let e = one_error("fn f<m>(a: Tensor<f32, [m]>) -> () { a }");
    assert!(e.contains("returns nothing"), "{e}");
    let e =
        errors("fn f<m, m>(a: Tensor<f32, [m]>, a: Tensor<f32, [m]>) -> Tensor<f32, [m]> { a }");
    assert!(e[0].contains("dimension `m` is declared twice"), "{e:?}");
    assert!(
        e[1].contains("`a` is already bound by a parameter"),
        "{e:?}"
    );
    let stub = crate::expand::stub(
        &block("fn f<m>(a: Tensor<f32, [m]>, a: Tensor<f32, [m]>) -> Tensor<f32, [m]> { a }")
            .fusions[0],
    )
    .to_string();
    assert!(stub.contains("__repeated1"), "{stub}");
}

#[test]
fn dtype_parameters_match_only_themselves() {
    let e = errors(
        "fn f<T: Float, U: Float, n>(x: Tensor<T, [n]>, y: Tensor<U, [n]>, z: Tensor<bf16, [n]>)
            -> Tensor<T, [n]> {
            let a = x + y;
            let b = x + z;
            let c: Tensor<f32, [n]> = x;
            x
        }",
    );
    assert_eq!(e.len(), 3, "{e:#?}");
    assert!(e[0].contains("add: `x` is `T` but `y` is `U`"), "{}", e[0]);
    assert!(
        e[1].contains("add: `x` is `T` but `z` is `bf16`"),
        "{}",
        e[1]
    );
    assert!(
        e[2].contains("declared element type `f32`, but `x` is `T`"),
        "{}",
        e[2]
    );
    assert!(errors(
        "fn f<T: Float, n>(x: Tensor<T, [n]>, y: Tensor<T, [n]>) -> Tensor<T, [n]> {
            cast(cast(x, f32) * cast(y, f32), T)
        }"
    )
    .is_empty());
}

#[test]
fn dtype_parameters_are_declared_once_and_bound_by_an_input() {
    let e = one_error("fn f<T: Float, T, n>(x: Tensor<T, [n]>) -> Tensor<T, [n]> { x }");
    assert!(e.contains("`T` is declared twice"), "{e}");
    let e = one_error("fn f<T: Float, n>(x: Tensor<f32, [n]>) -> Tensor<T, [n]> { cast(x, T) }");
    assert!(
        e.contains("dtype parameter `T` is not the element type of any input"),
        "{e}"
    );
    let e = one_error("fn f<n>(x: Tensor<n, [n]>) -> Tensor<f32, [n]> { x }");
    assert!(e.contains("`n` is a dimension symbol"), "{e}");
}

#[test]
fn a_generic_build_takes_one_dtype_per_parameter() {
    let e = expansion(
        "fn f<T: Float, U: Float, n>(x: Tensor<T, [n]>, y: Tensor<U, [n]>) -> Tensor<T, [n]> {
            x + cast(y, T)
        }",
    );
    assert!(
        e.contains("pub fn build (T : :: fusion :: __private :: fusion_core :: DType , U"),
        "{e}"
    );
    assert!(
        e.contains("DTypeSpec :: Param (0usize)") && e.contains("DTypeSpec :: Param (1usize)"),
        "{e}"
    );
    assert!(
        e.contains("pub const DTYPE_PARAMS : [& str ; 2usize] = [\"T\" , \"U\"]"),
        "{e}"
    );
}
