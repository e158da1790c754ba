//! Bad and edge-case input to the example binaries, tried as a new user would: every tool
//! checks its arguments and outputs before it loads a model or data, refuses an output that
//! would replace an input (leaving the input byte-identical), never panics on an argument, and
//! says what is wrong and what to do. The binaries are spawned as `tests/finetune.rs` does.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;

/// The example binary next to this test's profile directory, built if needed.
fn example(name: &str) -> PathBuf {
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        let status = Command::new(env!("CARGO"))
            .args(["build", "--example", "generate", "--example", "logits", "--example", "convert", "--example", "plan"])
            .args(["--example", "learner", "--example", "finetune", "--example", "swap"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo");
        assert!(status.success(), "building the examples failed");
    });
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent().and_then(Path::parent).expect("target/<profile>/deps/..").join("examples").join(name)
}

fn run(name: &str, args: &[&str]) -> (Output, String) {
    let out = Command::new(example(name)).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(!text.contains("panicked"), "{name} {args:?} panicked:\n{text}");
    (out, text)
}

/// `args` fail with a message holding every needle.
fn refused(name: &str, args: &[&str], needles: &[&str]) -> String {
    let (out, text) = run(name, args);
    assert!(!out.status.success(), "{name} {args:?} succeeded:\n{text}");
    for n in needles {
        assert!(text.contains(n), "{name} {args:?}: no {n:?} in:\n{text}");
    }
    text
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// For every tool with an output, an output equal to one of its inputs is refused and the
/// input stays byte-identical.
#[test]
fn no_tool_writes_over_its_input() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = fixtures().join("base_k4");
    let input = tmp.path().join("io.safetensors");
    std::fs::copy(ckpt.join("io.safetensors"), &input).unwrap();
    let before = std::fs::read(&input).unwrap();
    // the same file, and the same file through another spelling and a hard link
    let dotted = tmp.path().join(".").join("io.safetensors");
    let linked = tmp.path().join("link.safetensors");
    std::fs::hard_link(&input, &linked).unwrap();
    for tool in ["generate", "logits"] {
        for out in [&input, &dotted, &linked] {
            let text = refused(tool, &["--checkpoint", s(&ckpt), "--input", s(&input), "--output", s(out)], &["is the --input file"]);
            assert!(!text.contains("generated"), "{tool} refused only after working:\n{text}");
            assert_eq!(std::fs::read(&input).unwrap(), before, "{tool}: the input is untouched");
        }
    }
    // a file of the checkpoint is an input too
    let model = tmp.path().join("ckpt");
    std::fs::create_dir(&model).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(ckpt.join(f), model.join(f)).unwrap();
    }
    let weights = std::fs::read(model.join("model.safetensors")).unwrap();
    for tool in ["generate", "logits"] {
        refused(tool, &["--checkpoint", s(&model), "--input", s(&input), "--output", s(&model.join("model.safetensors"))], &["--checkpoint"]);
        assert_eq!(std::fs::read(model.join("model.safetensors")).unwrap(), weights);
    }
    refused("convert", &["--input", s(&model), "--output", s(&model)], &["is the --input directory"]);
    refused("convert", &["--input", s(&model), "--output", s(&model.join("sub"))], &["--input"]);
    assert_eq!(std::fs::read(model.join("model.safetensors")).unwrap(), weights);
}

/// Outputs are checked before any work: a missing directory, a directory where a file is
/// meant, a place that cannot be written.
#[test]
fn outputs_are_checked_before_the_model_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = fixtures().join("base_k4");
    let input = ckpt.join("io.safetensors");
    for tool in ["generate", "logits"] {
        let missing = tmp.path().join("no/such/dir/out.safetensors");
        let start = Instant::now();
        let text = refused(tool, &["--checkpoint", s(&ckpt), "--input", s(&input), "--output", s(&missing)], &["does not exist"]);
        assert!(!text.contains("generated") && !text.contains("forward ["), "{text}");
        assert!(start.elapsed() < Duration::from_secs(20));
        refused(tool, &["--checkpoint", s(&ckpt), "--input", s(&input), "--output", s(tmp.path())], &["is a directory"]);
    }
}

/// `learner --dir` where no directory can be made is an error before anything is prepared
/// (burn-train's log writer panicked there); a directory holding a run is not retrained over
/// without `--overwrite`; recipe keys the learner does not honour are refused by name; an
/// unknown section names the override.
#[test]
fn learner_checks_its_directory_and_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file");
    std::fs::write(&file, b"").unwrap();
    refused("learner", &["--dir", s(&file.join("run"))], &["--dir", "is not a directory"]);
    refused("learner", &["--dir", "/proc/glm5_learner"], &["--dir", "cannot"]);
    let earlier = tmp.path().join("earlier");
    std::fs::create_dir(&earlier).unwrap();
    std::fs::write(earlier.join("experiment.log"), b"a finished run").unwrap();
    refused("learner", &["--dir", s(&earlier)], &["already holds a run", "--overwrite"]);
    assert_eq!(std::fs::read(earlier.join("experiment.log")).unwrap(), b"a finished run");
    let dir = tmp.path().join("new");
    for key in ["--checkpoint.checkpoint_dir=elsewhere", "--step_scheduler.val_every_steps=2", "--distributed.activation_checkpointing=true"] {
        let k = key.trim_start_matches("--").split('=').next().unwrap();
        refused("learner", &[key, "--dir", s(&dir)], &[&format!("does not honour `{k}`")]);
    }
    // a mesh that does not fit one process is refused naming its sizes
    refused("learner", &["--distributed.ep_size=2", "--dir", s(&dir)], &["`distributed.ep_size`: (2) must divide the world size"]);
    let needle = if cfg!(feature = "mpi") { "distributed.dp_size is 2 but 1 processes were started" } else { "needs the MPI engine" };
    refused("learner", &["--distributed.dp_size=2", "--dir", s(&dir)], &[needle]);
    refused("learner", &["--foo.bar=1", "--dir", s(&dir)], &["override --foo.bar=1", "`foo`"]);
    assert!(!dir.exists(), "nothing written on a refusal");
}

/// `plan` range-checks its numbers with overflow-safe arithmetic, answers every published mesh
/// quickly, says why nothing fits, and compares published measurements only for the model they
/// were taken on.
#[test]
fn plan_refuses_nonsense_and_answers_quickly() {
    for (args, needle) in [
        (vec!["--mesh", "dp=4294967296,ep=1,cp=4294967296"], "more than 1048576 ranks"),
        (vec!["--mesh", "dp=18446744073709551615,ep=1,cp=2"], "more than 1048576 ranks"),
        (vec!["--mesh", "dp=2,dp=4"], "`dp` is given twice"),
        (vec!["--mesh", "dp=200,ep=8"], "larger than the recipe's global batch"),
        (vec!["--seq", "0"], "--seq 0"),
        (vec!["--seq", "2047"], "cp 2 equal shards"),
        (vec!["--micro-batches", "0"], "--micro-batches 0"),
        (vec!["--param-bytes", "0"], "--param-bytes 0"),
        (vec!["--optim-bytes", "0"], "--optim-bytes 0"),
        (vec!["--base-dtype", "fp8"], "give --peft"),
        (vec!["--base-dtype", "int4", "--peft", "r=8"], "expected fp8, bf16 or f32"),
        (vec!["--peft", "targets=attention"], "the rank r=… is required"),
        (vec!["--peft", "r=16,targets=qkv_proj"], "\"qkv_proj\" matches no linear layer"),
        (vec!["--peft", "r=16,dropout=0.1"], "unknown key"),
        (vec!["--peft", "r=9999,targets=b_proj"], "b_proj"),
    ] {
        refused("plan", &args, &[needle]);
    }
    for mesh in ["dp=36,ep=72,cp=2", "dp=144,ep=144,cp=1", "dp=18,ep=144,cp=8"] {
        let start = Instant::now();
        let (out, text) = run("plan", &["--mesh", mesh]);
        assert!(out.status.success() && text.contains("published mesh"), "{text}");
        assert!(start.elapsed() < Duration::from_secs(5), "{mesh}: {:?}", start.elapsed());
    }
    let start = Instant::now();
    let (out, text) = run("plan", &["--seq", "1048576"]);
    assert!(out.status.success() && text.contains("none up to 4096 ranks") && text.contains("activations"), "{text}");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    // a model of 8 experts: its own plan, and no comparison with measurements of another model
    let config = fixtures().join("base_k4/config.json");
    let (out, text) = run("plan", &["--config", s(&config), "--mesh", "dp=4,ep=4,cp=1"]);
    assert!(out.status.success() && text.contains("not compared") && !text.contains("EP72"), "{text}");
    // LoRA on an FP8 base: its own plan, the trainable count, no comparison with a full fine-tune
    let (out, text) = run("plan", &["--mesh", "dp=8,ep=8", "--peft", "r=16,targets=attention+experts", "--base-dtype", "fp8"]);
    assert!(out.status.success() && text.contains("2.832 B trainable values") && text.contains("not compared"), "{text}");
}

/// `generate` checks its sampling settings, EOS ids and prompt padding before generating, and
/// reads negative numbers as values.
#[test]
fn generate_checks_its_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = fixtures().join("base_k4");
    let input = ckpt.join("io.safetensors");
    let out = tmp.path().join("out.safetensors");
    let base = ["--checkpoint", s(&ckpt), "--input", s(&input), "--output", s(&out)];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        base.iter().chain(extra).copied().collect()
    }
    refused("generate", &with(&base, &["--temperature", "NaN"]), &["--temperature", "--do-sample"]);
    refused("generate", &with(&base, &["--top-p", "1.5"]), &["--top-p", "--do-sample"]);
    refused("generate", &with(&base, &["--do-sample", "--top-p", "1.5"]), &["--top-p 1.5", "(0, 1]"]);
    refused("generate", &with(&base, &["--do-sample", "--temperature", "NaN"]), &["--temperature NaN", "> 0"]);
    refused("generate", &with(&base, &["--do-sample", "--temperature", "-1"]), &["--temperature -1", "> 0"]);
    refused("generate", &with(&base, &["--eos", "-1"]), &["--eos", "EOS id -1"]);
    refused("generate", &with(&base, &["--eos", "99999999"]), &["EOS id 99999999", "vocab_size"]);
    assert!(!out.exists(), "nothing written on a refusal");

    // a right-padded prompt
    let io = Io::open(&input);
    let shape = io.shape("input_ids");
    let (b, sq) = (shape[0], shape[1]);
    let mut mask = vec![1i64; b * sq];
    mask[sq - 1] = 0;
    let padded = tmp.path().join("rightpad.safetensors");
    {
        use glm5_burn::checkpoint::safetensors_io::{serialize, write_atomic, OwnedTensor};
        let t = |v: &[i64]| OwnedTensor {
            dtype: safetensors::tensor::Dtype::I64,
            shape: vec![b, sq],
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        };
        let tensors =
            std::collections::BTreeMap::from([("input_ids".to_string(), t(&io.i64("input_ids"))), ("attention_mask".to_string(), t(&mask))]);
        write_atomic(&padded, &serialize(&tensors).unwrap()).unwrap();
    }
    refused("generate", &["--checkpoint", s(&ckpt), "--input", s(&padded), "--output", s(&out)], &["right", "padding_side"]);
    assert!(!out.exists());
}

/// One rule for `<|image|>` ids without pixel values in every tool: embedded as ordinary
/// tokens, as HF's forward does (the leftpad fixture's ids hold one; HF made its logits).
#[test]
fn every_tool_takes_image_ids_without_pixels_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = fixtures().join("leftpad");
    let input = ckpt.join("io.safetensors");
    let out = tmp.path().join("logits.safetensors");
    let (o, text) = run("logits", &["--checkpoint", s(&ckpt), "--input", s(&input), "--output", s(&out)]);
    assert!(o.status.success() && text.contains("embedded as ordinary tokens"), "{text}");
    // and the logits are HF's (the fixture's reference logits in the input)
    let kl: f64 = text.split("mean KL ").nth(1).and_then(|t| t.split_whitespace().next()).and_then(|v| v.parse().ok()).expect("a parity line");
    assert!(kl < 1e-9, "{text}");
    let (o, text) = run("swap", &["--checkpoint", s(&ckpt), "--input", s(&input), "--a", "flex:f32:reference", "--b", "flex:f32:op"]);
    assert!(o.status.success(), "{text}");
    let seqs = tmp.path().join("seq.safetensors");
    let (o, text) = run("generate", &["--checkpoint", s(&ckpt), "--input", s(&input), "--output", s(&seqs), "--max-new-tokens", "2"]);
    assert!(o.status.success() && text.contains("embedded as ordinary tokens"), "{text}");
}

/// `--tokenizer` takes the directory or its tokenizer.json in every tool.
#[test]
fn tokenizer_file_or_directory() {
    let chat = fixtures().join("chat");
    for tok in [chat.clone(), chat.join("tokenizer.json")] {
        let (o, text) = run("generate", &["--checkpoint", s(&chat.join("model")), "--tokenizer", s(&tok), "--prompt", "x", "--max-new-tokens", "2"]);
        assert!(o.status.success(), "{}: {text}", tok.display());
        let (o, text) = run("logits", &["--checkpoint", s(&chat.join("model")), "--tokenizer", s(&tok), "--prompt", "x"]);
        assert!(o.status.success() && text.contains("next token:"), "{}: {text}", tok.display());
    }
}

/// Library refusals with their one-sentence causes: a text-only checkpoint asked for images, a
/// step directory given for its model, an image too large to decode.
#[test]
fn checkpoints_and_images_say_what_they_are() {
    use glm5_burn::checkpoint::{load_causal_lm, read_config, LoadOptions};
    let device = Default::default();
    let text_only = fixtures().join("base_k4");
    let e = load_causal_lm::<B>(&text_only, &device, &LoadOptions { vision: true, ..Default::default() }).err().expect("no vision tower").to_string();
    assert!(e.contains("has no vision tower") && !e.contains("missing "), "{e}");

    let tmp = tempfile::tempdir().unwrap();
    let step = tmp.path().join("step_000070");
    std::fs::create_dir_all(step.join("model")).unwrap();
    std::fs::copy(text_only.join("config.json"), step.join("model/config.json")).unwrap();
    let e = read_config(&step).unwrap_err().to_string();
    assert!(e.contains("step directory") && e.contains(&step.join("model").display().to_string()), "{e}");

    // a valid PNG header of 20000 × 20000 pixels (the decoder refuses it by its size alone)
    let png = png_header(20000, 20000);
    let e = glm5_burn::data::image_processor::RgbImage::decode(&png, "huge.png").unwrap_err().to_string();
    assert!(e.contains("20000×20000") && e.contains("too large") && e.contains("MiB") && !e.contains("corrupt"), "{e}");
}

/// The signature, an IHDR chunk of `w × h` 8-bit RGB, an empty IDAT and IEND.
fn png_header(w: u32, h: u32) -> Vec<u8> {
    fn crc(bytes: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in bytes {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }
    let chunk = |kind: &[u8], data: &[u8]| {
        let mut v = (data.len() as u32).to_be_bytes().to_vec();
        let body: Vec<u8> = kind.iter().chain(data).copied().collect();
        v.extend(&body);
        v.extend(crc(&body).to_be_bytes());
        v
    };
    let mut ihdr = w.to_be_bytes().to_vec();
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(chunk(b"IHDR", &ihdr));
    // a zlib stream of nothing: the decoder reads the header up to the first IDAT
    png.extend(chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]));
    png.extend(chunk(b"IEND", &[]));
    png
}

/// A resumed run keeps its learning-rate schedule when `max_steps` changes (no jump at the
/// resumed step), says so, and follows the recipe's with `--new-schedule`; `max_steps=0` is a
/// recipe error, not "already holds step 0".
#[test]
fn a_resumed_run_keeps_its_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("run");
    let args = |steps: usize, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = vec![
            format!("--checkpoint.checkpoint_dir={}", dir.display()),
            format!("--step_scheduler.max_steps={steps}"),
            "--step_scheduler.global_batch_size=2".into(),
            "--step_scheduler.local_batch_size=1".into(),
            "--packed_sequence.packed_sequence_size=160".into(),
            "--lr_scheduler.lr_warmup_steps=1".into(),
        ];
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    // the learning rate of `step` as metrics.jsonl records it
    let lr_of = |step: u64| -> f64 {
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find(|v| v["step"].as_u64() == Some(step) && v.get("lr").is_some())
            .and_then(|v| v["lr"].as_f64())
            .unwrap_or_else(|| panic!("no lr for step {step}:\n{text}"))
    };
    let go = |a: Vec<String>| {
        let out = Command::new(example("finetune")).args(&a).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        text
    };
    go(args(4, &[]));
    let lr4 = lr_of(4);
    let longer = go(args(6, &[]));
    assert!(longer.contains("keeping the run's") && longer.contains("--new-schedule"), "{longer}");
    // the run's cosine reaches min_lr after its step 4: steps 5 and 6 stay at that final rate
    // (a schedule re-derived over 6 steps would jump up at step 5)
    assert_eq!(lr_of(4), lr4, "the resumed run keeps the first run's metrics");
    assert!(lr_of(5) <= lr4 && lr_of(6) == lr_of(5), "{longer}");
    let again = go(args(8, &["--new-schedule"]));
    assert!(again.contains("--new-schedule: following the recipe's schedule"), "{again}");
    let (o, text) =
        run("finetune", &[&format!("--checkpoint.checkpoint_dir={}", tmp.path().join("empty").display()), "--step_scheduler.max_steps=0"]);
    assert!(!o.status.success() && text.contains("step_scheduler.max_steps") && !text.contains("already holds"), "{text}");
}

/// `convert` dequantises FP8: on a checkpoint without FP8 weights it copies every tensor as
/// stored, and says so instead of letting `--dtype bf16` look applied.
#[test]
fn convert_says_when_there_is_nothing_to_dequantise() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/base_k4");
    let (status, text) = run("convert", &["--input", s(&src), "--output", s(&out), "--dtype", "bf16"]);
    assert!(status.status.success(), "{text}");
    assert!(text.contains("holds no FP8 weights") && text.contains("not cast to --dtype bf16"), "{text}");
}
