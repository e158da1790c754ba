//! SFT samples and their packing into THD sequences.
//!
//! A record becomes one conversation — user: `[image, question]`, assistant: `answer` — rendered
//! with the checkpoint's chat template, labelled on the assistant span ([`super::chat`]).
//! Samples are packed greedily (first fit, in the given order) into sequences of at most
//! `max_length` tokens; a pack keeps its documents' lengths (`cu_seqlens` = their prefix sums),
//! which the model uses to restart positions, KDA state and short conv, and to keep attention,
//! KPool pools and the vision tower inside each document. Nothing is padded: THD rows have the
//! length of their documents.
//!
//! A sample longer than `max_length` is dropped (`drop_long_samples`) or truncated; truncation
//! that would cut through an image's placeholders drops the sample instead, since the image's
//! features must all land.

use super::chat::{ChatError, ChatFormat};
use super::image_processor::{ImageError, ImageProcessor};
use super::medpix::VqaRecord;

/// One tokenised conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct SftSample {
    /// Token ids.
    pub ids: Vec<i64>,
    /// `-100` outside the assistant's answer.
    pub labels: Vec<i64>,
    /// Index of the record it came from.
    pub record: usize,
}

/// Errors building samples.
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// The record's image failed.
    #[error("{origin}: {source}")]
    Image {
        /// The record (`file:row`).
        origin: String,
        /// The image error.
        source: ImageError,
    },
    /// The record's conversation failed.
    #[error("{origin}: {source}")]
    Chat {
        /// The record (`file:row`).
        origin: String,
        /// The chat error.
        source: ChatError,
    },
}

/// The conversation of a record, as chat-template messages.
pub fn conversation(record: &VqaRecord) -> serde_json::Value {
    serde_json::json!([
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": record.question}]},
        {"role": "assistant", "content": record.answer},
    ])
}

/// Tokenise and label one record (the image's placeholder count comes from its size alone).
pub(crate) fn encode_record(chat: &ChatFormat, processor: &ImageProcessor, record: &VqaRecord, index: usize) -> Result<SftSample, SampleError> {
    let ((gh, gw), _) =
        processor.geometry(record.height, record.width).map_err(|source| SampleError::Image { origin: record.origin.clone(), source })?;
    let image_tokens = (gh / processor.patch_size) * (gw / processor.patch_size) / (processor.merge_size * processor.merge_size);
    let enc =
        chat.encode(&conversation(record), false, &[image_tokens]).map_err(|source| SampleError::Chat { origin: record.origin.clone(), source })?;
    Ok(SftSample { ids: enc.ids.iter().map(|&x| x as i64).collect(), labels: enc.labels, record: index })
}

/// What packing did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PackReport {
    /// Packs built.
    pub packs: usize,
    /// Samples packed.
    pub samples: usize,
    /// Samples dropped as too long.
    pub dropped_long: usize,
    /// Samples truncated to fit.
    pub truncated: usize,
    /// Tokens in packs / (packs · max_length).
    pub fill: f64,
}

/// One packed THD sequence: the samples it holds (possibly truncated) in order.
#[derive(Debug, Clone, PartialEq)]
pub struct Pack {
    /// The samples, in order.
    pub samples: Vec<SftSample>,
}

impl Pack {
    /// Tokens in the pack.
    pub fn len(&self) -> usize {
        self.samples.iter().map(|s| s.ids.len()).sum()
    }
    /// Whether it holds no sample.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
    /// Document lengths (`cu_seqlens` are their prefix sums).
    pub fn lengths(&self) -> Vec<usize> {
        self.samples.iter().map(|s| s.ids.len()).collect()
    }
    /// `cu_seqlens`: `[0, l₀, l₀+l₁, …]`.
    pub fn cu_seqlens(&self) -> Vec<usize> {
        let mut cu = vec![0];
        for l in self.lengths() {
            cu.push(cu.last().copied().unwrap_or(0) + l);
        }
        cu
    }
}

/// Greedy first-fit packing of `samples` (in order) into sequences of at most `max_length`;
/// `max_length` 0 means no packing: one sample per sequence.
pub(crate) fn pack_greedy(samples: Vec<SftSample>, max_length: usize, drop_long: bool, image_token: i64) -> (Vec<Pack>, PackReport) {
    if max_length == 0 {
        let packs: Vec<Pack> = samples.into_iter().filter(|s| !s.ids.is_empty()).map(|s| Pack { samples: vec![s] }).collect();
        let longest = packs.iter().map(Pack::len).max().unwrap_or(1);
        let tokens: usize = packs.iter().map(Pack::len).sum();
        let n = packs.len();
        return (packs, PackReport { packs: n, samples: n, fill: tokens as f64 / (n * longest).max(1) as f64, ..Default::default() });
    }
    let mut report = PackReport::default();
    let mut packs: Vec<Pack> = Vec::new();
    let mut room: Vec<usize> = Vec::new();
    for mut s in samples {
        if s.ids.is_empty() {
            continue;
        }
        if s.ids.len() > max_length {
            // cutting through an image's placeholders would orphan some of its features
            let cuts_image = s.ids[max_length - 1] == image_token && s.ids.get(max_length) == Some(&image_token);
            let keeps_labels = s.labels[..max_length].iter().any(|&l| l >= 0);
            if drop_long || cuts_image || !keeps_labels {
                report.dropped_long += 1;
                continue;
            }
            s.ids.truncate(max_length);
            s.labels.truncate(max_length);
            report.truncated += 1;
        }
        let n = s.ids.len();
        report.samples += 1;
        match room.iter().position(|&r| r >= n) {
            Some(i) => {
                room[i] -= n;
                packs[i].samples.push(s);
            }
            None => {
                room.push(max_length - n);
                packs.push(Pack { samples: vec![s] });
            }
        }
    }
    report.packs = packs.len();
    let tokens: usize = packs.iter().map(Pack::len).sum();
    report.fill = if packs.is_empty() { 0.0 } else { tokens as f64 / (packs.len() * max_length) as f64 };
    (packs, report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, record: usize) -> SftSample {
        SftSample { ids: vec![1; n], labels: vec![1; n], record }
    }

    #[test]
    fn first_fit_in_order() {
        let (packs, r) = pack_greedy(vec![sample(6, 0), sample(5, 1), sample(3, 2), sample(4, 3), sample(11, 4)], 10, true, 9);
        let recs: Vec<Vec<usize>> = packs.iter().map(|p| p.samples.iter().map(|s| s.record).collect()).collect();
        assert_eq!(recs, vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(r.dropped_long, 1);
        assert_eq!(packs[0].cu_seqlens(), vec![0, 6, 9]);
        assert!((r.fill - 18.0 / 20.0).abs() < 1e-12);
    }

    #[test]
    fn truncation_keeps_images_whole() {
        let mut s = sample(12, 0);
        s.ids[9] = 9;
        s.ids[10] = 9; // placeholders at 9..11: a cut at 10 splits them
        let (packs, r) = pack_greedy(vec![s.clone()], 10, false, 9);
        assert!(packs.is_empty());
        assert_eq!(r.dropped_long, 1);
        let (packs, r) = pack_greedy(vec![sample(12, 1)], 10, false, 9);
        assert_eq!((packs[0].len(), r.truncated), (10, 1));
        let (packs, r) = pack_greedy(vec![sample(12, 1), sample(3, 2)], 0, true, 9);
        assert_eq!((packs.len(), r.dropped_long, r.samples), (2, 0, 2), "0 = one sample per sequence");
    }
}
