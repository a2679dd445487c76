//! Point-to-point transfers and groups.

use fusion_compiler::hir::Transport;
use fusion_compiler::DType;

use super::{input, run_world, LONG, SHORT};
use crate::comm::Communicator;
use crate::error::Error;
use crate::tensor::Tensor;

#[test]
fn ring_inside_a_group_does_not_deadlock() {
    for n in [2, 3, 4, 8] {
        let (_, outs) = run_world(n, LONG, |cm| {
            let r = cm.rank();
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let buf = Tensor::zeros(&[2, 3], DType::F32);
            cm.group_start().unwrap();
            // The receive is issued first: inside a group it waits until group_end.
            cm.recv(0, prev, &buf, Transport::Nccl).unwrap();
            cm.send(0, next, &input(20, r, &[2, 3]), Transport::Nccl)
                .unwrap();
            cm.group_end().unwrap();
            buf.to_f32_vec().unwrap()
        });
        for (r, out) in outs.iter().enumerate() {
            let prev = (r + n - 1) % n;
            assert_eq!(
                out,
                &input(20, prev, &[2, 3]).to_f32_vec().unwrap(),
                "world {n}, rank {r}"
            );
        }
    }
}

#[test]
fn messages_between_a_pair_arrive_in_send_order() {
    let (_, outs) = run_world(2, LONG, |cm| {
        if cm.rank() == 0 {
            cm.send(0, 1, &Tensor::full(&[3], DType::F32, 1.0), Transport::Nccl)
                .unwrap();
            cm.send(0, 1, &Tensor::full(&[3], DType::F32, 2.0), Transport::Nccl)
                .unwrap();
            return vec![];
        }
        let (a, b) = (
            Tensor::zeros(&[3], DType::F32),
            Tensor::zeros(&[3], DType::F32),
        );
        cm.recv(0, 0, &a, Transport::Nccl).unwrap();
        cm.recv(0, 0, &b, Transport::Nccl).unwrap();
        vec![a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap()]
    });
    assert_eq!(outs[1], vec![vec![1.0; 3], vec![2.0; 3]]);
}

#[test]
fn recv_into_a_strided_view() {
    let (_, outs) = run_world(2, LONG, |cm| {
        if cm.rank() == 0 {
            cm.send(0, 1, &input(21, 0, &[3, 2]), Transport::Nccl)
                .unwrap();
            return None;
        }
        let base = Tensor::zeros(&[2, 3], DType::F32);
        cm.recv(0, 0, &base.permute(&[1, 0]).unwrap(), Transport::Nccl)
            .unwrap();
        Some(base.permute(&[1, 0]).unwrap().to_f32_vec().unwrap())
    });
    assert_eq!(outs[1], Some(input(21, 0, &[3, 2]).to_f32_vec().unwrap()));
}

#[test]
fn bad_peers_groups_and_sizes_are_errors() {
    let (_, outs) = run_world(2, SHORT, |cm| {
        let t = Tensor::zeros(&[3], DType::F32);
        let r = cm.rank();
        let mut errs = vec![
            cm.send(0, r, &t, Transport::Nccl).is_err(),
            cm.send(0, 7, &t, Transport::Nccl).is_err(),
            cm.recv(0, r, &t, Transport::Nccl).is_err(),
            cm.group_end().is_err(),
        ];
        cm.group_start().unwrap();
        errs.push(cm.group_start().is_err());
        cm.group_end().unwrap();
        // A size mismatch: rank 0 sends 3 elements, rank 1 expects 4.
        if r == 0 {
            cm.send(0, 1, &t, Transport::Nccl).unwrap();
        } else {
            let e = cm
                .recv(0, 0, &Tensor::zeros(&[4], DType::F32), Transport::Nccl)
                .unwrap_err();
            errs.push(matches!(e, Error::Communication { rank: 1, .. }));
        }
        errs
    });
    assert!(outs[0].iter().all(|&e| e), "{:?}", outs[0]);
    assert!(outs[1].iter().all(|&e| e), "{:?}", outs[1]);
}
