//! The loader's memory on a generated multi-shard checkpoint, counted exactly by a counting
//! global allocator: a load holds the destination tensors and, beyond them, a transient far
//! below one tensor (`checkpoint::read` writes each checkpoint tensor straight into its
//! parameter's buffer in the target dtype; no f32 staging copy, no transposed copy, no
//! conversion afterwards).
//!
//! The checkpoint is the `base_k4` model with a 65,536-token vocabulary, so that the embedding
//! and the LM head (2 Mi values each) dwarf everything else; its values are random BF16, in
//! 50 kB shards. (The resident set at the real width, file pages included, is what the
//! `load_memory` example measures: `docs/checkpoints.md`.)

mod common;

use std::path::Path;

use burn::backend::Flex;
use burn::tensor::DType;
use common::counting::{live, peak_during, Counting};
use glm5_burn::checkpoint::inventory::inventory;
use glm5_burn::checkpoint::writer::{index_json, plan_shards, write_safetensors, PlannedTensor};
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::Glm5Config;
use safetensors::tensor::Dtype;

#[global_allocator]
static GLOBAL: Counting = Counting;

const VOCAB: usize = 65_536;

/// A random BF16 checkpoint of the enlarged `base_k4` config in shards of ≤ 50 kB; returns the
/// number of values and of shards.
fn generate(dir: &Path) -> (usize, usize) {
    let text = std::fs::read_to_string(common::fixtures().join("base_k4/config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["text_config"]["vocab_size"] = VOCAB.into();
    let config = Glm5Config::from_hf_value(&json).unwrap();
    let tensors: Vec<PlannedTensor> =
        inventory(&config, false, false).into_iter().map(|e| PlannedTensor { name: e.name, dtype: Dtype::BF16, shape: e.shape }).collect();
    let values = tensors.iter().map(|t| t.shape.iter().product::<usize>()).sum();
    let shards = plan_shards(tensors, 50_000);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for (file, ts) in &shards {
        write_safetensors(&dir.join(file), ts, |i, out| {
            let n: usize = ts[i].shape.iter().product();
            let mut buf = Vec::with_capacity(2 * n);
            for _ in 0..n {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                buf.extend_from_slice(&half::bf16::from_f32(0.1 * u).to_bits().to_le_bytes());
            }
            out.write_all(&buf).map_err(|error| glm5_burn::CheckpointError::Io { path: dir.join(file), error })
        })
        .unwrap();
    }
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_vec_pretty(&index_json(&shards)).unwrap()).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&json).unwrap()).unwrap();
    (values, shards.len())
}

#[test]
fn a_load_holds_its_tensors_and_a_transient_far_below_one_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let (values, shards) = generate(dir.path());
    assert!(shards >= 4, "{shards} shards");
    let hidden = 32;
    for (dtype, width) in [(DType::BF16, 2usize), (DType::F32, 4)] {
        let largest = VOCAB * hidden * width; // the embedding and the LM head
        let before = live();
        let mut held = 0;
        let peak = peak_during(|| {
            let loaded = load_causal_lm::<Flex>(dir.path(), &Default::default(), &LoadOptions::with_dtype(dtype)).unwrap();
            held = live() - before;
            drop(loaded);
        });
        let transient = peak - held;
        println!("{dtype:?}: holds {held} B for {values} values; transient above that {transient} B; largest tensor {largest} B");
        // everything loaded is held (fp32-kept tensors make it a little more than values × width)
        assert!(held as usize >= values * width, "{dtype:?}: holds {held} B for {values} values of {width} B");
        assert!(held as usize <= values * width * 21 / 20, "{dtype:?}: holds {held} B for {values} values of {width} B");
        // staging a tensor in f32, transposing it or converting it afterwards costs ≥ 1 tensor
        assert!(transient as usize <= largest / 8, "{dtype:?}: transient {transient} B above the loaded model, largest tensor {largest} B");
    }
}
