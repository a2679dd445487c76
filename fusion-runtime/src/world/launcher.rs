//! Which rank this process is, read from the launcher's environment.
//!
//! Launchers start one process per GPU (or per node) and tell each its place through
//! environment variables. When several launchers' variables are present, the first found
//! in this order wins:
//!
//! 1. `FUSION_RANK`, `FUSION_WORLD_SIZE` (and `FUSION_LOCAL_RANK`, `FUSION_LOCAL_WORLD_SIZE`):
//!    explicit, for any other launcher;
//! 2. torchrun: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`;
//! 3. Open MPI: `OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`, `_LOCAL_SIZE`;
//! 4. Slurm (inside an `srun` step): `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`,
//!    `SLURM_LOCALID`, and the tasks on this node from `SLURM_STEP_TASKS_PER_NODE`.
//!
//! torchrun comes before the others because it may itself run under `srun` or `mpirun`,
//! and then its variables describe its workers while the others describe the agent.
//!
//! The rendezvous (rank 0's process) listens on `MASTER_ADDR:MASTER_PORT`. Defaults where
//! they are unset: Slurm uses the first host of the step's node list and port
//! `20000 + SLURM_JOB_ID % 20000`; the others `127.0.0.1` when every process is on one
//! node, and port 29500. `FUSION_MASTER_ADDR` / `FUSION_MASTER_PORT` override everything.
//! torchrun's own agent store already listens on `MASTER_PORT` when it sets
//! `TORCHELASTIC_USE_AGENT_STORE=True`; the rendezvous then uses the next port.

use crate::config;
use crate::error::{Error, Result};

/// The launcher whose variables placed this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// `FUSION_RANK` and friends.
    Fusion,
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`.
    Torchrun,
    /// `OMPI_COMM_WORLD_*`.
    OpenMpi,
    /// `SLURM_PROCID` and the step's variables.
    Slurm,
}

impl Launcher {
    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Fusion => "FUSION_* variables",
            Launcher::Torchrun => "torchrun",
            Launcher::OpenMpi => "Open MPI",
            Launcher::Slurm => "Slurm",
        }
    }
}

/// This process's place among the launched processes, and where they meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Whose variables these were.
    pub launcher: Launcher,
    /// This process's index among all processes.
    pub process: usize,
    /// Number of processes.
    pub processes: usize,
    /// This process's index among the processes of its node.
    pub local_process: usize,
    /// Number of processes on this node.
    pub local_processes: usize,
    /// Where rank 0's process serves the rendezvous: its host...
    pub master_addr: String,
    /// ...and port.
    pub master_port: u16,
}

/// Default port when the launcher names none (torch's default).
pub const DEFAULT_PORT: u16 = 29500;

struct Names {
    launcher: Launcher,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

const LAUNCHERS: [Names; 3] = [
    Names {
        launcher: Launcher::Fusion,
        rank: config::RANK,
        size: config::WORLD_SIZE,
        local_rank: config::LOCAL_RANK,
        local_size: config::LOCAL_WORLD_SIZE,
    },
    Names {
        launcher: Launcher::Torchrun,
        rank: "RANK",
        size: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_size: "LOCAL_WORLD_SIZE",
    },
    Names {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        size: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
];

impl LaunchSpec {
    /// Reads the process environment; `None` when no launcher variables are set.
    pub fn from_env() -> Result<Option<LaunchSpec>> {
        LaunchSpec::from_vars(config::var)
    }

    /// Reads variables through `get` (the environment, or a map in tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchSpec>> {
        let num =
            |name: &str| -> Result<Option<usize>> {
                match get(name) {
                    None => Ok(None),
                    Some(v) => v.trim().parse().map(Some).map_err(|_| {
                        Error::World(format!("{name}={v} is not a non-negative integer"))
                    }),
                }
            };
        let mut found = None;
        for n in &LAUNCHERS {
            if let (Some(rank), Some(size)) = (num(n.rank)?, num(n.size)?) {
                let local_rank = num(n.local_rank)?;
                let local_size = num(n.local_size)?;
                found = Some((n.launcher, rank, size, local_rank, local_size));
                break;
            }
        }
        if found.is_none() {
            if let (Some(rank), Some(size)) = (num("SLURM_PROCID")?, num("SLURM_STEP_NUM_TASKS")?) {
                let local_rank = num("SLURM_LOCALID")?;
                let local_size = match (get("SLURM_STEP_TASKS_PER_NODE"), num("SLURM_NODEID")?) {
                    (Some(spec), Some(node)) => Some(tasks_on_node(&spec, node)?),
                    _ => None,
                };
                found = Some((Launcher::Slurm, rank, size, local_rank, local_size));
            }
        }
        let Some((launcher, process, processes, local_rank, local_size)) = found else {
            return Ok(None);
        };
        if processes == 0 || process >= processes {
            return Err(Error::World(format!(
                "{}: rank {process} is outside a world of {processes} processes",
                launcher.name()
            )));
        }
        // Without per-node variables, assume one node holds every process.
        let local_processes = local_size.unwrap_or(processes);
        let local_process = local_rank.unwrap_or(process % local_processes.max(1));
        if local_process >= local_processes {
            return Err(Error::World(format!(
                "{}: local rank {local_process} is outside the {local_processes} processes of \
                 this node",
                launcher.name()
            )));
        }
        let one_node = local_processes == processes;
        let addr = get(config::MASTER_ADDR).or_else(|| get("MASTER_ADDR"));
        let addr = match (addr, launcher) {
            (Some(a), _) => a,
            (None, Launcher::Slurm) => {
                let list = get("SLURM_STEP_NODELIST")
                    .or_else(|| get("SLURM_JOB_NODELIST"))
                    .ok_or_else(|| {
                        Error::World(
                            "Slurm: neither MASTER_ADDR nor SLURM_STEP_NODELIST is set".into(),
                        )
                    })?;
                first_host(&list)?
            }
            (None, _) if one_node => "127.0.0.1".to_string(),
            (None, l) => {
                return Err(Error::World(format!(
                    "{}: the processes span several nodes; set MASTER_ADDR (and MASTER_PORT) to \
                     rank 0's host",
                    l.name()
                )))
            }
        };
        let port = |name: &str| -> Result<Option<u16>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| Error::World(format!("{name}={v} is not a port number"))),
            }
        };
        let master_port = match port(config::MASTER_PORT)? {
            Some(p) => p,
            None => match port("MASTER_PORT")? {
                Some(p) if get("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True") => {
                    p.checked_add(1).ok_or_else(|| {
                        Error::World("MASTER_PORT=65535 leaves no port for the rendezvous".into())
                    })?
                }
                Some(p) => p,
                None if launcher == Launcher::Slurm => match num("SLURM_JOB_ID")? {
                    Some(job) => 20000 + (job % 20000) as u16,
                    None => DEFAULT_PORT,
                },
                None => DEFAULT_PORT,
            },
        };
        Ok(Some(LaunchSpec {
            launcher,
            process,
            processes,
            local_process,
            local_processes,
            master_addr: addr,
            master_port,
        }))
    }

    /// `addr:port` of the rendezvous.
    pub fn rendezvous(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// The first host of a Slurm host list: `node[01-04,07],gpu5` -> `node01`.
pub fn first_host(list: &str) -> Result<String> {
    let bad = || Error::World(format!("cannot read the Slurm host list `{list}`"));
    let list = list.trim();
    let first_end = {
        let mut depth = 0i32;
        list.char_indices()
            .find(|&(_, c)| {
                match c {
                    '[' => depth += 1,
                    ']' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .map_or(list.len(), |(i, _)| i)
    };
    let first = &list[..first_end];
    let Some(open) = first.find('[') else {
        return if first.is_empty() {
            Err(bad())
        } else {
            Ok(first.to_string())
        };
    };
    let close = first[open..].find(']').map(|i| open + i).ok_or_else(bad)?;
    let inner = &first[open + 1..close];
    let item = inner.split(',').next().ok_or_else(bad)?;
    let start = item.split('-').next().ok_or_else(bad)?;
    if start.is_empty() {
        return Err(bad());
    }
    let rest = &first[close + 1..];
    let rest = if rest.contains('[') {
        first_host(rest)?
    } else {
        rest.to_string()
    };
    Ok(format!("{}{}{}", &first[..open], start, rest))
}

/// Tasks on node `node` from `SLURM_STEP_TASKS_PER_NODE` (`2(x3),1`: 2 on each of the
/// first three nodes, 1 on the fourth).
pub fn tasks_on_node(spec: &str, node: usize) -> Result<usize> {
    let bad = || Error::World(format!("cannot read SLURM_STEP_TASKS_PER_NODE={spec}"));
    let mut seen = 0usize;
    for part in spec.split(',') {
        let (tasks, repeat) = match part.split_once("(x") {
            Some((t, r)) => (
                t,
                r.trim_end_matches(')')
                    .parse::<usize>()
                    .map_err(|_| bad())?,
            ),
            None => (part, 1),
        };
        let tasks: usize = tasks.trim().parse().map_err(|_| bad())?;
        if node < seen + repeat {
            return Ok(tasks);
        }
        seen += repeat;
    }
    Err(Error::World(format!(
        "SLURM_STEP_TASKS_PER_NODE={spec} lists {seen} nodes but this is node {node}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn spec(vars: &[(&str, &str)]) -> Result<Option<LaunchSpec>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchSpec::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn no_launcher_means_no_spec() {
        assert_eq!(spec(&[]).unwrap(), None);
        assert_eq!(spec(&[("RANK", "0")]).unwrap(), None, "RANK alone");
    }

    #[test]
    fn torchrun_variables() {
        let s = spec(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(s.launcher, Launcher::Torchrun);
        assert_eq!((s.process, s.processes), (3, 8));
        assert_eq!((s.local_process, s.local_processes), (1, 2));
        assert_eq!(s.rendezvous(), "node7:1234");
    }

    #[test]
    fn torchrun_agent_store_moves_the_port() {
        let s = spec(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(s.master_port, 29401);
        assert_eq!(s.master_addr, "127.0.0.1", "one node by default");
    }

    #[test]
    fn precedence_fusion_then_torchrun_then_mpi_then_slurm() {
        let all = [
            (config::RANK, "1"),
            (config::WORLD_SIZE, "2"),
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "6"),
            ("SLURM_PROCID", "4"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_STEP_NODELIST", "n1"),
        ];
        let expect = [
            (Launcher::Fusion, 1, 2),
            (Launcher::Torchrun, 2, 4),
            (Launcher::OpenMpi, 3, 6),
            (Launcher::Slurm, 4, 8),
        ];
        for (i, e) in expect.iter().enumerate() {
            let s = spec(&all[i * 2..]).unwrap().unwrap();
            assert_eq!((s.launcher, s.process, s.processes), *e);
        }
    }

    #[test]
    fn open_mpi_variables() {
        let s = spec(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((s.process, s.local_process, s.local_processes), (5, 1, 4));
        assert_eq!(s.master_port, DEFAULT_PORT);
        let err = spec(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ])
        .unwrap_err()
        .to_string();
        assert!(err.contains("MASTER_ADDR"), "{err}");
    }

    #[test]
    fn slurm_variables_and_host_lists() {
        let s = spec(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_STEP_NUM_TASKS", "7"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
            ("SLURM_STEP_NODELIST", "gpu[007-010],big1"),
            ("SLURM_JOB_ID", "123456"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(s.launcher, Launcher::Slurm);
        assert_eq!((s.local_process, s.local_processes), (1, 2));
        assert_eq!(s.master_addr, "gpu007");
        assert_eq!(s.master_port, 20000 + 3456);
        assert_eq!(first_host("a1,b2").unwrap(), "a1");
        assert_eq!(first_host("rack[3,5]-n[1-2]").unwrap(), "rack3-n1");
        assert!(first_host("").is_err());
        assert_eq!(tasks_on_node("2(x3),1", 3).unwrap(), 1);
        assert!(tasks_on_node("2(x3),1", 4).is_err());
        // An sbatch script outside `srun` has SLURM_PROCID but no step: not launched.
        assert_eq!(
            spec(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")]).unwrap(),
            None
        );
    }

    #[test]
    fn bad_values_are_named() {
        let err = spec(&[("RANK", "x"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("RANK=x"), "{err}");
        let err = spec(&[("RANK", "2"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("outside"), "{err}");
        let err = spec(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "99999")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("MASTER_PORT"), "{err}");
    }
}
