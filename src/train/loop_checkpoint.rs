//! Checkpoints of a loop of one's own on a mesh: [`ParallelTraining::save_checkpoint`] writes
//! the layout of a sharded [`super::trainer::Trainer`]'s checkpoints — the model as a
//! published HF checkpoint, every rank writing the tensors it owns (`train::sharded`), and
//! AdamW's moments of each rank's rows by module path — and
//! [`ParallelTraining::load_checkpoint`] reads one back under any mesh, each rank only its
//! part. Burn's `AdamW` and the trainer's [`super::adamw::FusedAdamW`] both fit
//! ([`AdamWMoments`]: the same moments).

use std::path::{Path, PathBuf};

use burn::optim::adaptor::OptimizerAdaptor;
use burn::tensor::backend::AutodiffBackend;

use super::adamw::AdamWMoments;
use super::checkpoint::{self as ckpt, TrainerState};
use super::data_parallel::plan_of;
use super::parallel::ParallelTraining;
use super::params::param_ids;
use super::sharded;
use super::step::TrainError;
use super::trainer::{DataPosition, TrainOptions};
use crate::checkpoint::{load_causal_lm, save_causal_lm, CheckpointConfig};
use crate::distributed::mesh_of;
use crate::model::Glm5ForCausalLM;
use crate::ops::backend::Glm5Backend;

/// AdamW's moments by parameter id, as [`ParallelTraining::load_checkpoint`] returns them.
pub use super::sharded::AdamRecord;

/// A loop of one's own's checkpoint loaded for this rank ([`ParallelTraining::load_checkpoint`]).
pub struct ResumedLoop<B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>> {
    /// The model, this rank's part of it, prepared on the mesh.
    pub model: Glm5ForCausalLM<B>,
    /// Its parallelism.
    pub parallel: ParallelTraining,
    /// AdamW's moments of the rows this rank holds, for `optim.load_record`.
    pub record: AdamRecord<B, O>,
    /// The saved state: step, data position.
    pub state: TrainerState,
}

impl ParallelTraining {
    /// Save a training checkpoint of a loop of one's own as `root/step_{step:06}`: the model in
    /// the published HF layout — on a mesh each rank writes the tensors it owns, nothing is
    /// gathered whole — and `optim`'s AdamW moments of the rows each rank holds
    /// (`optimizer/rank-K-of-N.safetensors`, by module path), staged and renamed into place
    /// once every rank has written; the `keep_last` newest steps are kept. The layout of a
    /// sharded [`super::trainer::Trainer`]'s checkpoints, so it resumes under any mesh
    /// ([`Self::load_checkpoint`], or the trainer). A collective call on a mesh. Full
    /// fine-tuning only: a model with LoRA adapters is refused (the trainer saves them in
    /// PEFT's format).
    #[allow(clippy::too_many_arguments)]
    pub fn save_checkpoint<B: AutodiffBackend, O: AdamWMoments<B::InnerBackend>>(
        &self,
        root: &Path,
        step: usize,
        model: &Glm5ForCausalLM<B>,
        optim: &OptimizerAdaptor<O, Glm5ForCausalLM<B>, B>,
        config: &CheckpointConfig,
        keep_last: usize,
        position: DataPosition,
    ) -> Result<PathBuf, TrainError> {
        if crate::peft::has_adapters(&mut model.clone()) {
            return Err(TrainError::Unsupported {
                what: "ParallelTraining::save_checkpoint of a model with LoRA adapters (save them with checkpoint::adapter::save_adapter, or train with Trainer)",
            });
        }
        let state = TrainerState {
            step,
            epoch: position.epoch,
            cursor: position.cursor,
            seed: position.seed,
            skipped_steps: 0,
            param_ids: param_ids::<B, _>(model).into_iter().map(|(k, v)| (k, v.val())).collect(),
            data: None,
            schedule: None,
            base_checkpoint: None,
        };
        let plan = plan_of(model);
        let rank = self.world().map_or(0, |g| g.rank());
        let fill = |dir: &Path| -> Result<(), TrainError> {
            let model_dir = dir.join("model");
            let at = |source| TrainError::Checkpoint { dir: model_dir.clone(), source };
            // sharded: every rank its part; replicated (one process, DDP): rank 0 the one copy
            match plan {
                Some(plan) => sharded::save_model(model, plan, config, &model_dir).map_err(at)?,
                None if rank == 0 => {
                    save_causal_lm(model, config, &model_dir).map_err(at)?;
                }
                None => return Ok(()),
            }
            sharded::save_optimizer(model, optim, dir).map_err(|source| TrainError::Checkpoint { dir: dir.join("optimizer"), source })
        };
        let written = match self.world() {
            Some(g) => ckpt::write_group(root, &state, keep_last, &**g, fill),
            None => ckpt::write(root, &state, keep_last, fill),
        };
        written.map_err(|e| TrainError::Saving { step, source: Box::new(e) })
    }

    /// A checkpoint written by [`Self::save_checkpoint`] (or by a sharded
    /// [`super::trainer::Trainer`]), under any mesh: the model with this rank's part read
    /// ([`super::trainer::TrainOptions::base_load_options`], on the mesh of `options` or of
    /// the device), frozen as `options.freeze` says and [`Self::prepare`]d; AdamW's moments of
    /// the rows this rank holds, for `optim.load_record`; and the saved state (step, data
    /// position). An error naming the file when the checkpoint is not one.
    pub fn load_checkpoint<B: AutodiffBackend + Glm5Backend, O: AdamWMoments<B::InnerBackend>>(
        dir: &Path,
        options: &TrainOptions,
        vision: bool,
        device: &B::Device,
    ) -> Result<ResumedLoop<B, O>, TrainError> {
        let state = ckpt::read_state(dir)?;
        let optimizer_dir = dir.join("optimizer");
        if !optimizer_dir.is_dir() {
            return Err(TrainError::CheckpointFile {
                path: optimizer_dir,
                message: "missing: not a checkpoint of ParallelTraining::save_checkpoint or of a sharded run (an unsharded Trainer's resumes with Trainer::resume)".into(),
            });
        }
        let mut options = options.clone();
        if let (None, Some(mesh)) = (&options.parallel.mesh, mesh_of(device)) {
            options.parallel = options.parallel.on_mesh(&mesh)?;
        }
        let model_dir = dir.join("model");
        let loaded = load_causal_lm::<B>(&model_dir, device, &options.base_load_options(vision))
            .map_err(|source| TrainError::Checkpoint { dir: model_dir.clone(), source })?;
        let model = super::params::freeze(loaded.model, &options.freeze);
        super::params::materialize(&model);
        let (model, parallel) = Self::prepare(model, &options.parallel)?;
        let record =
            sharded::load_optimizer::<B, O>(&model, &optimizer_dir).map_err(|source| TrainError::Checkpoint { dir: optimizer_dir, source })?;
        Ok(ResumedLoop { model, parallel, record, state })
    }
}
