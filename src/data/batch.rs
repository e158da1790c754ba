//! The batch types the data pipeline produces and the training step consumes: token rows with
//! labels, padding, packed document boundaries and the images of their placeholders.

use burn::tensor::backend::Backend;

pub use crate::input::Images;
use crate::input::ModelInput;

/// One micro-batch of token rows.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    /// `[B·S]` row-major.
    pub ids: Vec<i64>,
    /// `[B·S]`; −100 where no loss is taken.
    pub labels: Vec<i64>,
    /// Rows B.
    pub batch: usize,
    /// Columns S.
    pub seq: usize,
    /// `[B, S]` validity (padding), or `None`.
    pub mask: Option<Vec<bool>>,
    /// Packed document lengths of a `B = 1` THD row, or `None`.
    pub documents: Option<Vec<usize>>,
    /// The images of the rows' placeholders, or `None`.
    pub images: Option<Images>,
}

impl MicroBatch {
    /// A text-only micro-batch of `batch` rows.
    pub fn text(ids: Vec<i64>, labels: Vec<i64>, batch: usize, seq: usize, mask: Option<Vec<bool>>) -> Self {
        Self { ids, labels, batch, seq, mask, documents: None, images: None }
    }

    /// The model's input for these rows (ids, padding or packed documents, images).
    pub fn input<B: Backend>(&self) -> ModelInput<B> {
        ModelInput {
            ids: self.ids.clone(),
            batch: self.batch,
            seq: self.seq,
            mask: self.mask.clone(),
            documents: self.documents.clone(),
            images: self.images.clone(),
            context: None,
            backend: std::marker::PhantomData,
        }
    }

    /// Label tokens after the shift (what the loss is normalised by).
    pub fn label_tokens(&self, vocab: usize) -> usize {
        crate::loss::count_labels(&self.labels, self.batch, self.seq, vocab)
    }
}
