//! The library training loop on the bundled tiny VLM (seeded weights) and sample: freezing
//! (no gradient, no optimizer state, unchanged weights), the non-finite policy (nothing
//! applied), bf16 compute with fp32 master weights, the router bias update (off by default),
//! and an in-process save/resume that continues bit for bit.

mod common;

use std::path::Path;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{DType, Tensor};
use common::{bundle, bundle_packs};
use glm5_burn::config::Glm5Config;
use glm5_burn::data::batch::MicroBatch;
use glm5_burn::text::decoder::Ffn;
use glm5_burn::train::params::param_ids;
use glm5_burn::train::recipe::{NonFinitePolicy, Precision, Recipe};
use glm5_burn::train::step::TrainError;
use glm5_burn::train::trainer::DataPosition;
use glm5_burn::train::trainer::{StepOutcome, TrainOptions, Trainer};
use glm5_burn::Glm5ForCausalLM;

type A = Autodiff<Flex>;

fn setup() -> (Glm5Config, glm5_burn::checkpoint::CheckpointConfig, Vec<MicroBatch>, TrainOptions) {
    let (json, ds) = bundle_packs();
    let config = json.resolved.clone();
    let micro = vec![ds.micro_batch(&[0]).unwrap(), ds.micro_batch(&[1]).unwrap()];
    let recipe =
        Recipe::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny_medpix.yaml"), &["--lr_scheduler.lr_warmup_steps=0".into()])
            .unwrap();
    (config, json, micro, TrainOptions::from_recipe(&recipe))
}

fn dtypes<M: Module<A>>(m: &M) -> Vec<(String, DType, bool)> {
    struct V(Vec<(String, DType, bool)>);
    impl burn::module::ModuleVisitor<A> for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<A, D>>) {
            self.0.push((format!("{:?}", p.id), p.val().dtype(), p.is_require_grad()));
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

/// A seeded model, initialised now: parameters are lazy, and the RNG is process-global (tests
/// run in parallel threads), so seeding and drawing happen under one lock.
/// Held by every draw from the backend's generator, which the tests of this binary share: a
/// draw outside it (an adapter's initialisation) interleaved with another test's seeded
/// model and changed its weights from run to run.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn model(config: &Glm5Config, seed: u64) -> Glm5ForCausalLM<A> {
    use burn::tensor::backend::Backend;
    let _guard = RNG.lock().unwrap_or_else(|p| p.into_inner());
    let device = Default::default();
    A::seed(&device, seed);
    let m = Glm5ForCausalLM::<A>::try_new_with_vision(config, None, &device).unwrap();
    values(&m);
    m
}

fn values<M: Module<A>>(m: &M) -> Vec<Vec<f32>> {
    struct V(Vec<Vec<f32>>);
    impl burn::module::ModuleVisitor<A> for V {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<A, D>>) {
            self.0.push(p.val().into_data().convert::<f32>().into_vec().unwrap());
        }
    }
    let mut v = V(Vec::new());
    m.visit(&mut v);
    v.0
}

#[test]
fn frozen_parameters_take_no_update_and_no_state() {
    let (config, _, micro, opts) = setup();
    let m = model(&config, 7);
    let (embed0, vision0, layers0) = (values(&m.language_model.embed_tokens), values(m.visual.as_ref().unwrap()), values(&m.language_model.layers));
    let mut t = Trainer::<A>::new(m, opts);
    let StepOutcome::Applied(metrics) = t.step(&micro).unwrap() else { panic!("finite step") };
    assert!(metrics.loss.is_finite() && metrics.grad_norm > 0.0);
    let m = t.model();
    assert_eq!(values(&m.language_model.embed_tokens), embed0, "freeze_embeddings");
    assert_eq!(values(m.visual.as_ref().unwrap()), vision0, "freeze_vision_tower");
    assert_ne!(values(&m.language_model.layers), layers0, "the decoder trains");
    let state = t.optimizer_state_ids();
    let frozen = param_ids::<A, _>(&m.language_model.embed_tokens).into_values().chain(param_ids::<A, _>(m.visual.as_ref().unwrap()).into_values());
    for id in frozen {
        assert!(!state.contains(&id), "a frozen parameter has optimizer state");
    }
    let trained = param_ids::<A, _>(&m.language_model.layers);
    let with_state = trained.values().filter(|id| state.contains(id)).count();
    assert!(with_state > 0 && with_state < trained.len(), "decoder parameters have state, except the indexer's (no gradient)");
    for (path, id) in &trained {
        assert_eq!(state.contains(id), !path.contains("indexer") && !path.contains("e_score_correction_bias"), "{path}");
    }
}

struct Poison;
impl ModuleMapper<A> for Poison {
    fn map_float<const D: usize>(&mut self, p: Param<Tensor<A, D>>) -> Param<Tensor<A, D>> {
        p.map(|t| {
            let rg = t.is_require_grad();
            let t = Tensor::from_inner(t.inner() * f32::NAN);
            if rg {
                t.require_grad()
            } else {
                t
            }
        })
    }
}

#[test]
fn non_finite_steps_apply_nothing() {
    let (config, _, micro, mut opts) = setup();
    let mut m = model(&config, 7);
    m.lm_head = m.lm_head.map(|h| h.map(&mut Poison)); // NaN logits → NaN loss and gradients
    let before = values(&m.language_model.layers);
    opts.on_nonfinite = NonFinitePolicy::Skip;
    let mut t = Trainer::<A>::new(m.clone(), opts.clone());
    let out = t.step(&micro).unwrap();
    assert!(matches!(out, StepOutcome::Skipped { what: "loss", .. }), "{out:?}");
    assert_eq!((t.step, t.skipped_steps), (1, 1));
    assert_eq!(values(&t.model().language_model.layers), before, "weights untouched");
    assert!(t.optimizer_state_ids().is_empty(), "no optimizer state created");
    opts.on_nonfinite = NonFinitePolicy::Abort;
    let mut t = Trainer::<A>::new(m, opts);
    let e = t.step(&micro).unwrap_err();
    assert!(matches!(e, TrainError::NonFinite { .. }) && e.to_string().contains("non-finite loss"), "{e}");
    assert_eq!(values(&t.model().language_model.layers), before);
}

#[test]
fn bf16_compute_updates_fp32_master_weights() {
    let (mut config, _, micro, mut opts) = setup();
    // every expert and every key selected: no top-k choice for a bf16 rounding to flip, so the
    // two runs differ by rounding alone (a flipped expert moves this tiny model's gradient
    // norm by ~10 %)
    let t = &mut config.text_config;
    (t.num_experts_per_tok, t.n_group, t.topk_group, t.index_topk) = (t.n_routed_experts, 1, 1, 1 << 16);
    let m = model(&config, 7);
    let mut f32_run = Trainer::<A>::new(m.clone(), opts.clone());
    opts.precision = Precision::Bf16;
    let mut bf16_run = Trainer::<A>::new(m, opts);
    for step in 0..3 {
        let (StepOutcome::Applied(a), StepOutcome::Applied(b)) = (f32_run.step(&micro).unwrap(), bf16_run.step(&micro).unwrap()) else { panic!() };
        println!("step {step}: loss f32 {:.5} bf16 {:.5}, grad norm {:.4} / {:.4}", a.loss, b.loss, a.grad_norm, b.grad_norm);
        // bf16 rounding (8 mantissa bits) in every matmul: a few parts in a thousand (measured:
        // loss ≤ 2.5e-3, gradient norm ≤ 1.7e-2 relative)
        assert!((a.loss - b.loss).abs() < 5e-3 * a.loss, "step {step}: {} vs {}", a.loss, b.loss);
        assert!((a.grad_norm - b.grad_norm).abs() < 3e-2 * a.grad_norm, "step {step}: {} vs {}", a.grad_norm, b.grad_norm);
    }
    let w = bf16_run.model().language_model.layers[0].post_attention_layernorm.weight.val();
    assert_eq!(w.dtype(), DType::F32, "master weights stay fp32");
    let (_, count) = bf16_run.evaluate(&micro).unwrap();
    assert!(count > 0);
}

#[test]
fn router_bias_moves_only_when_enabled() {
    let (config, _, micro, mut opts) = setup();
    let bias = |t: &Trainer<A>| -> Vec<Vec<f32>> {
        t.model()
            .language_model
            .layers
            .iter()
            .filter_map(|l| match &l.mlp {
                Ffn::Moe(m) => Some(m.gate.e_score_correction_bias.val().into_data().convert::<f32>().into_vec().unwrap()),
                Ffn::Dense(_) => None,
            })
            .collect()
    };
    let mut off = Trainer::<A>::new(model(&config, 7), opts.clone());
    let b0 = bias(&off);
    off.step(&micro).unwrap();
    assert_eq!(bias(&off), b0, "off by default");
    opts.router_bias_update_rate = 1e-3;
    let mut on = Trainer::<A>::new(model(&config, 7), opts);
    on.step(&micro).unwrap();
    let b1 = bias(&on);
    for (layer, (new, old)) in b1.iter().zip(&b0).enumerate() {
        let moved: Vec<f32> = new.iter().zip(old).map(|(a, b)| a - b).collect();
        assert!(moved.iter().all(|d| d.abs() < 1.0001e-3 && (d.abs() < 1e-9 || d.abs() > 0.9999e-3)), "layer {layer}: ±γ or 0: {moved:?}");
        assert!(moved.iter().any(|d| *d > 0.0) && moved.iter().any(|d| *d < 0.0), "layer {layer}: under-loaded up, over-loaded down");
    }
}

#[test]
fn save_and_resume_continue_exactly() {
    let (config, json, micro, opts) = setup();
    let device = Default::default();
    let tmp = tempfile::tempdir().unwrap();
    let mut straight = Trainer::<A>::new(model(&config, 7), opts.clone());
    let mut first = Trainer::<A>::new(model(&config, 7), opts.clone());
    let mut losses = Vec::new();
    for _ in 0..2 {
        let (StepOutcome::Applied(a), StepOutcome::Applied(b)) = (straight.step(&micro).unwrap(), first.step(&micro).unwrap()) else { panic!() };
        assert_eq!(a.loss, b.loss, "seeded init is reproducible");
        losses.push(a.loss);
    }
    let dir =
        first.save_checkpoint(tmp.path(), 2, &json, &[bundle().join("tokenizer.json")], DataPosition { epoch: 3, cursor: 5, seed: 42 }).unwrap();
    assert!(dir.ends_with("step_000002") && dir.join("model/tokenizer.json").is_file());
    drop(first);
    let (mut resumed, state) = Trainer::<A>::resume(&dir, opts, true, &device).unwrap();
    assert_eq!((state.step, state.epoch, state.cursor, state.seed), (2, 3, 5, 42));
    for step in 2..4 {
        let (StepOutcome::Applied(a), StepOutcome::Applied(b)) = (straight.step(&micro).unwrap(), resumed.step(&micro).unwrap()) else { panic!() };
        assert_eq!((a.loss, a.grad_norm, a.lr), (b.loss, b.grad_norm, b.lr), "step {step}");
    }
    // a directory that is not a checkpoint is refused, naming the file
    let e = Trainer::<A>::resume(
        &tmp.path().join("missing"),
        TrainOptions::from_recipe(&Recipe::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny_medpix.yaml"), &[]).unwrap()),
        true,
        &device,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("trainer_state.json"), "{e}");
}

/// `train::resume::resume_run`, what `finetune` does on start: nothing to resume in an empty
/// directory; the newest checkpoint that loads (a damaged newer one skipped and named) with its
/// data position on the same data; on changed data a refusal naming each difference, or, asked
/// to, the checkpoint's step with the new data from its first pack.
#[test]
fn resume_run_picks_the_newest_intact_checkpoint_and_checks_the_data() {
    use glm5_burn::data::fingerprint::DataFingerprint;
    use glm5_burn::train::resume::{resume_run, ResumeOptions, RunData};
    let (config, json, micro, opts) = setup();
    let device = Default::default();
    let tmp = tempfile::tempdir().unwrap();
    let how = ResumeOptions { vision: true, ..ResumeOptions::default() };
    let fp = DataFingerprint {
        path: "data".into(),
        format: "jsonl".into(),
        split: "train".into(),
        max_samples: None,
        files: Default::default(),
        packed_sequence_size: 160,
        drop_long_samples: true,
        seed: 42,
        global_batch_size: 4,
        local_batch_size: 1,
        packs: 9,
        content: "0123456789abcdef".into(),
    };
    let data = RunData { fingerprint: &fp, packs: 9, seed: 42 };
    assert!(resume_run::<A>(tmp.path(), &opts, &data, how, &device).unwrap().is_none());

    let mut first = Trainer::<A>::new(model(&config, 7), opts.clone());
    first.step(&micro).unwrap();
    first.data_fingerprint = Some(fp.clone());
    first.save_checkpoint(tmp.path(), 1, &json, &[], DataPosition { epoch: 1, cursor: 3, seed: 42 }).unwrap();
    // a newer checkpoint cut short: its state file is not JSON
    let newer = tmp.path().join("step_000002");
    std::fs::create_dir_all(&newer).unwrap();
    std::fs::write(newer.join("trainer_state.json"), "{ truncated").unwrap();

    let r = resume_run::<A>(tmp.path(), &opts, &data, how, &device).unwrap().unwrap();
    assert!(r.dir.ends_with("step_000001"), "{}", r.dir.display());
    assert_eq!((r.state.step, r.sampler.epoch, r.sampler.cursor), (1, 1, 3));
    assert_eq!(r.trainer.data_fingerprint.as_ref(), Some(&fp));
    let notes = r.notes.join("\n");
    assert!(notes.contains("step_000002 does not load") && notes.contains("newest intact checkpoint"), "{notes}");
    assert!(notes.contains("resumed from") && notes.contains("epoch 1, pack 3"), "{notes}");

    let mut other = fp.clone();
    other.packed_sequence_size = 512;
    let changed = RunData { fingerprint: &other, packs: 9, seed: 42 };
    let e = resume_run::<A>(tmp.path(), &opts, &changed, how, &device).err().unwrap().to_string();
    assert!(e.contains("step_000001") && e.contains("packed_sequence.packed_sequence_size: 160 → 512"), "{e}");
    assert!(e.contains("--reset-data-position"), "{e}");
    let reset = ResumeOptions { reset_data_position: true, ..how };
    let r = resume_run::<A>(tmp.path(), &opts, &changed, reset, &device).unwrap().unwrap();
    assert_eq!((r.state.step, r.sampler.epoch, r.sampler.cursor), (1, 0, 0));
    assert_eq!(r.trainer.data_fingerprint.as_ref(), Some(&other));
    assert!(r.notes.iter().any(|n| n.contains("on changed data")), "{:?}", r.notes);
}

/// `model.base_dtype: bf16`: a LoRA run in bf16 holds its frozen base in bf16 (cast once, no
/// fp32 masters: half the base's bytes) and trains exactly as the same run on an fp32 base,
/// whose every step casts the base into the same bf16 compute copy — bit for bit, three steps.
/// The adapters stay fp32, as do the fp32-kept tensors (router bias, mHC scales).
#[test]
fn a_bf16_base_holds_half_the_bytes_and_trains_as_the_fp32_base_in_bf16() {
    use glm5_burn::train::recipe::BaseDtype;
    use glm5_burn::train::trainer::PeftOptions;
    let (config, _, micro, mut opts) = setup();
    let lora: glm5_burn::text::lora::LoraConfig = serde_json::from_value(serde_json::json!({
        "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj", "gate_proj", "down_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    }))
    .unwrap();
    // attached once, so that both runs start from the same adapters
    let m = model(&config, 7);
    let (m, _) = {
        let _guard = RNG.lock().unwrap_or_else(|p| p.into_inner());
        glm5_burn::peft::attach(m, &lora).unwrap()
    };
    opts.precision = Precision::Bf16;
    let run = |base_dtype| {
        let mut o = opts.clone();
        o.peft = Some(PeftOptions { config: lora.clone(), base: None, base_dtype });
        Trainer::<A>::new(m.clone(), o)
    };
    let (mut f32_base, mut bf16_base) = (run(BaseDtype::F32), run(BaseDtype::Bf16));
    let bytes = |t: &Trainer<A>| -> usize {
        let mut n = 0;
        struct B<'a>(&'a mut usize);
        impl burn::module::ModuleVisitor<A> for B<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<A, D>>) {
                let v = p.val();
                *self.0 += v.shape().num_elements() * v.dtype().size();
            }
        }
        t.model().visit(&mut B(&mut n));
        n
    };
    let (held32, held16) = (dtypes(f32_base.model()), dtypes(bf16_base.model()));
    let (mut frozen16, mut kept32) = (0, 0);
    for ((id, d32, grad), (id16, d16, grad16)) in held32.iter().zip(&held16) {
        assert_eq!((id, grad), (id16, grad16));
        assert_eq!(*d32, DType::F32, "{id}: an fp32 base");
        match (grad, d16) {
            (true, d) => assert_eq!(*d, DType::F32, "{id}: an adapter stays fp32"),
            (false, DType::BF16) => frozen16 += 1,
            (false, _) => kept32 += 1,
        }
    }
    println!("bf16 base: {frozen16} frozen tensors in bf16, {kept32} kept fp32; {} -> {} bytes", bytes(&f32_base), bytes(&bf16_base));
    assert!(frozen16 > 50 && kept32 > 0, "{frozen16} bf16, {kept32} fp32-kept");
    assert!((bytes(&bf16_base) as f64) < 0.56 * bytes(&f32_base) as f64);
    for step in 0..3 {
        let (StepOutcome::Applied(a), StepOutcome::Applied(b)) = (f32_base.step(&micro).unwrap(), bf16_base.step(&micro).unwrap()) else { panic!() };
        println!("step {step}: loss {:.6} / {:.6}, grad norm {:.6} / {:.6}", a.loss, b.loss, a.grad_norm, b.grad_norm);
        assert_eq!((a.loss.to_bits(), a.grad_norm.to_bits()), (b.loss.to_bits(), b.grad_norm.to_bits()), "step {step}");
    }
    let trained = |t: &Trainer<A>| values(t.model()).into_iter().zip(dtypes(t.model())).filter(|(_, d)| d.2).map(|(v, _)| v).collect::<Vec<_>>();
    assert_eq!(trained(&f32_base), trained(&bf16_base), "the same adapters after three steps");
}

/// `ParallelTraining::save_checkpoint` / `load_checkpoint` in one process with Burn's own
/// AdamW: the loaded model and moments equal the saved ones bit for bit (frozen embedding
/// included, and trained as frozen again); a directory that is not such a checkpoint (an
/// unsharded `Trainer`'s, with `optimizer.mpk`) is refused naming what is missing; a model with
/// LoRA adapters is refused rather than saved without them.
#[test]
fn a_loop_of_ones_own_saves_and_loads_its_checkpoint() {
    use burn::optim::{AdamW, AdamWConfig, GradientsParams, Optimizer};
    use glm5_burn::train::parallel::ParallelTraining;
    let (config, json, micro, opts) = setup();
    let device = Default::default();
    let tmp = tempfile::tempdir().unwrap();
    let frozen = glm5_burn::train::params::freeze(model(&config, 7), &opts.freeze);
    let (mut m, par) = ParallelTraining::prepare(frozen, &opts.parallel).unwrap();
    let mut optim = AdamWConfig::new().init::<A, Glm5ForCausalLM<A>>();
    let out = glm5_burn::train::step::forward_micro(&m, &micro[0], &opts.forward, None).unwrap();
    let (sum, _) = glm5_burn::loss::target_loss_sum(out.output.logits, &out.targets);
    m = optim.step(1e-3, m.clone(), GradientsParams::from_grads(sum.backward(), &m));
    let dir = par.save_checkpoint(tmp.path(), 1, &m, &optim, &json, 2, DataPosition { epoch: 0, cursor: 2, seed: 3 }).unwrap();
    assert!(dir.join("model/model.safetensors").is_file() && dir.join("optimizer/rank-00000-of-00001.safetensors").is_file());
    let r = ParallelTraining::load_checkpoint::<A, AdamW>(&dir, &opts, true, &device).unwrap();
    let (back, record, state) = (r.model, r.record, r.state);
    assert_eq!((state.step, state.cursor, state.seed), (1, 2, 3));
    let values = |m: &Glm5ForCausalLM<A>| -> Vec<(String, bool, Vec<u32>)> {
        let ids = param_ids::<A, _>(m);
        struct V(std::collections::HashMap<burn::module::ParamId, (bool, Vec<u32>)>);
        impl burn::module::ModuleVisitor<A> for V {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<A, D>>) {
                let bits = p.val().into_data().convert::<f32>().into_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect();
                self.0.insert(p.id, (p.is_require_grad(), bits));
            }
        }
        let mut v = V(Default::default());
        m.visit(&mut v);
        ids.into_iter()
            .map(|(path, id)| {
                let (rg, bits) = v.0.remove(&id).unwrap();
                (path, rg, bits)
            })
            .collect()
    };
    assert_eq!(values(&m), values(&back));
    let saved = optim.to_record();
    assert_eq!(record.len(), saved.len());
    assert!(values(&back).iter().any(|(p, rg, _)| p.contains("embed_tokens") && !rg));

    // an unsharded Trainer's checkpoint (optimizer.mpk)
    let trainer = Trainer::<A>::new(model(&config, 7), opts.clone());
    let tdir = trainer.save_checkpoint(&tmp.path().join("trainer"), 2, &json, &[], DataPosition::default()).unwrap();
    let e = ParallelTraining::load_checkpoint::<A, AdamW>(&tdir, &opts, true, &device).err().unwrap().to_string();
    assert!(e.contains("optimizer") && e.contains("Trainer::resume"), "{e}");
    let e = ParallelTraining::load_checkpoint::<A, AdamW>(&tmp.path().join("nothing"), &opts, true, &device).err().unwrap().to_string();
    assert!(e.contains("trainer_state.json"), "{e}");

    // adapters would be lost: refused
    let lora: glm5_burn::text::lora::LoraConfig =
        serde_json::from_value(serde_json::json!({"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})).unwrap();
    let with = {
        let _guard = RNG.lock().unwrap_or_else(|p| p.into_inner());
        glm5_burn::peft::attach(m.clone(), &lora).unwrap().0
    };
    let e = par.save_checkpoint(&tmp.path().join("lora"), 1, &with, &optim, &json, 2, DataPosition::default()).err().unwrap().to_string();
    assert!(e.contains("LoRA"), "{e}");
}
