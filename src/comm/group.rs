//! The engine layer: [`ProcessGroup`], one object-safe interface over MPI (CPUs, nodes, CI)
//! and — later — NCCL (GPUs), with MPI/NCCL semantics for ranks, groups and collectives.
//!
//! Data-movement collectives (gather, all-to-all, broadcast, point-to-point) move bytes, so
//! any element type travels through them (the typed helpers of [`super::typed`] count in
//! elements); reductions name their element type ([`ReduceBuf`]), since the engine must add
//! them. Counts are validated on the calling rank before the engine sees them: a count list
//! of the wrong length or a buffer of the wrong size is a [`DistError`], never undefined
//! behaviour inside MPI.

use std::sync::Arc;

use super::error::DistError;

/// A shared handle to a group: the collectives' backward keeps one.
pub type Group = Arc<dyn ProcessGroup>;

/// Element-wise reduction of [`ProcessGroup::all_reduce`] and [`ProcessGroup::reduce_scatter_v`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum over ranks.
    Sum,
    /// Maximum over ranks.
    Max,
    /// Minimum over ranks.
    Min,
}

/// A buffer reduced in place, tagged with its element type.
#[derive(Debug)]
pub enum ReduceBuf<'a> {
    /// 32-bit floats (tensor data; bf16 tensors are reduced in f32).
    F32(&'a mut [f32]),
    /// 64-bit floats (loss sums that must not lose digits).
    F64(&'a mut [f64]),
    /// 64-bit integers (token and expert counts).
    I64(&'a mut [i64]),
}

impl ReduceBuf<'_> {
    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        match self {
            ReduceBuf::F32(b) => b.len(),
            ReduceBuf::F64(b) => b.len(),
            ReduceBuf::I64(b) => b.len(),
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One point-to-point transfer of a batch ([`ProcessGroup::exchange`]).
#[derive(Debug)]
pub enum P2p<'a> {
    /// Send these bytes to `peer`.
    Send {
        /// Destination rank in this group.
        peer: usize,
        /// The bytes.
        data: &'a [u8],
    },
    /// Receive exactly `data.len()` bytes from `peer` into `data`.
    Recv {
        /// Source rank in this group.
        peer: usize,
        /// Where the bytes land.
        data: &'a mut [u8],
    },
}

/// A group of processes that run collectives together (an MPI communicator, an NCCL
/// communicator). Every rank of the group must call the same collectives in the same order
/// with consistent counts, as with MPI and NCCL.
pub trait ProcessGroup: Send + Sync + std::fmt::Debug {
    /// This process's rank in the group, `0..size`.
    fn rank(&self) -> usize;

    /// Processes in the group.
    fn size(&self) -> usize;

    /// The engine's name, for messages (`local`, `mpi`).
    fn engine(&self) -> &'static str;

    /// Sub-groups (`MPI_Comm_split`): ranks calling with the same `color` form one group,
    /// ordered by `key`, ties by their rank here. Collective over this group.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn ProcessGroup>, DistError>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), DistError>;

    /// Element-wise reduction over ranks, the result on every rank, in place.
    fn all_reduce(&self, buf: ReduceBuf<'_>, op: ReduceOp) -> Result<(), DistError>;

    /// Element-wise reduction of `send` (`Σ counts` elements, the same layout on every rank),
    /// of which rank `r` keeps block `r` (`counts[r]` elements, at offset `Σ counts[..r]`) in
    /// `recv`. `send` and `recv` hold the same element type.
    fn reduce_scatter_v(&self, send: ReduceBuf<'_>, recv: ReduceBuf<'_>, counts: &[usize], op: ReduceOp) -> Result<(), DistError>;

    /// Concatenation of every rank's `send` in rank order into `recv`; `counts[r]` is rank
    /// `r`'s byte count (`send.len() == counts[rank]`, `recv.len() == Σ counts`).
    fn all_gather_v(&self, send: &[u8], recv: &mut [u8], counts: &[usize]) -> Result<(), DistError>;

    /// Personalised exchange: bytes `send[Σ send_counts[..p] ..][.. send_counts[p]]` go to
    /// rank `p`; rank `p`'s bytes for us land in `recv` at `Σ recv_counts[..p]`.
    fn all_to_all_v(&self, send: &[u8], send_counts: &[usize], recv: &mut [u8], recv_counts: &[usize]) -> Result<(), DistError>;

    /// `root`'s `buf` copied to every rank's `buf` (same length everywhere).
    fn broadcast(&self, buf: &mut [u8], root: usize) -> Result<(), DistError>;

    /// A batch of sends and receives, all posted before any completes (MPI `Waitall`, an NCCL
    /// group), so rings and halo exchanges cannot deadlock on ordering.
    fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<(), DistError>;

    /// The same group's collectives on device buffers, where the engine runs on an
    /// accelerator (NCCL: [`super::device`]); `None` (the default) for host-buffer engines.
    fn device(&self) -> Option<&dyn super::device::DeviceCollectives> {
        None
    }

    /// Ends every process of the job with `code` (`MPI_Abort`): what a rank does on an error
    /// the others cannot know about — returning would leave them blocked in their next
    /// collective. A single process just exits.
    fn abort(&self, code: i32) -> ! {
        std::process::exit(code)
    }
}

/// Where consecutive blocks of the given sizes start (the `_v` collectives' displacements).
pub(crate) fn offsets(counts: &[usize]) -> Vec<usize> {
    counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect()
}

/// Checks shared by the engines: a count per rank, and buffers that match the counts.
pub(crate) fn check_counts(g: &dyn ProcessGroup, what: &'static str, counts: &[usize]) -> Result<(), DistError> {
    if counts.len() != g.size() {
        return Err(DistError::Counts { op: what, message: format!("{} counts for a group of {} ranks", counts.len(), g.size()) });
    }
    Ok(())
}

pub(crate) fn check_len(what: &'static str, buffer: &'static str, len: usize, expected: usize) -> Result<(), DistError> {
    if len != expected {
        return Err(DistError::Counts { op: what, message: format!("{buffer} holds {len} elements, the counts say {expected}") });
    }
    Ok(())
}

pub(crate) fn check_peer(g: &dyn ProcessGroup, what: &'static str, peer: usize) -> Result<(), DistError> {
    if peer >= g.size() {
        return Err(DistError::Rank { op: what, rank: peer, size: g.size() });
    }
    Ok(())
}
