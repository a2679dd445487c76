//! Extents written with arithmetic: like terms combine, so the two halves of a weight stored
//! side by side (`[k, 2 * f]`, a gated MLP's gate and up projections as one GEMM) have the
//! extent `f` of the weight they feed, whether taken by `slice` or by `split` + `select`.
use fusion::prelude::*;

fusion! {
    /// `sum over ranks of (silu(x Wg) * (x Wu)) Wd`, Wg and Wu side by side in `wgu`.
    fn side_by_side<d, m, k, f>(
        x: Tensor<f32, [m, k]>,
        wgu: Tensor<f32, [d @ DIDx, k, 2 * f]>,
        wd: Tensor<f32, [d @ DIDx, f, k]>,
    ) -> Tensor<f32, [m, k]> {
        let rows: Tensor<f32, [1, m, k]> = broadcast(x, [true, false, false]);
        let gate_up: Tensor<f32, [d @ DIDx, m, 2 * f]> = matmul(rows, wgu);
        let gate = slice(gate_up, 2, 0, f);
        let halves: Tensor<f32, [d @ DIDx, m, 2, f]> = split(gate_up, 2, 2);
        let up = select(halves, 2, 1);
        let partial: Tensor<f32, [d @ DIDx, m, k]> = matmul(silu(gate) * up, wd);
        sum(partial, 0)
    }
}

pub fn main() -> fusion::Result<()> {
    let (d, m, k, f) = (2, 3, 4, 5);
    let x = Tensor::randn(&[m, k], DType::F32, 1);
    let wgu = Tensor::randn(&[d, k, 2 * f], DType::F32, 2);
    let wd = Tensor::randn(&[d, f, k], DType::F32, 3);
    let (xs, gus, ds) = (x.to_f32_vec()?, wgu.to_f32_vec()?, wd.to_f32_vec()?);
    // f64 reference: per rank, g = x Wg, u = x Wu (columns 0..f and f..2f), then the sum.
    let mut expect = vec![0f64; m * k];
    for r in 0..d {
        for i in 0..m {
            for c in 0..f {
                let dot = |col: usize| -> f64 {
                    (0..k)
                        .map(|l| xs[i * k + l] as f64 * gus[(r * k + l) * 2 * f + col] as f64)
                        .sum()
                };
                let (g, u) = (dot(c), dot(f + c));
                let act = g / (1.0 + (-g).exp()) * u;
                for j in 0..k {
                    expect[i * k + j] += act * ds[(r * f + c) * k + j] as f64;
                }
            }
        }
    }
    let world = World::local(d)?;
    world.run(|rank| {
        let out = side_by_side(
            rank,
            &x.clone().try_into()?,
            &rank.shard(&wgu, 0)?.try_into()?,
            &rank.shard(&wd, 0)?.try_into()?,
        )?;
        let got = rank.to_host(&out)?.to_f32_vec()?;
        for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
            assert!(
                (*g as f64 - e).abs() <= 1e-4 * (1.0 + e.abs()),
                "{i}: {g} vs {e}"
            );
        }
        // A weight whose columns are not twice the down projection's rows is refused.
        let odd = Tensor::randn(&[d, k, 2 * f + 1], DType::F32, 4);
        let err = side_by_side(
            rank,
            &x.clone().try_into()?,
            &rank.shard(&odd, 0)?.try_into()?,
            &rank.shard(&wd, 0)?.try_into()?,
        )
        .unwrap_err();
        assert!(err.to_string().contains("wgu"), "{err}");
        Ok(())
    })?;
    Ok(())
}
