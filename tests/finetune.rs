//! The `finetune` example end to end (the binary `cargo test` builds in `target/*/examples/`):
//! a run killed with SIGKILL after a checkpoint and then resumed produces the same loss trace,
//! bit for bit, as an uninterrupted run; its checkpoint loads in the `logits` example.

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
            .args(["build", "--example", "finetune", "--example", "logits"])
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
    assert!(a.join("loss_curve.png").is_file());
    let kept: Vec<String> = std::fs::read_dir(&a).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).filter(|n: &String| n.starts_with("step_")).collect();
    assert_eq!(kept.len(), 2, "keep_last = 2: {kept:?}");

    // start b, SIGKILL it once step 5 is logged (step 4's checkpoint exists), resume it
    let mut child = Command::new(example("finetune")).args(overrides(&b)).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let t0 = Instant::now();
    loop {
        let steps = std::fs::read_to_string(b.join("metrics.jsonl")).map(|t| t.lines().count()).unwrap_or(0);
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
    // a backend this build lacks is named
    let out = Command::new(example("finetune")).arg("--backend=metal").output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && text.contains("--backend=metal: not available in this build (flex"), "{text}");
    // an unknown recipe key names its path
    let out = Command::new(example("finetune")).arg("--optimizer.momentum=0.9").output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success() && text.contains("optimizer.momentum"), "{text}");
}
