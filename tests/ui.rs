//! Compile-time behaviour of `fusion!`: every compile-time rule of docs/DSL.md rejected with a
//! span on the culprit (`tests/ui/*.rs` and their `.stderr`, checked by trybuild;
//! regenerate the expected output with `TRYBUILD=overwrite`), and fusions that must
//! compile and run (`tests/ui/pass/*.rs`, each a module of this test crate with a test
//! that runs its `main`). The passing cases live here rather than in trybuild's project so
//! that trybuild only type-checks (`cargo check`) and the suite builds the workspace's
//! dependencies once more instead of compiling and linking them all again.

#[test]
fn ui() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}

#[path = "ui/pass/every_op.rs"]
mod every_op;
#[path = "ui/pass/extent_arithmetic.rs"]
mod extent_arithmetic;
#[path = "ui/pass/generic_dtype.rs"]
mod generic_dtype;
#[path = "ui/pass/hygiene.rs"]
mod hygiene;
#[path = "ui/pass/literal_dims.rs"]
mod literal_dims;
#[path = "ui/pass/tp_layers.rs"]
mod tp_layers;

#[test]
fn every_op_compiles_and_runs() -> fusion::Result<()> {
    every_op::main()
}

#[test]
fn extent_arithmetic_compiles_and_runs() -> fusion::Result<()> {
    extent_arithmetic::main()
}

#[test]
fn generic_dtype_compiles_and_runs() -> fusion::Result<()> {
    generic_dtype::main()
}

#[test]
fn hygiene_compiles_and_runs() -> fusion::Result<()> {
    hygiene::main()
}

#[test]
fn literal_dims_compiles_and_runs() -> fusion::Result<()> {
    literal_dims::main()
}

#[test]
fn tp_layers_compiles_and_runs() -> fusion::Result<()> {
    tp_layers::main()
}
