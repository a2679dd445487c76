//! Device memory: buffers from the stream-ordered allocator, the free list in front of it,
//! the arenas captured calls allocate from, memory that GPUs of other processes map, and
//! buffers the caller allocated.

pub(crate) mod buffer;
pub(crate) mod capture_arena;
pub(crate) mod free_list;
pub(crate) mod shared_arena;
pub(crate) mod user_buffers;
