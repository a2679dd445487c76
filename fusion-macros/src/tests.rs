//! Unit tests of the expansion on source text (no compiler run). The errors, their
//! messages and carets are the trybuild suite's (`tests/ui/*.rs` of the `fusion` crate),
//! the rules themselves `fusion-compiler`'s tests.

use crate::check::check;
use crate::parse::Block;

fn block(src: &str) -> Block {
    syn::parse_str(src).unwrap_or_else(|e| panic!("parse error: {e}"))
}

fn expansion(src: &str) -> String {
    let b = block(src);
    let c = check(&b.fusions[0]).unwrap_or_else(|e| panic!("{e}"));
    crate::expand::expand(&b.fusions[0], &c).to_string()
}

#[test]
fn expansion_repeats_the_builder_calls_in_order() {
    let x = expansion(
        "pub fn f<m, n>(a: Tensor<f32, [m, n]>, v: Tensor<f32, [n]>) -> Tensor<f32, [m @ Stream, n]> {
            let h = a + v;
            relu(h)
        }",
    );
    let order = [
        "symbol (\"m\")",
        "input_on (\"a\"",
        "input_on (\"v\"",
        "binary (",
        "name (",
        "unary (",
        "declare_on (",
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
    assert!(x.contains("pub fn f (") && x.contains("pub mod f"), "{x}");
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
}

#[test]
fn a_generic_build_takes_one_dtype_per_parameter() {
    let e = expansion(
        "fn f<T: Float, U: Float, n>(x: Tensor<T, [n]>, y: Tensor<U, [n]>) -> Tensor<T, [n]> {
            x + cast(y, T)
        }",
    );
    let needles = [
        "pub fn build (T : :: fusion :: __private :: fusion_compiler :: DType , U",
        "cast (__t1 , T)",
        "DTypeSpec :: Param (1usize)",
        "pub const DTYPE_PARAMS : [& str ; 2usize] = [\"T\" , \"U\"]",
    ];
    for n in needles {
        assert!(e.contains(n), "{n} missing in {e}");
    }
}
