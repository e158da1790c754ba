//! Process groups: the communication layer under the op traits and the distributed layer.
//!
//! * [`ProcessGroup`] (`group.rs`): one object-safe interface — rank, size, `split` into
//!   sub-groups, barrier, all-reduce, all-gather(v), reduce-scatter(v), all-to-all(v),
//!   broadcast and batched point-to-point — with MPI/NCCL semantics, on host byte buffers.
//! * [`DeviceCollectives`] (`device.rs`): an accelerator engine's equal-count collectives on
//!   device buffers ([`ProcessGroup::device`]), which `Distributed<B>` hands a CUDA backend's
//!   tensors to.
//! * [`LocalGroup`] (`local.rs`): the size-1 group, the default.
//! * [`CheckedGroup`] (`checked.rs`): a debug wrapper checking that every rank issues the same
//!   collectives.
//! * [`typed`]: element-typed helpers over the byte-level collectives.
//! * [`regather`]: the bookkeeping of an FSDP forward's resharded parameters.
//!
//! Why a layer of its own, below [`crate::ops`]: the collectives on tensors are ops of
//! [`crate::Glm5Backend`] (`all_gather_rows`, `gather_param`, …: one process on a plain
//! backend, the group's engine on [`crate::distributed::Distributed`]`<B>`), so their
//! signatures name a [`Group`]; a group is an interface to a communication engine and knows
//! nothing of tensors, backends or meshes — as `c10d`'s `ProcessGroup` sits under
//! `torch.distributed`. The engines (MPI, NCCL), the mesh, the mesh device and FSDP live above
//! the ops, in [`crate::distributed`], which re-exports this module's items.

pub mod checked;
pub mod device;
mod error;
pub mod group;
pub mod local;
pub mod regather;
pub mod typed;

pub use checked::CheckedGroup;
pub use device::{DeviceBuf, DeviceCollectives, DeviceP2p};
pub use error::DistError;
pub use group::{Group, P2p, ProcessGroup, ReduceBuf, ReduceOp};
pub use local::LocalGroup;
pub use regather::{ParamGather, Regather, RegatherTask};
