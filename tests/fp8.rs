//! Block-FP8 checkpoints: E4M3 decoding of all 256 codes against PyTorch's float8 cast,
//! bit-exact dequantisation (F32 and UE8M0 scales, partial edge blocks) against an
//! independent NumPy oracle, logits against the reference run on the dequantised weights, and
//! clear errors for bad scales and NaN codes. Fixtures: `make_fixtures.py fp8`.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use glm5_burn::checkpoint::fp8::E4M3_TABLE;
use glm5_burn::checkpoint::safetensors_io::{serialize, OwnedTensor, SafetensorsFiles};
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::ForwardOptions;
use glm5_burn::Outputs;
use safetensors::tensor::Dtype;

fn oracle() -> Io {
    Io::open(&fixtures().join("fp8_oracle.safetensors"))
}

#[test]
fn e4m3_table_matches_pytorch_for_all_256_codes() {
    let reference = oracle().f32("e4m3_table");
    let mut nan_codes = Vec::new();
    for (code, (&ours, &theirs)) in E4M3_TABLE.iter().zip(&reference).enumerate() {
        if theirs.is_nan() {
            assert!(ours.is_nan(), "code {code:#04x}: ours {ours}, PyTorch NaN");
            nan_codes.push(code);
        } else {
            assert_eq!(ours.to_bits(), theirs.to_bits(), "code {code:#04x}: ours {ours}, PyTorch {theirs}");
        }
    }
    assert_eq!(nan_codes, vec![0x7F, 0xFF]);
}

#[test]
fn dequantisation_is_bit_exact_with_the_oracle() {
    let io = oracle();
    for variant in ["fp8_f32_scales", "fp8_ue8m0_scales"] {
        let dir = fixtures().join(variant);
        let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let mut files = SafetensorsFiles::open_dir(&dir).unwrap();
        files.set_fp8_block_from_config(&config).unwrap();
        assert!(!files.fp8_scales.is_empty());
        let mut partial = 0;
        for (name, _) in files.fp8_scales.clone() {
            let ours = files.read_f32(&name).unwrap();
            let theirs = io.f32(&format!("{variant}.{name}"));
            assert_eq!(ours.len(), theirs.len(), "{variant}: {name}");
            for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{variant}: {name}[{i}]: ours {a}, oracle {b}");
            }
            let shape = files.shape(&name).unwrap();
            partial += (!shape[0].is_multiple_of(16) || !shape[1].is_multiple_of(16)) as usize;
        }
        assert!(partial > 0, "{variant}: no weight with a partial edge block");
    }
}

#[test]
fn fp8_checkpoint_logits_match_reference_on_dequantised_weights() {
    let device = Default::default();
    let io = oracle();
    let mask = io.mask();
    let loaded = load_causal_lm::<B>(&fixtures().join("fp8_f32_scales"), &device, &LoadOptions::default()).unwrap();
    let out = loaded.model.forward(io.ids().with_mask(mask.clone()), &ForwardOptions::default(), Outputs::default()).unwrap();
    let st = logit_stats(&io.f32("logits"), &host(out.logits), 128, &mask);
    println!("fp8: mean KL {:.2e}, max|Δ| {:.2e}, top-1 {}", st.mean_kl, st.max_abs, st.top1);
    assert!(st.mean_kl <= 1e-10 && st.max_abs <= 1e-4 && st.top1 == 1.0, "{st:?}");
}

fn edited(edit: impl FnOnce(&mut BTreeMap<String, OwnedTensor>)) -> tempfile::TempDir {
    let src = fixtures().join("fp8_f32_scales");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let mut t = read_all(&src.join("model.safetensors"));
    edit(&mut t);
    std::fs::write(dir.path().join("model.safetensors"), serialize(&t).unwrap()).unwrap();
    dir
}

fn load_err(dir: &Path) -> String {
    match load_causal_lm::<B>(dir, &Default::default(), &LoadOptions::default()) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    }
}

const W: &str = "model.language_model.layers.3.self_attn.q_a_proj.weight";

#[test]
fn wrong_scale_grid_is_reported_with_the_tensor() {
    let dir = edited(|t| {
        let s = t.get_mut(&format!("{W}_scale_inv")).unwrap();
        s.shape = vec![1, 4]; // 24×32 in 16×16 blocks needs [2, 2]
    });
    let e = load_err(dir.path());
    assert!(e.contains(&format!("{W}_scale_inv")) && e.contains("[2, 2]") && e.contains("model.safetensors"), "{e}");
}

#[test]
fn nan_after_dequantisation_names_tensor_and_shard() {
    let dir = edited(|t| t.get_mut(W).unwrap().data[5] = 0x7F);
    let device = Default::default();
    let err = match load_causal_lm::<B>(dir.path(), &device, &LoadOptions::default()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("loaded a NaN weight"),
    };
    println!("{err}");
    assert!(err.contains(W) && err.contains("NaN") && err.contains("model.safetensors"), "{err}");
}

#[test]
fn unpaired_scale_and_scale_less_fp8_are_rejected() {
    let dir = edited(|t| {
        let s = t.remove(&format!("{W}_scale_inv")).unwrap();
        t.insert("model.language_model.layers.3.self_attn.nothing_scale_inv".into(), s);
    });
    let e = load_err(dir.path());
    assert!(e.contains("nothing_scale_inv") && e.contains("has no weight"), "{e}");

    let dir = edited(|t| {
        t.remove(&format!("{W}_scale_inv"));
    });
    let e = load_err(dir.path());
    assert!(e.contains(W) && e.contains("F8_E4M3"), "{e}");
    let _ = Dtype::F8_E4M3;
}
