//! Data parallelism, sharded ([`shard_model`], FSDP: `distributed::fsdp`) or replicated.
//!
//! Replicated parameters (DDP, and under sharding the few that stay replicated): every rank holds the whole model, runs
//! its share of a global batch's micro-batches, and the gradients are summed over the group
//! before clipping and the (then identical) AdamW update — the semantics of one process
//! running the whole global batch, as PyTorch's `DistributedDataParallel` gives them.
//!
//! The sums are formed so that every rank gets the same bits: gradients by reduce-scatter then
//! all-gather (each element is reduced once, by its owner — an `MPI_Allreduce` may combine
//! partial sums in a different order on each rank, and replicas would drift apart over a long
//! run), scalars by gathering every rank's value and adding them in rank order.

use std::collections::HashSet;
use std::sync::Arc;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::distributed::typed::{all_gather, all_gather_v};
use crate::distributed::{DistError, Group, ProcessGroup, ReduceBuf, ReduceOp, ShardPlan};
use crate::model::Glm5ForCausalLM;
use crate::text::decoder::Ffn;
use crate::text::moe::ExpertParallel;

/// Gradients (and whether each parameter has one) flattened in visiting order.
struct Collect<'a, B: AutodiffBackend> {
    skip: &'a dyn Fn(ParamId) -> bool,
    grads: &'a mut GradientsParams,
    values: Vec<f32>,
    present: Vec<i64>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.is_require_grad() || (self.skip)(param.id) {
            return;
        }
        let n = param.shape().num_elements();
        match self.grads.remove::<B::InnerBackend, D>(param.id) {
            Some(g) => {
                self.values.extend(g.cast(DType::F32).into_data().convert::<f32>().into_vec::<f32>().expect("converted to f32"));
                self.present.push(1);
            }
            None => {
                self.values.extend(std::iter::repeat_n(0.0, n));
                self.present.push(0);
            }
        }
    }
}

/// Puts the reduced gradients back, in the parameters' dtypes.
struct Restore<'a, B: AutodiffBackend> {
    skip: &'a dyn Fn(ParamId) -> bool,
    grads: &'a mut GradientsParams,
    values: &'a [f32],
    present: &'a [i64],
    at: usize,
    index: usize,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Restore<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if !param.is_require_grad() || (self.skip)(param.id) {
            return;
        }
        let shape = param.shape();
        let n = shape.num_elements();
        if self.present[self.index] > 0 {
            let v = param.val();
            let data = TensorData::new(self.values[self.at..self.at + n].to_vec(), shape);
            let g = Tensor::<B::InnerBackend, D>::from_data(data, (&v.device(), DType::F32)).cast(v.dtype());
            self.grads.register::<B::InnerBackend, D>(param.id, g);
        }
        self.at += n;
        self.index += 1;
    }
}

/// Sums `grads` over `group`, in place, the same bits on every rank. A parameter that has a
/// gradient on any rank has one everywhere afterwards (zeros where a rank had none).
pub fn all_reduce_grads<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    group: &dyn ProcessGroup,
) -> Result<(), DistError> {
    all_reduce_grads_except::<B, M>(module, grads, group, &|_| false)
}

/// [`all_reduce_grads`] for the parameters `skip` does not name (a sharded model's shards
/// arrive summed already, through the gather's adjoint).
pub(crate) fn all_reduce_grads_except<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    grads: &mut GradientsParams,
    group: &dyn ProcessGroup,
    skip: &dyn Fn(ParamId) -> bool,
) -> Result<(), DistError> {
    if group.size() == 1 {
        return Ok(());
    }
    let mut c = Collect::<B> { skip, grads, values: Vec::new(), present: Vec::new(), _b: std::marker::PhantomData };
    module.visit(&mut c);
    let Collect { grads, mut values, mut present, .. } = c;
    group.all_reduce(ReduceBuf::I64(&mut present), ReduceOp::Max)?;
    // owner blocks as even as possible; each rank reduces its block, then everyone gathers
    let (n, size) = (values.len(), group.size());
    let counts: Vec<usize> = (0..size).map(|r| n / size + usize::from(r < n % size)).collect();
    let mut mine = vec![0f32; counts[group.rank()]];
    group.reduce_scatter_v(ReduceBuf::F32(&mut values), ReduceBuf::F32(&mut mine), &counts, ReduceOp::Sum)?;
    let summed = all_gather_v(group, &mine, &counts)?;
    let mut r = Restore::<B> { skip, grads, values: &summed, present: &present, at: 0, index: 0, _b: std::marker::PhantomData };
    module.visit(&mut r);
    Ok(())
}

/// Registers a zero gradient for every trainable parameter `select` names that has none.
pub(crate) fn zero_missing_grads<B: AutodiffBackend, M: Module<B>>(module: &M, grads: &mut GradientsParams, select: &dyn Fn(ParamId) -> bool) {
    struct Zero<'a>(&'a mut GradientsParams, &'a dyn Fn(ParamId) -> bool);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Zero<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.is_require_grad() && (self.1)(param.id) && self.0.get::<B::InnerBackend, D>(param.id).is_none() {
                let v = param.val().inner();
                self.0.register::<B::InnerBackend, D>(param.id, v.zeros_like());
            }
        }
    }
    module.visit(&mut Zero(grads, select));
}

/// Every rank's `x` added in rank order: the same value on every rank.
pub fn sum_f64(group: &dyn ProcessGroup, x: f64) -> Result<f64, DistError> {
    Ok(all_gather(group, &[x])?.iter().sum())
}

/// Every rank's `x` summed (exact).
pub(crate) fn sum_usize(group: &dyn ProcessGroup, x: usize) -> Result<usize, DistError> {
    let mut v = [x as i64];
    group.all_reduce(ReduceBuf::I64(&mut v), ReduceOp::Sum)?;
    Ok(v[0] as usize)
}

/// Every rank's `x`, in rank order.
pub(crate) fn gather_usize(group: &dyn ProcessGroup, x: usize) -> Result<Vec<usize>, DistError> {
    Ok(all_gather(group, &[x as u64])?.into_iter().map(|v| v as usize).collect())
}

/// Shard `model`'s trainable parameters over `group` ([`crate::distributed::fsdp`]): every
/// parameter that requires a gradient, except the ones that require one but never receive it
/// — the indexers' (the reference runs them under `no_grad`) and the routers'
/// `e_score_correction_bias` (selection only, moved by the bias update) — which stay
/// replicated, so that AdamW leaves them alone as it does in one process (a shard would
/// receive a zero gradient through the gather and weight decay would move it). Apply after
/// freezing: frozen parameters stay replicated.
pub fn shard_model<B: crate::ops::backend::Glm5Backend>(
    model: Glm5ForCausalLM<B>,
    group: Group,
    reshard_after_forward: bool,
) -> Result<Glm5ForCausalLM<B>, DistError> {
    shard_model_where(model, group, reshard_after_forward, true, None)
}

/// Parameters FSDP keeps whole although they train: the indexers' (the reference runs them
/// under `no_grad`) and the routers' `e_score_correction_bias` (selection only, moved by the
/// bias update), by module path.
pub(crate) fn kept_whole(path: &str) -> bool {
    path.contains(".indexer.") || path.ends_with("e_score_correction_bias")
}

/// Whether the module tensor at `path` belongs to the routed experts of an MoE layer (their
/// stacks and LoRA stacks: [`expert_param_ids`]).
pub(crate) fn is_routed_expert(path: &str) -> bool {
    path.contains(".mlp.experts.")
}

/// [`shard_model`] for a model that may hold an expert-parallel share of the experts. With
/// `shard = false` the plan shards nothing: the parameters stay replicated but go through the
/// sharded paths (every rank writes its part of a checkpoint), which expert parallelism needs
/// whether or not the dense parameters are sharded. An expert-parallel rank's experts are
/// sharded over `experts_over` — the expert-data-parallel group, the ranks holding the same
/// experts ([`ExpertMesh::edp`]) — when `shard` is set and that group has several ranks, and
/// stay whole otherwise (their gradients then summed over that group by the trainer).
///
/// Parameters loaded as this rank's slices ([`Glm5ForCausalLM::pre_sharded`]) are adopted as
/// they are; an error names the first one loaded for another mesh or another selection.
pub fn shard_model_where<B: crate::ops::backend::Glm5Backend>(
    model: Glm5ForCausalLM<B>,
    group: Group,
    reshard_after_forward: bool,
    shard: bool,
    experts_over: Option<Group>,
) -> Result<Glm5ForCausalLM<B>, DistError> {
    let experts = expert_param_ids(&model);
    let ids = super::params::param_ids::<B, _>(&model);
    let replicated: HashSet<ParamId> = ids.iter().filter(|(path, _)| kept_whole(path)).map(|(_, id)| *id).collect();
    let loaded: std::collections::HashMap<ParamId, _> = match &model.pre_sharded {
        Some(pre) => pre.by_path.iter().filter_map(|(path, slice)| Some((*ids.get(path)?, *slice))).collect(),
        None => Default::default(),
    };
    let local_experts = expert_parallel_of(&model).is_some();
    let select = |id, require_grad| {
        if !(shard && require_grad) || replicated.contains(&id) {
            return None;
        }
        if local_experts && experts.contains(&id) {
            return experts_over.clone().filter(|g| g.size() > 1);
        }
        Some(group.clone())
    };
    let (mut model, plan) = ShardPlan::adopt_over(model, group.clone(), reshard_after_forward, select, &loaded).map_err(|(id, why)| {
        let path = ids.iter().find(|(_, &v)| v == id).map(|(p, _)| p.as_str()).unwrap_or("?");
        DistError::Mesh {
            message: format!(
                "module tensor {path} {why}: load the model with the options of the run that shards it \
                 (TrainOptions::base_load_options), or without LoadOptions::row_shards"
            ),
            reported: false,
        }
    })?;
    if shard && group.size() > 1 {
        // the FP8 experts over the group their parameters would be sharded over
        let fp8_experts_over = if local_experts { experts_over.clone().filter(|g| g.size() > 1) } else { Some(group.clone()) };
        shard_fp8_base(&mut model, &group, fp8_experts_over)?;
    }
    model.language_model.shards = Some(plan);
    Ok(model)
}

/// Split every FP8-resident projection of the decoder layers (a LoRA run's frozen base,
/// [`crate::checkpoint::LoadOptions::fp8_base`]) over `group` by whole blocks of rows
/// ([`crate::text::fp8_weight::Fp8Weight::into_shard`]), as FSDP splits the parameters: module
/// constants are not parameters, so the shard plan does not see them; the text model gathers
/// them with their layer and frees them after it
/// ([`crate::text::model::TextModel::fp8_gathered`]). The routed experts' FP8 stacks are split
/// by whole experts over `experts_over` (the group their parameters would be sharded over:
/// the expert-data-parallel group under expert parallelism, else the world), and the vision
/// tower's projections stay whole. A weight already split for another group is an error
/// naming it.
fn shard_fp8_base<B: burn::tensor::backend::Backend>(
    model: &mut Glm5ForCausalLM<B>,
    group: &Group,
    experts_over: Option<Group>,
) -> Result<(), DistError> {
    let shard = crate::distributed::RowShard { rank: group.rank(), size: group.size() };
    for layer in &mut model.language_model.layers {
        let (Ffn::Moe(moe), Some(over)) = (&mut layer.mlp, &experts_over) else { continue };
        for stack in moe.experts.fp8.iter_mut().flat_map(|x| x.stacks_mut()) {
            if stack.shard.is_none() {
                *stack = stack.clone().into_shard(over.clone());
            }
        }
    }
    for (i, layer) in model.language_model.layers.iter_mut().enumerate() {
        for (name, l) in layer.projections_mut() {
            let Some(q) = l.fp8.take() else { continue };
            l.fp8 = Some(match q.shard {
                None => q.into_shard(shard),
                Some((s, _)) if s == shard => q,
                Some((s, _)) => {
                    return Err(DistError::Mesh {
                        message: format!(
                            "the FP8 base of model.language_model.layers.{i}.{name} is rank {} of {}'s slice but is sharded over rank {} of {} here",
                            s.rank, s.size, shard.rank, shard.size
                        ),
                        reported: false,
                    })
                }
            });
        }
    }
    Ok(())
}

/// The FP8-resident projections and experts of a model sharded by [`shard_fp8_base`]
/// gathered whole.
fn unshard_fp8_base<B: burn::tensor::backend::Backend>(model: &mut Glm5ForCausalLM<B>, group: &Group) -> Result<(), DistError> {
    for layer in &mut model.language_model.layers {
        if let Ffn::Moe(moe) = &mut layer.mlp {
            for stack in moe.experts.fp8.iter_mut().flat_map(|x| x.stacks_mut()) {
                *stack = stack.gathered(None)?;
            }
        }
        for (name, l) in layer.projections_mut() {
            if let Some(q) = l.fp8.as_mut().filter(|q| q.shard.is_some()) {
                *q = q
                    .gathered(group, None)
                    .map_err(|e| DistError::Mesh { message: format!("gathering the FP8 base of {name}: {e}"), reported: false })?;
            }
        }
    }
    Ok(())
}

/// Ids of the routed experts' parameters (every MoE layer's `mlp.experts`, their LoRA stacks
/// included).
pub fn expert_param_ids<B: burn::tensor::backend::Backend>(model: &Glm5ForCausalLM<B>) -> HashSet<ParamId> {
    model
        .language_model
        .layers
        .iter()
        .filter_map(|layer| match &layer.mlp {
            Ffn::Moe(moe) => {
                let e = &moe.experts;
                // an expert's LoRA stacks are split, reduced and clipped with the expert
                let lora = [&e.lora_gate_up, &e.lora_down].into_iter().flatten().flat_map(|l| [l.a.id, l.b.id]);
                Some([&e.gate_proj, &e.up_proj, &e.down_proj].into_iter().flatten().map(|p| p.id).chain(lora).collect::<Vec<_>>())
            }
            _ => None,
        })
        .flatten()
        .collect()
}

/// The expert parallelism of `model` (its MoE layers share one), if it holds a share.
pub fn expert_parallel_of<B: burn::tensor::backend::Backend>(model: &Glm5ForCausalLM<B>) -> Option<Arc<ExpertParallel>> {
    model.language_model.layers.iter().find_map(|layer| match &layer.mlp {
        Ffn::Moe(moe) => moe.experts.parallel.clone(),
        _ => None,
    })
}

pub use crate::distributed::ExpertMesh;

/// `model` with its routed experts split over `ep` (every MoE layer): a model built whole keeps
/// its rank's `E/P` experts (parameter ids kept), one loaded with this rank's experts only
/// ([`crate::checkpoint::LoadOptions::experts`]) is attached as it is. An error when the
/// layers hold neither `E` nor `E/P` experts, or `P` does not divide `E`.
pub(crate) fn expert_parallel_model<B: burn::tensor::backend::Backend>(
    mut model: Glm5ForCausalLM<B>,
    ep: Group,
) -> Result<Glm5ForCausalLM<B>, DistError> {
    let plan = Arc::new(ExpertParallel::new(ep, model.num_experts)?);
    let pre_sharded = model.pre_sharded.clone();
    for (i, layer) in model.language_model.layers.iter_mut().enumerate() {
        let Ffn::Moe(moe) = &mut layer.mlp else { continue };
        // loaded as this rank's FSDP slice of its experts: the experts it holds are the full rows
        let sliced = pre_sharded.as_ref().and_then(|p| p.by_path.get(&format!("language_model.layers.{i}.mlp.experts.gate_proj")));
        let held = sliced.map_or_else(|| moe.experts.dims()[0], |&(_, rows)| rows);
        if held == plan.local_experts() && held != plan.n_experts {
            moe.experts.parallel = Some(plan.clone());
        } else {
            // (a clone shares the tensors)
            moe.experts = moe.experts.clone().into_parallel(plan.clone())?;
        }
    }
    Ok(model)
}

/// `model` with every MoE layer's LoRA stacks gathered whole over its expert-parallel group
/// (rank order is expert order) and the layers marked whole, for saving the adapters; the
/// experts' base stacks stay this rank's. A collective call over every expert-parallel group;
/// without expert parallelism `model` comes back as it is.
pub fn gather_expert_adapters<B: burn::tensor::backend::Backend>(mut model: Glm5ForCausalLM<B>) -> Result<Glm5ForCausalLM<B>, DistError> {
    fn whole<B: burn::tensor::backend::Backend>(p: &Param<Tensor<B, 3>>, g: &dyn ProcessGroup) -> Result<Param<Tensor<B, 3>>, DistError> {
        let t = p.val();
        let [e, k, r] = t.dims();
        let local = t
            .to_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| DistError::Counts { op: "gathering expert adapters", message: format!("{e:?}") })?;
        let all = all_gather(g, &local)?;
        let data = TensorData::new(all, [e * g.size(), k, r]);
        Ok(Param::initialized(p.id, Tensor::from_data(data, &t.device())))
    }
    for layer in model.language_model.layers.iter_mut() {
        let Ffn::Moe(moe) = &mut layer.mlp else { continue };
        let Some(ep) = moe.experts.parallel.take() else { continue };
        for lora in [moe.experts.lora_gate_up.as_mut(), moe.experts.lora_down.as_mut()].into_iter().flatten() {
            lora.a = whole(&lora.a, &*ep.group)?;
            lora.b = whole(&lora.b, &*ep.group)?;
        }
    }
    Ok(model)
}

/// The shard plan of a sharded model.
pub fn plan_of<B: burn::tensor::backend::Backend>(model: &Glm5ForCausalLM<B>) -> Option<&Arc<ShardPlan>> {
    model.language_model.shards.as_ref()
}

/// Drops the gradients of `module`'s parameters (a unit no rank ran: one process would have
/// produced none, and AdamW skips a parameter without one).
pub(crate) fn drop_grads<B: AutodiffBackend, M: Module<B>>(module: &M, grads: &mut GradientsParams) {
    struct Drop<'a>(&'a mut GradientsParams);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Drop<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.remove::<B::InnerBackend, D>(param.id);
        }
    }
    module.visit(&mut Drop(grads));
}

/// The whole model of a sharded one, on every rank (one collective gathers every sharded
/// parameter): for evaluation on one rank, export, or checks. Parameter ids are kept; the
/// result is not sharded.
pub fn unshard_model<B: crate::ops::backend::Glm5Backend>(model: Glm5ForCausalLM<B>) -> Glm5ForCausalLM<B> {
    let Some(plan) = model.language_model.shards.clone() else { return model };
    // untracked shards: the gather must leave nothing on the autodiff graph (an unconsumed
    // node would keep its state — the group included — alive for the process's lifetime)
    struct Detach<'a>(&'a ShardPlan);
    impl<B: burn::tensor::backend::Backend> burn::module::ModuleMapper<B> for Detach<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if self.0.full_rows(param.id).is_none() {
                return param;
            }
            let (id, t, mapper) = param.consume();
            // (`detach` keeps a leaf's require-grad flag in Burn 0.21: this drops it)
            Param::from_mapped_value(id, t.set_require_grad(false), mapper)
        }
    }
    let model = model.map(&mut Detach(&plan));
    plan.begin();
    let full = plan.gather(&model, None, false);
    plan.end();
    struct Leaves<'a>(&'a ShardPlan);
    impl<B: burn::tensor::backend::Backend> burn::module::ModuleMapper<B> for Leaves<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if self.0.full_rows(param.id).is_none() {
                return param;
            }
            let (id, t, mapper) = param.consume();
            Param::from_mapped_value(id, t.detach().require_grad(), mapper)
        }
    }
    let mut full = full.map(&mut Leaves(&plan));
    // a failing engine aborts the MPI job; the slices were cut over this group
    unshard_fp8_base(&mut full, plan.group()).unwrap_or_else(|e| panic!("{e}"));
    full.language_model.shards = None;
    full.pre_sharded = None;
    full
}
