//! Supervised fine-tuning from a recipe.
//!
//! ```text
//! cargo run --release --example finetune                       # the embedded default (tiny model, bundled sample)
//! cargo run --release --example finetune -- RECIPE.yaml [--section.key=value ...] [--no-resume] [--backend=flex|cuda|vulkan]
//! ```
//!
//! Reads the dataset (MedPix-VQA parquet or JSONL + images), packs it into THD sequences, and
//! trains with [`glm5_burn::train::trainer::Trainer`]: a progress bar (step, loss, tokens/s,
//! ETA), one JSON line of metrics per step in `CHECKPOINT_DIR/metrics.jsonl`, validation loss
//! every `val_every_steps`, checkpoints every `ckpt_every_steps` and at the end, and
//! `CHECKPOINT_DIR/curves.svg` (loss and validation loss; step time and peak memory). A run whose checkpoint directory already holds checkpoints
//! continues from the newest one (data position, optimizer and step included); `--no-resume`
//! refuses to start over such a directory instead of overwriting it. One run per checkpoint
//! directory (an advisory lock on `CHECKPOINT_DIR/.lock`). Resuming on data that differ from
//! the checkpoint's (dataset files, split, packing, batch sizes, seed) is refused, listing what
//! changed; `--reset-data-position` continues from the checkpoint's step with the new data from
//! its first pack instead.
//!
//! Data parallelism (`distributed.dp_size = N`, built with `--features mpi`):
//! `mpirun -np N target/release/examples/finetune RECIPE --distributed.dp_size=N`. Every rank
//! runs `1/N` of each global batch's micro-batches and holds `1/N` of every trainable
//! parameter, its gradient and its AdamW moments (FSDP; `distributed.shard_parameters=false`
//! replicates them instead); gradients, losses and counts are summed over the ranks
//! (`glm5_burn::train::data_parallel`), so the run follows the single-process one. Rank 0 alone
//! prints, writes metrics and plots; every rank writes its part of a checkpoint.

mod plot;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::backend::autodiff::checkpoint::strategy::{BalancedCheckpointing, NoCheckpointing};
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use clap::{CommandFactory, FromArgMatches, Parser};
use glm5_burn::checkpoint::{load_causal_lm, CheckpointConfig};
use glm5_burn::data::batch::MicroBatch;
use glm5_burn::data::chat::ChatFormat;
use glm5_burn::data::fingerprint::DataFingerprint;
use glm5_burn::data::image_processor::ImageProcessor;
use glm5_burn::data::loader::{PackedDataset, PackingOptions, Sampler};
use glm5_burn::distributed::typed::all_gather;
use glm5_burn::distributed::{DistError, Distributed, Group, Mesh, MeshSizes};
use glm5_burn::ops::OpImpl;
use glm5_burn::train::checkpoint as ckpt;
use glm5_burn::train::params::trainable_counts;
use glm5_burn::train::recipe::{split_overrides, PathKind, Recipe};
use glm5_burn::train::resume::{resume_run, ResumeOptions, RunData};
use glm5_burn::train::trainer::{DataPosition, StepOutcome, TrainOptions, Trainer};
use glm5_burn::{Glm5Backend, Glm5ForCausalLM};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use std::sync::Arc;

/// Supervised fine-tuning from a recipe (no recipe: the embedded tiny MedPix default).
#[derive(Parser, Debug)]
#[command(
    name = "finetune",
    override_usage = "finetune [RECIPE.yaml] [--section.key=value ...] [OPTIONS]",
    after_help = "Recipe overrides: --section.key=value, any key of the recipe (the README's recipe key table; \
                  `finetune --help` lists them with the embedded default's values)."
)]
struct Args {
    /// Recipe file (YAML); without one, the embedded `configs/tiny_medpix.yaml`.
    recipe: Option<PathBuf>,
    /// Refuse to start over a checkpoint directory that already holds checkpoints (instead of
    /// resuming from the newest).
    #[arg(long)]
    no_resume: bool,
    /// Resume a checkpoint on changed data, from the first pack of the new data.
    #[arg(long)]
    reset_data_position: bool,
    /// On resume, follow the recipe's learning-rate schedule when it differs from the run's
    /// (e.g. after changing step_scheduler.max_steps); by default the run's schedule is kept.
    #[arg(long)]
    new_schedule: bool,
    /// Compute backend (cuda and vulkan need the cargo feature of that name).
    #[arg(long, default_value = "flex", value_parser = ["flex", "cuda", "vulkan"])]
    backend: String,
    /// `--section.key=value` recipe overrides, in order (split off before clap parses).
    #[arg(skip)]
    overrides: Vec<String>,
}

fn parse_args() -> Args {
    let (overrides, rest) = split_overrides(std::env::args().skip(1));
    let keys = Recipe::embedded_default(&[]).map(|r| r.override_keys()).unwrap_or_default();
    let cmd = Args::command().after_long_help(format!(
        "Recipe overrides (--section.key=value; YAML values: 5, true, 1e-5, [0.9, 0.95], null), with the embedded default's values:\n{keys}"
    ));
    let matches = cmd.get_matches_from(std::iter::once("finetune".to_string()).chain(rest));
    let mut args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    args.overrides = overrides;
    args
}

/// An error that another rank printed (or that every rank reached alike and rank 0 printed):
/// this process exits with status 1 without repeating it.
#[derive(Debug)]
struct ReportedByAnotherRank;

impl std::fmt::Display for ReportedByAnotherRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped: the error is reported by another rank")
    }
}

impl std::error::Error for ReportedByAnotherRank {}

/// Errors reach the user once: a refusal every rank reaches alike (arguments, recipe, mesh)
/// is printed by rank 0 alone, and a failure the ranks agreed on by the rank that had it; the
/// process then exits with status 1 — no MPI abort, so no launcher noise on top.
fn main() -> std::process::ExitCode {
    match real_main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            if !e.is::<ReportedByAnotherRank>() && glm5_burn::distributed::mesh::launcher_rank() == 0 {
                eprintln!("Error: {e:?}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// The ranks agree on a setup step that may fail on some of them (a locked directory, a
/// dataset one node cannot read): the lowest failing rank prints its error, and every rank
/// then stops with [`ReportedByAnotherRank`] instead of one of them waiting in a collective
/// the others never join.
fn agree<T>(group: Option<&Group>, result: Result<T>) -> Result<T> {
    let Some(g) = group.filter(|g| g.size() > 1) else { return result };
    let failed = all_gather(&**g, &[u64::from(result.is_err())])?;
    let Some(first) = failed.iter().position(|&f| f != 0) else { return result };
    if let Err(e) = &result {
        if g.rank() == first {
            let others: Vec<usize> = failed.iter().enumerate().filter(|(r, &f)| f != 0 && *r != first).map(|(r, _)| r).collect();
            let also = if others.is_empty() { String::new() } else { format!(" (ranks {others:?} failed too)") };
            eprintln!("Error on rank {first} of {}{also}: {e:?}", g.size());
        }
    }
    Err(ReportedByAnotherRank.into())
}

fn real_main() -> Result<()> {
    glm5_burn::train::alloc::keep_freed_memory();
    let args = parse_args();
    let recipe = match &args.recipe {
        Some(p) => Recipe::from_file(p, &args.overrides)?,
        None => Recipe::embedded_default(&args.overrides)?,
    };
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!(
        "recipe: {}  ({threads} threads)",
        args.recipe.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| "embedded tiny_medpix".into())
    );
    // Burn 0.21 fixes the checkpointing strategy in the autodiff type: one monomorphisation
    // each; the distributed decorator runs the collectives (one process: it is `$b` itself)
    macro_rules! dispatch {
        ($b:ty) => {
            if recipe.distributed.activation_checkpointing {
                run::<Autodiff<Distributed<$b>, BalancedCheckpointing>>(&recipe, &args)
            } else {
                run::<Autodiff<Distributed<$b>, NoCheckpointing>>(&recipe, &args)
            }
        };
    }
    match args.backend.as_str() {
        "flex" => dispatch!(Flex),
        #[cfg(feature = "cuda")]
        "cuda" => dispatch!(burn::backend::Cuda),
        #[cfg(feature = "vulkan")]
        "vulkan" => dispatch!(burn::backend::Vulkan),
        other => bail!(
            "--backend={other}: not available in this build (flex{}{})",
            if cfg!(feature = "cuda") { ", cuda" } else { "" },
            if cfg!(feature = "vulkan") { ", vulkan" } else { "" }
        ),
    }
}

fn packing_options(recipe: &Recipe) -> PackingOptions {
    PackingOptions {
        max_length: recipe.packed_sequence.packed_sequence_size,
        drop_long_samples: recipe.packed_sequence.drop_long_samples,
        seed: recipe.rng.seed,
    }
}

fn build_dataset(s: &glm5_burn::data::DatasetSource, recipe: &Recipe, chat: &ChatFormat, image_token: i64, label: &str) -> Result<PackedDataset> {
    let packing = packing_options(recipe);
    let ds = PackedDataset::build(s, chat, ImageProcessor::default(), image_token, &packing).with_context(|| format!("{label} dataset"))?;
    let r = &ds.read_report;
    println!(
        "{label}: {} records usable of {} read ({} skipped{}), {} packs of ≤{} tokens ({} tokens, fill {:.0}%, {} too long dropped, {} truncated)",
        r.usable,
        r.read,
        r.skipped_total(),
        if r.skipped.is_empty() {
            String::new()
        } else {
            format!(": {}", r.skipped.iter().map(|(k, v)| format!("{v}× {k}")).collect::<Vec<_>>().join(", "))
        },
        ds.packs.len(),
        recipe.packed_sequence.packed_sequence_size,
        ds.tokens(),
        100.0 * ds.pack_report.fill,
        ds.pack_report.dropped_long,
        ds.pack_report.truncated,
    );
    for e in r.examples.iter().take(3) {
        println!("  skipped {e}");
    }
    Ok(ds)
}

/// A log line above the progress bar, or on stdout when there is no terminal to draw it on
/// (indicatif drops `println` on a hidden bar).
fn say(bar: &ProgressBar, msg: String) {
    if bar.is_hidden() {
        println!("{msg}");
    } else {
        bar.println(msg);
    }
}

/// A memory figure of this process from `/proc/self/status` (Linux), MB: `VmHWM` is the peak
/// resident set, `VmRSS` the current one.
fn status_mb(key: &str) -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn peak_rss_mb() -> Option<f64> {
    status_mb("VmHWM:")
}

/// Keep the metrics lines up to `step` (a resumed run recomputes the later ones).
fn truncate_metrics(path: &Path, step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: Vec<&str> =
        text.lines().filter(|l| serde_json::from_str::<Value>(l).ok().and_then(|v| v["step"].as_u64()).is_some_and(|s| s as usize <= step)).collect();
    let tmp = path.with_extension("jsonl.partial");
    std::fs::write(&tmp, kept.iter().map(|l| format!("{l}\n")).collect::<String>()).with_context(|| tmp.display().to_string())?;
    std::fs::rename(&tmp, path).with_context(|| path.display().to_string())?;
    Ok(())
}

/// The mesh of this run ([`Mesh::from_env`]): one process, or under `mpirun` the world, which
/// must hold exactly `distributed.dp_size × distributed.cp_size` processes running the same
/// recipe (a hash of it agreed on). The library reports a refusal every rank reaches alike once.
fn run_mesh(recipe: &Recipe) -> Result<Arc<Mesh>> {
    let d = &recipe.distributed;
    let reported = |e: DistError| -> anyhow::Error {
        match e {
            DistError::Mesh { reported: true, .. } => ReportedByAnotherRank.into(),
            e => e.into(),
        }
    };
    let mesh = Mesh::from_env(Some(MeshSizes { dp: d.dp_size, cp: d.cp_size, ep: d.ep_size })).map_err(reported)?;
    if mesh.size() > 1 && std::env::var("GLM5_CHECK_COLLECTIVES").is_ok_and(|v| v == "1") {
        println!("collectives: checked across ranks (GLM5_CHECK_COLLECTIVES=1)");
    }
    // every rank must run the same recipe (batch sizes, seed, data)
    mesh.agree("recipe", recipe.digest(), "give every rank the same recipe and overrides").map_err(reported)?;
    Ok(Arc::new(mesh))
}

fn run<B: AutodiffBackend + Glm5Backend>(recipe: &Recipe, args: &Args) -> Result<()>
where
    B::InnerBackend: Glm5Backend,
{
    let mesh = run_mesh(recipe)?;
    let group = mesh.data_parallel().cloned();
    match train::<B>(recipe, args, &mesh) {
        Err(e) if e.is::<ReportedByAnotherRank>() => Err(e),
        // the other ranks may be waiting in a collective this rank will not join: end the job
        Err(e) if group.as_ref().is_some_and(|g| g.size() > 1) => {
            let g = group.expect("checked above");
            eprintln!("Error on rank {} of {}: {e:?}", g.rank(), g.size());
            g.abort(1)
        }
        r => r,
    }
}

fn train<B: AutodiffBackend + Glm5Backend>(recipe: &Recipe, args: &Args, mesh: &Arc<Mesh>) -> Result<()>
where
    B::InnerBackend: Glm5Backend,
{
    let group = mesh.data_parallel().cloned();
    let (rank, ranks) = (mesh.rank(), mesh.size());
    glm5_burn::distributed::quiet_unless_rank_zero(rank);
    // the ranks of a context-parallel group (cp consecutive ranks) share micro-batches
    let cp = mesh.sizes().cp;
    let (dp_rank, dp_ranks) = mesh.data_shard();
    if dp_ranks > 1 {
        println!("data parallel: {dp_ranks} ranks (MPI), each runs 1/{dp_ranks} of every global batch");
    }
    if cp > 1 {
        println!("context parallel: cp_size {cp}, each packed row split into {cp} contiguous shards of its ranks");
    }
    let ep = recipe.distributed.ep_size;
    if ep > 1 {
        println!(
            "expert parallel: ep_size {ep}, each rank holds 1/{ep} of the routed experts; experts' gradients summed over the {} ranks holding the same ones",
            ranks / ep
        );
    }
    // one GPU per rank of a node where the backend has several (the default device otherwise)
    let device: B::Device = if ranks > 1 { glm5_burn::distributed::local_device::<B>() } else { Default::default() };
    let seed = recipe.rng.seed;
    B::seed(&device, seed);
    let path = |kind: PathKind, runs: OpImpl| match (kind, runs) {
        (PathKind::Reference, _) => "reference tensor ops (recipe)",
        (PathKind::Op, OpImpl::Reference) => "reference tensor ops (nothing more on this backend)",
        (PathKind::Op, runs) => runs.describe(),
    };
    let be = &recipe.model.backend;
    println!(
        "paths: KDA scan {}, KDA pair terms {}, KPool indexer {}, sparse attention {}",
        path(be.kda, B::kda_scan_impl()),
        path(be.kda, B::kda_pairs_impl()),
        path(be.attn, B::kpool_impl()),
        path(be.attn, B::sparse_attention_impl())
    );

    // the setup each rank does alone, up to the run lock; the ranks agree on it before the
    // first collective of the model
    let setup = (|| -> Result<_> {
        // where checkpoints and metrics go, before any data or model is read
        glm5_burn::io::check_output_dir("checkpoint.checkpoint_dir", &recipe.checkpoint.checkpoint_dir, &[])?;
        // model description and tokenizer
        let checkpoint_config = match (&recipe.model.checkpoint, &recipe.model.config) {
            (Some(dir), _) => glm5_burn::checkpoint::read_config(dir)?,
            (None, Some(path)) => CheckpointConfig::read_file(path).context("model.config")?,
            (None, None) => bail!("the recipe names neither model.checkpoint nor model.config"),
        };
        let config = checkpoint_config.resolved.clone();
        let tok_dir = recipe.model.tokenizer.clone().or_else(|| recipe.model.checkpoint.clone()).context("model.tokenizer")?;
        let chat = ChatFormat::from_dir(&tok_dir)?;
        let extra_files: Vec<PathBuf> =
            ["tokenizer.json", "chat_template.jinja", "tokenizer_config.json"].iter().map(|f| tok_dir.join(f)).filter(|p| p.is_file()).collect();

        let train = build_dataset(&recipe.dataset, recipe, &chat, config.image_token_id, "train")?;
        let val = match &recipe.validation_dataset {
            Some(v) => Some(build_dataset(v, recipe, &chat, config.image_token_id, "validation")?),
            None => None,
        };

        let root = recipe.checkpoint.checkpoint_dir.clone();
        // one run per directory, before anything in it is read or written
        let lock = if rank == 0 { Some(ckpt::RunLock::acquire(&root)?) } else { None };
        Ok((config, checkpoint_config, chat, extra_files, train, val, root, lock))
    })();
    let (config, checkpoint_config, chat, extra_files, train, val, root, _lock) = agree(group.as_ref(), setup)?;
    let fingerprint = DataFingerprint::of(
        &train,
        &recipe.dataset,
        &packing_options(recipe),
        recipe.step_scheduler.global_batch_size,
        recipe.step_scheduler.local_batch_size,
    );
    let mut options = TrainOptions::from_recipe(recipe);
    options.parallel = options.parallel.on_mesh(mesh)?;
    let data = RunData { fingerprint: &fingerprint, packs: train.packs.len(), seed };
    let how = ResumeOptions { vision: true, reset_data_position: args.reset_data_position, new_schedule: args.new_schedule };
    let latest = if recipe.checkpoint.enabled { ckpt::latest(&root) } else { None };
    let (mut trainer, mut sampler) = match latest {
        Some(_) if !args.no_resume => {
            let resumed = resume_run::<B>(&root, &options, &data, how, &device)?.context("the checkpoints vanished while resuming")?;
            for note in &resumed.notes {
                println!("{note}");
            }
            if rank == 0 {
                truncate_metrics(&root.join("metrics.jsonl"), resumed.state.step)?;
            }
            (resumed.trainer, resumed.sampler)
        }
        Some(dir) => {
            bail!("{} holds checkpoints (newest {}); with --no-resume pick an empty checkpoint.checkpoint_dir", root.display(), dir.display())
        }
        None => {
            let model: Glm5ForCausalLM<B> = match &recipe.model.checkpoint {
                // a rank reads only its FSDP slices and its experts (seeded weights: every
                // rank builds the same whole model and keeps its part)
                Some(dir) => {
                    let load = options.base_load_options(true);
                    let loaded = load_causal_lm::<B>(dir, &device, &load)?;
                    if load.row_shards.is_some() || load.experts.is_some() {
                        println!("loaded this rank's part of {}: {:.1} MB read", dir.display(), loaded.bytes_read as f64 / 1e6);
                    }
                    loaded.model
                }
                None => Glm5ForCausalLM::<B>::try_new_with_vision(&config, None, &device)?,
            };
            if rank == 0 && root.join("metrics.jsonl").exists() {
                truncate_metrics(&root.join("metrics.jsonl"), 0)?;
            }
            // the seeded draws (a seeded base's weights, LoRA's adapters) start from the
            // recipe's seed whatever loading the base consumed
            B::seed(&device, seed);
            let mut t = Trainer::try_new(model, options)?;
            t.data_fingerprint = Some(fingerprint.clone());
            (t, Sampler::new(train.packs.len(), seed))
        }
    };
    if let Some(mb) = peak_rss_mb() {
        // the model built (loaded or resumed) and sharded, before the first step
        println!("peak RSS after building the model: {mb:.0} MB");
    }
    let (trainable, frozen) = trainable_counts(trainer.model());
    let dense_sharded = trainer.is_sharded() && recipe.distributed.shard_parameters;
    let held = match (dense_sharded, ep > 1) {
        (true, false) => format!(" (this rank's 1/{ranks} shard of them)"),
        (true, true) => format!(" (this rank's part: 1/{ranks} of the dense parameters, 1/{ep} of the routed experts)"),
        (false, true) => format!(" (this rank's part: the dense parameters whole, 1/{ep} of the routed experts)"),
        (false, false) => String::new(),
    };
    println!("parameters: {:.2} M trainable{held}, {:.2} M frozen", trainable as f64 / 1e6, frozen as f64 / 1e6);
    let [projections, experts] = trainer.model().language_model.fp8_base_bytes();
    if projections[1] + experts[1] > 0 {
        let mb = |b: usize| b as f64 / 1e6;
        println!(
            "FP8 base: this rank holds {:.3} MB of {:.3} MB (projections {:.3} of {:.3} MB, routed experts {:.3} of {:.3} MB)",
            mb(projections[0] + experts[0]),
            mb(projections[1] + experts[1]),
            mb(projections[0]),
            mb(projections[1]),
            mb(experts[0]),
            mb(experts[1])
        );
    }
    std::fs::create_dir_all(&root).with_context(|| root.display().to_string())?;
    let metrics_path = root.join("metrics.jsonl");
    let mut metrics = if rank == 0 {
        Some(std::fs::OpenOptions::new().create(true).append(true).open(&metrics_path).with_context(|| metrics_path.display().to_string())?)
    } else {
        None
    };

    let s = &recipe.step_scheduler;
    let accum = recipe.accumulation_steps();
    let bar = if rank == 0 { ProgressBar::new(s.max_steps as u64) } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]").expect("valid template"));
    bar.set_position(trainer.step as u64);

    let validate = |trainer: &Trainer<B>| -> Result<Option<f64>> {
        let Some(v) = &val else { return Ok(None) };
        let local = s.local_batch_size;
        // this rank's share: every `ranks`-th batch (Trainer::evaluate sums over the ranks)
        let packs: Vec<usize> = (0..v.packs.len()).collect();
        let batches: Vec<MicroBatch> =
            packs.chunks(local).enumerate().filter(|(j, _)| j % dp_ranks == dp_rank).map(|(_, c)| v.micro_batch(c)).collect::<Result<_, _>>()?;
        Ok(Some(trainer.evaluate(&batches)?.0))
    };

    // greedy answers to the validation questions, exact match (rank 0, unsharded models)
    let answer_limit = s.val_answer_max_new_tokens.filter(|&n| n > 0);
    let eos_ids: Vec<i64> = {
        let mut ids = glm5_burn::generate::config_eos_ids(&checkpoint_config.json);
        // the chat format's turn end stops an answer too
        ids.extend(["<|user|>", "<|endoftext|>"].iter().filter_map(|t| chat.tokenizer.token_to_id(t)).map(|x| x as i64));
        ids
    };
    let answer = |trainer: &Trainer<B>| -> Result<Option<glm5_burn::generate::eval::AnswerAccuracy>> {
        let (Some(v), Some(max_new)) = (&val, answer_limit) else { return Ok(None) };
        if rank != 0 {
            return Ok(None);
        }
        if trainer.is_sharded() {
            // answering needs every parameter on one rank; the loss is still validated
            return Ok(None);
        }
        let records = &v.records[..s.val_answer_samples.unwrap_or(usize::MAX).min(v.records.len())];
        let model = burn::module::AutodiffModule::valid(trainer.model());
        let opts = glm5_burn::generate::GenerateOptions {
            max_new_tokens: max_new,
            sampling: glm5_burn::generate::SamplingConfig::default(),
            eos_token_ids: eos_ids.clone(),
            pad_token_id: eos_ids.first().copied().unwrap_or(0),
            max_positions: config.text_config.max_position_embeddings,
        };
        let acc = glm5_burn::generate::eval::answer_accuracy(&model, &chat, &ImageProcessor::default(), records, &opts, &trainer.options.forward)?;
        Ok(Some(acc))
    };
    let record_validation = |trainer: &Trainer<B>, line: &mut Value, bar: &ProgressBar| -> Result<()> {
        let step = trainer.step;
        if let Some(v) = validate(trainer)? {
            line["val_loss"] = json!(v);
            say(bar, format!("step {step}: validation loss {v:.4}"));
        }
        if let Some(acc) = answer(trainer)? {
            line["val_accuracy"] = json!(acc.accuracy());
            line["val_answered"] = json!(acc.answers.len());
            let shown: Vec<String> = acc.answers.iter().take(2).map(|a| format!("{:?} (reference {:?})", a.prediction, a.reference)).collect();
            say(bar, format!("step {step}: validation exact match {}/{} — e.g. {}", acc.correct, acc.answers.len(), shown.join(", ")));
        }
        Ok(())
    };

    if answer_limit.is_some() && val.is_some() && trainer.is_sharded() && rank == 0 {
        println!(
            "step_scheduler.val_answer_max_new_tokens: no answer accuracy in this run (answering needs an unsharded model; validation loss only)"
        );
    }
    let started = trainer.step;
    // a fresh run validates its starting point (step 0) once
    if started == 0 && val.is_some() && s.max_steps > 0 {
        let mut line = json!({ "step": 0 });
        record_validation(&trainer, &mut line, &bar)?;
        if let Some(metrics) = metrics.as_mut() {
            writeln!(metrics, "{line}").and_then(|_| metrics.flush()).with_context(|| metrics_path.display().to_string())?;
        }
    }
    if started >= s.max_steps {
        println!(
            "{} already holds step {started} of step_scheduler.max_steps {}: nothing to train \
             (raise --step_scheduler.max_steps to continue — the run keeps its learning-rate schedule unless --new-schedule — \
             or pick another --checkpoint.checkpoint_dir)",
            root.display(),
            s.max_steps
        );
    }
    while trainer.step < s.max_steps {
        let t0 = Instant::now();
        // every rank draws the whole global batch in the same order and runs its share of it
        let mut micro = Vec::with_capacity(accum / dp_ranks);
        for i in 0..accum {
            let packs = sampler.take(s.local_batch_size);
            if i % dp_ranks == dp_rank {
                micro.push(train.micro_batch(&packs)?);
            }
        }
        let outcome = trainer.step(&micro)?;
        let secs = t0.elapsed().as_secs_f64();
        let step = trainer.step;
        let mut line = json!({"step": step, "epoch": sampler.epoch, "seconds": secs, "peak_rss_mb": peak_rss_mb(), "rss_mb": status_mb("VmRSS:")});
        match outcome {
            StepOutcome::Applied(m) => {
                line["loss"] = json!(m.loss);
                line["grad_norm"] = json!(m.grad_norm);
                line["lr"] = json!(m.lr);
                line["tokens"] = json!(m.tokens);
                line["label_tokens"] = json!(m.label_tokens);
                line["tokens_per_s"] = json!(m.tokens as f64 / secs);
                let msg = format!("loss {:.4}  {:.0} tok/s", m.loss, m.tokens as f64 / secs);
                if bar.is_hidden() {
                    println!("step {step}/{}: {msg}  grad norm {:.3}  lr {:.2e}", s.max_steps, m.grad_norm, m.lr);
                }
                bar.set_message(msg);
            }
            StepOutcome::Skipped { loss, grad_norm, what } => {
                line["skipped"] = json!(format!("non-finite {what}"));
                line["loss"] = json!(loss.to_string());
                line["grad_norm"] = json!(grad_norm.to_string());
                say(&bar, format!("step {step}: non-finite {what}; skipped ({} so far)", trainer.skipped_steps));
            }
        }
        if s.val_every_steps.is_some_and(|k| k > 0 && step % k == 0) || step == s.max_steps {
            record_validation(&trainer, &mut line, &bar)?;
        }
        if let Some(metrics) = metrics.as_mut() {
            writeln!(metrics, "{line}").and_then(|_| metrics.flush()).with_context(|| metrics_path.display().to_string())?;
        }
        bar.set_position(step as u64);
        let ckpt_due = s.ckpt_every_steps.is_some_and(|k| k > 0 && step % k == 0) || step == s.max_steps;
        // a sharded model is saved by every rank (each writes its shard), a replicated one by rank 0
        if recipe.checkpoint.enabled && ckpt_due && (rank == 0 || trainer.is_sharded()) {
            let position = DataPosition { epoch: sampler.epoch, cursor: sampler.cursor, seed };
            let dir = trainer.save_checkpoint(&root, recipe.checkpoint.keep_last, &checkpoint_config, &extra_files, position)?;
            say(&bar, format!("step {step}: checkpoint {}", dir.display()));
        }
    }
    bar.finish();
    if let Some(ep) = glm5_burn::train::data_parallel::expert_parallel_of(trainer.model()) {
        use std::sync::atomic::Ordering::Relaxed;
        let st = &ep.stats;
        let calls = st.calls.load(Relaxed).max(1) as f64;
        let kb = |b: &std::sync::atomic::AtomicU64| b.load(Relaxed) as f64 / calls / 1024.0;
        println!(
            "expert-parallel exchange (rank {rank}): per MoE layer forward {:.1} KB dispatched + {:.1} KB combined to other ranks, {:.0} routed rows \
             (mean over {} layer calls; backward moves as much again)",
            kb(&st.dispatch_bytes),
            kb(&st.combine_bytes),
            st.rows.load(Relaxed) as f64 / calls,
            calls
        );
    }
    if rank != 0 {
        return Ok(());
    }

    // the loss curve of the whole run (resumed runs included), from the metrics file
    let text = std::fs::read_to_string(&metrics_path).with_context(|| metrics_path.display().to_string())?;
    let rows: Vec<Value> = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let train_pts: Vec<(f64, f64)> = rows.iter().filter_map(|r| Some((r["step"].as_f64()?, r["loss"].as_f64()?))).collect();
    let val_pts: Vec<(f64, f64)> = rows.iter().filter_map(|r| Some((r["step"].as_f64()?, r["val_loss"].as_f64()?))).collect();
    let series = |key: &str| -> Vec<(f64, f64)> { rows.iter().filter_map(|r| Some((r["step"].as_f64()?, r[key].as_f64()?))).collect() };
    if !train_pts.is_empty() {
        let png = root.join("curves.svg");
        let curves = plot::Curves {
            train: &train_pts,
            val: &val_pts,
            seconds: &series("seconds"),
            peak_rss_mb: &series("peak_rss_mb"),
            val_accuracy: &series("val_accuracy"),
        };
        plot::curves(&png, &curves).map_err(anyhow::Error::msg)?;
        let first = train_pts.first().map(|p| p.1).unwrap_or(f64::NAN);
        let last = train_pts.last().map(|p| p.1).unwrap_or(f64::NAN);
        println!(
            "run so far: steps 1..{}, loss {first:.4} → {last:.4}{}; metrics {}, curve {}",
            trainer.step,
            val_pts.last().map(|v| format!(", validation {:.4}", v.1)).unwrap_or_default()
                + &series("val_accuracy")
                    .first()
                    .zip(series("val_accuracy").last())
                    .map(|(a, b)| format!(", validation exact match {:.3} (step {}) → {:.3} (step {})", a.1, a.0, b.1, b.0))
                    .unwrap_or_default(),
            metrics_path.display(),
            png.display()
        );
    }
    if let Some(p) = peak_rss_mb() {
        println!("peak RSS {p:.0} MB");
    }
    Ok(())
}
