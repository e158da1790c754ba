//! Run a checkpoint on token ids and write the logits — the way to check parity from outside.
//!
//! ```text
//! cargo run --release --example logits -- --checkpoint DIR --input IN.safetensors --output OUT.safetensors
//! ```
//!
//! `IN` holds `input_ids` (I64 `[B, S]`) and optionally `attention_mask` (I64 `[B, S]`,
//! 1 = token, 0 = padding) and images as the reference's forward takes them: `pixel_values`
//! (F32 `[N_patches, 1176]`) with `image_grid_thw` (I64 `[N_images, 3]`). `OUT` gets `logits`
//! (F32 `[B, S, V]`). If `IN` also holds reference `logits` (as the test fixtures do), the
//! parity against them is printed.

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::backend::Flex;
use burn::tensor::DType;
use clap::{Parser, ValueEnum};
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::io::{check_output_file, write_logits, TokenInputs};
use glm5_burn::{AttentionImpl, ForwardOptions, Glm5Backend, Outputs};

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

#[derive(Clone, Copy, ValueEnum)]
enum BackendChoice {
    /// Burn's CPU backend.
    Flex,
    /// LibTorch on the CPU (build with `--features tch`, see the README).
    Tch,
    /// CUDA (build with `--features cuda`).
    Cuda,
    /// Vulkan through wgpu (build with `--features vulkan`).
    Vulkan,
}

/// Compute GLM-5.3-Flash logits for token ids with a Hugging Face checkpoint, or, with
/// `--prompt`, run image files and a prompt through the processor and chat format and print
/// the most likely next tokens.
#[derive(Parser)]
struct Args {
    /// Images for the prompt (repeatable; PNG or JPEG), with `--prompt`.
    #[arg(long = "image", requires = "prompt")]
    images: Vec<PathBuf>,
    /// A user prompt: rendered with the tokenizer's chat template, images first.
    #[arg(long, requires = "tokenizer", conflicts_with_all = ["input", "output"])]
    prompt: Option<String>,
    /// `tokenizer.json`; its chat template is `chat_template.jinja` or `tokenizer_config.json` beside it.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// How many next tokens to print with `--prompt`.
    #[arg(long, default_value_t = 5)]
    top: usize,
    /// Backend to run on.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendChoice,
    /// Checkpoint directory (config.json + model.safetensors or a sharded index).
    #[arg(long)]
    checkpoint: PathBuf,
    /// A LoRA adapter directory in HF PEFT's format (adapter_config.json +
    /// adapter_model.safetensors), applied unmerged on top of the checkpoint.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Keep the checkpoint's FP8 weights (E4M3 with `weight_scale_inv`) in FP8 in memory,
    /// dequantised per use — a byte a weight — instead of dequantising them at load.
    #[arg(long)]
    fp8_base: bool,
    /// Input safetensors with `input_ids` (I64 [B, S]) and optional `attention_mask`.
    #[arg(long, required_unless_present = "prompt")]
    input: Option<PathBuf>,
    /// Output safetensors receiving `logits` (F32 [B, S, V]).
    #[arg(long, required_unless_present = "prompt")]
    output: Option<PathBuf>,
    /// Weight and activation precision (fp32 is kept where the reference keeps it).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Precision,
    /// DSA attention form.
    #[arg(long, value_enum, default_value = "auto")]
    attention: Attention,
    /// Under --dtype bf16, keep the mHC residual streams in fp32 (`true`, the library's
    /// default) or round them to bf16 after every layer as HF does (`false`):
    /// `ForwardOptions::fp32_residual`.
    #[arg(long, action = clap::ArgAction::Set, default_value_t = ForwardOptions::default().fp32_residual)]
    fp32_residual: bool,
}

fn main() {
    // one forward's buffers are freed and reallocated by the next layer: keep them (docs/throughput.md)
    glm5_burn::train::alloc::keep_freed_memory();
    let args = Args::parse();
    let result = match args.backend {
        BackendChoice::Flex => run::<Flex>(&args, &Default::default()),
        #[cfg(feature = "tch")]
        BackendChoice::Tch => run::<burn::backend::LibTorch>(&args, &burn::backend::libtorch::LibTorchDevice::Cpu),
        #[cfg(not(feature = "tch"))]
        BackendChoice::Tch => Err(anyhow::anyhow!("this binary was built without the `tch` feature")),
        #[cfg(feature = "cuda")]
        BackendChoice::Cuda => run::<burn::backend::Cuda>(&args, &Default::default()),
        #[cfg(not(feature = "cuda"))]
        BackendChoice::Cuda => Err(anyhow::anyhow!("this binary was built without the `cuda` feature")),
        #[cfg(feature = "vulkan")]
        BackendChoice::Vulkan => run::<burn::backend::Vulkan>(&args, &Default::default()),
        #[cfg(not(feature = "vulkan"))]
        BackendChoice::Vulkan => Err(anyhow::anyhow!("this binary was built without the `vulkan` feature")),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run<B: Glm5Backend>(args: &Args, device: &B::Device) -> Result<()> {
    if let Some(prompt) = &args.prompt {
        return run_prompt::<B>(args, prompt, device);
    }
    let (input, output) = (args.input.clone().expect("clap requires it"), args.output.clone().expect("clap requires it"));
    let mut inputs_of = vec![("--input", input.as_path()), ("--checkpoint", args.checkpoint.as_path())];
    if let Some(a) = &args.adapter {
        inputs_of.push(("--adapter", a.as_path()));
    }
    check_output_file("--output", &output, &inputs_of)?;
    let inputs = TokenInputs::read(&input)?;
    if let Some(note) = glm5_burn::checkpoint::read_config(&args.checkpoint).ok().and_then(|c| inputs.placeholder_note(c.resolved.image_token_id)) {
        eprintln!("note: {note}");
    }
    let (b, s) = (inputs.batch, inputs.seq);
    let dtype = match args.dtype {
        Precision::F32 => DType::F32,
        Precision::Bf16 => DType::BF16,
    };
    // the vision tower is loaded only when the input carries images
    let load = LoadOptions { vision: inputs.images.is_some(), fp8_base: args.fp8_base, ..LoadOptions::with_dtype(dtype) };
    let start = std::time::Instant::now();
    let mut loaded = load_causal_lm::<B>(&args.checkpoint, device, &load)?;
    eprintln!("loaded {} in {:.2?}", args.checkpoint.display(), start.elapsed());
    loaded.model = with_adapter(loaded.model, args.adapter.as_deref())?;
    let opts = ForwardOptions {
        attention: match args.attention {
            Attention::Auto => ForwardOptions::default().attention,
            Attention::Dense => AttentionImpl::Dense,
            Attention::Sparse => AttentionImpl::Sparse,
        },
        fp32_residual: args.fp32_residual,
        ..Default::default()
    };
    let start = std::time::Instant::now();
    let out = loaded.model.forward(inputs.input(), &opts, Outputs::default()).with_context(|| format!("{}", input.display()))?;
    let logits: Vec<f32> = out.logits.cast(DType::F32).into_data().convert::<f32>().into_vec().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let v = logits.len() / (b * s);
    eprintln!("forward [{b}, {s}] -> [{b}, {s}, {v}] in {:.2?}", start.elapsed());
    write_logits(&output, &logits, [b, s, v])?;
    eprintln!("wrote {}", output.display());

    if let Some((reference, rv)) = &inputs.reference_logits {
        if *rv == v {
            let (mut max_abs, mut kl_sum, mut n) = (0f64, 0f64, 0usize);
            let lse = |z: &[f32]| {
                let m = z.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
                z.iter().map(|&q| (q as f64 - m).exp()).sum::<f64>().ln() + m
            };
            for (row, (x, y)) in reference.chunks(v).zip(logits.chunks(v)).enumerate().filter(|(r, _)| inputs.mask[*r]) {
                let _ = row;
                let (lx, ly) = (lse(x), lse(y));
                kl_sum += x.iter().zip(y).map(|(&p, &q)| (p as f64 - lx).exp() * ((p as f64 - lx) - (q as f64 - ly))).sum::<f64>();
                max_abs = x.iter().zip(y).fold(max_abs, |m, (p, q)| m.max((p - q).abs() as f64));
                n += 1;
            }
            eprintln!(
                "parity vs the reference logits in the input: max|Δ| {max_abs:.3e}, mean KL {:.3e} over {n} positions",
                kl_sum / n.max(1) as f64
            );
        }
    }
    Ok(())
}

/// `model` with the PEFT adapter in `dir` attached, when one is given.
fn with_adapter<B: Glm5Backend>(model: glm5_burn::Glm5ForCausalLM<B>, dir: Option<&std::path::Path>) -> Result<glm5_burn::Glm5ForCausalLM<B>> {
    let Some(dir) = dir else { return Ok(model) };
    let (model, config, attached) = glm5_burn::checkpoint::adapter::load_adapter(model, dir)?;
    eprintln!("adapter {}: r {}, alpha {}: {attached}", dir.display(), config.r, config.lora_alpha);
    Ok(model)
}

fn run_prompt<B: Glm5Backend>(args: &Args, prompt: &str, device: &B::Device) -> Result<()> {
    use glm5_burn::data::chat::ChatFormat;
    use glm5_burn::data::image_processor::{ImageProcessor, RgbImage};
    let tok = args.tokenizer.as_ref().expect("clap requires it");
    // `--tokenizer` may name tokenizer.json or the directory holding it
    let chat = ChatFormat::from_dir(tok).with_context(|| format!("loading the tokenizer and chat template from {}", tok.display()))?;
    let images = args.images.iter().map(|p| RgbImage::open(p)).collect::<Result<Vec<_>, _>>()?;
    let p = glm5_burn::data::user_prompt(&chat, &ImageProcessor::default(), &images, prompt)?;
    let dtype = if matches!(args.dtype, Precision::Bf16) { DType::BF16 } else { DType::F32 };
    let load = LoadOptions { vision: !images.is_empty(), fp8_base: args.fp8_base, ..LoadOptions::with_dtype(dtype) };
    let mut loaded = load_causal_lm::<B>(&args.checkpoint, device, &load)?;
    loaded.model = with_adapter(loaded.model, args.adapter.as_deref())?;
    let image_id = chat.tokenizer.token_to_id("<|image|>").map(|x| x as i64);
    if !images.is_empty() && image_id != Some(loaded.config.resolved.image_token_id) {
        anyhow::bail!(
            "the tokenizer's <|image|> id {:?} differs from the checkpoint's image_token_id {}",
            image_id,
            loaded.config.resolved.image_token_id
        );
    }
    let s = p.ids.len();
    let out = loaded.model.forward(p.input(), &ForwardOptions::default(), Outputs::default())?;
    let v = loaded.config.resolved.text_config.vocab_size;
    let last: Vec<f32> =
        out.logits.slice([0..1, s - 1..s, 0..v]).cast(DType::F32).into_data().convert::<f32>().into_vec().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let m = last.iter().fold(f32::MIN, |a, &b| a.max(b));
    let z: f32 = last.iter().map(|x| (x - m).exp()).sum();
    let mut order: Vec<usize> = (0..v).collect();
    order.sort_by(|a, b| last[*b].total_cmp(&last[*a]));
    println!("{s} prompt tokens ({} images, grids {:?}); next token:", images.len(), p.images.grid_thw);
    for &i in order.iter().take(args.top) {
        let text = chat.tokenizer.decode(&[i as u32], false).unwrap_or_default();
        println!("  {i:>7}  p={:.4}  {text:?}", (last[i] - m).exp() / z);
    }
    Ok(())
}
