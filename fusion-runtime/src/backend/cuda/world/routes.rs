//! How each pair of a CUDA world's ranks reaches the other, decided once when the world is
//! made: copy engines between GPUs of one process with peer access and over CUDA IPC
//! between processes of a host that connected it, NCCL P2P otherwise. A world whose pairs
//! all have copy engines lowers its transfers onto them; any other world lowers them onto
//! NCCL (every rank runs the same program, so the choice is the world's).

use crate::comm::PeerCopies;

/// How one rank reaches another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// GPUs of one process with peer access to each other: copy engines.
    CopyEngines,
    /// Another process of this host, connected over CUDA IPC: copy engines.
    Ipc,
    /// GPUs of one process without peer access to each other: NCCL P2P.
    NoPeerAccess,
    /// Another host, or another process of this host without CUDA IPC: NCCL P2P.
    Nccl,
}

impl Route {
    /// Whether the pair has copy engines.
    fn copies(self) -> bool {
        matches!(self, Route::CopyEngines | Route::Ipc)
    }

    /// The route as a number (exchanged between processes at world construction).
    pub(crate) fn code(self) -> f32 {
        match self {
            Route::CopyEngines => 0.0,
            Route::Ipc => 1.0,
            Route::NoPeerAccess => 2.0,
            Route::Nccl => 3.0,
        }
    }

    /// The route of [`Route::code`] `c`.
    fn from_code(c: f32) -> Route {
        match c as u8 {
            0 => Route::CopyEngines,
            1 => Route::Ipc,
            2 => Route::NoPeerAccess,
            _ => Route::Nccl,
        }
    }
}

/// Every pair's route, by the ranks of the world that was launched (or made in process):
/// sub-worlds look their pairs up here through their members' ranks in it.
#[derive(Debug)]
pub(crate) struct Routes {
    size: usize,
    table: Vec<Route>,
}

impl Routes {
    /// The routes of `size` ranks of one process: copy engines, but NCCL P2P between the
    /// GPUs of `no_peer_access` (pairs of ranks, either order).
    pub(crate) fn in_process(size: usize, no_peer_access: &[(usize, usize)]) -> Routes {
        let lacks = |a: usize, b: usize| {
            (no_peer_access.iter()).any(|&(x, y)| (x.min(y), x.max(y)) == (a.min(b), a.max(b)))
        };
        Routes {
            size,
            table: (0..size * size)
                .map(|i| match lacks(i / size, i % size) {
                    true => Route::NoPeerAccess,
                    false => Route::CopyEngines,
                })
                .collect(),
        }
    }

    /// The routes from every rank's row of [`Route::code`]s (`rows[r][p]`: how rank `r`
    /// reaches rank `p`).
    pub(crate) fn from_codes(rows: &[Vec<f32>]) -> Routes {
        let size = rows.len();
        Routes {
            size,
            table: (0..size * size)
                .map(|i| {
                    let code = rows[i / size].get(i % size).copied();
                    code.map_or(Route::Nccl, Route::from_code)
                })
                .collect(),
        }
    }

    fn get(&self, a: usize, b: usize) -> Route {
        if a < self.size && b < self.size {
            self.table[a * self.size + b]
        } else {
            Route::Nccl
        }
    }

    /// Whether every pair of `members` (ranks of the table; a world's ranks in order) has
    /// copy engines, both ways.
    pub(crate) fn peer_copies(&self, members: &[usize]) -> PeerCopies {
        let every = members.iter().enumerate().all(|(i, &a)| {
            members[..i]
                .iter()
                .all(|&b| self.get(a, b).copies() && self.get(b, a).copies())
        });
        match every {
            true => PeerCopies::EveryPair,
            false => PeerCopies::NotEveryPair,
        }
    }

    /// How member `me` (a position in `members`) reaches every other member, one line per
    /// peer, numbered as the members' world numbers them.
    pub(crate) fn lines(&self, members: &[usize], me: usize) -> Vec<String> {
        let copies = self.peer_copies(members) == PeerCopies::EveryPair;
        (0..members.len())
            .filter(|&p| p != me)
            .map(|p| {
                let route = self.get(members[me], members[p]);
                let how = match (route, copies) {
                    (Route::CopyEngines, true) => "copy engines (peer access, same process)",
                    (Route::Ipc, true) => {
                        "copy engines over CUDA IPC (another process of this host)"
                    }
                    (Route::NoPeerAccess, _) => {
                        "NCCL P2P (same process, but the GPUs have no peer access to each other)"
                    }
                    (Route::Nccl, _) => {
                        "NCCL P2P (another host, or another process of this host without CUDA IPC)"
                    }
                    (_, false) => {
                        "NCCL P2P (copy engines reach this peer, but not every pair of the \
                         world has them, so every transfer of the world goes through NCCL)"
                    }
                };
                format!("rank {me} -> rank {p}: {how}; collectives NCCL")
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_world_copies_only_when_every_pair_does() {
        let all = Routes::in_process(3, &[]);
        assert_eq!(all.peer_copies(&[0, 1, 2]), PeerCopies::EveryPair);
        assert!(all.lines(&[0, 1, 2], 0)[0].contains("copy engines (peer access"));
        let one_pair = Routes::in_process(3, &[(2, 1)]);
        assert_eq!(one_pair.peer_copies(&[0, 1, 2]), PeerCopies::NotEveryPair);
        let lines = one_pair.lines(&[0, 1, 2], 1);
        assert!(lines[0].starts_with("rank 1 -> rank 0: NCCL P2P (copy engines reach"));
        assert!(lines[1].contains("no peer access"), "{lines:?}");
        // A sub-world of the ranks that do reach each other copies.
        assert_eq!(one_pair.peer_copies(&[0, 2]), PeerCopies::EveryPair);
        assert!(one_pair.lines(&[0, 2], 1)[0].starts_with("rank 1 -> rank 0: copy engines"));
    }

    #[test]
    fn rows_exchanged_between_processes_give_the_same_table() {
        let rows = vec![
            vec![Route::CopyEngines.code(), Route::Ipc.code()],
            vec![Route::Ipc.code(), Route::CopyEngines.code()],
        ];
        let routes = Routes::from_codes(&rows);
        assert_eq!(routes.peer_copies(&[0, 1]), PeerCopies::EveryPair);
        assert!(routes.lines(&[0, 1], 1)[0].contains("over CUDA IPC"));
        let one_way = Routes::from_codes(&[
            vec![Route::CopyEngines.code(), Route::Ipc.code()],
            vec![Route::Nccl.code(), Route::CopyEngines.code()],
        ]);
        assert_eq!(one_way.peer_copies(&[0, 1]), PeerCopies::NotEveryPair);
    }
}
