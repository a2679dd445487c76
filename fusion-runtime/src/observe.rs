//! Where a fusion call shows up outside the runtime: a `tracing` span per call (target
//! `fusion`, level INFO: the fusion's name, the rank, and how it ran) and per executed
//! host-IR node (target `fusion::node`, level DEBUG), and with the `nvtx` feature NVTX
//! ranges around both, so an Nsight Systems timeline names the fusion and its nodes.
//!
//! With no subscriber listening (and without `nvtx`), a call costs one disabled span and
//! the walk one check per call: node scopes are only made when something listens.

use fusion_compiler::hir::Node;

/// The span (and NVTX range) of one fusion call; ends when dropped.
pub(crate) struct CallScope {
    span: tracing::span::EnteredSpan,
}

impl CallScope {
    /// Enters the scope of a call of fusion `name` on `rank`.
    pub(crate) fn enter(name: &str, rank: usize) -> CallScope {
        let span = tracing::info_span!(
            target: "fusion",
            "fusion call",
            fusion = name,
            rank,
            run = tracing::field::Empty
        )
        .entered();
        #[cfg(feature = "nvtx")]
        nvtx::range_push!("fusion {name} (rank {rank})");
        CallScope { span }
    }

    /// Records how the call ran: `replayed`, `captured` or `walked`.
    pub(crate) fn ran(&self, how: &'static str) {
        self.span.record("run", how);
    }
}

#[cfg(feature = "nvtx")]
impl Drop for CallScope {
    fn drop(&mut self) {
        nvtx::range_pop!();
    }
}

/// Whether node scopes are wanted for this call (a subscriber listens for node spans, or
/// NVTX ranges are built in): checked once per call.
pub(crate) fn node_scopes_wanted() -> bool {
    cfg!(feature = "nvtx") || tracing::enabled!(target: "fusion::node", tracing::Level::DEBUG)
}

/// The span (and NVTX range) of one executed node; ends when dropped.
pub(crate) struct NodeScope {
    _span: tracing::span::EnteredSpan,
}

impl NodeScope {
    /// Enters the scope of node `n` (its pre-order `id` when known).
    pub(crate) fn enter(n: &Node, id: Option<usize>) -> NodeScope {
        let label = label(n);
        let span = tracing::debug_span!(target: "fusion::node", "node", op = %label, id).entered();
        #[cfg(feature = "nvtx")]
        nvtx::range_push!("{label}");
        NodeScope { _span: span }
    }
}

#[cfg(feature = "nvtx")]
impl Drop for NodeScope {
    fn drop(&mut self) {
        nvtx::range_pop!();
    }
}

/// What a node does, in a word or two: the op of a compute node, the collective of a
/// communication, `send`/`recv`, else the node's kind.
fn label(n: &Node) -> String {
    use fusion_compiler::hir::P2PDirection;
    match n {
        Node::Compute(e) => e.op.name(),
        Node::Communication(c) => c.kind.name().to_string(),
        Node::P2P(p) => match p.direction {
            P2PDirection::Send => "send".into(),
            P2PDirection::Recv => "recv".into(),
        },
        other => format!("{:?}", other.kind()),
    }
}
