//! One fusion per op family, each run once on two simulated devices.
use fusion::prelude::*;

fusion! {
    /// `set` and the infix and named elementwise ops, with broadcasting of a vector.
    pub(crate) fn elementwise<m, n>(
        a: Tensor<f32, [m, n]>,
        b: Tensor<f32, [m, n]>,
        v: Tensor<f32, [n]>,
    ) -> Tensor<f32, [m, n]> {
        let c = set(a);
        let d = (c + b) * v - b / v;
        minimum(maximum(d, a), -b)
    }

    fn unary<m>(x: Tensor<f32, [m]>) -> Tensor<f32, [m]> {
        silu(gelu_tanh(sqrt(abs(sigmoid(tanh(exp(gelu(relu(neg(x))))))))))
    }

    /// The derivative ops of backward passes (of positive inputs where the op needs them).
    fn derivatives<m>(x: Tensor<f32, [m]>) -> Tensor<f32, [m]> {
        let p = exp(x);
        gelu_grad(x) + gelu_tanh_grad(x) + silu_grad(x) + sigmoid_grad(x) + tanh_grad(x)
            + relu_grad(x) + abs_grad(x) + sqrt_grad(p) + rsqrt_grad(p)
    }

    /// The scale of an RMS norm: `rsqrt` of each row's sum of squares.
    fn inverse_norms<m, n>(x: Tensor<f32, [m, n]>) -> Tensor<f32, [m]> {
        rsqrt(sum(x * x, 1))
    }

    fn casts<m>(x: Tensor<f32, [m]>) -> (Tensor<bf16, [m]>, Tensor<f16, [m]>) {
        let h = cast(x, bf16);
        (h, cast(h, f16))
    }

    fn reductions<a, b, c>(x: Tensor<f32, [a, b, c]>) -> (Tensor<f32, [a]>, Tensor<f32, [a, c]>) {
        (sum(x, [1, 2]), max(x, 1))
    }

    fn broadcasts<m, n>(row: Tensor<f32, [n]>, x: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        let r: Tensor<f32, [1, n]> = broadcast(row, [true, false]);
        x + r
    }

    fn matmuls<s, m, k, n>(
        a: Tensor<f32, [s, m, k]>,
        b: Tensor<f32, [k, n]>,
        w: Tensor<f32, [n, k]>,
        bias: Tensor<f32, [n]>,
    ) -> (Tensor<f32, [s, m, n]>, Tensor<f32, [s, m, n]>, Tensor<f32, [s, m, n]>) {
        (matmul(a, b), linear(a, w), linear(a, w, bias))
    }

    fn views<m, n>(x: Tensor<f32, [m, n]>) -> (Tensor<f32, [n]>, Tensor<f32, [m, 2]>, Tensor<f32, [m, 2, n / 2]>) {
        (select(x, 0, 1), slice(x, 1, 1, 3), split(x, 1, 2))
    }

    fn permutes<a, b, c>(x: Tensor<f32, [a, b, c]>) -> (Tensor<f32, [c, a, b]>, Tensor<f32, [a, c, b]>) {
        (permute(x, [2, 0, 1]), transpose(x, 1, 2))
    }

    /// Sharding: reduce a sharded axis (an Allreduce) and copy to device 0 (a Gather).
    fn sharded<d, m>(x: Tensor<f32, [d @ DIDx, m]>) -> (Tensor<f32, [m]>, Tensor<f32, [d, m], mesh = [0]>) {
        (sum(x, 0), x)
    }
}

fn host(rank: &Rank, t: &Tensor) -> fusion::Result<Vec<f32>> {
    rank.to_host(t)?.to_f32_vec()
}

pub fn main() -> fusion::Result<()> {
    let world = World::local(2)?;
    world.run(|rank| {
        let t = |shape: &[usize], seed: u64| Tensor::randn(shape, DType::F32, seed);
        let (a, b, v) = (t(&[3, 4], 1), t(&[3, 4], 2), t(&[4], 3));
        let e = elementwise(
            rank,
            &a.clone().try_into()?,
            &b.clone().try_into()?,
            &v.clone().try_into()?,
        )?;
        let (av, bv, vv) = (a.to_f32_vec()?, b.to_f32_vec()?, v.to_f32_vec()?);
        let got = host(rank, &e)?;
        for i in 0..12 {
            let (x, y, z) = (av[i], bv[i], vv[i % 4]);
            let want = ((x + y) * z - y / z).max(x).min(-y);
            assert!(
                (got[i] - want).abs() < 1e-5,
                "elementwise[{i}]: {} vs {want}",
                got[i]
            );
        }

        let u = unary(rank, &t(&[5], 4).try_into()?)?;
        assert_eq!(u.shape(), &[5]);
        let x = t(&[6], 16);
        let grads = derivatives(rank, &x.clone().try_into()?)?;
        let got = host(rank, &grads)?;
        for (&v, got) in x.to_f32_vec()?.iter().zip(got) {
            use fusion::compiler::ir::UnaryOp::{self, RsqrtGrad, SqrtGrad};
            let (v, p) = (f64::from(v), f64::from(v).exp());
            let at_x = UnaryOp::ALL
                .into_iter()
                .filter(|u| u.is_derivative() && !matches!(u, SqrtGrad | RsqrtGrad));
            let want = at_x.map(|op| op.apply_f64(v)).sum::<f64>()
                + SqrtGrad.apply_f64(p)
                + RsqrtGrad.apply_f64(p);
            assert!(
                (f64::from(got) - want).abs() < 1e-4 * (1.0 + want.abs()),
                "derivatives: {got} vs {want}"
            );
        }
        let x = t(&[2, 3, 4], 17);
        let (p, q) = permutes(rank, &x.clone().try_into()?)?;
        assert_eq!(host(rank, &p)?, x.permute(&[2, 0, 1])?.to_f32_vec()?);
        assert_eq!(host(rank, &q)?, x.permute(&[0, 2, 1])?.to_f32_vec()?);
        let x = t(&[3, 5], 15);
        let norms = inverse_norms(rank, &x.clone().try_into()?)?;
        let norms = host(rank, &norms)?;
        for (row, got) in x.to_f32_vec()?.chunks(5).zip(norms) {
            let want = 1.0
                / row
                    .iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum::<f64>()
                    .sqrt();
            assert!(
                (f64::from(got) - want).abs() < 1e-5 * want,
                "rsqrt: {got} vs {want}"
            );
        }
        let (h, f) = casts(rank, &t(&[5], 5).try_into()?)?;
        assert_eq!((h.dtype(), f.dtype()), (DType::BF16, DType::F16));
        let (s, mx) = reductions(rank, &t(&[2, 3, 4], 6).try_into()?)?;
        assert_eq!((s.shape(), mx.shape()), (&[2][..], &[2, 4][..]));
        let r = broadcasts(rank, &t(&[4], 7).try_into()?, &t(&[3, 4], 8).try_into()?)?;
        assert_eq!(r.shape(), &[3, 4]);
        let (p, q, l) = matmuls(
            rank,
            &t(&[2, 3, 4], 9).try_into()?,
            &t(&[4, 5], 10).try_into()?,
            &t(&[5, 4], 11).try_into()?,
            &t(&[5], 12).try_into()?,
        )?;
        assert_eq!(
            (p.shape(), q.shape(), l.shape()),
            (&[2, 3, 5][..], &[2, 3, 5][..], &[2, 3, 5][..])
        );
        let x = t(&[3, 4], 13);
        let (row, cols, parts) = views(rank, &x.clone().try_into()?)?;
        assert_eq!(host(rank, &row)?, x.select(0, 1)?.to_f32_vec()?);
        assert_eq!(host(rank, &cols)?, x.narrow(1, 1, 2)?.to_f32_vec()?);
        assert_eq!(parts.shape(), &[3, 2, 2]);
        let full = t(&[2, 3], 14);
        let (total, gathered) = sharded(rank, &rank.shard(&full, 0)?.try_into()?)?;
        assert_eq!(total.shape(), &[3]);
        if rank.index() == 0 {
            assert_eq!(host(rank, &gathered)?, full.to_f32_vec()?);
        } else {
            assert!(gathered.is_empty(), "rank 1 is outside the mesh [0]");
        }
        Ok(())
    })?;
    Ok(())
}
