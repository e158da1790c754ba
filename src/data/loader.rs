//! A packed SFT dataset and its sampler: records → tokenised samples → THD packs, served as
//! micro-batches (each micro-batch is `local_batch_size` packs concatenated into one THD row,
//! document boundaries kept, images processed on demand).
//!
//! Order: samples are shuffled once with the recipe seed before packing (so packs mix records);
//! the packs are reshuffled every epoch with `(seed, epoch)`. The sampler's position is just
//! `(epoch, cursor)`, which is what a checkpoint stores to resume on the same batch.

use std::path::PathBuf;

use super::batch::{Images, MicroBatch};
use super::chat::ChatFormat;
use super::image_processor::ImageProcessor;
use super::medpix::{read_split, DatasetError, ReadReport, VqaRecord};
use super::packing::{encode_record, pack_greedy, Pack, PackReport, SampleError, SftSample};
use super::DatasetSource;

/// Errors building or serving the dataset.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// Reading the dataset failed.
    #[error(transparent)]
    Dataset(#[from] DatasetError),
    /// A sample could not be encoded.
    #[error(transparent)]
    Sample(#[from] SampleError),
    /// The tokenizer cannot produce the model's image token.
    #[error("{dir}: the tokenizer never produces the image token id {id} (config.json `image_token_id`): tokenizer and model disagree")]
    NoImageToken {
        /// The tokenizer directory.
        dir: PathBuf,
        /// The image token id of `config.json`.
        id: i64,
    },
    /// No sample of a split fits the pack length.
    #[error("{dir}: split `{split}`: every sample is longer than packed_sequence_size {max_length} ({dropped} dropped); {hint}")]
    AllTooLong {
        /// The dataset directory.
        dir: PathBuf,
        /// The split.
        split: String,
        /// The pack length.
        max_length: usize,
        /// Samples dropped.
        dropped: usize,
        /// What to change.
        hint: &'static str,
    },
    /// A pack index past the end.
    #[error("pack {index} out of range ({packs} packs)")]
    PackIndex {
        /// The index asked for.
        index: usize,
        /// Packs in the dataset.
        packs: usize,
    },
}

/// SplitMix64: a small, fully specified generator, so a data order is reproducible from
/// `(seed, epoch)` on any platform and version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher–Yates shuffle of `0..n`.
    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
        v
    }
}

/// Records, their packs and what reading/packing skipped.
pub struct PackedDataset {
    /// The usable records.
    pub records: Vec<VqaRecord>,
    /// The packed sequences.
    pub packs: Vec<Pack>,
    /// What reading skipped.
    pub read_report: ReadReport,
    /// What packing did.
    pub pack_report: PackReport,
    /// The image processor the samples were sized with.
    pub processor: ImageProcessor,
    /// The image placeholder id.
    pub image_token_id: i64,
}

/// How to build a [`PackedDataset`].
#[derive(Debug, Clone)]
pub struct PackingOptions {
    /// Tokens per pack; 0 = no packing (one sample per sequence).
    pub max_length: usize,
    /// Drop samples longer than `max_length` (else truncate them).
    pub drop_long_samples: bool,
    /// Seed of the pack order.
    pub seed: u64,
}

impl PackedDataset {
    /// Read the records of `source`, tokenise with `chat`, pack.
    pub fn build(
        source: &DatasetSource,
        chat: &ChatFormat,
        processor: ImageProcessor,
        image_token_id: i64,
        packing: &PackingOptions,
    ) -> Result<Self, DataError> {
        let (dir, split) = (source.path.as_path(), source.split.as_str());
        let (mut records, mut read_report) = read_split(dir, source.format, split, source.max_samples)?;
        // A special-token string in a question or answer (e.g. `<|image|>`) would be
        // tokenised as that control token — an extra image placeholder, a turn end — so such
        // a record is skipped and counted like any other malformed record, not escaped:
        // escaping would train on text the model never sees at inference.
        let specials = chat.special_tokens();
        records.retain(|r| match specials.iter().find(|t| r.question.contains(t.as_str()) || r.answer.contains(t.as_str())) {
            Some(t) => {
                read_report.skip(&r.origin, "special token in text", format!("contains {t}"));
                false
            }
            None => true,
        });
        read_report.usable = records.len();
        if records.is_empty() {
            return Err(read_report.no_usable_records(dir, split).into());
        }
        let mut samples: Vec<SftSample> = records.iter().enumerate().map(|(i, r)| encode_record(chat, &processor, r, i)).collect::<Result<_, _>>()?;
        if !samples.iter().any(|s| s.ids.contains(&image_token_id)) {
            return Err(DataError::NoImageToken { dir: dir.to_path_buf(), id: image_token_id });
        }
        let order = SplitMix64(packing.seed).permutation(samples.len());
        let mut shuffled: Vec<Option<SftSample>> = samples.drain(..).map(Some).collect();
        let samples: Vec<SftSample> = order.iter().filter_map(|&i| shuffled[i].take()).collect();
        let (packs, pack_report) = pack_greedy(samples, packing.max_length, packing.drop_long_samples, image_token_id);
        if packs.is_empty() {
            return Err(DataError::AllTooLong {
                dir: dir.to_path_buf(),
                split: split.to_string(),
                max_length: packing.max_length,
                dropped: pack_report.dropped_long,
                hint: if packing.drop_long_samples {
                    "raise it, or set drop_long_samples: false to truncate long samples"
                } else {
                    "raise it (a sample is not truncated through its image placeholders, so one whose image alone is longer cannot fit)"
                },
            });
        }
        Ok(Self { records, packs, read_report, pack_report, processor, image_token_id })
    }

    /// One THD row holding `packs` (indices into [`Self::packs`]), images processed.
    pub fn micro_batch(&self, packs: &[usize]) -> Result<MicroBatch, DataError> {
        let mut ids = Vec::new();
        let mut labels = Vec::new();
        let mut documents = Vec::new();
        let mut pixel_values = Vec::new();
        let mut grid_thw = Vec::new();
        let patch_dim = 3 * self.processor.temporal_patch_size * self.processor.patch_size * self.processor.patch_size;
        for &p in packs {
            let pack = self.packs.get(p).ok_or(DataError::PackIndex { index: p, packs: self.packs.len() })?;
            for s in &pack.samples {
                ids.extend_from_slice(&s.ids);
                labels.extend_from_slice(&s.labels);
                documents.push(s.ids.len());
                let record = &self.records[s.record];
                let image = record.image().map_err(|source| SampleError::Image { origin: record.origin.clone(), source })?;
                let processed = self.processor.process(&image).map_err(|source| SampleError::Image { origin: record.origin.clone(), source })?;
                pixel_values.extend_from_slice(&processed.pixel_values);
                grid_thw.push(processed.grid_thw);
            }
        }
        let seq = ids.len();
        Ok(MicroBatch {
            ids,
            labels,
            batch: 1,
            seq,
            mask: None,
            documents: Some(documents),
            images: (!grid_thw.is_empty()).then_some(Images { pixel_values, patch_dim, grid_thw }),
        })
    }

    /// Tokens over all packs.
    pub fn tokens(&self) -> usize {
        self.packs.iter().map(Pack::len).sum()
    }
}

/// Epoch-wise shuffled order over `n` packs; its state is `(epoch, cursor)`.
#[derive(Debug, Clone)]
pub struct Sampler {
    n: usize,
    seed: u64,
    /// Completed passes over the data.
    pub epoch: usize,
    /// Position in this epoch's order.
    pub cursor: usize,
    order: Vec<usize>,
}

impl Sampler {
    /// At the start of epoch 0.
    pub fn new(n: usize, seed: u64) -> Self {
        Self::at(n, seed, 0, 0)
    }

    /// Resume at `(epoch, cursor)`.
    pub fn at(n: usize, seed: u64, epoch: usize, cursor: usize) -> Self {
        let order = Self::order(n, seed, epoch);
        Self { n, seed, epoch, cursor, order }
    }

    fn order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
        SplitMix64(seed ^ (epoch as u64).wrapping_mul(0xA24B_AED4_963E_E407)).permutation(n)
    }

    /// The next `k` pack indices, rolling over epochs.
    pub fn take(&mut self, k: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            // `>=`: a cursor saved against a longer pack list starts the next epoch instead of
            // indexing past the end (resume checks the data fingerprint before it gets here)
            if self.cursor >= self.n {
                self.epoch += 1;
                self.cursor = 0;
                self.order = Self::order(self.n, self.seed, self.epoch);
            }
            out.push(self.order[self.cursor]);
            self.cursor += 1;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_resumes_where_it_stopped() {
        let mut a = Sampler::new(7, 5);
        let first: Vec<usize> = (0..5).flat_map(|_| a.take(3)).collect();
        let mut b = Sampler::new(7, 5);
        b.take(3);
        b.take(3);
        let mut c = Sampler::at(7, 5, b.epoch, b.cursor);
        let rest: Vec<usize> = (0..3).flat_map(|_| c.take(3)).collect();
        assert_eq!(&first[6..], &rest[..]);
        let mut sorted = first[..7].to_vec();
        sorted.sort();
        assert_eq!(sorted, (0..7).collect::<Vec<_>>(), "an epoch visits every pack once");
    }
}
