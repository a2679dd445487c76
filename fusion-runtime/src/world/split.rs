//! Sub-worlds: a world split into groups (e.g. tensor-parallel groups of 2 or 4 inside a
//! larger data-parallel world). Each group is a world of its own, with ranks numbered from
//! 0, its own key space on the fabric and, on GPUs, its own NCCL communicator; a fusion
//! runs on a group exactly as on a world, and every group can run at once.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::{Hosts, World, WorldShared};
use crate::comm::local::{LocalCommunicator, LocalFabric, Membership};
use crate::error::{Error, Result};

/// The key space of group `group` of split number `split` of the world in `parent`.
fn space_of(parent: u64, split: u64, group: usize) -> u64 {
    // FNV-1a over the three numbers: distinct groups get distinct spaces (0 is the
    // launched world's own).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in [parent, split, group as u64] {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h.max(1)
}

impl World {
    /// Splits the world into consecutive groups of `group_size` ranks (ranks
    /// `0..group_size`, then the next `group_size`, ...). Returns the groups that hold
    /// ranks of this process, in order (one for a process with one rank). Every rank of
    /// the world must call it (it is collective on GPUs).
    pub fn split(&self, group_size: usize) -> Result<Vec<World>> {
        if group_size == 0 || self.shared.size % group_size != 0 {
            return Err(Error::World(format!(
                "cannot split a world of {} ranks into groups of {group_size}",
                self.shared.size
            )));
        }
        let groups: Vec<Vec<usize>> = (0..self.shared.size / group_size)
            .map(|g| (g * group_size..(g + 1) * group_size).collect())
            .collect();
        self.split_groups(&groups)
    }

    /// Splits the world into `groups` (lists of ranks; every rank in exactly one group;
    /// a group's rank `i` is `groups[g][i]`). Returns the groups that hold ranks of this
    /// process, in the order of `groups`.
    pub fn split_groups(&self, groups: &[Vec<usize>]) -> Result<Vec<World>> {
        let mut owner = vec![None; self.shared.size];
        for (g, members) in groups.iter().enumerate() {
            if members.is_empty() {
                return Err(Error::World(format!("group {g} of the split is empty")));
            }
            for &r in members {
                match owner.get_mut(r) {
                    None => {
                        return Err(Error::World(format!(
                            "group {g} names rank {r}, outside the world of {} ranks",
                            self.shared.size
                        )))
                    }
                    Some(Some(other)) => {
                        return Err(Error::World(format!(
                            "rank {r} is in groups {other} and {g}"
                        )))
                    }
                    Some(slot) => *slot = Some(g),
                }
            }
        }
        if let Some(r) = owner.iter().position(Option::is_none) {
            return Err(Error::World(format!(
                "rank {r} is in no group of the split"
            )));
        }
        let split = self.splits.fetch_add(1, Ordering::SeqCst);
        let mut worlds = Vec::new();
        for (g, members) in groups.iter().enumerate() {
            // Positions in this process's ranks of the group's members, in group order.
            let local: Vec<usize> = members
                .iter()
                .filter_map(|r| self.local.iter().position(|(x, _)| x == r))
                .collect();
            if local.is_empty() {
                continue;
            }
            let space = space_of(self.space, split, g);
            let sub_rank = |pos: usize| {
                let r = self.local[pos].0;
                members.iter().position(|&m| m == r).expect("a member")
            };
            let size = members.len();
            let (hosts, setup_hosts) = match &self.hosts {
                Hosts::Fixed(v) => {
                    let h: Vec<Arc<LocalCommunicator>> = local
                        .iter()
                        .map(|&pos| {
                            Arc::new(LocalCommunicator::new(
                                v[pos].fabric().clone(),
                                Membership {
                                    rank: sub_rank(pos),
                                    size,
                                    space,
                                    world_rank: v[pos].membership().world_rank,
                                },
                            ))
                        })
                        .collect();
                    (Hosts::Fixed(h.clone()), h)
                }
                Hosts::InProcess => {
                    // Every member is in this process: a fabric for the setup only.
                    let fabric = LocalFabric::new(size, self.timeout);
                    let h = local
                        .iter()
                        .map(|&pos| Arc::new(fabric.communicator(sub_rank(pos))))
                        .collect();
                    (Hosts::InProcess, h)
                }
            };
            let device_comms = match &self.device_comms {
                Some(c) => Some(c.subset(&local, &setup_hosts, size)?),
                None => None,
            };
            worlds.push(World {
                shared: Arc::new(WorldShared::new(
                    size,
                    self.shared.kind,
                    self.shared.session.clone(),
                    space,
                )),
                local: local
                    .iter()
                    .map(|&pos| (sub_rank(pos), self.local[pos].1.clone()))
                    .collect(),
                hosts,
                device_comms,
                timeout: self.timeout,
                space,
                splits: Default::default(),
                ranks: Default::default(),
            });
        }
        Ok(worlds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;
    use fusion_compiler::DType;

    #[test]
    fn groups_of_an_in_process_world_are_worlds_of_their_own() {
        let world = World::local(4).unwrap();
        let groups = world.split(2).unwrap();
        assert_eq!(groups.len(), 2);
        for (g, w) in groups.iter().enumerate() {
            assert_eq!(w.size(), 2);
            assert_eq!(w.local_ranks(), vec![0, 1]);
            let sums = w
                .run(|rank| {
                    let t = Tensor::full(&[1], DType::F32, (g * 10 + rank.index()) as f32);
                    let all = rank.gather_to_host(&t)?;
                    Ok(all.iter().map(|x| x.to_f32_vec().unwrap()[0]).sum::<f32>())
                })
                .unwrap();
            let expect = (g * 20 + 1) as f32;
            assert_eq!(sums, vec![expect, expect]);
        }
        assert!(world.split(3).is_err());
        let err = match world.split_groups(&[vec![0, 1], vec![1, 2, 3]]) {
            Ok(_) => panic!("overlapping groups must be refused"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains("rank 1 is in groups 0 and 1"), "{err}");
        assert!(world.split_groups(&[vec![0, 1, 2]]).is_err());
        assert_ne!(space_of(0, 0, 0), space_of(0, 0, 1));
        assert_ne!(space_of(0, 0, 0), space_of(0, 1, 0));
    }
}
