//! What determines a run's data order, recorded in every training checkpoint so that a resume
//! on other data is caught instead of continuing at a cursor into a different pack list.
//!
//! The sampler's position is `(epoch, cursor)` into the packs; it means the same batches only
//! while the packs are the same: the dataset files, split and sample cap, the tokenizer and chat
//! template (through the token content), the packing settings, the batch sizes and the seed.
//! [`DataFingerprint::differences`] lists, by recipe key, what changed between two runs.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::loader::{PackedDataset, PackingOptions};
use super::DatasetSource;

/// The data-order fingerprint of a training run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFingerprint {
    /// `dataset.path` as the recipe gave it.
    pub path: String,
    /// `dataset.format`.
    pub format: String,
    /// `dataset.split`.
    pub split: String,
    /// `dataset.max_samples`.
    pub max_samples: Option<usize>,
    /// The files read, relative to `path`, with their sizes in bytes.
    pub files: BTreeMap<String, u64>,
    /// `packed_sequence.packed_sequence_size`.
    pub packed_sequence_size: usize,
    /// `packed_sequence.drop_long_samples`.
    pub drop_long_samples: bool,
    /// `rng.seed` (sample shuffle before packing, pack order per epoch).
    pub seed: u64,
    /// `step_scheduler.global_batch_size`.
    pub global_batch_size: usize,
    /// `step_scheduler.local_batch_size`.
    pub local_batch_size: usize,
    /// Packs built.
    pub packs: usize,
    /// FNV-1a 64 of every pack's token ids, labels and document lengths, in pack order
    /// (hex): changes with the records, the tokenizer, the chat template or the packing.
    pub content: String,
}

/// FNV-1a, 64 bit: small, fully specified, stable across platforms and versions.
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn bytes(&mut self, b: &[u8]) {
        for &x in b {
            self.0 ^= x as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn u64(&mut self, v: u64) {
        self.bytes(&v.to_le_bytes());
    }
}

impl DataFingerprint {
    /// The fingerprint of `ds`, read from `source`, packed with `packing`, served `local`
    /// packs per micro-batch and `global` per step.
    pub fn of(ds: &PackedDataset, source: &DatasetSource, packing: &PackingOptions, global: usize, local: usize) -> Self {
        let (path, split, max_samples) = (&source.path, &source.split, source.max_samples);
        // the recipe's spelling of the format, as earlier checkpoints recorded it
        let format = format!("{:?}", source.format).to_lowercase();
        let files = ds
            .read_report
            .files
            .iter()
            .map(|f| {
                let name = f.strip_prefix(path).unwrap_or(f).display().to_string();
                (name, std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
            })
            .collect();
        let mut h = Fnv::new();
        for pack in &ds.packs {
            h.u64(pack.samples.len() as u64);
            for s in &pack.samples {
                h.u64(s.ids.len() as u64);
                s.ids.iter().for_each(|&t| h.u64(t as u64));
                s.labels.iter().for_each(|&t| h.u64(t as u64));
            }
        }
        Self {
            path: path.display().to_string(),
            format: format.to_string(),
            split: split.to_string(),
            max_samples,
            files,
            packed_sequence_size: packing.max_length,
            drop_long_samples: packing.drop_long_samples,
            seed: packing.seed,
            global_batch_size: global,
            local_batch_size: local,
            packs: ds.packs.len(),
            content: format!("{:016x}", h.0),
        }
    }

    /// What differs from `saved` to `self`, one line per field (recipe key: saved → now);
    /// empty when the data order is the same.
    pub fn differences(&self, saved: &DataFingerprint) -> Vec<String> {
        let mut out = Vec::new();
        let mut field = |key: &str, was: String, now: String| {
            if was != now {
                out.push(format!("{key}: {was} → {now}"));
            }
        };
        field("dataset.path", saved.path.clone(), self.path.clone());
        field("dataset.format", saved.format.clone(), self.format.clone());
        field("dataset.split", saved.split.clone(), self.split.clone());
        field("dataset.max_samples", format!("{:?}", saved.max_samples), format!("{:?}", self.max_samples));
        field("packed_sequence.packed_sequence_size", saved.packed_sequence_size.to_string(), self.packed_sequence_size.to_string());
        field("packed_sequence.drop_long_samples", saved.drop_long_samples.to_string(), self.drop_long_samples.to_string());
        field("rng.seed", saved.seed.to_string(), self.seed.to_string());
        field("step_scheduler.global_batch_size", saved.global_batch_size.to_string(), self.global_batch_size.to_string());
        field("step_scheduler.local_batch_size", saved.local_batch_size.to_string(), self.local_batch_size.to_string());
        for (name, size) in &saved.files {
            match self.files.get(name) {
                None => out.push(format!("dataset file {name}: gone")),
                Some(now) if now != size => out.push(format!("dataset file {name}: {size} → {now} bytes")),
                _ => {}
            }
        }
        for name in self.files.keys().filter(|n| !saved.files.contains_key(*n)) {
            out.push(format!("dataset file {name}: new"));
        }
        if saved.packs != self.packs {
            out.push(format!("packs: {} → {}", saved.packs, self.packs));
        }
        if out.is_empty() && saved.content != self.content {
            out.push("packed token content differs (records, tokenizer or chat template changed)".into());
        }
        out
    }
}
