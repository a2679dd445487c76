//! Which candle device a rank's tensors live on, and the check that a candle tensor is
//! there.

use candle_core::DeviceLocation;
use fusion_runtime::{BackendKind, Rank};

use crate::error::{Error, Result};

/// The device a rank's tensors live on, in words.
pub(crate) fn rank_device(rank: &Rank) -> String {
    match rank.backend() {
        BackendKind::Cpu => "the CPU (a simulated device)".into(),
        BackendKind::Cuda => format!("cuda:{}", rank.device().ordinal()),
    }
}

/// Whether a candle tensor at `location` can be a tensor of `rank`'s device.
pub(crate) fn check_device(name: &str, location: &DeviceLocation, rank: &Rank) -> Result<()> {
    if location_matches(location, rank.backend(), rank.device().ordinal()) {
        Ok(())
    } else {
        Err(Error::Device {
            name: name.into(),
            found: format!("{location:?}"),
            rank: rank.index(),
            wanted: rank_device(rank),
        })
    }
}

/// The rule of [`check_device`]: CPU tensors for simulated CPU devices, `cuda:n` tensors
/// for the rank on GPU `n`.
fn location_matches(location: &DeviceLocation, backend: BackendKind, ordinal: usize) -> bool {
    match (location, backend) {
        (DeviceLocation::Cpu, BackendKind::Cpu) => true,
        (DeviceLocation::Cuda { gpu_id }, BackendKind::Cuda) => *gpu_id == ordinal,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_match_by_backend_and_ordinal() {
        let cuda = |gpu_id| DeviceLocation::Cuda { gpu_id };
        assert!(location_matches(&DeviceLocation::Cpu, BackendKind::Cpu, 3));
        assert!(location_matches(&cuda(1), BackendKind::Cuda, 1));
        assert!(
            !location_matches(&cuda(0), BackendKind::Cuda, 1),
            "another GPU"
        );
        assert!(
            !location_matches(&cuda(0), BackendKind::Cpu, 0),
            "GPU tensor, CPU rank"
        );
        assert!(!location_matches(
            &DeviceLocation::Cpu,
            BackendKind::Cuda,
            0
        ));
        let metal = DeviceLocation::Metal { gpu_id: 0 };
        assert!(!location_matches(&metal, BackendKind::Cpu, 0));
    }
}
