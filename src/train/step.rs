//! One optimizer step over micro-batches: the cross-entropy of every micro-batch is summed and
//! divided by the label tokens of the whole global batch (NeMo's `MaskedCrossEntropy`), the
//! gradients accumulate over micro-batches, are clipped by their global norm and applied.

use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};

use super::clip::clip_global_norm;
use crate::model::Glm5ForCausalLM;
use crate::text::{ForwardOptions, TokenMask};

/// One micro-batch of token rows.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    pub ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub batch: usize,
    pub seq: usize,
    /// `[B, S]` validity (padding), or `None`.
    pub mask: Option<Vec<bool>>,
    /// Packed document lengths of a `B = 1` row, or `None`.
    pub documents: Option<Vec<usize>>,
}

/// What a step did.
#[derive(Debug, Clone, Copy)]
pub struct StepMetrics {
    /// Mean cross-entropy over the global batch's label tokens (plus the weighted aux loss).
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    pub label_tokens: usize,
}

/// Forward/backward every micro-batch, then one optimizer step.
#[allow(clippy::too_many_arguments)]
pub fn train_step<B: AutodiffBackend, O: Optimizer<Glm5ForCausalLM<B>, B>>(
    model: Glm5ForCausalLM<B>,
    optim: &mut O,
    micro: &[MicroBatch],
    lr: f64,
    max_grad_norm: Option<f64>,
    aux_coef: f64,
    opts: &ForwardOptions,
    device: &B::Device,
) -> (Glm5ForCausalLM<B>, StepMetrics) {
    let vocab = model.vocab_size;
    let total: usize = micro.iter().map(|m| Glm5ForCausalLM::<B>::count_labels(&m.labels, m.batch, m.seq, vocab)).sum();
    let mut acc = GradientsAccumulator::<Glm5ForCausalLM<B>>::new();
    let mut loss_value = 0.0;
    for m in micro {
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(m.ids.clone(), [m.batch, m.seq]), device);
        let mask = match (&m.documents, &m.mask) {
            (Some(docs), _) => Some(TokenMask::packed(docs, device)),
            (None, Some(mk)) => Some(TokenMask::new(mk.clone(), m.batch, m.seq, device)),
            (None, None) => None,
        };
        let valid: Vec<bool> = m.mask.clone().unwrap_or_else(|| vec![true; m.batch * m.seq]);
        let out = model.forward(ids, mask, opts, false);
        let (sum, _) = Glm5ForCausalLM::<B>::lm_loss_sum(out.logits, &m.labels);
        let mut loss = sum / total.max(1) as f64;
        if aux_coef != 0.0 {
            if let Some(aux) = model.aux_loss(&out.text.router_logits, &valid) {
                loss = loss + aux * (aux_coef / micro.len() as f64);
            }
        }
        loss_value += loss.clone().into_scalar().elem::<f64>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        acc.accumulate(&model, grads);
    }
    let mut grads = acc.grads();
    let grad_norm = match max_grad_norm {
        Some(max) => clip_global_norm::<B, _>(&model, &mut grads, max),
        None => super::clip::global_norm::<B, _>(&model, &grads),
    };
    let model = optim.step(lr, model, grads);
    (model, StepMetrics { loss: loss_value, grad_norm, lr, label_tokens: total })
}

use burn::tensor::ElementConversion;
