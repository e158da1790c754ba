//! The distributed layer: process groups over real engines, the mesh, the backend decorator
//! that carries it, and FSDP.
//!
//! * [`ProcessGroup`], [`LocalGroup`], [`CheckedGroup`], [`typed`]: the communication
//!   interface, from [`crate::comm`] (below the op traits, which name it), re-exported here.
//! * [`MpiGroup`] (`mpi.rs`, cargo feature `mpi`): MPI through rsmpi — the engine for CPUs,
//!   multi-node CPU clusters and CI (`mpirun -np N …`).
//! * `NcclGroup` (`nccl.rs`, cargo feature `nccl`): NCCL through cudarc on CUDA machines,
//!   bootstrapped over MPI.
//! * [`Mesh`] (`mesh.rs`): the world of a run and its data-, context- and expert-parallel
//!   groups (Megatron's layout), from an explicit group or from the launcher's environment.
//! * [`MeshDevice`] (`device.rs`): the device of [`Distributed`]`<B>` — `B`'s device and the
//!   mesh bound to it, found again from every tensor made on it ([`mesh_of`]).
//! * [`Distributed`]`<B>` (`decorator/`): the backend decorator; it runs the collective ops of
//!   [`crate::Glm5Backend`] over the groups, which plain backends run as one process.
//! * [`fsdp`]: parameter sharding over a group (FSDP), gathered per unit.
//! * [`collective`]: the collectives on tensors (from [`crate::ops::collective`]).
//!
//! The design (why MPI and NCCL, not Burn's `burn-collective`; the communication patterns of
//! FSDP, expert and context parallelism) follows PyTorch's `torch.distributed` process groups
//! and Megatron-LM's parallel state.

pub use crate::comm::{checked, group, local, regather, typed};
pub use crate::ops::collective;

pub mod decorator;
pub mod device;
pub mod fsdp;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod node;

pub use crate::comm::{CheckedGroup, DeviceBuf, DeviceCollectives, DeviceP2p, DistError, Group, LocalGroup, P2p, ProcessGroup, ReduceBuf, ReduceOp};
pub use decorator::Distributed;
pub use device::{mesh_of, seam_group, MeshBinding, MeshDevice};
pub use fsdp::{PreSharded, RowShard, ShardPlan};
pub use mesh::{ExpertMesh, Mesh, MeshRole, MeshSizes};
#[cfg(feature = "mpi")]
pub use mpi::MpiGroup;
#[cfg(feature = "nccl")]
pub use nccl::NcclGroup;
pub use node::{local_device, local_rank, quiet_unless_rank_zero};
