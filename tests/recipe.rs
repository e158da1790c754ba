//! Recipes: the shipped YAML files parse; unknown keys and bad values name their path;
//! dotted overrides keep YAML types; unsupported parallel sizes are refused.

use glm5_burn::train::recipe::{DecayStyle, Recipe};

fn shipped(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join(name)
}

#[test]
fn shipped_recipes_parse() {
    let r = Recipe::from_file(&shipped("glm5_3_flash_medpix_packed2k.yaml"), &[]).unwrap();
    assert_eq!((r.step_scheduler.global_batch_size, r.step_scheduler.max_steps), (144, 100));
    assert_eq!(r.packed_sequence.packed_sequence_size, 2048);
    assert!(r.freeze_config.freeze_embeddings && r.freeze_config.freeze_vision_tower && !r.freeze_config.freeze_language_model);
    assert_eq!(r.accumulation_steps(), 144);
    let t = Recipe::from_file(&shipped("tiny_medpix.yaml"), &[]).unwrap();
    assert_eq!(t.accumulation_steps(), 2);
    assert_eq!(t.lr_scheduler.lr_decay_style, DecayStyle::Cosine);
    assert_eq!(t.optimizer.eps, 1e-8, "PyTorch's AdamW default, written out");
}

#[test]
fn overrides_apply_with_yaml_types() {
    let over = ["--step_scheduler.max_steps=5".to_string(), "optimizer.lr=2e-4".to_string(), "distributed.activation_checkpointing=true".to_string()];
    let r = Recipe::from_file(&shipped("tiny_medpix.yaml"), &over).unwrap();
    assert_eq!(r.step_scheduler.max_steps, 5);
    assert_eq!(r.optimizer.lr, 2e-4);
    assert!(r.distributed.activation_checkpointing);
}

#[test]
fn errors_name_the_key() {
    let path = shipped("tiny_medpix.yaml");
    let cases: [(&str, &str); 5] = [
        ("optimizer.momentum=0.9", "optimizer.momentum"),
        ("step_scheduler.max_steps=lots", "step_scheduler.max_steps"),
        ("distributed.ep_size=8", "distributed.ep_size"),
        ("step_scheduler.global_batch_size=3", "step_scheduler.global_batch_size"),
        ("lr_scheduler.lr_decay_style=exponential", "lr_scheduler.lr_decay_style"),
    ];
    for (o, key) in cases {
        let e = Recipe::from_file(&path, &[o.to_string()]).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains("tiny_medpix.yaml"), "{o}: {e}");
    }
    let e = Recipe::from_file(&path, &["max_steps".to_string()]).unwrap_err().to_string();
    assert!(e.contains("expected --section.key=value"), "{e}");
    let e = Recipe::from_yaml("step_scheduler: [", "bad.yaml", &[]).unwrap_err().to_string();
    assert!(e.contains("bad.yaml"), "{e}");
}

#[test]
fn packed_sequence_size_defaults_to_2048() {
    let text = std::fs::read_to_string(shipped("tiny_medpix.yaml")).unwrap().replace("  packed_sequence_size: 256\n", "");
    let r = Recipe::from_yaml(&text, "tiny_medpix.yaml (edited)", &[]).unwrap();
    assert_eq!(r.packed_sequence.packed_sequence_size, 2048);
}
