//! Host data of tensors: making host tensors (from f32 values, bytes, vectors, another
//! library's memory, seeded noise), reading and writing their elements as f32, taking the
//! vector back out, and the element conversions of each dtype.

use std::any::Any;
use std::sync::Arc;

use fusion_compiler::DType;
use half::{bf16, f16};

use super::layout::{contiguous_strides, for_each_offset, Tensor};
use super::storage::{HostBuffer, HostElement, HostMemory, Storage};
use crate::error::{Error, Result};

/// Reads element `i` (in elements) of a byte buffer as f32.
pub fn read_elem(bytes: &[u8], i: usize, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes")),
        DType::BF16 => {
            bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
        }
        DType::F16 => f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32(),
    }
}

/// Writes f32 `v` (rounded to `dtype`) as element `i` of a byte buffer.
pub fn write_elem(bytes: &mut [u8], i: usize, dtype: DType, v: f32) {
    match dtype {
        DType::F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
        DType::BF16 => {
            bytes[2 * i..2 * i + 2].copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes())
        }
        DType::F16 => {
            bytes[2 * i..2 * i + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes())
        }
    }
}

/// Rounds an f32 to the nearest value representable in `dtype`.
pub fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F32 => v,
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
    }
}

impl Tensor {
    /// A host tensor from f32 values in row-major order, rounded to `dtype`.
    pub fn from_f32(shape: &[usize], data: &[f32], dtype: DType) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if data.len() != numel {
            return Err(Error::Tensor(format!(
                "from_f32: shape {shape:?} holds {numel} elements but {} were given",
                data.len()
            )));
        }
        let memory = match dtype {
            DType::F32 => HostMemory::F32(data.to_vec()),
            DType::BF16 => HostMemory::BF16(data.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => HostMemory::F16(data.iter().map(|&v| f16::from_f32(v)).collect()),
        };
        Ok(Tensor::over_host(dtype, shape, HostBuffer::new(memory)))
    }

    /// A contiguous host tensor over raw little-endian element bytes (checked length).
    pub fn from_host_bytes_checked(
        dtype: DType,
        shape: &[usize],
        bytes: Vec<u8>,
    ) -> Result<Tensor> {
        let expected = shape.iter().product::<usize>() * dtype.size_bytes();
        if bytes.len() != expected {
            return Err(Error::Tensor(format!(
                "{} bytes do not hold a {dtype} tensor of shape {shape:?} ({expected} bytes)",
                bytes.len()
            )));
        }
        let numel = expected / dtype.size_bytes();
        let t = Tensor::over_host(dtype, shape, HostBuffer::zeroed(dtype, numel));
        t.host("from_host_bytes")?
            .with_mut(|dst| dst.copy_from_slice(&bytes))?;
        Ok(t)
    }

    fn over_host(dtype: DType, shape: &[usize], buffer: HostBuffer) -> Tensor {
        Tensor {
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            offset: 0,
            storage: Storage::Host(Arc::new(buffer)),
            shard: None,
        }
    }

    /// A host tensor of zeros.
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        let numel: usize = shape.iter().product();
        Tensor::over_host(dtype, shape, HostBuffer::zeroed(dtype, numel))
    }

    /// A contiguous host tensor that takes `data` as its memory, without a copy.
    pub fn from_host_vec<T: HostElement>(shape: &[usize], data: Vec<T>) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if data.len() != numel {
            return Err(Error::Tensor(format!(
                "from_host_vec: shape {shape:?} holds {numel} elements but {} were given",
                data.len()
            )));
        }
        Ok(Tensor::over_host(
            T::DTYPE,
            shape,
            HostBuffer::new(T::into_memory(data)),
        ))
    }

    /// A contiguous host tensor over another library's memory, read-only and without a
    /// copy: `len` elements from `ptr`, kept alive by `owner` for as long as any view of
    /// the tensor lives. Writing into the tensor (as an output) is an error.
    ///
    /// # Safety
    /// `ptr` must be valid for reads of `len` elements of `T` for as long as `owner` is
    /// alive, and nothing may write there while a view of the tensor is in use.
    pub unsafe fn from_foreign_host<T: HostElement>(
        shape: &[usize],
        ptr: *const T,
        len: usize,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Result<Tensor> {
        let numel: usize = shape.iter().product();
        if len != numel {
            return Err(Error::Tensor(format!(
                "from_foreign_host: shape {shape:?} holds {numel} elements but the memory \
                 has {len}"
            )));
        }
        Ok(Tensor::over_host(
            T::DTYPE,
            shape,
            HostBuffer::new(HostMemory::Foreign {
                ptr: ptr.cast::<u8>(),
                len: len * std::mem::size_of::<T>(),
                owner,
            }),
        ))
    }

    /// The elements of a host tensor as the vector that holds them, without a copy: the
    /// tensor must be the only view of memory the runtime allocated, whole and contiguous,
    /// of element type `T`.
    pub fn into_host_vec<T: HostElement>(self) -> Result<Vec<T>> {
        if self.dtype != T::DTYPE {
            return Err(Error::Tensor(format!(
                "into_host_vec: the tensor holds {} elements, not {}",
                self.dtype,
                T::DTYPE
            )));
        }
        let whole = self.offset == 0 && self.is_contiguous();
        let numel = self.numel();
        let Storage::Host(buffer) = self.storage else {
            return Err(Error::Tensor(
                "into_host_vec needs a host tensor; copy it to the host first (Rank::to_host)"
                    .into(),
            ));
        };
        if !whole || buffer.len_bytes() != numel * T::DTYPE.size_bytes() {
            return Err(Error::Tensor(
                "into_host_vec: the tensor is a view of part of its memory; take a \
                 contiguous_copy() first"
                    .into(),
            ));
        }
        let buffer = Arc::try_unwrap(buffer).map_err(|b| {
            Error::Tensor(format!(
                "into_host_vec: {} other tensor(s) (views or clones) still use this memory; \
                 drop them first",
                Arc::strong_count(&b) - 1
            ))
        })?;
        let memory = buffer
            .memory
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        T::from_memory(memory).map_err(|_| {
            Error::Tensor(
                "into_host_vec: the memory belongs to another library (a tensor made by \
                 from_foreign_host); it cannot be taken"
                    .into(),
            )
        })
    }

    /// A host tensor filled with `value`.
    pub fn full(shape: &[usize], dtype: DType, value: f32) -> Tensor {
        let numel: usize = shape.iter().product();
        Tensor::from_f32(shape, &vec![value; numel], dtype).expect("sizes match")
    }

    /// A host tensor of standard-normal values from a fixed seed (SplitMix64 + Box-Muller).
    pub fn randn(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
        let numel: usize = shape.iter().product();
        let mut state = seed ^ 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let mut data = Vec::with_capacity(numel);
        while data.len() < numel {
            let u1 = ((next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            let u2 = (next() >> 11) as f64 / (1u64 << 53) as f64;
            let r = (-2.0 * u1.ln()).sqrt();
            let th = 2.0 * std::f64::consts::PI * u2;
            data.push((r * th.cos()) as f32);
            if data.len() < numel {
                data.push((r * th.sin()) as f32);
            }
        }
        Tensor::from_f32(shape, &data, dtype).expect("sizes match")
    }

    /// A zero-element stand-in, returned for outputs a rank does not hold.
    pub fn placeholder(dtype: DType) -> Tensor {
        Tensor::zeros(&[0], dtype)
    }

    fn host(&self, what: &str) -> Result<&Arc<HostBuffer>> {
        match &self.storage {
            Storage::Host(h) => Ok(h),
            Storage::Device(_) => Err(Error::Tensor(format!(
                "{what} needs a host tensor; copy it to the host first (Rank::to_host)"
            ))),
        }
    }

    /// The elements in row-major order, as f32.
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let h = self.host("to_f32_vec")?;
        let mut out = Vec::with_capacity(self.numel());
        h.with(|bytes| {
            for_each_offset(&self.shape, &self.strides, self.offset, |o| {
                out.push(read_elem(bytes, o, self.dtype))
            })
        });
        Ok(out)
    }

    /// Overwrites the view's elements (row-major order) with `data`, rounded to the dtype.
    pub fn write_f32(&self, data: &[f32]) -> Result<()> {
        if data.len() != self.numel() {
            return Err(Error::Tensor(format!(
                "write_f32: the view has {} elements but {} were given",
                self.numel(),
                data.len()
            )));
        }
        let h = self.host("write_f32")?;
        let mut it = data.iter();
        h.with_mut(|bytes| {
            for_each_offset(&self.shape, &self.strides, self.offset, |o| {
                write_elem(bytes, o, self.dtype, *it.next().expect("counted"))
            })
        })
    }

    /// A new contiguous host tensor with the same values.
    pub fn contiguous_copy(&self) -> Result<Tensor> {
        Tensor::from_f32(&self.shape, &self.to_f32_vec()?, self.dtype)
    }

    /// Copies `src`'s values into this view (host tensors, same shape; dtype converts).
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        if src.shape != self.shape {
            return Err(Error::Tensor(format!(
                "copy_from: shapes {:?} and {:?} differ",
                src.shape, self.shape
            )));
        }
        self.write_f32(&src.to_f32_vec()?)
    }

    /// Relative Frobenius error `‖self − reference‖ / ‖reference‖`, in f64.
    pub fn rel_error(&self, reference: &Tensor) -> Result<f64> {
        if self.shape != reference.shape {
            return Err(Error::Tensor(format!(
                "rel_error: shapes {:?} and {:?} differ",
                self.shape, reference.shape
            )));
        }
        let (a, b) = (self.to_f32_vec()?, reference.to_f32_vec()?);
        let (mut num, mut den) = (0f64, 0f64);
        for (x, y) in a.iter().zip(&b) {
            let d = *x as f64 - *y as f64;
            if !d.is_finite() {
                return Ok(f64::INFINITY);
            }
            num += d * d;
            den += (*y as f64) * (*y as f64);
        }
        Ok(if den == 0.0 {
            num.sqrt()
        } else {
            (num / den).sqrt()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_round() {
        let t = Tensor::from_f32(&[3], &[1.0, 1.0 / 3.0, 1e-3], DType::BF16).unwrap();
        let v = t.to_f32_vec().unwrap();
        assert_eq!(v[0], 1.0);
        assert!((v[1] - 1.0 / 3.0).abs() < 2e-3 && v[1] != 1.0 / 3.0);
        let r = Tensor::randn(&[1000], DType::F32, 7).to_f32_vec().unwrap();
        let mean: f32 = r.iter().sum::<f32>() / 1000.0;
        let var: f32 = r.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / 1000.0;
        assert!(
            mean.abs() < 0.1 && (var - 1.0).abs() < 0.15,
            "mean {mean} var {var}"
        );
    }

    #[test]
    fn host_vectors_go_in_and_come_back_out_without_a_copy() {
        let v: Vec<bf16> = (0..6).map(|i| bf16::from_f32(i as f32)).collect();
        let at = v.as_ptr();
        let t = Tensor::from_host_vec(&[2, 3], v).unwrap();
        assert_eq!(t.dtype(), DType::BF16);
        assert_eq!(t.to_f32_vec().unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let view = t.narrow(1, 1, 2).unwrap();
        let err = t.clone().into_host_vec::<bf16>().unwrap_err().to_string();
        assert!(err.contains("2 other tensor(s)"), "{err}");
        let err = view
            .clone()
            .into_host_vec::<bf16>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("view of part"), "{err}");
        drop(view);
        let err = t.clone().into_host_vec::<f32>().unwrap_err().to_string();
        assert!(err.contains("not f32"), "{err}");
        let back = t.into_host_vec::<bf16>().unwrap();
        assert_eq!(back.as_ptr(), at, "the same allocation");
        assert!(Tensor::from_host_vec(&[4], vec![1.0f32; 3]).is_err());
    }

    #[test]
    fn foreign_memory_is_read_in_place_and_never_written() {
        let data: Arc<Vec<f32>> = Arc::new(vec![1.0, 2.0, 3.0, 4.0]);
        let owner: Arc<dyn Any + Send + Sync> = data.clone();
        // SAFETY: `data` is alive (held by `owner`) and never written.
        let t = unsafe { Tensor::from_foreign_host(&[2, 2], data.as_ptr(), 4, owner) }.unwrap();
        assert_eq!(Arc::strong_count(&data), 2, "the tensor keeps its owner");
        assert_eq!(t.select(0, 1).unwrap().to_f32_vec().unwrap(), [3.0, 4.0]);
        let err = t.write_f32(&[0.0; 4]).unwrap_err().to_string();
        assert!(err.contains("read-only"), "{err}");
        assert_eq!(*data, [1.0, 2.0, 3.0, 4.0]);
        let err = t.into_host_vec::<f32>().unwrap_err().to_string();
        assert!(err.contains("another library"), "{err}");
        assert_eq!(Arc::strong_count(&data), 1, "dropped with the last view");
        // SAFETY: as above.
        let short =
            unsafe { Tensor::from_foreign_host(&[5], data.as_ptr(), 4, data.clone() as Arc<_>) };
        assert!(short.is_err());
    }
}
