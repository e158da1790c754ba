//! Answer accuracy of a VQA model: greedy answers to the validation questions, compared with
//! the reference answers after normalisation (exact match).
//!
//! ```text
//! prompt_i  = chat template(user: image_i, question_i) + generation prompt
//! answer_i  = decode(greedy generate(prompt_i, ≤ max_new_tokens, stop at EOS / turn end))
//! accuracy  = (1/N) Σ_i [normalise(answer_i) == normalise(reference_i)]
//! normalise = lowercase → punctuation to spaces → drop a, an, the → collapse whitespace
//! ```
//!
//! The normalisation is SQuAD's `normalize_answer` (lowercase, no punctuation, no articles,
//! single spaces), the usual one for short-answer VQA exact match.

use super::decode::{generate, GenerateError, GenerateOptions};
use crate::data::chat::ChatFormat;
use crate::data::image_processor::ImageProcessor;
use crate::data::medpix::VqaRecord;
use crate::model::Glm5ForCausalLM;
use crate::ops::backend::Glm5Backend;
use crate::text::ForwardOptions;

/// Lowercase, punctuation replaced by spaces, the articles `a`/`an`/`the` dropped, words
/// joined by single spaces.
pub fn normalize_answer(text: &str) -> String {
    let lower: String = text.to_lowercase().chars().map(|c| if c.is_alphanumeric() || c.is_whitespace() { c } else { ' ' }).collect();
    lower.split_whitespace().filter(|w| !matches!(*w, "a" | "an" | "the")).collect::<Vec<_>>().join(" ")
}

/// Whether two answers are equal after [`normalize_answer`].
pub fn exact_match(prediction: &str, reference: &str) -> bool {
    normalize_answer(prediction) == normalize_answer(reference)
}

/// One answered question.
#[derive(Debug, Clone)]
pub struct Answered {
    /// The record's origin (`file:row`).
    pub origin: String,
    /// The model's answer (special tokens removed).
    pub prediction: String,
    /// The reference answer.
    pub reference: String,
    /// Exact match after normalisation.
    pub correct: bool,
}

/// Accuracy over a set of questions.
#[derive(Debug, Clone)]
pub struct AnswerAccuracy {
    /// Questions answered correctly.
    pub correct: usize,
    /// Every question, in order.
    pub answers: Vec<Answered>,
}

impl AnswerAccuracy {
    /// `correct / total` (0 when there is no question).
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.answers.len().max(1) as f64
    }
}

/// Errors of an evaluation, naming the record at fault.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// Building the record's prompt failed (image, template).
    #[error("{origin}: {message}")]
    Prompt {
        /// The record.
        origin: String,
        /// What failed.
        message: String,
    },
    /// Generation failed.
    #[error("{origin}: {source}")]
    Generate {
        /// The record.
        origin: String,
        /// The error.
        source: GenerateError,
    },
}

/// Answers of `model` to `records` as `opts` generates them (one question at a time: each
/// prompt has its own image; greedy unless `opts.sampling` says otherwise), each ending at
/// one of `opts.eos_token_ids`, scored by [`exact_match`].
pub fn answer_accuracy<B: Glm5Backend>(
    model: &Glm5ForCausalLM<B>,
    chat: &ChatFormat,
    processor: &ImageProcessor,
    records: &[VqaRecord],
    opts: &GenerateOptions,
    forward: &ForwardOptions,
) -> Result<AnswerAccuracy, EvalError> {
    let eos_token_ids = &opts.eos_token_ids;
    let mut out = AnswerAccuracy { correct: 0, answers: Vec::with_capacity(records.len()) };
    for r in records {
        let prompt_err = |message: String| EvalError::Prompt { origin: r.origin.clone(), message };
        let image = r.image().map_err(|e| prompt_err(e.to_string()))?;
        let p = crate::data::user_prompt(chat, processor, &[image], &r.question).map_err(|e| prompt_err(e.to_string()))?;
        let g = generate(model, p.input(), opts, forward, |_| {}).map_err(|source| EvalError::Generate { origin: r.origin.clone(), source })?;
        let new: Vec<u32> = g.sequences[p.ids.len()..].iter().filter(|t| !eos_token_ids.contains(t)).map(|&t| t as u32).collect();
        let prediction = chat.tokenizer.decode(&new, true).map_err(|e| prompt_err(format!("decoding the answer: {e}")))?;
        let correct = exact_match(&prediction, &r.answer);
        out.correct += correct as usize;
        out.answers.push(Answered { origin: r.origin.clone(), prediction: prediction.trim().to_string(), reference: r.answer.clone(), correct });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_follows_squad() {
        assert_eq!(normalize_answer("  The Left  Kidney. "), "left kidney");
        assert_eq!(normalize_answer("An MRI, T2-weighted!"), "mri t2 weighted");
        assert_eq!(normalize_answer("a"), "");
        assert!(exact_match("Axial", "axial."));
        assert!(!exact_match("axial plane", "axial"));
        assert!(exact_match("the CT", "ct"));
    }
}
