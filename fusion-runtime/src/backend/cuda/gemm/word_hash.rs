//! A word-at-a-time hasher for the small keys looked up at every GEMM launch (plans and
//! one-GEMM graphs: shapes, dtypes and device pointers). The standard SipHash spends
//! about a nanosecond per byte on them, which is a measurable share of a launch's host
//! time; these keys come from the program, not from an adversary, so a multiply-rotate
//! hash is enough.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A hash map keyed through [`WordHasher`].
pub(crate) type WordMap<K, V> = HashMap<K, V, BuildHasherDefault<WordHasher>>;

/// Folds each 64-bit word into the state with a rotate, a xor and a multiply by an odd
/// constant with well-mixed bits.
#[derive(Clone, Copy, Default)]
pub(crate) struct WordHasher {
    state: u64,
}

const MIX: u64 = 0x9e37_79b9_7f4a_7c15;

impl WordHasher {
    fn fold(&mut self, word: u64) {
        self.state = (self.state.rotate_left(23) ^ word).wrapping_mul(MIX);
    }
}

impl Hasher for WordHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.fold(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.fold(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.fold(u64::from(i));
    }
    fn write_u16(&mut self, i: u16) {
        self.fold(u64::from(i));
    }
    fn write_u32(&mut self, i: u32) {
        self.fold(u64::from(i));
    }
    fn write_u64(&mut self, i: u64) {
        self.fold(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.fold(i as u64);
    }
    fn write_i64(&mut self, i: i64) {
        self.fold(i as u64);
    }
    fn finish(&self) -> u64 {
        // A last mix so that the low bits (the bucket index) depend on every word.
        let x = self.state ^ (self.state >> 29);
        x.wrapping_mul(MIX) ^ (x >> 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn hash<T: Hash>(t: &T) -> u64 {
        BuildHasherDefault::<WordHasher>::default().hash_one(t)
    }

    #[test]
    fn keys_that_differ_in_one_field_hash_apart_and_maps_find_them() {
        // Pointer-like keys 256 bytes apart (aligned allocations) and small integers.
        let mut seen = std::collections::HashSet::new();
        for p in 0..4096u64 {
            assert!(seen.insert(hash(&(0x7f00_0000_0000u64 + p * 256, 3usize))));
        }
        for i in 0..4096u64 {
            assert!(seen.insert(hash(&(i, true))));
        }
        // The low bits spread: 4096 aligned pointers fill most of 1024 buckets.
        let buckets: std::collections::HashSet<u64> = (0..4096u64)
            .map(|p| hash(&(0x7f00_0000_0000u64 + p * 256)) & 1023)
            .collect();
        assert!(buckets.len() > 900, "{} of 1024 buckets", buckets.len());
        let mut m: WordMap<(u64, [u8; 3]), usize> = WordMap::default();
        for i in 0..1000 {
            m.insert((i * 4096, [1, 2, (i % 7) as u8]), i as usize);
        }
        for i in 0..1000 {
            assert_eq!(
                m.get(&(i * 4096, [1, 2, (i % 7) as u8])),
                Some(&(i as usize))
            );
        }
        // Byte strings of different lengths whose padded words agree hash apart.
        let bytes = |b: &[u8]| {
            let mut h = WordHasher::default();
            h.write(b);
            h.finish()
        };
        assert_ne!(bytes(&[1, 0]), bytes(&[1]));
    }
}
