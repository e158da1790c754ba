//! LoRA against HF PEFT (`peft==0.21.2`, fixtures by `tests/reference/make_fixtures.py`
//! `lora_attn_experts lora_rslora`): adapters saved by PEFT's own `save_pretrained` on the
//! `base_k4` checkpoint load here, and give PEFT's float64 logits, loss and LoRA gradients.
//! Also: a fresh adapter leaves the model unchanged, our saved adapter is PEFT's file again,
//! merging equals the unmerged adapter, and bad configs are refused by name.

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::Tensor;
use common::*;
use glm5_burn::checkpoint::adapter::{load_adapter, save_adapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
use glm5_burn::checkpoint::{load_causal_lm, CheckpointError, LoadOptions};
use glm5_burn::peft::{attach, merge};
use glm5_burn::text::lora::{LoraConfig, LoraError, TargetModules};
use glm5_burn::train::params::trainable_counts;
use glm5_burn::{ForwardOptions, Glm5ForCausalLM, Outputs};

type A = Autodiff<Flex>;

fn base() -> Glm5ForCausalLM<A> {
    load_causal_lm::<A>(&fixtures().join("base_k4"), &Default::default(), &LoadOptions::default()).unwrap().model
}

fn logits(model: &Glm5ForCausalLM<A>, io: &Io) -> Tensor<A, 3> {
    model.forward(io.ids().with_mask(io.mask()), &ForwardOptions::default(), Outputs::default()).unwrap().logits
}

/// Replaces every parameter by its gradient (zeros where none flows).
struct ToGrads<'a> {
    grads: &'a <A as AutodiffBackend>::Gradients,
    with_grad: usize,
}

impl ModuleMapper<A> for ToGrads<'_> {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
        let (id, t, mapper) = p.consume();
        let g = match t.grad(self.grads) {
            Some(g) => {
                self.with_grad += 1;
                Tensor::from_inner(g)
            }
            None => t.zeros_like().detach(),
        };
        Param::from_mapped_value(id, g, mapper)
    }
}

fn vals<const D: usize>(t: Tensor<A, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().into_vec().unwrap()
}

fn f32s(t: &glm5_burn::checkpoint::safetensors_io::OwnedTensor) -> Vec<f32> {
    t.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn peft_adapters_give_peft_logits_loss_and_gradients() {
    let io = Io::open(&fixtures().join("base_k4/io.safetensors"));
    for case in ["lora_attn_experts", "lora_rslora"] {
        check_against_peft(case, base(), &io, &io.i64("labels"));
    }
}

/// The vision tower's adapters (its blocks' attention and MLP, the patch merger) with three
/// text projections, on the VLM fixture's two-image prompt: PEFT's logits, loss, gradients.
#[test]
fn peft_vision_adapters_give_peft_logits_loss_and_gradients() {
    let dir = fixtures().join("vlm");
    let vlm = load_causal_lm::<A>(&dir, &Default::default(), &LoadOptions { vision: true, ..LoadOptions::default() }).unwrap().model;
    let io = Io::open(&dir.join("io.safetensors"));
    let labels = Io::open(&fixtures().join("lora_vlm/io.safetensors")).i64("labels");
    let modules = check_against_peft("lora_vlm", vlm, &io, &labels);
    assert_eq!(modules.iter().filter(|m| m.starts_with("model.visual.")).count(), 2 * 5 + 4, "{modules:?}");
}

/// The adapter of `case` on `model` against its HF + PEFT float64 fixture, on `io`'s inputs
/// (ids, mask, images when present); returns the adapted module names.
fn check_against_peft(case: &str, model: Glm5ForCausalLM<A>, io: &Io, labels: &[i64]) -> Vec<String> {
    let mask = io.mask();
    let dir = fixtures().join(case);
    let (model, config, attached) = load_adapter(model, &dir).unwrap();
    let reference = Io::open(&dir.join("io.safetensors"));
    // every parameter but the adapters is frozen
    let (trainable, _) = trainable_counts(&model);
    assert_eq!(trainable, attached.trainable, "{case}: trainable parameters are the adapters'");
    let input = io.ids().with_mask(mask.clone()).with_images(io.images());
    let out = model.forward(input, &ForwardOptions::default(), Outputs::default()).unwrap();
    let vocab = *reference.shape("logits").last().unwrap();
    let stats = logit_stats(&reference.f32("logits"), &vals(out.logits.clone()), vocab, &mask);
    let lm = glm5_burn::loss::lm_loss(out.logits, labels);
    let aux = model.aux_loss(&out.text.router_logits, &mask).unwrap();
    let loss = lm + aux * model.router_aux_loss_coef;
    let ours_loss = vals(loss.clone())[0];
    let ref_loss = reference.f32("loss")[0];
    println!(
        "{case}: r {} α {} rslora {}: {} modules + {} expert parameters; logits mean KL {:.2e} max {:.2e} (HF+PEFT fp32 {:.2e}); loss {ours_loss:.7} vs {ref_loss:.7}",
        config.r,
        config.lora_alpha,
        config.use_rslora,
        attached.modules.len(),
        attached.parameters.len(),
        stats.mean_kl,
        stats.max_kl,
        reference.f32("hf_f32_kl")[0]
    );
    assert!(stats.mean_kl <= 1e-10, "{case}: logits mean KL {:e}", stats.mean_kl);
    assert!(((ours_loss - ref_loss) / ref_loss).abs() <= 1e-6, "{case}: loss {ours_loss} vs {ref_loss}");

    // gradients, written in PEFT's layout by our own adapter writer
    let grads = loss.backward();
    let mut to_grads = ToGrads { grads: &grads, with_grad: 0 };
    let grad_model = model.clone().map(&mut to_grads);
    assert_eq!(to_grads.with_grad, 2 * (attached.modules.len() + attached.parameters.len()), "{case}: only the adapters take gradients");
    let tmp = tempfile::tempdir().unwrap();
    save_adapter(&grad_model, &config, tmp.path()).unwrap();
    let ours = read_all(&tmp.path().join(ADAPTER_WEIGHTS));
    let (mut worst, mut worst_name, mut compared) = (0f32, String::new(), 0);
    for (key, t) in &ours {
        let r = reference.f32(&format!("grad.{key}"));
        let o = f32s(t);
        let keep = vec![true; r.len()];
        let scale = max_abs(&r, 1, &keep);
        assert!(scale > 0.0, "{case}: {key}: the reference gradient is zero");
        let rel = max_abs_diff(&r, &o, 1, &keep) / scale;
        if rel.is_nan() || rel > worst {
            (worst, worst_name) = (if rel.is_nan() { f32::INFINITY } else { rel }, key.clone());
        }
        compared += 1;
    }
    println!("  {compared} LoRA gradients vs PEFT float64: worst max|Δ|/max|ref| {worst:.2e} ({worst_name})");
    assert!(worst <= 1e-4, "{case}: gradient of {worst_name}: {worst:e}");
    attached.modules
}

#[test]
fn our_saved_adapter_is_the_peft_file_and_merging_equals_it() {
    let io = Io::open(&fixtures().join("base_k4/io.safetensors"));
    let dir = fixtures().join("lora_attn_experts");
    let (model, config, _) = load_adapter(base(), &dir).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    save_adapter(&model, &config, tmp.path()).unwrap();
    let (theirs, ours) = (read_all(&dir.join(ADAPTER_WEIGHTS)), read_all(&tmp.path().join(ADAPTER_WEIGHTS)));
    assert_eq!(theirs.keys().collect::<Vec<_>>(), ours.keys().collect::<Vec<_>>());
    for (k, t) in &theirs {
        assert_eq!((&t.shape, &t.data), (&ours[k].shape, &ours[k].data), "{k}: not PEFT's tensor back");
    }
    // and the written config reads back as the same adapter
    let reread = glm5_burn::checkpoint::adapter::read_adapter_config(tmp.path()).unwrap();
    assert_eq!(
        (reread.r, reread.lora_alpha, &reread.target_modules, &reread.target_parameters),
        (config.r, config.lora_alpha, &config.target_modules, &config.target_parameters)
    );

    let vocab = 128;
    let unmerged = vals(logits(&model, &io));
    let merged = merge(model);
    let merged = vals(logits(&merged, &io));
    let stats = logit_stats(&unmerged, &merged, vocab, &io.mask());
    println!("merged vs adapter: mean KL {:.2e}, max|Δ| {:.2e}", stats.mean_kl, stats.max_abs);
    assert!(stats.max_abs <= 1e-4 && stats.mean_kl <= 1e-10, "merged logits differ: {stats:?}");
}

#[test]
fn a_fresh_adapter_leaves_the_model_unchanged_and_only_it_trains() {
    let io = Io::open(&fixtures().join("base_k4/io.safetensors"));
    let before = vals(logits(&base(), &io));
    let mut config = LoraConfig::new(4, 8.0, TargetModules::Names(vec!["q_proj".into(), "kv_b_proj".into(), "down_proj".into()]));
    config.target_parameters = Some(vec!["mlp.experts.gate_up_proj".into()]);
    let (model, attached) = attach(base(), &config).unwrap();
    // 3 KDA q_proj, 1 MLA kv_b_proj, 1 dense + 3 shared-expert down_proj; 3 MoE layers
    assert_eq!((attached.modules.len(), attached.parameters.len()), (8, 3), "{attached:?}");
    let after = vals(logits(&model, &io));
    assert_eq!(before, after, "B = 0 at initialisation: the logits must not move");
    let (trainable, frozen) = trainable_counts(&model);
    assert_eq!(trainable, attached.trainable);
    assert!(frozen > 0);
}

fn refused(config: LoraConfig) -> LoraError {
    match attach(base(), &config) {
        Ok(_) => panic!("accepted {config:?}"),
        Err(e) => e,
    }
}

#[test]
fn bad_lora_configs_are_refused_by_name() {
    let names = |n: &[&str]| TargetModules::Names(n.iter().map(|s| s.to_string()).collect());
    let e = refused(LoraConfig::new(4, 8.0, names(&["q_proj", "qq_proj"])));
    assert!(matches!(&e, LoraError::NoMatch { entry, .. } if entry == "qq_proj"), "{e}");
    assert!(e.to_string().contains("kv_a_proj_with_mqa"), "the error lists the adaptable names: {e}");
    let e = refused(LoraConfig::new(4, 8.0, names(&["wq_b"])));
    assert!(
        e.to_string().contains("self_attn.indexer.wq_b (an nn.Linear)") && e.to_string().contains("PEFT would adapt it"),
        "the indexer is not adaptable: {e}"
    );
    let e = refused(LoraConfig::new(4, 8.0, TargetModules::Regex(r".*\.nothing".into())));
    assert!(matches!(e, LoraError::NoMatch { .. }), "{e}");
    let e = refused(LoraConfig::new(4, 8.0, TargetModules::Regex("(".into())));
    assert!(e.to_string().contains("target_modules"), "{e}");
    // b_proj is [32 -> 2]
    let e = refused(LoraConfig::new(4, 8.0, names(&["b_proj"])));
    assert!(matches!(&e, LoraError::RankTooLarge { module, r: 4, d_in: 32, d_out: 2 } if module.ends_with("layers.0.self_attn.b_proj")), "{e}");
    let mut c = LoraConfig::new(4, 8.0, names(&["q_proj"]));
    c.target_parameters = Some(vec!["mlp.experts.up_proj".into()]);
    let e = refused(c);
    assert!(e.to_string().contains("mlp.experts.up_proj") && e.to_string().contains("gate_up_proj"), "{e}");
    let mut c = LoraConfig::new(4, 8.0, names(&["q_proj"]));
    c.other.insert("use_dora".into(), true.into());
    assert!(matches!(refused(c), LoraError::Config { field: "use_dora", .. }));
    let mut c = LoraConfig::new(4, 8.0, names(&["q_proj"]));
    c.target_parameters = Some(vec!["mlp.experts.down_proj".into()]);
    c.lora_dropout = 0.1;
    assert!(matches!(refused(c), LoraError::Config { field: "lora_dropout", .. }));
    assert!(matches!(refused(LoraConfig::new(0, 8.0, names(&["q_proj"]))), LoraError::Config { field: "r", .. }));
}

#[test]
fn an_adapter_for_another_model_lists_every_mismatch() {
    // lora_rslora's weights under lora_attn_experts' config: missing keys and wrong shapes
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(fixtures().join("lora_attn_experts").join(ADAPTER_CONFIG), tmp.path().join(ADAPTER_CONFIG)).unwrap();
    std::fs::copy(fixtures().join("lora_rslora").join(ADAPTER_WEIGHTS), tmp.path().join(ADAPTER_WEIGHTS)).unwrap();
    let err = match load_adapter(base(), tmp.path()) {
        Ok(_) => panic!("a mismatched adapter loaded"),
        Err(e) => e,
    };
    let text = err.to_string();
    assert!(matches!(err, CheckpointError::AdapterMismatch { .. }), "{text}");
    assert!(text.contains("missing: base_model.model.model.language_model.layers.0.self_attn.k_proj.lora_A.weight"), "{text}");
    assert!(text.contains("shape: base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight is [2, 32]"), "{text}");
    // an unknown key in adapter_config.json's targets names the file
    std::fs::write(tmp.path().join(ADAPTER_CONFIG), r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_projj"]}"#).unwrap();
    let text = load_adapter(base(), tmp.path()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("adapter_config.json") && text.contains("q_projj"), "{text}");
    std::fs::write(tmp.path().join(ADAPTER_CONFIG), r#"{"peft_type": "LORA", "r": "four"}"#).unwrap();
    let text = load_adapter(base(), tmp.path()).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(text.contains("adapter_config.json") && text.contains('r'), "{text}");
}

/// Writes an adapter trained here (three AdamW steps of Burn's own optimizer on
/// `lora_attn_experts`) and its logits to `$GLM5_LORA_EXPORT` for
/// `tests/reference/check_lora_adapter.py`, which loads it with `PeftModel.from_pretrained`
/// on the `base_k4` checkpoint and compares the logits:
///
/// ```text
/// GLM5_LORA_EXPORT=/tmp/lora_export cargo test --test lora -- --ignored export_trained_adapter
/// .venv/bin/python tests/reference/check_lora_adapter.py /tmp/lora_export
/// ```
#[test]
#[ignore = "writes files for the PEFT round-trip script"]
fn export_trained_adapter() {
    use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
    let out = std::path::PathBuf::from(std::env::var("GLM5_LORA_EXPORT").expect("set GLM5_LORA_EXPORT"));
    let io = Io::open(&fixtures().join("base_k4/io.safetensors"));
    let mask = io.mask();
    let (mut model, config, _) = load_adapter(base(), &fixtures().join("lora_attn_experts")).unwrap();
    let mut optim = AdamWConfig::new().init();
    for step in 0..3 {
        let o = model.forward(io.ids().with_mask(mask.clone()), &ForwardOptions::default(), Outputs::default()).unwrap();
        let loss = glm5_burn::loss::lm_loss(o.logits, &io.i64("labels"));
        println!("step {step}: loss {}", vals(loss.clone())[0]);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-2, model, grads);
    }
    save_adapter(&model, &config, &out).unwrap();
    let logits = logits(&model, &io);
    let shape = logits.dims().to_vec();
    let data: Vec<u8> = vals(logits).iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, &data).unwrap();
    safetensors::serialize_to_file([("logits", view)], None, &out.join("ours.safetensors")).unwrap();
}

fn example(name: &str) -> std::path::PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        let status = std::process::Command::new(env!("CARGO"))
            .args(["build", "--example", "logits", "--example", "convert"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo");
        assert!(status.success(), "building the examples failed");
    });
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(std::path::Path::parent).expect("target/<profile>/deps/..").join("examples").join(name)
}

fn run_ok(name: &str, args: &[&std::path::Path]) -> String {
    let out = std::process::Command::new(example(name)).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{name} {args:?}:\n{text}");
    text
}

#[test]
fn logits_with_adapter_equals_the_merged_checkpoint() {
    let p = |s: &str| std::path::PathBuf::from(s);
    let tmp = tempfile::tempdir().unwrap();
    let (base, adapter, io) = (fixtures().join("base_k4"), fixtures().join("lora_attn_experts"), fixtures().join("base_k4/io.safetensors"));
    let merged = tmp.path().join("merged");
    let text = run_ok("convert", &[&p("--input"), &base, &p("--merge-lora"), &adapter, &p("--output"), &merged, &p("--dtype"), &p("f32")]);
    assert!(text.contains("44 linear layers and 6 expert parameters"), "{text}");
    let (a, b) = (tmp.path().join("adapter.safetensors"), tmp.path().join("merged.safetensors"));
    run_ok("logits", &[&p("--checkpoint"), &base, &p("--adapter"), &adapter, &p("--input"), &io, &p("--output"), &a]);
    run_ok("logits", &[&p("--checkpoint"), &merged, &p("--input"), &io, &p("--output"), &b]);
    let (la, lb) = (Io::open(&a).f32("logits"), Io::open(&b).f32("logits"));
    // and the unmerged adapter gives PEFT's logits
    let reference = Io::open(&adapter.join("io.safetensors")).f32("logits");
    let mask = Io::open(&io).mask();
    let (vs_merged, vs_peft) = (logit_stats(&la, &lb, 128, &mask), logit_stats(&reference, &la, 128, &mask));
    println!(
        "logits --adapter vs merged checkpoint: max|Δ| {:.2e}, mean KL {:.2e}; vs PEFT float64: mean KL {:.2e}",
        vs_merged.max_abs, vs_merged.mean_kl, vs_peft.mean_kl
    );
    assert!(vs_merged.max_abs <= 1e-4 && vs_merged.mean_kl <= 1e-10, "{vs_merged:?}");
    assert!(vs_peft.mean_kl <= 1e-10, "{vs_peft:?}");
    // the merged checkpoint holds no adapter tensor and loads strictly as a plain checkpoint
    assert!(read_all(&merged.join("model.safetensors")).keys().all(|k| !k.contains("lora")));
}

/// `convert --merge-lora ADAPTER --dtype fp8` onto an FP8 checkpoint writes the same layout
/// (every tensor under the input's name and dtype, the FP8 ones with fresh `weight_scale_inv`):
/// each re-quantised weight dequantises to the f32 merge `W + s·A·B` within half an E4M3 step
/// of its block, each block's largest magnitude sits on ±448·scale, and the checkpoint's logits
/// follow the unmerged adapter's.
#[test]
fn fp8_merge_requantises_the_fp8_weights_with_fresh_block_scales() {
    use glm5_burn::checkpoint::safetensors_io::SafetensorsFiles;
    use glm5_burn::checkpoint::save_causal_lm;
    let p = |s: &str| std::path::PathBuf::from(s);
    let tmp = tempfile::tempdir().unwrap();
    let base_dir = fixtures().join("fp8_f32_scales");
    let io = Io::open(&fixtures().join("fp8_oracle.safetensors"));
    let mask = io.mask();
    let loaded = load_causal_lm::<A>(&base_dir, &Default::default(), &LoadOptions::default()).unwrap();
    // FP8 projections (dense MLP, shared experts, MLA's q_a/kv_b), an F32 one (KDA's q_proj)
    // and the routed experts
    let mut config = LoraConfig::new(
        2,
        4.0,
        TargetModules::Names(["gate_proj", "up_proj", "down_proj", "q_a_proj", "kv_b_proj", "q_proj"].map(String::from).to_vec()),
    );
    config.target_parameters = Some(vec!["mlp.experts.gate_up_proj".into(), "mlp.experts.down_proj".into()]);
    let adapter = tmp.path().join("adapter");
    trained_adapter(&attach(loaded.model, &config).unwrap().0, &config, &adapter);

    let merged = tmp.path().join("merged");
    let text = run_ok("convert", &[&p("--input"), &base_dir, &p("--merge-lora"), &adapter, &p("--output"), &merged, &p("--dtype"), &p("fp8")]);
    println!("{}", text.trim());
    // the f32 merge, in HF layout, as the reference values
    let base = load_causal_lm::<A>(&base_dir, &Default::default(), &LoadOptions::default()).unwrap();
    let (unmerged, _, _) = load_adapter(base.model, &adapter).unwrap();
    let adapter_logits = vals(logits(&unmerged, &io));
    let reference = tmp.path().join("reference");
    save_causal_lm(&merge(unmerged), &base.config, &reference).unwrap();
    let reference = read_all(&reference.join("model.safetensors"));

    let (input, output) = (read_all(&base_dir.join("model.safetensors")), read_all(&merged.join("model.safetensors")));
    assert_eq!(input.keys().collect::<Vec<_>>(), output.keys().collect::<Vec<_>>(), "the merged checkpoint's tensor names");
    for (name, t) in &input {
        assert_eq!((t.dtype, &t.shape), (output[name].dtype, &output[name].shape), "{name}: dtype and shape as in the input");
    }
    let mut files = SafetensorsFiles::open_dir(&merged).unwrap();
    files.set_fp8_block_from_config(&serde_json::from_str(&std::fs::read_to_string(merged.join("config.json")).unwrap()).unwrap()).unwrap();
    files.fp8_round_bf16 = false;
    let (mut checked, mut changed, mut worst) = (0, 0, 0f32);
    for name in files.fp8_scales.clone().keys() {
        let ours = files.read_f32(name).unwrap();
        let truth = f32s(&reference[name]);
        let [rows, cols] = [input[name].shape[0], input[name].shape[1]];
        let scales = f32s(&output[&format!("{name}_scale_inv")]);
        let grid_cols = cols.div_ceil(16);
        let mut amax = vec![0f32; scales.len()];
        for (i, (&x, &y)) in truth.iter().zip(&ours).enumerate() {
            let block = (i / cols / 16) * grid_cols + (i % cols) / 16;
            let s = scales[block];
            amax[block] = amax[block].max(x.abs());
            let step = (x.abs() / s).max(2f32.powi(-6)).log2().floor().exp2() / 8.0 * s;
            assert!((x - y).abs() <= step / 2.0 * 1.0001, "{name}[{}, {}]: merged {x}, FP8 {y}, step {step}", i / cols, i % cols);
            worst = worst.max((x - y).abs() / s);
        }
        for (b, (&s, &m)) in scales.iter().zip(&amax).enumerate() {
            assert!((s * 448.0 - m).abs() <= m * 1e-6, "{name}: block {b} scale {s} for largest magnitude {m}");
        }
        // an adapted weight moved by more than the quantisation step from the base
        let before = SafetensorsFiles::open_dir(&base_dir).map(|mut f| {
            f.set_fp8_block_from_config(&serde_json::json!({"quantization_config": {"weight_block_size": [16, 16]}})).unwrap();
            f.read_f32(name).unwrap()
        });
        changed += before.unwrap().iter().zip(&ours).any(|(a, b)| (a - b).abs() > 1e-2) as usize;
        checked += 1;
        assert_eq!(rows * cols, ours.len());
    }
    println!("{checked} FP8 weights re-quantised ({changed} moved by the merge); worst |Δ| {worst:.3} of a block scale (bound 16 at ±448)");
    assert!(checked >= 80 && changed >= 70, "{checked} FP8 weights, {changed} changed");
    // the merged FP8 checkpoint runs and carries the adapter: its logits are closer to the
    // adapter's than the base's are. Only that: the element bounds above are the exact check,
    // and this tiny random model is sensitive to FP8's 3 mantissa bits (re-quantising the base's
    // own FP8 weights with a zero adapter moves its logits by a mean KL of 3.9e-3; the merged
    // weights, off the FP8 grid, by 4.6e-2 against 2.8e-1 for dropping the adapter)
    let fp8 = load_causal_lm::<A>(&merged, &Default::default(), &LoadOptions::default()).unwrap().model;
    let st = logit_stats(&adapter_logits, &vals(logits(&fp8, &io)), 128, &mask);
    let base_model = load_causal_lm::<A>(&base_dir, &Default::default(), &LoadOptions::default()).unwrap().model;
    let without = logit_stats(&adapter_logits, &vals(logits(&base_model, &io)), 128, &mask);
    println!(
        "vs logits --adapter: FP8 merge mean KL {:.2e} (top-1 {:.3}), the base without the adapter {:.2e} (top-1 {:.3})",
        st.mean_kl, st.top1, without.mean_kl, without.top1
    );
    assert!(st.mean_kl < 0.5 * without.mean_kl && st.top1 > without.top1, "FP8 merge {st:?}\nbase {without:?}");
}

/// A LoRA-trained adapter written for `model`, with `B` away from its zero init (large enough
/// that the adapter moves the logits well beyond FP8's rounding). Both factors are fixed
/// patterns (`A` at Kaiming-uniform's scale, `1/√in`), not the backend's draw: tests in one
/// binary share its unseeded generator, so drawn values changed from run to run.
fn trained_adapter(model: &Glm5ForCausalLM<A>, config: &LoraConfig, dir: &std::path::Path) {
    use glm5_burn::checkpoint::safetensors_io::serialize;
    save_adapter(model, config, dir).unwrap();
    let weights = dir.join(ADAPTER_WEIGHTS);
    let mut tensors = read_all(&weights);
    for (name, t) in tensors.iter_mut() {
        let salt = name.len() as f32;
        let scale = match name.contains("lora_B") {
            true => 0.2,
            false => 1.0 / (*t.shape.last().unwrap() as f32).sqrt(),
        };
        t.data = (0..t.data.len() / 4).flat_map(|i| (scale * (i as f32 * 0.7 + salt).sin()).to_le_bytes()).collect();
    }
    std::fs::write(&weights, serialize(&tensors).unwrap()).unwrap();
}

/// The adapters' gradients of `model` for the LM loss on `io`, in PEFT's layout, and the loss.
fn adapter_grads(model: &Glm5ForCausalLM<A>, config: &LoraConfig, io: &Io) -> (f32, std::collections::BTreeMap<String, Vec<f32>>) {
    let out = model.forward(io.ids().with_mask(io.mask()), &ForwardOptions::default(), Outputs::default()).unwrap();
    let loss = glm5_burn::loss::lm_loss(out.logits, &io.i64("input_ids"));
    let value = vals(loss.clone())[0];
    let grads = loss.backward();
    let grad_model = model.clone().map(&mut ToGrads { grads: &grads, with_grad: 0 });
    let tmp = tempfile::tempdir().unwrap();
    save_adapter(&grad_model, config, tmp.path()).unwrap();
    (value, read_all(&tmp.path().join(ADAPTER_WEIGHTS)).iter().map(|(k, t)| (k.clone(), f32s(t))).collect())
}

/// LoRA on an FP8-resident base (`LoadOptions::fp8_base`: the checkpoint's FP8 projections
/// kept as E4M3 bytes + block scales, dequantised per use by `fp8_linear`) computes what it
/// computes on the dequantised base: the same logits within fp32 rounding (and the reference
/// run's on the dequantised weights), the same loss and adapter gradients — which flow back
/// through the FP8 layers' `∂x` — and, in BF16, logits within BF16 rounding.
#[test]
fn lora_on_an_fp8_resident_base_matches_the_dequantised_base() {
    use burn::tensor::DType;
    use glm5_burn::peft::{sites, Site};
    let dir = fixtures().join("fp8_f32_scales");
    let io = Io::open(&fixtures().join("fp8_oracle.safetensors"));
    let mask = io.mask();
    let load = |fp8_base: bool, dtype: DType| {
        load_causal_lm::<A>(&dir, &Default::default(), &LoadOptions { fp8_base, ..LoadOptions::with_dtype(dtype) }).unwrap().model
    };
    let (dense, mut fp8) = (load(false, DType::F32), load(true, DType::F32));
    // dense MLP (3), shared experts (3 × 3), MLA's q_a_proj, q_b_proj and kv_b_proj: FP8 in the file
    // and the routed experts of the three MoE layers
    let (mut resident, mut expert_layers, mut bytes, mut values) = (0, 0, 0, 0);
    for (name, site) in sites(&mut fp8) {
        match site {
            Site::Linear(l) => {
                if let Some(q) = &l.fp8 {
                    assert!(l.weight.is_none(), "{name}: an FP8 base holds no dense weight");
                    let (k, m) = l.in_out();
                    (resident, bytes, values) = (resident + 1, bytes + q.num_bytes(), values + k * m);
                }
            }
            Site::Experts(ex) => {
                let q = ex.fp8.as_ref().unwrap_or_else(|| panic!("{name}: the routed experts stay FP8"));
                assert!(ex.gate_proj.is_none() && ex.up_proj.is_none() && ex.down_proj.is_none(), "{name}: no dense stacks beside the FP8 base");
                let [e, d, i] = ex.dims();
                expert_layers += 1;
                bytes += q.gate_proj.num_bytes() + q.up_proj.num_bytes() + q.down_proj.num_bytes();
                values += 3 * e * d * i;
            }
        }
    }
    println!(
        "{resident} FP8-resident projections and {expert_layers} layers of routed experts: {bytes} bytes for {values} weights (f32: {})",
        4 * values
    );
    assert_eq!((resident, expert_layers), (15, 3));
    assert!(bytes < values + values / 8, "a byte a weight, plus the scales");
    let logits_of = |m: &Glm5ForCausalLM<A>| vals(logits(m, &io));
    let (ld, lq) = (logits_of(&dense), logits_of(&fp8));
    let (st, vs_ref) = (logit_stats(&ld, &lq, 128, &mask), logit_stats(&io.f32("logits"), &lq, 128, &mask));
    println!(
        "fp32: FP8-resident vs dequantised base: mean KL {:.2e}, max|Δ| {:.2e}; vs the reference run: mean KL {:.2e}",
        st.mean_kl, st.max_abs, vs_ref.mean_kl
    );
    assert!(st.mean_kl <= 1e-10 && st.max_abs <= 1e-4 && vs_ref.mean_kl <= 1e-10, "{st:?}\n{vs_ref:?}");

    // LoRA on both: the same adapter, the same loss and gradients
    let mut config = LoraConfig::new(
        2,
        4.0,
        TargetModules::Names(["q_proj", "o_proj", "q_a_proj", "kv_b_proj", "gate_proj", "up_proj", "down_proj"].map(String::from).to_vec()),
    );
    config.target_parameters = Some(vec!["mlp.experts.gate_up_proj".into(), "mlp.experts.down_proj".into()]);
    let tmp = tempfile::tempdir().unwrap();
    trained_adapter(&attach(dense.clone(), &config).unwrap().0, &config, tmp.path());
    let (dense, _, _) = load_adapter(dense, tmp.path()).unwrap();
    let (fp8, _, attached) = load_adapter(fp8, tmp.path()).unwrap();
    assert_eq!(trainable_counts(&fp8).0, attached.trainable, "only the adapters train on the FP8 base");
    let ((loss_d, gd), (loss_q, gq)) = (adapter_grads(&dense, &config, &io), adapter_grads(&fp8, &config, &io));
    assert_eq!(gd.keys().collect::<Vec<_>>(), gq.keys().collect::<Vec<_>>());
    let worst = gd.iter().map(|(k, g)| rel_err(&gq[k], g)).fold(0f32, f32::max);
    println!("LoRA: loss {loss_q:.7} (dequantised base {loss_d:.7}); {} adapter gradients, worst max|Δ|/max|ref| {worst:.2e}", gd.len());
    assert!(((loss_q - loss_d) / loss_d).abs() <= 1e-6 && worst <= 1e-5, "loss {loss_q} vs {loss_d}, gradients {worst:e}");
    // saving the FP8-resident base is refused (it holds no parameter a checkpoint would get)
    let e = glm5_burn::checkpoint::save_causal_lm(
        &fp8,
        &load_causal_lm::<A>(&dir, &Default::default(), &LoadOptions::default()).unwrap().config,
        tmp.path().join("saved"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("FP8") && e.contains("mlp"), "{e}");
    // merging onto the FP8 base (dequantised, then W + s·A·B) gives the dense merge
    let st = logit_stats(&logits_of(&merge(dense)), &logits_of(&merge(fp8)), 128, &mask);
    println!("merged: FP8 base vs dequantised base: mean KL {:.2e}, max|Δ| {:.2e}", st.mean_kl, st.max_abs);
    assert!(st.mean_kl <= 1e-10 && st.max_abs <= 1e-4, "{st:?}");

    // BF16: the same weights (BF16-rounded dequantisations) through another product path
    let (ld, lq) = (logits_of(&load(false, DType::BF16)), logits_of(&load(true, DType::BF16)));
    let st = logit_stats(&ld, &lq, 128, &mask);
    println!("bf16: FP8-resident vs dequantised base: mean KL {:.2e}, max|Δ| {:.2e}, top-1 {:.3}", st.mean_kl, st.max_abs, st.top1);
    assert!(st.mean_kl <= 1e-4, "{st:?}");
}

/// max |a − b| / max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// An FP8 weight's FSDP slices (`Fp8Weight::into_shard`): every rank holds whole blocks of
/// rows, the same number of rows everywhere (zero-padded), and the ranks' slices in rank order
/// are the weight — codes and block scales — which is what the per-layer all-gather rebuilds.
/// 40 rows in blocks of 16 over 2, 3 and 4 ranks (a last partial block; a rank with padding
/// only).
#[test]
fn fp8_weight_slices_are_whole_blocks_and_concatenate_to_the_weight() {
    use burn::tensor::{DType, Int, TensorData};
    use glm5_burn::distributed::RowShard;
    use glm5_burn::text::fp8_weight::Fp8Weight;
    type F = Flex;
    let dev = Default::default();
    let (m, k, block) = (40usize, 20usize, [16usize, 8]);
    let (gm, gk) = (m.div_ceil(block[0]), k.div_ceil(block[1]));
    let codes: Vec<u8> = (0..m * k).map(|i| (i * 7 % 251) as u8 + 1).collect();
    let scales: Vec<f32> = (0..gm * gk).map(|i| 0.5 + i as f32).collect();
    let whole = || {
        Fp8Weight::<F>::new(
            Tensor::<F, 2, Int>::from_data(TensorData::new(codes.clone(), [m, k]), (&dev, DType::U8)),
            Tensor::from_data(TensorData::new(scales.clone(), [gm, gk]), &dev),
            block,
        )
    };
    for size in [2usize, 3, 4] {
        let c = gm.div_ceil(size);
        let (mut all_codes, mut all_scales) = (Vec::new(), Vec::new());
        for rank in 0..size {
            let w = whole().into_shard(RowShard { rank, size });
            assert_eq!(w.shard, Some((RowShard { rank, size }, m)));
            assert_eq!(w.codes.dims(), [c * block[0], k], "{rank} of {size}: whole blocks, padded alike");
            assert_eq!(w.scale_inv.dims(), [c, gk]);
            let held = w.codes.to_data().as_slice::<u8>().unwrap().to_vec();
            let rows = (rank * c * block[0]).min(m)..((rank + 1) * c * block[0]).min(m);
            assert!(held[rows.len() * k..].iter().all(|&b| b == 0), "{rank} of {size}: padding rows are zero codes");
            assert_eq!(w.whole_bytes(), m * k + gm * gk * 4);
            all_codes.extend(held);
            all_scales.extend(w.scale_inv.to_data().as_slice::<f32>().unwrap().to_vec());
        }
        assert_eq!(&all_codes[..m * k], &codes[..], "codes over {size} ranks");
        assert_eq!(&all_scales[..gm * gk], &scales[..], "scales over {size} ranks");
    }
}
