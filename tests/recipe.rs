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

/// `model.backend.*`: `op` (the backend's op: fused host loops on Flex, kernels on CubeCL) and
/// `reference`; `kernel`, the value's name before fused loops were told apart from kernels,
/// still reads as `op`.
#[test]
fn backend_paths_parse_with_the_old_name() {
    use glm5_burn::ops::PathKind;
    let shipped_recipe = Recipe::from_file(&shipped("tiny_medpix.yaml"), &[]).unwrap();
    assert_eq!((shipped_recipe.model.backend.attn, shipped_recipe.model.backend.kda), (PathKind::Op, PathKind::Op));
    let over = ["model.backend.attn=kernel".to_string(), "model.backend.kda=reference".to_string()];
    let r = Recipe::from_file(&shipped("tiny_medpix.yaml"), &over).unwrap();
    assert_eq!((r.model.backend.attn, r.model.backend.kda), (PathKind::Op, PathKind::Reference));
    let err = Recipe::from_file(&shipped("tiny_medpix.yaml"), &["model.backend.attn=kernels".to_string()]).unwrap_err();
    assert!(err.to_string().contains("model.backend.attn"), "{err}");
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

/// Values torch.optim.AdamW refuses (and a negative clipping norm, which would reverse the
/// update) are errors naming the key.
#[test]
fn out_of_range_optimizer_values_are_refused() {
    let path = shipped("tiny_medpix.yaml");
    let cases = [
        ("optimizer.betas=[1.5, 0.95]", "optimizer.betas"),
        ("optimizer.betas=[0.9, 1.0]", "optimizer.betas"),
        ("optimizer.betas=[-0.1, 0.95]", "optimizer.betas"),
        ("optimizer.weight_decay=-0.01", "optimizer.weight_decay"),
        ("optimizer.lr=.inf", "optimizer.lr"),
        ("optimizer.lr=.nan", "optimizer.lr"),
        ("optimizer.lr=0", "optimizer.lr"),
        ("optimizer.max_grad_norm=-1.0", "optimizer.max_grad_norm"),
        ("optimizer.max_grad_norm=0", "optimizer.max_grad_norm"),
        ("optimizer.eps=-1e-8", "optimizer.eps"),
        ("lr_scheduler.min_lr=-1e-5", "lr_scheduler.min_lr"),
        ("moe.aux_loss_coef=-0.1", "moe.aux_loss_coef"),
    ];
    for (o, key) in cases {
        let e = Recipe::from_file(&path, &[format!("--{o}")]).unwrap_err().to_string();
        assert!(e.contains(key), "{o}: {e}");
    }
    // the limits themselves are fine
    Recipe::from_file(
        &path,
        &["--optimizer.betas=[0.0, 0.999]".into(), "--optimizer.weight_decay=0".into(), "--optimizer.max_grad_norm=null".into()],
    )
    .unwrap();
}

/// Messages that name the right culprit: an override's bad value names the override, not the
/// recipe file; an empty recipe says so.
#[test]
fn messages_name_the_override_and_the_empty_recipe() {
    let path = shipped("tiny_medpix.yaml");
    let e = Recipe::from_file(&path, &["--optimizer.lr=-1".into()]).unwrap_err().to_string();
    assert!(e.contains("override --optimizer.lr=-1") && e.contains("optimizer.lr"), "{e}");
    let e = Recipe::from_file(&path, &["--optimizer.momentum=0.9".into()]).unwrap_err().to_string();
    assert!(e.contains("override --optimizer.momentum=0.9"), "{e}");
    let e = Recipe::from_file(&path, &["--step_scheduler.max_steps=lots".into()]).unwrap_err().to_string();
    assert!(e.contains("override --step_scheduler.max_steps=lots"), "{e}");
    // a problem in the file itself still names the file
    let text = std::fs::read_to_string(&path).unwrap().replace("lr: 3.0e-3", "lr: -3.0e-3");
    let e = Recipe::from_yaml(&text, "edited.yaml", &["--step_scheduler.max_steps=5".into()]).unwrap_err().to_string();
    assert!(e.starts_with("edited.yaml") && e.contains("optimizer.lr"), "{e}");
    let e = Recipe::from_yaml("", "empty.yaml", &[]).unwrap_err().to_string();
    assert!(e.contains("empty.yaml") && e.contains("the recipe is empty"), "{e}");
    let e = Recipe::from_yaml("", "empty.yaml", &["--rng.seed=1".into()]).unwrap_err().to_string();
    assert!(e.contains("the recipe is empty"), "{e}");
}

#[test]
fn data_parallel_sizes_are_checked_against_the_batch() {
    let path = shipped("tiny_medpix.yaml"); // global 4, local 2
    let ok = |o: &[&str]| Recipe::from_file(&path, &o.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    let r = ok(&["--distributed.dp_size=2"]).unwrap();
    assert_eq!(r.distributed.dp_size, 2);
    let e = ok(&["--distributed.dp_size=3"]).unwrap_err().to_string();
    assert!(e.contains("step_scheduler.global_batch_size") && e.contains("local_batch_size × distributed.dp_size (2 × 3)"), "{e}");
    let e = ok(&["--distributed.dp_size=0"]).unwrap_err().to_string();
    assert!(e.contains("distributed.dp_size") && e.contains("at least 1"), "{e}");
    // the router bias update sums the expert loads over the ranks
    assert!(ok(&["--distributed.dp_size=2", "--moe.router_bias_update_rate=0.001"]).is_ok());
    // expert parallelism within the data-parallel world
    let r = ok(&["--distributed.ep_size=2", "--distributed.dp_size=2"]).unwrap();
    assert_eq!(r.distributed.ep_size, 2);
    // context parallelism, with the load-balancing loss too
    assert!(ok(&["--distributed.cp_size=2", "--distributed.dp_size=2"]).is_ok());
    assert!(ok(&["--distributed.cp_size=2", "--moe.aux_loss_coef=0.01"]).is_ok());
    // the mesh is checked before anything else about it
    let e = ok(&["--distributed.ep_size=3", "--distributed.dp_size=2"]).unwrap_err().to_string();
    assert!(e.contains("distributed.ep_size") && e.contains("must divide the world size distributed.dp_size × distributed.cp_size (2 × 1)"), "{e}");
    let e = ok(&["--distributed.cp_size=0"]).unwrap_err().to_string();
    assert!(e.contains("distributed.cp_size") && e.contains("at least 1"), "{e}");
}

#[test]
fn overrides_are_told_from_program_flags() {
    use glm5_burn::train::recipe::{split_overrides, SECTIONS};
    let args = ["r.yaml", "--optimizer.lr=1e-4", "--validation_dataset=null", "--no-resume", "--backend=flex", "--rng.seed=3"];
    let (overrides, rest) = split_overrides(args.iter().map(|s| s.to_string()));
    assert_eq!(overrides, ["--optimizer.lr=1e-4", "--validation_dataset=null", "--rng.seed=3"]);
    assert_eq!(rest, ["r.yaml", "--no-resume", "--backend=flex"]);
    // every section is a key of the recipe
    let r = Recipe::from_file(&shipped("tiny_medpix.yaml"), &[]).unwrap();
    let json = serde_json::to_value(&r).unwrap();
    let keys: Vec<&str> = json.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    let mut sections = SECTIONS.to_vec();
    sections.sort();
    let mut keys = keys;
    keys.sort();
    assert_eq!(sections, keys);
}

/// `model.base_dtype`: `f32` (the default), `bf16` and `fp8` parse; a frozen base below fp32
/// needs a LoRA run, and a bf16 base a bf16 run (it computes in the dtype it is held in).
#[test]
fn base_dtype_values_and_their_requirements() {
    use glm5_burn::train::recipe::BaseDtype;
    let lora = shipped("tiny_medpix_lora.yaml");
    let r = Recipe::from_file(&lora, &[]).unwrap();
    assert_eq!(r.model.base_dtype, None);
    let r = Recipe::from_file(&lora, &["--model.dtype=bf16".into(), "--model.base_dtype=bf16".into()]).unwrap();
    assert_eq!(r.model.base_dtype, Some(BaseDtype::Bf16));
    let r = Recipe::from_file(&lora, &["--model.base_dtype=f32".into()]).unwrap();
    assert_eq!(r.model.base_dtype, Some(BaseDtype::F32));
    let e = Recipe::from_file(&lora, &["--model.base_dtype=bf16".into()]).unwrap_err().to_string();
    assert!(e.contains("model.base_dtype") && e.contains("model.dtype: bf16"), "{e}");
    let e = Recipe::from_file(&lora, &["--model.base_dtype=fp4".into()]).unwrap_err().to_string();
    assert!(e.contains("model.base_dtype") && e.contains("fp4"), "{e}");
    let full = shipped("tiny_medpix.yaml");
    for base in ["bf16", "fp8"] {
        let e = Recipe::from_file(&full, &["--model.dtype=bf16".into(), format!("--model.base_dtype={base}")]).unwrap_err().to_string();
        assert!(e.contains("model.base_dtype") && e.contains("peft"), "{base}: {e}");
    }
}
