//! Compile-time behaviour of `fusion!`: every rule of DESIGN.md section 3 rejected with a
//! span on the culprit (`tests/ui/*.rs` and their `.stderr`), and fusions that must compile
//! and run (`tests/ui/pass/*.rs`). Regenerate the expected output with `TRYBUILD=overwrite`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
    t.pass("tests/ui/pass/*.rs");
}

/// `tests/ui/pass/readme.rs` is the README's headline example, so the README's code
/// compiles and runs as part of `ui`.
#[test]
fn the_readme_example_is_the_tested_one() {
    let readme = std::fs::read_to_string("README.md").unwrap();
    let example = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README starts with a rust example");
    let tested = std::fs::read_to_string("tests/ui/pass/readme.rs").unwrap();
    let tested = tested.split_once('\n').map_or("", |x| x.1);
    assert_eq!(
        tested, example,
        "update tests/ui/pass/readme.rs with the README's example"
    );
}
