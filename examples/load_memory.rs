//! Measure the loader's own peak host memory on a generated multi-shard checkpoint.
//!
//! ```text
//! cargo run --release --example load_memory -- --generate /tmp/ckpt --config configs/mem_test.json --shard-mb 500
//! cargo run --release --example load_memory -- --checkpoint /tmp/ckpt [--dtype bf16|f32] [--fp8-base]
//! cargo run --release --example load_memory -- --checkpoint /tmp/ckpt --dtype bf16 --lora-step 64 [--fp8-base]
//! ```
//!
//! It reports the load time, the peak resident set (`VmHWM`, file pages included) over the
//! model's own bytes, and the machine's floor for any load of that size: the time to fault in
//! as many bytes of fresh memory, measured after the load in the same process.
//!
//! The load samples `RssAnon` (anonymous memory: file-backed pages of the memory-mapped shards
//! do not count) every millisecond; the loader's own peak is that peak minus the baseline
//! before loading and minus the destination tensors themselves (the model's bytes).
//!
//! `--lora-step TOKENS` goes on to train: LoRA (r 16 on the attention projections and the
//! routed experts) on the frozen base as loaded, two AdamW steps on one synthetic row of
//! `TOKENS` tokens, in `--dtype` (`bf16`: the base held in bf16, `model.base_dtype: bf16`; with
//! `--fp8-base`, `fp8`). It reports the peak of anonymous memory over the load and the steps,
//! so a BF16 and an FP8 base can be compared on the bytes they hold.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use burn::backend::Flex;
use burn::tensor::DType;
use clap::Parser;
use glm5_burn::checkpoint::inventory::inventory;
use glm5_burn::checkpoint::writer::{index_json, plan_shards, write_safetensors, PlannedTensor};
use glm5_burn::checkpoint::{hf_map, load_causal_lm, LoadOptions};
use glm5_burn::Glm5Config;
use safetensors::tensor::Dtype;

#[derive(Parser)]
struct Args {
    /// Write a random BF16 checkpoint for `--config` into this directory.
    #[arg(long)]
    generate: Option<PathBuf>,
    /// HF config.json for `--generate`.
    #[arg(long, default_value = "configs/mem_test.json")]
    config: PathBuf,
    /// Shard size for `--generate`, in MB.
    #[arg(long, default_value_t = 500)]
    shard_mb: usize,
    /// With `--generate`: store routed experts as block-FP8 (E4M3 + F32 128×128 scales).
    #[arg(long)]
    fp8: bool,
    /// Load this checkpoint and report memory.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Model dtype for the load.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32"])]
    dtype: String,
    /// Keep the checkpoint's FP8 weights in FP8 (`LoadOptions::fp8_base`).
    #[arg(long)]
    fp8_base: bool,
    /// Then train LoRA adapters for two steps on one row of this many tokens (≥ 2) and report
    /// the peak memory of load and steps.
    #[arg(long)]
    lora_step: Option<usize>,
}

fn status_kb(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find(|l| l.starts_with(field)).and_then(|l| l.split_whitespace().nth(1)).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn generate(dir: &PathBuf, config_path: &PathBuf, shard_mb: usize, fp8: bool) -> Result<()> {
    // a generated checkpoint never lands over files that are there
    glm5_burn::io::check_output_dir("--generate", dir, &[("--config", config_path)])?;
    if std::fs::read_dir(dir).map(|mut d| d.next().is_some()).unwrap_or(false) {
        anyhow::bail!("--generate {}: the directory is not empty; name a new or empty one", dir.display());
    }
    if shard_mb == 0 {
        anyhow::bail!("--shard-mb 0: shards hold at least 1 MB");
    }
    let mut text = std::fs::read_to_string(config_path).with_context(|| config_path.display().to_string())?;
    let mut json: serde_json::Value = serde_json::from_str(&text)?;
    let config = Glm5Config::from_hf_value(&json)?;
    let mut tensors = Vec::new();
    for e in inventory(&config, false, false) {
        if fp8 && e.routed_expert {
            let grid = vec![e.shape[0].div_ceil(128), e.shape[1].div_ceil(128)];
            tensors.push(PlannedTensor { name: format!("{}_scale_inv", e.name), dtype: Dtype::F32, shape: grid });
            tensors.push(PlannedTensor { name: e.name, dtype: Dtype::F8_E4M3, shape: e.shape });
        } else {
            tensors.push(PlannedTensor { name: e.name, dtype: Dtype::BF16, shape: e.shape });
        }
    }
    if fp8 {
        json["quantization_config"] = serde_json::json!({"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [128, 128]});
        text = serde_json::to_string_pretty(&json)?;
    }
    let shards = plan_shards(tensors, shard_mb * 1_000_000);
    std::fs::create_dir_all(dir)?;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for (file, ts) in &shards {
        write_safetensors(&dir.join(file), ts, |i, out| {
            let n = ts[i].shape.iter().product::<usize>();
            let mut buf = Vec::with_capacity(n * 4);
            for _ in 0..n {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5; // uniform(-0.5, 0.5)
                match ts[i].dtype {
                    Dtype::F8_E4M3 => buf.push(((state >> 8) as u8) & 0x7E | ((state >> 20) as u8 & 0x80)), // no NaN codes
                    Dtype::F32 => buf.extend_from_slice(&(0.05f32 / 448.0 * (1.0 + u)).to_le_bytes()),
                    _ => buf.extend_from_slice(&half::bf16::from_f32(u * 0.05).to_bits().to_le_bytes()),
                }
            }
            out.write_all(&buf).map_err(|error| glm5_burn::CheckpointError::Io { path: dir.join(file), error })
        })?;
    }
    if shards.len() > 1 {
        std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_vec_pretty(&index_json(&shards))?)?;
    }
    std::fs::write(dir.join("config.json"), text)?;
    println!("wrote {} shard(s) to {}", shards.len(), dir.display());
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.generate {
        return generate(dir, &args.config, args.shard_mb, args.fp8);
    }
    let dir = args.checkpoint.context("--checkpoint or --generate is required")?;
    let dtype = if args.dtype == "f32" { DType::F32 } else { DType::BF16 };

    // checkpoint geometry
    let config = glm5_burn::checkpoint::read_config(&dir)?.resolved;
    let files = glm5_burn::checkpoint::safetensors_io::SafetensorsFiles::open_dir(&dir)?;
    let ckpt_bytes: u64 = files.tensors.values().map(|e| (e.bytes.end - e.bytes.start) as u64).sum();
    let largest = files.tensors.values().map(|e| e.bytes.end - e.bytes.start).max().unwrap_or(0) as u64;
    // destination bytes: every loaded tensor in the model dtype (fp32-kept ones in f32)
    // (with --fp8-base: the FP8 weights a byte each and their f32 block scales; the indexer's
    // are dequantised at load, as the loader does)
    let elem = if dtype == DType::F32 { 4 } else { 2 };
    let fp8_held = |name: &str| args.fp8_base && !name.contains(".indexer.") && files.tensors.get(name).is_some_and(|e| e.dtype == Dtype::F8_E4M3);
    let dest: u64 = inventory(&config, false, false)
        .iter()
        .map(|e| {
            let keep_f32 = hf_map::RULES.iter().any(|r| r.keep_f32 && matches_rule(r.hf, &e.name));
            if fp8_held(&e.name) {
                let scales = files.tensors.get(&format!("{}_scale_inv", e.name)).map_or(0, |s| s.bytes.end - s.bytes.start);
                return e.numel() + scales as u64;
            }
            e.numel() * if keep_f32 { 4 } else { elem }
        })
        .sum();
    drop(files);

    let baseline = status_kb("RssAnon:");
    let peak = Arc::new(AtomicU64::new(baseline));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(status_kb("RssAnon:"), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        })
    };
    if let Some(tokens) = args.lora_step {
        let out = lora_steps(&dir, dtype, args.fp8_base, tokens, &peak)?;
        stop.store(true, Ordering::Relaxed);
        sampler.join().expect("sampler thread");
        let gb = |kb: u64| (kb.saturating_sub(baseline) * 1024) as f64 / 1e9;
        println!(
            "{}",
            serde_json::json!({
                "base": if args.fp8_base { "fp8" } else { &args.dtype },
                "destination_gb": dest as f64 / 1e9,
                "load_seconds": out.load_seconds,
                "peak_rss_anon_load_gb": gb(out.load_peak_kb),
                "peak_rss_anon_load_and_steps_gb": gb(peak.load(Ordering::Relaxed)),
                "vm_hwm_gb": (status_kb("VmHWM:") * 1024) as f64 / 1e9,
                "trainable": out.trainable,
                "step_seconds": out.step_seconds,
                "losses": out.losses,
            })
        );
        return Ok(());
    }
    let start = std::time::Instant::now();
    let load = LoadOptions { fp8_base: args.fp8_base, ..LoadOptions::with_dtype(dtype) };
    let loaded = load_causal_lm::<Flex>(&dir, &Default::default(), &load)?;
    let secs = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler thread");
    let after = status_kb("RssAnon:");
    let peak_kb = peak.load(Ordering::Relaxed).max(after);
    let overhead = (peak_kb.saturating_sub(baseline) * 1024).saturating_sub(dest);
    println!(
        "{}",
        serde_json::json!({
            "checkpoint_gb": ckpt_bytes as f64 / 1e9,
            "largest_tensor_mb": largest as f64 / 1e6,
            "destination_gb": dest as f64 / 1e9,
            "rss_anon_after_load_gb": (after.saturating_sub(baseline) * 1024) as f64 / 1e9,
            "peak_rss_anon_gb": (peak_kb.saturating_sub(baseline) * 1024) as f64 / 1e9,
            "loader_overhead_mb": overhead as f64 / 1e6,
            "overhead_over_largest_tensor": overhead as f64 / largest as f64,
            "vm_hwm_gb": (status_kb("VmHWM:") * 1024) as f64 / 1e9,
            "vm_hwm_over_destination": (status_kb("VmHWM:") * 1024) as f64 / dest as f64,
            "load_seconds": secs,
        })
    );
    drop(loaded);
    let fault_in = fault_in_seconds(dest as usize);
    println!("{}", serde_json::json!({ "fault_in_destination_bytes_seconds": fault_in, "load_over_fault_in": secs / fault_in }));
    Ok(())
}

struct LoraSteps {
    load_seconds: f64,
    load_peak_kb: u64,
    trainable: usize,
    step_seconds: Vec<f64>,
    losses: Vec<f64>,
}

/// Load `dir` as a LoRA run's frozen base and train two steps on one row of `tokens` tokens.
fn lora_steps(dir: &std::path::Path, dtype: DType, fp8_base: bool, tokens: usize, peak: &AtomicU64) -> Result<LoraSteps> {
    use glm5_burn::train::recipe::{BaseDtype, Precision, Recipe};
    use glm5_burn::train::trainer::{PeftOptions, StepOutcome, TrainOptions, Trainer};
    type A = burn::backend::Autodiff<Flex>;
    anyhow::ensure!(tokens >= 2, "--lora-step {tokens}: a row of at least 2 tokens (one label)");
    let recipe = Recipe::from_yaml(include_str!("../configs/tiny_medpix_lora.yaml"), "configs/tiny_medpix_lora.yaml", &[])?;
    let mut options = TrainOptions::from_recipe(&recipe);
    options.precision = if dtype == DType::BF16 { Precision::Bf16 } else { Precision::F32 };
    let lora: glm5_burn::text::lora::LoraConfig = serde_json::from_value(serde_json::json!({
        "r": 16, "lora_alpha": 32,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    }))?;
    let base_dtype = match (fp8_base, dtype) {
        (true, _) => BaseDtype::Fp8,
        (false, DType::BF16) => BaseDtype::Bf16,
        _ => BaseDtype::F32,
    };
    options.peft = Some(PeftOptions { config: lora, base: Some(dir.to_path_buf()), base_dtype });
    let device = Default::default();
    let start = std::time::Instant::now();
    let model = load_causal_lm::<A>(dir, &device, &options.base_load_options(false))?.model;
    let load_seconds = start.elapsed().as_secs_f64();
    let load_peak_kb = peak.load(Ordering::Relaxed).max(status_kb("RssAnon:"));
    let vocab = model.vocab_size as i64;
    // the adapters' draws (PEFT's Kaiming-uniform A) from a fixed seed: runs compare step for step
    <A as burn::tensor::backend::Backend>::seed(&device, 0);
    let mut trainer = Trainer::<A>::try_new(model, options)?;
    let trainable = glm5_burn::train::params::trainable_counts(trainer.model()).0;
    let ids: Vec<i64> = (0..tokens as i64).map(|t| (t * 7919 + 11) % vocab).collect();
    let batch = glm5_burn::data::batch::MicroBatch::text(ids.clone(), ids, 1, tokens, None);
    let (mut step_seconds, mut losses) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let t = std::time::Instant::now();
        match trainer.step(std::slice::from_ref(&batch))? {
            StepOutcome::Applied(m) => losses.push(m.loss),
            StepOutcome::Skipped { what, .. } => anyhow::bail!("a non-finite {what}"),
        }
        step_seconds.push(t.elapsed().as_secs_f64());
    }
    Ok(LoraSteps { load_seconds, load_peak_kb, trainable, step_seconds, losses })
}

/// The machine's floor for any load: seconds to fault in `bytes` of fresh memory (one write
/// per 4 KiB page, on every core), which the kernel must zero before the process sees them.
fn fault_in_seconds(bytes: usize) -> f64 {
    let mut buf: Vec<u8> = Vec::with_capacity(bytes);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let start = std::time::Instant::now();
    let spare = buf.spare_capacity_mut();
    let per = spare.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for part in spare.chunks_mut(per) {
            s.spawn(move || {
                for page in part.chunks_mut(4096) {
                    page[0].write(1);
                }
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    drop(buf);
    secs
}

/// Does a table pattern (`{i}`, `{e}` placeholders) match a checkpoint name?
fn matches_rule(pattern: &str, name: &str) -> bool {
    let re = regex::Regex::new(&format!("^{}$", regex::escape(pattern).replace(r"\{i\}", r"\d+").replace(r"\{e\}", r"\d+"))).expect("valid pattern");
    re.is_match(name)
}
