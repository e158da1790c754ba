//! FSDP-style parameter sharding (PyTorch FSDP2's `fully_shard`, ZeRO-3): every selected
//! parameter is split along dim 0 over the data-parallel group and each rank keeps one slice;
//! a module (a unit: embedding, decoder layer, head, vision tower) is gathered just before it
//! runs.
//!
//! ```text
//! shard_r(W) = W[r·c .. (r+1)·c]  (c = ⌈rows/P⌉; the last slices padded with zero rows)
//! gather(W):  W = concat_r(shard_r(W))[..rows] = all_gather_rows_after(shard(W), anchor)[..rows]
//! backward:   ∂shard_r(W) = Σ_ranks ∂W[r·c .. (r+1)·c]                  (reduce-scatter)
//! ```
//!
//! One collective per parameter, not one per unit over a flattened buffer: Burn's slice
//! backward writes each piece into a zero tensor of the whole buffer, so unflattening a unit
//! of n parameters cost n passes over the unit in every backward (measured: FSDP with 2 ranks
//! 16 % slower per step than one process on `bench_small`); per parameter it is one pass.
//!
//! So parameters, their gradients and AdamW's moments (which follow the parameters' shapes)
//! take ~1/P of the memory per rank, and the gradient arrives summed over the group: the
//! reduce-scatter is the gather's adjoint (`collective.rs`).
//!
//! **Ordering.** Every gather of a forward takes the previous gather's output as its anchor
//! ([`super::CollectiveBackend::all_gather_rows_after`]), so the gathers form one chain on the
//! autodiff graph and their reduce-scatters run in exactly the reverse order on every rank,
//! whatever the data made of the rest of the graph. A unit gathered but unused by this rank's
//! data (the vision tower of a text-only micro-batch) still reduce-scatters — a zero gradient —
//! because the next gather hangs off it; the trainer then drops gradients of units no rank used
//! (the update a single process would have skipped).
//!
//! **Memory during a step.** The gathered weights a backward needs stay referenced by the
//! autodiff graph until that backward has run (Burn 0.21 saves operands, not the recipe to
//! re-gather them), so within a step the peak holds the gathered weights of the layers between
//! forward and backward, as FSDP with `reshard_after_forward=False` does; between steps only the
//! shards remain.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

use super::collective::{all_gather_rows_after, CollectiveBackend, Group};

/// Which parameters are sharded over which group, and the anchor chain of the running forward.
pub struct ShardPlan {
    group: Group,
    /// Full dim-0 size of every sharded parameter.
    rows: HashMap<ParamId, usize>,
    /// The previous gather's output in the current forward (a `Tensor<B, 2>` of that forward's
    /// backend).
    chain: Mutex<Option<Box<dyn Any + Send>>>,
    /// Whether a forward since the last [`Self::take_vision_used`] ran the vision tower.
    vision_used: AtomicBool,
}

impl std::fmt::Debug for ShardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShardPlan {{ {} parameters over {} ranks }}", self.rows.len(), self.group.size())
    }
}

/// Rows per rank of a dim-0 size `rows` split over `size` ranks (padded: every rank the same).
pub fn shard_rows(rows: usize, size: usize) -> usize {
    rows.div_ceil(size.max(1))
}

/// Rows `[begin, end)` of the full tensor that rank `rank` holds (possibly empty: padding only).
pub fn shard_range(rows: usize, size: usize, rank: usize) -> std::ops::Range<usize> {
    let c = shard_rows(rows, size);
    (rank * c).min(rows)..((rank + 1) * c).min(rows)
}

impl ShardPlan {
    /// Shard the parameters of `module` that `select` picks (by id and `require_grad`) over
    /// `group`: each rank keeps its slice (padded). Every rank must pass the same module
    /// (the same values: the slices are cut locally, nothing is exchanged).
    pub fn shard<B: Backend, M: Module<B>>(module: M, group: Group, select: impl Fn(ParamId, bool) -> bool) -> (M, Arc<Self>) {
        let mut mapper = Cut::<B, _> { rank: group.rank(), size: group.size(), select, rows: HashMap::new(), _b: Default::default() };
        let module = module.map(&mut mapper);
        let plan = Arc::new(Self { group, rows: mapper.rows, chain: Mutex::new(None), vision_used: AtomicBool::new(false) });
        (module, plan)
    }

    /// The group the parameters are sharded over.
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// Whether `id` is sharded, and its full dim-0 size.
    pub fn full_rows(&self, id: ParamId) -> Option<usize> {
        self.rows.get(&id).copied()
    }

    /// Number of sharded parameters.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether nothing is sharded.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Start a forward: the anchor chain begins anew.
    pub fn begin(&self) {
        *self.chain.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// End a forward: drop the chain's last link (it would keep the last gathered weights).
    pub fn end(&self) {
        self.begin();
    }

    /// Record that this rank ran the vision tower.
    pub fn mark_vision_used(&self) {
        self.vision_used.store(true, Ordering::Relaxed);
    }

    /// Whether the vision tower ran since the last call (and reset).
    pub fn take_vision_used(&self) -> bool {
        self.vision_used.swap(false, Ordering::Relaxed)
    }

    /// `unit` with its sharded parameters replaced by the gathered full tensors
    /// (differentiable: the shards receive the group's summed gradient). Every rank must gather
    /// the same units in the same order. A unit without sharded parameters is returned as it
    /// is, without a collective.
    pub fn gather<B: CollectiveBackend, M: Module<B>>(&self, unit: &M) -> M {
        let mut chain = self.chain.lock().unwrap_or_else(|e| e.into_inner());
        let anchor = chain.take().and_then(|a| a.downcast::<Tensor<B, 1>>().ok()).map(|a| *a);
        let mut gather = Gather { plan: self, anchor };
        let unit = unit.clone().map(&mut gather);
        *chain = gather.anchor.map(|a| Box::new(a) as Box<dyn Any + Send>);
        unit
    }
}

/// Cuts each selected parameter to this rank's padded slice.
struct Cut<B, F> {
    rank: usize,
    size: usize,
    select: F,
    rows: HashMap<ParamId, usize>,
    _b: std::marker::PhantomData<B>,
}

impl<B: Backend, F: Fn(ParamId, bool) -> bool> ModuleMapper<B> for Cut<B, F> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let require_grad = param.is_require_grad();
        if !(self.select)(param.id, require_grad) {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.dims();
        let rows = dims[0];
        let c = shard_rows(rows, self.size);
        let range = shard_range(rows, self.size, self.rank);
        let have = range.len();
        let mut pad = dims;
        pad[0] = c - have;
        let zeros = || Tensor::<B, D>::zeros(pad, &tensor.device()).cast(tensor.dtype());
        let slice = match have {
            0 => zeros(),
            _ if have == c => tensor.clone().detach().narrow(0, range.start, have),
            _ => Tensor::cat(vec![tensor.clone().detach().narrow(0, range.start, have), zeros()], 0),
        };
        self.rows.insert(id, rows);
        // a fresh leaf (slicing a tracked parameter would give a graph node)
        let leaf = Tensor::<B, D>::from_data(slice.into_data(), &tensor.device());
        Param::from_mapped_value(id, leaf.set_require_grad(require_grad), mapper)
    }
}

/// Gathers each sharded parameter of a unit, in visiting order, each gather anchored on the
/// previous one (the chain).
struct Gather<'a, B: Backend> {
    plan: &'a ShardPlan,
    anchor: Option<Tensor<B, 1>>,
}

impl<B: CollectiveBackend> ModuleMapper<B> for Gather<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(&rows) = self.plan.rows.get(&param.id) else { return param };
        let (id, shard, mapper) = param.consume();
        let size = self.plan.group.size();
        let c = shard.dims()[0];
        // a failing engine aborts the MPI job; the counts are equal by construction
        let gathered =
            all_gather_rows_after(shard, self.anchor.take(), &vec![c; size], &self.plan.group).expect("the all-gather of a sharded parameter failed");
        let n = gathered.shape().num_elements();
        self.anchor = Some(gathered.clone().reshape([n]));
        Param::from_mapped_value(id, gathered.narrow(0, 0, rows), mapper)
    }
}

/// The full tensor of a sharded parameter from every rank's shard, on the host (checkpoints,
/// tests): `shards[r]` is rank `r`'s padded slice, row-major.
pub fn unshard_host(shards: &[Vec<f32>], full_rows: usize, row_width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(full_rows * row_width);
    for s in shards {
        let take = (full_rows * row_width - out.len()).min(s.len());
        out.extend_from_slice(&s[..take]);
    }
    out
}
