//! The model in burn-train's `Learner` (cargo feature `learner`): [`TrainStep`] and
//! [`InferenceStep`] for [`Glm5ForCausalLM`] on [`LmItem`]s — one micro-batch of our data
//! pipeline (packed THD rows with document boundaries, labels, images) together with the size
//! of the global batch it belongs to — and [`LmLoader`], a burn `DataLoader` over such items.
//!
//! ```text
//! item m of global batch g:  L_m = Σ_{t ∈ labels(m)} CE_t / N_labels(g)  [+ aux_coef · aux_m / M(g)]
//! Learner with grads_accumulation(M): Σ_m ∇L_m = ∇ of our Trainer's step loss
//! ```
//!
//! So with `SupervisedTraining::grads_accumulation` equal to the micro-batches per global batch,
//! the gradients Burn's loop accumulates are exactly those of [`super::trainer::Trainer::step`]
//! (NeMo's label-token normalisation across the whole global batch). What the `Learner` path
//! does not do, and why: global-norm clipping and the non-finite skip (Burn's loop applies
//! every accumulated gradient; its `GradientClipping` clips per parameter, not the global
//! norm), bf16 compute copies over fp32 masters (Burn's loop trains the module it is given, in
//! its own precision), the aux-loss-free router-bias update (a step hook Burn's loop lacks)
//! and our resumable checkpoints with data position (Burn's checkpointer saves model, optimizer
//! and scheduler records per epoch). The reported loss is each micro-batch's mean cross-entropy.
//!
//! Data, expert and context parallelism come with the backend: a model on a mesh device
//! (`Autodiff<Distributed<B>>`, [`crate::distributed::MeshDevice`]) prepared by
//! [`ParallelTraining::prepare`] and fed its replica's items
//! ([`LmItem::share_of_global_batches`]) trains as one process would on the whole global
//! batches; each step finds its mesh through the model's device.

use std::sync::Arc;

use burn::data::dataloader::{DataLoader, DataLoaderIterator, Progress};
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::LearningRate;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use burn::train::metric::{Adaptor, LossInput};
use burn::train::{InferenceStep, ItemLazy, TrainOutput, TrainStep};
use burn_flex::Flex;

use super::parallel::ParallelTraining;
use super::schedule::LrSchedule;
use super::step::{forward_micro, GlobalBatch};
use crate::data::batch::MicroBatch;
use crate::distributed::Group;
use crate::model::Glm5ForCausalLM;
use crate::ops::backend::Glm5Backend;
use crate::text::ForwardOptions;

/// One item of the `Learner`'s loader: a micro-batch and what normalises its loss.
#[derive(Debug, Clone)]
pub struct LmItem {
    /// The micro-batch.
    pub micro: MicroBatch,
    /// The global batch it belongs to (label tokens, micro-batches).
    pub global: GlobalBatch,
    /// Weight of the load-balancing loss (recipe `moe.aux_loss_coef`; 0: off).
    pub aux_coef: f64,
    /// Forward paths.
    pub forward: ForwardOptions,
}

impl LmItem {
    /// The items of global batches: each inner list is one global batch's micro-batches, in
    /// order (`SupervisedTraining::grads_accumulation` must equal its length).
    pub fn from_global_batches(batches: Vec<Vec<MicroBatch>>, vocab: usize, aux_coef: f64, forward: &ForwardOptions) -> Vec<Self> {
        Self::share_of_global_batches(batches, vocab, aux_coef, forward, (0, 1))
    }

    /// [`Self::from_global_batches`] for data-parallel replica `share.0` of `share.1`
    /// ([`crate::distributed::Mesh::data_shard`]): every `share.1`-th micro-batch of each global
    /// batch from the replica's on (finetune's split), each normalised by the whole global
    /// batch (`SupervisedTraining::grads_accumulation` is then its share's length).
    pub fn share_of_global_batches(
        batches: Vec<Vec<MicroBatch>>,
        vocab: usize,
        aux_coef: f64,
        forward: &ForwardOptions,
        share: (usize, usize),
    ) -> Vec<Self> {
        let (replica, replicas) = (share.0, share.1.max(1));
        batches
            .into_iter()
            .flat_map(|micro| {
                let global = GlobalBatch::local(&micro, vocab);
                micro.into_iter().enumerate().filter(move |(i, _)| i % replicas == replica).map(move |(_, m)| LmItem {
                    micro: m,
                    global,
                    aux_coef,
                    forward: *forward,
                })
            })
            .collect()
    }
}

/// What a step reports to burn-train's metrics: the micro-batch's mean cross-entropy.
pub struct LmOutput<B: Backend> {
    /// Mean cross-entropy over the micro-batch's label tokens `[1]`.
    pub loss: Tensor<B, 1>,
}

impl<B: Backend> ItemLazy for LmOutput<B> {
    type ItemSync = LmOutput<Flex>;

    fn sync(self) -> Self::ItemSync {
        LmOutput { loss: Tensor::from_data(self.loss.into_data(), &Default::default()) }
    }
}

impl<B: Backend> Adaptor<LossInput<B>> for LmOutput<B> {
    fn adapt(&self) -> LossInput<B> {
        LossInput::new(self.loss.clone())
    }
}

/// The forward of one item: (the loss to differentiate, the micro-batch's mean CE).
/// Panics with the batch error: burn-train's steps cannot return one, and our pipeline's
/// batches are checked when they are built.
fn item_loss<B: Glm5Backend>(model: &Glm5ForCausalLM<B>, item: &LmItem, context: Option<&Group>) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let out = forward_micro(model, &item.micro, &item.forward, context).unwrap_or_else(|e| panic!("learner step: {e}"));
    let (sum, count) = crate::loss::target_loss_sum(out.output.logits, &out.targets);
    let mean = sum.clone() / count.max(1) as f64;
    let mut loss = sum / item.global.label_tokens.max(1) as f64;
    if item.aux_coef != 0.0 {
        if let Some(aux) = model.aux_loss(&out.output.text.router_logits, &out.valid) {
            loss = loss + aux * (item.aux_coef / item.global.micro_batches.max(1) as f64);
        }
    }
    (loss, mean)
}

impl<B: AutodiffBackend + Glm5Backend> TrainStep for Glm5ForCausalLM<B> {
    type Input = LmItem;
    type Output = LmOutput<B>;

    /// On a mesh device ([`ParallelTraining::prepare`]d), each item's gradients are made the
    /// global batch's share ([`ParallelTraining::reduce_grads`]: they add up over the items to
    /// the reduced sum, the reductions being linear).
    fn step(&self, item: LmItem) -> TrainOutput<LmOutput<B>> {
        let par = ParallelTraining::of_model(self);
        let (loss, mean) = item_loss(self, &item, par.context());
        let mut out = TrainOutput::new(self, loss.backward(), LmOutput { loss: mean.detach() });
        par.reduce_grads(self, &mut out.grads).unwrap_or_else(|e| panic!("learner step: {e}"));
        out
    }
}

impl<B: Glm5Backend> InferenceStep for Glm5ForCausalLM<B> {
    type Input = LmItem;
    type Output = LmOutput<B>;

    fn step(&self, item: LmItem) -> LmOutput<B> {
        LmOutput { loss: item_loss(self, &item, ParallelTraining::of_model(self).context()).1 }
    }
}

/// A burn `DataLoader` over prepared items, in order (our sampler already fixed the order;
/// burn's loop must not reshuffle micro-batches across global batches).
#[derive(Debug, Clone)]
pub struct LmLoader {
    items: Arc<Vec<LmItem>>,
    range: std::ops::Range<usize>,
}

impl LmLoader {
    /// All of `items`.
    pub fn new(items: Vec<LmItem>) -> Self {
        let n = items.len();
        Self { items: Arc::new(items), range: 0..n }
    }
}

struct LmIter<'a> {
    loader: &'a LmLoader,
    next: usize,
}

impl Iterator for LmIter<'_> {
    type Item = LmItem;

    fn next(&mut self) -> Option<LmItem> {
        let i = self.loader.range.start + self.next;
        (i < self.loader.range.end).then(|| {
            self.next += 1;
            self.loader.items[i].clone()
        })
    }
}

impl DataLoaderIterator<LmItem> for LmIter<'_> {
    fn progress(&self) -> Progress {
        Progress::new(self.next, self.loader.range.len())
    }
}

impl<B: Backend> DataLoader<B, LmItem> for LmLoader {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<LmItem> + 'a> {
        Box::new(LmIter { loader: self, next: 0 })
    }

    fn num_items(&self) -> usize {
        self.range.len()
    }

    /// Items are host data; the step puts them on the model's device.
    fn to_device(&self, _device: &B::Device) -> Arc<dyn DataLoader<B, LmItem>> {
        Arc::new(self.clone())
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<B, LmItem>> {
        let s = (self.range.start + start).min(self.range.end);
        let e = (self.range.start + end).min(self.range.end).max(s);
        Arc::new(Self { items: self.items.clone(), range: s..e })
    }
}

/// Our learning-rate schedule as a burn-train scheduler. Burn's loop steps the scheduler
/// once per item (micro-batch) and applies the optimizer every `accumulation` items with the
/// last rate, so optimizer step `k` (0-based) gets `schedule.at(k)` as in our `Trainer`.
#[derive(Debug, Clone)]
pub struct ScheduleLr {
    /// The schedule of optimizer steps.
    pub schedule: LrSchedule,
    /// Micro-batches per optimizer step.
    pub accumulation: usize,
    /// Items seen.
    pub items: usize,
}

impl LrScheduler for ScheduleLr {
    type Record<B: Backend> = usize;

    fn step(&mut self) -> LearningRate {
        self.items += 1;
        self.schedule.at((self.items - 1) / self.accumulation.max(1))
    }

    fn to_record<B: Backend>(&self) -> usize {
        self.items
    }

    fn load_record<B: Backend>(mut self, record: usize) -> Self {
        self.items = record;
        self
    }
}
