//! One rank's KV cache, allocated once for every position a run reaches, and what a step
//! needs to use it without the host: the rotary table of every position.
//!
//! A step gets its tokens' positions as a device tensor (`u32`, one per token): the
//! rotary cosines and sines are the table's rows at those positions, the new keys and
//! values are written into the cache at those rows (one kernel on CUDA), and attention's
//! softmax lets each query see the keys up to its position. Nothing in a step depends on
//! the host's idea of the position, so the same recorded step (a CUDA graph) serves every
//! decode position once its positions tensor is rewritten; only the number of cached keys
//! a step reads is fixed by its shapes (the filled part, in whole blocks of [`KEY_BLOCK`],
//! when run eagerly; the whole cache when recorded). Keys past a query's position weigh nothing, whatever the cache holds
//! there (zeros at first, a previous request's values later).
//!
//! The cache is `[kv_heads, capacity, head_dim]`: each head's keys (values) are one
//! matrix, which grouped attention (`ops::grouped_attention`) reads in place.

use candle_core::{DType as CDType, Device, Tensor as CTensor};

use crate::kernels::{rope, write_rows};
use crate::ops::{grouped_attention, rope_angles};

/// Cached positions an eager step's attention reads at a time: its GEMMs' shapes then
/// change once every few decode steps, not at every step. cuBLAS chooses a kernel for each
/// new shape on the host, which took 2.1-3.3 ms of a 64-token step at TP 4 when every
/// step read one block of 64 more keys (4x H100); a step reads at most `KEY_BLOCK - 1`
/// positions more than it needs, which the causal softmax weighs 0.
pub const KEY_BLOCK: usize = 256;

/// A rank's KV cache of `capacity` positions and its position tables.
pub struct KvCache {
    /// `[kv_heads, capacity, head_dim]` in the layer's dtype: each head's keys (values)
    /// are one matrix, which attention reads in place.
    k: CTensor,
    v: CTensor,
    /// `[capacity, head_dim]` f32: each position's `head_dim / 2` rotary cosines, then
    /// its sines.
    table: CTensor,
    capacity: usize,
}

impl KvCache {
    /// An empty cache of `capacity` positions for `kv_heads` heads of `head_dim`, in
    /// `dtype` on `device`, with rotary tables for base `theta`.
    pub fn new(
        capacity: usize,
        kv_heads: usize,
        head_dim: usize,
        theta: f64,
        dtype: CDType,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let angles = rope_angles(0..capacity, head_dim, theta);
        let angles = CTensor::from_vec(angles, (capacity, head_dim / 2), device)?;
        let shape = (kv_heads, capacity, head_dim);
        Ok(KvCache {
            k: CTensor::zeros(shape, dtype, device)?,
            v: CTensor::zeros(shape, dtype, device)?,
            table: CTensor::cat(&[angles.cos()?, angles.sin()?], 1)?,
            capacity,
        })
    }

    /// How many positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// `x` `[tokens, heads, head_dim]` (any strides, the last 1) rotated for the tokens at
    /// `positions` (`[tokens]`), contiguous.
    pub fn rope(&self, x: &CTensor, positions: &CTensor) -> candle_core::Result<CTensor> {
        rope(x, positions, &self.table)
    }

    /// Writes keys and values `[tokens, kv_heads, head_dim]` (any strides, the last 1)
    /// into the rows `positions` of every head.
    pub fn write(&self, k: &CTensor, v: &CTensor, positions: &CTensor) -> candle_core::Result<()> {
        write_rows(&self.k, k, positions)?;
        write_rows(&self.v, v, positions)
    }

    /// Causal attention of `q` `[tokens, heads, head_dim]` at `positions` over the first
    /// `keys` cached positions (which must hold the keys and values of every position up
    /// to the last query's), read in whole blocks of [`KEY_BLOCK`] positions (up to the
    /// capacity): the positions past the last query's weigh nothing. Returns `[tokens,
    /// heads * head_dim]`. `mark` is told where each of its parts starts (`--sections`).
    pub fn attend(
        &self,
        q: &CTensor,
        positions: &CTensor,
        keys: usize,
        mark: &mut dyn FnMut(&'static str) -> candle_core::Result<()>,
    ) -> candle_core::Result<CTensor> {
        let keys = keys.next_multiple_of(KEY_BLOCK).min(self.capacity);
        let (k, v) = (self.k.narrow(1, 0, keys)?, self.v.narrow(1, 0, keys)?);
        grouped_attention(q, &k, &v, positions, mark)
    }
}

/// The positions `start..start + tokens` as a `u32` tensor on `device`.
pub fn positions(start: usize, tokens: usize, device: &Device) -> candle_core::Result<CTensor> {
    let p: Vec<u32> = (start..start + tokens).map(|p| p as u32).collect();
    CTensor::from_vec(p, tokens, device)
}
