//! Collectives on Burn tensors, along dim 0 ("rows": tokens, or a flattened parameter's
//! elements), as ops of [`Glm5Backend`], with their adjoints under `Autodiff`:
//!
//! | forward | backward |
//! |---|---|
//! | `all_gather_rows(x; rows)` | `reduce_scatter_rows(∂y; rows)` |
//! | `reduce_scatter_rows(x; rows)` | `all_gather_rows(∂y; rows)` |
//! | `all_to_all_rows(x; send, recv)` | `all_to_all_rows(∂y; recv, send)` |
//! | `all_reduce_sum(x)` | `all_reduce_sum(∂y)` |
//! | `shift_rows(x; to, from)` | `shift_rows(∂y; from, to)` |
//! | `gather_param(x; links)` (FSDP) | `reduce_scatter_rows(∂y)`, then re-gathers |
//!
//! The gradients are those of the sum of every rank's loss (each rank's backward seeds its own
//! loss; the adjoint collectives add the contributions): what data, expert and context
//! parallelism need. This is the table of PyTorch's `torch.distributed.nn.functional` and
//! Megatron-LM's `tensor_parallel/mappings.py`.
//!
//! **Who runs them.** A plain backend (Flex, LibTorch, the CubeCL backends) is one process:
//! the trait's default bodies ([`local`]) return the input for a group of one — the model's
//! parallel seams cost nothing there — and refuse a larger group with
//! [`DistError::OneProcess`]. The distributed decorator
//! ([`crate::distributed::Distributed`]`<B>`) runs them over the group's engine (MPI, NCCL),
//! and `Autodiff<B>` records the adjoints above ([`crate::ops::backend`]'s `autodiff_collective.rs`). Every rank
//! must run the same collectives in the same order with consistent row counts, and agree on
//! whether the input is tracked (the backward runs a collective too).

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::backend::Glm5Backend;
use crate::comm::{DistError, Group};

pub mod local;

fn wrap<B: Backend, const D: usize>(r: Result<FloatTensor<B>, DistError>) -> Result<Tensor<B, D>, DistError> {
    r.map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
}

/// [`Glm5Backend::all_gather_rows`] on a tensor.
pub fn all_gather_rows<B: Glm5Backend, const D: usize>(x: Tensor<B, D>, rows: &[usize], group: &Group) -> Result<Tensor<B, D>, DistError> {
    wrap(B::all_gather_rows(x.into_primitive().tensor(), rows, group))
}

/// [`Glm5Backend::reduce_scatter_rows`] on a tensor.
pub fn reduce_scatter_rows<B: Glm5Backend, const D: usize>(x: Tensor<B, D>, rows: &[usize], group: &Group) -> Result<Tensor<B, D>, DistError> {
    wrap(B::reduce_scatter_rows(x.into_primitive().tensor(), rows, group))
}

/// [`Glm5Backend::all_to_all_rows`] on a tensor.
pub fn all_to_all_rows<B: Glm5Backend, const D: usize>(
    x: Tensor<B, D>,
    send: &[usize],
    recv: &[usize],
    group: &Group,
) -> Result<Tensor<B, D>, DistError> {
    wrap(B::all_to_all_rows(x.into_primitive().tensor(), send, recv, group))
}

/// [`Glm5Backend::all_reduce_sum`] on a tensor.
pub fn all_reduce_sum<B: Glm5Backend, const D: usize>(x: Tensor<B, D>, group: &Group) -> Result<Tensor<B, D>, DistError> {
    wrap(B::all_reduce_sum(x.into_primitive().tensor(), group))
}

/// [`Glm5Backend::shift_rows`] on a tensor.
pub fn shift_rows<B: Glm5Backend, const D: usize>(
    x: Tensor<B, D>,
    to: usize,
    from: usize,
    recv_rows: usize,
    group: &Group,
) -> Result<Tensor<B, D>, DistError> {
    wrap(B::shift_rows(x.into_primitive().tensor(), to, from, recv_rows, group))
}
