//! Element-typed forms of the byte-level collectives of [`ProcessGroup`]: counts in elements,
//! results allocated. Any plain-old-data element type travels (`f32`, `bf16` as `u16`, `i64`,
//! …); reductions are [`ProcessGroup::all_reduce`] with a [`super::ReduceBuf`].

use bytemuck::Pod;

use super::group::{P2p, ProcessGroup};
use super::DistError;

fn bytes(counts: &[usize], size: usize) -> Vec<usize> {
    counts.iter().map(|&c| c * size).collect()
}

/// Every rank's `send` concatenated in rank order; `counts[r]` elements from rank `r`.
pub fn all_gather_v<T: Pod>(g: &dyn ProcessGroup, send: &[T], counts: &[usize]) -> Result<Vec<T>, DistError> {
    let mut out = vec![T::zeroed(); counts.iter().sum()];
    g.all_gather_v(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(&mut out), &bytes(counts, size_of::<T>()))?;
    Ok(out)
}

/// Equal-size all-gather: every rank sends `send.len()` elements.
pub fn all_gather<T: Pod>(g: &dyn ProcessGroup, send: &[T]) -> Result<Vec<T>, DistError> {
    all_gather_v(g, send, &vec![send.len(); g.size()])
}

/// Personalised exchange in elements: `send_counts[p]` to rank `p`, `recv_counts[p]` from it.
pub fn all_to_all_v<T: Pod>(g: &dyn ProcessGroup, send: &[T], send_counts: &[usize], recv_counts: &[usize]) -> Result<Vec<T>, DistError> {
    let mut out = vec![T::zeroed(); recv_counts.iter().sum()];
    let size = size_of::<T>();
    g.all_to_all_v(bytemuck::cast_slice(send), &bytes(send_counts, size), bytemuck::cast_slice_mut(&mut out), &bytes(recv_counts, size))?;
    Ok(out)
}

/// `root`'s `buf` on every rank.
pub fn broadcast<T: Pod>(g: &dyn ProcessGroup, buf: &mut [T], root: usize) -> Result<(), DistError> {
    g.broadcast(bytemuck::cast_slice_mut(buf), root)
}

/// Sends `send` to rank `to` and receives `recv_len` elements from rank `from`, both posted
/// before either completes (a ring shift when `to = rank + 1`, `from = rank − 1`).
pub fn shift<T: Pod>(g: &dyn ProcessGroup, send: &[T], to: usize, recv_len: usize, from: usize) -> Result<Vec<T>, DistError> {
    let mut out = vec![T::zeroed(); recv_len];
    g.exchange(&mut [P2p::Send { peer: to, data: bytemuck::cast_slice(send) }, P2p::Recv { peer: from, data: bytemuck::cast_slice_mut(&mut out) }])?;
    Ok(out)
}
