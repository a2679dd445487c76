//! One copy stream for every peer ([`CopyStreams::One`], a plan candidate), also with the
//! receives ordered by the senders ([`CopyStreams::OneInSendOrder`]): the pipelined
//! AllGather + GEMM over the copy engines on 2 and 4 simulated devices computes what a copy
//! stream per peer computes, and its program carries the choice (a note and
//! `HostProgram::copy_streams`); over NCCL the choice leaves the program as it was. The
//! CPU backend simulates the copies, so this checks the program and the call path; which
//! stream the copies run on is a GPU matter.

mod common;

use common::cases;
use common::*;
use fusion::compiler::hir::{HostProgram, Transport};
use fusion::compiler::lower::Pipelining;
use fusion::{CopyStreams, DType, ExecOptions, FusionExecutor, Tensor};

/// Runs AllGather + GEMM on `d` devices with `copy_streams` and P2P over `p2p`: the
/// assembled output and rank 0's program.
fn ag_matmul(d: usize, copy_streams: CopyStreams, p2p: Transport) -> (Tensor, HostProgram) {
    let (m, k, n) = (4, 6, 5);
    let inputs = vec![
        (Tensor::randn(&[d, m, k], DType::F32, 1), Give::Shard(0)),
        (Tensor::randn(&[k, n], DType::F32, 2), Give::Whole),
    ];
    let exec = FusionExecutor::new(cases::ag_matmul_p2p(DType::F32));
    let mut options = ExecOptions {
        race_check: true,
        ..ExecOptions::default()
    };
    options.lower.pipelines.pipelining = Pipelining::Always;
    options.lower.transports.p2p = p2p;
    options.lower.transports.copy_streams = copy_streams;
    let per_rank = world(d)
        .run(|rank| {
            let local = distribute(rank, &inputs)?;
            let refs: Vec<&Tensor> = local.iter().collect();
            let report = exec.run_with(rank, &refs, None, &options)?;
            let program = exec.program(rank, &refs, &options)?;
            Ok((rank.to_host(&report.outputs[0])?, (*program).clone()))
        })
        .unwrap_or_else(|e| panic!("AG+GEMM on {d} devices, {copy_streams:?}: {e}"));
    let (out, program) = per_rank.into_iter().next().expect("a rank");
    (out, program)
}

fn notes_one(p: &HostProgram) -> bool {
    p.to_string()
        .contains("// copy streams: one shared by all peers")
}

#[test]
fn one_copy_stream_computes_what_a_stream_per_peer_computes() {
    for d in [2, 4] {
        let (want, per_peer) = ag_matmul(d, CopyStreams::PerPeer, Transport::CopyEngine);
        let (got, one) = ag_matmul(d, CopyStreams::One, Transport::CopyEngine);
        assert_eq!(
            got.to_f32_vec().unwrap(),
            want.to_f32_vec().unwrap(),
            "{d} devices"
        );
        assert_eq!(one.copy_streams, CopyStreams::One);
        assert!(notes_one(&one), "{one}");
        assert_eq!(per_peer.copy_streams, CopyStreams::PerPeer);
        assert!(!notes_one(&per_peer), "{per_peer}");
        let (sent, in_order) = ag_matmul(d, CopyStreams::OneInSendOrder, Transport::CopyEngine);
        assert_eq!(
            sent.to_f32_vec().unwrap(),
            want.to_f32_vec().unwrap(),
            "{d} devices, in the senders' order"
        );
        assert_eq!(in_order.copy_streams, CopyStreams::OneInSendOrder);
        assert!(
            in_order.to_string().contains(
                "// copy streams: one shared by all peers, receives ordered by the senders"
            ),
            "{in_order}"
        );
    }
}

#[test]
fn without_copy_engine_transfers_the_choice_changes_nothing() {
    for d in [2, 4] {
        let (_, one) = ag_matmul(d, CopyStreams::One, Transport::Nccl);
        let (_, per_peer) = ag_matmul(d, CopyStreams::PerPeer, Transport::Nccl);
        assert_eq!(one.copy_streams, CopyStreams::PerPeer);
        assert_eq!(one.to_string(), per_peer.to_string());
    }
}
