//! Checkpoint loading and saving: the published layout round trip, sharded indexes, dtypes,
//! ignored keys, and the error report for every kind of bad checkpoint.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::DType;
use common::*;
use glm5_burn::checkpoint::safetensors_io::{serialize, OwnedTensor};
use glm5_burn::checkpoint::{load_causal_lm, save_causal_lm, LoadOptions};
use glm5_burn::Outputs;
use glm5_burn::{CheckpointError, ForwardOptions};
use safetensors::tensor::Dtype;

fn write_all(path: &Path, t: &BTreeMap<String, OwnedTensor>) {
    std::fs::write(path, serialize(t).unwrap()).unwrap();
}

/// A copy of a fixture checkpoint with its tensors edited by `edit`.
fn edited(case: &str, edit: impl FnOnce(&mut BTreeMap<String, OwnedTensor>)) -> tempfile::TempDir {
    let src = fixtures().join(case);
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let mut t = read_all(&src.join("model.safetensors"));
    edit(&mut t);
    write_all(&dir.path().join("model.safetensors"), &t);
    dir
}

fn load_err(dir: &Path) -> String {
    match load_causal_lm::<B>(dir, &Default::default(), &LoadOptions::default()) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn logits(dir: &Path, opts: &LoadOptions) -> Vec<f32> {
    let device = Default::default();
    let m = load_causal_lm::<B>(dir, &device, opts).unwrap();
    let io = Io::open(&fixtures().join("base_k4").join("io.safetensors"));
    host(m.model.forward(io.ids(), &ForwardOptions::default(), Outputs::default()).unwrap().logits.cast(DType::F32))
}

#[test]
fn load_save_round_trip_is_byte_identical() {
    for case in ["base_k4", "quirks", "shared_pair"] {
        let src = fixtures().join(case);
        let loaded = load_causal_lm::<B>(&src, &Default::default(), &LoadOptions::default()).unwrap();
        let out = tempfile::tempdir().unwrap();
        save_causal_lm(&loaded.model, &loaded.config, out.path()).unwrap();
        let a = read_all(&src.join("model.safetensors"));
        let b = read_all(&out.path().join("model.safetensors"));
        assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{case}: tensor names");
        for (k, ta) in &a {
            let tb = &b[k];
            assert_eq!((ta.dtype, &ta.shape), (tb.dtype, &tb.shape), "{case}: {k}");
            assert!(ta.data == tb.data, "{case}: {k} values differ");
        }
        // the written checkpoint loads again
        load_causal_lm::<B>(out.path(), &Default::default(), &LoadOptions::default()).unwrap();
    }
}

#[test]
fn f16_source_loads_exactly() {
    let dir = edited("base_k4", |t| {
        for v in t.values_mut() {
            let vals: Vec<f32> = v.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            v.data = vals.iter().flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes()).collect();
            v.dtype = Dtype::F16;
        }
    });
    let loaded = load_causal_lm::<B>(dir.path(), &Default::default(), &LoadOptions::default()).unwrap();
    let out = tempfile::tempdir().unwrap();
    save_causal_lm(&loaded.model, &loaded.config, out.path()).unwrap();
    let a = read_all(&dir.path().join("model.safetensors"));
    let b = read_all(&out.path().join("model.safetensors"));
    for (k, ta) in &a {
        let va = glm5_burn::checkpoint::dtype::decode_f32(ta.dtype, &ta.data).unwrap();
        let vb = glm5_burn::checkpoint::dtype::decode_f32(b[k].dtype, &b[k].data).unwrap();
        assert_eq!(va, vb, "{k}: F16 values must load exactly into F32");
    }
}

#[test]
fn bf16_checkpoint_round_trips_in_bf16() {
    let dir = edited("base_k4", |t| {
        for v in t.values_mut() {
            let vals: Vec<f32> = v.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            v.data = vals.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect();
            v.dtype = Dtype::BF16;
        }
    });
    let cfg = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    let loaded = load_causal_lm::<B>(dir.path(), &Default::default(), &LoadOptions::with_dtype(DType::BF16)).unwrap();
    let out = tempfile::tempdir().unwrap();
    save_causal_lm(
        &loaded.model,
        &glm5_burn::checkpoint::CheckpointConfig::from_json(serde_json::from_str(&cfg).unwrap(), "config.json").unwrap(),
        out.path(),
    )
    .unwrap();
    let a = read_all(&dir.path().join("model.safetensors"));
    let b = read_all(&out.path().join("model.safetensors"));
    for (k, ta) in &a {
        let tb = &b[k];
        // fp32-kept tensors (A_log, dt_bias, conv taps, router bias, mHC base/scale) come back
        // as F32 holding exactly the BF16 values
        let va = glm5_burn::checkpoint::dtype::decode_f32(ta.dtype, &ta.data).unwrap();
        let vb = glm5_burn::checkpoint::dtype::decode_f32(tb.dtype, &tb.data).unwrap();
        assert_eq!(va, vb, "{k}");
        if tb.dtype == Dtype::BF16 {
            assert!(ta.data == tb.data, "{k}");
        }
    }
}

#[test]
fn sharded_index_loads_the_same_weights() {
    let src = fixtures().join("base_k4");
    let all = read_all(&src.join("model.safetensors"));
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    let mut map = serde_json::Map::new();
    for (i, (k, v)) in all.into_iter().enumerate() {
        let file = if i % 2 == 0 { "model-00001-of-00002.safetensors" } else { "model-00002-of-00002.safetensors" };
        map.insert(k.clone(), file.into());
        if i % 2 == 0 {
            a.insert(k, v)
        } else {
            b.insert(k, v)
        };
    }
    write_all(&dir.path().join("model-00001-of-00002.safetensors"), &a);
    write_all(&dir.path().join("model-00002-of-00002.safetensors"), &b);
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    assert_eq!(logits(dir.path(), &LoadOptions::default()), logits(&src, &LoadOptions::default()));

    // an index naming a shard that does not exist
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("does not exist"), "{e}");
}

#[test]
fn every_problem_is_listed_in_one_report() {
    let dir = edited("base_k4", |t| {
        t.remove("model.language_model.layers.1.self_attn.q_conv1d.weight");
        t.remove("model.language_model.layers.3.mlp.experts.5.up_proj.weight");
        let mut extra = t["model.language_model.norm.weight"].clone();
        extra.shape = vec![extra.shape[0]];
        t.insert("model.language_model.layers.2.self_attn.bogus.weight".into(), extra);
        let w = t.get_mut("model.language_model.layers.3.self_attn.kv_b_proj.weight").unwrap();
        w.shape = vec![w.shape[1], w.shape[0]];
    });
    let e = load_err(dir.path());
    for needle in [
        "missing     model.language_model.layers.1.self_attn.q_conv1d.weight",
        "missing     model.language_model.layers.3.mlp.experts.5.up_proj.weight",
        "unexpected  model.language_model.layers.2.self_attn.bogus.weight",
        "wrong shape model.language_model.layers.3.self_attn.kv_b_proj.weight",
        "4 problem(s)",
    ] {
        assert!(e.contains(needle), "report lacks {needle:?}:\n{e}");
    }
}

#[test]
fn truncated_file_and_bad_config_are_clear_errors() {
    let dir = edited("base_k4", |_| {});
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");

    let dir = edited("base_k4", |_| {});
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["text_config"]["index_topk"] = 10.into();
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("config.json") && e.contains("index_topk") && e.contains("divisible"), "{e}");

    let e = load_err(Path::new("/nonexistent/checkpoint"));
    assert!(e.contains("/nonexistent/checkpoint/config.json"), "{e}");
}

#[test]
fn unsupported_dtype_names_the_tensor() {
    let dir = edited("base_k4", |t| {
        let w = t.get_mut("model.language_model.layers.0.self_attn.A_log").unwrap();
        w.dtype = Dtype::I32;
    });
    let e = load_err(dir.path());
    assert!(e.contains("model.language_model.layers.0.self_attn.A_log") && e.contains("I32"), "{e}");
}

#[test]
fn mtp_layer_shared_head_and_vision_keys_are_skipped() {
    let dir = edited("base_k4", |t| {
        let v = t["model.language_model.norm.weight"].clone();
        t.insert("model.language_model.layers.4.eh_proj.weight".into(), v.clone()); // MTP at num_hidden_layers
        t.insert("model.language_model.layers.4.shared_head.norm.weight".into(), v.clone());
        t.insert("model.visual.post_layernorm.weight".into(), v);
    });
    let loaded = load_causal_lm::<B>(dir.path(), &Default::default(), &LoadOptions::default()).unwrap();
    assert_eq!(loaded.skipped.len(), 3, "{:?}", loaded.skipped);
    assert_eq!(logits(dir.path(), &LoadOptions::default()), logits(&fixtures().join("base_k4"), &LoadOptions::default()));

    // a layer index past the MTP layer is not ignored
    let dir = edited("base_k4", |t| {
        let v = t["model.language_model.norm.weight"].clone();
        t.insert("model.language_model.layers.5.eh_proj.weight".into(), v);
    });
    assert!(load_err(dir.path()).contains("unexpected  model.language_model.layers.5.eh_proj.weight"));
    // ... unless the load is not strict
    let relaxed = LoadOptions { strict: false, ..LoadOptions::default() };
    let loaded = load_causal_lm::<B>(dir.path(), &Default::default(), &relaxed).unwrap();
    assert_eq!(loaded.skipped, vec!["model.language_model.layers.5.eh_proj.weight".to_string()]);
}

#[test]
fn duplicate_tensor_across_shards_is_rejected() {
    let e: CheckpointError = {
        let src = fixtures().join("base_k4");
        let all = read_all(&src.join("model.safetensors"));
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
        write_all(&dir.path().join("a.safetensors"), &all);
        write_all(&dir.path().join("b.safetensors"), &all);
        let map: serde_json::Map<String, serde_json::Value> = all.keys().map(|k| (k.clone(), "a.safetensors".into())).collect();
        let mut idx = serde_json::json!({"weight_map": map});
        idx["weight_map"]["lm_head.weight"] = "b.safetensors".into();
        std::fs::write(dir.path().join("model.safetensors.index.json"), idx.to_string()).unwrap();
        match load_causal_lm::<B>(dir.path(), &Default::default(), &LoadOptions::default()) {
            Ok(_) => panic!("loaded"),
            Err(e) => e,
        }
    };
    assert!(e.to_string().contains("lm_head.weight"), "{e}");
}

/// A NaN or infinity in any BF16/F32 weight is an error naming the tensor and its shard
/// (FP8 NaN codes already are); `allow_non_finite` loads it anyway. A non-positive norm ε in
/// config.json is refused by the config validator, naming the field.
#[test]
fn non_finite_weights_and_bad_epsilons_are_refused() {
    let name = "model.language_model.layers.1.mlp.experts.2.up_proj.weight";
    for (bad, label) in [(f32::NAN, "NaN"), (f32::INFINITY, "inf"), (f32::NEG_INFINITY, "-inf")] {
        let dir = edited("base_k4", |t| {
            let w = t.get_mut(name).unwrap();
            let mut v = glm5_burn::checkpoint::dtype::decode_f32(w.dtype, &w.data).unwrap();
            v[3] = bad;
            v[7] = bad;
            w.data = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            w.dtype = Dtype::F32;
        });
        let e = load_err(dir.path());
        assert!(e.contains(name) && e.contains("model.safetensors") && e.contains("2 non-finite") && e.contains("index 3"), "{label}: {e}");
        let opts = LoadOptions { allow_non_finite: true, ..LoadOptions::default() };
        load_causal_lm::<B>(dir.path(), &Default::default(), &opts).unwrap();
    }
    // bf16 too
    let dir = edited("base_k4", |t| {
        let w = t.get_mut(name).unwrap();
        let v = glm5_burn::checkpoint::dtype::decode_f32(w.dtype, &w.data).unwrap();
        let mut b: Vec<u8> = v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
        b[0..2].copy_from_slice(&half::bf16::NAN.to_le_bytes());
        w.data = b;
        w.dtype = Dtype::BF16;
    });
    assert!(load_err(dir.path()).contains(name));

    for (section, field, v) in [("text_config", "rms_norm_eps", -1e-5), ("text_config", "rms_norm_eps", 0.0), ("text_config", "hc_eps", -1.0)] {
        let dir = edited("base_k4", |_| {});
        let cfg_path = dir.path().join("config.json");
        let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
        cfg[section][field] = v.into();
        std::fs::write(&cfg_path, cfg.to_string()).unwrap();
        let e = load_err(dir.path());
        assert!(e.contains(field) && e.contains("positive"), "{field} = {v}: {e}");
    }
}
