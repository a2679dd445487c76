//! Running a group of transfers in three phases: every rank first posts the buffers it
//! receives into, then copies into what its peers posted, then waits for the copies into
//! its own buffers. Each transfer takes one of three routes: over CUDA IPC to another
//! process (`comm::ipc`), through device flags (`flag_hand_off`), or through events and
//! the registry's rendezvous (`event_hand_off`).
//!
//! The receiver *posts* its buffer (device address + a point after which it is ready),
//! the sender *performs* the copy (writes over NVLink: push) on a copy stream per peer
//! after waiting for that point, then says it is *done*, which the receiver's stream waits
//! for before it uses the buffer. Pushing was measured 1.6-1.8x faster than pulling for
//! reduce-scatter pipelines (`docs/DECISIONS.md`, "Push, not pull").

use std::sync::{Arc, PoisonError};

use super::engine::CopyEngine;
use super::registry::{Slot, Transfer};
use crate::backend::cuda::comm::ipc::{IpcDevice, IpcPeer, IpcState};
use crate::backend::cuda::comm::signals::{Flag, SLOTS};
use crate::error::Result;
use fusion_compiler::hir::CopyStreams;

/// A group of transfers as it runs: each with its route, the call's identity, and whether
/// its one receive lands after the previous group's.
struct GroupRun<'a> {
    group: &'a [Transfer],
    routes: &'a [Route],
    identity: Option<u64>,
    in_order: bool,
}

/// How one transfer hands off.
enum Route {
    /// With a peer of another process, over CUDA IPC.
    Ipc,
    /// Through events and a host rendezvous in the registry.
    Events(Arc<Slot>),
    /// Through device flags (the index of the transfer in the call).
    Flags,
}

impl CopyEngine {
    /// Runs a group of transfers: posts first, then copies, then waits for the copies of
    /// this rank's posted buffers.
    pub(crate) fn run_group(&self, group: &[Transfer]) -> Result<()> {
        // A failed world enqueues nothing more (its flags may no longer be waited for).
        self.registry.health.check(self.rank)?;
        let mut ipc = self
            .ipc
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(PoisonError::into_inner));
        let (identity, copy_streams) = {
            let call = self.call.lock().unwrap_or_else(PoisonError::into_inner);
            (call.identity, call.copy_streams)
        };
        let routes = self.routes(group, ipc.as_deref())?;
        let run = GroupRun {
            group,
            routes: &routes,
            identity,
            // One receive (a P2P pipeline's step): it waits for the previous one to land,
            // unless the senders order the copies (`CopyStreams::OneInSendOrder`).
            in_order: copy_streams != CopyStreams::OneInSendOrder
                && group.iter().filter(|t| !t.sending).count() == 1,
        };
        self.post_group(&run, ipc.as_deref_mut())?;
        self.copy_group(&run, ipc.as_deref_mut())?;
        self.finish_group(&run, ipc.as_deref_mut())
    }

    /// How each transfer of `group` hands off (over IPC, through device flags, or through
    /// events and the registry); device flags are numbered and labelled for the watchdog.
    fn routes(&self, group: &[Transfer], ipc: Option<&IpcState>) -> Result<Vec<Route>> {
        let routes: Vec<Route> = group
            .iter()
            .map(|t| {
                let over_ipc = match (ipc, self.ipc_peer_of(t)) {
                    (Some(s), Some(g)) => s.peers.contains_key(&g),
                    _ => false,
                };
                if over_ipc {
                    Route::Ipc
                } else if self.registry.signals.is_some() {
                    Route::Flags
                } else {
                    Route::Events(self.registry.slot(t.key))
                }
            })
            .collect();
        if let Some(t) = group
            .iter()
            .zip(&routes)
            .find(|(t, r)| matches!(r, Route::Flags) && t.index >= SLOTS)
        {
            return Err(self.err(format!(
                "more than {SLOTS} copy-engine transfers from rank {} to rank {} in one call \
                 (the device flags hold {SLOTS} per pair of ranks and call): split the \
                 program into several calls, or lower it with LowerOptions::transports.p2p = Nccl",
                t.0.key.0, t.0.key.1
            )));
        }
        if let (Some(board), Some(waits)) = (&self.registry.signals, &self.registry.waits) {
            for (t, _) in group
                .iter()
                .zip(&routes)
                .filter(|(_, r)| matches!(r, Route::Flags))
            {
                board.note_used(t.key.0, t.key.1, t.index);
                if let Some(what) = &t.label {
                    waits.label(self.rank, t.key.0, t.key.1, t.index, what.clone());
                }
            }
        }
        Ok(routes)
    }

    /// Whether this rank posts its buffer: the receiver does, and the sender copies
    /// into it (push).
    fn posts(t: &Transfer) -> bool {
        !t.sending
    }

    fn peer_of(&self, t: &Transfer) -> usize {
        if t.key.0 == self.rank {
            t.key.1
        } else {
            t.key.0
        }
    }

    /// The launched-world rank of `t`'s peer, for its IPC state.
    fn ipc_peer_of(&self, t: &Transfer) -> Option<usize> {
        self.ipc_ranks.get(self.peer_of(t)).copied()
    }

    /// The IPC peer of transfer `t` in this rank's IPC state.
    fn ipc_peer<'a>(
        &self,
        state: Option<&'a mut IpcState>,
        t: &Transfer,
    ) -> (&'a mut IpcDevice, &'a mut IpcPeer) {
        let IpcState { device, peers } = state.expect("an IPC transfer has IPC state");
        let peer = self
            .ipc_peer_of(t)
            .and_then(|g| peers.get_mut(&g))
            .expect("an IPC peer");
        (device, peer)
    }

    /// The group's first phase: this rank posts the buffers the other sides copy.
    fn post_group(&self, run: &GroupRun<'_>, mut ipc: Option<&mut IpcState>) -> Result<()> {
        let posted = (run.group.iter().zip(run.routes)).filter(|(t, _)| Self::posts(t));
        for (t, route) in posted {
            let own = self.device.raw_stream(t.stream)?;
            if run.in_order && !t.sending {
                self.after_last_inbound(own)?;
            }
            match route {
                Route::Events(slot) => self.post_with_events(t, slot)?,
                Route::Flags => self.post_with_flags(t, own, run.identity)?,
                Route::Ipc => {
                    let ptr = t.buf.device_ptr().expect("checked");
                    let (device, peer) = self.ipc_peer(ipc.as_deref_mut(), t);
                    peer.post(
                        device,
                        self.device.shared_arena().map(|a| &**a),
                        t.key,
                        ptr,
                        t.buf.nbytes(),
                        own,
                        &self.registry.health,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// The group's second phase: this rank copies what the other sides posted.
    fn copy_group(&self, run: &GroupRun<'_>, mut ipc: Option<&mut IpcState>) -> Result<()> {
        let copied = (run.group.iter().zip(run.routes)).filter(|(t, _)| !Self::posts(t));
        for (t, route) in copied {
            // The copy runs on the peer's copy stream, after the work the iteration's
            // stream has queued so far.
            let own = self.device.raw_stream(t.stream)?;
            let peer = self.peer_of(t);
            match route {
                Route::Ipc => {
                    let raw = self.copy_stream_after(t, peer, own)?;
                    let (device, ipc_peer) = self.ipc_peer(ipc.as_deref_mut(), t);
                    let done = ipc_peer.perform(
                        device,
                        t.key,
                        t.buf.device_ptr().expect("checked"),
                        t.buf.nbytes(),
                        raw,
                        &self.registry.health,
                    )?;
                    self.wait_raw(own, done)?;
                }
                Route::Flags => self.copy_with_flags(t, peer, own, run.identity)?,
                Route::Events(slot) => self.copy_with_events(t, slot, peer, own)?,
            }
        }
        Ok(())
    }

    /// The group's last phase: this rank's streams wait for the copies into (or out of)
    /// the buffers it posted.
    fn finish_group(&self, run: &GroupRun<'_>, mut ipc: Option<&mut IpcState>) -> Result<()> {
        let posted = (run.group.iter().zip(run.routes)).filter(|(t, _)| Self::posts(t));
        for (t, route) in posted {
            let own = self.device.raw_stream(t.stream)?;
            match route {
                Route::Events(slot) => self.finish_with_events(t, slot)?,
                Route::Flags => self.take(own, t, Flag::Done)?,
                Route::Ipc => {
                    let (device, ipc_peer) = self.ipc_peer(ipc.as_deref_mut(), t);
                    ipc_peer.finish(device, t.key, own, &self.registry.health)?;
                }
            }
            if run.in_order && !t.sending {
                self.set_last_inbound(own)?;
            }
        }
        Ok(())
    }
}
