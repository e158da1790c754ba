//! Convert an FP8 (block-scaled E4M3) checkpoint to BF16, or inspect a checkpoint.
//!
//! ```text
//! cargo run --release --example convert -- --input FP8_DIR --output BF16_DIR [--dtype bf16|f32] [--max-shard-size 5GB]
//! cargo run --release --example convert -- --inspect DIR      # DIR may hold only config.json
//! cargo run --release --example convert -- --input BASE --merge-lora ADAPTER --output MERGED [--dtype bf16|f32|fp8]
//! cargo run --release --example convert -- --input BF16_DIR --output FP8_DIR --dtype fp8 [--fp8-block 128,128]
//! ```
//!
//! `--dtype fp8` on a BF16/F32 checkpoint quantises it in the release's FP8 layout: the
//! decoder's MLP weights (dense, shared and routed experts) become E4M3 with block scales, the
//! rest keeps its dtype, and `config.json` gets the `quantization_config`.
//!
//! With `--merge-lora`, `--dtype fp8` re-quantises the weights that `BASE` holds in FP8 (its
//! block size, fresh block scales from the merged values) and writes every other tensor in the
//! dtype `BASE` stores it in: a merge onto the FP8 release is a checkpoint of the same layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use glm5_burn::checkpoint::convert::{convert_checkpoint, ConvertOptions};
use glm5_burn::checkpoint::inventory::{inventory, ParamCounts, Part};
use glm5_burn::checkpoint::safetensors_io::SafetensorsFiles;
use glm5_burn::checkpoint::{read_config, CheckpointConfig};
use glm5_burn::config::{IndexerType, LayerType, MlpType};
use indicatif::{ProgressBar, ProgressStyle};
use safetensors::tensor::Dtype;

/// FP8 → BF16 conversion and checkpoint inspection for GLM-5.3-Flash checkpoints.
#[derive(Parser)]
struct Args {
    /// Checkpoint to convert (config.json + safetensors with `*_scale_inv` FP8 weights).
    #[arg(long, required_unless_present = "inspect")]
    input: Option<PathBuf>,
    /// Output directory (must not exist or be empty).
    #[arg(long, required_unless_present = "inspect")]
    output: Option<PathBuf>,
    /// Dtype of the dequantised weights; `fp8` only with `--merge-lora` (the weights `--input`
    /// holds in FP8 are re-quantised with fresh block scales, the others written in the dtype
    /// `--input` stores them in).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f32", "fp8"])]
    dtype: String,
    /// Block `ROWS,COLS` of the scales when quantising a BF16/F32 checkpoint (`--dtype fp8`).
    #[arg(long, default_value = "128,128", value_name = "ROWS,COLS")]
    fp8_block: String,
    /// Largest output shard, e.g. 5GB, 500MB.
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
    /// Fold this LoRA adapter (HF PEFT format) into the `--input` checkpoint's weights and write
    /// the merged checkpoint (HF layout, `--dtype`; PEFT's `merge_and_unload`). The model is
    /// held in memory whole: for checkpoints that fit the host.
    #[arg(long, value_name = "ADAPTER", conflicts_with = "inspect")]
    merge_lora: Option<PathBuf>,
    /// Print the config summary, parameter counts, dtypes and FP8 tensors of DIR instead.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["input", "output"])]
    inspect: Option<PathBuf>,
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim().to_ascii_uppercase();
    let (num, mul) = [("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0)]
        .iter()
        .find_map(|(suf, m)| s.strip_suffix(suf).map(|n| (n.to_string(), *m)))
        .unwrap_or((s.clone(), 1.0));
    let v: f64 = num.trim().parse().with_context(|| format!("invalid size {s:?} (e.g. 5GB, 500MB)"))?;
    let bytes = v * mul;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes <= usize::MAX as f64) {
        bail!("--max-shard-size {s:?}: a shard holds at least 1 byte (e.g. 5GB, 500MB)");
    }
    Ok(bytes as usize)
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    if let Some(dir) = &args.inspect {
        return inspect(dir);
    }
    let (input, output) = (args.input.expect("clap requires it"), args.output.expect("clap requires it"));
    if let Some(adapter) = &args.merge_lora {
        glm5_burn::io::check_output_dir("--output", &output, &[("--input", &input), ("--merge-lora", adapter)])?;
        return merge_lora(&input, adapter, &output, &args.dtype);
    }
    if args.dtype == "fp8" {
        glm5_burn::io::check_output_dir("--output", &output, &[("--input", &input)])?;
        return quantize(&input, &output, parse_block(&args.fp8_block)?, parse_size(&args.max_shard_size)?);
    }
    glm5_burn::io::check_output_dir("--output", &output, &[("--input", &input)])?;
    let opts =
        ConvertOptions { dtype: if args.dtype == "f32" { Dtype::F32 } else { Dtype::BF16 }, max_shard_bytes: parse_size(&args.max_shard_size)? };
    let bar = progress_bar();
    let start = std::time::Instant::now();
    let report = convert_checkpoint(&input, &output, &opts, progress(&bar))?;
    bar.finish_and_clear();
    println!(
        "wrote {}: {} tensors ({} dequantised from FP8), {} shard(s), {:.3} GB in {:.1?}",
        report.output.display(),
        report.tensors,
        report.dequantised,
        report.shards,
        report.bytes_written as f64 / 1e9,
        start.elapsed()
    );
    if !report.copied.is_empty() {
        println!("copied beside the weights: {}", report.copied.join(", "));
    }
    if report.dequantised == 0 {
        // the tensors were copied as stored: say so, rather than let `--dtype` look applied
        eprintln!(
            "note: {} holds no FP8 weights, so nothing was dequantised: every tensor was copied in the dtype it is stored in \
             (re-sharded), not cast to --dtype {}",
            input.display(),
            args.dtype
        );
    }
    Ok(())
}

/// `--merge-lora`: base + adapter → one HF checkpoint with `W + s·A·B` in every adapted weight.
fn merge_lora(input: &Path, adapter: &Path, output: &Path, dtype: &str) -> Result<()> {
    use glm5_burn::checkpoint::{load_causal_lm, save_causal_lm, save_causal_lm_fp8, CheckpointError, Fp8Output, LoadOptions};
    type B = burn::backend::Flex;
    let start = std::time::Instant::now();
    // FP8 output: which weights, known before the long load; merged in f32, quantised once
    let fp8 = if dtype == "fp8" { Some(Fp8Output::like(input).context("--dtype fp8")?) } else { None };
    let dtype = if dtype == "bf16" { burn::tensor::DType::BF16 } else { burn::tensor::DType::F32 };
    let device = Default::default();
    // keep the vision tower when the checkpoint has one (a merged VLM stays a VLM)
    let loaded = match load_causal_lm::<B>(input, &device, &LoadOptions { vision: true, ..LoadOptions::with_dtype(dtype) }) {
        Err(CheckpointError::NoVisionTower { .. }) => load_causal_lm::<B>(input, &device, &LoadOptions::with_dtype(dtype))?,
        other => other?,
    };
    let (model, config, attached) = glm5_burn::checkpoint::adapter::load_adapter(loaded.model, adapter)?;
    let merged = glm5_burn::peft::merge(model);
    match &fp8 {
        None => save_causal_lm(&merged, &loaded.config, output)?,
        Some(fp8) => save_causal_lm_fp8(&merged, &loaded.config, output, fp8)?,
    };
    println!(
        "wrote {}: {} merged with {} (r {}, alpha {}: {attached}) in {:.1?}",
        output.display(),
        input.display(),
        adapter.display(),
        config.r,
        config.lora_alpha,
        start.elapsed()
    );
    Ok(())
}

fn parse_block(s: &str) -> Result<[usize; 2]> {
    let parts: Vec<usize> = s
        .split(',')
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| format!("--fp8-block {s:?}: expected ROWS,COLS (e.g. 128,128)"))?;
    match parts[..] {
        [r, c] if r > 0 && c > 0 => Ok([r, c]),
        _ => bail!("--fp8-block {s:?}: expected two positive sizes ROWS,COLS (e.g. 128,128)"),
    }
}

/// `--dtype fp8` on a BF16/F32 checkpoint: the release's FP8 layout
/// ([`glm5_burn::checkpoint::Fp8Output::release_layout`]), streamed a tensor at a time, each
/// weight quantised once from its stored values.
fn quantize(input: &Path, output: &Path, block: [usize; 2], max_shard_bytes: usize) -> Result<()> {
    let bar = progress_bar();
    let start = std::time::Instant::now();
    let report = glm5_burn::checkpoint::convert::quantize_checkpoint(input, output, block, max_shard_bytes, progress(&bar)).context("--dtype fp8")?;
    bar.finish_and_clear();
    println!(
        "wrote {}: {} weights quantised to FP8 (blocks {block:?}), {} tensors kept, {} shard(s), {:.3} GB, {} in {:.1?}",
        report.output.display(),
        report.quantised,
        report.kept,
        report.shards,
        report.bytes_written as f64 / 1e9,
        if report.copied.is_empty() { "nothing else copied".to_string() } else { format!("copied {}", report.copied.join(", ")) },
        start.elapsed()
    );
    Ok(())
}

/// The bar's update after each tensor: bytes so far, the tensor's last three name parts.
fn progress(bar: &ProgressBar) -> impl FnMut(u64, u64, &str) + '_ {
    |done, total, name| {
        bar.set_length(total);
        bar.set_position(done);
        bar.set_message(name.rsplit('.').take(3).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("."));
    }
}

/// A bytes-written bar.
fn progress_bar() -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}")
            .expect("valid template"),
    );
    bar
}

fn billions(n: u64) -> String {
    format!("{:.2}B ({n})", n as f64 / 1e9)
}

fn inspect(path: &Path) -> Result<()> {
    // a checkpoint directory, or a bare config.json
    let checkpoint = if path.is_file() { CheckpointConfig::read_file(path)? } else { read_config(path)? };
    let (config, json) = (&checkpoint.resolved, &checkpoint.json);
    let dir = if path.is_file() { path.parent().unwrap_or(Path::new(".")) } else { path };
    let c = &config.text_config;
    let n = c.num_hidden_layers;
    let kda = c.layer_types[..n].iter().filter(|t| **t == LayerType::LinearAttention).count();
    let dense = c.mlp_layer_types[..n].iter().filter(|t| **t == MlpType::Dense).count();
    let shared = c.indexer_types[..n]
        .iter()
        .zip(&c.layer_types[..n])
        .filter(|(i, t)| **t == LayerType::IndexedAttention && **i == IndexerType::Shared)
        .count();
    println!("{}", path.display());
    println!(
        "  text: {n} layers ({kda} KDA, {} KPool-DSA of which {shared} shared-indexer), hidden {}, vocab {}",
        n - kda,
        c.hidden_size,
        c.vocab_size
    );
    println!(
        "        FFN: {dense} dense (intermediate {}), {} MoE ({} experts, top-{}, {} shared, width {}, groups {}/{})",
        c.intermediate_size,
        n - dense,
        c.n_routed_experts,
        c.num_experts_per_tok,
        c.n_shared_experts,
        c.moe_intermediate_size,
        c.topk_group,
        c.n_group
    );
    println!(
        "        KDA {}×{} (conv {}, gate bound {:?}); MLA {} heads, q_lora {}, kv_lora {}; indexer {}×{}, top-{} in pools of {} (tail {})",
        c.linear_num_heads,
        c.linear_head_dim,
        c.linear_conv_kernel_dim,
        c.linear_lower_bound,
        c.num_attention_heads,
        c.q_lora_rank,
        c.kv_lora_rank,
        c.index_n_heads,
        c.index_head_dim,
        c.index_topk,
        c.index_kpool,
        c.index_kpool_always_select_tail
    );
    println!("        mHC {} streams, {} Sinkhorn iterations; MTP layers {}", c.hc_mult, c.hc_sinkhorn_iters, c.num_nextn_predict_layers);
    let v = &config.vision_config;
    println!("  vision: {} blocks, hidden {}, {} heads, out {}", v.depth, v.hidden_size, v.num_heads, v.out_hidden_size);
    if let Some(q) = json.get("quantization_config") {
        println!("  quantization_config: {q}");
    }
    let p = ParamCounts::of(config);
    println!("  parameters: trunk {}, MTP {}, vision {}, total {}", billions(p.trunk), billions(p.mtp), billions(p.vision), billions(p.total()));
    println!("  active per token: trunk {}, with vision {}", billions(p.trunk_active), billions(p.trunk_active + p.vision));
    println!(
        "  (rounded: {:.0}B total, {:.0}B active)",
        (p.total() as f64 / 1e10).round() * 10.0,
        ((p.trunk_active + p.vision) as f64 / 1e9).round()
    );

    let has_weights = path.is_dir() && (dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists());
    if !has_weights {
        println!("  no safetensors in this directory (config only)");
        return Ok(());
    }
    let mut files = SafetensorsFiles::open_dir(dir)?;
    files.set_fp8_block_from_config(json)?;
    let mut by_dtype: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for e in files.tensors.values() {
        let s = by_dtype.entry(format!("{:?}", e.dtype)).or_default();
        s.0 += 1;
        s.1 += (e.bytes.end - e.bytes.start) as u64;
    }
    println!(
        "  tensors: {} in {:?}",
        files.tensors.len(),
        by_dtype.iter().map(|(d, (n, b))| format!("{d}: {n} ({:.3} GB)", *b as f64 / 1e9)).collect::<Vec<_>>()
    );
    println!("  FP8 weights (with weight_scale_inv, blocks {:?}): {}", files.fp8_block, files.fp8_scales.len());
    for name in files.fp8_scales.keys().take(5) {
        println!("    {name} {:?}", files.shape(name).unwrap_or(&[]));
    }
    if files.fp8_scales.len() > 5 {
        println!("    ... and {} more", files.fp8_scales.len() - 5);
    }
    let expected = inventory(config, true, true);
    let missing = |part: Part| expected.iter().filter(|e| e.part == part && !files.tensors.contains_key(&e.name)).count();
    let known: std::collections::HashSet<&str> = expected.iter().map(|e| e.name.as_str()).collect();
    let extra = files.tensors.keys().filter(|k| !known.contains(k.as_str()) && !files.is_scale(k)).count();
    println!(
        "  against the config's inventory: missing {} trunk, {} MTP, {} vision tensors; {extra} unexpected",
        missing(Part::Trunk),
        missing(Part::Mtp),
        missing(Part::Vision)
    );
    Ok(())
}
