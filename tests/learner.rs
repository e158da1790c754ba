//! The model in burn-train's `Learner` (`train::learner`, feature `learner`): the gradients
//! Burn's loop accumulates over a global batch's items equal our `Trainer`'s step gradients;
//! the schedule adapter gives optimizer step k the schedule's rate; the `learner` example
//! trains and reports; `compose` trains only its head; `swap` compares two runs per layer.
#![cfg(feature = "learner")]

use std::path::PathBuf;
use std::process::Command;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::lr_scheduler::LrScheduler;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use burn::train::TrainStep;
use glm5_burn::data::batch::MicroBatch;
use glm5_burn::train::learner::{LmItem, ScheduleLr};
use glm5_burn::train::recipe::DecayStyle;
use glm5_burn::train::schedule::LrSchedule;
use glm5_burn::train::step::{accumulate, StepContext};
use glm5_burn::{ForwardOptions, Glm5Config, Glm5ForCausalLM};

type B = Autodiff<Flex>;

#[test]
fn learner_items_accumulate_the_trainer_step_gradients() {
    let device = Default::default();
    B::seed(&device, 5);
    let config = Glm5Config::tiny();
    let model = Glm5ForCausalLM::<B>::new(&config, &device);
    let v = config.text_config.vocab_size as i64;
    let micro: Vec<MicroBatch> = (0..3)
        .map(|i| {
            let seq = 9 + 4 * i;
            let ids: Vec<i64> = (0..seq).map(|t| ((t * 29 + i * 13 + 3) as i64) % v).collect();
            let labels = ids.iter().enumerate().map(|(t, &x)| if t % 4 == i { -100 } else { x }).collect();
            MicroBatch::text(ids, labels, 1, seq, None)
        })
        .collect();
    let aux = 0.01;
    let reference = accumulate(&model, &micro, &StepContext::local(&micro, model.vocab_size, aux, ForwardOptions::default())).unwrap();
    let items = LmItem::from_global_batches(vec![micro], config.text_config.vocab_size, aux, &ForwardOptions::default());
    let mut acc = GradientsAccumulator::<Glm5ForCausalLM<B>>::new();
    for item in items {
        acc.accumulate(&model, TrainStep::step(&model, item).grads);
    }
    let ours = acc.grads();
    struct Same<'a> {
        a: &'a GradientsParams,
        b: &'a GradientsParams,
        n: usize,
    }
    impl ModuleVisitor<B> for Same<'_> {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
            let get = |g: &GradientsParams| g.get::<Flex, D>(p.id).map(|t| t.into_data());
            assert_eq!(get(self.a), get(self.b), "parameter {}", p.id);
            self.n += usize::from(get(self.a).is_some());
        }
    }
    let mut same = Same { a: &ours, b: &reference.grads, n: 0 };
    model.visit(&mut same);
    assert!(same.n > 50, "{} gradients compared", same.n);
}

#[test]
fn schedule_adapter_gives_each_optimizer_step_its_rate() {
    let schedule = LrSchedule { style: DecayStyle::Cosine, lr: 1e-3, min_lr: 1e-5, warmup_steps: 2, total_steps: 6 };
    let mut lr = ScheduleLr { schedule, accumulation: 3, items: 0 };
    for step in 0..6 {
        // the optimizer applies after the third item of a step, with the rate of the last
        let rates: Vec<f64> = (0..3).map(|_| lr.step()).collect();
        assert_eq!(rates[2], schedule.at(step), "optimizer step {step}");
    }
}

fn example(name: &str) -> PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        let status = Command::new(env!("CARGO"))
            .args(["build", "--example", "learner", "--example", "compose", "--example", "swap"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo");
        assert!(status.success(), "building the examples failed");
    });
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(|d| d.parent()).expect("target/<profile>").join("examples").join(name)
}

#[test]
fn learner_example_trains_and_reports_the_validation_loss() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(example("learner"))
        .args(["--step_scheduler.max_steps=6", "--packed_sequence.packed_sequence_size=160", "--dir"])
        .arg(tmp.path())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let losses: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            l.strip_prefix("step ").and_then(|r| r.split("loss ").nth(1)).and_then(|r| r.split_whitespace().next()).and_then(|x| x.parse().ok())
        })
        .collect();
    assert_eq!(losses.len(), 6, "one line per optimizer step:\n{text}");
    assert!(losses[5] < losses[0], "the loss falls: {losses:?}");
    let val: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("validation loss after 6 steps (label-token mean, as finetune reports it): "))
        .and_then(|x| x.trim().parse().ok())
        .unwrap_or_else(|| panic!("no final validation loss:\n{text}"));
    assert!(val.is_finite() && val < losses[0], "validation {val} vs first loss {}", losses[0]);
    assert!(tmp.path().join("checkpoint").is_dir(), "burn-train's checkpointer wrote {}", tmp.path().display());
}

#[test]
fn compose_example_trains_only_its_head() {
    let out = Command::new(example("compose")).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("the backbone's weights are unchanged"), "{text}");
    let first: f64 = text.lines().find_map(|l| l.strip_prefix("step  0: loss ")).and_then(|x| x.parse().ok()).unwrap();
    let last: f64 = text.lines().find_map(|l| l.strip_prefix("step 99: loss ")).and_then(|x| x.parse().ok()).unwrap();
    assert!(last < first, "the head learns: {first} → {last}");
}

#[test]
fn swap_compares_two_runs_layer_by_layer() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/base_k4");
    let run = |a: &str, b: &str| {
        Command::new(example("swap"))
            .arg("--checkpoint")
            .arg(&fixture)
            .arg("--input")
            .arg(fixture.join("io.safetensors"))
            .args(["--a", a, "--b", b, "--json"])
            .output()
            .unwrap()
    };
    let out = run("flex:f32:reference", "flex:f32:op");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let layers = j["layers"].as_array().unwrap();
    assert_eq!(layers.len(), 4, "{j}");
    for l in layers {
        assert!(l["max_rel"].as_f64().unwrap() < 1e-4 && l["cosine"].as_f64().unwrap() > 0.999999, "{l}");
    }
    assert!(j["logits"]["kl_mean"].as_f64().unwrap() < 1e-9 && j["logits"]["top1_agreement"].as_f64().unwrap() == 1.0, "{j}");
    // the same run against itself is exact; a bf16 run is not
    let same: serde_json::Value = serde_json::from_slice(&run("flex:f32:op", "flex:f32:op").stdout).unwrap();
    assert_eq!(same["logits"]["max_rel"].as_f64(), Some(0.0), "{same}");
    let bf16: serde_json::Value = serde_json::from_slice(&run("flex:f32:op", "flex:bf16:op").stdout).unwrap();
    assert!(bf16["logits"]["max_rel"].as_f64().unwrap() > 1e-3, "{bf16}");
    let bad = run("flex:f16:op", "flex:f32:op");
    let text = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && text.contains("--a") && text.contains("dtype \"f16\""), "{text}");
}
