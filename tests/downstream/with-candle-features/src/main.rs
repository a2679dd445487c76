//! A layer of an application that keeps its data on its own cudarc stream: the fusion runs
//! on that stream, and `?` carries cudarc's errors and fusion's alike.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use fusion::prelude::*;

fusion! {
    /// Row-parallel layer: each rank's block of `k`, summed over the ranks.
    fn row_parallel<d, m, k, n>(
        x: Tensor<f32, [d @ DIDx, m, k]>,
        w: Tensor<f32, [d @ DIDx, k, n]>,
    ) -> Tensor<f32, [m, n]> {
        sum(matmul(x, w), 0)
    }
}

/// One rank's layer: its handle, its stream and its weight block.
struct Layer {
    rank: Rank,
    stream: Arc<CudaStream>,
    w: Ranked<3>,
}

impl Layer {
    fn new(rank: Rank, w: &Tensor) -> fusion::Result<Layer> {
        let ctx: Arc<CudaContext> = rank.cuda_context()?;
        let stream = ctx.new_stream()?; // a cudarc error, converted by `?`
        let w = rank.shard(w, 0)?.try_into()?;
        Ok(Layer { rank, stream, w })
    }

    fn forward(&self, x: &Ranked<3>) -> fusion::Result<Ranked<2>> {
        row_parallel(&self.rank.on(&self.stream), x, &self.w)
    }
}

fn main() -> fusion::Result<()> {
    let world = World::local_default()?;
    if world.backend() != BackendKind::Cuda {
        println!("no GPU here: nothing to run");
        return Ok(());
    }
    let w = Tensor::randn(&[world.size(), 4, 2], DType::F32, 1);
    let x = Tensor::randn(&[world.size(), 3, 4], DType::F32, 2);
    let layers = world
        .ranks()?
        .into_iter()
        .map(|r| Layer::new(r, &w))
        .collect::<fusion::Result<Vec<_>>>()?;
    std::thread::scope(|s| {
        for layer in &layers {
            let x = &x;
            s.spawn(move || -> fusion::Result<()> {
                let mine = layer.rank.shard(x, 0)?.try_into()?;
                let y = layer.forward(&mine)?;
                println!("rank {}: {:?}", layer.rank.index(), layer.rank.to_host(&y)?.shape());
                Ok(())
            });
        }
    });
    Ok(())
}
