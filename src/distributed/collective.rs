//! Differentiable collectives on Burn tensors, along dim 0 ("rows": tokens, or a flattened
//! parameter's elements), with their adjoints under `Autodiff`:
//!
//! | forward | backward |
//! |---|---|
//! | `all_gather_rows(x; rows)` | `reduce_scatter_rows(∂y; rows)` |
//! | `reduce_scatter_rows(x; rows)` | `all_gather_rows(∂y; rows)` |
//! | `all_to_all_rows(x; send, recv)` | `all_to_all_rows(∂y; recv, send)` |
//! | `all_reduce_sum(x)` | `all_reduce_sum(∂y)` |
//! | `shift_rows(x; to, from)` | `shift_rows(∂y; from, to)` |
//!
//! The gradients are those of the sum of every rank's loss (each rank's backward seeds its own
//! loss; the adjoint collectives add the contributions): what data, expert and context
//! parallelism need. This is the table of PyTorch's `torch.distributed.nn.functional` and
//! Megatron-LM's `tensor_parallel/mappings.py`.
//!
//! [`CollectiveBackend`]'s default bodies are the host path — read the tensor, run the
//! [`ProcessGroup`] collective on f32 (bf16 and f16 travel as f32), write the result back in
//! the input's dtype on its device; a CUDA backend with NCCL would override them with device
//! pointers. Every rank must run the same collectives in the same order with consistent row
//! counts, and agree on whether the input is tracked (the backward runs a collective too).

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use super::group::{check_counts, ProcessGroup, ReduceBuf, ReduceOp};
use super::typed;
use super::DistError;

/// A shared handle to a group: the collectives' backward keeps one.
pub type Group = Arc<dyn ProcessGroup>;

/// Collectives on float primitives, along dim 0 (module docs).
pub trait CollectiveBackend: Backend {
    /// Every rank's `x` concatenated along dim 0 in rank order; rank `r` holds `rows[r]` rows
    /// (the other dims equal everywhere).
    fn all_gather_rows(x: FloatTensor<Self>, rows: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        check_counts(&**group, "all_gather_rows", rows)?;
        let (data, s) = host(x);
        check_rows("all_gather_rows", &s, rows[group.rank()])?;
        let counts: Vec<usize> = rows.iter().map(|r| r * s.width).collect();
        let out = typed::all_gather_v(&**group, &data, &counts)?;
        Ok(back::<Self>(out, &s, rows.iter().sum()))
    }

    /// The sum over ranks of `x` (`Σ rows` rows, the same layout on every rank), of which rank
    /// `r` keeps rows `Σ rows[..r] .. + rows[r]`.
    fn reduce_scatter_rows(x: FloatTensor<Self>, rows: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        check_counts(&**group, "reduce_scatter_rows", rows)?;
        let (mut data, s) = host(x);
        check_rows("reduce_scatter_rows", &s, rows.iter().sum())?;
        let counts: Vec<usize> = rows.iter().map(|r| r * s.width).collect();
        let mut out = vec![0f32; counts[group.rank()]];
        group.reduce_scatter_v(ReduceBuf::F32(&mut data), ReduceBuf::F32(&mut out), &counts, ReduceOp::Sum)?;
        Ok(back::<Self>(out, &s, rows[group.rank()]))
    }

    /// Rows `Σ send[..p] .. + send[p]` of `x` go to rank `p`; rank `p`'s rows for us arrive in
    /// rank order (`recv[p]` rows from `p`).
    fn all_to_all_rows(x: FloatTensor<Self>, send: &[usize], recv: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        check_counts(&**group, "all_to_all_rows", send)?;
        let (data, s) = host(x);
        check_rows("all_to_all_rows", &s, send.iter().sum())?;
        let w = |c: &[usize]| c.iter().map(|r| r * s.width).collect::<Vec<_>>();
        let out = typed::all_to_all_v(&**group, &data, &w(send), &w(recv))?;
        Ok(back::<Self>(out, &s, recv.iter().sum()))
    }

    /// The element-wise sum of every rank's `x` (same shape everywhere), on every rank.
    fn all_reduce_sum(x: FloatTensor<Self>, group: &Group) -> Result<FloatTensor<Self>, DistError> {
        let (mut data, s) = host(x);
        group.all_reduce(ReduceBuf::F32(&mut data), ReduceOp::Sum)?;
        let rows = s.dims[0];
        Ok(back::<Self>(data, &s, rows))
    }

    /// [`Self::all_gather_rows`] placed after `anchor` on the autodiff graph: under `Autodiff`
    /// the gather takes `anchor` as a second parent (which receives a zero gradient), so its
    /// backward — the reduce-scatter — runs after `anchor`'s consumers are done and before
    /// `anchor`'s own backward on every rank. A chain of anchored collectives therefore runs
    /// its adjoints in exactly the reverse order of the forward whatever else the graph holds
    /// (Burn 0.21 orders backward steps by graph depth; two collectives at one depth could run
    /// in either order). Other backends ignore the anchor.
    fn all_gather_rows_after(
        x: FloatTensor<Self>,
        anchor: Option<FloatTensor<Self>>,
        rows: &[usize],
        group: &Group,
    ) -> Result<FloatTensor<Self>, DistError> {
        let _ = anchor;
        Self::all_gather_rows(x, rows, group)
    }

    /// Sends all of `x` to rank `to` and returns the `recv_rows` rows rank `from` sent us
    /// (a ring step with `to = r + 1`, `from = r − 1`; both posted before either completes).
    fn shift_rows(x: FloatTensor<Self>, to: usize, from: usize, recv_rows: usize, group: &Group) -> Result<FloatTensor<Self>, DistError> {
        let (data, s) = host(x);
        let out = typed::shift(&**group, &data, to, recv_rows * s.width, from)?;
        Ok(back::<Self>(out, &s, recv_rows))
    }
}

/// The geometry a host round trip keeps.
struct HostShape<B: Backend> {
    dims: Vec<usize>,
    width: usize,
    dtype: DType,
    device: B::Device,
}

fn host<B: Backend>(x: FloatTensor<B>) -> (Vec<f32>, HostShape<B>) {
    let dims = x.shape().to_vec();
    let dtype = x.dtype();
    let device = B::float_device(&x);
    let n: usize = dims.iter().product();
    let width = dims[1..].iter().product();
    let flat = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::float_reshape(x, Shape::new([n]))));
    let data = flat.into_data().convert::<f32>().into_vec::<f32>().expect("converted to f32 above");
    (data, HostShape { dims, width, dtype, device })
}

fn back<B: Backend>(data: Vec<f32>, s: &HostShape<B>, rows: usize) -> FloatTensor<B> {
    let n = data.len();
    let t = Tensor::<B, 1>::from_data(TensorData::new(data, [n]), (&s.device, DType::F32)).cast(s.dtype);
    let mut dims = s.dims.clone();
    dims[0] = rows;
    B::float_reshape(t.into_primitive().tensor(), Shape::from(dims))
}

fn check_rows<B: Backend>(op: &'static str, s: &HostShape<B>, expected: usize) -> Result<(), DistError> {
    if expected != s.dims[0] {
        return Err(DistError::Counts { op, message: format!("the tensor has {} rows, the row counts say {expected}", s.dims[0]) });
    }
    Ok(())
}

impl CollectiveBackend for Flex {}

#[cfg(feature = "tch")]
impl CollectiveBackend for burn::backend::LibTorch {}

#[cfg(any(feature = "vulkan", feature = "cuda"))]
impl<R, F, I, BT> CollectiveBackend for glm5_cubecl_kernels::CubeBackend<R, F, I, BT>
where
    R: glm5_cubecl_kernels::CubeRuntime,
    F: glm5_cubecl_kernels::FloatElement,
    I: glm5_cubecl_kernels::IntElement,
    BT: glm5_cubecl_kernels::BoolElement,
{
}

// ---------------------------------------------------------------------------------------------
// Autodiff: the adjoints
// ---------------------------------------------------------------------------------------------

/// Runs `B`'s collective and puts its result on the graph with `$backward` holding `$state`
/// when `$x` is tracked.
macro_rules! collective {
    ($backward:expr, $x:expr, $state:expr, $out:expr) => {{
        let out = $out?;
        Ok(match $backward.prepare::<C>([$x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish($state, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        })
    }};
}

/// Adds `grad` to the input's gradient when the input is tracked.
macro_rules! register {
    ($ops:expr, $grads:expr, $grad:expr) => {
        if let Some(node) = &$ops.parents[0] {
            $grads.register::<B>(node.id, $grad);
        }
    };
}

// A collective that fails in a backward cannot return an error: every rank ran the same call
// with the same counts in the forward, so only an engine failure is left, which MPI turns
// into a job abort before this message could be seen.
const BACKWARD: &str = "the adjoint collective failed although its forward succeeded";

#[derive(Debug)]
struct AllGatherBackward;

impl<B: CollectiveBackend> Backward<B, 1> for AllGatherBackward {
    type State = (Vec<usize>, Group);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (rows, group) = &ops.state;
        register!(ops, grads, B::reduce_scatter_rows(grad, rows, group).expect(BACKWARD));
    }
}

#[derive(Debug)]
struct AnchoredGatherBackward;

impl<B: CollectiveBackend> Backward<B, 2> for AnchoredGatherBackward {
    /// (rows, group, the anchor's shape, dtype and device)
    type State = (Vec<usize>, Group, Shape, DType, B::Device);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (rows, group, shape, dtype, device) = &ops.state;
        let [x, anchor] = &ops.parents;
        // the reduce-scatter runs whether or not the shard is tracked: every rank must take part
        let shard = B::reduce_scatter_rows(grad, rows, group).expect(BACKWARD);
        if let Some(node) = x {
            grads.register::<B>(node.id, shard);
        }
        if let Some(node) = anchor {
            grads.register::<B>(node.id, B::float_zeros(shape.clone(), device, (*dtype).into()));
        }
    }
}

#[derive(Debug)]
struct ReduceScatterBackward;

impl<B: CollectiveBackend> Backward<B, 1> for ReduceScatterBackward {
    type State = (Vec<usize>, Group);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (rows, group) = &ops.state;
        register!(ops, grads, B::all_gather_rows(grad, rows, group).expect(BACKWARD));
    }
}

#[derive(Debug)]
struct AllToAllBackward;

impl<B: CollectiveBackend> Backward<B, 1> for AllToAllBackward {
    type State = (Vec<usize>, Vec<usize>, Group);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (send, recv, group) = &ops.state;
        register!(ops, grads, B::all_to_all_rows(grad, recv, send, group).expect(BACKWARD));
    }
}

#[derive(Debug)]
struct AllReduceBackward;

impl<B: CollectiveBackend> Backward<B, 1> for AllReduceBackward {
    type State = Group;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        register!(ops, grads, B::all_reduce_sum(grad, &ops.state).expect(BACKWARD));
    }
}

#[derive(Debug)]
struct ShiftBackward;

impl<B: CollectiveBackend> Backward<B, 1> for ShiftBackward {
    /// (to, from, rows sent, group)
    type State = (usize, usize, usize, Group);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (to, from, sent, group) = &ops.state;
        register!(ops, grads, B::shift_rows(grad, *from, *to, *sent, group).expect(BACKWARD));
    }
}

impl<B: CollectiveBackend, C: CheckpointStrategy> CollectiveBackend for Autodiff<B, C> {
    fn all_gather_rows(x: FloatTensor<Self>, rows: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective!(AllGatherBackward, x, (rows.to_vec(), group.clone()), B::all_gather_rows(x.primitive.clone(), rows, group))
    }

    fn all_gather_rows_after(
        x: FloatTensor<Self>,
        anchor: Option<FloatTensor<Self>>,
        rows: &[usize],
        group: &Group,
    ) -> Result<FloatTensor<Self>, DistError> {
        let Some(anchor) = anchor else { return Self::all_gather_rows(x, rows, group) };
        let out = B::all_gather_rows(x.primitive.clone(), rows, group)?;
        let state = (rows.to_vec(), group.clone(), anchor.primitive.shape(), anchor.primitive.dtype(), B::float_device(&anchor.primitive));
        Ok(match AnchoredGatherBackward.prepare::<C>([x.node.clone(), anchor.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(state, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        })
    }

    fn reduce_scatter_rows(x: FloatTensor<Self>, rows: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective!(ReduceScatterBackward, x, (rows.to_vec(), group.clone()), B::reduce_scatter_rows(x.primitive.clone(), rows, group))
    }

    fn all_to_all_rows(x: FloatTensor<Self>, send: &[usize], recv: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective!(AllToAllBackward, x, (send.to_vec(), recv.to_vec(), group.clone()), B::all_to_all_rows(x.primitive.clone(), send, recv, group))
    }

    fn all_reduce_sum(x: FloatTensor<Self>, group: &Group) -> Result<FloatTensor<Self>, DistError> {
        collective!(AllReduceBackward, x, group.clone(), B::all_reduce_sum(x.primitive.clone(), group))
    }

    fn shift_rows(x: FloatTensor<Self>, to: usize, from: usize, recv_rows: usize, group: &Group) -> Result<FloatTensor<Self>, DistError> {
        let sent = x.primitive.shape()[0];
        collective!(ShiftBackward, x, (to, from, sent, group.clone()), B::shift_rows(x.primitive.clone(), to, from, recv_rows, group))
    }
}

// ---------------------------------------------------------------------------------------------
// On tensors
// ---------------------------------------------------------------------------------------------

fn wrap<B: Backend, const D: usize>(r: Result<FloatTensor<B>, DistError>) -> Result<Tensor<B, D>, DistError> {
    r.map(|p| Tensor::from_primitive(TensorPrimitive::Float(p)))
}

/// [`CollectiveBackend::all_gather_rows`] on a tensor.
pub fn all_gather_rows<B: CollectiveBackend, const D: usize>(x: Tensor<B, D>, rows: &[usize], group: &Group) -> Result<Tensor<B, D>, DistError> {
    wrap(B::all_gather_rows(x.into_primitive().tensor(), rows, group))
}

/// [`CollectiveBackend::all_gather_rows_after`] on tensors.
pub fn all_gather_rows_after<B: CollectiveBackend, const D: usize, const DA: usize>(
    x: Tensor<B, D>,
    anchor: Option<Tensor<B, DA>>,
    rows: &[usize],
    group: &Group,
) -> Result<Tensor<B, D>, DistError> {
    wrap(B::all_gather_rows_after(x.into_primitive().tensor(), anchor.map(|a| a.into_primitive().tensor()), rows, group))
}

/// [`CollectiveBackend::reduce_scatter_rows`] on a tensor.
pub fn reduce_scatter_rows<B: CollectiveBackend, const D: usize>(x: Tensor<B, D>, rows: &[usize], group: &Group) -> Result<Tensor<B, D>, DistError> {
    wrap(B::reduce_scatter_rows(x.into_primitive().tensor(), rows, group))
}

/// [`CollectiveBackend::all_to_all_rows`] on a tensor.
pub fn all_to_all_rows<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    send: &[usize],
    recv: &[usize],
    group: &Group,
) -> Result<Tensor<B, D>, DistError> {
    wrap(B::all_to_all_rows(x.into_primitive().tensor(), send, recv, group))
}

/// [`CollectiveBackend::all_reduce_sum`] on a tensor.
pub fn all_reduce_sum<B: CollectiveBackend, const D: usize>(x: Tensor<B, D>, group: &Group) -> Result<Tensor<B, D>, DistError> {
    wrap(B::all_reduce_sum(x.into_primitive().tensor(), group))
}

/// [`CollectiveBackend::shift_rows`] on a tensor.
pub fn shift_rows<B: CollectiveBackend, const D: usize>(
    x: Tensor<B, D>,
    to: usize,
    from: usize,
    recv_rows: usize,
    group: &Group,
) -> Result<Tensor<B, D>, DistError> {
    wrap(B::shift_rows(x.into_primitive().tensor(), to, from, recv_rows, group))
}
