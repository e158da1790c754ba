//! `Autodiff<B>`'s collectives ([`crate::ops::collective`]): each runs `B`'s and records its
//! adjoint, and the FSDP gather records the chain that orders the backward's collectives and
//! the re-gathers of resharded parameters ([`crate::distributed::fsdp`], "Ordering").

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, CheckpointStrategy};
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};

use super::Glm5Backend;
use crate::comm::regather::{lock, ParamGather, Regather, RegatherTask};
use crate::comm::{DistError, Group};
use crate::ops::collective::local::{narrow_rows, pad_rows};

type A<B, C> = Autodiff<B, C>;

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

impl<B: Glm5Backend> Backward<B, 1> for AllGatherBackward {
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

/// State of an FSDP gather `G` (see [`Glm5Backend::gather_param`]).
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

impl<B: Glm5Backend> Backward<B, 3> for ParamGatherBackward {
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

impl<B: Glm5Backend> Backward<B, 1> for ReduceScatterBackward {
    type State = (Vec<usize>, Group);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (rows, group) = &ops.state;
        register!(ops, grads, B::all_gather_rows(grad, rows, group).expect(BACKWARD));
    }
}

#[derive(Debug)]
struct AllToAllBackward;

impl<B: Glm5Backend> Backward<B, 1> for AllToAllBackward {
    type State = (Vec<usize>, Vec<usize>, Group);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (send, recv, group) = &ops.state;
        register!(ops, grads, B::all_to_all_rows(grad, recv, send, group).expect(BACKWARD));
    }
}

#[derive(Debug)]
struct AllReduceBackward;

impl<B: Glm5Backend> Backward<B, 1> for AllReduceBackward {
    type State = Group;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        register!(ops, grads, B::all_reduce_sum(grad, &ops.state).expect(BACKWARD));
    }
}

#[derive(Debug)]
struct ShiftBackward;

impl<B: Glm5Backend> Backward<B, 1> for ShiftBackward {
    /// (to, from, rows sent, group)
    type State = (usize, usize, usize, Group);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (to, from, sent, group) = &ops.state;
        register!(ops, grads, B::shift_rows(grad, *from, *to, *sent, group).expect(BACKWARD));
    }
}

pub(super) fn all_gather_rows<B: Glm5Backend, C: CheckpointStrategy>(
    x: FloatTensor<A<B, C>>,
    rows: &[usize],
    group: &Group,
) -> Result<FloatTensor<A<B, C>>, DistError> {
    collective!(AllGatherBackward, x, (rows.to_vec(), group.clone()), B::all_gather_rows(x.primitive.clone(), rows, group))
}

pub(super) fn gather_param<B: Glm5Backend, C: CheckpointStrategy>(
    x: FloatTensor<A<B, C>>,
    links: [Option<FloatTensor<A<B, C>>>; 2],
    site: &ParamGather,
) -> Result<[FloatTensor<A<B, C>>; 2], DistError> {
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
        OpsKind::UnTracked(prep) => return Ok([prep.finish(full), A::<B, C>::from_inner(placeholder())]),
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

pub(super) fn reduce_scatter_rows<B: Glm5Backend, C: CheckpointStrategy>(
    x: FloatTensor<A<B, C>>,
    rows: &[usize],
    group: &Group,
) -> Result<FloatTensor<A<B, C>>, DistError> {
    collective!(ReduceScatterBackward, x, (rows.to_vec(), group.clone()), B::reduce_scatter_rows(x.primitive.clone(), rows, group))
}

pub(super) fn all_to_all_rows<B: Glm5Backend, C: CheckpointStrategy>(
    x: FloatTensor<A<B, C>>,
    send: &[usize],
    recv: &[usize],
    group: &Group,
) -> Result<FloatTensor<A<B, C>>, DistError> {
    collective!(AllToAllBackward, x, (send.to_vec(), recv.to_vec(), group.clone()), B::all_to_all_rows(x.primitive.clone(), send, recv, group))
}

pub(super) fn all_reduce_sum<B: Glm5Backend, C: CheckpointStrategy>(
    x: FloatTensor<A<B, C>>,
    group: &Group,
) -> Result<FloatTensor<A<B, C>>, DistError> {
    collective!(AllReduceBackward, x, group.clone(), B::all_reduce_sum(x.primitive.clone(), group))
}

pub(super) fn shift_rows<B: Glm5Backend, C: CheckpointStrategy>(
    x: FloatTensor<A<B, C>>,
    to: usize,
    from: usize,
    recv_rows: usize,
    group: &Group,
) -> Result<FloatTensor<A<B, C>>, DistError> {
    let sent = x.primitive.shape()[0];
    collective!(ShiftBackward, x, (to, from, sent, group.clone()), B::shift_rows(x.primitive.clone(), to, from, recv_rows, group))
}
