//! Errors of the communication and distributed layers.

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
    /// A collective over several ranks on a backend that runs one process (a plain backend:
    /// the groups are run by the `Distributed<B>` decorator).
    #[error(
        "{op} over a group of {size} ranks on `{backend}`, a one-process backend: run the model on \
         `Distributed<B>` (`Autodiff<Distributed<B>>` to train, on a `MeshDevice`) to use process groups"
    )]
    OneProcess {
        /// The collective.
        op: &'static str,
        /// The group's size.
        size: usize,
        /// The backend's type.
        backend: &'static str,
    },
    /// A mesh the processes cannot form (sizes against the launched world, ranks that disagree
    /// on their recipe), reached alike by every rank.
    #[error("{message}")]
    Mesh {
        /// What does not fit, naming the sizes or the rank.
        message: String,
        /// Already written to stderr once, by rank 0 (a launcher's front end prints nothing more).
        reported: bool,
    },
}
