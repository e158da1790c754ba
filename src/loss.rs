//! The language-modelling losses: shifted next-token cross-entropy over labels ≠ −100.
//!
//! `loss = Σ_t CE(logits[t], labels[t+1]) / #labels`, logits `[B, S, V]` cast to fp32, labels
//! `[B, S]` on the host (−100, or an id outside the vocabulary, is not a label). The sum and
//! the count come separately so that a loop can normalise by the label tokens of a whole
//! global batch. HF: `ForCausalLMLoss` (`transformers/loss/loss_utils.py`), called from
//! `Glm5NextForConditionalGeneration.forward`.

use burn::tensor::{DType, Tensor};

use crate::ops::backend::{cast, cross_entropy_sum, Glm5Backend};

/// Shifted next-token cross-entropy (mean over labels ≠ −100). `labels` `[B, S]` host.
pub fn lm_loss<B: Glm5Backend>(logits: Tensor<B, 3>, labels: &[i64]) -> Tensor<B, 1> {
    let (sum, count) = lm_loss_sum(logits, labels);
    sum / count.max(1) as f64
}

/// The summed shifted cross-entropy and the number of label tokens it covers (to
/// normalise by the label tokens of a whole global batch).
pub fn lm_loss_sum<B: Glm5Backend>(logits: Tensor<B, 3>, labels: &[i64]) -> (Tensor<B, 1>, usize) {
    let [b, s, _] = logits.dims();
    target_loss_sum(logits, &shifted_targets(labels, b, s))
}

/// The next-token target of every position of a `[B, S]` label buffer: `labels[t + 1]`,
/// −100 at each row's last position.
pub fn shifted_targets(labels: &[i64], batch: usize, seq: usize) -> Vec<i64> {
    (0..batch).flat_map(|b| (0..seq).map(move |t| if t + 1 < seq { labels[b * seq + t + 1] } else { -100 })).collect()
}

/// The summed cross-entropy of `logits` `[B, S, V]` against already shifted `targets`
/// `[B, S]` (−100 or out of the vocabulary: not a label) and the number of labels.
pub fn target_loss_sum<B: Glm5Backend>(logits: Tensor<B, 3>, targets: &[i64]) -> (Tensor<B, 1>, usize) {
    let _t = crate::profile::scope("loss");
    let [b, s, v] = logits.dims();
    let targets = &targets[..b * s];
    let count = targets.iter().filter(|&&l| l >= 0 && (l as usize) < v).count();
    (cross_entropy_sum(cast(logits, DType::F32).reshape([b * s, v]), targets), count)
}

/// Number of label tokens of a `[B, S]` label buffer after the shift.
pub fn count_labels(labels: &[i64], batch: usize, seq: usize, vocab: usize) -> usize {
    (0..batch).flat_map(|b| (1..seq).map(move |t| labels[b * seq + t])).filter(|&l| l >= 0 && (l as usize) < vocab).count()
}
