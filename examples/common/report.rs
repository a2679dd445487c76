//! What a lesson prints: what it ran, where, the check against the host reference (the
//! line scripts look for ends in `ok` or `FAILED`), the time per call and the lowerings.

use super::reference::REFERENCE_LIMIT;
use super::run::{Run, Timed};

/// A lesson's result, printed by [`Report::print`] under the example's name.
pub struct Report {
    /// What the fusion is, in a few words.
    pub what: &'static str,
    /// The shapes of the inputs and the output, and how they are sharded.
    pub shapes: String,
    /// Worst relative error over the checked ranks, or `None` when the check was skipped.
    pub error: Option<f64>,
    pub timed: Timed,
    /// Floating-point operations per call per device, for a throughput figure.
    pub flops_per_device: Option<f64>,
    /// How many times the fusion was lowered (once per shape and options).
    pub lowerings: usize,
}

/// The check line: the relative error against the f64 host reference and the verdict.
pub fn check_line(error: f64, tolerance: f64, ok: bool) -> String {
    format!(
        "  check: relative error {error:.2e} against an f64 host reference (tolerance \
         {tolerance:.0e}): {}",
        if ok { "ok" } else { "FAILED" }
    )
}

impl Report {
    /// Prints the summary of `run` and returns whether the result is within tolerance
    /// (or the check was skipped).
    pub fn print(&self, run: &Run) -> bool {
        let (c, world) = (&run.common, &run.world);
        println!("{}: {}", env!("CARGO_BIN_NAME"), self.what);
        println!(
            "  backend {}, {} devices, dtype {}, {} streams",
            world.backend().name(),
            world.size(),
            c.dtype.dtype(),
            c.streams
        );
        if let Some(spec) = world.launch_spec() {
            println!(
                "  launched by {}: {} processes; this one holds rank(s) {:?} and checks every \
                 rank's output",
                spec.launcher.name(),
                spec.processes,
                world.local_ranks()
            );
        }
        println!("  {}", self.shapes);
        let tol = c.dtype.tolerance();
        let ok = match self.error {
            Some(e) => {
                let ok = e <= tol;
                println!("{}", check_line(e, tol, ok));
                ok
            }
            None => {
                println!(
                    "  check: skipped, the problem is above the host reference's limit of \
                     {REFERENCE_LIMIT:.0e} multiply-adds"
                );
                true
            }
        };
        let ms = self.timed.median.as_secs_f64() * 1e3;
        let rate = self
            .flops_per_device
            .filter(|_| ms > 0.0)
            .map(|f| format!(", {:.2} GFLOP/s per device", f / (ms * 1e6)))
            .unwrap_or_default();
        println!(
            "  time: median {ms:.3} ms per call over {} calls after a warm-up{rate}",
            self.timed.iters
        );
        println!("  lowerings: {}", self.lowerings);
        ok
    }
}

/// Ends the process with status 1 when the check failed.
pub fn exit_on_failure(ok: bool) {
    if !ok {
        eprintln!("the result does not match the reference");
        std::process::exit(1);
    }
}
