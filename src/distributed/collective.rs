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

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, Tensor, TensorData, TensorMetadata, TensorPrimitive};

use super::error::DistError;
use super::group::{check_counts, Group, ReduceBuf, ReduceOp};
use super::regather::{lock, ParamGather, Regather, RegatherTask};
use super::typed;

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

    /// One FSDP parameter gather ([`super::fsdp`]): `[value, link]` where `value` is
    /// `all_gather_rows(x)[..full_rows]` (every rank holds `x.rows` padded rows) and `link` a
    /// 1-D handle for the next gather's `links[0]`. Other backends ignore the links and the
    /// resharding; under `Autodiff` the gather takes `links` (the previous gather, the unit's
    /// input activation) as parents, so the reduce-scatters of a forward's gathers run in
    /// reverse forward order on every rank (Burn 0.21 orders backward steps by graph depth;
    /// two collectives at one depth could run in either order), and a resharded `value` is
    /// re-gathered in backward instead of kept.
    fn gather_param(x: FloatTensor<Self>, links: [Option<FloatTensor<Self>>; 2], site: &ParamGather) -> Result<[FloatTensor<Self>; 2], DistError> {
        let _ = links;
        let c = x.shape()[0];
        let gathered = Self::all_gather_rows(x, &vec![c; site.group.size()], site.group)?;
        let value = narrow_rows::<Self>(gathered, site.full_rows);
        let n = value.shape().num_elements();
        let link = Self::float_reshape(value.clone(), Shape::new([n]));
        Ok([value, link])
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

/// The first `rows` rows of `x` (dim 0).
fn narrow_rows<B: Backend>(x: FloatTensor<B>, rows: usize) -> FloatTensor<B> {
    let dims = x.shape().to_vec();
    if dims[0] == rows {
        return x;
    }
    let width: usize = dims[1..].iter().product();
    let flat = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(B::float_reshape(x, Shape::new([dims[0], width]))));
    let mut out = dims;
    out[0] = rows;
    B::float_reshape(flat.narrow(0, 0, rows).into_primitive().tensor(), Shape::from(out))
}

/// `x` with zero rows appended up to `rows` (dim 0).
fn pad_rows<B: Backend>(x: FloatTensor<B>, rows: usize) -> FloatTensor<B> {
    let mut dims = x.shape().to_vec();
    if dims[0] == rows {
        return x;
    }
    dims[0] = rows - dims[0];
    let zeros = B::float_zeros(Shape::from(dims), &B::float_device(&x), x.dtype().into());
    B::float_cat(vec![x, zeros], 0)
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

/// A resharded parameter waiting to be re-gathered: its view's key and its shard.
struct RegatherItem<B: Backend> {
    key: u64,
    shard: FloatTensor<B>,
    full_rows: usize,
    /// The group the parameter is sharded over (not necessarily the anchoring gather's).
    group: Group,
}

/// State of an FSDP gather `G` (see [`CollectiveBackend::gather_param`]).
#[derive(Clone)]
struct ParamGatherState<B: Backend> {
    /// Rows per rank, the full size, the gradient's geometry.
    shard_rows: usize,
    full_shape: Shape,
    dtype: DType,
    device: B::Device,
    group: Group,
    /// The view's key when this parameter is resharded (its unused re-gather is dropped).
    key: Option<u64>,
    regather: Arc<Regather>,
    /// The earlier units' resharded parameters this `G`'s backward re-gathers.
    before: Arc<Vec<RegatherItem<B>>>,
    /// Then their resharded constants (FP8 bases), once.
    tasks: Arc<Mutex<Vec<RegatherTask>>>,
}

impl<B: Backend> std::fmt::Debug for ParamGatherState<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ParamGather {{ shape: {:?}, re-gathers: {} }}", self.full_shape, self.before.len())
    }
}

#[derive(Debug)]
struct ParamGatherBackward;

impl<B: CollectiveBackend> Backward<B, 3> for ParamGatherBackward {
    type State = ParamGatherState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let s = &ops.state;
        let size = s.group.size();
        // no gradient: this rank did not use the unit; the reduce-scatter runs all the same
        let mut handle = <Autodiff<B> as AutodiffBackend>::from_inner(B::float_zeros(Shape::new([0]), &s.device, s.dtype.into()));
        handle.node = ops.node.clone();
        handle.rc = Arc::new(ops.node.id);
        let grad = grads.remove::<B>(&handle).unwrap_or_else(|| B::float_zeros(s.full_shape.clone(), &s.device, s.dtype.into()));
        let shard = B::reduce_scatter_rows(pad_rows::<B>(grad, s.shard_rows * size), &vec![s.shard_rows; size], &s.group).expect(BACKWARD);
        if let Some(node) = &ops.parents[0] {
            grads.register::<B>(node.id, shard);
        }
        if let Some(key) = s.key {
            // re-gathered for consumers that did not ask for it (an unused unit)
            drop(s.regather.drop_ready::<FloatTensor<B>>(key));
        }
        for item in s.before.iter() {
            let c = item.shard.shape()[0];
            let full = B::all_gather_rows(item.shard.clone(), &vec![c; item.group.size()], &item.group).expect(BACKWARD);
            s.regather.put_ready(item.key, narrow_rows::<B>(full, item.full_rows));
        }
        for task in std::mem::take(&mut *lock(&s.tasks)) {
            task();
        }
    }
}

/// The view `V` of a resharded parameter: identity, memory-bound, so its consumers record
/// "recompute" and the gathered tensor is freed after the forward; the recompute takes the
/// tensor `G`'s successor re-gathered.
#[derive(Debug)]
struct ReshardedViewBackward;

impl<B: Backend> Backward<B, 1> for ReshardedViewBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        register!(ops, grads, grad);
    }
}

#[derive(Debug)]
struct RetroRegathered<B> {
    gather: NodeId,
    key: u64,
    regather: Arc<Regather>,
    _b: std::marker::PhantomData<B>,
}

impl<B: Backend> RetroForward for RetroRegathered<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        // `G`'s placeholder state (kept so the checkpointer does not look past `G`)
        let _: FloatTensor<B> = states.get_state(&self.gather);
        let tensor = self.regather.take_ready::<FloatTensor<B>>(self.key).unwrap_or_else(|| {
            panic!(
                "FSDP: a resharded parameter was needed in backward before it was re-gathered — a unit's weights were \
                 consumed outside the unit, or a resharded unit was not followed by an anchored gather (distributed::fsdp)"
            )
        });
        states.save(out_node, tensor)
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

    fn gather_param(x: FloatTensor<Self>, links: [Option<FloatTensor<Self>>; 2], site: &ParamGather) -> Result<[FloatTensor<Self>; 2], DistError> {
        let size = site.group.size();
        let c = x.primitive.shape()[0];
        let full = narrow_rows::<B>(B::all_gather_rows(x.primitive.clone(), &vec![c; size], site.group)?, site.full_rows);
        let device = B::float_device(&full);
        let dtype = full.dtype();
        let placeholder = || B::float_zeros(Shape::new([1]), &device, dtype.into());
        let (before, tasks) = match site.regather_before {
            true => (site.regather.take_open::<RegatherItem<B>>(), site.regather.take_tasks()),
            false => (Vec::new(), Vec::new()),
        };
        let key = site.reshard.then(|| site.regather.key());
        let state = ParamGatherState::<B> {
            shard_rows: c,
            full_shape: full.shape(),
            dtype: full.dtype(),
            device: device.clone(),
            group: site.group.clone(),
            key,
            regather: site.regather.clone(),
            before: Arc::new(before),
            tasks: Arc::new(Mutex::new(tasks)),
        };
        // the parents: the shard, then the chain's previous link and the unit's input
        let [prev, after] = links;
        let nodes = [x.node.clone(), prev.unwrap_or_else(|| x.clone()).node, after.unwrap_or_else(|| x.clone()).node];
        let gathered = match ParamGatherBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(state, full.clone()),
            OpsKind::UnTracked(prep) => return Ok([prep.finish(full), Self::from_inner(placeholder())]),
        };
        // the next gather needs `G`'s node, not its tensor
        let mut link = gathered.clone();
        link.primitive = placeholder();
        let Some(key) = key else { return Ok([gathered, link]) };
        site.regather.push_open(RegatherItem::<B> { key, shard: x.primitive.clone(), full_rows: site.full_rows, group: site.group.clone() });
        let retro = RetroRegathered::<B> { gather: gathered.node.id, key, regather: site.regather.clone(), _b: Default::default() };
        // memory-bound whatever the backend's strategy: the consumers must not keep `full`
        let view = match ReshardedViewBackward
            .prepare::<BalancedCheckpointing>([gathered.node.clone()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&link])
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), full),
            OpsKind::UnTracked(prep) => prep.finish(full),
        };
        Ok([view, link])
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
