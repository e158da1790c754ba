//! Data: the image processor, the chat format, the MedPix-VQA reader and THD packing.

pub mod batch;
pub mod chat;
pub mod fingerprint;
pub mod image_processor;
pub mod loader;
pub mod medpix;
pub mod packing;
pub mod resize;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::input::{Images, ModelInput};
use chat::{ChatError, ChatFormat};
use image_processor::{ImageError, ImageProcessor, RgbImage};

/// How a dataset is stored on disk (recipe `dataset.format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DatasetFormat {
    /// MedPix-VQA's HF layout: parquet shards with `image_id`, `question`, `answer`, …
    Parquet,
    /// One JSON object per line (`image`, `question`, `answer`) beside an image folder.
    Jsonl,
}

/// Where a dataset's records come from and which of them to read (recipe `dataset` /
/// `validation_dataset`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetSource {
    /// Dataset directory.
    pub path: PathBuf,
    /// On-disk format.
    pub format: DatasetFormat,
    /// Split name (`train`, `validation`, …).
    #[serde(default = "train_split")]
    pub split: String,
    /// Read at most this many records (`None`: all).
    #[serde(default)]
    pub max_samples: Option<usize>,
}

fn train_split() -> String {
    "train".into()
}

/// A user turn with images and text: one row of ids, placeholders expanded, and its images.
#[derive(Debug, Clone)]
pub struct MultimodalPrompt {
    /// Token ids of the prompt, placeholders expanded.
    pub ids: Vec<i64>,
    /// Its images, all concatenated (none: a text-only turn).
    pub images: Images,
}

impl MultimodalPrompt {
    /// The model's input: one row, with its images when it has any.
    pub fn input<B: burn::tensor::backend::Backend>(&self) -> ModelInput<B> {
        ModelInput::row(self.ids.clone()).with_images((!self.images.grid_thw.is_empty()).then(|| self.images.clone()))
    }
}

/// Errors of prompt building.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// An image could not be read or processed.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The chat template or tokenizer failed.
    #[error(transparent)]
    Chat(#[from] ChatError),
}

/// One user turn — the images, then `text` — rendered with the chat template and a generation
/// prompt, images processed and their placeholders expanded.
pub fn user_prompt(chat: &ChatFormat, processor: &ImageProcessor, images: &[RgbImage], text: &str) -> Result<MultimodalPrompt, PromptError> {
    let processed = images.iter().map(|im| processor.process(im)).collect::<Result<Vec<_>, _>>()?;
    let mut content: Vec<serde_json::Value> = images.iter().map(|_| serde_json::json!({"type": "image"})).collect();
    content.push(serde_json::json!({"type": "text", "text": text}));
    let messages = serde_json::json!([{"role": "user", "content": content}]);
    let tokens: Vec<usize> = processed.iter().map(|p| p.n_tokens(processor.merge_size)).collect();
    let enc = chat.encode(&messages, true, &tokens)?;
    let patch_dim = 3 * processor.temporal_patch_size * processor.patch_size * processor.patch_size;
    Ok(MultimodalPrompt {
        ids: enc.ids.iter().map(|&x| x as i64).collect(),
        images: Images {
            pixel_values: processed.iter().flat_map(|p| p.pixel_values.iter().copied()).collect(),
            patch_dim,
            grid_thw: processed.iter().map(|p| p.grid_thw).collect(),
        },
    })
}
