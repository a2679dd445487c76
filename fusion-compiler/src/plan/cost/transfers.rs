//! What the model charges for moving data, at the receiver: receives from several peers
//! at once or one after another, and collectives.
//!
//! With a copy stream per peer ([`CopyStreams::PerPeer`], the default) the receives of
//! one group from different peers run on their own copy streams and links at once: the
//! group takes its largest receive at the link rate, or all its bytes at the device's
//! inbound rate where that is slower. On one copy stream ([`CopyStreams::One`]) they run
//! one after another. A group of one receive (a pipeline step) waits for the rank's
//! previous single receive to land (the runtime keeps them in program order, so that
//! chunks arrive in the order the GEMMs use them), so such receives add up whatever the
//! copy streams. Copy-engine collectives are groups of one receive per peer; NCCL and
//! peer-memory collectives are charged at the collective rate.

use super::{MachineProfile, Model};
use crate::hir::{Communication, CommunicationKind, CopyStreams, Transport};

/// Seconds to receive `bytes` (one entry per peer) at once (`at_once`) or one after
/// another, with `profile`'s rates.
pub(super) fn receives(profile: &MachineProfile, bytes: &[f64], at_once: bool) -> f64 {
    if bytes.is_empty() {
        return 0.0;
    }
    let total: f64 = bytes.iter().sum();
    if !at_once || bytes.len() == 1 {
        return bytes.len() as f64 * profile.latency + total / profile.link_bytes;
    }
    let largest = bytes.iter().copied().fold(0.0, f64::max) / profile.link_bytes;
    let shared = profile.inbound_bytes.map_or(0.0, |rate| total / rate);
    profile.latency + largest.max(shared)
}

impl Model<'_> {
    /// Whether copies from several peers run at once in this program.
    fn copies_at_once(&self) -> bool {
        self.program.copy_streams == CopyStreams::PerPeer
    }

    /// Seconds for a coalesced group's receives (`(bytes, transport)` each).
    pub(super) fn receive_group(&self, group: &[(f64, Transport)]) -> f64 {
        let bytes: Vec<f64> = group.iter().map(|r| r.0).collect();
        let at_once = group.len() > 1
            && group.iter().all(|r| match r.1 {
                Transport::CopyEngine => self.copies_at_once(),
                Transport::Nccl | Transport::PeerMemory => true,
            });
        receives(self.profile, &bytes, at_once)
    }

    /// Seconds for the collective `c`.
    pub(super) fn collective(&self, c: &Communication) -> f64 {
        let p = self.profile;
        let d = c.team.len().max(1) as f64;
        let bytes = self.bytes(c.input).max(self.bytes(c.output));
        // Copy-engine Allgather and ReduceScatter: a chunk from every peer (an Allreduce
        // is both).
        let phases = match c.kind {
            CommunicationKind::Allgather | CommunicationKind::ReduceScatter => 1.0,
            CommunicationKind::Allreduce => 2.0,
            _ => 0.0,
        };
        if c.transport == Transport::CopyEngine && phases > 0.0 && d > 1.0 {
            let chunks = vec![bytes / d; c.team.len() - 1];
            return phases * receives(p, &chunks, self.copies_at_once());
        }
        let wire = match c.kind {
            CommunicationKind::Allreduce => 2.0 * bytes * (d - 1.0) / d,
            CommunicationKind::Allgather | CommunicationKind::ReduceScatter => {
                bytes * (d - 1.0) / d
            }
            _ => bytes,
        };
        p.latency + wire / p.collective_bytes
    }
}
