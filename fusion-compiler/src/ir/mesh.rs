//! Device meshes: the ordered set of devices a tensor lives on.

use std::fmt;

/// The devices holding a tensor. A DIDx axis is sharded over them in this order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub enum DeviceMesh {
    /// Every device of the world the fusion runs on (resolved when it is lowered).
    #[default]
    World,
    /// An explicit list of device indices.
    Devices(Vec<usize>),
}

impl DeviceMesh {
    /// A mesh of the given devices.
    pub fn devices(devices: impl Into<Vec<usize>>) -> Self {
        DeviceMesh::Devices(devices.into())
    }

    /// The device list for a world of `world_size` devices.
    pub fn resolve(&self, world_size: usize) -> Vec<usize> {
        match self {
            DeviceMesh::World => (0..world_size).collect(),
            DeviceMesh::Devices(d) => d.clone(),
        }
    }

    /// Number of devices, if known without the world size.
    pub fn known_size(&self) -> Option<usize> {
        match self {
            DeviceMesh::World => None,
            DeviceMesh::Devices(d) => Some(d.len()),
        }
    }

    /// Position of `device` in the mesh (its DIDx index), if it belongs to it.
    pub fn index_of(&self, device: usize, world_size: usize) -> Option<usize> {
        match self {
            DeviceMesh::World => (device < world_size).then_some(device),
            DeviceMesh::Devices(d) => d.iter().position(|&x| x == device),
        }
    }
}

impl fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceMesh::World => f.write_str("DeviceMesh{world}"),
            DeviceMesh::Devices(d) => {
                f.write_str("DeviceMesh{")?;
                for (i, x) in d.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" ")?;
                    }
                    write!(f, "{x}")?;
                }
                f.write_str("}")
            }
        }
    }
}
