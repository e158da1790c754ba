//! Per-rank memory and per-step communication of a training run at real scale, on paper
//! (`glm5_burn::plan`), checked against published figures of the same recipe.
//!
//! ```text
//! cargo run --release --example plan -- [--config configs/glm5_3_flash.json] [--mesh dp=36,ep=72,cp=2]
//!     [--seq 2048] [--micro-batches N] [--param-bytes 2] [--grad-bytes 4] [--optim-bytes 8]
//!     [--no-checkpointing] [--keep-gathered]
//! ```
//!
//! Prints the mesh's memory by part and communication by collective, then the plan for the
//! meshes NeMo AutoModel published measurements for (MedPix SFT, 2,048-token packs, global
//! batch 144) next to those measurements, and the smallest meshes that fit 80 GiB (H100) and
//! 141 GB (H200) GPUs.

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use glm5_burn::plan::{check_inputs, check_mesh, largest_ep, plan, smallest_fitting, Mesh, PlanInputs};
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
    /// Bytes per parameter value (2: bf16).
    #[arg(long, default_value_t = 2)]
    param_bytes: usize,
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
    let inputs = |mesh: Mesh| PlanInputs {
        mesh,
        seq: a.seq,
        micro_batches: a.micro_batches.unwrap_or((GLOBAL_BATCH / mesh.dp).max(1)),
        param_bytes: a.param_bytes,
        grad_bytes: a.grad_bytes,
        optim_bytes: a.optim_bytes,
        checkpointing: !a.no_checkpointing,
        reshard_after_forward: !a.keep_gathered,
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
    if config == Glm5Config::full() {
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
        println!("\n(published measurements are of the GLM-5.3-Flash release config; this config differs, so they are not compared)");
    }

    println!("\n| GPU memory | smallest mesh that fits (per cp) | planned GiB |\n|---|---|---|");
    let cps = [1, 2, 4, 8];
    for (label, limit) in [("80 GiB (H100)", 80.0 * GIB), ("141 GB (H200)", 141e9)] {
        let fits = smallest_fitting(&config, &inputs(mesh), limit, &cps, MAX_WORLD);
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
