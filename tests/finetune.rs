//! The `finetune` example end to end (the binary `cargo test` builds in `target/*/examples/`):
//! a run killed with SIGKILL after a checkpoint and then resumed produces the same loss trace,
//! bit for bit, as an uninterrupted run; its checkpoint loads in the `logits` example; one run
//! per checkpoint directory; resume refuses changed data; a damaged newest checkpoint falls
//! back to the previous one. Also the other CLIs' refusals of bad sizes and paths.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The example binary next to this test's profile directory, built if needed (`cargo test`
/// builds examples already; `cargo test --test finetune` does not).
fn example(name: &str) -> PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        let status = Command::new(env!("CARGO"))
            .args(["build", "--example", "finetune", "--example", "logits", "--example", "bench", "--example", "convert", "--example", "generate"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo");
        assert!(status.success(), "building the examples failed");
    });
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/..");
    let p = dir.join("examples").join(name);
    assert!(p.is_file(), "{} was not built", p.display());
    p
}

fn overrides(ckpt: &Path) -> Vec<String> {
    [
        format!("--checkpoint.checkpoint_dir={}", ckpt.display()),
        "--step_scheduler.max_steps=8".into(),
        "--step_scheduler.global_batch_size=2".into(),
        "--step_scheduler.local_batch_size=1".into(),
        "--step_scheduler.ckpt_every_steps=2".into(),
        "--step_scheduler.val_every_steps=4".into(),
        "--packed_sequence.packed_sequence_size=160".into(),
        "--checkpoint.keep_last=2".into(),
    ]
    .into()
}

fn trace(ckpt: &Path) -> Vec<(u64, f64, f64)> {
    let text = std::fs::read_to_string(ckpt.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        // step lines (a fresh run's validation of its starting point is a step-0 line without a loss)
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap(), v["grad_norm"].as_f64().unwrap()))
        .collect()
}

fn run_to_end(ckpt: &Path) -> String {
    let out = Command::new(example("finetune")).args(overrides(ckpt)).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "finetune failed:\n{text}");
    text
}

#[test]
fn killed_and_resumed_run_matches_an_uninterrupted_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let log = run_to_end(&a);
    let full = trace(&a);
    assert_eq!(full.iter().map(|t| t.0).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>(), "{log}");
    assert!(full[7].1 < full[0].1, "the loss falls: {full:?}");
    // validation answers the questions greedily: exact match at the start (step 0) and at each validation
    let rows: Vec<Value> = std::fs::read_to_string(a.join("metrics.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let acc: Vec<(u64, f64, u64)> =
        rows.iter().filter_map(|r| Some((r["step"].as_u64()?, r["val_accuracy"].as_f64()?, r["val_answered"].as_u64()?))).collect();
    assert_eq!(acc.iter().map(|a| a.0).collect::<Vec<_>>(), [0, 4, 8], "{rows:?}");
    assert!(acc.iter().all(|a| (0.0..=1.0).contains(&a.1) && a.2 == 24), "24 validation questions answered: {acc:?}");
    assert!(rows[0].get("loss").is_none() && rows[0]["val_loss"].as_f64().is_some(), "step 0 is validation only");
    assert!(log.contains("validation exact match"), "{log}");
    let svg = std::fs::read_to_string(a.join("curves.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("validation") && svg.contains("peak RSS"), "curves.svg");
    let kept: Vec<String> =
        std::fs::read_dir(&a).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).filter(|n: &String| n.starts_with("step_")).collect();
    assert_eq!(kept.len(), 2, "keep_last = 2: {kept:?}");

    // start b, SIGKILL it once step 5 is logged (step 4's checkpoint exists), resume it
    let mut child = Command::new(example("finetune")).args(overrides(&b)).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let t0 = Instant::now();
    loop {
        let steps = std::fs::read_to_string(b.join("metrics.jsonl")).map(|t| t.lines().filter(|l| l.contains("\"loss\"")).count()).unwrap_or(0);
        if steps >= 5 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(600), "run b did not reach step 5");
        assert!(child.try_wait().unwrap().is_none(), "run b ended before it was killed");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(trace(&b).len() < 8, "killed before the end");
    let log = run_to_end(&b);
    assert!(log.contains("resumed from"), "{log}");
    let resumed = trace(&b);
    assert_eq!(resumed.len(), 8, "{resumed:?}");
    for (x, y) in full.iter().zip(&resumed) {
        assert_eq!(x, y, "step {}: uninterrupted {x:?} vs killed+resumed {y:?}", x.0);
    }

    // the checkpoint runs in the logits example (vision tower included), image + prompt
    let ckpt = a.join("step_000008").join("model");
    let image = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/medpix_jsonl/images/train_0000.png");
    let out = Command::new(example("logits"))
        .args(["--checkpoint", ckpt.to_str().unwrap(), "--tokenizer", ckpt.join("tokenizer.json").to_str().unwrap()])
        .args(["--image", image.to_str().unwrap(), "--prompt", "Which imaging modality was used?"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "logits on the finetune checkpoint failed:\n{text}");
    assert!(text.contains("next token:") && text.contains("p="), "{text}");
    // and answers in the generate example's human mode (decoded with caches, streamed)
    let out = Command::new(example("generate"))
        .args(["--checkpoint", ckpt.to_str().unwrap(), "--tokenizer", ckpt.to_str().unwrap(), "--max-new-tokens", "8"])
        .args(["--image", image.to_str().unwrap(), "--prompt", "Is the kidney lesion large or small?"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "generate on the finetune checkpoint failed:\n{text}");
    assert!(!text.trim().is_empty(), "no answer printed");
}

#[test]
fn refuses_to_overwrite_checkpoints_without_resume() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(tmp.path().join("step_000002")).unwrap();
    std::fs::write(tmp.path().join("step_000002/trainer_state.json"), "{}").unwrap();
    let mut args = overrides(tmp.path());
    args.push("--no-resume".into());
    let out = Command::new(example("finetune")).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && text.contains("holds checkpoints"), "{text}");
    // an unknown backend is refused by the parser, one this build lacks is named
    let out = Command::new(example("finetune")).arg("--backend=metal").output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && text.contains("'metal'") && text.contains("[possible values: flex, cuda, vulkan]"), "{text}");
    if !cfg!(feature = "cuda") {
        let out = Command::new(example("finetune")).arg("--backend=cuda").output().unwrap();
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success() && text.contains("--backend=cuda: not available in this build (flex"), "{text}");
    }
    // --help lists the flags and every recipe key with the embedded default's value
    let out = Command::new(example("finetune")).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    for want in ["--no-resume", "--reset-data-position", "--backend", "--step_scheduler.max_steps=40", "--distributed.reshard_after_forward=true"] {
        assert!(out.status.success() && text.contains(want), "--help lacks {want}:\n{text}");
    }
    // an unknown recipe key names its path
    let out = Command::new(example("finetune")).arg("--optimizer.momentum=0.9").output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && text.contains("optimizer.momentum"), "{text}");
}

/// Two runs on one checkpoint directory: the second is refused at start, naming the
/// directory and the process that holds it, and touches nothing; the first finishes and its
/// checkpoints and metrics are whole. After the first ends, a new run may take the directory.
#[test]
fn a_second_run_on_the_same_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("shared");
    let mut first = Command::new(example("finetune")).args(overrides(&dir)).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let t0 = Instant::now();
    while !dir.join(".lock").exists() || std::fs::read_to_string(dir.join(".lock")).unwrap_or_default().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(300), "the first run never took the lock");
        assert!(first.try_wait().unwrap().is_none(), "the first run ended early");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut second_args = overrides(&dir);
    second_args.push("--optimizer.lr=1e-3".into());
    let out = Command::new(example("finetune")).args(second_args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "the second run was not refused:\n{text}");
    assert!(
        text.contains(&dir.display().to_string()) && text.contains("in use by another run") && text.contains(&format!("pid {}", first.id())),
        "{text}"
    );
    let status = first.wait().unwrap();
    assert!(status.success(), "the first run failed");
    let steps: Vec<u64> = trace(&dir).iter().map(|t| t.0).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>(), "metrics.jsonl holds the first run's 8 steps only");
    for step in ["step_000006", "step_000008"] {
        let d = dir.join(step);
        assert!(
            d.join("trainer_state.json").is_file() && d.join("optimizer.mpk").is_file() && d.join("model/model.safetensors").is_file(),
            "{step} whole"
        );
        glm5_burn::checkpoint::load_causal_lm::<burn::backend::Flex>(d.join("model"), &Default::default(), &Default::default()).unwrap();
    }
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".partial")).collect();
    assert!(leftovers.is_empty(), "staging directories left: {leftovers:?}");
    // released with the process: the directory can be resumed (nothing left to train)
    let out = Command::new(example("finetune")).args(overrides(&dir)).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Resuming on data that would change the order: refused, listing what changed; with
/// `--reset-data-position` the run continues from the checkpoint's step on the new data.
#[test]
fn resume_with_changed_data_is_refused_unless_reset() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let mut args = overrides(&dir);
    args[1] = "--step_scheduler.max_steps=4".into();
    run_with(&args);
    let mut changed = overrides(&dir);
    changed.push("--packed_sequence.packed_sequence_size=512".into());
    let out = Command::new(example("finetune")).args(&changed).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "resumed on other packing:\n{text}");
    assert!(text.contains("the data differ from the checkpoint's") && text.contains("packed_sequence.packed_sequence_size: 160 → 512"), "{text}");
    assert!(text.contains("--reset-data-position"), "{text}");
    assert_eq!(trace(&dir).len(), 4, "a refused resume leaves the metrics alone");
    // another split of the same files (a different dataset) is named as well
    let mut other = overrides(&dir);
    other.push("--dataset.split=validation".into());
    let out = Command::new(example("finetune")).args(&other).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && text.contains("dataset.split: train → validation"), "{text}");
    // the deliberate change
    changed.push("--reset-data-position".into());
    let log = run_with(&changed);
    assert!(log.contains("--reset-data-position: the new data from its first pack"), "{log}");
    let steps: Vec<u64> = trace(&dir).iter().map(|t| t.0).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());
    // the new checkpoints record the new data: a plain resume with it is accepted
    let mut more = changed.clone();
    more.retain(|a| a != "--reset-data-position");
    more[1] = "--step_scheduler.max_steps=9".into();
    let log = run_with(&more);
    assert!(log.contains("resumed from"), "{log}");
}

fn run_with(args: &[String]) -> String {
    let out = Command::new(example("finetune")).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "finetune failed:\n{text}");
    text
}

/// The newest checkpoint damaged (its optimizer state truncated, as a crash mid-copy leaves
/// it): resume warns, names it, and continues from the one before.
#[test]
fn a_damaged_newest_checkpoint_falls_back_to_the_previous_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d");
    let mut args = overrides(&dir);
    args[1] = "--step_scheduler.max_steps=4".into();
    run_with(&args);
    let opt = dir.join("step_000004/optimizer.mpk");
    let len = std::fs::metadata(&opt).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&opt).unwrap().set_len(len / 2).unwrap();
    args[1] = "--step_scheduler.max_steps=5".into();
    let log = run_with(&args);
    assert!(log.contains("step_000004 does not load") && log.contains("newest intact checkpoint") && log.contains("step_000002"), "{log}");
    let steps: Vec<u64> = trace(&dir).iter().map(|t| t.0).collect();
    assert_eq!(steps, (1..=5).collect::<Vec<_>>());
}

/// `bench` with zero sizes, `logits`/`convert` writing over their input, `logits` given the
/// tokenizer's directory, and a truncated optimizer state: clear errors, no panic.
#[test]
fn clis_refuse_bad_sizes_and_paths() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for (flag, value) in [("--seq", "0"), ("--batch", "0"), ("--steps", "0")] {
        let mut args = vec!["--config", "configs/bench_small.json", "--mode", "forward"];
        for (f, v) in [("--seq", "8"), ("--batch", "1"), ("--steps", "1")] {
            args.extend(if f == flag { [f, value] } else { [f, v] });
        }
        let out = Command::new(example("bench")).args(&args).current_dir(root).output().unwrap();
        let text = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success() && text.contains(&format!("{flag} 0: must be at least 1")) && !text.contains("panicked"), "{flag}: {text}");
    }
    let input = root.join("tests/fixtures/base_k4/io.safetensors");
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("io.safetensors");
    std::fs::copy(&input, &copy).unwrap();
    let before = std::fs::read(&copy).unwrap();
    let ckpt = root.join("tests/fixtures/base_k4");
    let out = Command::new(example("logits"))
        .args(["--checkpoint", ckpt.to_str().unwrap(), "--input", copy.to_str().unwrap(), "--output", copy.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && text.contains("is the --input file"), "{text}");
    assert_eq!(std::fs::read(&copy).unwrap(), before, "the input is untouched");
    let out = Command::new(example("convert")).args(["--input", ckpt.to_str().unwrap(), "--output", ckpt.to_str().unwrap()]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && text.contains("is the --input directory"), "{text}");
    // --tokenizer may be the directory
    let chat = root.join("tests/fixtures/chat");
    let out = Command::new(example("logits"))
        .args([
            "--checkpoint",
            chat.join("model").to_str().unwrap(),
            "--tokenizer",
            chat.join("tokenizer.json").parent().unwrap().to_str().unwrap(),
            "--prompt",
            "x",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("next token:"), "{text}");
}

/// A truncated optimizer state is reported as truncated or corrupt, naming the file and its
/// size (the decoder's own text blames a format change).
#[test]
fn a_truncated_optimizer_state_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    let mut args = overrides(&dir);
    args[1] = "--step_scheduler.max_steps=2".into();
    args.push("--checkpoint.keep_last=1".into());
    run_with(&args);
    let opt = dir.join("step_000002/optimizer.mpk");
    let len = std::fs::metadata(&opt).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&opt).unwrap().set_len(len / 3).unwrap();
    args[1] = "--step_scheduler.max_steps=3".into();
    let out = Command::new(example("finetune")).args(&args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("optimizer.mpk") && text.contains(&format!("({} bytes) is truncated or corrupt", len / 3)) && !text.contains("0.14.0"),
        "{text}"
    );
}

/// The generate example's file mode writes `sequences` exactly as HF's greedy `generate` does
/// (`leftpad`: two left-padded rows, row 0 ends on the EOS mid-batch and is padded).
#[test]
fn generate_example_writes_hf_sequences() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/leftpad");
    let out_path = tmp.path().join("out.safetensors");
    let out = Command::new(example("generate"))
        .args(["--checkpoint", fixture.to_str().unwrap(), "--input", fixture.join("generate.safetensors").to_str().unwrap()])
        .args(["--max-new-tokens", "8", "--eos", "106", "--output", out_path.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "generate failed:\n{text}");
    let read = |p: &Path| {
        let bytes = std::fs::read(p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("sequences").unwrap();
        (t.shape().to_vec(), t.data().chunks(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect::<Vec<i64>>())
    };
    assert_eq!(read(&out_path), read(&fixture.join("generate.safetensors")), "{text}");
}

/// Recipe `peft`: LoRA on a frozen base checkpoint. Only the adapters train; each step
/// directory holds the adapters in PEFT's format (no copy of the base); the base checkpoint is
/// untouched; a run resumed from its adapters follows an uninterrupted one exactly.
#[test]
fn lora_run_trains_adapters_only_and_resumes_from_them() {
    let tmp = tempfile::tempdir().unwrap();
    let base_run = tmp.path().join("base");
    let mut args = overrides(&base_run);
    args.extend(["--step_scheduler.max_steps=2".to_string(), "--validation_dataset=null".to_string()]);
    run_with(&args);
    let base = base_run.join("step_000002").join("model");
    let base_bytes = std::fs::read(base.join("model.safetensors")).unwrap();
    let lora = |dir: &Path, steps: usize| {
        let mut a = overrides(dir);
        a.extend([
            format!("--model.checkpoint={}", base.display()),
            format!("--step_scheduler.max_steps={steps}"),
            "--step_scheduler.val_every_steps=100".into(),
            "--peft.r=4".into(),
            "--peft.lora_alpha=8".into(),
            "--peft.target_modules=[q_proj, k_proj, v_proj, o_proj, q_a_proj, kv_b_proj, gate_proj, up_proj, down_proj]".into(),
            "--peft.target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]".into(),
        ]);
        run_with(&a)
    };
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let log = lora(&a, 6);
    let trainable = log.lines().find(|l| l.starts_with("parameters:")).unwrap_or_default().to_string();
    assert!(trainable.contains("M trainable"), "{log}");
    println!("{trainable}");
    let full = trace(&a);
    assert_eq!(full.len(), 6, "{log}");
    assert!(full[5].1 < full[0].1, "the loss falls: {full:?}");
    let step = a.join("step_000006");
    assert!(step.join("adapter/adapter_model.safetensors").is_file() && step.join("adapter/adapter_config.json").is_file());
    assert!(!step.join("model").exists(), "a LoRA checkpoint references its base, it does not copy it");
    assert_eq!(std::fs::read(base.join("model.safetensors")).unwrap(), base_bytes, "the base checkpoint is untouched");
    let state: Value = serde_json::from_str(&std::fs::read_to_string(step.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!(state["base_checkpoint"].as_str().map(PathBuf::from), Some(std::fs::canonicalize(&base).unwrap()));
    // 4 steps, then resumed to 6 from the step-4 adapters and their AdamW moments
    lora(&b, 4);
    let log = lora(&b, 6);
    assert!(log.contains("resumed from"), "{log}");
    let resumed = trace(&b);
    assert_eq!(resumed.len(), 6, "{resumed:?}");
    for (x, y) in full.iter().zip(&resumed) {
        assert_eq!(x, y, "step {}: uninterrupted {x:?} vs resumed {y:?}", x.0);
    }
    // the adapters run in the logits example on the base
    let adapter = step.join("adapter");
    let image = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/medpix_jsonl/images/train_0000.png");
    let out = Command::new(example("logits"))
        .args([
            "--checkpoint",
            base.to_str().unwrap(),
            "--adapter",
            adapter.to_str().unwrap(),
            "--tokenizer",
            base.join("tokenizer.json").to_str().unwrap(),
        ])
        .args(["--image", image.to_str().unwrap(), "--prompt", "Which imaging modality was used?"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("adapter ") && text.contains("next token:"), "{text}");
    // the README's second quick-start command: the bundled LoRA recipe on a base of the default run
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny_medpix_lora.yaml");
    let mut args = vec![recipe.display().to_string()];
    args.extend(overrides(&tmp.path().join("quick")));
    args.extend([format!("--model.checkpoint={}", base.display()), "--step_scheduler.max_steps=2".into(), "--validation_dataset=null".into()]);
    let log = run_with(&args);
    assert!(log.contains("M trainable") && tmp.path().join("quick/step_000002/adapter/adapter_model.safetensors").is_file(), "{log}");
}

/// `model.base_dtype: bf16`: a LoRA run in bf16 on a BF16 checkpoint loads its base straight
/// into bf16 (no fp32 masters) and follows, bit for bit, the same run holding that base in
/// fp32, whose steps cast it into the same bf16 values; it resumes from its adapters.
#[test]
fn lora_on_a_bf16_base_follows_the_fp32_base_in_bf16() {
    let tmp = tempfile::tempdir().unwrap();
    let base_run = tmp.path().join("base");
    let mut args = overrides(&base_run);
    args.extend(["--step_scheduler.max_steps=2".to_string(), "--validation_dataset=null".to_string()]);
    run_with(&args);
    // the published checkpoints' values: every weight a BF16 value (stored in f32), so that
    // holding it in fp32 and casting per step rounds nothing
    let base = tmp.path().join("bf16_values");
    {
        use burn::tensor::DType;
        use glm5_burn::checkpoint::{load_causal_lm, save_causal_lm, LoadOptions};
        let options = LoadOptions { vision: true, ..LoadOptions::with_dtype(DType::BF16) };
        let loaded = load_causal_lm::<burn::backend::Flex>(&base_run.join("step_000002/model"), &Default::default(), &options).unwrap();
        let model = glm5_burn::train::params::cast_weights(loaded.model, DType::F32);
        save_causal_lm(&model, &loaded.config, &base).unwrap();
    }
    let lora = |dir: &Path, base_dtype: &str, steps: usize| {
        let mut a = overrides(dir);
        a.extend([
            format!("--model.checkpoint={}", base.display()),
            format!("--step_scheduler.max_steps={steps}"),
            "--validation_dataset=null".into(),
            "--model.dtype=bf16".into(),
            format!("--model.base_dtype={base_dtype}"),
            "--peft.r=4".into(),
            "--peft.lora_alpha=8".into(),
            "--peft.target_modules=[q_proj, o_proj, q_a_proj, kv_b_proj, gate_proj, down_proj]".into(),
            "--peft.target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]".into(),
        ]);
        run_with(&a)
    };
    let (held16, held32) = (tmp.path().join("held_bf16"), tmp.path().join("held_f32"));
    lora(&held16, "bf16", 2);
    lora(&held16, "bf16", 4);
    lora(&held32, "f32", 4);
    let (a, b) = (trace(&held16), trace(&held32));
    println!("4 LoRA steps in bf16 (step, loss, grad norm): bf16 base (resumed at 2) {a:?}\n  fp32 base {b:?}");
    assert_eq!(a.len(), 4);
    assert_eq!(a, b, "a bf16 base computes what the fp32 base's bf16 compute copy computes");
}

/// `model.base_dtype: fp8`: a LoRA run on an FP8 checkpoint (the default run's base quantised
/// by `convert --dtype fp8`: its MLPs and routed experts E4M3 with block scales) keeps that
/// base in FP8 and follows, step for step, the same run on the dequantised base (`convert
/// --dtype f32` of the FP8 checkpoint: the same weights); it resumes from its adapters on the
/// FP8 base, and the recipe refuses an FP8 base without `peft` or on a BF16/F32 checkpoint.
#[test]
fn lora_on_an_fp8_base_follows_the_dequantised_base_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let base_run = tmp.path().join("base");
    let mut args = overrides(&base_run);
    args.extend(["--step_scheduler.max_steps=2".to_string(), "--validation_dataset=null".to_string()]);
    run_with(&args);
    let base = base_run.join("step_000002").join("model");
    let convert = |args: &[&str]| {
        let out = Command::new(example("convert")).args(args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "convert {args:?}:\n{text}");
        text
    };
    let (fp8, dense) = (tmp.path().join("fp8"), tmp.path().join("dequantised"));
    let text = convert(&["--input", base.to_str().unwrap(), "--output", fp8.to_str().unwrap(), "--dtype", "fp8", "--fp8-block", "16,16"]);
    println!("{}", text.trim());
    assert!(fp8.join("tokenizer.json").is_file(), "the tokenizer travels with the quantised checkpoint");
    convert(&["--input", fp8.to_str().unwrap(), "--output", dense.to_str().unwrap(), "--dtype", "f32"]);
    let lora = |dir: &Path, checkpoint: &Path, fp8_base: bool, steps: usize| {
        let mut a = overrides(dir);
        a.extend([
            format!("--model.checkpoint={}", checkpoint.display()),
            format!("--step_scheduler.max_steps={steps}"),
            "--validation_dataset=null".into(),
            "--peft.r=4".into(),
            "--peft.lora_alpha=8".into(),
            "--peft.target_modules=[q_proj, o_proj, q_a_proj, kv_b_proj, gate_proj, up_proj, down_proj]".into(),
            "--peft.target_parameters=[mlp.experts.gate_up_proj, mlp.experts.down_proj]".into(),
        ]);
        if fp8_base {
            a.push("--model.base_dtype=fp8".into());
        }
        run_with(&a)
    };
    let (on_fp8, on_dense, resumed) = (tmp.path().join("on_fp8"), tmp.path().join("on_dense"), tmp.path().join("resumed"));
    lora(&on_fp8, &fp8, true, 4);
    lora(&on_dense, &dense, false, 4);
    let (a, b) = (trace(&on_fp8), trace(&on_dense));
    println!("4 LoRA steps (step, loss, grad norm): FP8 base {a:?}\n                                     dequantised {b:?}");
    assert_eq!((a.len(), b.len()), (4, 4));
    // The same weights through other products: the losses agree to the products' rounding.
    // Only so far: in this tiny MoE a router decision that an ulp flips moves the step's
    // gradient by percents (the exact gradient comparison on fixed adapters is
    // tests/lora.rs, lora_on_an_fp8_resident_base_matches_the_dequantised_base).
    for (x, y) in a.iter().zip(&b) {
        assert!((x.1 - y.1).abs() <= 1e-3 * y.1.abs(), "step {}: FP8 base {x:?}, dequantised {y:?}", x.0);
    }
    // resumed from the step-2 adapters on the FP8 base
    lora(&resumed, &fp8, true, 2);
    let log = lora(&resumed, &fp8, true, 4);
    assert!(log.contains("resumed from"), "{log}");
    assert_eq!(trace(&resumed), a, "the resumed FP8-base run equals the uninterrupted one");
    // logits on the FP8 checkpoint, kept in FP8 or dequantised at load, with the trained adapter
    let adapter = on_fp8.join("step_000004/adapter");
    let image = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/medpix_jsonl/images/train_0000.png");
    let next = |fp8_base: bool| {
        let mut cmd = Command::new(example("logits"));
        cmd.args(["--checkpoint", fp8.to_str().unwrap(), "--adapter", adapter.to_str().unwrap(), "--image", image.to_str().unwrap()]);
        cmd.args(["--prompt", "Which imaging modality was used?", "--tokenizer", fp8.join("tokenizer.json").to_str().unwrap()]);
        if fp8_base {
            cmd.arg("--fp8-base");
        }
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        text.lines().find(|l| l.contains("next token:")).map(str::to_string).unwrap_or_else(|| panic!("no next token in:\n{text}"))
    };
    assert_eq!(next(true), next(false), "logits --fp8-base predicts what the dequantised base predicts");
    // refusals, by key and by path
    let refused = |extra: &[String]| {
        let mut a = overrides(&tmp.path().join("refused"));
        a.extend(extra.iter().cloned());
        let out = Command::new(example("finetune")).args(&a).output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let e = refused(&[format!("--model.checkpoint={}", fp8.display()), "--model.base_dtype=fp8".into()]);
    assert!(e.contains("model.base_dtype") && e.contains("peft"), "{e}");
    let e = refused(&[
        format!("--model.checkpoint={}", base.display()),
        "--model.base_dtype=fp8".into(),
        "--peft.r=4".into(),
        "--peft.lora_alpha=8".into(),
        "--peft.target_modules=[q_proj]".into(),
    ]);
    assert!(e.contains("no FP8 weight") && e.contains(base.to_str().unwrap()), "{e}");
}

/// The README's quick start as a user runs it: the default recipe (40 steps, no arguments
/// but the directory), then `configs/tiny_medpix_lora.yaml` on its step-40 checkpoint — the
/// LoRA run's validation loss falls and its greedy answers improve (exact match over the 24
/// validation questions, measured before the first step and at the end).
#[test]
fn the_quick_start_lora_run_lowers_the_validation_loss_and_improves_the_answers() {
    let tmp = tempfile::tempdir().unwrap();
    let (base, lora) = (tmp.path().join("base"), tmp.path().join("lora"));
    let run = |args: &[String]| {
        let out = Command::new(example("finetune")).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "finetune {args:?} failed:\n{text}");
    };
    run(&[format!("--checkpoint.checkpoint_dir={}", base.display())]);
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny_medpix_lora.yaml");
    run(&[
        recipe.display().to_string(),
        format!("--checkpoint.checkpoint_dir={}", lora.display()),
        format!("--model.checkpoint={}", base.join("step_000040/model").display()),
    ]);
    let validations: Vec<(u64, f64, f64)> = std::fs::read_to_string(lora.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter_map(|r| Some((r["step"].as_u64()?, r["val_loss"].as_f64()?, r["val_accuracy"].as_f64()?)))
        .collect();
    let (first, last) = (validations[0], validations[validations.len() - 1]);
    println!("LoRA quick start (step, validation loss, exact match): {validations:?}");
    assert_eq!((first.0, last.0), (0, 40), "{validations:?}");
    assert!(last.1 < first.1, "the validation loss falls: {validations:?}");
    assert!(last.2 > first.2, "the answers improve: {validations:?}");
}
