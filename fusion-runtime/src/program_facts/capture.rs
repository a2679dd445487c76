//! Whether a program can be captured as a device graph, and the words for why a call runs
//! eagerly instead ([`EagerReason`]); the arena a captured call's buffers get.

use std::fmt;

use fusion_compiler::hir::HostProgram;

use super::receives::peer_copy_receives;
use crate::device::BackendKind;

/// Why a call ran eagerly rather than from a graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EagerReason {
    /// `ExecOptions::graphs` is off.
    Disabled,
    /// The backend has no graphs (the CPU backend).
    Backend(BackendKind),
    /// The call is traced (its device markers are read after the call).
    Traced,
    /// The call is race-checked (the checker follows the host program as it runs).
    RaceChecked,
    /// The first call of a program runs eagerly: it compiles kernels and creates the
    /// library handles the capture must not create.
    FirstCall,
    /// An input lives on the host: its upload waits for the device.
    HostInput(String),
    /// Outputs alias inputs (written in place): the graph cannot own them.
    AliasedOutputs,
    /// Peer copies (copy-engine transfers) cannot be recorded, for this reason (they land
    /// in memory the caller owns, or the communicator hands them off on the host).
    PeerCopies(String),
    /// The inputs or outputs are not where the graph was captured; a new graph is captured
    /// if the same addresses come again.
    Moved,
    /// Capturing failed (the graph is not used for this program and rank again).
    CaptureFailed(String),
}

impl fmt::Display for EagerReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EagerReason::Disabled => {
                write!(f, "graphs are off (ExecOptions::graphs)")
            }
            EagerReason::Backend(k) => write!(f, "the {} backend has no graphs", k.name()),
            EagerReason::Traced => write!(f, "traced calls run eagerly"),
            EagerReason::RaceChecked => write!(f, "race-checked calls run eagerly"),
            EagerReason::FirstCall => {
                write!(
                    f,
                    "the first call runs eagerly (it compiles kernels and makes handles)"
                )
            }
            EagerReason::HostInput(t) => {
                write!(
                    f,
                    "input {t} is on the host (its upload waits for the device)"
                )
            }
            EagerReason::AliasedOutputs => write!(f, "outputs are written into inputs"),
            EagerReason::PeerCopies(why) => write!(
                f,
                "copy-engine transfers cannot be captured: {why} (lower with \
                 LowerOptions::transports.p2p = Nccl to replay this program)"
            ),
            EagerReason::Moved => write!(f, "the inputs or outputs moved since the capture"),
            EagerReason::CaptureFailed(e) => write!(f, "capturing failed: {e}"),
        }
    }
}

/// Whether `program` could ever be captured on `backend` (what the communicator of a
/// rank allows is asked at run time, see [`crate::comm::Capabilities::capture`]).
pub fn capture_plan(
    program: &HostProgram,
    backend: BackendKind,
) -> std::result::Result<(), EagerReason> {
    if !backend.records_graphs() {
        return Err(EagerReason::Backend(backend));
    }
    if !program.aliases.is_empty() {
        return Err(EagerReason::AliasedOutputs);
    }
    if program.world_size > 1 {
        let receives = peer_copy_receives(program);
        if !receives.all_internal() {
            let names: Vec<String> = receives
                .external
                .iter()
                .map(|&t| program.ir.tensor_name(t))
                .collect();
            return Err(EagerReason::PeerCopies(format!(
                "they land in {}, which the caller owns and may move between calls",
                names.join(", ")
            )));
        }
    }
    Ok(())
}

/// Calls that allocate at most this many bytes (on any rank, in an eager call) are
/// captured with their buffers in an arena owned by the graph, instead of allocation
/// nodes in it: such nodes add a few microseconds to every launch, which matters for small
/// calls; the arena holds the sum of a call's buffers rather than their peak.
pub const CAPTURE_ARENA_LIMIT: usize = 64 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_say_what_to_do() {
        let text = EagerReason::PeerCopies("they land in T2".into()).to_string();
        assert!(text.contains("transports.p2p = Nccl"), "{text}");
        assert!(text.contains("land in T2"), "{text}");
        assert!(EagerReason::HostInput("a".into())
            .to_string()
            .contains("input a"));
        assert!(EagerReason::Backend(BackendKind::Cpu)
            .to_string()
            .contains("cpu backend"));
    }
}
