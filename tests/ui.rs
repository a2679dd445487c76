//! Compile-time behaviour of `fusion!`: every rule of DESIGN.md section 3 rejected with a
//! span on the culprit (`tests/ui/*.rs` and their `.stderr`), and fusions that must compile
//! and run (`tests/ui/pass/*.rs`). Regenerate the expected output with `TRYBUILD=overwrite`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
