//! Parameter-level tools of the training loop: freezing, the bf16 compute copy of fp32 master
//! weights, gradient casts, and parameter ids by module path (so optimizer state saved under
//! one process's ids is found again after a reload).
//!
//! Module paths are Burn's (enum variants skipped, as burn-store names them), e.g.
//! `language_model.layers.3.self_attn.q_a_proj.weight`; [`crate::checkpoint::hf_map`] maps them
//! to checkpoint names.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorPrimitive};

use super::recipe::FreezeConfig;
use crate::checkpoint::hf_map::resolve;
use crate::model::Glm5ForCausalLM;
use crate::ops::backend::{cast, Glm5Backend};

/// Tracks the module path during a visit or map (enum variants add no segment).
#[derive(Default)]
struct PathTracker {
    path: Vec<String>,
    containers: Vec<bool>,
}

impl PathTracker {
    fn enter(&mut self, name: &str, container_type: &str) {
        let variant = container_type.starts_with("Enum:");
        self.containers.push(variant);
        if !variant {
            self.path.push(name.to_string());
        }
    }
    fn exit(&mut self) {
        if !self.containers.pop().unwrap_or(false) {
            self.path.pop();
        }
    }
    fn current(&self) -> String {
        self.path.join(".")
    }
}

struct Ids {
    tracker: PathTracker,
    out: BTreeMap<String, ParamId>,
}

impl<B: Backend> ModuleVisitor<B> for Ids {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.tracker.enter(name, container_type);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.tracker.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.out.insert(self.tracker.current(), param.id);
    }
}

/// Every float parameter's id by module path.
pub fn param_ids<B: Backend, M: Module<B>>(module: &M) -> BTreeMap<String, ParamId> {
    let mut v = Ids { tracker: PathTracker::default(), out: BTreeMap::new() };
    module.visit(&mut v);
    v.out
}

struct AssignIds<'a> {
    tracker: PathTracker,
    ids: &'a BTreeMap<String, ParamId>,
    missing: Vec<String>,
}

impl<B: Backend> ModuleMapper<B> for AssignIds<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.tracker.enter(name, container_type);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.tracker.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let path = self.tracker.current();
        match self.ids.get(&path) {
            Some(&id) => {
                let (_, tensor, mapper) = param.consume();
                Param::from_mapped_value(id, tensor, mapper)
            }
            None => {
                self.missing.push(path);
                param
            }
        }
    }
}

/// Give the parameters the ids recorded by [`param_ids`] (of an identically shaped model);
/// returns the paths that had no recorded id.
pub(crate) fn assign_param_ids<B: Backend, M: Module<B>>(module: M, ids: &BTreeMap<String, ParamId>) -> (M, Vec<String>) {
    let mut m = AssignIds { tracker: PathTracker::default(), ids, missing: Vec::new() };
    let module = module.map(&mut m);
    (module, m.missing)
}

/// Initialise every lazily initialised parameter of `module` now, in module order. Burn draws
/// a seeded model's weights when each parameter is first used, so the weights depend on the
/// order of first use (a forward's, or a sharding pass's) and each clone of an uninitialised
/// model draws its own: a trainer initialises in one fixed order, so one process and every
/// data- or expert-parallel mesh start from the same weights.
pub fn materialize<B: Backend, M: Module<B>>(module: &M) {
    struct Touch;
    impl<B: Backend> burn::module::ModuleVisitor<B> for Touch {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<burn::tensor::Tensor<B, D>>) {
            let _ = param.val();
        }
        fn visit_int<const D: usize>(&mut self, param: &burn::module::Param<burn::tensor::Tensor<B, D, burn::tensor::Int>>) {
            let _ = param.val();
        }
        fn visit_bool<const D: usize>(&mut self, param: &burn::module::Param<burn::tensor::Tensor<B, D, burn::tensor::Bool>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
}

/// Freeze per the recipe: frozen parameters stop requiring gradients, so backward produces none
/// for them and the optimizer never creates state for them.
///
/// - `freeze_embeddings`: `language_model.embed_tokens` (with a tied head, the head too).
/// - `freeze_vision_tower`: `visual` (patch embedding, blocks, merger).
/// - `freeze_language_model`: every text parameter (embedding, decoder layers, final norm, LM head).
pub fn freeze<B: Backend>(mut model: Glm5ForCausalLM<B>, f: &FreezeConfig) -> Glm5ForCausalLM<B> {
    if f.freeze_language_model {
        model.language_model = model.language_model.no_grad();
        model.lm_head = model.lm_head.map(|h| h.no_grad());
    } else if f.freeze_embeddings {
        model.language_model.embed_tokens = model.language_model.embed_tokens.no_grad();
    }
    if f.freeze_vision_tower {
        model.visual = model.visual.map(|v| v.no_grad());
    }
    model
}

impl FreezeConfig {
    /// Whether [`freeze`] freezes the module tensor at `path` (a module path of
    /// [`Glm5ForCausalLM`], as [`param_ids`] spells it): for deciding what a rank loads before
    /// the model exists.
    pub fn freezes(&self, path: &str) -> bool {
        let under = |prefix: &str| path.strip_prefix(prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'));
        if self.freeze_language_model {
            if under("language_model") || under("lm_head") {
                return true;
            }
        } else if self.freeze_embeddings && under("language_model.embed_tokens") {
            return true;
        }
        self.freeze_vision_tower && under("visual")
    }
}

/// Trainable (gradient-requiring) and frozen parameter counts.
pub fn trainable_counts<B: Backend>(model: &Glm5ForCausalLM<B>) -> (usize, usize) {
    struct Count(usize, usize);
    impl<B: Backend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let n = param.lazy_shape().num_elements();
            if param.is_require_grad() {
                self.0 += n;
            } else {
                self.1 += n;
            }
        }
    }
    let mut c = Count(0, 0);
    model.visit(&mut c);
    (c.0, c.1)
}

/// Where a cast is in the module tree, and to what: the checkpoint's fp32-kept tensors (router
/// bias, mHC scales) stay fp32, as a load in `dtype` keeps them.
struct CastPlan {
    tracker: PathTracker,
    dtype: DType,
}

impl CastPlan {
    fn new(dtype: DType) -> Self {
        Self { tracker: PathTracker::default(), dtype }
    }

    /// The dtype of the parameter at the current path (`None`: it stays as it is).
    fn target(&self) -> Option<DType> {
        let path = self.tracker.current();
        // LoRA adapters stay fp32 over any base dtype (PEFT's `autocast_adapter_dtype`)
        let keep = crate::peft::is_adapter_path(&path) || resolve(&path).is_some_and(|r| r.rule.keep_f32);
        (!keep).then_some(self.dtype)
    }
}

/// The compute copies of frozen parameters, by id: a frozen parameter never changes during a
/// run, so its cast is made at the first step and reused ([`compute_copy`]).
pub(crate) struct FrozenCopies<B: AutodiffBackend>(std::sync::Mutex<std::collections::HashMap<ParamId, FloatTensor<B::InnerBackend>>>);

impl<B: AutodiffBackend> Default for FrozenCopies<B> {
    fn default() -> Self {
        Self(Default::default())
    }
}

/// Casts into fresh graph leaves (the compute copy of [`compute_copy`]).
struct CastCompute<'a, B: AutodiffBackend> {
    plan: CastPlan,
    frozen: &'a FrozenCopies<B>,
}

impl<B: AutodiffBackend> ModuleMapper<B> for CastCompute<'_, B>
where
    B::InnerBackend: Glm5Backend,
{
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.plan.tracker.enter(name, container_type);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.plan.tracker.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let grad = tensor.is_require_grad();
        let inner = tensor.inner();
        let inner = match self.plan.target() {
            // a base already held in `dtype` (recipe `model.base_dtype`) is used as it is
            Some(dtype) if inner.dtype() != dtype && !grad => {
                let mut frozen = self.frozen.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                let copy = frozen.entry(id).or_insert_with(|| cast(inner, dtype).into_primitive().tensor());
                Tensor::from_primitive(TensorPrimitive::Float(copy.clone()))
            }
            Some(dtype) if inner.dtype() != dtype => cast(inner, dtype),
            _ => inner,
        };
        // a fresh leaf: gradients land on the same id as the master parameter
        let mut t = Tensor::<B, D>::from_inner(inner);
        if grad {
            t = t.require_grad();
        }
        Param::from_mapped_value(id, t, mapper)
    }
}

/// Casts in place: every parameter (inference weights, [`cast_weights`]) or the frozen ones
/// only ([`hold_frozen_in`]).
struct CastWeights {
    plan: CastPlan,
    frozen_only: bool,
}

impl<B: Glm5Backend> ModuleMapper<B> for CastWeights {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.plan.tracker.enter(name, container_type);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.plan.tracker.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        match self.plan.target() {
            Some(_) if self.frozen_only && param.is_require_grad() => param,
            // already in `dtype` (a base loaded so): no cast node, no copy
            Some(dtype) if param.val().dtype() == dtype => param,
            // `map` keeps a trainable parameter trainable
            Some(dtype) => param.map(|t| cast(t, dtype)),
            None => param,
        }
    }
}

/// The frozen base of a LoRA run held in `dtype` (recipe `model.base_dtype`): every frozen
/// parameter cast except the checkpoint's fp32-kept tensors and the adapters; trainable
/// parameters keep their dtype (fp32 masters). A base loaded in `dtype` is left as it is.
/// [`crate::train::trainer::Trainer`] does this for a LoRA run; a loop of one's own calls it
/// after [`crate::peft::attach`] (a model whose forward then runs in `dtype`).
pub fn hold_frozen_in<B: Glm5Backend>(model: Glm5ForCausalLM<B>, dtype: DType) -> Glm5ForCausalLM<B> {
    model.map(&mut CastWeights { plan: CastPlan::new(dtype), frozen_only: true })
}

/// `model` for inference in `dtype`: every parameter cast, except the tensors the checkpoint
/// keeps in fp32 (router bias, mHC scales), as a load with [`crate::checkpoint::LoadOptions`]
/// `dtype` gives them.
pub fn cast_weights<B: Glm5Backend>(model: Glm5ForCausalLM<B>, dtype: DType) -> Glm5ForCausalLM<B> {
    model.map(&mut CastWeights { plan: CastPlan::new(dtype), frozen_only: false })
}

/// The compute copy of fp32 master weights: every parameter cast to `dtype` (the checkpoint's
/// fp32-kept tensors — router bias, mHC scales — stay fp32), as graph leaves with the master's
/// ids, so its gradients can be applied to the master.
/// `frozen` keeps the frozen parameters' copies from one call to the next (one store per
/// master model and dtype).
pub(crate) fn compute_copy<B: AutodiffBackend>(master: &Glm5ForCausalLM<B>, dtype: DType, frozen: &FrozenCopies<B>) -> Glm5ForCausalLM<B>
where
    B::InnerBackend: Glm5Backend,
{
    master.clone().map(&mut CastCompute { plan: CastPlan::new(dtype), frozen })
}

struct CastGrads<'a> {
    grads: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for CastGrads<'_>
where
    B::InnerBackend: Glm5Backend,
{
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads.register::<B::InnerBackend, D>(param.id, cast(g, DType::F32));
        }
    }
}

/// Cast every gradient of `module`'s parameters to fp32 (for the fp32 master update).
pub(crate) fn grads_to_f32<B: AutodiffBackend, M: Module<B>>(module: &M, grads: &mut GradientsParams)
where
    B::InnerBackend: Glm5Backend,
{
    module.visit(&mut CastGrads { grads });
}
