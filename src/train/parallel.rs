//! Training on a mesh in any loop: what data, expert and context parallelism add to a plain
//! Burn step, as functions a loop of one's own calls — and the ones [`super::trainer::Trainer`] calls.
//!
//! ```text
//! prepare      model → this rank's experts (EP) and FSDP shards (dp × cp), on the mesh of
//!              the model's device (`MeshDevice`) or of the layout
//! global_batch Σ_ranks label tokens / cp        (every rank normalises by the global count)
//! forward      each sharded unit gathered, its gradient reduce-scattered in backward
//! reduce_grads Σ_world ∂(replicated) ; Σ_edp ∂(experts)   (shards arrive summed already)
//! clip         ‖g‖ = √(Σ_world ‖shards‖² + ‖replicated‖² + Σ_ep ‖experts‖²)
//! optim.step   local: each rank updates its shards (FSDP), its experts (EP)
//! ```
//!
//! A loop of one's own on `Autodiff<Distributed<B>>` with a mesh device:
//!
//! ```ignore
//! let device = MeshDevice::from_env(Default::default(), None)?;   // under mpirun
//! let _binding = device.binding();                                  // released on every way out
//! let (mut model, par) = ParallelTraining::prepare(model_on(&device), &ParallelLayout::default())?;
//! let mut optim = AdamWConfig::new().init();
//! for micro in my_share_of_each_global_batch {
//!     let global = par.global_batch(&model, &micro)?;
//!     let mut acc = GradientsAccumulator::new();
//!     for m in &micro {
//!         let out = forward_micro(&model, m, &forward, par.context())?;
//!         let (sum, _) = target_loss_sum(out.output.logits, &out.targets);
//!         acc.accumulate(&model, GradientsParams::from_grads((sum / global.label_tokens as f64).backward(), &model));
//!     }
//!     let mut grads = acc.grads();
//!     par.reduce_grads(&model, &mut grads)?;
//!     par.clip(&model, &mut grads, Some(1.0))?;
//!     model = optim.step(lr, model, grads);
//!     if step % 100 == 0 {
//!         par.save_checkpoint(&root, step, &model, &optim, &config, 2, DataPosition::default())?;
//!     }
//! }
//! // resumed under any mesh: this rank's part of the model, its rows of AdamW's moments
//! // (`train::loop_checkpoint`)
//! let resumed = ParallelTraining::load_checkpoint(&step_dir, &options, false, &device)?;
//! let optim = AdamWConfig::new().init().load_record(resumed.record);
//! ```
//!
//! The reductions follow Megatron-LM's `finalize_model_grads` (data-parallel all-reduce of
//! replicated gradients, expert gradients over the expert-data-parallel group) and PyTorch
//! FSDP2's `clip_grad_norm_` over sharded `DTensor`s.

use std::collections::HashSet;
use std::sync::Arc;

use burn::module::ParamId;
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::clip::{clip_global_norm, clip_to, global_norm, squared_norms_by};
use super::data_parallel::{
    all_reduce_grads, all_reduce_grads_except, drop_grads, expert_parallel_model, expert_parallel_of, expert_param_ids, gather_usize, plan_of,
    shard_model_where, sum_f64, sum_usize, zero_missing_grads,
};
use super::step::{GlobalBatch, TrainError};
use crate::data::batch::MicroBatch;
use crate::distributed::{mesh_of, Group, Mesh, MeshSizes};
use crate::model::Glm5ForCausalLM;
use crate::ops::backend::Glm5Backend;
use crate::text::decoder::Ffn;

/// How the ranks share the work (recipe `distributed`); the default is one process.
#[derive(Debug, Clone)]
pub struct ParallelLayout {
    /// Under data parallelism, shard the trainable parameters (and so their gradients and
    /// AdamW moments) over the group, FSDP-style ([`super::data_parallel::shard_model`]);
    /// false replicates them (DDP). Recipe `distributed.shard_parameters`.
    pub shard_parameters: bool,
    /// With sharded parameters, free each unit's gathered parameters after its forward and
    /// gather them again for its backward. Recipe `distributed.reshard_after_forward`.
    pub reshard_after_forward: bool,
    /// Expert parallelism: the routed experts split over groups of this many data-parallel
    /// ranks (`distributed.ep_size`, dividing the group's size and the expert count; 1: off).
    /// Each rank keeps `E/P` experts per MoE layer and exchanges tokens with its
    /// expert-parallel group; the experts' gradients are summed over the ranks holding the same
    /// experts ([`super::data_parallel::ExpertMesh`]).
    pub expert_parallel: usize,
    /// Context parallelism: each packed micro-batch split into contiguous shards over groups
    /// of this many consecutive ranks of the data-parallel group (`distributed.cp_size`; 1:
    /// off). The ranks of a group pass the same micro-batches; KDA and DSA exchange across the
    /// shards ([`crate::text::context`]); gradients are summed over the whole group.
    pub context_parallel: usize,
    /// The mesh this trainer is one rank of ([`Self::on_mesh`], [`Self::with_world`]): its
    /// data-parallel world of `dp × cp` ranks and their context- and expert-parallel groups.
    /// Each rank passes its share of every global batch to
    /// [`super::trainer::Trainer::step`] and of the validation batches to
    /// [`super::trainer::Trainer::evaluate`]; gradients, losses and counts are summed over the
    /// world. `None`: the mesh of the model's device ([`crate::distributed::MeshDevice`]), or
    /// one process. The options name a mesh, never a bare process group.
    pub mesh: Option<std::sync::Arc<Mesh>>,
}

impl Default for ParallelLayout {
    fn default() -> Self {
        Self { shard_parameters: true, reshard_after_forward: true, expert_parallel: 1, context_parallel: 1, mesh: None }
    }
}

impl ParallelLayout {
    /// This layout on `mesh`: its world as the data-parallel group (`None` for one process),
    /// its context- and expert-parallel sizes and groups (the sharding settings kept). An error
    /// naming both when the layout asks for other cp / ep sizes than the mesh has.
    pub fn on_mesh(self, mesh: &std::sync::Arc<Mesh>) -> Result<Self, crate::distributed::DistError> {
        let sizes = mesh.sizes();
        for (name, asked, has) in [("cp_size", self.context_parallel, sizes.cp), ("ep_size", self.expert_parallel, sizes.ep)] {
            if asked != 1 && asked != has {
                return Err(crate::distributed::DistError::Mesh {
                    message: format!("the training layout asks for {name} {asked} but the mesh has {has}"),
                    reported: false,
                });
            }
        }
        Ok(Self { context_parallel: sizes.cp, expert_parallel: sizes.ep, mesh: Some(mesh.clone()), ..self })
    }

    /// This layout on the mesh of its context- and expert-parallel sizes over `world` (the
    /// groups split: a collective call, every rank of `world` makes it). An error naming the
    /// size that does not divide the world.
    pub fn with_world(self, world: Group) -> Result<Self, crate::distributed::DistError> {
        let sizes = self.sizes(world.size())?;
        let mesh = Arc::new(Mesh::new(world, sizes)?);
        self.on_mesh(&mesh)
    }

    /// The data-parallel world of the layout's mesh (`None`: none named).
    pub fn world(&self) -> Option<&Group> {
        self.mesh.as_ref().and_then(|m| m.data_parallel())
    }

    /// The mesh sizes of this layout over a data-parallel group of `world` ranks: an error
    /// naming `cp_size` when it does not divide them.
    pub fn sizes(&self, world: usize) -> Result<MeshSizes, crate::distributed::DistError> {
        let cp = self.context_parallel;
        if cp == 0 || !world.is_multiple_of(cp) {
            return Err(crate::distributed::DistError::Counts {
                op: "context parallelism",
                message: format!("cp_size {cp} does not divide the {world} ranks"),
            });
        }
        Ok(MeshSizes { dp: world / cp, cp, ep: self.expert_parallel })
    }
}

/// This rank's part in a mesh's training (module docs); one process: every method a no-op or
/// the local value.
#[derive(Debug, Clone, Default)]
pub struct ParallelTraining {
    /// The data-parallel world (several ranks), and the mesh it belongs to.
    mesh: Option<Arc<Mesh>>,
    /// Under expert parallelism: the expert-data-parallel group and the experts' parameter ids.
    experts: Option<(Group, HashSet<ParamId>)>,
}

impl ParallelTraining {
    /// One process.
    pub fn one_process() -> Self {
        Self::default()
    }

    /// `model` (frozen as it should be, adapters attached) made this rank's: its experts split
    /// over the expert-parallel group and its trainable parameters sharded over the world
    /// (`layout.shard_parameters`; experts over the expert-data-parallel group). The mesh is
    /// the layout's ([`ParallelLayout::mesh`]), else the
    /// one of the model's device ([`crate::distributed::MeshDevice`]). A collective call: every
    /// rank passes the same model, or its experts' share
    /// ([`crate::checkpoint::LoadOptions::experts`]).
    pub fn prepare<B: AutodiffBackend + Glm5Backend>(
        model: Glm5ForCausalLM<B>,
        layout: &ParallelLayout,
    ) -> Result<(Glm5ForCausalLM<B>, Self), TrainError> {
        let mut model = model;
        let device_mesh = mesh_of(&model.language_model.norm.weight.device());
        let layout = match (&layout.mesh, &device_mesh) {
            (None, Some(mesh)) => layout.clone().on_mesh(mesh)?,
            // the collectives would pair this rank with the layout's processes while its
            // tensors (and the batches made on its device) belong to the device's mesh
            (Some(named), Some(bound)) if !Arc::ptr_eq(named, bound) && !Arc::ptr_eq(named.world(), bound.world()) => {
                return Err(TrainError::Distributed(crate::distributed::DistError::Mesh {
                    message: format!(
                        "the model is on a device bound to rank {} of a mesh of {}, but the training layout names another mesh \
                         (rank {} of {}): build the model on the layout's mesh device, or leave ParallelLayout::mesh unset \
                         to train on the device's",
                        bound.rank(),
                        bound.size(),
                        named.rank(),
                        named.size()
                    ),
                    reported: false,
                }));
            }
            _ => layout.clone(),
        };
        let world = layout.world().cloned().filter(|g| g.size() > 1);
        for (size, what) in [
            (layout.expert_parallel, "expert parallelism (expert_parallel > 1) without a data-parallel group of several ranks"),
            (layout.context_parallel, "context parallelism (context_parallel > 1) without a data-parallel group of several ranks"),
        ] {
            if size > 1 && world.is_none() {
                return Err(TrainError::Unsupported { what });
            }
        }
        // slices loaded for a sharded run are only whole again in a plan that gathers them
        let unsharded_slices = |model: &Glm5ForCausalLM<B>| -> Result<(), TrainError> {
            match (&model.pre_sharded, plan_of(model)) {
                (Some(pre), None) => Err(TrainError::Distributed(crate::distributed::DistError::Mesh {
                    message: format!(
                        "the model holds this rank's slices of {} tensors (loaded with LoadOptions::row_shards) but this layout \
                         does not shard them (one process, or shard_parameters off): load it with the layout's own \
                         TrainOptions::base_load_options",
                        pre.by_path.len()
                    ),
                    reported: false,
                })),
                _ => Ok(()),
            }
        };
        let Some(g) = world else {
            unsharded_slices(&model)?;
            return Ok((model, Self::one_process()));
        };
        // the layout's or the device's mesh, or the layout's group split as a mesh (Megatron's layout)
        let mesh = match layout.mesh.clone().or(device_mesh).filter(|m| Arc::ptr_eq(m.world(), &g)) {
            Some(m) => m,
            None => Arc::new(Mesh::new(g.clone(), layout.sizes(g.size())?)?),
        };
        // a batch carries its context shard as data; the model runs it over this group
        model.language_model.context_group = mesh.context().cloned();
        let mut experts = None;
        if let Some(ex) = mesh.expert() {
            model = expert_parallel_model(model, ex.ep.clone())?;
            experts = Some((ex.edp.clone(), expert_param_ids(&model)));
        }
        if layout.shard_parameters || experts.is_some() {
            let edp = experts.as_ref().map(|(edp, _)| edp.clone());
            model = shard_model_where(model, g, layout.reshard_after_forward, layout.shard_parameters, edp)?;
        }
        unsharded_slices(&model)?;
        Ok((model, Self { mesh: Some(mesh), experts }))
    }

    /// The part of a model [`Self::prepare`]d on its device's mesh, found again from the model
    /// (the mesh of its device, its expert-parallel split): for steps that are handed only the
    /// model, as burn-train's `TrainStep` is. One process for a model on a plain device.
    pub fn of_model<B: Backend>(model: &Glm5ForCausalLM<B>) -> Self {
        let Some(mesh) = mesh_of(&model.language_model.norm.weight.device()).filter(|m| m.size() > 1) else {
            return Self::one_process();
        };
        let experts = match (mesh.expert(), expert_parallel_of(model)) {
            (Some(ex), Some(_)) => Some((ex.edp.clone(), expert_param_ids(model))),
            _ => None,
        };
        Self { mesh: Some(mesh), experts }
    }

    /// The mesh (`None`: one process).
    pub fn mesh(&self) -> Option<&Arc<Mesh>> {
        self.mesh.as_ref()
    }

    /// The data-parallel world (`None`: one process).
    pub fn world(&self) -> Option<&Group> {
        self.mesh.as_ref().map(|m| m.world())
    }

    /// This rank's context-parallel group, for the forward ([`super::step::forward_micro`]).
    pub fn context(&self) -> Option<&Group> {
        self.mesh.as_ref().and_then(|m| m.context())
    }

    /// The expert-data-parallel group and the experts' parameter ids (expert parallelism).
    pub fn experts(&self) -> Option<&(Group, HashSet<ParamId>)> {
        self.experts.as_ref()
    }

    /// The global batch this rank's `micro` belongs to: label tokens and micro-batches over
    /// every rank (a context-parallel group's ranks count theirs once). With sharded
    /// parameters every rank must run as many micro-batches (each forward gathers with the
    /// whole world): an error naming the counts otherwise.
    pub fn global_batch<B: Glm5Backend>(&self, model: &Glm5ForCausalLM<B>, micro: &[MicroBatch]) -> Result<GlobalBatch, TrainError> {
        let local = GlobalBatch::local(micro, model.vocab_size);
        let Some(g) = self.world() else { return Ok(local) };
        let counts = gather_usize(&**g, micro.len())?;
        if plan_of(model).is_some() && counts.iter().any(|&c| c != counts[0]) {
            return Err(TrainError::Batch(format!(
                "micro-batches per rank {counts:?}: with sharded parameters every rank runs the same number (global batch a multiple of local × dp)"
            )));
        }
        let cp = self.context().map_or(1, |c| c.size());
        Ok(GlobalBatch { label_tokens: sum_usize(&**g, local.label_tokens)? / cp, micro_batches: counts.iter().sum::<usize>() / cp })
    }

    /// `x` summed over the world, in rank order (the same bits on every rank).
    pub fn sum(&self, x: f64) -> Result<f64, TrainError> {
        Ok(match self.world() {
            Some(g) => sum_f64(&**g, x)?,
            None => x,
        })
    }

    /// `x` summed over the world (exact).
    pub fn sum_count(&self, x: usize) -> Result<usize, TrainError> {
        Ok(match self.world() {
            Some(g) => sum_usize(&**g, x)?,
            None => x,
        })
    }

    /// This rank's gradients made the global step's: replicated parameters' summed over the
    /// world, the experts' over the ranks holding them (shards arrive summed through their
    /// gathers' adjoint); a vision tower no rank ran gets none, and an expert no token reached
    /// anywhere a zero one — what one process gives AdamW.
    pub fn reduce_grads<B: AutodiffBackend + Glm5Backend>(&self, model: &Glm5ForCausalLM<B>, grads: &mut GradientsParams) -> Result<(), TrainError> {
        let Some(g) = self.world() else { return Ok(()) };
        match plan_of(model) {
            Some(plan) => {
                if sum_usize(&**g, usize::from(plan.take_vision_used()))? == 0 {
                    if let Some(v) = &model.visual {
                        drop_grads::<B, _>(v, grads);
                    }
                }
                let expert = |id| self.experts.as_ref().is_some_and(|(_, ids)| ids.contains(&id));
                all_reduce_grads_except::<B, _>(model, grads, &**g, &|id| plan.full_rows(id).is_some() || expert(id))?;
                if let Some((edp, ids)) = &self.experts {
                    all_reduce_grads_except::<B, _>(model, grads, &**edp, &|id| !ids.contains(&id) || plan.full_rows(id).is_some())?;
                    zero_missing_grads::<B, _>(model, grads, &|id| ids.contains(&id));
                }
            }
            None => all_reduce_grads::<B, _>(model, grads, &**g)?,
        }
        Ok(())
    }

    /// The global gradient norm over the mesh, and the gradients clipped to `max_norm` by it
    /// (PyTorch's `clip_grad_norm_`; `None`: the norm only). The same value on every rank.
    pub fn clip<B: AutodiffBackend>(
        &self,
        model: &Glm5ForCausalLM<B>,
        grads: &mut GradientsParams,
        max_norm: Option<f64>,
    ) -> Result<f64, TrainError> {
        let (Some(plan), Some(g)) = (plan_of(model), self.world()) else {
            return Ok(match max_norm {
                Some(max) => clip_global_norm::<B, _>(model, grads, max),
                None => global_norm::<B, _>(model, grads),
            });
        };
        // every rank holds its own rows of a sharded parameter (an expert-parallel rank's
        // experts sharded over the ranks holding them included); whole expert shares are
        // split over an expert-parallel group and alike on its replicas
        let expert = |id| self.experts.as_ref().is_some_and(|(_, ids)| ids.contains(&id));
        let [sharded, replicated, experts] = squared_norms_by::<B, _, 3>(model, grads, &|id| match (plan.full_rows(id), expert(id)) {
            (Some(_), _) => 0,
            (None, false) => 1,
            (None, true) => 2,
        });
        let experts = match expert_parallel_of(model) {
            Some(ep) => sum_f64(&*ep.group, experts)?,
            None => experts,
        };
        let norm = (sum_f64(&**g, sharded)? + replicated + experts).sqrt();
        if let Some(max) = max_norm {
            clip_to::<B, _>(model, grads, norm, max);
        }
        Ok(norm)
    }

    /// The aux-loss-free bias update of every MoE layer ([`crate::text::moe::Router::update_bias`])
    /// from the step's router logits (per micro-batch: one `[N·E]` buffer per MoE layer and the
    /// tokens' validity). The expert loads are summed over the world, so the update is the one
    /// a single process makes from the whole global batch, the same on every rank; a sharded
    /// bias is gathered for the selection and each rank updates its own rows.
    pub fn update_router_bias<B: AutodiffBackend>(
        &self,
        model: &mut Glm5ForCausalLM<B>,
        router_logits: &[(Vec<Vec<f32>>, Vec<bool>)],
        rate: f64,
    ) -> Result<(), TrainError> {
        let e = model.num_experts;
        let plan = plan_of(model).cloned();
        let world = self.world().cloned();
        let moes = model.language_model.layers.iter_mut().filter_map(|layer| match &mut layer.mlp {
            Ffn::Moe(moe) => Some(moe),
            _ => None,
        });
        for (moe_index, moe) in moes.enumerate() {
            let batches: Vec<(&[f32], &[bool])> =
                router_logits.iter().filter_map(|(layers, valid)| layers.get(moe_index).map(|l| (l.as_slice(), valid.as_slice()))).collect();
            let Some(g) = &world else {
                moe.gate.update_bias(&batches, rate);
                continue;
            };
            let held: Vec<f32> = moe.gate.e_score_correction_bias.val().into_data().convert::<f32>().into_vec().unwrap_or_default();
            let sharded = plan.as_ref().is_some_and(|p| p.full_rows(moe.gate.e_score_correction_bias.id).is_some());
            let result = (|| -> Result<Vec<f32>, crate::distributed::DistError> {
                let full = if sharded { crate::distributed::typed::all_gather(&**g, &held)?[..e].to_vec() } else { held.clone() };
                let mut loads = moe.gate.expert_loads(&batches, &full);
                g.all_reduce(crate::distributed::ReduceBuf::F64(&mut loads), crate::distributed::ReduceOp::Sum)?;
                let delta = crate::text::moe::Router::<B>::bias_delta(&loads, rate);
                // this rank's rows of the (padded) bias
                Ok(if sharded { (0..held.len()).map(|j| delta.get(g.rank() * held.len() + j).copied().unwrap_or(0.0)).collect() } else { delta })
            })();
            moe.gate.add_to_bias(&result?);
        }
        Ok(())
    }
}
