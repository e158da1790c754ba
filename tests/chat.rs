//! Chat format against the reference processor's `apply_chat_template` (fixture tokenizer
//! with the GLM special tokens and a GLM-5-style template): token ids identical, SFT labels
//! exactly the tokens of the reference's assistant mask.

mod common;

use glm5_burn::data::chat::ChatFormat;
use glm5_burn::data::image_processor::{ImageProcessor, RgbImage};
use serde_json::Value;

#[test]
fn ids_and_labels_match_the_reference_processor() {
    let dir = common::fixtures().join("chat");
    let chat = ChatFormat::from_dir(&dir).unwrap();
    let cases: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let proc = ImageProcessor::default();
    for (k, case) in cases.iter().enumerate() {
        // images in the order they appear
        let mut grids = Vec::new();
        for m in case["messages"].as_array().unwrap() {
            if let Some(parts) = m["content"].as_array() {
                for p in parts.iter().filter(|p| p["type"] == "image") {
                    let img = RgbImage::open(&dir.join(p["path"].as_str().unwrap())).unwrap();
                    grids.push(proc.process(&img).unwrap());
                }
            }
        }
        let tokens: Vec<usize> = grids.iter().map(|g| g.n_tokens(proc.merge_size)).collect();
        let ref_grids: Vec<[usize; 3]> = serde_json::from_value(case["image_grid_thw"].clone()).unwrap();
        assert_eq!(grids.iter().map(|g| g.grid_thw).collect::<Vec<_>>(), ref_grids, "case {k}: grids");
        let enc = chat.encode(&case["messages"], case["add_generation_prompt"].as_bool().unwrap(), &tokens).unwrap();
        let ref_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        let mask: Vec<u8> = serde_json::from_value(case["assistant_masks"].clone()).unwrap();
        assert_eq!(enc.ids, ref_ids, "case {k}: token ids");
        for (i, ((&id, &label), &m)) in enc.ids.iter().zip(&enc.labels).zip(&mask).enumerate() {
            assert_eq!(label, if m == 1 { id as i64 } else { -100 }, "case {k}: label of token {i}");
        }
        println!("case {k}: {} tokens, {} labelled", enc.ids.len(), enc.labels.iter().filter(|&&l| l != -100).count());
    }
}

#[test]
fn placeholder_count_mismatch_is_an_error() {
    let chat = ChatFormat::from_dir(&common::fixtures().join("chat")).unwrap();
    let msgs: Value = serde_json::json!([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]);
    let e = chat.encode(&msgs, true, &[]).unwrap_err().to_string();
    assert!(e.contains("1 <|image|> placeholders but 0 images"), "{e}");
    let e = ChatFormat::from_dir(std::path::Path::new("/nonexistent")).err().unwrap().to_string();
    assert!(e.contains("/nonexistent"), "{e}");
}
