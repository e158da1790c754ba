//! Generation (`generate::decode`) against HF `generate(do_sample=False)` run in float64 on the
//! model fixtures (`make_fixtures.py generate_base_k4 generate_leftpad generate_vlm`): the same
//! sequences — one row stopping at its EOS before `max_new_tokens`; two left-padded rows, one
//! ending mid-batch and padded while the other runs to the limit; three multimodal prompts
//! (images, a left-padded row, one ending mid-batch) — with every step's tokens streamed;
//! bad inputs are errors naming them.

mod common;

use burn::backend::Flex;
use common::*;
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::generate::{generate, generate_with, GenerateOptions, SamplingConfig, StopStrings, StoppingCriteria};
use glm5_burn::{ForwardOptions, Images, ModelInput};

fn hf_case(name: &str) {
    let dir = fixtures().join(name);
    let io = Io::open(&dir.join("generate.safetensors"));
    let shape = io.shape("input_ids");
    let (b, s) = (shape[0], shape[1]);
    let ids = io.i64("input_ids");
    let mask: Vec<bool> = io.i64("attention_mask").iter().map(|&m| m != 0).collect();
    let want = io.i64("sequences");
    let device = Default::default();
    let loaded = load_causal_lm::<Flex>(&dir, &device, &LoadOptions { vision: io.has("pixel_values"), ..LoadOptions::default() }).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: io.i64("max_new_tokens")[0] as usize,
        sampling: SamplingConfig::default(),
        eos_token_ids: io.i64("eos_token_id"),
        pad_token_id: io.i64("pad_token_id")[0],
        max_positions: loaded.config.resolved.text_config.max_position_embeddings,
    };
    let mut streamed: Vec<Vec<i64>> = Vec::new();
    let prompt = ModelInput::new(ids, b, s).with_mask(mask).with_images(io.images());
    let out = generate(&loaded.model, prompt, &opts, &ForwardOptions::default(), |t| streamed.push(t.to_vec())).unwrap();
    let len = want.len() / b;
    assert_eq!(out.new_tokens, len - s, "{name}: tokens generated");
    assert_eq!(out.sequences, want, "{name}: sequences differ from HF generate");
    assert_eq!(streamed.len(), out.new_tokens);
    for (step, tokens) in streamed.iter().enumerate() {
        for r in 0..b {
            assert_eq!(tokens[r], want[r * len + s + step], "{name}: streamed token {step} of row {r}");
        }
    }
    println!("{name}: [{b}, {s}] → [{b}, {len}] as HF's greedy generate, ended {:?}", out.ended);
}

#[test]
fn greedy_generation_stops_at_eos_like_hf() {
    hf_case("base_k4");
}

#[test]
fn left_padded_batch_pads_the_row_that_ended_like_hf() {
    hf_case("leftpad");
}

#[test]
fn multimodal_batch_with_left_padding_like_hf() {
    // three images in the prompts (prefill only), row 1 left-padded, row 0 ends mid-batch
    hf_case("vlm");
}

#[test]
fn bad_inputs_are_errors_naming_them() {
    let dir = fixtures().join("base_k4");
    let device = Default::default();
    let loaded = load_causal_lm::<Flex>(&dir, &device, &LoadOptions::default()).unwrap();
    let opts = GenerateOptions { max_new_tokens: 2, sampling: SamplingConfig::default(), eos_token_ids: vec![], pad_token_id: 0, max_positions: 16 };
    let run = |ids: &[i64], seq: usize, opts: &GenerateOptions, images: Option<Images>| {
        let prompt = ModelInput::new(ids.to_vec(), 1, seq).with_images(images);
        generate(&loaded.model, prompt, opts, &ForwardOptions::default(), |_| {}).unwrap_err().to_string()
    };
    assert!(run(&[], 0, &opts, None).contains("empty prompt"));
    assert!(run(&[1; 20], 20, &opts, None).contains("more than max_position_embeddings (16)"));
    let zero = GenerateOptions { max_new_tokens: 0, ..opts.clone() };
    assert!(run(&[1, 2], 2, &zero, None).contains("max_new_tokens is 0"));
    let hot = GenerateOptions { sampling: SamplingConfig { do_sample: true, temperature: -1.0, ..SamplingConfig::default() }, ..opts.clone() };
    assert!(run(&[1, 2], 2, &hot, None).contains("temperature"));
    let e = run(&[1, 2], 2, &opts, Some(Images { pixel_values: vec![0.0; 4 * 1176], patch_dim: 1176, grid_thw: vec![[1, 2, 2]] }));
    assert!(e.contains("pixel_values") || e.contains("image"), "{e}");
}

/// A stopping rule that ends a row on the fixture's EOS token gives HF's sequences without any
/// EOS id — the hook ends rows and pads them exactly as EOS ids do.
#[test]
fn stopping_rule_ends_rows_like_an_eos_id() {
    let dir = fixtures().join("leftpad");
    let io = Io::open(&dir.join("generate.safetensors"));
    let (b, s) = (io.shape("input_ids")[0], io.shape("input_ids")[1]);
    let (ids, want) = (io.i64("input_ids"), io.i64("sequences"));
    let mask: Vec<bool> = io.i64("attention_mask").iter().map(|&m| m != 0).collect();
    let eos = io.i64("eos_token_id")[0];
    let loaded = load_causal_lm::<Flex>(&dir, &Default::default(), &LoadOptions::default()).unwrap();
    struct OnToken(i64, usize);
    impl StoppingCriteria for OnToken {
        fn ends(&mut self, _row: usize, sequence: &[i64]) -> bool {
            self.1 += 1;
            sequence.last() == Some(&self.0)
        }
    }
    let opts = GenerateOptions {
        max_new_tokens: io.i64("max_new_tokens")[0] as usize,
        sampling: SamplingConfig::default(),
        eos_token_ids: vec![],
        pad_token_id: io.i64("pad_token_id")[0],
        max_positions: 1 << 20,
    };
    let mut rule = OnToken(eos, 0);
    let prompt = ModelInput::new(ids, b, s).with_mask(mask);
    let out = generate_with(&loaded.model, prompt, &opts, &ForwardOptions::default(), &mut rule, |_| {}).unwrap();
    assert_eq!(out.sequences, want);
    assert_eq!(out.ended, [true, false]);
    // asked once per token of an unfinished row: row 0 ends at its third token
    assert_eq!(rule.1, 3 + out.new_tokens);
}

/// Stop strings end a row at the token that completes one (spanning tokens, overlapping the
/// newest), not later, and an occurrence further back does not stop it.
#[test]
fn stop_strings_end_at_the_completing_token() {
    let tok =
        tokenizers::Tokenizer::from_file(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/data/tiny_medpix/tokenizer.json")).unwrap();
    let text = "The lesion is in the upper left quadrant.";
    let ids: Vec<i64> = tok.encode(text, false).unwrap().get_ids().iter().map(|&i| i as i64).collect();
    let decode = |n: usize| tok.decode(&ids[..n].iter().map(|&i| i as u32).collect::<Vec<_>>(), false).unwrap();
    for stop in ["upper left", "quadrant", "n t", "."] {
        // the first prefix whose text shows the string, found by decoding prefixes
        let want = (1..=ids.len()).find(|&n| decode(n).contains(stop)).unwrap();
        let mut rule = StopStrings::new(&tok, &[stop.to_string()]).unwrap();
        let first = (1..=ids.len()).find(|&n| rule.ends(0, &ids[..n]));
        assert_eq!(first, Some(want), "{stop:?} in {:?}", (1..=ids.len()).map(decode).collect::<Vec<_>>());
        if want < ids.len() {
            // one token later the string is only further back (unless that token shows it again)
            let (before, after) = (decode(want), decode(want + 1));
            let again = after.match_indices(stop).any(|(i, _)| i + stop.len() > before.len());
            assert_eq!(rule.ends(0, &ids[..want + 1]), again, "{stop:?} one token after it completed");
        }
    }
    assert!(StopStrings::new(&tok, &[String::new()]).is_err());
}
