//! The choices that change a lowered program: [`LowerOptions`] and the enums it holds.
//!
//! Lowering reads them and so does every pass (through its context); they sit below both
//! so that neither has to reach into the other for them. Re-exported from [`crate::lower`].

use std::collections::BTreeSet;

/// Which copy streams copy-engine transfers run on ([`TransportOptions::copy_streams`]);
/// defined with the host program, which keeps the choice for the runtime.
pub use crate::hir::CopyStreams;
use crate::hir::Transport;

/// Order in which a P2P pipeline visits the chunks of its stream loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum P2pSchedule {
    /// Iteration `i` handles this device's chunk first, then receives from `rank - i` and
    /// sends to `rank + i` (a ring): communication starts at once and pairs always match.
    #[default]
    Ring,
    /// Iteration `i` exchanges chunk `i` with device `i` (mesh order; nvFuser's programs):
    /// a device's own chunk comes at its own index, and pairs are matched by coalescing.
    MeshOrder,
}

/// Where a backward's loops run their weight gradients: the GEMMs a loop accumulates over
/// its blocks (that a gather-scatter loop's last GEMM does not read). A loop that only
/// gathers (the row-parallel layer's backward: `dW = A^T AG(dY)`) keeps them in the loop
/// but with [`WeightGradients::AfterLoop`], which runs those that read only its gathered
/// rows and inputs after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WeightGradients {
    /// Block by block in the loop, after each step's ring send.
    InLoop,
    /// Those that read no result of the loop (only its gathered rows and inputs: the MLP
    /// block's dW2) once after it, one GEMM summed over every block (their rows land in a
    /// buffer of every block); the others in the loop. On 4 H200s 1-6% faster than
    /// [`WeightGradients::InLoop`] on every row, on 2 level (docs/DECISIONS.md).
    #[default]
    AfterLoopFromInputs,
    /// All of them once after the loop, the loop's results they read kept for every block:
    /// on 4 H100s faster at the largest MLP shape, slower at the others (its GEMMs no
    /// longer cover the loop's transfers; docs/DECISIONS.md). Also an AllGather loop's
    /// (faster only at the row-parallel backward's 16384,8192,8192 at D = 4 on 4 H200s).
    AfterLoop,
}

/// How a P2P reduce-scatter pipeline (a sum over DIDx folded into a stream loop) reduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ReduceScatterPipeline {
    /// [`ReduceScatterPipeline::Ring`] on 2 devices, [`ReduceScatterPipeline::Direct`] on
    /// more: on 4 H200s the ring's twice as many loop iterations cost more host time than
    /// its missing sum saves, on 2 it is 16-20% faster (docs/DECISIONS.md).
    #[default]
    Auto,
    /// Each step sends its partial straight to the device that owns that block; the owner
    /// sums the `D` partials after the loop (per round, with sub-chunks).
    Direct,
    /// A ring: each step's GEMM adds its partial onto the running sum received from the
    /// next device (in the GEMM's epilogue) and passes the sum on to the previous one; the
    /// last step's GEMM writes this device's finished block. No sum kernel, and nothing
    /// left after the last GEMM. Applies when the reduced tensor is the result of the
    /// loop's last expression, a 2-D matmul per chunk, with compute-first streams;
    /// otherwise the pipeline is [`ReduceScatterPipeline::Direct`].
    Ring,
}

impl ReduceScatterPipeline {
    /// The pipeline used on `world_size` devices ([`ReduceScatterPipeline::Auto`] decided).
    pub fn resolve(self, world_size: usize) -> ReduceScatterPipeline {
        match self {
            ReduceScatterPipeline::Auto if world_size == 2 => ReduceScatterPipeline::Ring,
            ReduceScatterPipeline::Auto => ReduceScatterPipeline::Direct,
            other => other,
        }
    }
}

/// Which passes run, and whether the program is recorded after each.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PassOptions {
    /// Names of passes to skip (see [`crate::pass::PassManager::standard`]).
    pub disabled: BTreeSet<String>,
    /// Record the program after every pass (`FUSION_DUMP=host_ir_passes`).
    pub dump_each: bool,
}

/// What carries a program's transfers and collectives. A world lowers them onto what it
/// has: where not every pair of ranks can copy into each other's memory, copy engines
/// become NCCL for every rank alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TransportOptions {
    /// Transport for the P2P pipelines' sends and receives. Copy engines by default: they
    /// use no SMs, so transfers do not slow the GEMMs they overlap. The CPU backend
    /// simulates whichever is named.
    pub p2p: Transport,
    /// Transport for Allgather and ReduceScatter (NCCL, or copy-engine transfers plus a
    /// local sum for ReduceScatter).
    pub collectives: Transport,
    /// Which collectives of the whole world run as kernels over peer memory
    /// ([`Transport::PeerMemory`]) instead: small ones, by message size
    /// ([`PeerMemoryCollectives`]). Worlds without peer access use `collectives`.
    pub peer_memory: PeerMemoryCollectives,
    /// Which copy streams a rank's copy-engine transfers run on: a stream per peer by
    /// default, or one for all ([`CopyStreams::One`]), which measured faster on some
    /// shapes, also with the receives ordered by the senders
    /// ([`CopyStreams::OneInSendOrder`]); plan candidates, so tuning picks them per shape.
    /// Programs without copy-engine transfers ignore it.
    pub copy_streams: CopyStreams,
    /// Whether a peer-memory Allreduce of a decode-size GEMM's product runs inside the GEMM
    /// (`lower::gemm_allreduce`: one kernel per rank whose epilogue exchanges the product's
    /// tiles). On by default; the runtime lowers with it only where the device runs the
    /// kernel.
    pub gemm_allreduce: bool,
}

impl Default for TransportOptions {
    fn default() -> Self {
        TransportOptions {
            p2p: Transport::CopyEngine,
            collectives: Transport::Nccl,
            peer_memory: PeerMemoryCollectives::Auto,
            copy_streams: CopyStreams::PerPeer,
            gemm_allreduce: true,
        }
    }
}

/// Which Allreduce, Allgather and ReduceScatter nodes of a program run over peer memory
/// ([`Transport::PeerMemory`]): a node of the whole world, outside stream loops, summing
/// (or gathering) f32, bf16 or f16, whose message is at most a size. A message is the
/// larger of what a rank holds before and after (for an Allreduce, the tensor).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PeerMemoryCollectives {
    /// At the sizes where peer memory measured faster than NCCL on this many devices
    /// ([`crate::lower::peer_memory_wins`]).
    #[default]
    Auto,
    /// Messages of at most this many bytes.
    UpTo(usize),
    /// Never: every collective on [`TransportOptions::collectives`] (or NCCL).
    Never,
}

/// How stream loops use streams and buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamOptions {
    /// Give stream-loop intermediates `numberOfStreams` slots instead of the full stream
    /// extent (a slot is reused by every `numberOfStreams`-th iteration, on the same stream).
    pub buffers: bool,
    /// In stream loops that compute and then communicate (GEMM + ReduceScatter), run the
    /// compute of every iteration in order on the caller's stream and only the
    /// communication on the pool stream: iteration `i`'s transfer then overlaps iteration
    /// `i + 1`'s GEMM, instead of all iterations' GEMMs contending for the SMs at once.
    pub compute_first: bool,
    /// Streams the ring reduce-scatter's GEMMs take turns on: 1 runs them on the caller's
    /// stream; 2 alternates two compute streams ([`crate::hir::StreamDef::Compute`]), so
    /// that the tail of one GEMM overlaps the start of the next. Values are clamped to
    /// `1..=COMPUTE_STREAMS`; a ring whose loop computes more than its GEMM uses one.
    pub ring_compute_streams: usize,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            buffers: true,
            compute_first: true,
            ring_compute_streams: 1,
        }
    }
}

/// Whether stream loops are pipelined, and the shape of the pipelines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PipelineOptions {
    /// Whether stream loops are pipelined at a call's shapes ([`Pipelining`]): by default
    /// only when every streamed GEMM has enough rows per chunk to hide a transfer
    /// ([`AUTO_MIN_CHUNK_ROWS`]); decode-sized calls get one collective and one GEMM.
    pub pipelining: Pipelining,
    /// Chunk order of P2P pipelines.
    pub p2p_schedule: P2pSchedule,
    /// How P2P reduce-scatter pipelines reduce (see [`ReduceScatterPipeline`]).
    pub reduce_scatter: ReduceScatterPipeline,
    /// Row ranges per device block in a P2P reduce-scatter pipeline (`None`: 2 for the
    /// ring, 1 for the direct pipeline). With `c > 1` the loop runs `D * c` iterations over
    /// `1/c` of each block's rows (the first axis after the Stream axis): the direct
    /// pipeline in `c` rounds, each summed as soon as its partials arrived; the ring with
    /// the transfer of one row range behind the GEMMs of the others. A loop whose rows
    /// cannot be split into contiguous ranges runs unsplit.
    pub reduce_scatter_subchunks: Option<usize>,
    /// Row ranges per gathered chunk in a P2P allgather pipeline that does not also
    /// reduce-scatter (AllGather + GEMM; `None` or 1: unsplit, the default). With `c > 1`
    /// the loop runs `D * c` iterations, each receiving `1/c` of a chunk's rows (the first
    /// axis after the Stream axis) and running the GEMM of those rows, so only `1/(D c)`
    /// of the GEMM is left after the last transfer instead of `1/D`. Ranges are
    /// `[r m / c, (r + 1) m / c)`: rows `c` does not divide give uneven ranges; a loop whose
    /// rows cannot be split into contiguous ranges runs unsplit. A loop that gathers and
    /// reduce-scatters takes its row ranges from [`Self::reduce_scatter_subchunks`].
    pub allgather_subchunks: Option<usize>,
    /// AllGather + GEMM loops whose transfers are all copy-engine ones as one persistent
    /// GEMM launched before the loop, which reads each peer's block as soon as the loop
    /// says it landed (`lower::gathered_gemm`; off by default, not yet measured in the
    /// runtime). The runtime lowers with it only where the device runs such a GEMM (Hopper
    /// GPUs with `GemmEngine::Persistent`, and the CPU backend, which computes it at the
    /// join); a loop it does not apply to keeps its pipeline.
    pub gathered_gemm: bool,
    /// GEMM + ReduceScatter pairs at the top level of the program as one persistent GEMM
    /// per rank whose epilogue adds each tile into its owner's output
    /// (`lower::gemm_reduce_scatter`; off by default). The runtime lowers with it only where
    /// the device runs such a GEMM (Hopper GPUs with every rank in one process); elsewhere
    /// the node runs as the GEMM, then the ReduceScatter.
    pub scattered_gemm: bool,
    /// Where a backward's loops run their weight gradients ([`WeightGradients`]).
    pub weight_gradients: WeightGradients,
}

/// Choices that change the lowered program, in four groups; part of the executor's cache
/// key. `LowerOptions::default()` is what a fusion call gets.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LowerOptions {
    /// Which passes run ([`PassOptions`]).
    pub passes: PassOptions,
    /// What carries transfers and collectives ([`TransportOptions`]).
    pub transports: TransportOptions,
    /// How stream loops use streams and buffers ([`StreamOptions`]).
    pub streams: StreamOptions,
    /// Whether and how loops are pipelined ([`PipelineOptions`]).
    pub pipelines: PipelineOptions,
}

impl LowerOptions {
    /// The plainest programs, the shape of nvFuser's host IR: P2P chunks in mesh order
    /// over NCCL, full-size stream buffers, every iteration of a stream loop on one pool
    /// stream, the direct reduce-scatter without row ranges.
    pub fn plain() -> Self {
        LowerOptions {
            transports: TransportOptions {
                p2p: Transport::Nccl,
                peer_memory: PeerMemoryCollectives::Never,
                ..TransportOptions::default()
            },
            streams: StreamOptions {
                buffers: false,
                compute_first: false,
                ..StreamOptions::default()
            },
            pipelines: PipelineOptions {
                p2p_schedule: P2pSchedule::MeshOrder,
                reduce_scatter: ReduceScatterPipeline::Direct,
                reduce_scatter_subchunks: Some(1),
                ..PipelineOptions::default()
            },
            ..LowerOptions::default()
        }
    }

    /// The reduce-scatter pipeline and its row ranges per block on `world_size` devices.
    pub fn reduce_scatter_plan(&self, world_size: usize) -> (ReduceScatterPipeline, usize) {
        let pipeline = self.pipelines.reduce_scatter.resolve(world_size);
        let default = if pipeline == ReduceScatterPipeline::Ring {
            2
        } else {
            1
        };
        (
            pipeline,
            self.pipelines
                .reduce_scatter_subchunks
                .unwrap_or(default)
                .max(1),
        )
    }

    /// Row ranges per gathered chunk of an allgather pipeline without a reduce-scatter
    /// ([`PipelineOptions::allgather_subchunks`]; 1 when unsplit).
    pub fn allgather_row_ranges(&self) -> usize {
        self.pipelines.allgather_subchunks.unwrap_or(1).max(1)
    }

    /// Options with the named pass disabled.
    pub fn without_pass(mut self, name: &str) -> Self {
        self.passes.disabled.insert(name.to_string());
        self
    }

    /// Options with `pipelining` ([`PipelineOptions::pipelining`]).
    pub fn with_pipelining(mut self, pipelining: Pipelining) -> Self {
        self.pipelines.pipelining = pipelining;
        self
    }

    /// Options with transfers and collectives on `transport` alone: NCCL or the copy
    /// engines for both (and no peer-memory collectives), or [`Transport::PeerMemory`] for
    /// every collective it can carry (it carries no P2P transfers, which keep theirs).
    pub fn with_transport(mut self, transport: Transport) -> Self {
        self.transports = match transport {
            Transport::PeerMemory => TransportOptions {
                peer_memory: PeerMemoryCollectives::UpTo(usize::MAX),
                ..self.transports
            },
            t => TransportOptions {
                p2p: t,
                collectives: t,
                peer_memory: PeerMemoryCollectives::Never,
                copy_streams: self.transports.copy_streams,
                gemm_allreduce: self.transports.gemm_allreduce,
            },
        };
        self
    }
}

/// Rows per chunk from which [`Pipelining::Auto`] pipelines a streamed GEMM.
pub const AUTO_MIN_CHUNK_ROWS: usize = 256;

/// When a fusion's `Stream` axes become pipelined host loops ([`LowerOptions`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Pipelining {
    /// Pipeline when every streamed GEMM has at least [`AUTO_MIN_CHUNK_ROWS`] rows per
    /// chunk at the call's shapes (always, when lowering without shapes).
    #[default]
    Auto,
    /// Pipeline when every streamed GEMM has at least this many rows per chunk.
    MinChunkRows(usize),
    /// Always pipeline (the programs the seeds and the stream-lowering tests pin).
    Always,
    /// Never pipeline: whole collectives around whole GEMMs.
    Never,
}

impl Pipelining {
    /// The rows-per-chunk threshold, or `None` for [`Pipelining::Never`].
    pub(crate) fn min_rows(self) -> Option<usize> {
        match self {
            Pipelining::Auto => Some(AUTO_MIN_CHUNK_ROWS),
            Pipelining::MinChunkRows(n) => Some(n),
            Pipelining::Always => Some(0),
            Pipelining::Never => None,
        }
    }
}
