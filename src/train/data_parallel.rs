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

use std::sync::Arc;

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::distributed::typed::{all_gather, all_gather_v};
use crate::distributed::{DistError, Group, ProcessGroup, ReduceBuf, ReduceOp, ShardPlan};
use crate::model::Glm5ForCausalLM;

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
pub fn all_reduce_grads_except<B: AutodiffBackend, M: AutodiffModule<B>>(
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

/// Every rank's `x` added in rank order: the same value on every rank.
pub fn sum_f64(group: &dyn ProcessGroup, x: f64) -> Result<f64, DistError> {
    Ok(all_gather(group, &[x])?.iter().sum())
}

/// Every rank's `x` summed (exact).
pub fn sum_usize(group: &dyn ProcessGroup, x: usize) -> Result<usize, DistError> {
    let mut v = [x as i64];
    group.all_reduce(ReduceBuf::I64(&mut v), ReduceOp::Sum)?;
    Ok(v[0] as usize)
}

/// Every rank's `x`, in rank order.
pub fn gather_usize(group: &dyn ProcessGroup, x: usize) -> Result<Vec<usize>, DistError> {
    Ok(all_gather(group, &[x as u64])?.into_iter().map(|v| v as usize).collect())
}

/// Shard `model`'s trainable parameters over `group` ([`crate::distributed::fsdp`]): every
/// parameter that requires a gradient, except the ones that require one but never receive it
/// — the indexers' (the reference runs them under `no_grad`) and the routers'
/// `e_score_correction_bias` (selection only, moved by the bias update) — which stay
/// replicated, so that AdamW leaves them alone as it does in one process (a shard would
/// receive a zero gradient through the gather and weight decay would move it). Apply after
/// freezing: frozen parameters stay replicated.
pub fn shard_model<B: crate::distributed::CollectiveBackend>(
    model: Glm5ForCausalLM<B>,
    group: Group,
    reshard_after_forward: bool,
) -> Glm5ForCausalLM<B> {
    let replicated: std::collections::HashSet<ParamId> = super::params::param_ids::<B, _>(&model)
        .into_iter()
        .filter(|(path, _)| path.contains(".indexer.") || path.ends_with("e_score_correction_bias"))
        .map(|(_, id)| id)
        .collect();
    let (mut model, plan) = ShardPlan::shard(model, group, reshard_after_forward, |id, require_grad| require_grad && !replicated.contains(&id));
    model.language_model.shards = Some(plan);
    model
}

/// The shard plan of a sharded model.
pub fn plan_of<B: burn::tensor::backend::Backend>(model: &Glm5ForCausalLM<B>) -> Option<&Arc<ShardPlan>> {
    model.language_model.shards.as_ref()
}

/// Drops the gradients of `module`'s parameters (a unit no rank ran: one process would have
/// produced none, and AdamW skips a parameter without one).
pub fn drop_grads<B: AutodiffBackend, M: Module<B>>(module: &M, grads: &mut GradientsParams) {
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
pub fn unshard_model<B: crate::distributed::CollectiveBackend>(model: Glm5ForCausalLM<B>) -> Glm5ForCausalLM<B> {
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
    full.language_model.shards = None;
    full
}
