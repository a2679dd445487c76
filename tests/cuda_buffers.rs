//! Tensors over cudarc buffers (`Rank::from_cuda_slice`, `Rank::with_cuda_view[_mut]`,
//! `Tensor::into_cuda_slice`). The GPU tests are `#[ignore]`d (shown as ignored where there
//! is no GPU); `scripts/gpu.sh check` runs them with `--ignored`. The CPU-backend errors
//! run everywhere.

use cudarc::driver::CudaSlice;
use fusion::prelude::*;
use fusion::runtime::backend::cuda::cuda_world;
use fusion::runtime::backend::cuda::device_count;
use fusion::runtime::cudarc;
use half::bf16;

fusion! {
    /// `relu(x) * y` in any dtype.
    #[allow(dead_code)] // called through `gated::run_with`, with a caller's output
    fn gated<T: Float, m, n>(x: Tensor<T, [m, n]>, y: Tensor<T, [m, n]>) -> Tensor<T, [m, n]> {
        relu(x) * y
    }
}

fn gpu_run(f: impl Fn(&Rank) -> Result<()> + Sync) {
    assert!(
        device_count() > 0,
        "no CUDA GPU is visible: these tests need one"
    );
    cuda_world(Some(1)).unwrap().run(f).unwrap();
}

fn cudarc<T>(r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| Error::World(format!("cudarc: {e:?}")))
}

fn expected(x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(y)
        .map(|(&a, &b)| bf16::from_f32(a.max(0.0) * b).to_f32())
        .collect()
}

#[test]
fn cuda_buffers_need_a_cuda_rank() {
    let err = World::local(1)
        .unwrap()
        .run(|rank| rank.cuda_context().map(|_| ()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cuda_context needs a CUDA device, but rank 0 runs on the cpu backend"),
        "{err}"
    );
    let err = Tensor::zeros(&[2], DType::F32)
        .into_cuda_slice::<f32>()
        .unwrap_err()
        .to_string();
    assert!(err.contains("not made from a CudaSlice"), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn owned_and_borrowed_buffers_round_trip_without_copies() {
    gpu_run(|rank| {
        let (m, n) = (5, 7);
        let xs: Vec<f32> = (0..m * n).map(|i| i as f32 - 17.0).collect();
        let ys: Vec<f32> = (0..m * n).map(|i| 0.25 * i as f32).collect();
        let to_bf16 = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        let stream = cudarc(rank.cuda_context()?.new_stream())?;
        let x_buf = cudarc(stream.clone_htod(&to_bf16(&xs)))?;
        let y_buf = cudarc(stream.clone_htod(&to_bf16(&ys)))?;
        let mut out = cudarc(stream.alloc_zeros::<bf16>(m * n))?;
        let x_ptr = {
            use cudarc::driver::DevicePtr;
            x_buf.device_ptr(&stream).0
        };
        let x: Ranked<2> = rank.from_cuda_slice(x_buf, &[m, n])?.try_into()?;
        assert_eq!(x.device_ptr(), Some(x_ptr), "no copy on the way in");
        rank.with_cuda_view(&y_buf, &[m, n], |y| {
            rank.with_cuda_view_mut(&mut out, &[m, n], |o| {
                let (y, o): (Ranked<2>, Ranked<2>) = (y.clone().try_into()?, o.clone().try_into()?);
                gated::run_with(rank, &x, &y, Some(&o), &ExecOptions::default())?;
                Ok(())
            })
        })?;
        let got: Vec<f32> = cudarc(stream.clone_dtoh(&out))?
            .into_iter()
            .map(bf16::to_f32)
            .collect();
        assert_eq!(got, expected(&xs, &ys));
        // A view keeps the buffer: it cannot be taken back until the view is gone.
        let view = x.select(0, 1)?;
        let x = x.into_inner();
        let err = x.clone().into_cuda_slice::<bf16>().unwrap_err().to_string();
        assert!(err.contains("other tensor(s)"), "{err}");
        drop(view);
        let err = x.clone().into_cuda_slice::<f32>().unwrap_err().to_string();
        assert!(err.contains("holds bf16 elements, not f32"), "{err}");
        let back: CudaSlice<bf16> = x.into_cuda_slice()?;
        assert_eq!(back.len(), m * n);
        let again: Vec<bf16> = cudarc(stream.clone_dtoh(&back))?;
        assert_eq!(again, to_bf16(&xs));
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn a_clone_that_outlives_its_borrow_moves_to_a_copy() {
    gpu_run(|rank| {
        let stream = cudarc(rank.cuda_context()?.new_stream())?;
        let mut buf = cudarc(stream.clone_htod(&[1.0f32, 2.0, 3.0]))?;
        let escaped = rank.with_cuda_view(&buf, &[3], |t| Ok(t.clone()))?;
        // The caller owns its buffer again: overwrite it; the escaped tensor kept a copy.
        cudarc(stream.memcpy_htod(&[9.0f32, 9.0, 9.0], &mut buf))?;
        cudarc(stream.synchronize())?;
        assert_eq!(rank.to_host(&escaped)?.to_f32_vec()?, vec![1.0, 2.0, 3.0]);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn mismatched_buffers_are_rejected() {
    gpu_run(|rank| {
        let stream = cudarc(rank.cuda_context()?.new_stream())?;
        let buf = cudarc(stream.alloc_zeros::<f32>(6))?;
        let err = rank.from_cuda_slice(buf, &[4, 2]).unwrap_err().to_string();
        assert!(
            err.contains("shape [4, 2] holds 8 elements, but the buffer holds 6 elements of f32"),
            "{err}"
        );
        let buf = cudarc(stream.alloc_zeros::<f32>(6))?;
        let err = rank
            .with_cuda_view(&buf, &[7], |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds 7 elements"), "{err}");
        Ok(())
    });
}
