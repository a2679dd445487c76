//! Host-IR passes and the manager that runs them.
//!
//! Each pass rewrites a [`HostProgram`] in place. Whether a pass runs is decided by the
//! [`PassContext`] handed to the manager (no global flags), so two fusions lowered at the
//! same time can use different settings. With dumping on, the program is recorded after
//! every pass.

mod context;
mod convert_to_communication;
mod fuse_elementwise;
mod fuse_epilogue;
mod insert_deallocations;
mod stream_parallel_type;

use std::collections::BTreeSet;

pub use context::{Pass, PassContext};
pub use convert_to_communication::ConvertOpToCommunication;
pub use fuse_elementwise::FuseElementwise;
pub use fuse_epilogue::FuseEpilogue;
pub use insert_deallocations::InsertDeallocations;
pub use stream_parallel_type::StreamParallelType;

use crate::error::{Error, Result};
use crate::hir::HostProgram;

/// The program as printed after one pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassDump {
    pub pass: &'static str,
    pub program: String,
}

/// Runs passes in order, skipping disabled ones and recording dumps.
pub struct PassManager {
    passes: Vec<Box<dyn Pass>>,
}

impl PassManager {
    /// A manager running `passes` in order.
    pub fn new(passes: Vec<Box<dyn Pass>>) -> Self {
        PassManager { passes }
    }

    /// The standard pipeline: `StreamParallelType`, `ConvertOpToCommunication`,
    /// `FuseEpilogue`, `FuseElementwise`, `InsertDeallocations`.
    pub fn standard() -> Self {
        PassManager::new(vec![
            Box::new(StreamParallelType),
            Box::new(ConvertOpToCommunication),
            Box::new(FuseEpilogue),
            Box::new(FuseElementwise),
            Box::new(InsertDeallocations),
        ])
    }

    /// Names of the passes, in order.
    pub fn names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Fails on a name no pass has (a typo would otherwise disable nothing silently).
    pub fn check_names(&self, names: &BTreeSet<String>) -> Result<()> {
        let known = self.names();
        for n in names {
            if !known.contains(&n.as_str()) {
                let hint = crate::suggest::suggest(n, known.iter().copied())
                    .map_or_else(String::new, |s| format!("; did you mean `{s}`?"));
                return Err(Error::UnknownPass(n.clone(), known.join(", "), hint));
            }
        }
        Ok(())
    }

    /// Runs every enabled pass; returns the dumps recorded after each one that ran.
    pub fn run(&self, program: &mut HostProgram, ctx: &PassContext) -> Result<Vec<PassDump>> {
        let mut dumps = Vec::new();
        for pass in &self.passes {
            if !ctx.is_enabled(pass.name()) {
                tracing::debug!(pass = pass.name(), "pass disabled");
                continue;
            }
            pass.run(program, ctx)?;
            tracing::debug!(
                pass = pass.name(),
                nodes = program.node_count(),
                "pass done"
            );
            if ctx.options.passes.dump_each {
                dumps.push(PassDump {
                    pass: pass.name(),
                    program: program.to_string(),
                });
            }
        }
        Ok(dumps)
    }
}
