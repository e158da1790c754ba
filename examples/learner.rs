//! The model in burn-train's own `Learner`: the bundled tiny VLM fine-tuned on the bundled
//! MedPix sample with `SupervisedTraining` (its loss metrics, file checkpointer, and its
//! terminal dashboard when stdout is a terminal, plain lines otherwise).
//!
//! ```text
//! cargo run --release --features learner --example learner [-- RECIPE.yaml] [--section.key=value ...] [--dir DIR]
//! ```
//!
//! The recipe is `finetune`'s (default: the embedded `configs/tiny_medpix.yaml`): the same
//! packs in the same order, `global_batch_size / local_batch_size` micro-batches accumulated
//! per optimizer step, AdamW with the recipe's schedule. `glm5_burn::train::learner` says
//! which of our `Trainer`'s features this path lacks. At the end the validation loss is
//! printed with `finetune`'s definition (label-token mean over the validation set) to compare.
//!
//! Under `mpirun` (`--features mpi`) the same Learner trains on a mesh: the backend is
//! `Autodiff<Distributed<Flex>>`, the device a `MeshDevice` of the recipe's
//! `distributed.dp_size × cp_size` ranks (`ep_size` splitting the experts), the model
//! `ParallelTraining::prepare`d (FSDP shards, this rank's experts) and each rank fed its share
//! of every global batch; burn-train's files of rank `r > 0` go to `DIR/rank{r}` (its records
//! hold that rank's shards).
//!
//! ```text
//! mpirun -np 2 target/release/examples/learner --distributed.dp_size=2 --dir DIR
//! ```

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use burn::backend::flex::FlexDevice;
use burn::backend::{Autodiff, Flex};
use burn::record::{FullPrecisionSettings, NamedMpkFileRecorder};
use burn::tensor::backend::Backend;
use burn::train::metric::{LossMetric, MetricDefinition, NumericEntry};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation, MetricsRendererTraining, ProgressType,
    TrainingProgress,
};
use burn::train::{Learner, SupervisedTraining};
use clap::{CommandFactory, FromArgMatches, Parser};
use glm5_burn::checkpoint::load_causal_lm;
use glm5_burn::data::batch::MicroBatch;
use glm5_burn::data::chat::ChatFormat;
use glm5_burn::data::image_processor::ImageProcessor;
use glm5_burn::data::loader::{PackedDataset, PackingOptions, Sampler};
use glm5_burn::distributed::{DistError, Distributed, Mesh, MeshDevice, MeshSizes};
use glm5_burn::train::adamw::FusedAdamW;
use glm5_burn::train::data_parallel::{gather_expert_adapters, sum_f64, unshard_model};
use glm5_burn::train::learner::{LmItem, LmLoader, ScheduleLr};
use glm5_burn::train::parallel::ParallelTraining;
use glm5_burn::train::params::{freeze, trainable_counts};
use glm5_burn::train::recipe::{split_overrides, Precision, Recipe};
use glm5_burn::train::step::{micro_loss_sum, LossSum};
use glm5_burn::train::trainer::TrainOptions;
use glm5_burn::Glm5ForCausalLM;

/// The decorator carries the mesh; with one process it is `Autodiff<Flex>` bit for bit.
type B = Autodiff<Distributed<Flex>>;

/// Plain lines when stdout is not a terminal (burn-train's dashboard otherwise): one per
/// optimizer step with the mean loss of its micro-batches, one for the validation pass.
struct Lines {
    accumulation: usize,
    train: Vec<f64>,
    valid: Vec<f64>,
}

fn value(state: &MetricState) -> Option<f64> {
    match state {
        MetricState::Numeric(_, NumericEntry::Value(v)) => Some(*v),
        MetricState::Numeric(_, NumericEntry::Aggregated { aggregated_value, .. }) => Some(*aggregated_value),
        MetricState::Generic(_) => None,
    }
}

impl MetricsRendererTraining for Lines {
    fn update_train(&mut self, state: MetricState) {
        self.train.extend(value(&state));
    }

    fn update_valid(&mut self, state: MetricState) {
        self.valid.extend(value(&state));
    }

    fn render_train(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        let Some(i) = item.iteration.filter(|i| i % self.accumulation == 0) else { return };
        let mean = self.train.iter().sum::<f64>() / self.train.len().max(1) as f64;
        println!("step {}: loss {mean:.4} (mean of its {} micro-batches)", i / self.accumulation, self.train.len());
        self.train.clear();
    }

    fn render_valid(&mut self, item: TrainingProgress, _: Vec<ProgressType>) {
        let done = item.progress.as_ref().is_some_and(|p| p.items_processed == p.items_total);
        if done && !self.valid.is_empty() {
            let mean = self.valid.iter().sum::<f64>() / self.valid.len() as f64;
            println!("validation: loss {mean:.4} (mean over {} batches)", self.valid.len());
            self.valid.clear();
        }
    }
}

impl MetricsRendererEvaluation for Lines {
    fn update_test(&mut self, _: EvaluationName, _: MetricState) {}
    fn render_test(&mut self, _: EvaluationProgress, _: Vec<ProgressType>) {}
}

impl MetricsRenderer for Lines {
    fn manual_close(&mut self) {}
    fn register_metric(&mut self, _: MetricDefinition) {}
}

/// Fine-tune with burn-train's Learner (no recipe: the embedded tiny MedPix default).
#[derive(Parser, Debug)]
#[command(name = "learner", override_usage = "learner [RECIPE.yaml] [--section.key=value ...] [OPTIONS]")]
struct Args {
    /// Recipe file (YAML); without one, the embedded `configs/tiny_medpix.yaml`.
    recipe: Option<PathBuf>,
    /// Directory of burn-train's checkpoints and logs (the recipe's `checkpoint.checkpoint_dir`
    /// is finetune's; the Learner writes here).
    #[arg(long, default_value = "checkpoints/tiny_medpix_learner")]
    dir: PathBuf,
    /// Train again into a `--dir` that already holds a run (its files are replaced).
    #[arg(long)]
    overwrite: bool,
}

/// Recipe keys this path does not honour: given on the command line they are refused, naming
/// the key and what to use instead (a silently ignored key would train something else).
const NOT_HONOURED: &[(&str, &str)] = &[
    ("checkpoint.checkpoint_dir", "the Learner writes burn-train's checkpoints and logs under --dir"),
    ("checkpoint.keep_last", "burn-train's file checkpointer keeps its own files under --dir"),
    ("step_scheduler.ckpt_every_steps", "burn-train checkpoints once per epoch"),
    ("step_scheduler.val_every_steps", "burn-train validates once per epoch"),
    ("step_scheduler.val_answer_max_new_tokens", "the Learner reports the validation loss only (use finetune for answer accuracy)"),
    ("step_scheduler.on_nonfinite", "burn-train applies every step"),
    ("distributed.activation_checkpointing", "the Learner's backend has no checkpointing strategy (use finetune)"),
];

/// The first override naming a key of [`NOT_HONOURED`] (or a key below it).
fn refuse_unhonoured(overrides: &[String]) -> Result<()> {
    for o in overrides {
        let key = o.trim_start_matches("--").split('=').next().unwrap_or_default();
        if let Some((k, why)) = NOT_HONOURED.iter().find(|(k, _)| key == *k || key.starts_with(&format!("{k}."))) {
            bail!("--{o}: the learner does not honour `{k}`: {why}");
        }
    }
    Ok(())
}

/// A refusal every rank reached alike, already written once by rank 0: exit 1 quietly.
#[derive(Debug)]
struct Reported;

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped: the error is reported by rank 0")
    }
}

impl std::error::Error for Reported {}

/// Returning (not `exit`ing) drops the mesh, so MPI finalises and the launcher adds no noise.
fn main() -> std::process::ExitCode {
    match real_main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            if !e.is::<Reported>() {
                eprintln!("Error: {e:?}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn real_main() -> Result<()> {
    let (overrides, rest) = split_overrides(std::env::args().skip(1));
    let matches = Args::command().get_matches_from(std::iter::once("learner".to_string()).chain(rest));
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    refuse_unhonoured(&overrides)?;
    let recipe = match &args.recipe {
        Some(p) => Recipe::from_file(p, &overrides)?,
        None => Recipe::embedded_default(&overrides)?,
    };
    // the mesh of the recipe's sizes (one process without mpirun); a refusal every rank
    // reaches alike is reported once, by rank 0
    let d = &recipe.distributed;
    let reported = |e: DistError| -> anyhow::Error {
        match e {
            DistError::Mesh { reported: true, .. } => Reported.into(),
            e => e.into(),
        }
    };
    let mesh = Arc::new(Mesh::from_env(Some(MeshSizes { dp: d.dp_size, cp: d.cp_size, ep: d.ep_size })).map_err(reported)?);
    let rank = mesh.rank();
    glm5_burn::distributed::quiet_unless_rank_zero(rank);
    // where burn-train writes, before any data or model is prepared (it panics on a directory
    // it cannot create); checked by every rank before any creates its own
    glm5_burn::io::check_output_dir("--dir", &args.dir, &[])?;
    let earlier = std::fs::read_dir(&args.dir).map(|mut d| d.next().is_some()).unwrap_or(false);
    if earlier && !args.overwrite {
        bail!(
            "--dir {} already holds a run (burn-train's checkpoints and logs): pass --overwrite to train again into it, or name another --dir",
            args.dir.display()
        );
    }
    if earlier {
        println!("--overwrite: training again into {}; its checkpoints and logs are written over", args.dir.display());
    }
    mesh.agree("recipe", recipe.digest(), "give every rank the same recipe and overrides").map_err(reported)?;
    let dir = match rank {
        0 => args.dir.clone(),
        r => args.dir.join(format!("rank{r}")),
    };
    let (replica, replicas) = mesh.data_shard();
    if replicas > 1 || mesh.size() > 1 {
        println!(
            "mesh: dp {} × cp {} ranks, ep {}; each data-parallel rank trains on 1/{replicas} of every global batch",
            d.dp_size, d.cp_size, d.ep_size
        );
    }
    if recipe.model.dtype != Precision::F32 {
        println!("model.dtype {:?}: the Learner trains the module in its own precision; training in f32", recipe.model.dtype);
    }
    let device = MeshDevice::new(FlexDevice, mesh.clone())?;
    // unbound on every way out, so MPI finalises with the mesh's last group
    let _binding = device.binding();
    B::seed(&device, recipe.rng.seed);

    let config = match (&recipe.model.checkpoint, &recipe.model.config) {
        (Some(dir), _) => glm5_burn::checkpoint::read_config(dir)?,
        (None, Some(path)) => glm5_burn::checkpoint::CheckpointConfig::read_file(path).context("model.config")?,
        (None, None) => bail!("the recipe names neither model.checkpoint nor model.config"),
    }
    .resolved;
    let tok_dir = recipe.model.tokenizer.clone().or_else(|| recipe.model.checkpoint.clone()).context("model.tokenizer")?;
    let chat = ChatFormat::from_dir(&tok_dir)?;
    let packing = PackingOptions {
        max_length: recipe.packed_sequence.packed_sequence_size,
        drop_long_samples: recipe.packed_sequence.drop_long_samples,
        seed: recipe.rng.seed,
    };
    let build = |s: &glm5_burn::data::DatasetSource, label: &str| -> Result<PackedDataset> {
        let ds =
            PackedDataset::build(s, &chat, ImageProcessor::default(), config.image_token_id, &packing).with_context(|| format!("{label} dataset"))?;
        println!("{label}: {} packs of ≤{} tokens", ds.packs.len(), packing.max_length);
        Ok(ds)
    };
    let train = build(&recipe.dataset, "train")?;
    let val = recipe.validation_dataset.as_ref().map(|v| build(v, "validation")).transpose()?;

    // the packs finetune draws, in its order: max_steps global batches of `accum` micro-batches
    let s = &recipe.step_scheduler;
    let accum = recipe.accumulation_steps();
    let mut sampler = Sampler::new(train.packs.len(), recipe.rng.seed);
    let mut global = Vec::with_capacity(s.max_steps);
    for _ in 0..s.max_steps {
        global.push((0..accum).map(|_| train.micro_batch(&sampler.take(s.local_batch_size))).collect::<Result<Vec<_>, _>>()?);
    }
    let mut options = TrainOptions::from_recipe(&recipe);
    options.parallel = options.parallel.on_mesh(&mesh)?;
    if accum % replicas != 0 {
        bail!("{accum} micro-batches per optimizer step do not split over {replicas} data-parallel ranks: make step_scheduler.global_batch_size / local_batch_size a multiple of distributed.dp_size");
    }
    let vocab = config.text_config.vocab_size;
    let train_items = LmItem::share_of_global_batches(global, vocab, options.aux_loss_coef, &options.forward, (replica, replicas));
    let val_batches: Vec<MicroBatch> = match &val {
        Some(v) => (0..v.packs.len()).collect::<Vec<_>>().chunks(s.local_batch_size).map(|c| v.micro_batch(c)).collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let val_items = LmItem::from_global_batches(val_batches.iter().map(|m| vec![m.clone()]).collect(), vocab, 0.0, &options.forward);

    let model: Glm5ForCausalLM<B> = match &recipe.model.checkpoint {
        Some(dir) => load_causal_lm::<B>(dir, &device, &options.base_load_options(true))?.model,
        None => Glm5ForCausalLM::<B>::try_new_with_vision(&config, None, &device)?,
    };
    let model = freeze(model, &recipe.freeze_config);
    // recipe `peft`: LoRA adapters on the frozen base, the only parameters the Learner trains
    let model = match &options.peft {
        Some(peft) => {
            let (model, attached) = glm5_burn::peft::attach(model, &peft.config)?;
            println!("LoRA r {} alpha {}: {attached}", peft.config.r, peft.config.lora_alpha);
            model
        }
        None => model,
    };
    let (trainable, frozen) = trainable_counts(&model);
    // this rank's experts and FSDP shards, on the device's mesh
    let (model, par) = ParallelTraining::prepare(model, &options.parallel)?;
    println!(
        "parameters: {:.2} M trainable, {:.2} M frozen; {} optimizer steps of {accum} micro-batches",
        trainable as f64 / 1e6,
        frozen as f64 / 1e6,
        s.max_steps
    );
    let optim = FusedAdamW {
        beta_1: options.optimizer.betas[0] as f32,
        beta_2: options.optimizer.betas[1] as f32,
        epsilon: options.optimizer.eps as f32,
        weight_decay: options.optimizer.weight_decay as f32,
    }
    .init::<B, Glm5ForCausalLM<B>>();
    let lr = ScheduleLr { schedule: options.optimizer.lr, accumulation: accum / replicas, items: 0 };
    let learner = Learner::new(model, optim, lr);

    let training = SupervisedTraining::new(&dir, Arc::new(LmLoader::new(train_items)), Arc::new(LmLoader::new(val_items)))
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new());
    // checkpoint.enabled: false writes no model checkpoints (burn-train's logs still go to --dir)
    let training =
        if recipe.checkpoint.enabled { training.with_file_checkpointer(NamedMpkFileRecorder::<FullPrecisionSettings>::new()) } else { training };
    let training = training.grads_accumulation(accum / replicas).num_epochs(1).summary();
    // (under mpirun the launcher may hand rank 0 a pty, but no terminal to draw on)
    let training = match std::io::stdout().is_terminal() && mesh.size() == 1 {
        true => training,
        false => training.renderer(Lines { accumulation: accum / replicas, train: Vec::new(), valid: Vec::new() }),
    };
    let result = training.launch(learner);

    // finetune's validation loss: Σ CE / Σ label tokens over the validation set
    if !val_batches.is_empty() {
        // every rank runs every batch (a sharded model gathers with all of them); under
        // context parallelism each holds its shard's part, summed over its context group
        let (mut sum, mut count) = (0.0, 0.0);
        for m in &val_batches {
            let LossSum { sum: s, label_tokens: c } = micro_loss_sum(&result.model, m, &options.forward, par.context())?;
            sum += s;
            count += c as f64;
        }
        if let Some(ctx) = par.context() {
            (sum, count) = (sum_f64(&**ctx, sum)?, sum_f64(&**ctx, count)?);
        }
        println!("validation loss after {} steps (label-token mean, as finetune reports it): {:.8}", s.max_steps, sum / count.max(1.0));
    }
    if let Some(peft) = &options.peft {
        // the adapters gathered whole (they are small), written by rank 0
        let whole = gather_expert_adapters(unshard_model(result.model))?;
        if rank == 0 {
            let dir = args.dir.join("adapter");
            glm5_burn::checkpoint::adapter::save_adapter(&whole, &peft.config, &dir)?;
            println!("adapters (HF PEFT format): {}", dir.display());
        }
    }
    println!("burn-train's checkpoints and logs: {}", dir.display());
    Ok(())
}
