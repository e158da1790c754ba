//! Packed (THD) sequences: documents concatenated into one row with their boundaries give
//! the same logits as running each document on its own — KDA state and conv restart, and
//! attention, pools, tails and shared indexer selections stay inside each document.

mod common;

use common::*;
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::{AttentionImpl, ForwardOptions};
use glm5_burn::{ModelInput, Outputs};

#[test]
fn packed_documents_equal_separate_runs() {
    let device = Default::default();
    for case in ["base_k4", "shared_pair", "kpool16"] {
        let dir = fixtures().join(case);
        let m = load_causal_lm::<B>(&dir, &device, &LoadOptions::default()).unwrap();
        let vocab = m.config.resolved.text_config.vocab_size;
        let ids = Io::open(&dir.join("io.safetensors")).i64("input_ids");
        // an empty document (as `cu_seqlens` with a repeated offset) among them
        let lengths = [69usize, 5, 0, 1, 55];
        let packed_ids: Vec<i64> = ids.iter().cycle().take(lengths.iter().sum()).copied().collect();
        for attention in [AttentionImpl::Dense, AttentionImpl::Sparse] {
            let opts = ForwardOptions { attention, ..Default::default() };
            let s: usize = lengths.iter().sum();
            let row = ModelInput::<B>::row(packed_ids.clone());
            let packed = host(m.model.forward(row.clone().with_documents(lengths.to_vec()), &opts, Outputs::default()).unwrap().logits);
            // without the boundaries the later documents see the earlier ones: the check bites
            let unbounded = host(m.model.forward(row, &opts, Outputs::default()).unwrap().logits);
            let tail = lengths[0] * vocab..;
            assert!(max_abs_diff(&packed[tail.clone()], &unbounded[tail], vocab, &vec![true; s - lengths[0]]) > 1e-2);
            let mut start = 0;
            for &l in lengths.iter().filter(|&&l| l > 0) {
                let doc = ModelInput::<B>::row(packed_ids[start..start + l].to_vec());
                let alone = host(m.model.forward(doc, &opts, Outputs::default()).unwrap().logits);
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

/// The multimodal form on the bundled tiny VLM: a THD row of several conversations, each with
/// its image, gives each conversation's logits and summed loss as when it runs alone (vision
/// attention per image, every text path per document).
///
/// Bar: 1e-5 of the logit scale, or twice this model's fp32 floor for a change of batch shape
/// alone, whichever is larger. The floor is measured here: the same conversation run as one row
/// and as two identical rows differs by ~1.6e-5 relative, because the vision tower's matmuls
/// round differently for a different number of patch rows (1e-6 relative on the features) and
/// the seeded tower's features are ~7× the token embeddings, so that rounding reaches the
/// logits amplified. Text-only rows show no such floor (bit-identical across batch shapes).
#[test]
fn packed_conversations_with_images_equal_separate_runs() {
    use glm5_burn::data::batch::MicroBatch;
    use glm5_burn::data::chat::ChatFormat;
    use glm5_burn::data::image_processor::ImageProcessor;
    use glm5_burn::data::loader::{PackedDataset, PackingOptions};
    use glm5_burn::data::{DatasetFormat, DatasetSource};
    use glm5_burn::train::step::forward_micro;
    use glm5_burn::Glm5ForCausalLM;

    let bundle = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/tiny_medpix");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(bundle.join("config.json")).unwrap()).unwrap();
    let config = glm5_burn::config::Glm5Config::from_hf_value(&json).unwrap();
    let device = Default::default();
    <B as burn::tensor::backend::Backend>::seed(&device, 5);
    let model = Glm5ForCausalLM::<B>::try_new_with_vision(&config, None, &device).unwrap();
    let chat = ChatFormat::from_dir(&bundle).unwrap();
    let packing = PackingOptions { max_length: 200, drop_long_samples: true, seed: 9 };
    let ds = PackedDataset::build(
        &DatasetSource { path: bundle.clone(), format: DatasetFormat::Parquet, split: "validation".into(), max_samples: None },
        &chat,
        ImageProcessor::default(),
        config.image_token_id,
        &packing,
    )
    .unwrap();
    let packed = ds.micro_batch(&[0]).unwrap();
    let docs = packed.documents.clone().unwrap();
    assert!(docs.len() >= 3, "{docs:?}");
    let vocab = config.text_config.vocab_size;
    for attention in [AttentionImpl::Dense, AttentionImpl::Sparse] {
        let opts = ForwardOptions { attention, ..Default::default() };
        let out = forward_micro(&model, &packed, &opts, None).unwrap().output;
        let all = host(out.logits.clone());
        let (packed_sum, packed_count) = glm5_burn::loss::lm_loss_sum(out.logits, &packed.labels);
        let packed_sum: f32 = packed_sum.into_scalar();
        let images = packed.images.as_ref().unwrap();
        let (mut start, mut patch) = (0, 0);
        let (mut sum, mut count) = (0f64, 0);
        for (k, &l) in docs.iter().enumerate() {
            let g = images.grid_thw[k];
            let rows = g[0] * g[1] * g[2];
            let alone = MicroBatch {
                ids: packed.ids[start..start + l].to_vec(),
                labels: packed.labels[start..start + l].to_vec(),
                batch: 1,
                seq: l,
                mask: None,
                documents: None,
                images: Some(glm5_burn::data::batch::Images {
                    pixel_values: images.pixel_values[patch * images.patch_dim..(patch + rows) * images.patch_dim].to_vec(),
                    patch_dim: images.patch_dim,
                    grid_thw: vec![g],
                }),
            };
            let o = forward_micro(&model, &alone, &opts, None).unwrap().output;
            let logits = host(o.logits.clone());
            let keep = vec![true; l];
            let d = max_abs_diff(&logits, &all[start * vocab..(start + l) * vocab], vocab, &keep);
            let scale = max_abs(&logits, vocab, &keep);
            let twice = MicroBatch {
                ids: alone.ids.repeat(2),
                labels: alone.labels.repeat(2),
                batch: 2,
                images: alone.images.clone().map(|i| glm5_burn::data::batch::Images {
                    pixel_values: i.pixel_values.repeat(2),
                    grid_thw: vec![g; 2],
                    ..i
                }),
                ..alone.clone()
            };
            let floor = max_abs_diff(&logits, &host(forward_micro(&model, &twice, &opts, None).unwrap().output.logits)[..l * vocab], vocab, &keep);
            println!("{attention:?}: conversation {k} ({l} tokens): packed vs alone max|Δ| {d:.2e}, batch-shape floor {floor:.2e}, scale {scale:.2}");
            assert!(d <= (1e-5 * scale).max(2.0 * floor), "{attention:?}: conversation {k}: max|Δ| {d:e} (scale {scale}, floor {floor:e})");
            let (s, c) = glm5_burn::loss::lm_loss_sum(o.logits, &alone.labels);
            sum += s.into_scalar() as f64;
            count += c;
            start += l;
            patch += rows;
        }
        assert_eq!(count, packed_count);
        assert!((sum - packed_sum as f64).abs() <= 1e-5 * sum.abs(), "{attention:?}: loss {sum} alone vs {packed_sum} packed");
    }
}

/// A batch carries its context-parallel shard as data (`ContextSplit`); the model runs it over
/// its own context-parallel group. A shard for a model without one, or made for another group
/// size, is an error naming both — not a forward over the wrong rows.
#[test]
fn a_context_shard_needs_the_models_group_of_its_size() {
    use glm5_burn::distributed::{Group, LocalGroup};
    use glm5_burn::text::context::ContextSplit;
    let device = Default::default();
    let mut m = load_causal_lm::<B>(&fixtures().join("base_k4"), &device, &LoadOptions::default()).unwrap().model;
    let ids: Vec<i64> = (0..16).collect();
    let split = ContextSplit::new(1, 2, vec![0..10, 10..16], 16).unwrap();
    assert_eq!((split.shard.clone(), split.docs.continues), (8..16, true));
    let run = |m: &glm5_burn::Glm5ForCausalLM<B>, split: ContextSplit| {
        m.forward(ModelInput::<B>::row(ids.clone()).with_context(split), &ForwardOptions::default(), Outputs::default())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let e = run(&m, split.clone());
    assert!(e.contains("shard 1 of 2") && e.contains("no context-parallel group") && e.contains("cp_size"), "{e}");
    m.language_model.context_group = Some(std::sync::Arc::new(LocalGroup) as Group);
    let e = run(&m, split);
    assert!(e.contains("shard 1 of 2") && e.contains("rank 0 of a context-parallel group of 1"), "{e}");
    let e = ContextSplit::new(2, 2, vec![0..8, 8..16], 16).unwrap_err().to_string();
    assert!(e.contains("context parallelism") && e.contains("rank 2"), "{e}");
    let e = ContextSplit::new(0, 3, vec![0..8, 8..16], 16).unwrap_err().to_string();
    assert!(e.contains("does not split into 3 equal shards"), "{e}");
}
