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
//! * [`fsdp`]: parameter sharding over a group (FSDP), gathered per unit.
//! * [`context`]: context parallelism of packed rows (KDA state and short-conv hand-overs).
//! * [`typed`]: element-typed helpers over the byte-level collectives.
//!
//! The design (why MPI and NCCL, not Burn's `burn-collective`; the communication patterns of
//! FSDP, expert and context parallelism) follows PyTorch's `torch.distributed` process groups
//! and Megatron-LM's parallel state.

pub mod checked;
pub mod collective;
pub mod context;
pub mod decorator;
pub mod fsdp;
pub mod group;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod plan;
pub mod typed;

pub use checked::CheckedGroup;
pub use collective::{CollectiveBackend, Group};
pub use decorator::Distributed;
pub use fsdp::ShardPlan;
pub use group::{P2p, ProcessGroup, ReduceBuf, ReduceOp};
pub use local::LocalGroup;
#[cfg(feature = "mpi")]
pub use mpi::MpiGroup;
#[cfg(feature = "nccl")]
pub use nccl::NcclGroup;

/// The device of backend `B` for this process: the default device's kind, numbered by
/// [`local_rank`] (modulo the devices present) where the backend has several, so the ranks of a
/// node spread over its GPUs; the default device elsewhere (CPU backends).
pub fn local_device<B: burn::tensor::backend::Backend>() -> B::Device {
    use burn::tensor::backend::{Device, DeviceId, DeviceOps};
    let default = B::Device::default();
    let id = default.id();
    let n = B::device_count(id.type_id);
    if n <= 1 {
        return default;
    }
    B::Device::from_id(DeviceId { type_id: id.type_id, index_id: (local_rank() % n) as u16 })
}

/// This process's rank among the processes of its node, from the launcher's environment
/// (OpenMPI `OMPI_COMM_WORLD_LOCAL_RANK`, MPICH/Hydra `MPI_LOCALRANKID`, Slurm `SLURM_LOCALID`,
/// torchrun `LOCAL_RANK`); 0 when none is set. A process with several GPUs uses the one of its
/// local rank.
pub fn local_rank() -> usize {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"]
        .iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// Errors of the distributed layer, naming the collective or engine at fault.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// Counts or buffer sizes that do not fit the group or each other.
    #[error("{op}: {message}")]
    Counts {
        /// The collective.
        op: &'static str,
        /// What does not fit.
        message: String,
    },
    /// A rank outside the group.
    #[error("{op}: rank {rank} is outside the group of {size}")]
    Rank {
        /// The collective.
        op: &'static str,
        /// The rank named.
        rank: usize,
        /// The group's size.
        size: usize,
    },
    /// The engine could not be started or refused the call.
    #[error("{engine}: {message}")]
    Engine {
        /// `mpi`, `nccl`.
        engine: &'static str,
        /// What failed.
        message: String,
    },
}
