//! Whether a program can be captured as a device graph, and the words for why a call runs
//! eagerly instead ([`EagerReason`]); the arena a captured call's buffers get; whether a
//! call on a stream the caller is capturing can be recorded into that capture, the error
//! that says why not ([`recording_refused`]), and the arena its buffers get
//! ([`MostHandedOut`]).

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};

use fusion_compiler::hir::HostProgram;

use super::receives::peer_copy_receives;
use super::ProgramFacts;
use crate::device::{capture_arena_bytes, BackendKind, HandedOut};
use crate::error::Error;

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

/// Why a call that would otherwise run eagerly for `reason` cannot be recorded into a
/// graph the caller is capturing on its stream, and what to do instead; `None` where
/// `reason` does not keep a call out of the caller's capture (a call at new addresses is
/// recorded like any other: the recording is captured for them).
pub(crate) fn recording_refusal(reason: &EagerReason) -> Option<String> {
    let why = match reason {
        EagerReason::Moved => return None,
        EagerReason::FirstCall => "this program has not run on this rank yet: its first \
            call compiles kernels, builds GEMM plans and makes library handles, none of which \
            may happen in a capture; call it once outside the capture with the same shapes \
            (a warm-up step), then capture"
            .to_string(),
        EagerReason::Disabled => "graphs are off (ExecOptions::graphs); turn them on to \
            record calls into your capture"
            .to_string(),
        EagerReason::Traced => "traced calls read their device timings on the host after \
            the call; capture without ExecOptions::trace, trace_dir or FUSION_TRACE"
            .to_string(),
        EagerReason::RaceChecked => "race-checked calls follow the host program as it runs; \
            capture without ExecOptions::race_check"
            .to_string(),
        EagerReason::HostInput(t) => format!(
            "input {t} is on the host (its upload waits for the device); pass tensors on the \
             rank's device"
        ),
        EagerReason::PeerCopies(why) => format!(
            "its copy-engine transfers cannot be captured: {why}; lower it with \
             ExecOptions::lower.transports.p2p = Transport::Nccl to record it, or call it \
             outside the capture"
        ),
        EagerReason::AliasedOutputs | EagerReason::Backend(_) | EagerReason::CaptureFailed(_) => {
            format!("{reason}; call it outside the capture")
        }
    };
    Some(why)
}

/// The error of a call on rank `rank` whose stream the caller is capturing, when the call
/// cannot be recorded into that capture for `reason` (see [`recording_refusal`]).
pub(crate) fn recording_refused(rank: usize, reason: &EagerReason) -> Option<Error> {
    let why = recording_refusal(reason)?;
    Some(Error::Backend {
        backend: "cuda",
        reason: format!(
            "rank {rank}: the stream given to Rank::on is being captured into a CUDA graph of \
             yours, and this call cannot be recorded into it: {why}"
        ),
    })
}

/// The most buffers, and bytes, the device handed out in one eager call of a program, on
/// any rank ([`HandedOut`]): every buffer a recording of the program takes from its arena.
///
/// A recording may hold no allocation of its own, so its arena must hold everything the
/// walk allocates: the evaluator's buffers and the backend's own (a GEMM's f32 product
/// before an epilogue it cannot fuse, copies of operands it cannot read in place, a
/// transport's staging and receive buffers), on every stream. The device counts them where
/// it hands them out, which is where a recording takes them from the arena. A walk
/// allocates the same buffers at every call with the same inputs' layouts (a recording
/// writes into outputs allocated before it, which only takes fewer), so the most of the
/// eager calls holds a recording whose inputs are laid out as in one of them.
#[derive(Debug, Default)]
pub(crate) struct MostHandedOut {
    buffers: AtomicUsize,
    bytes: AtomicUsize,
}

impl MostHandedOut {
    /// Notes what one eager call had its device hand out.
    fn note(&self, call: HandedOut) {
        self.buffers.fetch_max(call.buffers, Ordering::Relaxed);
        self.bytes.fetch_max(call.bytes, Ordering::Relaxed);
    }

    /// The arena that holds every buffer of any call noted, each aligned; 0 when none
    /// allocated anything.
    fn arena_bytes(&self) -> usize {
        match self.buffers.load(Ordering::Relaxed) {
            0 => 0,
            buffers => capture_arena_bytes(self.bytes.load(Ordering::Relaxed), buffers),
        }
    }
}

impl ProgramFacts {
    /// Notes what an eager call had its device hand out ([`MostHandedOut`]).
    pub(crate) fn note_handed_out(&self, call: HandedOut) {
        self.handed_out.note(call);
    }

    /// The arena of a call recorded into a graph the caller is capturing: room for every
    /// buffer the device handed out in an eager call of the program, however large (see
    /// [`MostHandedOut`]); 0 when none allocated anything.
    pub(crate) fn recording_arena_bytes(&self) -> usize {
        self.handed_out.arena_bytes()
    }
}

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

    #[test]
    fn a_recordings_arena_holds_the_most_any_eager_call_had_handed_out() {
        let most = MostHandedOut::default();
        assert_eq!(most.arena_bytes(), 0, "nothing allocated: no arena");
        let call = |buffers, bytes| HandedOut { buffers, bytes };
        // The first call allocates receive buffers that later calls reuse; a later call
        // at other layouts stages more. The arena holds either.
        most.note(call(5, 13312));
        most.note(call(7, 9000));
        most.note(call(2, 1024));
        assert_eq!(most.arena_bytes(), capture_arena_bytes(13312, 7));
        assert!(most.arena_bytes() >= capture_arena_bytes(13312, 5));
        assert!(most.arena_bytes() >= capture_arena_bytes(9000, 7));
    }

    #[test]
    fn a_call_at_new_addresses_is_recorded_into_the_callers_capture() {
        assert_eq!(recording_refusal(&EagerReason::Moved), None);
        assert!(recording_refused(0, &EagerReason::Moved).is_none());
    }

    #[test]
    fn every_other_reason_refuses_a_recording_saying_what_to_do() {
        let cases = [
            (
                EagerReason::FirstCall,
                "once outside the capture with the same shapes",
            ),
            (EagerReason::Disabled, "ExecOptions::graphs"),
            (EagerReason::Traced, "without ExecOptions::trace"),
            (EagerReason::RaceChecked, "without ExecOptions::race_check"),
            (EagerReason::HostInput("x".into()), "input x is on the host"),
            (
                EagerReason::AliasedOutputs,
                "outputs are written into inputs",
            ),
            (
                EagerReason::PeerCopies("they land in T2".into()),
                "transports.p2p = Transport::Nccl",
            ),
            (
                EagerReason::CaptureFailed("out of memory".into()),
                "capturing failed: out of memory",
            ),
            (EagerReason::Backend(BackendKind::Cpu), "cpu backend"),
        ];
        for (reason, what) in cases {
            let text = recording_refused(3, &reason)
                .unwrap_or_else(|| panic!("{reason:?} refuses"))
                .to_string();
            assert!(text.contains(what), "{reason:?}: {text}");
            assert!(
                text.starts_with(
                    "cuda backend: rank 3: the stream given to Rank::on is being \
                                  captured into a CUDA graph of yours"
                ),
                "{text}"
            );
        }
        let text = recording_refusal(&EagerReason::PeerCopies("over CUDA IPC".into())).unwrap();
        assert!(text.contains("over CUDA IPC") && text.contains("outside the capture"));
    }
}
