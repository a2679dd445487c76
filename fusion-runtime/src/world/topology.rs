//! Where each rank of a world lives (host, process, device) and which transport connects
//! two ranks: exchanged once at bootstrap, then read by the communicators.

use crate::comm::remote::wire::{Reader, Writer};
use crate::error::Result;

/// What every rank tells the others at bootstrap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankInfo {
    /// The rank in the launched world.
    pub rank: usize,
    /// Host name.
    pub host: String,
    /// Operating-system process id.
    pub pid: u32,
    /// The launcher's index of the process.
    pub process: usize,
    /// `cpu`, or the GPU's UUID and PCI bus id.
    pub device: String,
    /// Backend-specific bytes (e.g. rank 0's NCCL unique id).
    pub extra: Vec<u8>,
}

impl RankInfo {
    /// The bytes sent in the hello.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.usize(self.rank)
            .str(&self.host)
            .u64(u64::from(self.pid))
            .usize(self.process)
            .str(&self.device)
            .bytes(&self.extra);
        w.0
    }

    /// Reads [`Self::encode`]'s bytes.
    pub fn decode(bytes: &[u8]) -> Result<RankInfo> {
        let mut r = Reader::new(bytes, "rank info");
        Ok(RankInfo {
            rank: r.usize()?,
            host: r.str()?,
            pid: r.u64()? as u32,
            process: r.usize()?,
            device: r.str()?,
            extra: r.bytes()?,
        })
    }
}

/// This machine's host name (`/proc/sys/kernel/hostname`, else `HOSTNAME`).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// How two ranks reach each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Link {
    /// Threads of one process.
    SameProcess,
    /// Processes of one host.
    SameHost,
    /// Different hosts.
    Network,
}

/// Every rank's [`RankInfo`], in rank order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// One per rank, in rank order.
    pub ranks: Vec<RankInfo>,
}

impl Topology {
    /// How ranks `a` and `b` are connected.
    pub fn link(&self, a: usize, b: usize) -> Link {
        let (x, y) = (&self.ranks[a], &self.ranks[b]);
        if x.host != y.host {
            Link::Network
        } else if x.pid == y.pid && x.process == y.process {
            Link::SameProcess
        } else {
            Link::SameHost
        }
    }

    /// Number of distinct hosts.
    pub fn hosts(&self) -> usize {
        let mut h: Vec<&str> = self.ranks.iter().map(|r| r.host.as_str()).collect();
        h.sort_unstable();
        h.dedup();
        h.len()
    }

    /// A line per rank: `rank 1: host a, pid 42, device ...`.
    pub fn describe(&self) -> String {
        self.ranks
            .iter()
            .map(|r| {
                format!(
                    "rank {}: host {}, process {} (pid {}), device {}",
                    r.rank, r.host, r.process, r.pid, r.device
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(rank: usize, host: &str, pid: u32) -> RankInfo {
        RankInfo {
            rank,
            host: host.into(),
            pid,
            process: pid as usize,
            device: "cpu".into(),
            extra: vec![rank as u8; rank],
        }
    }

    #[test]
    fn infos_round_trip_and_links_follow_host_and_process() {
        let t = Topology {
            ranks: vec![
                info(0, "a", 1),
                info(1, "a", 1),
                info(2, "a", 2),
                info(3, "b", 3),
            ],
        };
        for r in &t.ranks {
            assert_eq!(&RankInfo::decode(&r.encode()).unwrap(), r);
        }
        assert_eq!(t.link(0, 1), Link::SameProcess);
        assert_eq!(t.link(0, 2), Link::SameHost);
        assert_eq!(t.link(2, 3), Link::Network);
        assert_eq!(t.hosts(), 2);
        assert!(t.describe().contains("rank 3: host b"));
    }
}
