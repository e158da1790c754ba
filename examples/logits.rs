//! Run a checkpoint on token ids and write the logits — the way to check parity from outside.
//!
//! ```text
//! cargo run --release --example logits -- --checkpoint DIR --input IN.safetensors --output OUT.safetensors
//! ```
//!
//! `IN` holds `input_ids` (I64 `[B, S]`) and optionally `attention_mask` (I64 `[B, S]`,
//! 1 = token, 0 = padding). `OUT` gets `logits` (F32 `[B, S, V]`). If `IN` also holds
//! reference `logits` (as the test fixtures do), the parity against them is printed.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use burn::backend::Flex;
use burn::tensor::{DType, Int, Tensor, TensorData};
use clap::{Parser, ValueEnum};
use glm5_burn::checkpoint::safetensors_io::{serialize, write_atomic, OwnedTensor};
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::{AttentionImpl, ForwardOptions, TokenMask};
use safetensors::tensor::{Dtype, SafeTensors};

#[derive(Clone, Copy, ValueEnum)]
enum Precision {
    F32,
    Bf16,
}

#[derive(Clone, Copy, ValueEnum)]
enum Attention {
    Auto,
    Dense,
    Sparse,
}

/// Compute GLM-5.3-Flash logits for token ids with a Hugging Face checkpoint.
#[derive(Parser)]
struct Args {
    /// Checkpoint directory (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Input safetensors with `input_ids` (I64 [B, S]) and optional `attention_mask`.
    #[arg(long)]
    input: PathBuf,
    /// Output safetensors receiving `logits` (F32 [B, S, V]).
    #[arg(long)]
    output: PathBuf,
    /// Weight and activation precision (fp32 is kept where the reference keeps it).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Precision,
    /// DSA attention form.
    #[arg(long, value_enum, default_value = "auto")]
    attention: Attention,
}

fn read_i64(st: &SafeTensors, name: &str, path: &PathBuf) -> Result<Option<(Vec<i64>, Vec<usize>)>> {
    let Ok(v) = st.tensor(name) else { return Ok(None) };
    if v.dtype() != Dtype::I64 {
        bail!("{}: `{name}` must be I64, found {:?}", path.display(), v.dtype());
    }
    if v.shape().len() != 2 {
        bail!("{}: `{name}` must have rank 2 [B, S], found shape {:?}", path.display(), v.shape());
    }
    let data = v.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
    Ok(Some((data, v.shape().to_vec())))
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(args: Args) -> Result<()> {
    let bytes = std::fs::read(&args.input).with_context(|| format!("reading {}", args.input.display()))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e:?}", args.input.display()))?;
    let (ids, shape) = read_i64(&st, "input_ids", &args.input)?
        .with_context(|| format!("{}: no `input_ids` tensor", args.input.display()))?;
    let (b, s) = (shape[0], shape[1]);
    if b == 0 || s == 0 {
        bail!("{}: `input_ids` is empty (shape {shape:?})", args.input.display());
    }
    let mask = match read_i64(&st, "attention_mask", &args.input)? {
        None => vec![true; b * s],
        Some((m, mshape)) => {
            if mshape != shape {
                bail!("{}: `attention_mask` shape {mshape:?} differs from `input_ids` {shape:?}", args.input.display());
            }
            if let Some(x) = m.iter().find(|&&x| x != 0 && x != 1) {
                bail!("{}: `attention_mask` must hold 0 or 1, found {x}", args.input.display());
            }
            m.iter().map(|&x| x == 1).collect()
        }
    };

    let device = Default::default();
    let dtype = match args.dtype {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::BF16,
    };
    let loaded = load_causal_lm::<Flex>(&args.checkpoint, &device, &LoadOptions { dtype })?;
    loaded.model.check_ids(&ids).with_context(|| format!("{}", args.input.display()))?;
    let opts = ForwardOptions {
        attention: match args.attention {
            Attention::Auto => ForwardOptions::default().attention,
            Attention::Dense => AttentionImpl::Dense,
            Attention::Sparse => AttentionImpl::Sparse,
        },
        ..Default::default()
    };
    let ids_t = Tensor::<Flex, 2, Int>::from_data(TensorData::new(ids, [b, s]), &device);
    let start = std::time::Instant::now();
    let out = loaded.model.forward(ids_t, Some(TokenMask::new(mask.clone(), b, s, &device)), &opts, false);
    let logits: Vec<f32> = out.logits.cast(DType::F32).into_data().convert::<f32>().into_vec().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let v = logits.len() / (b * s);
    eprintln!("forward [{b}, {s}] -> [{b}, {s}, {v}] in {:.2?}", start.elapsed());

    let mut t = BTreeMap::new();
    t.insert(
        "logits".to_string(),
        OwnedTensor { dtype: Dtype::F32, shape: vec![b, s, v], data: logits.iter().flat_map(|x| x.to_le_bytes()).collect() },
    );
    write_atomic(&args.output, &serialize(&t)?)?;
    eprintln!("wrote {}", args.output.display());

    // optional parity report against reference logits stored in the input file
    if let Ok(r) = st.tensor("logits") {
        if r.dtype() == Dtype::F32 && r.shape() == [b, s, v] {
            let reference: Vec<f32> = r.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            let (mut max_abs, mut kl_sum, mut n) = (0f64, 0f64, 0usize);
            for (row, (x, y)) in reference.chunks(v).zip(logits.chunks(v)).enumerate() {
                if !mask[row] {
                    continue;
                }
                let lse = |z: &[f32]| {
                    let m = z.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
                    z.iter().map(|&q| (q as f64 - m).exp()).sum::<f64>().ln() + m
                };
                let (lx, ly) = (lse(x), lse(y));
                kl_sum += x.iter().zip(y).map(|(&p, &q)| (p as f64 - lx).exp() * ((p as f64 - lx) - (q as f64 - ly))).sum::<f64>();
                max_abs = x.iter().zip(y).fold(max_abs, |m, (p, q)| m.max((p - q).abs() as f64));
                n += 1;
            }
            eprintln!("parity vs reference logits in the input: max|Δ| {max_abs:.3e}, mean KL {:.3e} over {n} positions", kl_sum / n.max(1) as f64);
        }
    }
    Ok(())
}
