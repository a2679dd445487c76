//! What a pass is ([`Pass`]) and what it may consult ([`PassContext`]): the world size and
//! the lowering options, handed to each pass by the manager (no global flags).

use crate::error::Result;
use crate::hir::HostProgram;
use crate::options::LowerOptions;

/// A host-IR to host-IR transformation.
pub trait Pass: Send + Sync {
    /// Name used to enable/disable the pass and in dumps.
    fn name(&self) -> &'static str;
    /// Rewrites `program`.
    fn run(&self, program: &mut HostProgram, ctx: &PassContext) -> Result<()>;
}

/// What passes may consult: the world size and the lowering options (which passes are
/// disabled, which transports to use).
#[derive(Clone, Debug)]
pub struct PassContext {
    pub world_size: usize,
    pub options: LowerOptions,
}

impl PassContext {
    /// A context for `world_size` devices.
    pub fn new(world_size: usize, options: LowerOptions) -> Self {
        PassContext {
            world_size,
            options,
        }
    }

    /// False when the pass named `name` is disabled.
    pub fn is_enabled(&self, name: &str) -> bool {
        !self.options.passes.disabled.contains(name)
    }
}
