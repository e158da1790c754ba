//! Collectives on device buffers: what an engine that runs on the accelerator (NCCL) offers
//! besides [`ProcessGroup`]'s host buffers, so that a backend whose tensors already live on
//! that accelerator hands them over in place — no copy to the host and back.
//!
//! The interface is the handful of equal-count primitives NCCL has (`ncclAllGather`,
//! `ncclReduceScatter`, `ncclAllReduce`, grouped `ncclSend`/`ncclRecv`); the uneven forms the
//! model's collectives need are composed from them by the caller
//! (`distributed::decorator::device`), with the backend's own ops padding and cutting rows.
//! Reductions are f32 sums: the caller widens bf16 and f16 first and rounds once after, as the
//! host path does, so both paths sum in the same precision.
//!
//! A group offers these through [`ProcessGroup::device`]; the host-buffer engines (MPI, the
//! size-1 group) do not, and the callers then take the host path.

use super::DistError;

/// A buffer in the engine's device memory: its address and length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuf {
    /// The device address (a `CUdeviceptr` for CUDA).
    pub ptr: u64,
    /// Its length in bytes.
    pub bytes: usize,
}

impl DeviceBuf {
    /// The `bytes` bytes from `offset` (bytes) on: an error naming `what` if they are not
    /// inside this buffer.
    pub fn slice(&self, what: &'static str, offset: usize, bytes: usize) -> Result<DeviceBuf, DistError> {
        if offset.checked_add(bytes).is_none_or(|end| end > self.bytes) {
            return Err(DistError::Counts {
                op: what,
                message: format!("bytes {offset}..{} outside a buffer of {}", offset.saturating_add(bytes), self.bytes),
            });
        }
        Ok(DeviceBuf { ptr: self.ptr + offset as u64, bytes })
    }
}

/// One point-to-point transfer of a [`DeviceCollectives::exchange`].
#[derive(Debug, Clone, Copy)]
pub enum DeviceP2p {
    /// Send the buffer's bytes to `peer`.
    Send {
        /// Destination rank in the group.
        peer: usize,
        /// The bytes.
        buf: DeviceBuf,
    },
    /// Receive exactly the buffer's length from `peer` into it.
    Recv {
        /// Source rank in the group.
        peer: usize,
        /// Where the bytes land.
        buf: DeviceBuf,
    },
}

/// Equal-count collectives on device buffers (module docs). Every call is collective over the
/// group, like [`ProcessGroup`]'s, and returns once its results are written (the engine's
/// stream synchronised), so the caller's next kernels read them.
///
/// # Safety (every method)
/// Each [`DeviceBuf`] must be live memory on the engine's device ([`Self::ordinal`]), of
/// the stated length, not freed or written by anything else until the call returns, and the
/// writes that produced the inputs must have completed (the caller synchronises its backend
/// first). Receive buffers must not overlap send buffers, except where a method says so.
pub trait DeviceCollectives: Send + Sync {
    /// The device (CUDA ordinal) the engine runs on.
    fn ordinal(&self) -> usize;

    /// Every rank's `send` in rank order into `recv` (`recv.bytes == size × send.bytes`).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn all_gather(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError>;

    /// `send` (f32, `size` equal blocks) summed over the ranks; rank `r` keeps block `r` in
    /// `recv` (`send.bytes == size × recv.bytes`).
    ///
    /// # Safety
    /// See the trait.
    unsafe fn reduce_scatter_sum_f32(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError>;

    /// `send` (f32) summed over the ranks into `recv` (the same length), the same result on
    /// every rank.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn all_reduce_sum_f32(&self, send: DeviceBuf, recv: DeviceBuf) -> Result<(), DistError>;

    /// Sends and receives posted together (an NCCL group), so rings cannot deadlock on order.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn exchange(&self, ops: &[DeviceP2p]) -> Result<(), DistError>;
}
