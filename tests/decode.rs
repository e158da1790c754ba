//! Decoding with caches (`Glm5ForCausalLM::prefill` / `decode_step`) against the
//! whole-sequence forward: prefill the first `P` tokens of each fixture, then feed the rest one
//! token at a time (and, in one case, three at a time). The logits of every decoded position
//! must equal the full forward's (the parity bars: mean KL ≤ 1e-10, max|Δ| ≤ 1e-4, top-1 where
//! the margin exceeds 1e-4) and HF's float64 logits stored in the fixture, with `P` chosen so
//! that several pools complete and the tail moves during decoding. Covers full and `shared`
//! indexers, kpool 4 and 16, no tail, left padding, the chunked and recurrent KDA forms, and
//! a multimodal prompt whose images are embedded at prefill.

mod common;

use burn::backend::Flex;
use burn::tensor::Tensor;
use common::*;
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions, LoadedModel};
use glm5_burn::config::LayerType;
use glm5_burn::text::{AttentionImpl, KdaImpl};
use glm5_burn::ForwardOptions;
use glm5_burn::{ModelInput, Outputs};

type B = Flex;

struct Case {
    name: &'static str,
    /// tokens decoded after the prefill
    decoded: usize,
    /// tokens per decode step
    step: usize,
}

fn host3(t: Tensor<B, 3>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

/// Logits `[B, P−1.., V]` of the decoded positions (the prefill's last one first).
fn decode_logits(model: &LoadedModel<B>, io: &Io, case: &Case, opts: &ForwardOptions) -> (Vec<f32>, usize) {
    let shape = io.shape("input_ids");
    let (b, s) = (shape[0], shape[1]);
    let ids = io.i64("input_ids");
    let mask: Vec<bool> = io.i64("attention_mask").iter().map(|&m| m != 0).collect();
    let p = s - case.decoded;
    let prompt: Vec<i64> = ids.chunks(s).flat_map(|r| r[..p].to_vec()).collect();
    let prompt_mask: Vec<bool> = mask.chunks(s).flat_map(|r| r[..p].to_vec()).collect();
    let input = ModelInput::new(prompt, b, p).with_mask(prompt_mask).with_images(io.images());
    let (first, mut cache) = model.model.prefill(input, opts).expect("prefill");
    let v = first.dims()[2];
    // per row: logits of positions p−1 .. s−1
    let mut rows: Vec<Vec<f32>> = host3(first).chunks(v).map(|r| r.to_vec()).collect();
    let mut at = p;
    while at < s {
        let t = case.step.min(s - at);
        let next: Vec<i64> = ids.chunks(s).flat_map(|r| r[at..at + t].to_vec()).collect();
        let logits = host3(model.model.decode_step(&next, &mut cache, opts).expect("decode step"));
        for (r, row) in rows.iter_mut().enumerate() {
            row.extend_from_slice(&logits[r * t * v..(r + 1) * t * v]);
        }
        at += t;
    }
    assert_eq!(cache.len(), s, "{}: cache length", case.name);
    (rows.concat(), v)
}

/// The same positions of a `[B, S, V]` buffer.
fn tail(full: &[f32], b: usize, s: usize, v: usize, from: usize) -> Vec<f32> {
    (0..b).flat_map(|r| full[(r * s + from) * v..(r + 1) * s * v].to_vec()).collect()
}

fn check(case: &Case, opts: ForwardOptions, label: &str) {
    let dir = fixtures().join(case.name);
    let io = Io::open(&dir.join("io.safetensors"));
    let device = Default::default();
    let load = LoadOptions { vision: io.has("pixel_values"), ..LoadOptions::default() };
    let model = load_causal_lm::<B>(&dir, &device, &load).unwrap();
    let shape = io.shape("input_ids");
    let (b, s) = (shape[0], shape[1]);
    let ids = io.i64("input_ids");
    let mask: Vec<bool> = io.i64("attention_mask").iter().map(|&m| m != 0).collect();
    let (decoded, v) = decode_logits(&model, &io, case, &opts);
    // the whole-sequence forward on the same options
    let input = ModelInput::new(ids.clone(), b, s).with_mask(mask.clone()).with_images(io.images());
    let full = model.model.forward(input, &opts, Outputs::default()).unwrap().logits;
    let from = s - case.decoded - 1;
    let full = tail(&host3(full), b, s, v, from);
    let hf = tail(&io.f32("logits"), b, s, v, from);
    let keep: Vec<bool> = (0..b).flat_map(|r| mask[r * s + from..(r + 1) * s].to_vec()).collect();
    for (reference, what) in [(&full, "full forward"), (&hf, "HF float64")] {
        let st = logit_stats(reference, &decoded, v, &keep);
        println!(
            "| {} | {label} | vs {what} | {} positions | mean KL {:.1e} | max|Δ| {:.1e} | top-1 {:.0}% ({}) |",
            case.name,
            st.positions,
            st.mean_kl,
            st.max_abs,
            st.top1 * 100.0,
            st.top1_positions
        );
        assert!(st.mean_kl <= 1e-10, "{}/{label} vs {what}: mean KL {:e}", case.name, st.mean_kl);
        assert!(st.max_abs <= 1e-4, "{}/{label} vs {what}: max|Δ| {:e}", case.name, st.max_abs);
        assert_eq!(st.top1, 1.0, "{}/{label} vs {what}: top-1 agreement {}", case.name, st.top1);
        assert!(st.top1_positions > 0);
    }
}

/// Fixtures with kpool 4 decode 13 tokens (three pools complete, the tail cycles through
/// every length); kpool 16 decodes 40 (two pools complete).
const CASES: &[Case] = &[
    Case { name: "base_k4", decoded: 13, step: 1 },
    Case { name: "leftpad", decoded: 13, step: 1 },
    Case { name: "shared_pair", decoded: 13, step: 1 },
    Case { name: "kpool16", decoded: 40, step: 1 },
    Case { name: "notail", decoded: 13, step: 1 },
    Case { name: "softplus", decoded: 13, step: 1 },
    Case { name: "release_slice", decoded: 13, step: 1 },
];

#[test]
fn decoded_logits_equal_the_full_forward_chunked_kda() {
    for case in CASES {
        check(case, ForwardOptions::default(), "chunked KDA, dense prefill");
    }
}

#[test]
fn decoded_logits_equal_the_full_forward_recurrent_kda_sparse_prefill() {
    let opts = ForwardOptions { kda: KdaImpl::Recurrent, attention: AttentionImpl::Sparse, ..Default::default() };
    for case in CASES {
        check(case, opts, "recurrent KDA, sparse prefill");
    }
}

#[test]
fn steps_of_several_tokens_equal_the_full_forward() {
    check(&Case { name: "leftpad", decoded: 14, step: 3 }, ForwardOptions::default(), "3 tokens per step");
    check(&Case { name: "kpool16", decoded: 40, step: 5 }, ForwardOptions::default(), "5 tokens per step");
}

#[test]
fn multimodal_prompt_then_text_decoding_equals_the_full_forward() {
    // images sit at positions ≤ 22 of the 48-token rows; row 1 is left-padded
    check(&Case { name: "vlm", decoded: 20, step: 1 }, ForwardOptions::default(), "VLM");
}

#[test]
fn cache_grows_by_latent_and_indexer_rows_only() {
    let dir = fixtures().join("base_k4");
    let device = Default::default();
    let model = load_causal_lm::<B>(&dir, &device, &LoadOptions::default()).unwrap();
    let c = &model.config.resolved.text_config;
    let opts = ForwardOptions::default();
    let (_, mut cache) = model.model.prefill(ModelInput::row(vec![1, 2, 3, 4, 5]), &opts).unwrap();
    let before = cache.bytes();
    model.model.decode_step(&[6], &mut cache, &opts).unwrap();
    let after = cache.bytes();
    assert_eq!(after.kda, before.kda, "KDA caches are constant in the context");
    let dsa = c.layer_types.iter().filter(|&&t| t == LayerType::IndexedAttention).count(); // all with full indexers here
    assert_eq!(after.latent - before.latent, dsa * c.kv_lora_rank * 4, "one f32 latent row per DSA layer");
    // keys + gates per token; the pooled keys grow by one pool every kpool tokens
    assert_eq!(
        after.indexer - before.indexer,
        dsa * 2 * c.index_head_dim * 4 + dsa * c.index_head_dim * 4 * ((6usize.div_ceil(c.index_kpool)) - 5usize.div_ceil(c.index_kpool))
    );
    let e = model.model.decode_step(&[], &mut cache, &opts).unwrap_err().to_string();
    assert!(e.contains("input_ids"), "{e}");
    let e = model.model.decode_step(&[1000], &mut cache, &opts).unwrap_err().to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
}
