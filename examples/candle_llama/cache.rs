//! One rank's KV cache, allocated once for every position a run reaches, and what a step
//! needs to use it without the host: the rotary tables of every position and the key
//! indices for the causal mask.
//!
//! A step gets its tokens' positions as a device tensor (`u32`, one per token): the
//! rotary cosines and sines are rows of the tables picked by those positions, the new keys
//! and values are scattered into the cache at those rows, and the mask compares each
//! cached key's index with each query's position. Nothing in a step depends on the host's
//! idea of the position, so the same recorded step (a CUDA graph) serves every decode
//! position once its positions tensor is rewritten; only the number of cached keys a step
//! reads is fixed by its shapes (the filled part when run eagerly, the whole cache when
//! recorded). Keys past a query's position are masked to -inf, so whatever the cache holds
//! there (zeros at first, a previous request's values later) weighs nothing.

use candle_core::{DType as CDType, Device, Tensor as CTensor};

use crate::ops::{attention, rope_angles, rotate};

/// A rank's KV cache of `capacity` positions and its position tables.
pub struct KvCache {
    /// `[capacity, kv_heads * head_dim]` in the layer's dtype.
    k: CTensor,
    v: CTensor,
    kv_heads: usize,
    head_dim: usize,
    /// `[capacity, head_dim / 2]`, f32.
    cos: CTensor,
    sin: CTensor,
    /// `0..capacity`, `u32`: each cached key's position.
    keys: CTensor,
    /// f32 scalars of the mask.
    zero: CTensor,
    neg_inf: CTensor,
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
        let width = kv_heads * head_dim;
        let angles = rope_angles(0..capacity, head_dim, theta);
        let angles = CTensor::from_vec(angles, (capacity, head_dim / 2), device)?;
        Ok(KvCache {
            k: CTensor::zeros((capacity, width), dtype, device)?,
            v: CTensor::zeros((capacity, width), dtype, device)?,
            kv_heads,
            head_dim,
            cos: angles.cos()?,
            sin: angles.sin()?,
            keys: CTensor::arange(0u32, capacity as u32, device)?,
            zero: CTensor::new(0f32, device)?,
            neg_inf: CTensor::new(f32::NEG_INFINITY, device)?,
        })
    }

    /// How many positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.keys.dims1().unwrap_or(0)
    }

    /// `x` `[tokens, heads, head_dim]` rotated for the tokens at `positions` (`[tokens]`).
    pub fn rope(&self, x: &CTensor, positions: &CTensor) -> candle_core::Result<CTensor> {
        let t = positions.dim(0)?;
        let half = self.head_dim / 2;
        let pick = |table: &CTensor| table.index_select(positions, 0)?.reshape((t, 1, half));
        rotate(x, &pick(&self.cos)?, &pick(&self.sin)?)
    }

    /// Writes keys and values `[tokens, kv_heads, head_dim]` into the rows `positions`.
    pub fn write(&self, k: &CTensor, v: &CTensor, positions: &CTensor) -> candle_core::Result<()> {
        let t = positions.dim(0)?;
        let width = self.kv_heads * self.head_dim;
        let rows = positions
            .reshape((t, 1))?
            .broadcast_as((t, width))?
            .contiguous()?;
        let flat = |x: &CTensor| x.reshape((t, width))?.contiguous();
        self.k.scatter_set(&rows, &flat(k)?, 0)?;
        self.v.scatter_set(&rows, &flat(v)?, 0)
    }

    /// Causal attention of `q` `[tokens, heads, head_dim]` at `positions` over the first
    /// `keys` cached positions (which must hold the keys and values of every position up
    /// to the last query's). Returns `[tokens, heads * head_dim]`.
    pub fn attend(
        &self,
        q: &CTensor,
        positions: &CTensor,
        keys: usize,
    ) -> candle_core::Result<CTensor> {
        let t = positions.dim(0)?;
        let cached = |c: &CTensor| {
            c.narrow(0, 0, keys)?
                .reshape((keys, self.kv_heads, self.head_dim))
        };
        let seen = self
            .keys
            .narrow(0, 0, keys)?
            .reshape((1, keys))?
            .broadcast_as((t, keys))?
            .le(&positions.reshape((t, 1))?.broadcast_as((t, keys))?)?;
        let mask = seen.where_cond(
            &self.zero.broadcast_as((t, keys))?,
            &self.neg_inf.broadcast_as((t, keys))?,
        )?;
        attention(q, &cached(&self.k)?, &cached(&self.v)?, &mask)
    }
}

/// The positions `start..start + tokens` as a `u32` tensor on `device`.
pub fn positions(start: usize, tokens: usize, device: &Device) -> candle_core::Result<CTensor> {
    let p: Vec<u32> = (start..start + tokens).map(|p| p as u32).collect();
    CTensor::from_vec(p, tokens, device)
}
