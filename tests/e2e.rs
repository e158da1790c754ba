//! End to end: an image file and a prompt through our processor, chat format and model,
//! against the reference processor + model (float64) on the same tiny VLM and tokenizer.

mod common;

use common::*;
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::data::chat::ChatFormat;
use glm5_burn::data::image_processor::{ImageProcessor, RgbImage};
use glm5_burn::data::user_prompt;
use glm5_burn::ForwardOptions;

#[test]
fn image_and_prompt_to_logits_matches_reference() {
    let dir = fixtures().join("chat");
    let chat = ChatFormat::from_dir(&dir).unwrap();
    let image = RgbImage::open(&dir.join("b.png")).unwrap();
    let p = user_prompt(&chat, &ImageProcessor::default(), &[image], "What does the scan show?").unwrap();
    let io = Io::open(&dir.join("e2e.safetensors"));
    assert_eq!(p.ids, io.i64("input_ids"), "token ids");
    let device = Default::default();
    let loaded = load_causal_lm::<B>(&dir.join("model"), &device, &LoadOptions { vision: true, ..LoadOptions::default() }).unwrap();
    let out = loaded.model.forward(p.input(), &ForwardOptions::default(), glm5_burn::Outputs::default()).unwrap();
    let vocab = loaded.config.resolved.text_config.vocab_size;
    let st = logit_stats(&io.f32("logits"), &host(out.logits), vocab, &vec![true; p.ids.len()]);
    println!("e2e: mean KL {:.2e}, max|Δ| {:.2e}, top-1 {}", st.mean_kl, st.max_abs, st.top1);
    assert!(st.mean_kl <= 1e-10 && st.max_abs <= 1e-4 && st.top1 == 1.0, "{st:?}");
}
