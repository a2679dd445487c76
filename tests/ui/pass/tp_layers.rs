//! The tensor-parallel transformer blocks in their natural forms: a Stream annotation on
//! the activation settles the first matmul's two DIDx axes (rows gathered chunk by chunk,
//! weight columns local), and the partial products are reduce-scattered in the same loop.
use fusion::prelude::*;

fusion! {
    /// `ReduceScatter(gelu(AllGather(x) W1) W2)`.
    pub fn mlp<d, m, h, f>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        w1: Tensor<f32, [d @ DIDx, h, f]>,
        w2: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ DIDx, m, h]> {
        let act: Tensor<f32, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(matmul(broadcast(x, [false, true, false, false]), w1));
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
        sum(partial, 1)
    }

    /// `ReduceScatter((silu(AG(x) Wg) * (AG(x) Wu)) Wd)`.
    pub fn gated_mlp<d, m, h, f>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        wg: Tensor<f32, [d @ DIDx, h, f]>,
        wu: Tensor<f32, [d @ DIDx, h, f]>,
        wd: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ DIDx, m, h]> {
        let rows = broadcast(x, [false, true, false, false]);
        let act: Tensor<f32, [d @ Stream, d @ DIDx, m, f]> =
            silu(matmul(rows, wg)) * matmul(rows, wu);
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, h]> = matmul(act, wd);
        sum(partial, 1)
    }

    /// Column-parallel QKV from the gathered rows.
    pub fn qkv<d, m, h, q>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        w: Tensor<f32, [d @ DIDx, h, q]>,
    ) -> Tensor<f32, [d @ Stream, d @ DIDx, m, q]> {
        matmul(broadcast(x, [false, true, false, false]), w)
    }

    /// Row-parallel output projection + ReduceScatter.
    pub fn out_proj<d, m, f, h>(
        a: Tensor<f32, [d, d @ DIDx, m, f]>,
        w: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ DIDx, m, h]> {
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, h]> = matmul(a, w);
        sum(partial, 1)
    }
}

pub fn main() -> fusion::Result<()> {
    let world = World::local(2)?;
    let t = |shape: &[usize], seed: u64| Tensor::randn(shape, DType::F32, seed);
    let (x, w1, w2, w3) = (
        t(&[2, 4, 8], 1),
        t(&[2, 8, 6], 2),
        t(&[2, 6, 8], 3),
        t(&[2, 8, 6], 4),
    );
    let a = t(&[2, 2, 4, 6], 5);
    world.run(|rank| {
        let s = |full: &Tensor, axis: usize| -> fusion::Result<Ranked<3>> {
            rank.shard(full, axis)?.try_into()
        };
        let y = mlp(rank, &s(&x, 0)?, &s(&w1, 0)?, &s(&w2, 0)?)?;
        assert_eq!(y.shape(), &[1, 4, 8]);
        let g = gated_mlp(rank, &s(&x, 0)?, &s(&w1, 0)?, &s(&w3, 0)?, &s(&w2, 0)?)?;
        assert_eq!(g.shape(), &[1, 4, 8]);
        let q = qkv(rank, &s(&x, 0)?, &s(&w1, 0)?)?;
        assert_eq!(q.shape(), &[2, 1, 4, 6]);
        let o = out_proj(rank, &rank.shard(&a, 1)?.try_into()?, &s(&w2, 0)?)?;
        assert_eq!(o.shape(), &[1, 4, 8]);
        // Lowered once each, into one stream loop with both pipelines.
        // Pipelined at any shape (by default only from 256 rows per chunk on).
        let always = ExecOptions {
            lower: LowerOptions {
                pipelines: fusion::PipelineOptions {
                    pipelining: Pipelining::Always,
                    ..Default::default()
                },
                ..LowerOptions::default()
            },
            ..ExecOptions::default()
        };
        let text = mlp::program(rank, &s(&x, 0)?, &s(&w1, 0)?, &s(&w2, 0)?, &always)?.to_string();
        assert_eq!(text.matches("P2PCommunication").count(), 4, "{text}");
        Ok(())
    })?;
    Ok(())
}
