//! Packed (THD) sequences: documents concatenated into one row with their boundaries give
//! the same logits as running each document on its own — KDA state and conv restart, and
//! attention, pools, tails and shared indexer selections stay inside each document.

mod common;

use burn::tensor::{Int, Tensor, TensorData};
use common::*;
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::{AttentionImpl, ForwardOptions, TokenMask};

#[test]
fn packed_documents_equal_separate_runs() {
    let device = Default::default();
    for case in ["base_k4", "shared_pair", "kpool16"] {
        let dir = fixtures().join(case);
        let m = load_causal_lm::<B>(&dir, &device, &LoadOptions::default()).unwrap();
        let vocab = m.config.text_config.vocab_size;
        let ids = Io::open(&dir.join("io.safetensors")).i64("input_ids");
        let lengths = [69usize, 5, 1, 55];
        let packed_ids: Vec<i64> = ids.iter().cycle().take(lengths.iter().sum()).copied().collect();
        for attention in [AttentionImpl::Dense, AttentionImpl::Sparse] {
            let opts = ForwardOptions { attention, ..Default::default() };
            let s: usize = lengths.iter().sum();
            let t = Tensor::<B, 2, Int>::from_data(TensorData::new(packed_ids.clone(), [1, s]), &device);
            let packed = host(m.model.forward(t.clone(), Some(TokenMask::packed(&lengths, &device)), &opts, false).logits);
            // without the boundaries the later documents see the earlier ones: the check bites
            let unbounded = host(m.model.forward(t, None, &opts, false).logits);
            let tail = lengths[0] * vocab..;
            assert!(max_abs_diff(&packed[tail.clone()], &unbounded[tail], vocab, &vec![true; s - lengths[0]]) > 1e-2);
            let mut start = 0;
            for &l in &lengths {
                let doc = Tensor::<B, 2, Int>::from_data(TensorData::new(packed_ids[start..start + l].to_vec(), [1, l]), &device);
                let alone = host(m.model.forward(doc, None, &opts, false).logits);
                let part = &packed[start * vocab..(start + l) * vocab];
                let keep = vec![true; l];
                let d = max_abs_diff(&alone, part, vocab, &keep);
                let scale = max_abs(&alone, vocab, &keep);
                assert!(d <= 1e-5 * scale, "{case}/{attention:?}: document at {start}..{}: max|Δ| {d:e} (scale {scale})", start + l);
                start += l;
            }
        }
    }
}
