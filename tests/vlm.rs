//! The vision tower and the multimodal merge against the reference (float64 run of a tiny
//! VLM written by `save_pretrained`): two images of different sizes in one prompt, a second,
//! left-padded sample without images, a third with one image.

mod common;

use std::collections::BTreeMap;

use burn::tensor::Tensor;
use common::*;
use glm5_burn::checkpoint::{load_causal_lm, save_causal_lm, LoadOptions, LoadedModel};
use glm5_burn::ForwardOptions;
use glm5_burn::{Images, ModelInput, Outputs};

fn load() -> (LoadedModel<B>, Io) {
    let dir = fixtures().join("vlm");
    let opts = LoadOptions { vision: true, ..LoadOptions::default() };
    (load_causal_lm::<B>(&dir, &Default::default(), &opts).expect("VLM fixture loads"), Io::open(&dir.join("io.safetensors")))
}

fn grid(io: &Io) -> Vec<[usize; 3]> {
    io.i64("image_grid_thw").chunks(3).map(|g| [g[0] as usize, g[1] as usize, g[2] as usize]).collect()
}

#[test]
fn vision_tower_matches_reference() {
    let (m, io) = load();
    let device = Default::default();
    let pixels: Tensor<B, 2> = io.tensor("pixel_values", &device);
    let feats = host(m.model.visual.as_ref().unwrap().forward(pixels, &grid(&io)));
    let reference = io.f32("vision_features");
    let keep = vec![true; reference.len()];
    let d = max_abs_diff(&reference, &feats, 1, &keep);
    println!("vision features max|Δ| {d:.2e} (scale {:.2})", max_abs(&reference, 1, &keep));
    assert!(d <= 1e-5, "vision features max|Δ| {d:e}");
}

#[test]
fn multimodal_logits_match_reference() {
    let (m, io) = load();
    let mask = io.mask();
    let out = m.model.forward(io.ids().with_mask(mask.clone()).with_images(io.images()), &ForwardOptions::default(), Outputs::default()).unwrap();
    let st = logit_stats(&io.f32("logits"), &host(out.logits), m.config.resolved.text_config.vocab_size, &mask);
    println!("vlm logits: mean KL {:.2e}, max|Δ| {:.2e}, min cos {:.8}, top-1 {}", st.mean_kl, st.max_abs, st.min_cos, st.top1);
    assert!(st.mean_kl <= 1e-10 && st.max_abs <= 1e-4 && st.min_cos >= 0.99999 && st.top1 == 1.0, "{st:?}");
}

#[test]
fn bad_multimodal_inputs_are_errors() {
    let (m, io) = load();
    let device = Default::default();
    let shape = io.shape("input_ids");
    let (b, s) = (shape[0], shape[1]);
    let ids = io.i64("input_ids");
    let images = io.images().unwrap();
    let with_grid = |grid_thw: &[[usize; 3]]| Some(Images { grid_thw: grid_thw.to_vec(), ..images.clone() });
    let g = images.grid_thw.clone();
    let input = |ids: &[i64], images: Option<Images>| ModelInput::<B>::new(ids.to_vec(), b, s).with_images(images);
    let run = |ids: &[i64], images: Option<Images>| {
        m.model.forward(input(ids, images), &ForwardOptions::default(), Outputs::default()).err().map(|e| e.to_string())
    };
    // one placeholder too many
    let mut extra = ids.clone();
    extra[s + 20] = m.config.resolved.image_token_id; // sample 1, a text position
    let e = run(&extra, with_grid(&g)).expect("count mismatch");
    assert!(e.contains("do not match") && e.contains("10 <|image|>") && e.contains("9 image features"), "{e}");
    // placeholders without pixel values are embedded as ordinary tokens, as HF's forward does
    // (it looks for them only when pixel_values are given): every tool takes such ids alike
    assert_eq!(run(&ids, None), None, "placeholders without pixel_values run as text");
    // a grid that does not describe the pixel rows
    let e = run(&ids, with_grid(&[[1, 4, 6]])).expect("grid mismatch");
    assert!(e.contains("image_grid_thw") || e.contains("pixel_values"), "{e}");
    // image placeholders inside a video span
    let mut video = ids.clone();
    let first = video.iter().position(|&x| x == m.config.resolved.image_start_token_id).unwrap();
    video[first] = m.config.resolved.video_start_token_id;
    let e = run(&video, with_grid(&g)).expect("video rejected");
    assert!(e.contains("video inputs are not supported"), "{e}");
    // a text-only load cannot take images
    let text_only = load_causal_lm::<B>(&fixtures().join("vlm"), &device, &LoadOptions::default()).unwrap();
    let e = match text_only.model.forward(input(&ids, with_grid(&g)), &ForwardOptions::default(), Outputs::default()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a text-only model accepted images"),
    };
    assert!(e.contains("without its vision tower"), "{e}");
}

#[test]
fn vlm_round_trip_is_byte_identical() {
    let (m, _) = load();
    let out = tempfile::tempdir().unwrap();
    save_causal_lm(&m.model, &m.config, out.path()).unwrap();
    let read = |p: &std::path::Path| -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
        let bytes = std::fs::read(p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensors().into_iter().map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec()))).collect()
    };
    let a = read(&fixtures().join("vlm").join("model.safetensors"));
    let b = read(&out.path().join("model.safetensors"));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, v) in &a {
        assert!(v == &b[k], "{k} differs after load -> save");
    }
}
