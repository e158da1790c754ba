//! Per-rank memory and per-step communication of a training run at real scale, on paper
//! (`glm5_burn::plan`), checked against published figures of the same recipe.
//!
//! ```text
//! cargo run --release --example plan -- [--config configs/glm5_3_flash.json] [--mesh dp=36,ep=72,cp=2]
//!     [--seq 2048] [--micro-batches N] [--param-bytes 2] [--grad-bytes 4] [--optim-bytes 8]
//!     [--no-checkpointing] [--keep-gathered] [--fp32-residual]
//!     [--peft r=16,alpha=32,rslora,targets=attention+experts] [--base-dtype fp8|bf16|f32]
//! ```
//!
//! `--peft` plans LoRA on a frozen base (PEFT's placement: the adapters, fp32, are the only
//! trainable values). `targets` joins with `+` the groups `attention` (every KDA and MLA
//! projection), `mlp` (dense MLPs and shared experts), `experts` (the routed experts'
//! `gate_up_proj`, `down_proj`) and any HF module names (`q_proj`, `kv_b_proj`, …).
//! `--base-dtype fp8` holds the frozen base's projections as the release checkpoint stores them
//! (E4M3 codes + one f32 scale per 128×128 block); it needs `--peft`.
//!
//! Prints the mesh's memory by part and communication by collective, then the plan for the
//! meshes NeMo AutoModel published measurements for (MedPix SFT, 2,048-token packs, global
//! batch 144) next to those measurements, and the smallest meshes that fit 80 GiB (H100) and
//! 141 GB (H200) GPUs.

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use glm5_burn::peft::target_group;
use glm5_burn::plan::{check_inputs, check_mesh, largest_ep, param_split, plan, smallest_fitting, Mesh, PlanInputs};
use glm5_burn::text::lora::{LoraConfig, TargetModules};
use glm5_burn::Glm5Config;

#[derive(Parser)]
struct Args {
    /// HF config.json (default: the bundled GLM-5.3-Flash release config).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// The mesh: `dp=…,ep=…,cp=…` (ranks = dp × cp).
    #[arg(long, default_value = "dp=36,ep=72,cp=2")]
    mesh: String,
    /// Tokens per packed sequence.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Micro-batches per rank per step (default: global batch 144 / dp).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// Bytes per parameter value (default 2: bf16).
    #[arg(long, conflicts_with = "base_dtype")]
    param_bytes: Option<usize>,
    /// Bytes per gradient value (4: fp32 reduction).
    #[arg(long, default_value_t = 4)]
    grad_bytes: usize,
    /// Optimizer bytes per trainable value (8: AdamW m, v in fp32; 12 with fp32 masters).
    #[arg(long, default_value_t = 8)]
    optim_bytes: usize,
    /// Without activation checkpointing.
    #[arg(long)]
    no_checkpointing: bool,
    /// Keep gathered weights until backward (FSDP `reshard_after_forward=False`).
    #[arg(long)]
    keep_gathered: bool,
    /// The mHC residual streams in fp32, as our recipes keep them by default (recipe
    /// `model.fp32_residual`). Without it the plan models NeMo's run, whose streams are bf16
    /// and whose published memory figures it is compared with.
    #[arg(long)]
    fp32_residual: bool,
    /// LoRA on a frozen base: `r=…[,alpha=…][,rslora][,targets=group+name+…]`.
    #[arg(long)]
    peft: Option<String>,
    /// The base weights' dtype: `fp8` (projections as E4M3 + block scales, the rest bf16;
    /// with --peft only), `bf16` or `f32`.
    #[arg(long)]
    base_dtype: Option<String>,
}

/// `--peft r=16,alpha=32,rslora,targets=attention+experts` as a PEFT `LoraConfig`.
fn parse_peft(spec: &str) -> Result<LoraConfig> {
    let (mut r, mut alpha, mut rslora, mut targets) = (None, None, false, "attention".to_string());
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (key, value) = item.split_once('=').unwrap_or((item, ""));
        let number = |what: &str| value.parse::<f64>().map_err(|_| anyhow!("{key}={value:?}: {what}"));
        match key {
            "r" => r = Some(value.parse::<usize>().ok().filter(|&r| r > 0).ok_or_else(|| anyhow!("r={value:?}: the rank is a positive integer"))?),
            "alpha" | "lora_alpha" => alpha = Some(number("lora_alpha is a number")?),
            "rslora" | "use_rslora" => rslora = true,
            "targets" => targets = value.to_string(),
            _ => bail!("{item:?}: unknown key (r, alpha, rslora, targets)"),
        }
    }
    let r = r.ok_or_else(|| anyhow!("the rank r=… is required"))?;
    let (mut names, mut params) = (Vec::new(), Vec::new());
    for t in targets.split('+').filter(|t| !t.is_empty()) {
        match target_group(t) {
            Some((n, p)) => (names.extend(n), params.extend(p)),
            None if t.contains("experts.") && !t.contains("shared_experts") => ((), params.push(t.to_string())),
            None => ((), names.push(t.to_string())),
        };
    }
    if names.is_empty() && params.is_empty() {
        bail!("targets={targets:?}: nothing to adapt");
    }
    let mut config = LoraConfig::new(r, alpha.unwrap_or(r as f64), TargetModules::Names(names.clone()));
    config.use_rslora = rslora;
    if names.is_empty() {
        config.target_modules = None;
    }
    if !params.is_empty() {
        config.target_parameters = Some(params);
    }
    Ok(config)
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
/// The published recipe's global batch (packs per optimizer step).
const GLOBAL_BATCH: usize = 144;
/// The largest world the smallest-mesh search tries.
const MAX_WORLD: usize = 4096;

fn main() -> Result<()> {
    let a = Args::parse();
    let config = match &a.config {
        Some(p) => Glm5Config::from_file(p).with_context(|| p.display().to_string())?,
        None => Glm5Config::full(),
    };
    let mesh = Mesh::parse(&a.mesh).map_err(|e| anyhow!("--mesh {}: {e}", a.mesh))?;
    if a.micro_batches.is_none() && mesh.dp > GLOBAL_BATCH {
        bail!(
            "--mesh {}: dp {} is larger than the recipe's global batch of {GLOBAL_BATCH} packs, so some data-parallel ranks \
             would get none; give --micro-batches N for a global batch of dp × N",
            a.mesh,
            mesh.dp
        );
    }
    let peft = a.peft.as_deref().map(parse_peft).transpose().with_context(|| format!("--peft {}", a.peft.as_deref().unwrap_or_default()))?;
    let (param_bytes, base_fp8) = match a.base_dtype.as_deref() {
        None => (a.param_bytes.unwrap_or(2), false),
        Some("fp8") if peft.is_none() => {
            bail!("--base-dtype fp8: an FP8 base is a frozen one; give --peft (a fully trained weight is not held in FP8)")
        }
        Some("fp8") => (2, true),
        Some("bf16") => (2, false),
        Some("f32") => (4, false),
        Some(other) => bail!("--base-dtype {other}: expected fp8, bf16 or f32"),
    };
    let inputs = |mesh: Mesh| PlanInputs {
        mesh,
        seq: a.seq,
        micro_batches: a.micro_batches.unwrap_or((GLOBAL_BATCH / mesh.dp).max(1)),
        param_bytes,
        peft: peft.clone(),
        base_fp8,
        grad_bytes: a.grad_bytes,
        optim_bytes: a.optim_bytes,
        checkpointing: !a.no_checkpointing,
        reshard_after_forward: !a.keep_gathered,
        fp32_residual: a.fp32_residual,
        ..PlanInputs::medpix_recipe(mesh)
    };
    let i = inputs(mesh);
    // the numbers first, so a bad --seq or byte size is named as such
    check_inputs(&i).map_err(|e| {
        let flag = match e.field {
            "seq" => "--seq",
            "micro_batches" => "--micro-batches",
            "param_bytes" => "--param-bytes",
            "grad_bytes" => "--grad-bytes",
            "optim_bytes" => "--optim-bytes",
            other => other,
        };
        anyhow!("{flag} {}: {}", e.value, e.message)
    })?;
    check_mesh(&config, mesh).map_err(|e| anyhow!("--mesh {}: {e}", a.mesh))?;
    let split = param_split(&config, &i).map_err(|e| anyhow!("--peft {}: {e}", a.peft.as_deref().unwrap_or_default()))?;
    let (m, comm) = plan(&config, &i).map_err(|e| anyhow!("--mesh {}: {e}", a.mesh))?;
    println!(
        "mesh dp={} ep={} cp={} ({} ranks), {} tokens per pack, {} micro-batches per rank, activation checkpointing {}",
        mesh.dp,
        mesh.ep,
        mesh.cp,
        mesh.world(),
        i.seq,
        i.micro_batches,
        if i.checkpointing { "on" } else { "off" }
    );
    let trainable = split.trainable_dense + split.trainable_experts;
    match &i.peft {
        Some(p) => println!(
            "LoRA r={} (fp32 adapters): {:.3} B trainable values ({:.3} B on routed experts), {:.2} B frozen base values held {}",
            p.r,
            trainable / 1e9,
            split.trainable_experts / 1e9,
            split.frozen / 1e9,
            if base_fp8 { "as FP8 E4M3 + 128×128 block scales (MLPs and routed experts, as released), bf16 (the rest)" } else { "in --param-bytes" }
        ),
        None => println!("full fine-tune: {:.2} B trainable values, {:.2} B frozen", trainable / 1e9, split.frozen / 1e9),
    }
    println!("\n| per rank | GiB |\n|---|---|");
    for (k, v) in [
        ("parameters", m.params),
        ("gradients", m.grads),
        ("optimizer state", m.optimizer),
        ("gathered FSDP units", m.gathered),
        ("activations", m.activations),
        ("EP exchange buffers", m.exchange),
        ("total (modelled)", m.total()),
    ] {
        println!("| {k} | {:.2} |", v / GIB);
    }
    println!("\n| collective | moves | GiB sent per rank per step |\n|---|---|---|");
    for (op, what, bytes) in &comm.rows {
        println!("| {op} | {what} | {:.2} |", bytes / GIB);
    }
    println!("| all | | {:.2} |", comm.total() / GIB);
    let c = &config.text_config;
    let f = glm5_burn::plan::dedup_factor(mesh.ep, c.n_routed_experts, c.num_experts_per_tok);
    println!(
        "\nEP dispatch sends one row per (token, expert); sending each token once per destination rank (DeepEP) \
         would move {:.0} % of that at ep {} (uniform routing).",
        100.0 * f,
        mesh.ep
    );

    // the published measurements of the same recipe (NeMo AutoModel, H100s), of the release
    // model only: another config is not what was measured
    if config == Glm5Config::full() && i.peft.is_none() {
        println!("\n| published mesh | ranks | measured GiB per GPU | planned GiB | gap GiB |\n|---|---|---|---|---|");
        for (mesh, ranks, measured) in [
            (Mesh { dp: 36, ep: 72, cp: 2 }, 72, "57.2 mean / 57.7 peak"),
            (Mesh { dp: 144, ep: 144, cp: 1 }, 144, "38.9"),
            (Mesh { dp: 18, ep: 144, cp: 8 }, 144, "41.0"),
        ] {
            match plan(&config, &inputs(mesh)) {
                Ok((m, _)) => {
                    let first: f64 = measured.split_whitespace().next().and_then(|x| x.parse().ok()).unwrap_or(f64::NAN);
                    println!("| EP{} / CP{} | {ranks} | {measured} | {:.1} | {:+.1} |", mesh.ep, mesh.cp, m.total() / GIB, first - m.total() / GIB);
                }
                Err(e) => println!("| EP{} / CP{} | {ranks} | {measured} | not planned: {e} | |", mesh.ep, mesh.cp),
            }
        }
    } else {
        println!(
            "\n(published measurements are of a full fine-tune of the GLM-5.3-Flash release config; this plan differs, so they are not compared)"
        );
    }

    println!("\n| GPU memory | smallest mesh that fits (per cp) | planned GiB |\n|---|---|---|");
    let cps = [1, 2, 4, 8];
    for (label, limit) in [("80 GiB (H100)", 80.0 * GIB), ("141 GB (H200)", 141e9)] {
        let fits = smallest_fitting(&config, &inputs(mesh), limit, &cps, MAX_WORLD).map_err(|e| anyhow!("{e}"))?;
        for (mesh, m) in &fits {
            println!("| {label} | dp={} ep={} cp={} ({} ranks) | {:.1} |", mesh.dp, mesh.ep, mesh.cp, mesh.world(), m.total() / GIB);
        }
        if fits.is_empty() {
            println!("| {label} | none up to {MAX_WORLD} ranks: {} | |", why_nothing_fits(&config, &inputs, &cps, limit));
        }
    }
    Ok(())
}

/// Why no mesh fits: the plan of the largest mesh tried, and its largest part.
fn why_nothing_fits(config: &Glm5Config, inputs: &dyn Fn(Mesh) -> PlanInputs, cps: &[usize], limit: f64) -> String {
    let e = config.text_config.n_routed_experts;
    let best = cps
        .iter()
        .filter_map(|&cp| {
            let world = MAX_WORLD / cp * cp;
            let ep = largest_ep(world, e);
            let mesh = Mesh { dp: world / cp, ep, cp };
            plan(config, &inputs(mesh)).ok().map(|(m, _)| (mesh, m))
        })
        .min_by(|a, b| a.1.total().total_cmp(&b.1.total()));
    match best {
        Some((mesh, m)) => {
            let parts = [
                ("activations", m.activations),
                ("parameters + gradients + optimizer", m.params + m.grads + m.optimizer),
                ("gathered FSDP units", m.gathered),
                ("EP exchange buffers", m.exchange),
            ];
            let (part, bytes) = parts.iter().copied().fold(("", 0.0), |a, b| if b.1 > a.1 { b } else { a });
            format!(
                "even dp={} ep={} cp={} plans {:.1} GiB per rank against {:.1} GiB, {part} alone {:.1} GiB (activations shrink only with a shorter --seq or a larger cp)",
                mesh.dp, mesh.ep, mesh.cp, m.total() / GIB, limit / GIB, bytes / GIB
            )
        }
        None => format!("no mesh of at most {MAX_WORLD} ranks is valid for this config and --seq"),
    }
}
