//! Launch checks of a launched CUDA world: whether the processes of a node fit the GPUs
//! they see, and whether every rank has a GPU of its own and the same NCCL, each reported
//! with what was found and what to do. They are functions of what the processes see (GPU
//! counts, `CUDA_VISIBLE_DEVICES`, UUIDs, NCCL versions), so that they are tested with
//! faked device counts; `backend::cuda::world` feeds them the real answers, before the rendezvous
//! (what one process can see alone) and right after it (what only all ranks' infos show),
//! so every rank reports the same mistake within seconds, before NCCL starts.

use super::launcher::LaunchSpec;
use crate::error::{Error, Result};

/// The GPUs one process sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Visible {
    /// How many.
    pub count: usize,
    /// `CUDA_VISIBLE_DEVICES`, when set.
    pub cuda_visible_devices: Option<String>,
}

impl Visible {
    /// What this process sees, from its environment and `count` GPUs.
    pub(crate) fn from_env(count: usize) -> Visible {
        Visible {
            count,
            cuda_visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        }
    }

    /// `1 GPU is visible (CUDA_VISIBLE_DEVICES unset)`.
    pub(crate) fn describe(&self) -> String {
        let n = match self.count {
            1 => "1 GPU is".to_string(),
            n => format!("{n} GPUs are"),
        };
        match &self.cuda_visible_devices {
            None => format!("{n} visible (CUDA_VISIBLE_DEVICES unset)"),
            Some(v) => format!("{n} visible (CUDA_VISIBLE_DEVICES={v})"),
        }
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

/// The device ordinals of this process's `per_process` ranks, or why the process cannot
/// have them. A process that sees exactly `per_process` GPUs takes them all (the launcher
/// gave each process its own, e.g. through `CUDA_VISIBLE_DEVICES`); otherwise it takes its
/// block of the node's GPUs by its local index.
pub(crate) fn local_ordinals(
    spec: &LaunchSpec,
    per_process: usize,
    visible: &Visible,
) -> Result<Vec<usize>> {
    let me = format!(
        "process {} (local process {} of {} on this node)",
        spec.process, spec.local_process, spec.local_processes
    );
    if visible.count == 0 {
        let why = match &visible.cuda_visible_devices {
            Some(v) => format!("CUDA_VISIBLE_DEVICES={v} hides every GPU"),
            None => "the driver reports no GPU".into(),
        };
        return Err(Error::World(format!(
            "{me} sees no GPU: {why}. Make this node's GPUs visible (unset \
             CUDA_VISIBLE_DEVICES or list them in it), or set FUSION_BACKEND=cpu for \
             simulated devices"
        )));
    }
    if per_process > visible.count {
        return Err(Error::World(format!(
            "{me} asks for {} (FUSION_DEVICES_PER_PROCESS), but {}: ask for at most {} or \
             make more GPUs visible",
            plural(per_process, "GPU", "GPUs"),
            visible.describe(),
            visible.count
        )));
    }
    let fit = visible.count / per_process;
    let fix = format!(
        "Start at most {} on this node (torchrun --nproc-per-node {fit}), give each \
         process GPUs of its own with CUDA_VISIBLE_DEVICES, or run several ranks in one \
         process (FUSION_DEVICES_PER_PROCESS)",
        plural(fit, "process", "processes"),
    );
    if visible.count == per_process {
        // Every process sees the same GPUs when nothing set CUDA_VISIBLE_DEVICES: then the
        // node's processes need more GPUs than it has.
        if visible.cuda_visible_devices.is_none() && spec.local_processes > 1 {
            return Err(Error::World(format!(
                "{} run on this node with {} each, but {} to every process: their ranks \
                 would share GPUs, and NCCL allows one rank per GPU. {fix}",
                plural(spec.local_processes, "process", "processes"),
                plural(per_process, "rank", "ranks"),
                visible.describe()
            )));
        }
        return Ok((0..per_process).collect());
    }
    let first = spec.local_process * per_process;
    if first + per_process > visible.count {
        return Err(Error::World(format!(
            "{me} needs GPU{} {first}..{} for its {}, but {}. {fix}",
            if per_process == 1 { "" } else { "s" },
            first + per_process - 1,
            plural(per_process, "rank", "ranks"),
            visible.describe()
        )));
    }
    Ok((first..first + per_process).collect())
}

/// What the launch checks need to know about one rank, from its bootstrap info.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RankGpu {
    pub rank: usize,
    pub host: String,
    pub process: usize,
    /// The GPU's UUID.
    pub uuid: String,
    /// Its ordinal in the rank's process.
    pub ordinal: usize,
    /// What the rank's process sees.
    pub visible: Visible,
    /// `ncclGetVersion`'s code, or 0 when NCCL could not say.
    pub nccl: i32,
}

/// NCCL's version code as `major.minor.patch`.
pub(crate) fn nccl_version_name(code: i32) -> String {
    if code <= 0 {
        return "unknown".into();
    }
    // Codes from NCCL 2.9 on are major * 10000 + minor * 100 + patch; older ones
    // major * 1000 + minor * 100 + patch.
    let (major, rest) = if code >= 20900 {
        (code / 10000, code % 10000)
    } else {
        (code / 1000, code % 1000)
    };
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

/// Checks, with every rank's info, that no two ranks of different processes use one GPU
/// (unless `sharing` was asked for) and that every rank loaded the same NCCL (when the
/// world uses NCCL). The same answer on every rank.
pub(crate) fn check_ranks(ranks: &[RankGpu], sharing: bool) -> Result<()> {
    if !sharing {
        for (i, a) in ranks.iter().enumerate() {
            if let Some(b) = ranks[..i]
                .iter()
                .find(|b| b.uuid == a.uuid && b.process != a.process)
            {
                let on = if a.host == b.host {
                    format!(
                        "processes {} and {} on host {}",
                        b.process, a.process, a.host
                    )
                } else {
                    format!(
                        "process {} on host {} and process {} on host {}",
                        b.process, b.host, a.process, a.host
                    )
                };
                let same_host = ranks
                    .iter()
                    .filter(|r| r.host == a.host)
                    .map(|r| r.process)
                    .collect::<std::collections::BTreeSet<_>>()
                    .len();
                let fit = a.visible.count.max(1);
                return Err(Error::World(format!(
                    "ranks {} and {} ({on}) both use GPU {} (ordinal {} in each), and NCCL \
                     allows one rank per GPU: {} run on host {}, and to each {}. Start one \
                     process per GPU (at most {} on this host, e.g. torchrun \
                     --nproc-per-node {fit}), give each process a GPU of its own with \
                     CUDA_VISIBLE_DEVICES, or run several ranks in one process \
                     (FUSION_DEVICES_PER_PROCESS)",
                    b.rank,
                    a.rank,
                    a.uuid,
                    a.ordinal,
                    plural(same_host, "process", "processes"),
                    a.host,
                    a.visible.describe(),
                    plural(fit, "process", "processes"),
                )));
            }
        }
        let mut versions: Vec<i32> = ranks.iter().map(|r| r.nccl).collect();
        versions.sort_unstable();
        versions.dedup();
        if versions.len() > 1 {
            let each: Vec<String> = ranks
                .iter()
                .map(|r| {
                    format!(
                        "rank {} (host {}): NCCL {}",
                        r.rank,
                        r.host,
                        nccl_version_name(r.nccl)
                    )
                })
                .collect();
            return Err(Error::World(format!(
                "the ranks loaded different NCCL versions ({}); NCCL needs the same version on \
                 every rank: install the same NCCL on every node (e.g. the same nvidia-nccl \
                 wheel) or point LD_LIBRARY_PATH at one build",
                each.join(", ")
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::launcher::Launcher;

    fn spec(process: usize, processes: usize, local: usize, locals: usize) -> LaunchSpec {
        LaunchSpec {
            launcher: Launcher::Torchrun,
            process,
            processes,
            local_process: local,
            local_processes: locals,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        }
    }

    fn visible(count: usize, cvd: Option<&str>) -> Visible {
        Visible {
            count,
            cuda_visible_devices: cvd.map(String::from),
        }
    }

    #[test]
    fn two_processes_on_a_one_gpu_node_name_the_count_and_the_fix() {
        // torchrun --nproc-per-node 2 on a machine with one GPU.
        for p in 0..2 {
            let err = local_ordinals(&spec(p, 2, p, 2), 1, &visible(1, None))
                .unwrap_err()
                .to_string();
            for needle in [
                "2 processes run on this node",
                "1 GPU is visible (CUDA_VISIBLE_DEVICES unset)",
                "torchrun --nproc-per-node 1",
                "CUDA_VISIBLE_DEVICES",
            ] {
                assert!(err.contains(needle), "{needle}: {err}");
            }
        }
    }

    #[test]
    fn processes_take_their_block_of_the_node_gpus() {
        assert_eq!(
            local_ordinals(&spec(5, 8, 1, 4), 1, &visible(4, None)).unwrap(),
            vec![1]
        );
        assert_eq!(
            local_ordinals(&spec(1, 2, 1, 2), 2, &visible(4, None)).unwrap(),
            vec![2, 3]
        );
        // The launcher gave each process its own GPU.
        assert_eq!(
            local_ordinals(&spec(3, 4, 3, 4), 1, &visible(1, Some("3"))).unwrap(),
            vec![0]
        );
        // One process per node, one rank: no other process to share with.
        assert_eq!(
            local_ordinals(&spec(0, 2, 0, 1), 1, &visible(1, None)).unwrap(),
            vec![0]
        );
    }

    #[test]
    fn more_local_ranks_than_visible_gpus_is_an_error() {
        // Four processes, two GPUs visible: process 2 has none left.
        let err = local_ordinals(&spec(2, 4, 2, 4), 1, &visible(2, None))
            .unwrap_err()
            .to_string();
        for needle in ["needs GPU 2..2", "2 GPUs are visible", "--nproc-per-node 2"] {
            assert!(err.contains(needle), "{needle}: {err}");
        }
        // Two ranks per process on three GPUs.
        let err = local_ordinals(&spec(0, 1, 0, 1), 4, &visible(3, None))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("asks for 4 GPUs") && err.contains("3 GPUs are visible"),
            "{err}"
        );
    }

    #[test]
    fn cuda_visible_devices_that_hide_a_gpu_are_named() {
        let err = local_ordinals(&spec(3, 4, 3, 4), 1, &visible(2, Some("0,1")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("CUDA_VISIBLE_DEVICES=0,1"), "{err}");
        assert!(err.contains("needs GPU 3..3"), "{err}");
        let err = local_ordinals(&spec(0, 2, 0, 2), 1, &visible(0, Some("")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("CUDA_VISIBLE_DEVICES= hides every GPU"),
            "{err}"
        );
        assert!(err.contains("FUSION_BACKEND=cpu"), "{err}");
    }

    fn rank(rank: usize, host: &str, process: usize, uuid: &str, nccl: i32) -> RankGpu {
        RankGpu {
            rank,
            host: host.into(),
            process,
            uuid: uuid.into(),
            ordinal: 0,
            visible: visible(1, Some("0")),
            nccl,
        }
    }

    #[test]
    fn two_processes_on_one_gpu_are_found_from_the_uuids() {
        let ranks = [
            rank(0, "a", 0, "GPU-1", 22803),
            rank(1, "a", 1, "GPU-1", 22803),
        ];
        let err = check_ranks(&ranks, false).unwrap_err().to_string();
        for needle in [
            "ranks 0 and 1 (processes 0 and 1 on host a) both use GPU GPU-1",
            "one rank per GPU",
            "CUDA_VISIBLE_DEVICES=0",
            "--nproc-per-node 1",
        ] {
            assert!(err.contains(needle), "{needle}: {err}");
        }
        // Asked for (ranks sharing a GPU without NCCL): fine.
        assert!(check_ranks(&ranks, true).is_ok());
        // Ranks of one process on distinct GPUs, and a world of distinct GPUs: fine.
        let ok = [
            rank(0, "a", 0, "GPU-1", 22803),
            rank(1, "a", 1, "GPU-2", 22803),
            rank(2, "b", 2, "GPU-3", 22803),
        ];
        assert!(check_ranks(&ok, false).is_ok());
    }

    #[test]
    fn different_nccl_versions_are_listed() {
        let ranks = [
            rank(0, "a", 0, "GPU-1", 22803),
            rank(1, "b", 1, "GPU-2", 2708),
        ];
        let err = check_ranks(&ranks, false).unwrap_err().to_string();
        for needle in [
            "rank 0 (host a): NCCL 2.28.3",
            "rank 1 (host b): NCCL 2.7.8",
            "same NCCL",
        ] {
            assert!(err.contains(needle), "{needle}: {err}");
        }
        assert_eq!(nccl_version_name(21903), "2.19.3");
        assert_eq!(nccl_version_name(0), "unknown");
    }
}
