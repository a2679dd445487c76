//! Device memory: what buffers of a device share with it (`device_shared`), buffers from
//! the stream-ordered allocator, the free list in front of it, the arenas captured calls
//! allocate from and the count that sizes a recorded call's (`handed_out`), memory that
//! GPUs of other processes map, and pinned host words devices map (`mapped_host`).

pub(crate) mod buffer;
pub(crate) mod capture_arena;
pub(crate) mod device_shared;
pub(crate) mod free_list;
pub(crate) mod handed_out;
pub(crate) mod mapped_host;
pub(crate) mod shared_arena;
