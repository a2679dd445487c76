//! Counts of what the runtime creates and moves, for tests and reports: threads it
//! spawns, communicators it makes, tensors it copies from a device to the host, GEMMs it
//! enqueues on its own persistent kernel. A rank handle's calls create neither threads nor
//! communicators after the first call (the first may make a team's NCCL communicator),
//! which tests check with these counts.

use std::sync::atomic::{AtomicU64, Ordering};

static THREADS: AtomicU64 = AtomicU64::new(0);
static COMMUNICATORS: AtomicU64 = AtomicU64::new(0);
static DEVICE_TO_HOST: AtomicU64 = AtomicU64::new(0);
static TRANSFER_EVENTS: AtomicU64 = AtomicU64::new(0);
static PERSISTENT_GEMMS: AtomicU64 = AtomicU64::new(0);

/// What this process's runtime has created so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuntimeCounters {
    /// Threads the runtime spawned: `World::run`'s rank threads, setup threads, the
    /// rendezvous' connection threads and watchdogs.
    pub threads_spawned: u64,
    /// Communicators it made: host endpoints, rank communicators (in-process and NCCL
    /// ones) and NCCL communicators of worlds, sub-worlds and teams.
    pub communicators_created: u64,
    /// Copies of tensors from a GPU to the host (`Rank::to_host`, `gather_to_host` of a
    /// device tensor): activations that make a host round trip.
    pub device_to_host_copies: u64,
    /// GEMMs enqueued on the persistent Hopper kernel (`GemmEngine::Persistent` where it
    /// applies; a GEMM recorded into a graph counts once, when recorded, not per replay).
    pub persistent_gemms: u64,
}

/// The counts so far (they only grow).
pub fn counters() -> RuntimeCounters {
    RuntimeCounters {
        threads_spawned: THREADS.load(Ordering::Relaxed),
        communicators_created: COMMUNICATORS.load(Ordering::Relaxed),
        device_to_host_copies: DEVICE_TO_HOST.load(Ordering::Relaxed),
        persistent_gemms: PERSISTENT_GEMMS.load(Ordering::Relaxed),
    }
}

/// Counts a thread about to be spawned.
pub(crate) fn thread_spawned() {
    THREADS.fetch_add(1, Ordering::Relaxed);
}

/// Counts `n` communicators made.
pub(crate) fn communicators_created(n: u64) {
    COMMUNICATORS.fetch_add(n, Ordering::Relaxed);
}

/// Counts a copy of a tensor from a device to the host.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn device_to_host_copy() {
    DEVICE_TO_HOST.fetch_add(1, Ordering::Relaxed);
}

/// Counts a GEMM enqueued on the persistent Hopper kernel.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn persistent_gemm() {
    PERSISTENT_GEMMS.fetch_add(1, Ordering::Relaxed);
}

/// A thread builder, counted as a spawned thread (for the runtime's named threads).
pub(crate) fn thread_builder() -> std::thread::Builder {
    thread_spawned();
    std::thread::Builder::new()
}

/// Copy-engine transfer events alive in this process (CUDA worlds; 0 elsewhere): a soak
/// checks that the count stays flat.
pub fn transfer_events_alive() -> usize {
    TRANSFER_EVENTS.load(Ordering::Relaxed) as usize
}

/// Counts a transfer event created (`alive` true) or destroyed.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn transfer_event(alive: bool) {
    if alive {
        TRANSFER_EVENTS.fetch_add(1, Ordering::Relaxed);
    } else {
        TRANSFER_EVENTS.fetch_sub(1, Ordering::Relaxed);
    }
}
