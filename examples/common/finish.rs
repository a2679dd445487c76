//! The end of a lesson's (or measuring tool's) `main`: an error is printed as its message
//! (which says what to fix, e.g. which library to put on `LD_LIBRARY_PATH`), not in its
//! `Debug` form.

use std::process::ExitCode;

/// The exit status for `result`, printing an error's message to stderr.
pub fn finish(result: fusion::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
