//! Collectives over peer memory as the lowering plans them, on 2, 3, 4 and 8 simulated
//! devices (the CPU backend runs the same host-program nodes): a small Allreduce of the
//! whole world says `backend=PeerMemory` in the host program with the size that decided
//! it, sizes where NCCL measured faster and `PeerMemoryCollectives::Never` stay on NCCL,
//! Allgather and ReduceScatter go to peer memory where asked, and every plan computes the
//! same result as the host reference.

use fusion::prelude::*;
use fusion::PeerMemoryCollectives;

fusion! {
    /// The Allreduce of a row-parallel layer's partial sums.
    pub fn allreduce<T: Float, d, n>(x: Tensor<T, [d @ DIDx, n]>) -> Tensor<T, [n]> {
        sum(x, 0)
    }
}

fusion! {
    /// Every rank gets every rank's block.
    pub fn allgather<T: Float, d, m>(x: Tensor<T, [d @ DIDx, m]>) -> Tensor<T, [d, m]> {
        set(x)
    }
}

fusion! {
    /// Each rank gets the sum of its block of every rank's partials.
    pub fn reduce_scatter<T: Float, d, m>(x: Tensor<T, [d @ DIDx, d, m]>) -> Tensor<T, [d @ DIDx, m]> {
        sum(x, 0)
    }
}

const DEVICES: [usize; 4] = [2, 3, 4, 8];

fn every_size() -> ExecOptions {
    let mut o = ExecOptions::default();
    o.lower.transports.peer_memory = PeerMemoryCollectives::UpTo(usize::MAX);
    o
}

fn never() -> ExecOptions {
    let mut o = ExecOptions::default();
    o.lower.transports.peer_memory = PeerMemoryCollectives::Never;
    o
}

/// `len` values that differ per rank and position.
fn values(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 31 + i * 7) % 19) as f32 - 9.0)
        .collect()
}

/// The host program's communications, one line each.
fn comm_lines(program: &str) -> Vec<String> {
    program
        .lines()
        .filter(|l| l.contains("backend="))
        .map(str::to_string)
        .collect()
}

#[test]
fn small_allreduces_run_over_peer_memory_and_sum_like_nccl() {
    for d in DEVICES {
        let world = World::local(d).unwrap();
        for (n, opts, backend) in [
            (1000, ExecOptions::default(), "backend=PeerMemory"),
            (1000, never(), "backend=NCCL"),
        ] {
            let rows: Vec<Vec<f32>> = (0..d).map(|r| values(r, n)).collect();
            let full = Tensor::from_f32(&[d, n], &rows.concat(), DType::F32).unwrap();
            let want: Vec<f32> = (0..n).map(|i| rows.iter().map(|r| r[i]).sum()).collect();
            let out = world
                .run(|rank| {
                    let x: Ranked<2> = rank.shard(&full, 0)?.try_into()?;
                    let program = allreduce::program(rank, &x, &opts)?.to_string();
                    let y = allreduce::call(rank, &x, &opts)?.into_inner();
                    Ok((program, rank.to_host(&y)?.to_f32_vec()?))
                })
                .unwrap();
            for (program, got) in out {
                let lines = comm_lines(&program);
                assert!(
                    lines.len() == 1 && lines[0].contains(backend),
                    "{d} devices: {program}"
                );
                if backend.contains("Peer") {
                    assert!(program.contains("Allreduce of `"), "{program}");
                    assert!(program.contains("(4000 B) on PeerMemory"), "{program}");
                }
                assert_eq!(got, want, "{d} devices, {backend}");
            }
        }
    }
}

#[test]
fn allgather_and_reduce_scatter_run_over_peer_memory_where_asked() {
    for d in DEVICES {
        let world = World::local(d).unwrap();
        let m = 37;
        let rows: Vec<Vec<f32>> = (0..d).map(|r| values(r, m)).collect();
        let gathered = Tensor::from_f32(&[d, m], &rows.concat(), DType::F32).unwrap();
        let partials: Vec<Vec<f32>> = (0..d).map(|r| values(r + 5, d * m)).collect();
        let stacked = Tensor::from_f32(&[d, d, m], &partials.concat(), DType::F32).unwrap();
        let out = world
            .run(|rank| {
                let o = every_size();
                let x: Ranked<2> = rank.shard(&gathered, 0)?.try_into()?;
                let default = allgather::program(rank, &x, &ExecOptions::default())?;
                assert!(comm_lines(&default.to_string())[0].contains("backend=NCCL"));
                let ag = allgather::program(rank, &x, &o)?.to_string();
                let all = rank.to_host(&allgather::call(rank, &x, &o)?.into_inner())?;
                let p: Ranked<3> = rank.shard(&stacked, 0)?.try_into()?;
                let rs = reduce_scatter::program(rank, &p, &o)?.to_string();
                let mine = rank.to_host(&reduce_scatter::call(rank, &p, &o)?.into_inner())?;
                Ok((ag, all.to_f32_vec()?, rs, mine.to_f32_vec()?, rank.index()))
            })
            .unwrap();
        for (ag, all, rs, mine, r) in out {
            assert!(comm_lines(&ag)[0].contains("backend=PeerMemory"), "{ag}");
            assert!(comm_lines(&rs)[0].contains("backend=PeerMemory"), "{rs}");
            assert_eq!(all, rows.concat(), "{d} devices: Allgather");
            let want: Vec<f32> = (0..m)
                .map(|i| partials.iter().map(|p| p[r * m + i]).sum())
                .collect();
            assert_eq!(mine, want, "{d} devices: ReduceScatter on rank {r}");
        }
    }
}

#[test]
fn allreduces_go_where_they_measured_faster_on_two_and_four_devices() {
    // f32: 256 KiB, 1 MiB and 16 MiB measured faster over peer memory on 2 and 4 devices;
    // 64 MiB on 2 only (NCCL on 4).
    for (bytes, d, backend) in [
        (256 << 10, 2, "backend=PeerMemory"),
        (256 << 10, 4, "backend=PeerMemory"),
        (1 << 20, 4, "backend=PeerMemory"),
        (16 << 20, 4, "backend=PeerMemory"),
        (64 << 20, 2, "backend=PeerMemory"),
        (64 << 20, 4, "backend=NCCL"),
    ] {
        let n = bytes / 4;
        let world = World::local(d).unwrap();
        let full = Tensor::from_f32(&[d, n], &vec![1.0; d * n], DType::F32).unwrap();
        let programs = world
            .run(|rank| {
                let x: Ranked<2> = rank.shard(&full, 0)?.try_into()?;
                Ok(allreduce::program(rank, &x, &ExecOptions::default())?.to_string())
            })
            .unwrap();
        for p in programs {
            assert!(
                comm_lines(&p)[0].contains(backend),
                "{bytes} B on {d} devices: {p}"
            );
        }
    }
}
