//! The distributed layer's foundation: process groups over real engines.
//!
//! * [`ProcessGroup`] (`group.rs`): one object-safe interface — rank, size, `split` into
//!   sub-groups, barrier, all-reduce, all-gather(v), reduce-scatter(v), all-to-all(v),
//!   broadcast and batched point-to-point — with MPI/NCCL semantics.
//! * [`LocalGroup`] (`local.rs`): the size-1 group, the default, so single-process code runs
//!   the same collectives at the cost of a copy.
//! * [`MpiGroup`] (`mpi.rs`, cargo feature `mpi`): MPI through rsmpi — the engine for CPUs,
//!   multi-node CPU clusters and CI (`mpirun -np N …`).
//! * `NcclGroup` (`nccl.rs`, cargo feature `nccl`): NCCL through cudarc on CUDA machines,
//!   bootstrapped over MPI.
//! * [`CheckedGroup`] (`checked.rs`): a debug wrapper checking that every rank issues the same
//!   collectives.
//! * [`Mesh`] (`mesh.rs`): the world of a run and its data-, context- and expert-parallel
//!   groups (Megatron's layout), from an explicit group or from the launcher's environment.
//! * [`MeshDevice`] (`device.rs`): the device of [`Distributed`]`<B>` — `B`'s device and the
//!   mesh bound to it, found again from every tensor made on it ([`mesh_of`]).
//! * [`fsdp`]: parameter sharding over a group (FSDP), gathered per unit.
//! * [`typed`]: element-typed helpers over the byte-level collectives.
//!
//! The design (why MPI and NCCL, not Burn's `burn-collective`; the communication patterns of
//! FSDP, expert and context parallelism) follows PyTorch's `torch.distributed` process groups
//! and Megatron-LM's parallel state.

pub mod checked;
pub mod collective;
pub mod decorator;
pub mod device;
mod error;
pub mod fsdp;
pub mod group;
pub mod local;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
mod node;
pub mod regather;
pub mod typed;

pub use checked::CheckedGroup;
pub use collective::CollectiveBackend;
pub use decorator::Distributed;
pub use device::{mesh_of, MeshBinding, MeshDevice};
pub use error::DistError;
pub use fsdp::{PreSharded, RowShard, ShardPlan};
pub use group::{Group, P2p, ProcessGroup, ReduceBuf, ReduceOp};
pub use local::LocalGroup;
pub use mesh::{ExpertMesh, Mesh, MeshSizes};
#[cfg(feature = "mpi")]
pub use mpi::MpiGroup;
#[cfg(feature = "nccl")]
pub use nccl::NcclGroup;
pub use node::{local_device, local_rank, quiet_unless_rank_zero};
