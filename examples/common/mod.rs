//! What every lesson shares, so that a lesson is its fusion, its inputs, how it calls the
//! fusion and its host reference: the command line (the lesson's dimensions, then
//! `--devices --dtype --streams --iters --dump --pipelining`), the world, the timed calls
//! on every rank, the check against an f64 host reference, the printed summary and the
//! exit status. Included by each lesson with `#[path = "common/mod.rs"] mod common;`
//! (`cuda_buffers`, with a command line of its own, uses its `--dtype` values, check line
//! and exit); the measuring tools in `bench/` include `finish.rs` and `dtype.rs`.
#![allow(dead_code, unused_imports)] // each lesson uses a part

mod cli;
mod dtype;
pub mod finish;
mod reference;
mod report;
mod run;

use std::process::ExitCode;

use clap::Args;

pub use dtype::Dt;
pub use reference::{checked, matmul_ref, rel_error, to_f64, worst_error};
pub use report::{check_line, exit_on_failure, Report};
pub use run::Run;

/// A lesson's `main`: parses the lesson's dimensions `D` (its `--help` text is `D`'s doc
/// comment) and the common flags, makes the world, runs `lesson`, prints its [`Report`]
/// and ends with status 1 when the check failed; an error is printed as its message.
pub fn main<D: Args>(lesson: impl FnOnce(&D, &Run) -> fusion::Result<Report>) -> ExitCode {
    finish::finish(run_lesson(lesson))
}

fn run_lesson<D: Args>(
    lesson: impl FnOnce(&D, &Run) -> fusion::Result<Report>,
) -> fusion::Result<()> {
    let cli = cli::Cli::<D>::parse_lesson();
    let run = Run::new(cli.common)?;
    let report = lesson(&cli.dims, &run)?;
    exit_on_failure(report.print(&run));
    Ok(())
}
