//! Every collective kind against references built from all ranks' inputs.

use fusion_compiler::hir::{Communication, CommunicationKind as K};
use fusion_compiler::ir::ReduceOp;
use fusion_compiler::DType;

use super::{comm, input, reduce_ref, run_world, stack_ref, world, LONG};
use crate::comm::Communicator;
use crate::tensor::Tensor;

const SIZES: [usize; 5] = [1, 2, 3, 4, 8];

#[test]
fn allgather_outer_axis() {
    for n in SIZES {
        let c = comm(K::Allgather, &world(n), &world(n));
        let c = Communication {
            in_sharded_axis: Some(0),
            out_sharded_axis: Some(0),
            ..c
        };
        let (_, outs) = run_world(n, LONG, |comm_| {
            let x = input(1, comm_.rank(), &[1, 3, 2]);
            let y = Tensor::zeros(&[n, 3, 2], DType::F32);
            comm_.collective(0, &c, Some(&x), Some(&y)).unwrap();
            y.to_f32_vec().unwrap()
        });
        let inputs: Vec<Tensor> = (0..n).map(|r| input(1, r, &[1, 3, 2])).collect();
        let expected = stack_ref(&inputs, 0, &[n, 3, 2]);
        for (r, out) in outs.iter().enumerate() {
            assert_eq!(out, &expected, "world {n}, rank {r}");
        }
    }
}

#[test]
fn allgather_inner_axis_into_strided_bf16_view() {
    for n in [2, 3, 4] {
        let c = Communication {
            in_sharded_axis: Some(1),
            out_sharded_axis: Some(1),
            ..comm(K::Allgather, &world(n), &world(n))
        };
        let x_of = |r: usize| {
            Tensor::from_f32(
                &[2, 1, 3],
                &input(2, r, &[2, 1, 3]).to_f32_vec().unwrap(),
                DType::BF16,
            )
            .unwrap()
        };
        let (_, outs) = run_world(n, LONG, |cm| {
            let x = x_of(cm.rank());
            // [2, n, 3] as a permuted view of an [n, 2, 3] buffer.
            let y = Tensor::zeros(&[n, 2, 3], DType::BF16)
                .permute(&[1, 0, 2])
                .unwrap();
            cm.collective(0, &c, Some(&x), Some(&y)).unwrap();
            y.to_f32_vec().unwrap()
        });
        let inputs: Vec<Tensor> = (0..n).map(x_of).collect();
        let expected = stack_ref(&inputs, 1, &[2, n, 3]);
        for out in &outs {
            assert_eq!(out, &expected, "world {n}");
        }
    }
}

#[test]
fn allreduce_sum_and_max() {
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        for n in SIZES {
            let c = Communication {
                in_sharded_axis: Some(0),
                reduce_op: Some(op),
                ..comm(K::Allreduce, &world(n), &world(n))
            };
            let (_, outs) = run_world(n, LONG, |cm| {
                let x = input(3, cm.rank(), &[1, 4, 3]);
                let y = Tensor::zeros(&[4, 3], DType::F32);
                cm.collective(0, &c, Some(&x), Some(&y)).unwrap();
                y.to_f32_vec().unwrap()
            });
            let parts: Vec<Vec<f32>> = (0..n)
                .map(|r| input(3, r, &[1, 4, 3]).to_f32_vec().unwrap())
                .collect();
            let expected = reduce_ref(op, &parts);
            for out in &outs {
                assert_eq!(out, &expected, "{op:?}, world {n}");
            }
        }
    }
}

#[test]
fn reduce_scatter_axis0_scatter_axis1() {
    for n in SIZES {
        let c = Communication {
            in_sharded_axis: Some(0),
            in_scatter_axis: Some(1),
            out_sharded_axis: Some(0),
            reduce_op: Some(ReduceOp::Sum),
            ..comm(K::ReduceScatter, &world(n), &world(n))
        };
        let (_, outs) = run_world(n, LONG, |cm| {
            let x = input(4, cm.rank(), &[1, n, 3, 2]);
            let y = Tensor::zeros(&[1, 3, 2], DType::F32);
            cm.collective(0, &c, Some(&x), Some(&y)).unwrap();
            y.to_f32_vec().unwrap()
        });
        let parts: Vec<Vec<f32>> = (0..n)
            .map(|r| input(4, r, &[1, n, 3, 2]).to_f32_vec().unwrap())
            .collect();
        let full =
            Tensor::from_f32(&[n, 3, 2], &reduce_ref(ReduceOp::Sum, &parts), DType::F32).unwrap();
        for (r, out) in outs.iter().enumerate() {
            let expected = full.narrow(0, r, 1).unwrap().to_f32_vec().unwrap();
            assert_eq!(out, &expected, "world {n}, rank {r}");
        }
    }
}

#[test]
fn reduce_scatter_inner_blocks_max() {
    // input [2, 1, n]: sharded axis 1, scatter axis 2; reduced [2, n]; output [2, 1].
    for n in [2, 3, 4] {
        let c = Communication {
            in_sharded_axis: Some(1),
            in_scatter_axis: Some(2),
            out_sharded_axis: Some(1),
            reduce_op: Some(ReduceOp::Max),
            ..comm(K::ReduceScatter, &world(n), &world(n))
        };
        let (_, outs) = run_world(n, LONG, |cm| {
            let x = input(5, cm.rank(), &[2, 1, n]);
            let y = Tensor::zeros(&[2, 1], DType::F32);
            cm.collective(0, &c, Some(&x), Some(&y)).unwrap();
            y.to_f32_vec().unwrap()
        });
        let parts: Vec<Vec<f32>> = (0..n)
            .map(|r| input(5, r, &[2, 1, n]).to_f32_vec().unwrap())
            .collect();
        let full =
            Tensor::from_f32(&[2, n], &reduce_ref(ReduceOp::Max, &parts), DType::F32).unwrap();
        for (r, out) in outs.iter().enumerate() {
            assert_eq!(
                out,
                &full.narrow(1, r, 1).unwrap().to_f32_vec().unwrap(),
                "world {n}, rank {r}"
            );
        }
    }
}

#[test]
fn scatter_from_root_zero() {
    for n in SIZES {
        let c = Communication {
            root: Some(0),
            in_scatter_axis: Some(0),
            out_sharded_axis: Some(0),
            ..comm(K::Scatter, &world(n), &world(n))
        };
        let x = input(6, 0, &[n, 4]);
        let (_, outs) = run_world(n, LONG, |cm| {
            let y = Tensor::zeros(&[1, 4], DType::F32);
            let x = (cm.rank() == 0).then_some(&x);
            cm.collective(0, &c, x, Some(&y)).unwrap();
            y.to_f32_vec().unwrap()
        });
        for (r, out) in outs.iter().enumerate() {
            assert_eq!(
                out,
                &x.narrow(0, r, 1).unwrap().to_f32_vec().unwrap(),
                "world {n}, rank {r}"
            );
        }
    }
}

#[test]
fn scatter_from_root_outside_mesh() {
    let c = Communication {
        root: Some(0),
        in_scatter_axis: Some(1),
        out_sharded_axis: Some(1),
        ..comm(K::Scatter, &[1, 2, 0], &[1, 2])
    };
    let x = input(7, 0, &[3, 2, 5]);
    let (_, outs) = run_world(3, LONG, |cm| {
        if cm.rank() == 0 {
            cm.collective(0, &c, Some(&x), None).unwrap();
            return None;
        }
        let y = Tensor::zeros(&[3, 1, 5], DType::F32);
        cm.collective(0, &c, None, Some(&y)).unwrap();
        Some(y.to_f32_vec().unwrap())
    });
    assert_eq!(outs[0], None);
    for (r, out) in outs.iter().enumerate().skip(1) {
        let expected = x.narrow(1, r - 1, 1).unwrap().to_f32_vec().unwrap();
        assert_eq!(out.as_ref(), Some(&expected), "rank {r}");
    }
}

#[test]
fn broadcast_from_root_zero_and_from_outside_mesh() {
    for n in SIZES {
        let c = Communication {
            root: Some(0),
            ..comm(K::Broadcast, &world(n), &world(n))
        };
        let x = input(8, 0, &[2, 3]);
        let (_, outs) = run_world(n, LONG, |cm| {
            let y = Tensor::zeros(&[2, 3], DType::F32);
            let x = (cm.rank() == 0).then_some(&x);
            cm.collective(0, &c, x, Some(&y)).unwrap();
            y.to_f32_vec().unwrap()
        });
        for out in &outs {
            assert_eq!(out, &x.to_f32_vec().unwrap(), "world {n}");
        }
    }
    let c = Communication {
        root: Some(0),
        ..comm(K::Broadcast, &[1, 2, 0], &[1, 2])
    };
    let x = input(9, 0, &[4]);
    let (_, outs) = run_world(3, LONG, |cm| {
        if cm.rank() == 0 {
            cm.collective(0, &c, Some(&x), None).unwrap();
            return None;
        }
        let y = Tensor::zeros(&[4], DType::F32);
        cm.collective(0, &c, None, Some(&y)).unwrap();
        Some(y.to_f32_vec().unwrap())
    });
    assert_eq!(outs[0], None);
    assert_eq!(outs[1], Some(x.to_f32_vec().unwrap()));
    assert_eq!(outs[2], Some(x.to_f32_vec().unwrap()));
}

#[test]
fn gather_to_root_in_and_outside_mesh() {
    for n in [2, 3, 4, 8] {
        let root = n - 1;
        let c = Communication {
            root: Some(root),
            in_sharded_axis: Some(0),
            out_sharded_axis: Some(0),
            ..comm(K::Gather, &world(n), &world(n))
        };
        let (_, outs) = run_world(n, LONG, |cm| {
            let x = input(10, cm.rank(), &[1, 5]);
            let y = (cm.rank() == root).then(|| Tensor::zeros(&[n, 5], DType::F32));
            cm.collective(0, &c, Some(&x), y.as_ref()).unwrap();
            y.map(|y| y.to_f32_vec().unwrap())
        });
        let inputs: Vec<Tensor> = (0..n).map(|r| input(10, r, &[1, 5])).collect();
        assert_eq!(
            outs[root],
            Some(stack_ref(&inputs, 0, &[n, 5])),
            "world {n}"
        );
        assert!(outs[..root].iter().all(Option::is_none));
    }
    let c = Communication {
        root: Some(2),
        in_sharded_axis: Some(0),
        out_sharded_axis: Some(0),
        ..comm(K::Gather, &[0, 1, 2], &[0, 1])
    };
    let (_, outs) = run_world(3, LONG, |cm| {
        if cm.rank() == 2 {
            let y = Tensor::zeros(&[2, 5], DType::F32);
            cm.collective(0, &c, None, Some(&y)).unwrap();
            return Some(y.to_f32_vec().unwrap());
        }
        cm.collective(0, &c, Some(&input(11, cm.rank(), &[1, 5])), None)
            .unwrap();
        None
    });
    let inputs: Vec<Tensor> = (0..2).map(|r| input(11, r, &[1, 5])).collect();
    assert_eq!(outs[2], Some(stack_ref(&inputs, 0, &[2, 5])));
}

#[test]
fn reduce_to_root_in_and_outside_mesh() {
    for (n, team, mesh, root, op) in [
        (4, vec![0, 1, 2, 3], vec![0, 1, 2, 3], 2, ReduceOp::Max),
        (3, vec![1, 2, 0], vec![1, 2], 0, ReduceOp::Sum),
        (1, vec![0], vec![0], 0, ReduceOp::Sum),
    ] {
        let c = Communication {
            root: Some(root),
            in_sharded_axis: Some(0),
            reduce_op: Some(op),
            ..comm(K::Reduce, &team, &mesh)
        };
        let (_, outs) = run_world(n, LONG, |cm| {
            let r = cm.rank();
            let x = mesh.contains(&r).then(|| input(12, r, &[1, 6]));
            let y = (r == root).then(|| Tensor::zeros(&[6], DType::F32));
            cm.collective(0, &c, x.as_ref(), y.as_ref()).unwrap();
            y.map(|y| y.to_f32_vec().unwrap())
        });
        let parts: Vec<Vec<f32>> = mesh
            .iter()
            .map(|&r| input(12, r, &[1, 6]).to_f32_vec().unwrap())
            .collect();
        assert_eq!(outs[root], Some(reduce_ref(op, &parts)), "world {n}");
    }
}

#[test]
fn send_recv_pairs_moving_the_sharded_axis() {
    // world 4: 0 -> 2 and 1 -> 3 at once; [1, 4] arrives as [4, 1].
    let pairs = [(0, 2), (1, 3)];
    let comms: Vec<_> = pairs
        .iter()
        .map(|&(s, r)| Communication {
            root: Some(s),
            receiver: Some(r),
            in_sharded_axis: Some(0),
            out_sharded_axis: Some(1),
            ..comm(K::SendRecv, &[s, r], &[s])
        })
        .collect();
    let (_, outs) = run_world(4, LONG, |cm| {
        let r = cm.rank();
        let c = &comms[r % 2];
        if r < 2 {
            cm.collective(0, c, Some(&input(13, r, &[1, 4])), None)
                .unwrap();
            None
        } else {
            let y = Tensor::zeros(&[4, 1], DType::F32);
            cm.collective(0, c, None, Some(&y)).unwrap();
            Some(y.to_f32_vec().unwrap())
        }
    });
    assert_eq!(outs[2], Some(input(13, 0, &[1, 4]).to_f32_vec().unwrap()));
    assert_eq!(outs[3], Some(input(13, 1, &[1, 4]).to_f32_vec().unwrap()));
}

#[test]
fn send_recv_to_itself() {
    let c = Communication {
        root: Some(0),
        receiver: Some(0),
        ..comm(K::SendRecv, &[0, 0], &[0])
    };
    let (_, outs) = run_world(1, LONG, |cm| {
        let x = input(14, 0, &[3]);
        let y = Tensor::zeros(&[3], DType::F32);
        cm.collective(0, &c, Some(&x), Some(&y)).unwrap();
        y.to_f32_vec().unwrap()
    });
    assert_eq!(outs[0], input(14, 0, &[3]).to_f32_vec().unwrap());
}

#[test]
fn interleaved_and_overlapping_teams() {
    let pair = |team: &[usize]| Communication {
        in_sharded_axis: Some(0),
        reduce_op: Some(ReduceOp::Sum),
        ..comm(K::Allreduce, team, team)
    };
    let (low, high, all) = (pair(&[0, 1]), pair(&[2, 3]), pair(&[0, 1, 2, 3]));
    let (front, back) = (pair(&[0, 1, 2]), pair(&[1, 2, 3]));
    let value = |round: usize, r: usize| Tensor::full(&[1, 2], DType::F32, (10 * round + r) as f32);
    let (fabric, outs) = run_world(4, LONG, |cm| {
        let r = cm.rank();
        let mut got = Vec::new();
        for round in 0..10 {
            let mine = if r < 2 { &low } else { &high };
            let y = Tensor::zeros(&[2], DType::F32);
            cm.collective(0, mine, Some(&value(round, r)), Some(&y))
                .unwrap();
            got.push(y.to_f32_vec().unwrap()[0]);
            cm.collective(0, &all, Some(&value(round, r)), Some(&y))
                .unwrap();
            got.push(y.to_f32_vec().unwrap()[0]);
            for team in [&front, &back] {
                if team.team.contains(&r) {
                    cm.collective(0, team, Some(&value(round, r)), Some(&y))
                        .unwrap();
                    got.push(y.to_f32_vec().unwrap()[0]);
                }
            }
        }
        got
    });
    for (r, got) in outs.iter().enumerate() {
        let mut expected = Vec::new();
        for round in 0..10 {
            let sum = |ranks: &[usize]| ranks.iter().map(|&q| (10 * round + q) as f32).sum::<f32>();
            expected.push(if r < 2 { sum(&[0, 1]) } else { sum(&[2, 3]) });
            expected.push(sum(&[0, 1, 2, 3]));
            if r < 3 {
                expected.push(sum(&[0, 1, 2]));
            }
            if r > 0 {
                expected.push(sum(&[1, 2, 3]));
            }
        }
        assert_eq!(got, &expected, "rank {r}");
    }
    assert_eq!(fabric.open_slots(), 0);
}

#[test]
fn many_consecutive_collectives_pair_up_in_order() {
    let n = 4;
    let c = Communication {
        in_sharded_axis: Some(0),
        reduce_op: Some(ReduceOp::Sum),
        ..comm(K::Allreduce, &world(n), &world(n))
    };
    let g = Communication {
        in_sharded_axis: Some(0),
        out_sharded_axis: Some(0),
        ..comm(K::Allgather, &world(n), &world(n))
    };
    let rounds = 200u64;
    let (fabric, outs) = run_world(n, LONG, |cm| {
        let mut bad = 0;
        for i in 0..rounds {
            let x = input(100 + i, cm.rank(), &[1, 8]);
            let y = Tensor::zeros(&[8], DType::F32);
            cm.collective(0, &c, Some(&x), Some(&y)).unwrap();
            let parts: Vec<Vec<f32>> = (0..n)
                .map(|r| input(100 + i, r, &[1, 8]).to_f32_vec().unwrap())
                .collect();
            bad += usize::from(y.to_f32_vec().unwrap() != reduce_ref(ReduceOp::Sum, &parts));
            if i % 10 == 0 {
                let z = Tensor::zeros(&[n, 8], DType::F32);
                cm.collective(0, &g, Some(&x), Some(&z)).unwrap();
                let inputs: Vec<Tensor> = (0..n).map(|r| input(100 + i, r, &[1, 8])).collect();
                bad += usize::from(z.to_f32_vec().unwrap() != stack_ref(&inputs, 0, &[n, 8]));
            }
        }
        bad
    });
    assert_eq!(outs, vec![0; n]);
    assert_eq!(fabric.open_slots(), 0);
}
