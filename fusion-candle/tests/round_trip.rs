//! candle CPU tensors into fusions and fusion outputs back into candle, without copies:
//! the memory is checked to be shared, the values against candle's own ops, and every
//! input the adapter refuses gives its error.

use candle_core::{DType as CDType, Device, Storage, Tensor as CTensor};
use fusion::prelude::*;
use fusion_candle::Error;

fusion! {
    /// `gelu_tanh(x @ w) * s`, in any element type.
    pub fn scaled<T: Float, m, k, n>(
        x: Tensor<T, [m, k]>,
        w: Tensor<T, [k, n]>,
        s: Tensor<T, [n]>,
    ) -> Tensor<T, [m, n]> {
        gelu_tanh(matmul(x, w)) * s
    }

    /// Row-parallel `sum_d x[d] @ w[d]` (an Allreduce), each rank holding one block.
    pub fn row_parallel<d, m, k, n>(
        x: Tensor<f32, [d @ DIDx, m, k]>,
        w: Tensor<f32, [d @ DIDx, k, n]>,
    ) -> Tensor<f32, [m, n]> {
        sum(matmul(x, w), 0)
    }
}

/// Runs `f` on every rank; `f` uses `?` on candle, adapter and fusion errors alike.
fn on_ranks<T: Send>(
    world: &World,
    f: impl Fn(&Rank) -> fusion_candle::Result<T> + Sync,
) -> fusion::Result<Vec<T>> {
    world.run(|rank| f(rank).map_err(Into::into))
}

/// Address of the first element of a candle CPU tensor's storage.
fn candle_address(t: &CTensor) -> usize {
    let (storage, _) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(c) => match c {
            candle_core::CpuStorage::F32(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::BF16(v) => v.as_ptr() as usize,
            candle_core::CpuStorage::F16(v) => v.as_ptr() as usize,
            _ => panic!("unexpected storage dtype"),
        },
        _ => panic!("not a CPU tensor"),
    }
}

/// Address of the first byte of a fusion host tensor's memory.
fn fusion_address(t: &fusion::Tensor) -> usize {
    match t.storage() {
        fusion::runtime::tensor::Storage::Host(h) => h.with(|b| b.as_ptr() as usize),
        _ => panic!("not a host tensor"),
    }
}

fn max_abs_diff(a: &CTensor, b: &CTensor) -> f32 {
    (a.to_dtype(CDType::F32).unwrap() - b.to_dtype(CDType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[test]
fn inputs_view_candle_memory_and_outputs_move_into_candle_in_every_dtype() {
    let world = World::local(1).unwrap();
    for (dt, tol) in [
        (CDType::F32, 1e-5),
        (CDType::BF16, 2e-2),
        (CDType::F16, 5e-3),
    ] {
        let x = CTensor::randn(0f32, 1.0, (5, 8), &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let w = (CTensor::randn(0f32, 1.0, (8, 3), &Device::Cpu).unwrap() * 0.3)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let s = CTensor::new(&[0.5f32, -1.0, 2.0], &Device::Cpu)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let y = on_ranks(&world, |rank| {
            let xf = fusion_candle::input(rank, "x", &x)?;
            assert_eq!(
                fusion_address(&xf),
                candle_address(&x),
                "x is viewed, not copied"
            );
            let wf = fusion_candle::input(rank, "w", &w)?;
            let sf = fusion_candle::input(rank, "s", &s)?;
            let out: Ranked<2> = scaled(rank, &xf.try_into()?, &wf.try_into()?, &sf.try_into()?)?;
            let out = out.into_inner();
            let at = fusion_address(&out);
            let y = fusion_candle::output(rank, "y", out, &Device::Cpu)?;
            assert_eq!(candle_address(&y), at, "the output moved into candle");
            Ok(y)
        })
        .unwrap()
        .remove(0);
        assert_eq!((y.dims(), y.dtype()), (&[5, 3][..], dt));
        let f32 = |t: &CTensor| t.to_dtype(CDType::F32).unwrap();
        let expected = f32(&x)
            .matmul(&f32(&w))
            .unwrap()
            .gelu()
            .unwrap()
            .broadcast_mul(&f32(&s))
            .unwrap();
        let scale = f32(&expected)
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let diff = max_abs_diff(&y, &expected);
        assert!(
            diff <= tol * scale.max(1.0),
            "{dt:?}: max difference {diff}"
        );
    }
}

#[test]
fn inputs_keep_their_candle_tensor_alive() {
    let world = World::local(1).unwrap();
    let kept = on_ranks(&world, |rank| {
        let x = CTensor::arange(0f32, 6.0, &Device::Cpu)?.reshape((2, 3))?;
        let xf = fusion_candle::input(rank, "x", &x)?;
        drop(x); // the fusion tensor holds the storage now
        Ok(xf)
    })
    .unwrap()
    .remove(0);
    assert_eq!(kept.to_f32_vec().unwrap(), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
}

#[test]
fn several_ranks_take_their_blocks_from_candle() {
    let d = 2;
    let world = World::local(d).unwrap();
    let x = CTensor::randn(0f32, 1.0, (d, 3, 4), &Device::Cpu).unwrap();
    let w = CTensor::randn(0f32, 1.0, (d, 4, 5), &Device::Cpu).unwrap();
    let ys = on_ranks(&world, |rank| {
        let r = rank.index();
        // This rank's blocks, each copied once into storage of its own (`force_contiguous`): a
        // narrowed view starts inside its parent's storage, which inputs refuse.
        let xr = x.narrow(0, r, 1)?.force_contiguous()?;
        let wr = w.narrow(0, r, 1)?.force_contiguous()?;
        let y = row_parallel(
            rank,
            &fusion_candle::input(rank, "x", &xr)?.try_into()?,
            &fusion_candle::input(rank, "w", &wr)?.try_into()?,
        )?;
        fusion_candle::output(rank, "y", y.into_inner(), &Device::Cpu)
    })
    .unwrap();
    let expected = x.matmul(&w).unwrap().sum(0).unwrap();
    for y in ys {
        assert!(max_abs_diff(&y, &expected) < 1e-4);
    }
}

#[test]
fn bad_inputs_and_outputs_say_what_to_do() {
    let world = World::local(1).unwrap();
    on_ranks(&world, |rank| {
        let t = CTensor::randn(0f32, 1.0, (4, 6), &Device::Cpu)?;
        let err = |r: fusion_candle::Result<fusion::Tensor>| r.map(|_| ()).unwrap_err();

        let e = err(fusion_candle::input(rank, "wt", &t.t()?));
        assert!(matches!(e, Error::NotContiguous { .. }), "{e}");
        assert!(e.to_string().contains("`wt`") && e.to_string().contains(".contiguous()"));

        let e = err(fusion_candle::input(rank, "rows", &t.narrow(0, 1, 2)?));
        assert!(matches!(e, Error::StorageOffset { offset: 6, .. }), "{e}");
        assert!(e.to_string().contains(".force_contiguous()"), "{e}");

        for dt in [CDType::F64, CDType::U32, CDType::U8, CDType::I64] {
            let e = err(fusion_candle::input(rank, "ids", &t.to_dtype(dt)?));
            assert!(matches!(e, Error::DType { .. }), "{e}");
            assert!(e.to_string().contains(".to_dtype("), "{e}");
        }

        // An output another view still reads is not handed over.
        let out = fusion::Tensor::from_host_vec(&[2, 2], vec![1.0f32; 4])?;
        let view = out.select(0, 1)?;
        let e = fusion_candle::output(rank, "y", out, &Device::Cpu).unwrap_err();
        assert!(matches!(e, Error::Output { .. }), "{e}");
        assert!(e.to_string().contains("drop them first"), "{e}");
        drop(view);

        // An input is never written: a fusion writing into it fails, candle's data stays.
        let viewed = fusion_candle::input(rank, "x", &t)?;
        let e = viewed.write_f32(&[0.0; 24]).unwrap_err();
        assert!(e.to_string().contains("read-only"), "{e}");
        assert!(t.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
        Ok(())
    })
    .unwrap();
}
