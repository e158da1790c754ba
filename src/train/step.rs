//! One optimizer step over micro-batches: the cross-entropy of every micro-batch is summed and
//! divided by the label tokens of the whole global batch (NeMo's `MaskedCrossEntropy`), the
//! gradients accumulate over micro-batches, are clipped by their global norm and applied.
//!
//! ```text
//! L = Σ_m Σ_{t ∈ labels(m)} CE_t / N_labels(global batch)  [+ aux_coef · mean_m aux_m]
//! ```
//!
//! The step refuses to apply a non-finite loss or gradient norm: the weights and optimizer
//! state are left as they were and the caller decides (skip and count, or abort).

use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ElementConversion;

use super::clip::{clip_global_norm, global_norm};
use crate::data::batch::MicroBatch;
use crate::distributed::Group;
use crate::input::{ModelInput, Outputs};
use crate::model::{CausalLmOutput, Glm5ForCausalLM};
use crate::ops::backend::Glm5Backend;
use crate::text::context::{ContextShard, ContextSplit};
use crate::text::ForwardOptions;
use crate::text::ModelError;

/// What a micro-batch must satisfy before it reaches the model: a [`TrainError::Batch`]
/// naming the mismatch otherwise.
fn check_batch(batch: &MicroBatch) -> Result<(), TrainError> {
    let n = batch.batch * batch.seq;
    let bad = |m: String| Err(TrainError::Batch(m));
    if batch.ids.len() != n || batch.labels.len() != n {
        return bad(format!("{} ids and {} labels for shape [{}, {}]", batch.ids.len(), batch.labels.len(), batch.batch, batch.seq));
    }
    if let Some(mask) = &batch.mask {
        if mask.len() != n {
            return bad(format!("mask has {} entries for shape [{}, {}]", mask.len(), batch.batch, batch.seq));
        }
    }
    if let Some(d) = &batch.documents {
        if batch.batch != 1 || d.iter().sum::<usize>() != batch.seq || d.contains(&0) {
            return bad(format!("documents {d:?} must be positive lengths summing to the one THD row's {} tokens", batch.seq));
        }
    }
    Ok(())
}

/// Training errors.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The forward rejected the batch.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A micro-batch is malformed.
    #[error("micro-batch: {0}")]
    Batch(String),
    /// A non-finite loss or gradient norm (the update was not applied).
    #[error("step {step}: non-finite {what} (loss {loss}, gradient norm {grad_norm}); the update was not applied")]
    NonFinite {
        /// The step.
        step: usize,
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// The loss.
        loss: f64,
        /// The gradient norm.
        grad_norm: f64,
    },
    /// The model inside a training checkpoint could not be written or read.
    #[error("{dir}: {source}")]
    Checkpoint {
        /// The checkpoint's model directory.
        dir: std::path::PathBuf,
        /// The checkpoint error.
        source: crate::checkpoint::CheckpointError,
    },
    /// The checkpoint directory itself (lock, staging, rename, state file).
    #[error(transparent)]
    CheckpointDir(#[from] super::checkpoint::CheckpointDirError),
    /// One file of a training checkpoint beside the model (optimizer state, copied files).
    #[error("{path}: {message}")]
    CheckpointFile {
        /// The file.
        path: std::path::PathBuf,
        /// What failed.
        message: String,
    },
    /// A collective of the data-parallel group failed.
    #[error(transparent)]
    Distributed(#[from] crate::distributed::DistError),
    /// The recipe's `peft` adapters do not fit the model (unknown target, rank).
    #[error("peft: {0}")]
    Lora(Box<crate::text::lora::LoraError>),
    /// A combination of options this version does not support.
    #[error("not supported: {what}")]
    Unsupported {
        /// What was asked for.
        what: &'static str,
    },
    /// Saving a checkpoint failed.
    #[error("saving step {step}: {source}")]
    Saving {
        /// The step being saved.
        step: usize,
        /// What failed.
        source: Box<TrainError>,
    },
}

/// What a step did.
#[derive(Debug, Clone, Copy)]
pub struct StepMetrics {
    /// Mean cross-entropy over the global batch's label tokens (plus the weighted aux loss).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Tokens that carried a label.
    pub label_tokens: usize,
    /// Tokens processed (all micro-batches, padding excluded).
    pub tokens: usize,
}

/// One micro-batch's forward with what its loss needs.
pub struct MicroOutput<B: Glm5Backend> {
    /// The model's output (this rank's shard of the row under context parallelism).
    pub output: CausalLmOutput<B>,
    /// Next-token target of every position of the output (−100: none): the labels shifted by
    /// one, over the whole row before a context-parallel split, so no label is lost at a
    /// shard edge.
    pub targets: Vec<i64>,
    /// Validity of every position of the output (padding false).
    pub valid: Vec<bool>,
    /// The context-parallel shard it ran as (its chain orders the forward's collectives).
    pub shard: Option<ContextShard<B>>,
}

/// Forward one micro-batch (text or multimodal, padded or packed). Under context parallelism
/// (`context`: the group, whose ranks all pass the same micro-batch) it runs as this rank's
/// shard of its packed row (`B = 1`): a row whose length `cp_size` does not divide is padded
/// at its end with a document of its own (no label, marked invalid, so it changes no loss,
/// gradient or router statistic — NeMo pads packed rows to a multiple of the CP size
/// likewise).
pub fn forward_micro<B: Glm5Backend>(
    model: &Glm5ForCausalLM<B>,
    m: &MicroBatch,
    opts: &ForwardOptions,
    context: Option<&Group>,
) -> Result<MicroOutput<B>, TrainError> {
    let Some(group) = context else {
        check_batch(m)?;
        let output = model.forward(m.input(), opts, Outputs::default())?;
        let targets = crate::loss::shifted_targets(&m.labels, m.batch, m.seq);
        let valid = m.mask.clone().unwrap_or_else(|| vec![true; m.batch * m.seq]);
        return Ok(MicroOutput { output, targets, valid, shard: None });
    };
    check_batch(m)?;
    if m.batch != 1 || m.mask.as_ref().is_some_and(|mk| mk.iter().any(|&v| !v)) {
        return Err(TrainError::Batch(format!(
            "context parallelism splits one packed row: this micro-batch has {} rows{} (use packed sequences)",
            m.batch,
            if m.mask.is_some() { " with padding" } else { "" }
        )));
    }
    let keep = model.conv_window();
    let p = group.size();
    let pad = (p - m.seq % p) % p;
    let seq = m.seq + pad;
    if seq / p < keep {
        return Err(TrainError::Batch(format!(
            "a packed row of {} tokens gives shards of {} tokens under cp_size {p}: each must hold the short conv's {keep} earlier inputs",
            m.seq,
            seq / p
        )));
    }
    let (mut ids, mut labels) = (m.ids.clone(), m.labels.clone());
    ids.resize(seq, 0);
    labels.resize(seq, -100);
    let mut lengths = m.documents.clone().unwrap_or_else(|| vec![m.seq]);
    lengths.push(pad);
    let split = ContextSplit::new(group.rank(), p, crate::text::document_ranges(&lengths), seq)?;
    let shard = split.shard.clone();
    let input = ModelInput::row(ids).with_images(m.images.clone()).with_context(split);
    let mut output = model.forward(input, opts, Outputs::default())?;
    let ctx = output.text.context.take();
    let targets = crate::loss::shifted_targets(&labels, 1, seq)[shard.clone()].to_vec();
    let valid = shard.map(|t| t < m.seq).collect();
    Ok(MicroOutput { output, targets, valid, shard: ctx })
}

/// A summed loss and the label tokens it covers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossSum {
    /// Summed cross-entropy.
    pub sum: f64,
    /// Label tokens summed over.
    pub label_tokens: usize,
}

/// Summed cross-entropy and label tokens of one micro-batch (of this rank's shard under
/// context parallelism), for validation: run it on a plain backend (`model.valid()` of a
/// training model), not on `Autodiff`. On `Autodiff`, a forward that no backward consumes
/// keeps its whole graph — the saved activations included — alive in Burn 0.21's autodiff
/// state for as long as the parameters live (`tests/long_run.rs`).
pub fn micro_loss_sum<B: Glm5Backend>(
    model: &Glm5ForCausalLM<B>,
    m: &MicroBatch,
    opts: &ForwardOptions,
    context: Option<&Group>,
) -> Result<LossSum, TrainError> {
    let out = forward_micro(model, m, opts, context)?;
    let (sum, label_tokens) = crate::loss::target_loss_sum(out.output.logits, &out.targets);
    Ok(LossSum { sum: sum.into_scalar().elem::<f64>(), label_tokens })
}

/// Gradients of one global batch, before clipping.
pub struct Accumulated {
    /// Summed gradients.
    pub grads: GradientsParams,
    /// Loss summed over micro-batches (normalised per label token).
    pub loss: f64,
    /// Label tokens of the global batch.
    pub label_tokens: usize,
    /// Tokens processed, padding excluded.
    pub tokens: usize,
    /// Router logits `[N, E]` (host, row-major) of every MoE layer, per micro-batch, with
    /// the validity of each row — for the router bias update.
    pub router_logits: Vec<(Vec<Vec<f32>>, Vec<bool>)>,
}

/// What a global batch's loss is normalised by, over every data-parallel rank: its label
/// tokens (the cross-entropy is their mean) and its micro-batches (the load-balancing loss is
/// their mean).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalBatch {
    /// Label tokens of the whole global batch.
    pub label_tokens: usize,
    /// Micro-batches of the whole global batch.
    pub micro_batches: usize,
}

impl GlobalBatch {
    /// The batch of one process: these micro-batches are all of it.
    pub fn local(micro: &[MicroBatch], vocab: usize) -> Self {
        GlobalBatch { label_tokens: micro.iter().map(|m| m.label_tokens(vocab)).sum(), micro_batches: micro.len() }
    }
}

/// How a step's micro-batches form its loss, and where they run.
#[derive(Debug, Clone)]
pub struct StepContext {
    /// The global batch this rank's micro-batches are a share of (data parallelism: each
    /// rank's loss is normalised by the whole batch, so the sum of the ranks' gradients is the
    /// gradient of the global batch).
    pub global: GlobalBatch,
    /// Weight of the router load-balancing loss (0: off).
    pub aux_coef: f64,
    /// Forward paths.
    pub forward: ForwardOptions,
    /// Bring the router logits back to the host (for the router bias update).
    pub keep_router_logits: bool,
    /// Context parallelism: the group whose ranks all pass the same micro-batches, each
    /// running its shard of every packed row ([`forward_micro`]); the shards' gradients summed
    /// over the group are the row's (the load-balancing loss from the row's router
    /// statistics, [`Glm5ForCausalLM::aux_loss_context`]).
    pub context: Option<Group>,
}

impl StepContext {
    /// One process whose micro-batches `micro` are the whole global batch.
    pub fn local(micro: &[MicroBatch], vocab: usize, aux_coef: f64, forward: ForwardOptions) -> Self {
        Self { global: GlobalBatch::local(micro, vocab), aux_coef, forward, keep_router_logits: false, context: None }
    }
}

/// Forward/backward every micro-batch, accumulating gradients of the globally normalised loss.
pub fn accumulate<B: AutodiffBackend + Glm5Backend>(
    model: &Glm5ForCausalLM<B>,
    micro: &[MicroBatch],
    step: &StepContext,
) -> Result<Accumulated, TrainError> {
    let StepContext { global, aux_coef, keep_router_logits, .. } = *step;
    let total = global.label_tokens;
    let mut acc = GradientsAccumulator::<Glm5ForCausalLM<B>>::new();
    let mut loss_value = 0.0;
    let mut tokens = 0;
    let mut router_logits = Vec::new();
    for m in micro {
        let MicroOutput { output: out, targets, valid, shard } = forward_micro(model, m, &step.forward, step.context.as_ref())?;
        let (sum, _) = crate::loss::target_loss_sum(out.logits.clone(), &targets);
        tokens += valid.iter().filter(|&&v| v).count();
        let mut loss = sum / total.max(1) as f64;
        if aux_coef != 0.0 {
            let aux = match &shard {
                Some(shard) => model.aux_loss_context(&out.text.router_logits, &valid, shard)?,
                None => model.aux_loss(&out.text.router_logits, &valid),
            };
            if let Some(aux) = aux {
                loss = loss + aux * (aux_coef / global.micro_batches.max(1) as f64);
            }
        }
        if keep_router_logits {
            let host = out.text.router_logits.iter().map(|l| l.clone().detach().into_data().convert::<f32>().into_vec::<f32>());
            let host = host.collect::<Result<Vec<_>, _>>().map_err(|e| TrainError::Batch(format!("router logits: {e:?}")))?;
            router_logits.push((host, valid.clone()));
        }
        loss_value += loss.clone().into_scalar().elem::<f64>();
        let backward = crate::profile::scope("backward");
        let grads = GradientsParams::from_grads(loss.backward(), model);
        drop(backward);
        acc.accumulate(model, grads);
    }
    Ok(Accumulated { grads: acc.grads(), loss: loss_value, label_tokens: total, tokens, router_logits })
}

/// One optimizer step's settings for [`train_step`].
#[derive(Debug, Clone, Copy)]
pub struct StepSettings {
    /// Learning rate.
    pub lr: f64,
    /// Global gradient-norm clip (`None`: off).
    pub max_grad_norm: Option<f64>,
    /// Weight of the router load-balancing loss (0: off).
    pub aux_coef: f64,
    /// Forward paths.
    pub forward: ForwardOptions,
}

/// Forward/backward every micro-batch, then one optimizer step (the low-level form of
/// [`super::trainer::Trainer::step`], for a caller's own optimizer). On a non-finite loss or
/// gradient norm the model comes back unchanged with [`TrainError::NonFinite`].
pub fn train_step<B: AutodiffBackend + Glm5Backend, O: Optimizer<Glm5ForCausalLM<B>, B>>(
    model: Glm5ForCausalLM<B>,
    optim: &mut O,
    micro: &[MicroBatch],
    settings: &StepSettings,
) -> (Glm5ForCausalLM<B>, Result<StepMetrics, TrainError>) {
    let StepSettings { lr, max_grad_norm, aux_coef, forward } = *settings;
    let acc = match accumulate(&model, micro, &StepContext::local(micro, model.vocab_size, aux_coef, forward)) {
        Ok(a) => a,
        Err(e) => return (model, Err(e)),
    };
    let mut grads = acc.grads;
    let grad_norm = match max_grad_norm {
        Some(max) => clip_global_norm::<B, _>(&model, &mut grads, max),
        None => global_norm::<B, _>(&model, &grads),
    };
    if let Some(what) = non_finite(acc.loss, grad_norm) {
        return (model, Err(TrainError::NonFinite { step: 0, what, loss: acc.loss, grad_norm }));
    }
    let model = optim.step(lr, model, grads);
    (model, Ok(StepMetrics { loss: acc.loss, grad_norm, lr, label_tokens: acc.label_tokens, tokens: acc.tokens }))
}

/// Which of loss / gradient is not finite, if any.
pub(crate) fn non_finite(loss: f64, grad_norm: f64) -> Option<&'static str> {
    if !loss.is_finite() {
        Some("loss")
    } else if !grad_norm.is_finite() {
        Some("gradient")
    } else {
        None
    }
}
