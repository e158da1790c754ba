//! FSDP-style parameter sharding (PyTorch FSDP2's `fully_shard`, ZeRO-3): every selected
//! parameter is split along dim 0 over the data-parallel group and each rank keeps one slice;
//! a module (a unit: embedding, vision tower, decoder layer, final norm, head) is gathered just
//! before it runs, freed after its forward, and gathered again just before its backward.
//!
//! ```text
//! shard_r(W) = W[r·c .. (r+1)·c]  (c = ⌈rows/P⌉; the last slices padded with zero rows)
//! forward:    W = all_gather(shard(W))[..rows]        (G, one op per parameter)
//! backward:   W = all_gather(shard(W))[..rows]        (re-gathered when the next unit's backward is done)
//!             ∂shard_r(W) = Σ_ranks ∂W[r·c .. (r+1)·c]   (reduce-scatter, G's adjoint)
//! ```
//!
//! One collective per parameter, not one per unit over a flattened buffer: Burn's slice
//! backward writes each piece into a zero tensor of the whole buffer, so unflattening a unit
//! of n parameters would cost n passes over the unit in every backward; per parameter it is
//! one pass.
//!
//! So parameters, their gradients and AdamW's moments (which follow the parameters' shapes)
//! take ~1/P of the memory per rank, and the gradient arrives summed over the group.
//!
//! **Ordering.** Every collective of the backward runs in the backward of a gather op `G`, and
//! the `G`s of a forward form one chain: each takes the previous one as a parent, and the first
//! `G` of a unit also takes the unit's input activation (the previous unit's output). Burn 0.21
//! runs backward steps by decreasing graph depth, so the `G`s run in exactly the reverse order
//! of the forward on every rank, whatever the data made of the rest of the graph (skewed MoE
//! routing, images on some ranks only). A unit gathered but unused by this rank's data (the
//! vision tower of a text-only micro-batch) still reduce-scatters — a zero gradient — because
//! the next `G` hangs off it; the trainer then drops gradients of units no rank used (the update
//! a single process would have skipped).
//!
//! **Freeing and re-gathering** (`reshard_after_forward`, FSDP2's default). A resharded
//! parameter reaches the unit through a view node `V` marked memory-bound, so the ops that need
//! the weight in backward (`linear`, `matmul`) record "recompute V" instead of keeping the
//! gathered tensor, and it is freed when the unit's forward ends. The first `G` of the next
//! unit re-gathers the unit's parameters in its backward, after its own reduce-scatter: that
//! `G` lies deeper than every op of the unit (the unit's output is its parent), so the
//! re-gathered weights are ready before the unit's backward needs them, and `V`'s recompute
//! only takes them from [`Regather`]'s store. The last units of a forward (final norm, head)
//! are kept, as FSDP2 does for the last module. Ops that keep a weight themselves instead of
//! asking the checkpointer (Burn's `embedding`, our RMSNorm and short-conv kernels: vectors and
//! small kernels) still hold the forward's copy until backward; the embedding of a sharded
//! model therefore runs as a row `select` (same values, same gradient), which needs no weight
//! in backward.
use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

use super::device::seam_group;
use super::mesh::MeshRole;
use crate::comm::group::Group;
use crate::comm::regather::{lock, ParamGather, Regather};
use crate::ops::backend::Glm5Backend;

/// Which parameters are sharded over which group, and the bookkeeping of the running forward.
pub struct ShardPlan {
    group: Group,
    /// Full dim-0 size of every sharded parameter.
    rows: HashMap<ParamId, usize>,
    /// Parameters sharded over another group than [`Self::group`] (an expert-parallel rank's
    /// experts over the ranks holding the same experts).
    groups: HashMap<ParamId, Group>,
    /// Free the units' gathered parameters after forward and re-gather them for backward.
    reshard_after_forward: bool,
    /// The previous gather's chain link in the current forward (a `Tensor<B, 1>` of that
    /// forward's backend).
    chain: Mutex<Option<Box<dyn Any + Send>>>,
    /// Resharded parameters waiting to be re-gathered, and re-gathered ones waiting for use.
    regather: Arc<Regather>,
    /// Whether a forward since the last [`Self::take_vision_used`] ran the vision tower.
    vision_used: AtomicBool,
}

impl std::fmt::Debug for ShardPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShardPlan {{ {} parameters over {} ranks }}", self.rows.len(), self.group.size())
    }
}

/// Rows per rank of a dim-0 size `rows` split over `size` ranks (padded: every rank the same).
pub(crate) fn shard_rows(rows: usize, size: usize) -> usize {
    rows.div_ceil(size.max(1))
}

/// Rows `[begin, end)` of the full tensor that rank `rank` holds (possibly empty: padding only).
pub(crate) fn shard_range(rows: usize, size: usize, rank: usize) -> std::ops::Range<usize> {
    let c = shard_rows(rows, size);
    (rank * c).min(rows)..((rank + 1) * c).min(rows)
}

/// The FSDP slice of one parameter a rank holds: rows [`shard_range`]`(rows, size, rank)` of
/// the full tensor, padded with zero rows to [`shard_rows`]`(rows, size)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowShard {
    /// The rank's index in the group the parameter is sharded over.
    pub rank: usize,
    /// That group's size.
    pub size: usize,
}

/// The parameters a model was built with as this rank's slices already (a rank-local load,
/// [`crate::checkpoint::LoadOptions::row_shards`]), by module path: the slice and the full
/// dim-0 size. [`ShardPlan::shard_over`] adopts them as they are instead of cutting them.
#[derive(Debug, Default, Clone)]
pub struct PreSharded {
    /// Module path → (slice, full rows).
    pub by_path: std::collections::BTreeMap<String, (RowShard, usize)>,
}

impl ShardPlan {
    /// Shard the parameters of `module` that `select` picks (by id and `require_grad`) over
    /// `group`: each rank keeps its slice (padded). Every rank must pass the same module
    /// (the same values: the slices are cut locally, nothing is exchanged). With
    /// `reshard_after_forward` the gathered parameters of a unit are freed after its forward
    /// and gathered again for its backward (module docs).
    pub fn shard<B: Backend, M: Module<B>>(
        module: M,
        group: Group,
        reshard_after_forward: bool,
        select: impl Fn(ParamId, bool) -> bool,
    ) -> (M, Arc<Self>) {
        let over = group.clone();
        Self::shard_over(module, group, reshard_after_forward, move |id, require_grad| select(id, require_grad).then(|| over.clone()))
    }

    /// [`Self::shard`] with a group per parameter: `select` returns the group to shard a
    /// parameter over (`None`: not sharded); `group` is the plan's own (the data-parallel
    /// world). Every rank of a parameter's group must select it over that group.
    pub fn shard_over<B: Backend, M: Module<B>>(
        module: M,
        group: Group,
        reshard_after_forward: bool,
        select: impl Fn(ParamId, bool) -> Option<Group>,
    ) -> (M, Arc<Self>) {
        Self::adopt_over(module, group, reshard_after_forward, select, &HashMap::new())
            .unwrap_or_else(|_| unreachable!("nothing to adopt, nothing to refuse"))
    }

    /// [`Self::shard_over`] for a module some of whose parameters are this rank's slices
    /// already (`loaded`: id → slice and full rows, from a rank-local load): those are adopted
    /// as they are, the others cut. An error naming the first parameter whose slice is not
    /// the one `select` asks for (loaded for another mesh, or sharded but selected whole).
    pub fn adopt_over<B: Backend, M: Module<B>>(
        module: M,
        group: Group,
        reshard_after_forward: bool,
        select: impl Fn(ParamId, bool) -> Option<Group>,
        loaded: &HashMap<ParamId, (RowShard, usize)>,
    ) -> Result<(M, Arc<Self>), (ParamId, String)> {
        let mut mapper =
            Cut::<B, _> { select, rows: HashMap::new(), groups: HashMap::new(), world: group.clone(), loaded, refused: None, _b: Default::default() };
        let module = module.map(&mut mapper);
        if let Some(refused) = mapper.refused {
            return Err(refused);
        }
        let plan = Arc::new(Self {
            group,
            rows: mapper.rows,
            groups: mapper.groups,
            reshard_after_forward,
            chain: Mutex::new(None),
            regather: Arc::default(),
            vision_used: AtomicBool::new(false),
        });
        Ok((module, plan))
    }

    /// The plan's group: the data-parallel world (most parameters are sharded over it).
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// The group parameter `id` is sharded over.
    pub fn group_of(&self, id: ParamId) -> &Group {
        self.groups.get(&id).unwrap_or(&self.group)
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

    /// Whether units are freed after forward and re-gathered for backward.
    pub fn reshard_after_forward(&self) -> bool {
        self.reshard_after_forward
    }

    /// The re-gather bookkeeping (tests).
    pub fn regather(&self) -> &Arc<Regather> {
        &self.regather
    }

    /// Start a forward: the chain and the re-gather bookkeeping begin anew.
    pub fn begin(&self) {
        *lock(&self.chain) = None;
        self.regather.clear();
    }

    /// End a forward: drop the chain's last link.
    pub fn end(&self) {
        *lock(&self.chain) = None;
    }

    /// Record that this rank ran the vision tower.
    pub fn mark_vision_used(&self) {
        self.vision_used.store(true, Ordering::Relaxed);
    }

    /// Whether the vision tower ran since the last call (and reset).
    pub fn take_vision_used(&self) -> bool {
        self.vision_used.swap(false, Ordering::Relaxed)
    }

    /// Whether `unit` holds a parameter of this plan (its [`Self::gather`] runs collectives).
    /// A unit may reshard only if a later unit of the same forward does: that unit's first
    /// gather re-gathers it in backward (a LoRA run shards only its adapters, so frozen units
    /// gather nothing).
    pub fn holds<B: Backend, M: Module<B>>(&self, unit: &M) -> bool {
        struct Holds<'a>(&'a HashMap<ParamId, usize>, bool);
        impl<B: Backend> burn::module::ModuleVisitor<B> for Holds<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.1 |= self.0.contains_key(&param.id);
            }
        }
        let mut v = Holds(&self.rows, false);
        unit.visit(&mut v);
        v.1
    }

    /// `unit` with its sharded parameters replaced by the gathered full tensors
    /// (differentiable: the shards receive the group's summed gradient). `after` is the
    /// unit's input activation — the previous unit's output — on which the unit's first gather
    /// is anchored (its primitive: a reshape would add a node no gradient reaches); `reshard` frees the unit after its forward (honoured only when the plan
    /// reshards and the gathers will be followed by an anchored one: the caller's promise).
    /// Every rank must gather the same units in the same order. A unit without sharded
    /// parameters is returned as it is, without a collective.
    pub fn gather<B: Glm5Backend, M: Module<B>>(&self, unit: &M, after: Option<FloatTensor<B>>, reshard: bool) -> M {
        let mut chain = lock(&self.chain);
        let link = chain.take().and_then(|a| a.downcast::<Tensor<B, 1>>().ok()).map(|a| *a);
        let mut gather = Gather { plan: self, link, after, reshard: reshard && self.reshard_after_forward };
        let unit = unit.clone().map(&mut gather);
        *chain = gather.link.map(|a| Box::new(a) as Box<dyn Any + Send>);
        unit
    }
}

/// Cuts each selected parameter to this rank's padded slice (or adopts one loaded so).
struct Cut<'a, B, F> {
    select: F,
    rows: HashMap<ParamId, usize>,
    groups: HashMap<ParamId, Group>,
    world: Group,
    loaded: &'a HashMap<ParamId, (RowShard, usize)>,
    refused: Option<(ParamId, String)>,
    _b: std::marker::PhantomData<B>,
}

impl<B: Backend, F: Fn(ParamId, bool) -> Option<Group>> ModuleMapper<B> for Cut<'_, B, F> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let require_grad = param.is_require_grad();
        let selected = (self.select)(param.id, require_grad);
        if let Some(&(shard, full)) = self.loaded.get(&param.id) {
            let held = param.lazy_shape().to_vec().first().copied().unwrap_or(0);
            match &selected {
                Some(g) if g.size() == shard.size && g.rank() == shard.rank && held == shard_rows(full, shard.size) => {
                    self.rows.insert(param.id, full);
                    if !Arc::ptr_eq(g, &self.world) {
                        self.groups.insert(param.id, g.clone());
                    }
                }
                Some(g) => {
                    self.refused.get_or_insert((
                        param.id,
                        format!(
                            "was loaded as rank {} of {} ({held} of {full} rows) but is sharded over rank {} of {} here",
                            shard.rank,
                            shard.size,
                            g.rank(),
                            g.size()
                        ),
                    ));
                }
                None => {
                    self.refused.get_or_insert((
                        param.id,
                        format!("was loaded as rank {} of {}'s slice but is kept whole here (frozen, or not sharded)", shard.rank, shard.size),
                    ));
                }
            }
            return param;
        }
        let Some(group) = selected else {
            return param;
        };
        let (size, rank) = (group.size(), group.rank());
        if !Arc::ptr_eq(&group, &self.world) {
            self.groups.insert(param.id, group);
        }
        let (id, tensor, mapper) = param.consume();
        let dims = tensor.dims();
        let rows = dims[0];
        let c = shard_rows(rows, size);
        let range = shard_range(rows, size, rank);
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

/// Gathers each sharded parameter of a unit, in visiting order, each gather a link of the
/// chain; the first also anchored on `after`.
struct Gather<'a, B: Backend> {
    plan: &'a ShardPlan,
    link: Option<Tensor<B, 1>>,
    after: Option<FloatTensor<B>>,
    reshard: bool,
}

impl<B: Glm5Backend> ModuleMapper<B> for Gather<'_, B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(&rows) = self.plan.rows.get(&param.id) else { return param };
        let (id, shard, mapper) = param.consume();
        let after = self.after.take();
        // the device's mesh decides the group (its experts' shards over the expert-data group)
        let role = if self.plan.groups.contains_key(&id) { MeshRole::ExpertData } else { MeshRole::World };
        let group =
            seam_group(&shard.device(), role, self.plan.group_of(id)).unwrap_or_else(|e| panic!("the FSDP gather of a sharded parameter: {e}"));
        let site =
            ParamGather { full_rows: rows, group: &group, reshard: self.reshard, regather_before: after.is_some(), regather: &self.plan.regather };
        let prim = |t: Tensor<B, 1>| t.into_primitive().tensor();
        // a failing engine aborts the MPI job; the counts are equal by construction
        let [value, link] = B::gather_param(shard.into_primitive().tensor(), [self.link.take().map(prim), after], &site)
            .expect("the all-gather of a sharded parameter failed");
        self.link = Some(Tensor::from_primitive(TensorPrimitive::Float(link)));
        Param::from_mapped_value(id, Tensor::from_primitive(TensorPrimitive::Float(value)), mapper)
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
