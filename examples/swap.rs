//! Backend-swapping experiments without code: one checkpoint, one input, two runs — each a
//! backend, a dtype and a path choice — compared layer by layer.
//!
//! ```text
//! cargo run --release --example swap -- --checkpoint DIR --input IN.safetensors \
//!     --a flex:f32:reference --b flex:bf16:op [--json]
//! ```
//!
//! A run is `BACKEND:DTYPE:PATH`: `flex|tch|cuda|vulkan` (the last three need the cargo feature
//! of that name), `f32|bf16`, and `reference|op` (the reference tensor-op paths of KDA and
//! sparse attention, or the backend's own kernels / fused loops: recipe `model.backend.*`).
//! `IN` is what `logits` reads (`input_ids`, optional `attention_mask`, `pixel_values`,
//! `image_grid_thw`). Printed: per decoder layer, the divergence of the mHC streams of run B
//! from run A (max|Δ|/max|A| and cosine, over real tokens); then the logits' mean and max KL(A‖B)
//! per position and the top-1 agreement. `--json` prints one JSON object instead.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use burn::tensor::{DType, Tensor};
use clap::Parser;
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::io::TokenInputs;
use glm5_burn::ops::PathKind;
use glm5_burn::{ForwardOptions, Glm5Backend, Outputs};
use serde_json::json;

/// Compare one checkpoint's forward under two backend/dtype/path choices.
#[derive(Parser)]
struct Args {
    /// Checkpoint directory (config.json + safetensors).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Input safetensors with `input_ids` (I64 [B, S]) and optional `attention_mask`, images.
    #[arg(long)]
    input: PathBuf,
    /// The reference run, `BACKEND:DTYPE:PATH`.
    #[arg(long, default_value = "flex:f32:reference")]
    a: String,
    /// The compared run, `BACKEND:DTYPE:PATH`.
    #[arg(long, default_value = "flex:bf16:op")]
    b: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// One run's choices.
struct Spec {
    backend: String,
    dtype: DType,
    path: PathKind,
}

fn parse_spec(s: &str) -> Result<Spec> {
    let parts: Vec<&str> = s.split(':').collect();
    let [backend, dtype, path] = parts[..] else { bail!("{s:?}: expected BACKEND:DTYPE:PATH, e.g. flex:f32:reference") };
    let dtype = match dtype {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => bail!("{s:?}: dtype {other:?} (f32 or bf16)"),
    };
    let path = match path {
        "reference" => PathKind::Reference,
        "op" | "kernel" => PathKind::Op,
        other => bail!("{s:?}: path {other:?} (reference or op)"),
    };
    if !["flex", "tch", "cuda", "vulkan"].contains(&backend) {
        bail!("{s:?}: backend {backend:?} (flex, tch, cuda or vulkan)");
    }
    Ok(Spec { backend: backend.into(), dtype, path })
}

/// One run's results on the host: the streams after each layer `[B·S·n·D]` and the logits `[B·S·V]`.
struct Run {
    streams: Vec<Vec<f32>>,
    logits: Vec<f32>,
}

fn host<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>> {
    t.cast(DType::F32).into_data().convert::<f32>().into_vec::<f32>().map_err(|e| anyhow::anyhow!("{e:?}"))
}

fn run<B: Glm5Backend>(args: &Args, spec: &Spec, inputs: &TokenInputs, device: &B::Device) -> Result<Run> {
    let (_b, _s) = (inputs.batch, inputs.seq);
    let load = LoadOptions { vision: inputs.images.is_some(), ..LoadOptions::with_dtype(spec.dtype) };
    let loaded = load_causal_lm::<B>(&args.checkpoint, device, &load)?;
    let opts = ForwardOptions { attn_path: spec.path, kda_path: spec.path, ..Default::default() };
    let out = loaded
        .model
        .forward(inputs.input(), &opts, Outputs { layer_streams: true, index_rows: false })
        .with_context(|| args.input.display().to_string())?;
    Ok(Run { streams: out.text.layer_streams.into_iter().map(host).collect::<Result<_>>()?, logits: host(out.logits)? })
}

fn dispatch(args: &Args, spec: &Spec, inputs: &TokenInputs) -> Result<Run> {
    match spec.backend.as_str() {
        "flex" => run::<burn::backend::Flex>(args, spec, inputs, &Default::default()),
        #[cfg(feature = "tch")]
        "tch" => run::<burn::backend::LibTorch>(args, spec, inputs, &burn::backend::libtorch::LibTorchDevice::Cpu),
        #[cfg(feature = "cuda")]
        "cuda" => run::<burn::backend::Cuda>(args, spec, inputs, &Default::default()),
        #[cfg(feature = "vulkan")]
        "vulkan" => run::<burn::backend::Vulkan>(args, spec, inputs, &Default::default()),
        other => bail!("backend {other:?}: this binary was built without the `{other}` feature"),
    }
}

/// max|a − b| / max|a| and the cosine of `a` and `b`, over the rows (of `width`) `keep` marks.
fn divergence(a: &[f32], b: &[f32], width: usize, keep: &[bool]) -> (f64, f64) {
    let (mut dmax, mut amax, mut dot, mut na, mut nb) = (0f64, 0f64, 0f64, 0f64, 0f64);
    for ((ra, rb), _) in a.chunks(width).zip(b.chunks(width)).zip(keep).filter(|(_, k)| **k) {
        for (&x, &y) in ra.iter().zip(rb) {
            let (x, y) = (x as f64, y as f64);
            dmax = dmax.max((x - y).abs());
            amax = amax.max(x.abs());
            dot += x * y;
            na += x * x;
            nb += y * y;
        }
    }
    (dmax / amax.max(1e-30), dot / (na.sqrt() * nb.sqrt()).max(1e-30))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let (spec_a, spec_b) = (parse_spec(&args.a).context("--a")?, parse_spec(&args.b).context("--b")?);
    let inputs = TokenInputs::read(&args.input)?;
    if let Some(note) = glm5_burn::checkpoint::read_config(&args.checkpoint).ok().and_then(|c| inputs.placeholder_note(c.resolved.image_token_id)) {
        eprintln!("note: {note}");
    }
    let a = dispatch(&args, &spec_a, &inputs).with_context(|| format!("run A ({})", args.a))?;
    let b = dispatch(&args, &spec_b, &inputs).with_context(|| format!("run B ({})", args.b))?;
    let positions = inputs.batch * inputs.seq;
    let keep = &inputs.mask;

    let layers: Vec<(f64, f64)> = a.streams.iter().zip(&b.streams).map(|(x, y)| divergence(x, y, x.len() / positions, keep)).collect();
    let v = a.logits.len() / positions;
    let lse = |z: &[f32]| {
        let m = z.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
        z.iter().map(|&q| (q as f64 - m).exp()).sum::<f64>().ln() + m
    };
    let argmax = |z: &[f32]| z.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map(|(i, _)| i);
    let (mut kl_sum, mut kl_max, mut agree, mut n) = (0f64, 0f64, 0usize, 0usize);
    for ((x, y), _) in a.logits.chunks(v).zip(b.logits.chunks(v)).zip(keep).filter(|(_, k)| **k) {
        let (lx, ly) = (lse(x), lse(y));
        let kl: f64 = x.iter().zip(y).map(|(&p, &q)| (p as f64 - lx).exp() * ((p as f64 - lx) - (q as f64 - ly))).sum();
        kl_sum += kl;
        kl_max = kl_max.max(kl);
        agree += usize::from(argmax(x) == argmax(y));
        n += 1;
    }
    let (kl_mean, top1) = (kl_sum / n.max(1) as f64, agree as f64 / n.max(1) as f64);
    let (logits_rel, logits_cos) = divergence(&a.logits, &b.logits, v, keep);

    if args.json {
        let layers: Vec<_> = layers.iter().enumerate().map(|(i, (r, c))| json!({"layer": i, "max_rel": r, "cosine": c})).collect();
        let out = json!({
            "a": args.a, "b": args.b, "positions": n, "layers": layers,
            "logits": {"max_rel": logits_rel, "cosine": logits_cos, "kl_mean": kl_mean, "kl_max": kl_max, "top1_agreement": top1},
        });
        println!("{out}");
        return Ok(());
    }
    println!("A = {}   B = {}   ({n} positions)", args.a, args.b);
    println!("{:>6}  {:>14}  {:>12}", "layer", "max|Δ|/max|A|", "cosine");
    for (i, (r, c)) in layers.iter().enumerate() {
        println!("{i:>6}  {r:>14.3e}  {c:>12.9}");
    }
    println!("{:>6}  {logits_rel:>14.3e}  {logits_cos:>12.9}", "logits");
    println!("KL(A‖B) per position: mean {kl_mean:.3e}, max {kl_max:.3e}; top-1 agreement {:.2} %", 100.0 * top1);
    Ok(())
}
