//! The training loop as a library: a [`Trainer`] owns the model, AdamW and the schedule, and
//! runs one optimizer step per call over the micro-batches of a global batch. A user's own loop
//! calls [`Trainer::step`] with batches from anywhere (our [`crate::data::loader`] or theirs).
//!
//! Per step (NeMo AutoModel's SFT loop, single device):
//!
//! ```text
//! compute ← master                      (bf16 copy when precision = bf16; fp32: the master)
//! for each micro-batch m: backward of Σ_t CE_t(m) / N_labels(global batch) [+ aux]
//! g ← accumulated gradients (→ fp32),  ‖g‖ over all trainable parameters
//! non-finite loss or ‖g‖ → nothing applied; skip and count, or abort (recipe)
//! g ← g · min(1, max_norm / (‖g‖ + 1e-6));  master ← AdamW(master, g, lr_schedule(step))
//! router bias b_e += γ · sign(mean load − load_e)   (aux-loss-free balancing; γ = 0: off)
//! ```
//!
//! Frozen parameters ([`super::params::freeze`]) require no gradient: backward skips them and
//! AdamW never allocates their moments. The indexer's parameters get no gradient either — the
//! reference runs the indexer under `no_grad`; training it needs its own objective.
//! Activation checkpointing is a property of the autodiff backend type in Burn 0.21
//! (`Autodiff<B, BalancedCheckpointing>` recomputes cheap ops in backward instead of keeping
//! their outputs); the trainer is generic over it and the `finetune` example dispatches the
//! recipe flag to the two monomorphised backends.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{AutodiffModule, ParamId};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::Optimizer;

use super::adamw::FusedAdamW;
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::DType;

use super::checkpoint::{self as ckpt, TrainerState};
use super::data_parallel::{gather_usize, plan_of};
use super::parallel::ParallelTraining;
use super::params::{assign_param_ids, compute_copy, freeze, grads_to_f32, hold_frozen_in, materialize, param_ids, FrozenCopies};
use super::recipe::{BaseDtype, FreezeConfig, NonFinitePolicy, Precision, Recipe};
use super::schedule::LrSchedule;
use super::sharded;
use super::step::{accumulate, micro_loss_sum, non_finite, Accumulated, LossSum, StepContext, StepMetrics, TrainError};
use crate::checkpoint::{load_causal_lm, save_causal_lm, CheckpointConfig, LoadOptions};
use crate::data::batch::MicroBatch;
use crate::data::fingerprint::DataFingerprint;
use crate::model::Glm5ForCausalLM;
use crate::ops::backend::Glm5Backend;
use crate::text::ForwardOptions;

/// AdamW and its schedule.
#[derive(Debug, Clone)]
pub struct OptimizerSettings {
    /// Learning-rate schedule.
    pub lr: LrSchedule,
    /// AdamW β₁, β₂.
    pub betas: [f64; 2],
    /// AdamW ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clip (`None`: off).
    pub max_grad_norm: Option<f64>,
}

pub use super::parallel::ParallelLayout;

/// Everything a step needs besides the data.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// AdamW and its schedule.
    pub optimizer: OptimizerSettings,
    /// Weight of the router load-balancing loss (0: off).
    pub aux_loss_coef: f64,
    /// γ of the aux-loss-free router bias update (0: off, the default).
    pub router_bias_update_rate: f64,
    /// fp32 or bf16 compute.
    pub precision: Precision,
    /// What a non-finite step does.
    pub on_nonfinite: NonFinitePolicy,
    /// Frozen parts.
    pub freeze: FreezeConfig,
    /// Forward paths.
    pub forward: ForwardOptions,
    /// How the ranks share the work.
    pub parallel: ParallelLayout,
    /// LoRA adapters on a frozen base (recipe `peft`): [`Trainer::try_new`] attaches them
    /// (unless the model already has adapters) and only they train.
    pub peft: Option<PeftOptions>,
}

/// A LoRA run: its adapters, and the base checkpoint they sit on.
#[derive(Debug, Clone)]
pub struct PeftOptions {
    /// The adapters (PEFT's `LoraConfig`).
    pub config: crate::text::lora::LoraConfig,
    /// The base checkpoint directory (`model.checkpoint`): checkpoints reference it and hold
    /// the adapters only. `None` (seeded base weights): checkpoints hold the base too.
    pub base: Option<PathBuf>,
    /// How the frozen base is held (recipe `model.base_dtype`): `Fp8` keeps its FP8
    /// projections in FP8 ([`crate::checkpoint::LoadOptions::fp8_base`]); `Bf16` (and `Fp8`'s
    /// other weights under bf16 precision) holds it in bf16, without fp32 masters.
    pub base_dtype: BaseDtype,
}

impl TrainOptions {
    /// This rank's share of the routed experts under expert parallelism (`None` without), for
    /// [`crate::checkpoint::LoadOptions::experts`] so a rank reads only its experts' bytes.
    pub fn expert_shard(&self) -> Option<crate::checkpoint::select::ExpertShard> {
        let g = self.parallel.world()?;
        let p = self.parallel.expert_parallel;
        (p > 1).then(|| crate::checkpoint::select::ExpertShard { rank: g.rank() % p, size: p })
    }

    /// The load options of this run's base: this rank's experts, this rank's FSDP slices of
    /// the parameters the run shards ([`Self::row_selection`]), and the base held as the LoRA
    /// section says (FP8, bf16 or fp32). A rank so reads only its own bytes of them.
    pub fn base_load_options(&self, vision: bool) -> LoadOptions {
        LoadOptions {
            vision,
            experts: self.expert_shard(),
            fp8_base: self.peft.as_ref().is_some_and(|p| p.base_dtype == BaseDtype::Fp8),
            row_shards: self.row_selection(),
            ..LoadOptions::with_dtype(self.base_weight_dtype())
        }
    }

    /// Under FSDP over a data-parallel group of several ranks: the module tensors
    /// [`super::parallel::ParallelTraining::prepare`] shards over that group, by path — the
    /// ones that train after `freeze_config` (none under LoRA, whose base is frozen), less the
    /// indexers and router biases kept whole — with this rank's slice. Under expert
    /// parallelism a rank's experts ([`Self::expert_shard`]) are sliced over their
    /// expert-data-parallel group (rank `r / ep` of `world / ep`, [`super::data_parallel::ExpertMesh`]),
    /// and kept whole when that group is one rank.
    pub fn row_selection(&self) -> Option<crate::checkpoint::select::RowSelection> {
        use crate::distributed::RowShard;
        let world = self.parallel.world().filter(|g| g.size() > 1)?;
        if self.peft.is_some() || !self.parallel.shard_parameters {
            return None;
        }
        let (r, w, ep) = (world.rank(), world.size(), self.parallel.expert_parallel.max(1));
        let dense = RowShard { rank: r, size: w };
        let experts = (ep > 1).then_some(RowShard { rank: r / ep, size: w / ep });
        let freeze = self.freeze.clone();
        Some(crate::checkpoint::select::RowSelection(std::sync::Arc::new(move |path: &str| {
            if freeze.freezes(path) || super::data_parallel::kept_whole(path) {
                return None;
            }
            match experts {
                Some(over) if super::data_parallel::is_routed_expert(path) => (over.size > 1).then_some(over),
                _ => Some(dense),
            }
        })))
    }

    /// The dtype the frozen base's weights are held in (those not FP8-resident): fp32 unless a
    /// LoRA run trains in bf16 on a `bf16` or `fp8` base.
    pub fn base_weight_dtype(&self) -> DType {
        self.peft.as_ref().map_or(DType::F32, |p| p.base_dtype.held_dtype(self.precision))
    }
}

impl TrainOptions {
    /// The options a recipe describes (one process: set [`ParallelLayout::mesh`]
    /// to run as one rank of a group).
    pub fn from_recipe(r: &Recipe) -> Self {
        Self {
            optimizer: OptimizerSettings {
                lr: LrSchedule {
                    style: r.lr_scheduler.lr_decay_style,
                    lr: r.optimizer.lr,
                    min_lr: r.lr_scheduler.min_lr,
                    warmup_steps: r.lr_scheduler.lr_warmup_steps,
                    total_steps: r.step_scheduler.max_steps,
                },
                betas: r.optimizer.betas,
                eps: r.optimizer.eps,
                weight_decay: r.optimizer.weight_decay,
                max_grad_norm: r.optimizer.max_grad_norm,
            },
            aux_loss_coef: r.moe.aux_loss_coef,
            router_bias_update_rate: r.moe.router_bias_update_rate,
            precision: r.model.dtype,
            on_nonfinite: r.step_scheduler.on_nonfinite,
            freeze: r.freeze_config.clone(),
            forward: ForwardOptions {
                attn_path: r.model.backend.attn,
                kda_path: r.model.backend.kda,
                fp32_residual: r.model.fp32_residual,
                ..ForwardOptions::default()
            },
            parallel: ParallelLayout {
                shard_parameters: r.distributed.shard_parameters,
                reshard_after_forward: r.distributed.reshard_after_forward,
                expert_parallel: r.distributed.ep_size,
                context_parallel: r.distributed.cp_size,
                mesh: None,
            },
            peft: r.peft.as_ref().map(|p| PeftOptions {
                config: p.lora_config(r.model.checkpoint.as_deref()),
                base: r.model.checkpoint.as_ref().map(|b| std::fs::canonicalize(b).unwrap_or_else(|_| b.clone())),
                base_dtype: r.model.base_dtype.unwrap_or_default(),
            }),
        }
    }
}

/// Where the data stands when a checkpoint is written: what a resumed sampler starts from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DataPosition {
    /// The sampler's epoch after this step.
    pub epoch: usize,
    /// Its cursor within the epoch.
    pub cursor: usize,
    /// The data order's seed.
    pub seed: u64,
}

/// What [`Trainer::step`] did.
#[derive(Debug, Clone, Copy)]
pub enum StepOutcome {
    /// The update was applied.
    Applied(StepMetrics),
    /// Non-finite loss or gradient under `on_nonfinite: skip`: nothing was applied.
    Skipped {
        /// The loss.
        loss: f64,
        /// The gradient norm.
        grad_norm: f64,
        /// Which was non-finite.
        what: &'static str,
    },
}

type Adam<B> = OptimizerAdaptor<FusedAdamW, Glm5ForCausalLM<B>, B>;
type OptimRecord<B> = <Adam<B> as Optimizer<Glm5ForCausalLM<B>, B>>::Record;

/// Model + AdamW + schedule + step counter.
pub struct Trainer<B: AutodiffBackend>
where
    B::InnerBackend: Glm5Backend,
{
    model: Option<Glm5ForCausalLM<B>>,
    optim: Adam<B>,
    /// The step's settings.
    pub options: TrainOptions,
    /// Optimizer steps taken (applied or skipped).
    pub step: usize,
    /// Steps skipped as non-finite.
    pub skipped_steps: usize,
    /// The data order's fingerprint, written into every checkpoint (set by the caller that
    /// built the data; see [`crate::data::fingerprint`]).
    pub data_fingerprint: Option<DataFingerprint>,
    /// This rank's part in the mesh (one process: nothing).
    parallel: ParallelTraining,
    /// Under bf16 precision, the frozen parameters' bf16 copies (made once: they never change).
    frozen_copies: FrozenCopies<B>,
}

fn adamw<B: AutodiffBackend>(o: &OptimizerSettings) -> Adam<B>
where
    B::InnerBackend: Glm5Backend,
{
    FusedAdamW { beta_1: o.betas[0] as f32, beta_2: o.betas[1] as f32, epsilon: o.eps as f32, weight_decay: o.weight_decay as f32 }.init()
}

impl<B: AutodiffBackend + Glm5Backend> Trainer<B>
where
    B::InnerBackend: Glm5Backend,
{
    /// Start training `model` (fp32 master weights): applies the freeze configuration.
    /// Under data parallelism with `shard_parameters`, every rank must pass the same model
    /// (it keeps its shard). Panics where [`Self::try_new`] returns an error (an expert-parallel
    /// size that does not fit the group or the experts).
    pub fn new(model: Glm5ForCausalLM<B>, options: TrainOptions) -> Self {
        Self::try_new(model, options).unwrap_or_else(|e| panic!("Trainer::new: {e}"))
    }

    /// [`Self::new`]. Under expert parallelism (`options.parallel.expert_parallel = P > 1`, a collective
    /// call over the data-parallel group) `model` is either the whole model (each rank keeps its
    /// experts) or this rank's share loaded with
    /// [`crate::checkpoint::LoadOptions::experts`] = [`Self::expert_shard`].
    pub fn try_new(model: Glm5ForCausalLM<B>, options: TrainOptions) -> Result<Self, TrainError> {
        // with LoRA the whole base is frozen and every adapter trains (PEFT's rule), whatever
        // `freeze_config` says: `attach` (or, resuming, `load_adapter`) froze the base, and
        // freezing the model with its adapters would freeze the vision tower's with the tower
        let mut model = if options.peft.is_some() { model } else { freeze(model, &options.freeze) };
        // a seeded base draws its lazily initialised weights now, before the adapters draw
        // theirs: the same base with and without LoRA, on every mesh
        materialize(&model);
        if let Some(peft) = &options.peft {
            if !crate::peft::has_adapters(&mut model) {
                // a model loaded with this rank's experts only draws every expert's adapter
                let shard = Self::expert_shard(&options).filter(|s| model.num_experts > 0 && expert_stacks(&model) * s.size == model.num_experts);
                model = crate::peft::attach_shard(model, &peft.config, shard.map(|s| (s.rank, s.size))).map_err(|e| TrainError::Lora(Box::new(e)))?.0;
            }
            // a base held below fp32 (loaded so, or seeded in fp32 and cast once here)
            model = hold_frozen_in(model, options.base_weight_dtype());
        }
        materialize(&model);
        // a model on a mesh device (`Distributed<B>`) runs on the device's mesh
        let (model, parallel) = ParallelTraining::prepare(model, &options.parallel)?;
        let mut options = options;
        if let (None, Some(mesh)) = (&options.parallel.mesh, parallel.mesh()) {
            options.parallel = options.parallel.on_mesh(mesh)?;
        }
        Ok(Self {
            model: Some(model),
            optim: adamw::<B>(&options.optimizer),
            options,
            step: 0,
            skipped_steps: 0,
            data_fingerprint: None,
            parallel,
            frozen_copies: FrozenCopies::default(),
        })
    }

    /// The routed experts a rank of `options` holds (`None`: all): what to pass as
    /// [`crate::checkpoint::LoadOptions::experts`] so a rank reads only its experts' bytes.
    pub fn expert_shard(options: &TrainOptions) -> Option<crate::checkpoint::select::ExpertShard> {
        options.expert_shard()
    }

    /// The current (master) model.
    pub fn model(&self) -> &Glm5ForCausalLM<B> {
        self.model.as_ref().expect("the trainer always holds its model between steps")
    }

    /// Give the model back.
    pub fn into_model(self) -> Glm5ForCausalLM<B> {
        self.model.expect("the trainer always holds its model between steps")
    }

    /// Ids of the parameters AdamW holds moments for (frozen and gradient-less parameters
    /// have none).
    pub fn optimizer_state_ids(&self) -> std::collections::HashSet<ParamId> {
        self.optim.to_record().keys().copied().collect()
    }

    /// One optimizer step over the micro-batches of a global batch.
    pub fn step(&mut self, micro: &[MicroBatch]) -> Result<StepOutcome, TrainError> {
        let lr = self.options.optimizer.lr.at(self.step);
        let master = self.model.take().expect("the trainer always holds its model between steps");
        let result = self.step_inner(&master, micro).and_then(|r| self.reduce(&master, r));
        let Accumulated { mut grads, loss: acc_loss, label_tokens, tokens, router_logits: router } = match result {
            Ok(x) => x,
            Err(e) => {
                self.model = Some(master);
                return Err(e);
            }
        };
        let norm = crate::profile::scope("gradient norm");
        let grad_norm = self.clip(&master, &mut grads);
        drop(norm);
        let grad_norm = match grad_norm {
            Ok(n) => n,
            Err(e) => {
                self.model = Some(master);
                return Err(e);
            }
        };
        self.step += 1;
        if let Some(what) = non_finite(acc_loss, grad_norm) {
            self.model = Some(master);
            return match self.options.on_nonfinite {
                NonFinitePolicy::Skip => {
                    self.skipped_steps += 1;
                    Ok(StepOutcome::Skipped { loss: acc_loss, grad_norm, what })
                }
                NonFinitePolicy::Abort => Err(TrainError::NonFinite { step: self.step, what, loss: acc_loss, grad_norm }),
            };
        }
        let update = crate::profile::scope("adamw update");
        let mut model = self.optim.step(lr, master, grads);
        drop(update);
        if self.options.router_bias_update_rate != 0.0 {
            if let Err(e) = self.parallel.update_router_bias(&mut model, &router, self.options.router_bias_update_rate) {
                self.model = Some(model);
                return Err(e);
            }
        }
        self.model = Some(model);
        Ok(StepOutcome::Applied(StepMetrics { loss: acc_loss, grad_norm, lr, label_tokens, tokens }))
    }

    /// The gradients one [`Self::step`] over `micro` would apply, before clipping (summed over
    /// the data-parallel group, an expert-parallel rank's experts over the ranks holding them),
    /// and the loss; nothing is applied. A sharded parameter's gradient is this rank's rows, an
    /// expert stack's this rank's experts. For inspection and for checking a mesh against one
    /// process.
    pub fn gradients(&mut self, micro: &[MicroBatch]) -> Result<(burn::optim::GradientsParams, f64), TrainError> {
        let master = self.model.take().expect("the trainer always holds its model between steps");
        let result = self.step_inner(&master, micro).and_then(|r| self.reduce(&master, r));
        self.model = Some(master);
        result.map(|acc| (acc.grads, acc.loss))
    }

    /// The global gradient norm (a sharded model's shards summed over the ranks, the same
    /// value on every rank), clipping to `max_grad_norm` when set.
    fn clip(&self, master: &Glm5ForCausalLM<B>, grads: &mut burn::optim::GradientsParams) -> Result<f64, TrainError> {
        self.parallel.clip(master, grads, self.options.optimizer.max_grad_norm)
    }

    fn step_inner(&self, master: &Glm5ForCausalLM<B>, micro: &[MicroBatch]) -> Result<Accumulated, TrainError> {
        let keep_router = self.options.router_bias_update_rate != 0.0;
        let o = &self.options;
        let global = self.parallel.global_batch(master, micro)?;
        let step = StepContext {
            global,
            aux_coef: o.aux_loss_coef,
            forward: o.forward,
            keep_router_logits: keep_router,
            context: self.parallel.context().cloned(),
        };
        match o.precision {
            Precision::F32 => accumulate(master, micro, &step),
            Precision::Bf16 => {
                let cast = crate::profile::scope("bf16 compute copy");
                let compute = compute_copy(master, DType::BF16, &self.frozen_copies);
                drop(cast);
                let mut acc = accumulate(&compute, micro, &step)?;
                let _cast = crate::profile::scope("gradients to fp32");
                grads_to_f32::<B, _>(master, &mut acc.grads);
                Ok(acc)
            }
        }
    }

    /// Sums this rank's gradients, loss and token count over the data-parallel group (the same
    /// bits on every rank, so the replicas stay identical); one process: unchanged.
    fn reduce(&self, master: &Glm5ForCausalLM<B>, sums: Accumulated) -> Result<Accumulated, TrainError> {
        let Accumulated { mut grads, loss, label_tokens, tokens, router_logits } = sums;
        self.parallel.reduce_grads(master, &mut grads)?;
        Ok(Accumulated { grads, loss: self.parallel.sum(loss)?, label_tokens, tokens: self.parallel.sum_count(tokens)?, router_logits })
    }

    /// Mean cross-entropy over the label tokens of `batches` (no gradients), in the training
    /// precision; under data parallelism `batches` is this rank's share and the mean is over
    /// every rank's.
    pub fn evaluate(&self, batches: &[MicroBatch]) -> Result<(f64, usize), TrainError> {
        let model = match self.options.precision {
            Precision::F32 => self.model().valid(),
            Precision::Bf16 => compute_copy(self.model(), DType::BF16, &self.frozen_copies).valid(),
        };
        let mut sum = 0.0;
        let mut count = 0;
        // sharded: every forward gathers parameters with the whole group, so every rank runs as
        // many forwards as the rank with the largest share (agreed before any of them), a
        // smaller share padded with forwards whose results are dropped
        let plan = plan_of(&model).cloned();
        let runs = match (&plan, self.parallel.world()) {
            (Some(_), Some(g)) => gather_usize(&**g, batches.len())?.into_iter().max().unwrap_or(0),
            _ => batches.len(),
        };
        // (under context parallelism each shard must hold a short conv's window)
        let len = 8 * self.parallel.context().map_or(1, |c| c.size());
        let filler = || batches.first().cloned().unwrap_or_else(|| MicroBatch::text(vec![0; len], vec![-100; len], 1, len, None));
        for i in 0..runs {
            match batches.get(i) {
                Some(b) => {
                    let LossSum { sum: s, label_tokens } =
                        micro_loss_sum::<B::InnerBackend>(&model, b, &self.options.forward, self.parallel.context())?;
                    sum += s;
                    count += label_tokens;
                }
                None => {
                    micro_loss_sum::<B::InnerBackend>(&model, &filler(), &self.options.forward, self.parallel.context())?;
                }
            }
        }
        if let Some(plan) = &plan {
            plan.take_vision_used();
        }
        (sum, count) = (self.parallel.sum(sum)?, self.parallel.sum_count(count)?);
        Ok((sum / count.max(1) as f64, count))
    }

    /// Write a checkpoint under `root` (see [`super::checkpoint`]): the HF-layout model with
    /// `config`, the `extra_files` (tokenizer, chat template) beside it, the optimizer moments
    /// and the trainer state with the data `position`.
    pub fn save_checkpoint(
        &self,
        root: &Path,
        keep_last: usize,
        config: &CheckpointConfig,
        extra_files: &[PathBuf],
        position: DataPosition,
    ) -> Result<PathBuf, TrainError> {
        let ids: BTreeMap<String, u64> = param_ids::<B, _>(self.model()).into_iter().map(|(k, v)| (k, v.val())).collect();
        let state = TrainerState {
            step: self.step,
            epoch: position.epoch,
            cursor: position.cursor,
            seed: position.seed,
            skipped_steps: self.skipped_steps,
            param_ids: ids,
            data: self.data_fingerprint.clone(),
            schedule: Some(self.options.optimizer.lr),
            base_checkpoint: self.options.peft.as_ref().and_then(|p| p.base.clone()),
        };
        let file = |path: &Path, message: String| TrainError::CheckpointFile { path: path.to_path_buf(), message };
        if let Some(plan) = plan_of(self.model()) {
            let rank = plan.group().rank();
            return ckpt::write_group(root, &state, keep_last, &**plan.group(), |dir: &Path| -> Result<(), TrainError> {
                let model_dir = dir.join("model");
                let at = |source| TrainError::Checkpoint { dir: model_dir.clone(), source };
                // a LoRA run: the adapters, gathered whole (they are small), written by rank 0
                // in PEFT's format; the base (only without a base checkpoint) as a full run's
                let model_dir = match &self.options.peft {
                    Some(peft) => {
                        let adapter_dir = dir.join("adapter");
                        let at = |source| TrainError::Checkpoint { dir: adapter_dir.clone(), source };
                        let whole = super::data_parallel::gather_expert_adapters(super::data_parallel::unshard_model(self.model().clone()))
                            .map_err(|e| at(crate::checkpoint::CheckpointError::Internal(format!("gathering the adapters: {e}"))))?;
                        if peft.base.is_none() {
                            sharded::save_model(self.model(), plan, config, &model_dir)
                                .map_err(|source| TrainError::Checkpoint { dir: model_dir.clone(), source })?;
                        }
                        if rank == 0 {
                            crate::checkpoint::adapter::save_adapter(&whole, &peft.config, &adapter_dir).map_err(at)?;
                        }
                        adapter_dir
                    }
                    None => {
                        sharded::save_model(self.model(), plan, config, &model_dir).map_err(at)?;
                        model_dir
                    }
                };
                if rank == 0 {
                    for f in extra_files {
                        let name = f.file_name().ok_or_else(|| file(f, "not a file name".into()))?;
                        std::fs::copy(f, model_dir.join(name)).map_err(|e| file(f, e.to_string()))?;
                    }
                }
                sharded::save_optimizer(self.model(), &self.optim, dir)
                    .map_err(|source| TrainError::Checkpoint { dir: dir.join("optimizer"), source })
            })
            .map_err(|e| TrainError::Saving { step: self.step, source: Box::new(e) });
        }
        ckpt::write(root, &state, keep_last, |dir: &Path| -> Result<(), TrainError> {
            let model_dir = match &self.options.peft {
                Some(peft) => {
                    // the adapters (PEFT's format); the base only when no checkpoint holds it
                    let adapter_dir = dir.join("adapter");
                    crate::checkpoint::adapter::save_adapter(self.model(), &peft.config, &adapter_dir)
                        .map_err(|source| TrainError::Checkpoint { dir: adapter_dir.clone(), source })?;
                    if peft.base.is_none() {
                        save_causal_lm(self.model(), config, dir.join("model"))
                            .map_err(|source| TrainError::Checkpoint { dir: dir.join("model"), source })?;
                    }
                    adapter_dir
                }
                None => {
                    let model_dir = dir.join("model");
                    save_causal_lm(self.model(), config, &model_dir).map_err(|source| TrainError::Checkpoint { dir: model_dir.clone(), source })?;
                    model_dir
                }
            };
            for f in extra_files {
                let name = f.file_name().ok_or_else(|| file(f, "not a file name".into()))?;
                std::fs::copy(f, model_dir.join(name)).map_err(|e| file(f, e.to_string()))?;
            }
            // encoded in memory, written by us: a full disk then reads as the I/O error it is
            // (the file recorder reported it as a MessagePack encoding error)
            let path = dir.join("optimizer.mpk");
            let bytes = NamedMpkBytesRecorder::<FullPrecisionSettings>::new()
                .record(self.optim.to_record(), ())
                .map_err(|e| file(&path, format!("encoding the optimizer state: {e}")))?;
            std::fs::write(&path, bytes).map_err(|e| file(&path, e.to_string()))?;
            Ok(())
        })
        .map_err(|e| TrainError::Saving { step: self.step, source: Box::new(e) })
    }

    /// Continue from a checkpoint directory written by [`Self::save_checkpoint`]: weights,
    /// optimizer moments, step counter. Returns the trainer and the saved state (whose data
    /// position the caller's sampler resumes at). Any checkpoint resumes under any data- and
    /// expert-parallel mesh; an expert-parallel rank reads only its experts.
    pub fn resume(dir: &Path, options: TrainOptions, vision: bool, device: &B::Device) -> Result<(Self, TrainerState), TrainError> {
        let file = |name: &str, message: String| TrainError::CheckpointFile { path: dir.join(name), message };
        let state = ckpt::read_state(dir)?;
        let load = options.base_load_options(vision);
        // a LoRA step: the base from its checkpoint (or the step's model/), the adapters from adapter/
        let adapter_dir = dir.join("adapter");
        let model_dir = match &state.base_checkpoint {
            Some(base) if adapter_dir.is_dir() => base.clone(),
            _ => dir.join("model"),
        };
        let mut loaded =
            load_causal_lm::<B>(&model_dir, device, &load).map_err(|source| TrainError::Checkpoint { dir: model_dir.clone(), source })?;
        if adapter_dir.is_dir() {
            if options.peft.is_none() {
                return Err(file(
                    "adapter",
                    "this checkpoint is a LoRA run's (adapters on a base): resume it with the recipe's `peft` section".into(),
                ));
            }
            loaded.model = crate::checkpoint::adapter::load_adapter_shard(loaded.model, &adapter_dir, load.experts.as_ref())
                .map_err(|source| TrainError::Checkpoint { dir: adapter_dir.clone(), source })?
                .0;
        }
        let ids: BTreeMap<String, ParamId> = state.param_ids.iter().map(|(k, &v)| (k.clone(), ParamId::from(v))).collect();
        let (model, missing) = assign_param_ids(loaded.model, &ids);
        if !missing.is_empty() {
            return Err(file(
                "trainer_state.json",
                format!("no parameter id for {} module tensors (first: {}); the checkpoint is from another model", missing.len(), missing[0]),
            ));
        }
        let mut trainer = Self::try_new(model, options)?;
        let sharded_dir = dir.join("optimizer");
        let record = if sharded_dir.is_dir() {
            // written by a sharded run (any number of ranks): this rank's rows
            sharded::load_optimizer(trainer.model(), &sharded_dir).map_err(|source| TrainError::Checkpoint { dir: sharded_dir.clone(), source })?
        } else {
            sharded::cut_record(trainer.model(), Self::read_mpk(dir, device)?)
        };
        trainer.optim = trainer.optim.load_record(record);
        trainer.step = state.step;
        trainer.skipped_steps = state.skipped_steps;
        trainer.data_fingerprint = state.data.clone();
        Ok((trainer, state))
    }

    /// Whether the parameters are sharded over a data-parallel group (then every rank takes
    /// part in [`Self::save_checkpoint`]).
    pub fn is_sharded(&self) -> bool {
        plan_of(self.model()).is_some()
    }

    /// `optimizer.mpk` of an unsharded run.
    fn read_mpk(dir: &Path, device: &B::Device) -> Result<OptimRecord<B>, TrainError> {
        let file = |name: &str, message: String| TrainError::CheckpointFile { path: dir.join(name), message };
        let path = dir.join("optimizer.mpk");
        let bytes = std::fs::read(&path).map_err(|e| file("optimizer.mpk", e.to_string()))?;
        let n = bytes.len();
        let record: OptimRecord<B> = NamedMpkBytesRecorder::<FullPrecisionSettings>::new().load(bytes, device).map_err(|e| {
            // the decoder's own text blames a format change; say what it almost always is
            let detail = e.to_string();
            let first = detail.split("\\n").next().and_then(|l| l.lines().next()).unwrap_or_default();
            let first = first.trim_start_matches("Unknown(\"").trim_end_matches("\")");
            file("optimizer.mpk", format!("({n} bytes) is truncated or corrupt and cannot be decoded (decoder: {first})"))
        })?;
        Ok(record)
    }
}

/// The routed experts each MoE layer of `model` holds (0 without MoE layers).
fn expert_stacks<B: burn::tensor::backend::Backend>(model: &Glm5ForCausalLM<B>) -> usize {
    model
        .language_model
        .layers
        .iter()
        .find_map(|layer| match &layer.mlp {
            crate::text::decoder::Ffn::Moe(moe) => Some(moe.experts.dims()[0]),
            _ => None,
        })
        .unwrap_or(0)
}
