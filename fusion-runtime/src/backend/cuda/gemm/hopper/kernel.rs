//! What the host knows of the persistent Hopper GEMM (`gemm.cu`): its variants, its launch
//! geometry, and its source as NVRTC compiles it. NVRTC opens no files, so the source is
//! `gemm.cu` with its include (`wgmma.inc.cu`) pasted in, and one `HOPPER_GEMM` line that
//! instantiates the variant. The geometry must match `gemm.cu`'s `#define`s (a unit test
//! reads them).

use fusion_compiler::ir::UnaryOp;

/// The kernel's source, as the repository holds it.
const GEMM_CU: &str = include_str!("gemm.cu");
/// The file `gemm.cu` includes: the wgmma instructions.
const WGMMA_INC: &str = include_str!("wgmma.inc.cu");
/// The line of `gemm.cu` that includes [`WGMMA_INC`].
const INCLUDE_LINE: &str = "#include \"wgmma.inc.cu\"";

/// Output tile rows.
pub(crate) const BM: u32 = 128;
/// Output tile columns.
pub(crate) const BN: u32 = 256;
/// Depth of one K step.
const BK: u32 = 64;
/// Shared-memory stages of the operand ring.
const STAGES: u32 = 4;
/// Consumer warpgroups (each multiplies 64 rows of a tile).
const CONSUMERS: u32 = 2;
/// Threads per block: a loader warpgroup and the consumers.
pub(crate) const THREADS: u32 = 128 * (CONSUMERS + 1);
/// Bytes of one stage: an A tile and a B tile of bf16/f16.
const STAGE_BYTES: u32 = BM * BK * 2 + BN * BK * 2;
/// Output pieces (64 x 64) per consumer in the epilogue.
const PIECES: u32 = 2;
/// Bytes of the epilogue's output pieces.
const OUT_BYTES: u32 = CONSUMERS * PIECES * 64 * 64 * 2;
/// Dynamic shared memory of a block: the stages, the output pieces, 1024 bytes of slack to
/// align for the swizzle, the barriers (two per stage, two per piece).
pub(crate) const SMEM_BYTES: u32 =
    STAGES * STAGE_BYTES + OUT_BYTES + 1024 + 2 * (STAGES + CONSUMERS * PIECES) * 8;

/// The architecture NVRTC compiles the kernel for: wgmma, `setmaxnreg` and the bulk tensor
/// copies are instructions of sm_90a only.
pub(crate) const ARCH: &str = "compute_90a";

/// `gemm.cu`'s code of activation `op` (`ACT_*`), where the kernel has it.
pub(crate) fn activation_code(op: UnaryOp) -> Option<i32> {
    Some(match op {
        UnaryOp::Relu => 1,
        UnaryOp::Gelu => 2,
        UnaryOp::GeluTanh => 3,
        UnaryOp::Silu => 4,
        UnaryOp::Sigmoid => 5,
        UnaryOp::Tanh => 6,
        _ => return None,
    })
}

/// The code (`ACT_*`) of the activation whose derivative `op` is, where the kernel's
/// `slope` has it: what [`Entry::Slope`] multiplies by.
pub(crate) fn slope_code(op: UnaryOp) -> Option<u8> {
    let act = match op {
        UnaryOp::ReluGrad => UnaryOp::Relu,
        UnaryOp::GeluGrad => UnaryOp::Gelu,
        UnaryOp::GeluTanhGrad => UnaryOp::GeluTanh,
        UnaryOp::SiluGrad => UnaryOp::Silu,
        UnaryOp::SigmoidGrad => UnaryOp::Sigmoid,
        UnaryOp::TanhGrad => UnaryOp::Tanh,
        _ => return None,
    };
    activation_code(act).map(|c| c as u8)
}

/// One instantiation of the kernel: the operands' dtype and how each is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    /// f16 operands (else bf16).
    pub f16: bool,
    /// A is M-contiguous (a transposed view), else K-contiguous (row-major).
    pub a_mn: bool,
    /// B is K-contiguous (a transposed view), else N-contiguous (row-major).
    pub b_k: bool,
}

/// Which entry of `gemm.cu` a variant instantiates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Entry {
    /// `HOPPER_GEMM`: one GEMM.
    Plain,
    /// `HOPPER_GEMM_AG`: a GEMM whose A is gathered while it runs (`AgArgs`).
    AllGather,
    /// `HOPPER_GEMM_RS`: a GEMM whose tiles are added into their owners' outputs
    /// (`RsArgs`), with [`RS_STAGES`] stages and [`RS_PIECES`] pieces.
    ReduceScatter,
    /// `HOPPER_GEMM_SLOPE`: a GEMM whose product is multiplied by the derivative of the
    /// activation `gemm.cu` codes as this `ACT_*` at an auxiliary matrix (`AuxArgs`).
    Slope(u8),
    /// `HOPPER_GEMM_ADD`: a GEMM whose product is added to an auxiliary matrix (`AuxArgs`):
    /// an accumulating GEMM, in place or from an addend.
    Add,
}

/// Operand stages of the ReduceScatter entry: its consumers stage whole tiles for the
/// storer warps, which leaves room for three.
const RS_STAGES: u32 = 3;
/// Output pieces per consumer of the ReduceScatter entry: a whole 128 x 256 tile.
const RS_PIECES: u32 = 4;

impl Entry {
    /// The macro that instantiates it, and the prefix of its names (a slope entry's names
    /// carry its activation's code: `hopper_gemm_slope3`).
    fn spelled(self) -> (&'static str, String) {
        match self {
            Entry::Plain => ("HOPPER_GEMM", "hopper_gemm".into()),
            Entry::AllGather => ("HOPPER_GEMM_AG", "hopper_gemm_ag".into()),
            Entry::ReduceScatter => ("HOPPER_GEMM_RS", "hopper_gemm_rs".into()),
            Entry::Slope(act) => ("HOPPER_GEMM_SLOPE", format!("hopper_gemm_slope{act}")),
            Entry::Add => ("HOPPER_GEMM_ADD", "hopper_gemm_add".into()),
        }
    }

    /// The instantiating macro's arguments after the layout ones.
    fn extra_arguments(self) -> String {
        match self {
            Entry::ReduceScatter => format!(", {RS_STAGES}, {RS_PIECES}"),
            Entry::Slope(act) => format!(", {act}"),
            Entry::Plain | Entry::AllGather | Entry::Add => String::new(),
        }
    }
}

impl Variant {
    /// The name of `entry` for this variant: `hopper_gemm_<dtype>_<a><b>` for the plain
    /// entry, `n` for a row-major operand and `t` for a transposed one (the harness's
    /// names); `hopper_gemm_ag_bf16_nn` for the AllGather entry.
    pub(crate) fn entry_name(self, entry: Entry) -> String {
        let t = |transposed: bool| if transposed { 't' } else { 'n' };
        format!(
            "{}_{}_{}{}",
            entry.spelled().1,
            if self.f16 { "f16" } else { "bf16" },
            t(self.a_mn),
            t(self.b_k)
        )
    }

    /// The source NVRTC compiles for `entry` of this variant: `gemm.cu` with
    /// `wgmma.inc.cu` in place of its include, then the entry's instantiating line.
    pub(crate) fn entry_source(self, entry: Entry) -> String {
        let body = GEMM_CU.replacen(INCLUDE_LINE, WGMMA_INC, 1);
        format!(
            "{body}\n{}({}, {}, {}, {}{})\n",
            entry.spelled().0,
            self.entry_name(entry),
            self.f16,
            self.a_mn,
            self.b_k,
            entry.extra_arguments()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define NAME value` in `gemm.cu`.
    fn define(name: &str) -> String {
        let prefix = format!("#define {name} ");
        GEMM_CU
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .unwrap_or_else(|| panic!("gemm.cu defines no {name}"))
            .trim()
            .to_string()
    }

    #[test]
    fn the_geometry_matches_the_kernels_defines() {
        for (name, value) in [
            ("BM", BM),
            ("BN", BN),
            ("BK", BK),
            ("STAGES", STAGES),
            ("PIECES", PIECES),
            ("CONSUMERS", CONSUMERS),
        ] {
            assert_eq!(define(name), value.to_string(), "{name}");
        }
        // The formulas as gemm.cu writes them, which the constants above compute.
        assert_eq!(define("THREADS"), "(128 * (CONSUMERS + 1))");
        assert_eq!(define("A_BYTES"), "(BM * BK * 2)");
        assert_eq!(define("B_BYTES"), "(BN * BK * 2)");
        assert_eq!(define("STAGE_BYTES"), "(A_BYTES + B_BYTES)");
        assert_eq!(define("OUT_PIECE_BYTES"), "(64 * 64 * 2)");
        assert_eq!(
            define("SMEM_FOR(NS, NP)"),
            "((NS) * STAGE_BYTES + CONSUMERS * (NP) * OUT_PIECE_BYTES + 1024 + 2 * ((NS) + CONSUMERS * (NP)) * 8)"
        );
        assert_eq!(define("SMEM_BYTES"), "SMEM_FOR(STAGES, PIECES)");
        assert_eq!((THREADS, SMEM_BYTES), (384, 230_528));
    }

    #[test]
    fn the_source_pastes_the_include_and_instantiates_one_variant() {
        let v = Variant {
            f16: false,
            a_mn: true,
            b_k: false,
        };
        assert_eq!(v.entry_name(Entry::Plain), "hopper_gemm_bf16_tn");
        let src = v.entry_source(Entry::Plain);
        assert!(!src.contains("#include"), "NVRTC cannot open includes");
        assert!(src.contains("wgmma.mma_async.sync.aligned.m64n256k16.f32.\" #TY"));
        // The pasted instructions come before the code that calls them.
        let defined = src.find("void wgmma_bf16(").expect("wgmma_bf16 defined");
        let used = src.find("wgmma_bf16(d, da").expect("wgmma_bf16 called");
        assert!(defined < used);
        assert!(src
            .trim_end()
            .ends_with("HOPPER_GEMM(hopper_gemm_bf16_tn, false, true, false)"));
    }

    #[test]
    fn the_reduce_scatter_and_slope_entries_fit_the_plain_entrys_shared_memory() {
        let v = Variant {
            f16: false,
            a_mn: false,
            b_k: false,
        };
        let src = v.entry_source(Entry::ReduceScatter);
        assert!(src
            .trim_end()
            .ends_with("HOPPER_GEMM_RS(hopper_gemm_rs_bf16_nn, false, false, false, 3, 4)"));
        // Launched with the plain entry's shared memory (SMEM_FOR(STAGES, PIECES)), which
        // must hold its own SMEM_FOR(RS_STAGES, RS_PIECES).
        let rs = RS_STAGES * STAGE_BYTES
            + CONSUMERS * RS_PIECES * 64 * 64 * 2
            + 1024
            + 2 * (RS_STAGES + CONSUMERS * RS_PIECES) * 8;
        assert!(rs <= SMEM_BYTES, "{rs} > {SMEM_BYTES}");
        // The auxiliary-matrix entries run with the same stages and pieces.
        assert!(v
            .entry_source(Entry::Slope(3))
            .contains("gemm_body<F16, A_MN, B_K, 3, 4, WALK_PLAIN, AUX>"));
        assert!(v
            .entry_source(Entry::Add)
            .trim_end()
            .ends_with("HOPPER_GEMM_ADD(hopper_gemm_add_bf16_nn, false, false, false)"));
        assert_eq!((RS_STAGES, RS_PIECES), (3, 4));
    }

    /// NVRTC compiles every variant for `compute_90a` (no GPU needed; skipped, saying so,
    /// where NVRTC cannot be loaded).
    #[test]
    fn nvrtc_compiles_every_variant() {
        if !crate::backend::cuda::libs::nvrtc_present() {
            eprintln!("skipping: NVRTC (libnvrtc.so) cannot be loaded here");
            return;
        }
        for bits in 0..8 {
            let v = Variant {
                f16: bits & 1 != 0,
                a_mn: bits & 2 != 0,
                b_k: bits & 4 != 0,
            };
            let opts = cudarc::nvrtc::CompileOptions {
                arch: Some(ARCH),
                ..Default::default()
            };
            for entry in [
                Entry::Plain,
                Entry::AllGather,
                Entry::ReduceScatter,
                Entry::Slope(3),
                Entry::Add,
            ] {
                let name = v.entry_name(entry);
                let ptx = cudarc::nvrtc::compile_ptx_with_opts(v.entry_source(entry), opts.clone())
                    .unwrap_or_else(|e| panic!("{name}: {e:?}"));
                let text = ptx.to_src();
                assert!(text.contains(&format!(".entry {name}(")), "{name}");
                assert!(text.contains(".target sm_90a"));
            }
        }
    }

    #[test]
    fn every_variant_has_its_own_name() {
        let mut names = std::collections::HashSet::new();
        for bits in 0..8 {
            let v = Variant {
                f16: bits & 1 != 0,
                a_mn: bits & 2 != 0,
                b_k: bits & 4 != 0,
            };
            assert!(names.insert(v.entry_name(Entry::Plain)));
        }
        assert!(names.contains("hopper_gemm_f16_nt"));
        let v = Variant {
            f16: false,
            a_mn: false,
            b_k: true,
        };
        assert_eq!(v.entry_name(Entry::AllGather), "hopper_gemm_ag_bf16_nt");
        assert!(v
            .entry_source(Entry::AllGather)
            .trim_end()
            .ends_with("HOPPER_GEMM_AG(hopper_gemm_ag_bf16_nt, false, false, true)"));
        assert_eq!(v.entry_name(Entry::Slope(3)), "hopper_gemm_slope3_bf16_nt");
        assert!(v
            .entry_source(Entry::Slope(3))
            .trim_end()
            .ends_with("HOPPER_GEMM_SLOPE(hopper_gemm_slope3_bf16_nt, false, false, true, 3)"));
    }
}
