//! Runtime tensors: a dtype, a shape, strides and an offset over shared storage.
//!
//! Views (select, narrow, split, expand, permute) share storage with their base, which is
//! how the host program aliases buffers without copies. Host storage sits behind a mutex,
//! so a view can be written from the thread of the rank that owns it while others read
//! (the in-process communicator copies between ranks' buffers). Device storage is a handle
//! owned by a backend.
//!
//! `layout` holds the [`Tensor`] itself (dtype, shape, strides, offset, storage) and what
//! it says of itself; `storage` where the elements live; `views` the views; `host` the
//! host data and element conversions.

mod host;
mod layout;
mod storage;
mod views;

pub use host::{read_elem, round_to, write_elem};
pub use layout::{contiguous_strides, for_each_offset, ShardTag, Tensor};
#[cfg(test)]
pub(crate) use storage::AddressOnly;
pub use storage::{DeviceBuffer, HostBuffer, HostElement, HostMemory, Storage};
