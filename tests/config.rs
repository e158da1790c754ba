//! Config resolution against the reference: derived defaults (`layer_types`,
//! `mlp_layer_types`, `indexer_types` from `index_topk_pattern` / `index_topk_freq` /
//! `index_skip_topk_offset`, the `linear_attn_config` dict, `full_attention` alias, the flat
//! text-only form) and the reference's validation errors. Cases and expected values come
//! from `Glm5NextConfig` in transformers 5.23.0 (`tests/fixtures/config_cases.json`).

mod common;

use glm5_burn::config::{Glm5Config, TextConfig};
use glm5_burn::ConfigError;
use serde_json::{json, Value};

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(common::fixtures().join("config_cases.json")).unwrap();
    serde_json::from_str::<Value>(&text).unwrap().as_array().unwrap().clone()
}

#[test]
fn derived_defaults_match_the_reference() {
    for case in cases().iter().filter(|c| c.get("resolved").is_some()) {
        let name = case["name"].as_str().unwrap();
        let cfg = Glm5Config::from_hf_value(&case["input"]).unwrap_or_else(|e| panic!("{name}: {e}"));
        let t = &cfg.text_config;
        let ours = json!({
            "vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "num_hidden_layers": t.num_hidden_layers,
            "layer_types": t.layer_types, "mlp_layer_types": t.mlp_layer_types, "indexer_types": t.indexer_types,
            "linear_num_heads": t.linear_num_heads, "linear_head_dim": t.linear_head_dim,
            "linear_conv_kernel_dim": t.linear_conv_kernel_dim, "linear_lower_bound": t.linear_lower_bound,
            "index_topk": t.index_topk, "index_kpool": t.index_kpool, "n_routed_experts": t.n_routed_experts,
            "pad_token_id": t.pad_token_id, "qk_rope_head_dim": t.qk_rope_head_dim, "q_lora_rank": t.q_lora_rank,
        });
        let expected = &case["resolved"];
        for (k, v) in expected.as_object().unwrap() {
            let o = &ours[k];
            let same = match (o.as_f64(), v.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => o == v,
            };
            assert!(same, "{name}: field {k}: ours {o}, reference {v}");
        }
    }
}

#[test]
fn invalid_configs_fail_like_the_reference_naming_the_field() {
    let fields = [("topk_kpool", "index_topk"), ("rope", "qk_rope_head_dim"), ("kv_heads", "num_key_value_heads")];
    for case in cases().iter().filter(|c| c.get("error").is_some()) {
        let name = case["name"].as_str().unwrap();
        let hf = case["error"].as_str().unwrap().trim_end_matches('.');
        match Glm5Config::from_hf_value(&case["input"]) {
            Ok(_) => panic!("{name}: accepted, the reference rejects it with {hf:?}"),
            Err(ConfigError::Invalid { field, message }) => {
                let want = fields.iter().find(|(n, _)| *n == name).unwrap().1;
                assert_eq!(field, want, "{name}: field");
                assert!(message.contains(hf) || hf.contains(&message), "{name}: ours {message:?}, reference {hf:?}");
            }
            Err(e) => panic!("{name}: unexpected error kind {e}"),
        }
    }
}

#[test]
fn nested_and_bad_values_are_reported_with_their_path() {
    let err = Glm5Config::from_hf_value(&json!({"text_config": {"layer_types": ["linear_attention", "mamba"]}})).unwrap_err();
    assert!(err.to_string().contains("text_config.layer_types[1]"), "{err}");
    let err = Glm5Config::from_hf_value(&json!({"text_config": {"hidden_size": "big"}})).unwrap_err();
    assert!(err.to_string().contains("text_config.hidden_size"), "{err}");
    let err = Glm5Config::from_hf_value(&json!({"text_config": {"num_hidden_layers": 4, "n_group": 4, "n_routed_experts": 4,
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]}}))
    .unwrap_err();
    assert!(err.to_string().contains("n_group"), "{err}");
    let err = Glm5Config::from_json_str("{not json", "x/config.json").unwrap_err();
    assert!(err.to_string().contains("x/config.json"), "{err}");
}

#[test]
fn presets_are_valid_and_match_the_release() {
    // the release's numbers as published (model card / config.json), spelled out here so a
    // bundled file that drifted from them fails
    let full = TextConfig::full();
    full.validate().unwrap();
    assert_eq!((full.num_hidden_layers, full.hidden_size, full.vocab_size), (45, 4096, 154880));
    assert_eq!((full.n_routed_experts, full.num_experts_per_tok, full.n_shared_experts), (288, 8, 1));
    assert_eq!(full.mlp_layer_types.iter().filter(|t| **t == glm5_burn::config::MlpType::Dense).count(), 3);
    assert_eq!(full.index_kpool, 4);
    assert_eq!(full.index_width(), 2051);
    assert_eq!(full.layer_types.iter().filter(|t| **t == glm5_burn::config::LayerType::IndexedAttention).count(), 11);
    assert_eq!(Glm5Config::full().vision_config.out_hidden_size, 4096);
    TextConfig::tiny().validate().unwrap();
    // a vision out_hidden_size different from the text width is accepted (only used with images)
    let cfg = Glm5Config::from_hf_value(&json!({"text_config": {"hidden_size": 64, "num_hidden_layers": 1},
        "vision_config": {"out_hidden_size": 24}}))
    .unwrap();
    assert_eq!(cfg.vision_config.out_hidden_size, 24);
}

/// Every field of the resolved configs, read from an empty `config.json`, equals what
/// `Glm5NextConfig()` resolves to in transformers 5.23.0 (`tests/fixtures/config_defaults.json`):
/// the serde mirror's one set of defaults is the reference classes'.
#[test]
fn empty_config_resolves_to_the_reference_class_defaults() {
    let text = std::fs::read_to_string(common::fixtures().join("config_defaults.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    let cfg = Glm5Config::from_hf_value(&json!({"text_config": {}, "vision_config": {}})).unwrap();
    let same = |a: &Value, b: &Value| match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    };
    let mut vision_ref = reference["vision_config"].clone();
    vision_ref["rope_theta"] = vision_ref["rope_parameters"]["rope_theta"].clone();
    for (ours, theirs, section) in [
        (serde_json::to_value(&cfg.text_config).unwrap(), reference["text_config"].clone(), "text_config"),
        (serde_json::to_value(&cfg.vision_config).unwrap(), vision_ref, "vision_config"),
    ] {
        for (k, o) in ours.as_object().unwrap() {
            // a key of the published config.json that the class keeps only as an extra
            // attribute; we read it to skip the stored MTP layer on load
            if k == "num_nextn_predict_layers" {
                assert_eq!(o, &json!(0));
                continue;
            }
            let t = theirs.get(k).unwrap_or_else(|| panic!("{section}.{k}: not a field of the reference class"));
            assert!(same(o, t), "{section}.{k}: ours {o}, reference {t}");
        }
    }
    for (k, t) in reference["top"].as_object().unwrap() {
        let o = &serde_json::to_value(&cfg).unwrap()[k];
        assert!(same(o, t), "{k}: ours {o}, reference {t}");
    }
    // the flat form and a fully empty file resolve to the same text config
    assert_eq!(Glm5Config::from_hf_value(&json!({})).unwrap(), cfg);
}

#[test]
fn null_means_the_default_except_where_the_reference_gives_it_a_meaning() {
    let cfg = Glm5Config::from_hf_value(&json!({"text_config": {"hidden_size": null, "pad_token_id": null, "linear_lower_bound": null},
        "vision_config": null}))
    .unwrap();
    assert_eq!(cfg.text_config.hidden_size, 4096);
    assert_eq!(cfg.text_config.pad_token_id, None);
    assert_eq!(cfg.text_config.linear_lower_bound, None, "null selects the softplus gate");
    assert_eq!(cfg.vision_config, Glm5Config::from_hf_value(&json!({})).unwrap().vision_config);
    let err = Glm5Config::from_hf_value(&json!({"text_config": {"q_lora_rank": null}})).unwrap_err();
    assert!(err.to_string().contains("text_config.q_lora_rank") && err.to_string().contains("strictly required"), "{err}");
    // num_local_experts (the Mixtral-style name) feeds n_routed_experts; an explicit n_routed_experts wins
    let t = |v: Value| Glm5Config::from_hf_value(&json!({ "text_config": v })).unwrap().text_config;
    assert_eq!(t(json!({"num_local_experts": 16})).n_routed_experts, 16);
    assert_eq!(t(json!({"num_local_experts": 16, "n_routed_experts": 32})).n_routed_experts, 32);
    // unmodelled keys are ignored, as `from_dict` keeps them as attributes nobody reads
    assert_eq!(t(json!({"scoring_func": "sigmoid", "mhc": true})), t(json!({})));
}

#[test]
fn vision_values_are_read_and_reported_with_their_path() {
    let v = |x: Value| Glm5Config::from_hf_value(&json!({ "vision_config": x }));
    let cfg = v(json!({"patch_size": [16, 16], "temporal_patch_size": [1], "rope_parameters": {"rope_theta": 500.0}})).unwrap().vision_config;
    assert_eq!((cfg.patch_size, cfg.temporal_patch_size, cfg.rope_theta), (16, 1, 500.0));
    let err = v(json!({"patch_size": []})).unwrap_err().to_string();
    assert!(err.contains("vision_config.patch_size"), "{err}");
    let err = v(json!({"depth": -1})).unwrap_err().to_string();
    assert!(err.contains("vision_config.depth"), "{err}");
    let err = v(json!({"num_heads": 5})).unwrap_err().to_string();
    assert!(err.contains("vision_config.num_heads") && err.contains("multiple"), "{err}");
    let err = v(json!({"hidden_act": "mish"})).unwrap_err().to_string();
    assert!(err.contains("vision_config.hidden_act") && err.contains("mish"), "{err}");
    let err = Glm5Config::from_hf_value(&json!([1, 2])).unwrap_err().to_string();
    assert!(err.contains("<root>"), "{err}");
}
