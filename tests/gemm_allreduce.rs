//! A decode-size row-parallel projection, `sum(matmul(x, w), 0)`, lowered with the Allreduce
//! in its GEMM's epilogue (`Node::GemmAllreduce`) on 2, 3, 4 and 8 simulated devices: the
//! program has the node; every rank gets the same bits, within bf16's and f16's rounding of
//! the f64 sum, at 1, 8 and 32 rows (the kernel's three variants on a GPU); on the CPU
//! backend they equal, bit for bit, those of the program that keeps the GEMM and the
//! Allreduce apart. On 2 and 4 GPUs (`--ignored`) the same checks run the kernel.

use fusion::prelude::*;
use fusion::runtime::backend::BackendKind;

fusion! {
    /// A row-parallel projection of a decode step: each rank's partial product, summed.
    pub fn row_parallel<T: Float, d, m, k, n>(
        x: Tensor<T, [d @ DIDx, m, k]>,
        w: Tensor<T, [d @ DIDx, k, n]>,
    ) -> Tensor<T, [m, n]> {
        sum(matmul(x, w), 0)
    }

    /// A gated MLP with its residual: the down projection's operand is computed in the
    /// program (and freed once read), and the summed product feeds an add.
    pub fn mlp_residual<T: Float, d, m, h, f, n>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        res: Tensor<T, [m, n]>,
        wg: Tensor<T, [d @ DIDx, h, f]>,
        wu: Tensor<T, [d @ DIDx, h, f]>,
        wd: Tensor<T, [d @ DIDx, f, n]>,
    ) -> Tensor<T, [m, n]> {
        let gate: Tensor<T, [d @ DIDx, m, f]> = matmul(x, wg);
        let up: Tensor<T, [d @ DIDx, m, f]> = matmul(x, wu);
        let partial: Tensor<T, [d @ DIDx, m, n]> = matmul(silu(gate) * up, wd);
        res + sum(partial, 0)
    }
}

const DEVICES: [usize; 4] = [2, 3, 4, 8];

/// Rows, element type, K and N of each case: the kernel's three variants over 128 tiles
/// (N = 8192: 1 row with flags beside the data, 8 and 32 rows with the flag meeting), and
/// its two parts of K over 64 tiles (N = 4096, Llama-8B's width).
const CASES: [(usize, DType, usize, usize); 5] = [
    (1, DType::BF16, 64, 8192),
    (8, DType::F16, 64, 8192),
    (32, DType::BF16, 64, 8192),
    (1, DType::BF16, 128, 4096),
    (8, DType::F16, 256, 4096),
];

fn apart() -> ExecOptions {
    let mut o = ExecOptions::default();
    o.lower.transports.gemm_allreduce = false;
    o
}

/// `sum over ranks j of x_j @ w_j` (`[rows, k] @ [k, n]`), in f64, row-major `[rows, n]`.
fn reference(xs: &[f32], ws: &[f32], d: usize, [rows, k, n]: [usize; 3]) -> Vec<f64> {
    (0..rows * n)
        .map(|i| {
            let (r, c) = (i / n, i % n);
            (0..d)
                .map(|j| {
                    (0..k)
                        .map(|q| xs[(j * rows + r) * k + q] as f64 * ws[(j * k + q) * n + c] as f64)
                        .sum::<f64>()
                })
                .sum()
        })
        .collect()
}

/// The largest difference from `want`, relative to its largest value.
fn error(got: &[f32], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs() / scale))
}

/// Every rank's result of the fused program in `world` of `d` ranks in every case of
/// [`CASES`] (each of the kernel's variants on a GPU), against the program that keeps the
/// GEMM and the Allreduce apart and the f64 sum.
fn sums_like_the_gemm_and_allreduce_apart(world: &World, d: usize) {
    for (rows, dt, k, n) in CASES {
        let x_full = Tensor::randn(&[d, rows, k], dt, 7);
        let w_full = Tensor::randn(&[d, k, n], dt, 8);
        let (xs, ws) = (x_full.to_f32_vec().unwrap(), w_full.to_f32_vec().unwrap());
        let out = world
            .run(|rank| {
                let x: Ranked<3> = rank.shard(&x_full, 0)?.try_into()?;
                let w: Ranked<3> = rank.shard(&w_full, 0)?.try_into()?;
                let fused = row_parallel::program(rank, &x, &w, &ExecOptions::default())?;
                let kept = row_parallel::program(rank, &x, &w, &apart())?;
                let y = row_parallel::call(rank, &x, &w, &ExecOptions::default())?.into_inner();
                let y_apart = row_parallel::call(rank, &x, &w, &apart())?.into_inner();
                Ok((
                    fused.to_string(),
                    kept.to_string(),
                    rank.to_host(&y)?.to_f32_vec()?,
                    rank.to_host(&y_apart)?.to_f32_vec()?,
                ))
            })
            .unwrap();
        let want = reference(&xs, &ws, d, [rows, k, n]);
        let what = format!("{d} devices, {rows} x {k} x {n}, {dt:?}");
        for (fused, kept, y, y_apart) in &out {
            assert!(fused.contains("GemmAllreduce"), "{what}: {fused}");
            assert!(!kept.contains("GemmAllreduce"), "{what}: {kept}");
            // The CPU backend runs the node as the GEMM, then the Allreduce.
            if world.backend() == BackendKind::Cpu {
                assert_eq!(y, y_apart, "{what}: the fused program's sums");
            }
            assert_eq!(y, &out[0].2, "{what}: every rank gets the same bits");
            for (got, label) in [(y, "fused"), (y_apart, "apart")] {
                let err = error(got, &want);
                assert!(err < 2e-2, "{what}, {label}: max error {err:.3e}");
            }
        }
    }
}

/// The MLP block with its residual in `world` of `d` ranks at 1 and 8 rows (n = 4096: the
/// kernel's two parts of K): the down projection's Allreduce goes into its GEMM although
/// its operand is an intermediate the program frees, the residual add into the kernel's
/// last store (`GemmAllreduce::residual`), and the fused program's result is
/// the same on every rank and matches the unfused one's (bit for bit on the CPU backend,
/// within bf16's rounding on a GPU).
fn an_mlp_block_sums_like_the_gemm_and_allreduce_apart(world: &World, d: usize) {
    let (h, f, n) = (64, 256, 4096);
    for rows in [1, 8] {
        let x_full = Tensor::randn(&[d, rows, h], DType::BF16, 11);
        let res = Tensor::randn(&[rows, n], DType::BF16, 12);
        let wg_full = Tensor::randn(&[d, h, f], DType::BF16, 13);
        let wu_full = Tensor::randn(&[d, h, f], DType::BF16, 14);
        let wd_full = Tensor::randn(&[d, f, n], DType::BF16, 15);
        let out = world
            .run(|rank| {
                let x: Ranked<3> = rank.shard(&x_full, 0)?.try_into()?;
                let r: Ranked<2> = rank.to_device(&res)?.try_into()?;
                let wg: Ranked<3> = rank.shard(&wg_full, 0)?.try_into()?;
                let wu: Ranked<3> = rank.shard(&wu_full, 0)?.try_into()?;
                let wd: Ranked<3> = rank.shard(&wd_full, 0)?.try_into()?;
                let run = |o: &ExecOptions| -> fusion::Result<(String, Vec<f32>)> {
                    let program = mlp_residual::program(rank, &x, &r, &wg, &wu, &wd, o)?;
                    let y = mlp_residual::call(rank, &x, &r, &wg, &wu, &wd, o)?.into_inner();
                    Ok((program.to_string(), rank.to_host(&y)?.to_f32_vec()?))
                };
                Ok((run(&ExecOptions::default())?, run(&apart())?))
            })
            .unwrap();
        let what = format!("{d} devices, the MLP block at {rows} rows");
        for ((fused, y), (kept, y_apart)) in &out {
            assert!(fused.contains("GemmAllreduce"), "{what}: {fused}");
            // The residual add is the kernel's last store: no add and no buffer of the sum.
            assert!(fused.contains("then, in its last store"), "{what}: {fused}");
            assert!(!kept.contains("GemmAllreduce"), "{what}: {kept}");
            assert_eq!(y, &out[0].0 .1, "{what}: every rank gets the same bits");
            if world.backend() == BackendKind::Cpu {
                assert_eq!(y, y_apart, "{what}: the fused program's sums");
            } else {
                let want: Vec<f64> = y_apart.iter().map(|&v| f64::from(v)).collect();
                let err = error(y, &want);
                assert!(
                    err < 2e-2,
                    "{what}: max difference {err:.3e} from the unfused"
                );
            }
        }
    }
}

#[test]
fn the_fused_program_sums_like_the_gemm_and_allreduce_apart() {
    for d in DEVICES {
        sums_like_the_gemm_and_allreduce_apart(&World::local(d).unwrap(), d);
    }
}

#[test]
fn an_mlp_block_with_its_allreduce_in_the_down_gemm_sums_like_the_unfused() {
    for d in DEVICES {
        an_mlp_block_sums_like_the_gemm_and_allreduce_apart(&World::local(d).unwrap(), d);
    }
}

#[test]
#[ignore = "needs two CUDA GPUs; run with --ignored on a GPU machine"]
fn the_kernel_sums_like_the_gemm_and_allreduce_apart_on_gpus() {
    for d in [2, 4] {
        if fusion::runtime::backend::visible_gpus() < d {
            eprintln!("skipping {d} ranks: fewer CUDA GPUs");
            continue;
        }
        let world = fusion::runtime::backend::cuda::cuda_world(Some(d)).expect("a CUDA world");
        sums_like_the_gemm_and_allreduce_apart(&world, d);
        an_mlp_block_sums_like_the_gemm_and_allreduce_apart(&world, d);
        eprintln!("{d} GPUs: the GEMM with the Allreduce in its epilogue sums right");
    }
}
