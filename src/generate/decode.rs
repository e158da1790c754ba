//! Autoregressive generation with HF `generate()`'s semantics (`GenerationMixin._sample`):
//!
//! ```text
//! repeat up to max_new_tokens:
//!     z ← logits of each row's last position          (prefill, then one cached decode step)
//!     t_r ← choose(z_r) if row r is unfinished, else pad_token_id
//!     append t; attention_mask gains a 1 for every row
//!     row r finishes when t_r is an EOS id; stop when every row has
//! sequences: [B, S + n], n ≤ max_new_tokens
//! ```
//!
//! Rows may be left-padded (`attention_mask` 0 before the prompt), as HF batches prompts.
//! The prompt runs once ([`Glm5ForCausalLM::prefill`]), filling the per-layer caches
//! ([`super::cache`]); each new token is then one [`Glm5ForCausalLM::decode_step`]: O(1) in the
//! context for KDA layers, O(index width) attention and O(context / kpool) indexer scoring for
//! DSA layers.

use burn::tensor::DType;

use super::sampling::{SamplingConfig, SamplingError, TokenSampler};
use crate::input::ModelInput;
use crate::model::Glm5ForCausalLM;
use crate::ops::backend::Glm5Backend;
use crate::text::ForwardOptions;
use crate::text::ModelError;

/// When to stop and how to fill ended rows.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// At most this many new tokens per row (≥ 1).
    pub max_new_tokens: usize,
    /// Greedy or sampled choice.
    pub sampling: SamplingConfig,
    /// A row ends when it produces one of these (`config.json` / `generation_config.json`
    /// `eos_token_id`, plus the caller's stop tokens).
    pub eos_token_ids: Vec<i64>,
    /// What ended rows receive.
    pub pad_token_id: i64,
    /// The model's `max_position_embeddings`: longer prompts are refused, generation stops there.
    pub max_positions: usize,
}

/// Generation errors, naming the input at fault.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The prompt or an option is unusable.
    #[error("generate: {0}")]
    Input(String),
    /// A sampling value is out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The forward rejected the inputs.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// What [`generate`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// `[B, S + new_tokens]` row-major: the prompts and what followed, ended rows padded.
    pub sequences: Vec<i64>,
    /// Rows B.
    pub batch: usize,
    /// Tokens added per row.
    pub new_tokens: usize,
    /// Whether each row ended on an EOS id or a stopping rule (false: it reached the length limit).
    pub ended: Vec<bool>,
}

/// A rule that ends a row besides its EOS ids (HF `StoppingCriteria`), checked after each of
/// the row's tokens until it has ended.
pub trait StoppingCriteria {
    /// Whether row `row` ends now; `sequence` is the row so far (prompt, left padding
    /// included, then the generated tokens, the newest last).
    fn ends(&mut self, row: usize, sequence: &[i64]) -> bool;
}

/// No rule besides the EOS ids.
pub struct NoStoppingCriteria;

impl StoppingCriteria for NoStoppingCriteria {
    fn ends(&mut self, _row: usize, _sequence: &[i64]) -> bool {
        false
    }
}

/// Generate after `prompt`. `on_tokens` receives each step's tokens (one per row, `pad` for
/// ended rows) as soon as they are chosen — the streaming hook.
pub fn generate<B: Glm5Backend>(
    model: &Glm5ForCausalLM<B>,
    prompt: ModelInput<B>,
    opts: &GenerateOptions,
    forward: &ForwardOptions,
    on_tokens: impl FnMut(&[i64]),
) -> Result<Generated, GenerateError> {
    generate_with(model, prompt, opts, forward, &mut NoStoppingCriteria, on_tokens)
}

/// [`generate`] with a further stopping rule (e.g. [`super::stop::StopStrings`]): a row also
/// ends when `stopping` says so after one of its tokens, and is padded from then on.
pub fn generate_with<B: Glm5Backend>(
    model: &Glm5ForCausalLM<B>,
    prompt: ModelInput<B>,
    opts: &GenerateOptions,
    forward: &ForwardOptions,
    stopping: &mut dyn StoppingCriteria,
    mut on_tokens: impl FnMut(&[i64]),
) -> Result<Generated, GenerateError> {
    let (b, s) = (prompt.batch, prompt.seq);
    let bad = |m: String| Err(GenerateError::Input(m));
    if b == 0 || s == 0 {
        return bad(format!("an empty prompt ([{b}, {s}]): at least one token per row"));
    }
    if prompt.ids.len() != b * s {
        return bad(format!("{} input_ids for shape [{b}, {s}]", prompt.ids.len()));
    }
    if prompt.documents.is_some() || prompt.context.is_some() {
        return bad("a prompt is a batch of rows, not a packed row or a context-parallel shard".into());
    }
    if opts.max_new_tokens == 0 {
        return bad("max_new_tokens is 0: nothing to generate".into());
    }
    if s > opts.max_positions {
        return bad(format!("the prompt has {s} positions, more than max_position_embeddings ({})", opts.max_positions));
    }
    let mask: Vec<Vec<bool>> = match &prompt.mask {
        Some(m) if m.len() != b * s => return bad(format!("attention_mask has {} entries for shape [{b}, {s}]", m.len())),
        Some(m) => m.chunks(s).map(|r| r.to_vec()).collect(),
        None => vec![vec![true; s]; b],
    };
    if let Some(r) = mask.iter().position(|row| !row.iter().any(|&x| x)) {
        return bad(format!("row {r} of attention_mask has no token"));
    }
    let mut rows: Vec<Vec<i64>> = prompt.ids.chunks(s).map(|r| r.to_vec()).collect();
    let mut sampler = TokenSampler::new(opts.sampling)?;
    let mut ended = vec![false; b];
    let steps = opts.max_new_tokens.min(opts.max_positions - s);
    let (mut logits, mut cache) = model.prefill(prompt, forward)?;
    let mut new_tokens = 0;
    for step in 0..steps {
        if step > 0 {
            let last: Vec<i64> = rows.iter().map(|r| r[r.len() - 1]).collect();
            logits = model.decode_step(&last, &mut cache, forward)?;
        }
        let [_, t, v] = logits.dims();
        let last: Vec<f32> = logits
            .clone()
            .slice([0..b, t - 1..t, 0..v])
            .cast(DType::F32)
            .into_data()
            .convert::<f32>()
            .into_vec()
            .map_err(|e| GenerateError::Input(format!("reading the logits: {e:?}")))?;
        let tokens: Vec<i64> = (0..b).map(|r| if ended[r] { opts.pad_token_id } else { sampler.choose(&last[r * v..(r + 1) * v]) as i64 }).collect();
        for (r, &t) in tokens.iter().enumerate() {
            rows[r].push(t);
            if !ended[r] {
                ended[r] = opts.eos_token_ids.contains(&t) || stopping.ends(r, &rows[r]);
            }
        }
        new_tokens += 1;
        on_tokens(&tokens);
        if ended.iter().all(|&e| e) {
            break;
        }
    }
    Ok(Generated { sequences: rows.concat(), batch: b, new_tokens, ended })
}

/// The EOS ids a checkpoint declares: `eos_token_id` (an id or a list) of
/// `generation_config.json`, else of `config.json` (top level or `text_config`), as HF's
/// `GenerationConfig.from_model_config` finds them. Empty when none is declared.
pub fn checkpoint_eos_ids(dir: &std::path::Path) -> Result<Vec<i64>, GenerateError> {
    for (file, nested) in [("generation_config.json", false), ("config.json", true)] {
        let path = dir.join(file);
        if !path.is_file() {
            continue;
        }
        let text = std::fs::read_to_string(&path).map_err(|e| GenerateError::Input(format!("{}: {e}", path.display())))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| GenerateError::Input(format!("{}: {e}", path.display())))?;
        let found = if nested { config_eos_ids(&json) } else { json.get("eos_token_id").map(eos_list).unwrap_or_default() };
        if !found.is_empty() {
            return Ok(found);
        }
    }
    Ok(Vec::new())
}

/// The EOS ids of a `config.json` value: its `eos_token_id`, else `text_config.eos_token_id`.
pub fn config_eos_ids(config: &serde_json::Value) -> Vec<i64> {
    [&["eos_token_id"][..], &["text_config", "eos_token_id"][..]]
        .iter()
        .filter_map(|keys| keys.iter().try_fold(config, |v, k| v.get(*k)))
        .map(eos_list)
        .find(|x| !x.is_empty())
        .unwrap_or_default()
}

/// An `eos_token_id` field: one id or a list of them.
fn eos_list(v: &serde_json::Value) -> Vec<i64> {
    match v {
        serde_json::Value::Number(n) => n.as_i64().into_iter().collect(),
        serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_i64()).collect(),
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::config_eos_ids;
    use serde_json::json;

    #[test]
    fn eos_ids_from_the_top_level_then_the_text_config() {
        assert_eq!(config_eos_ids(&json!({"eos_token_id": 5})), [5]);
        assert_eq!(config_eos_ids(&json!({"eos_token_id": [5, 7], "text_config": {"eos_token_id": 9}})), [5, 7]);
        assert_eq!(config_eos_ids(&json!({"eos_token_id": null, "text_config": {"eos_token_id": [9, 10]}})), [9, 10]);
        assert!(config_eos_ids(&json!({"text_config": {}})).is_empty());
    }
}
