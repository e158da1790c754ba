//! The mesh device: the device of [`super::Distributed`]`<B>` — `B`'s device, and the
//! [`Mesh`] of processes this rank runs in.
//!
//! **Where the mesh lives.** Burn asks three things of a device: `Clone + Default + PartialEq`,
//! `from_id`/`to_id` through a [`DeviceId`] (two small integers), and that every tensor can
//! report it (`float_device`). A `DeviceId` cannot carry a process group, and `Distributed<B>`'s
//! tensors are `B`'s primitives, which know only `B`'s device. So the mesh is kept in a
//! process-wide registry keyed by the device's type and id: [`MeshDevice::new`] binds `B`'s
//! device to a mesh, and every `MeshDevice` of that device — the one passed in, one rebuilt by
//! `from_id`, or the one a tensor reports — finds the same mesh. Equality, `to_id`/`from_id`
//! and hashing are therefore `B`'s device's own; a device never bound is one process (rank 0
//! of 1), which is also what plain backends are: their devices are never looked up here, since
//! the registry is keyed by the `MeshDevice` type.
//!
//! One process is one rank, so one device belongs to at most one mesh at a time (as
//! `torch.distributed`'s default group is per process): binding it to another mesh is an error
//! until [`MeshDevice::release`] unbinds it.

use std::any::TypeId;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, RwLock};

use burn::tensor::backend::{Device, DeviceId, DeviceOps};

use super::mesh::{Mesh, MeshRole};
use crate::comm::{DistError, Group};

type Registry = RwLock<HashMap<(TypeId, DeviceId), Arc<Mesh>>>;

static MESHES: LazyLock<Registry> = LazyLock::new(Registry::default);

fn registry_read() -> std::sync::RwLockReadGuard<'static, HashMap<(TypeId, DeviceId), Arc<Mesh>>> {
    MESHES.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn registry_write() -> std::sync::RwLockWriteGuard<'static, HashMap<(TypeId, DeviceId), Arc<Mesh>>> {
    MESHES.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `D` (a backend's device) as a rank of a [`Mesh`] (module docs).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct MeshDevice<D> {
    /// The backend's own device (which GPU, or the CPU).
    pub device: D,
}

impl<D: DeviceOps> MeshDevice<D> {
    /// `device` as a rank of `mesh`: binds it in the registry (module docs). An error naming
    /// the device when it is bound to another mesh (release that first); binding it to the
    /// mesh it has is a no-op.
    pub fn new(device: D, mesh: impl Into<Arc<Mesh>>) -> Result<Self, DistError> {
        let mesh = mesh.into();
        let key = (TypeId::of::<Self>(), device.to_id());
        let mut meshes = registry_write();
        if let Some(bound) = meshes.get(&key) {
            if !Arc::ptr_eq(bound, &mesh) {
                return Err(DistError::Mesh {
                    message: format!(
                        "device {device:?} is already rank {} of a mesh of {}; a process is one rank: release that mesh first",
                        bound.rank(),
                        bound.size()
                    ),
                    reported: false,
                });
            }
        }
        meshes.insert(key, mesh);
        Ok(Self { device })
    }

    /// This process's mesh on the launcher's world ([`Mesh::from_env`]) on `device`.
    pub fn from_env(device: D, sizes: Option<super::MeshSizes>) -> Result<Self, DistError> {
        Self::new(device, Mesh::from_env(sizes)?)
    }

    /// The mesh this device is a rank of (`None`: one process).
    pub fn mesh(&self) -> Option<Arc<Mesh>> {
        mesh_of(self)
    }

    /// Unbind the device from its mesh (the end of a run; the mesh's groups are dropped with
    /// its last holder). Tensors on it are one process's again.
    pub fn release(&self) {
        registry_write().remove(&(TypeId::of::<Self>(), self.device.to_id()));
    }

    /// A guard that [`Self::release`]s the device when dropped, on every path out of a run:
    /// the registry holds the mesh, and MPI is finalised only when its last group is dropped —
    /// a process that exits with its mesh still bound leaves `mpirun` reporting an improper
    /// exit.
    pub fn binding(&self) -> MeshBinding<D> {
        MeshBinding(Self { device: self.device.clone() })
    }
}

/// Releases its device's mesh when dropped ([`MeshDevice::binding`]).
#[must_use = "the mesh is released when the binding is dropped"]
pub struct MeshBinding<D: DeviceOps>(MeshDevice<D>);

impl<D: DeviceOps> Drop for MeshBinding<D> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// The mesh a device of any backend is a rank of: a [`MeshDevice`]'s bound mesh; `None` for
/// an unbound one and for every plain backend's device (one process).
pub fn mesh_of<D: DeviceOps>(device: &D) -> Option<Arc<Mesh>> {
    registry_read().get(&(TypeId::of::<D>(), device.to_id())).cloned()
}

/// The group a parallel seam of the model runs over, asked of the tensors' device at each call:
/// the group of `role` in the mesh `device` is bound to. `held` is the group the model was cut
/// for when it was prepared — a sharded parameter's rows and an expert-parallel layer's experts
/// are a function of its size and rank — so the device's group must put this process at the
/// same rank of as many; an error naming both otherwise (the model was prepared on another
/// mesh: prepare it on this one). On a device bound to no mesh (a plain backend's, or groups
/// handed explicitly) the seam runs over `held`: a plain backend then runs a group of one, and
/// refuses a larger one (`DistError::OneProcess`).
pub fn seam_group<D: DeviceOps>(device: &D, role: MeshRole, held: &Group) -> Result<Group, DistError> {
    let Some(mesh) = mesh_of(device) else { return Ok(held.clone()) };
    match mesh.group(role) {
        Some(g) if Arc::ptr_eq(g, held) || (g.size() == held.size() && g.rank() == held.rank()) => Ok(g.clone()),
        None if held.size() == 1 => Ok(held.clone()),
        found => Err(DistError::Mesh {
            message: format!(
                "the model was prepared with rank {} of a {} of {}, but its device is bound to a mesh (rank {} of {}) whose {}: \
                 prepare the model on the device's mesh",
                held.rank(),
                role.name(),
                held.size(),
                mesh.rank(),
                mesh.size(),
                match found {
                    Some(g) => format!("{} puts this process at rank {} of {}", role.name(), g.rank(), g.size()),
                    None => format!("sizes {:?} have no {}", mesh.sizes(), role.name()),
                }
            ),
            reported: false,
        }),
    }
}

impl<D> From<D> for MeshDevice<D> {
    /// `device` with whatever mesh it is bound to (none: one process).
    fn from(device: D) -> Self {
        Self { device }
    }
}

impl<D: DeviceOps> std::fmt::Debug for MeshDevice<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.mesh() {
            Some(m) => write!(f, "MeshDevice({:?}, rank {} of {})", self.device, m.rank(), m.size()),
            None => write!(f, "MeshDevice({:?}, one process)", self.device),
        }
    }
}

impl<D: DeviceOps> Device for MeshDevice<D> {
    fn from_id(device_id: DeviceId) -> Self {
        Self { device: D::from_id(device_id) }
    }

    fn to_id(&self) -> DeviceId {
        self.device.to_id()
    }
}

impl<D: DeviceOps> DeviceOps for MeshDevice<D> {}
