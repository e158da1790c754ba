//! Generate with a checkpoint: token ids in, sequences out (as HF's `generate` returns them),
//! or a question about an image answered on the terminal as it is generated.
//!
//! ```text
//! cargo run --release --example generate -- --checkpoint DIR --input IN.safetensors --max-new-tokens N --output OUT.safetensors
//! cargo run --release --example generate -- --checkpoint DIR --tokenizer DIR --image FILE --prompt TEXT
//! ```
//!
//! `IN` is what `logits` reads (`input_ids` I64 `[B, S]`, optional `attention_mask`,
//! `pixel_values`, `image_grid_thw`); `OUT` gets `sequences` I64 `[B, S + n]` (n ≤ N: generation
//! stops once every row has ended; ended rows are padded with `pad_token_id`). EOS ids come
//! from the checkpoint's `generation_config.json` / `config.json` unless `--eos` is given.
//! Greedy by default; `--do-sample` with `--temperature`, `--top-k`, `--top-p`, `--seed`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use burn::tensor::DType;
use clap::{Parser, ValueEnum};
use glm5_burn::checkpoint::{load_causal_lm, LoadOptions};
use glm5_burn::generate::{checkpoint_eos_ids, generate, generate_with, GenerateOptions, SamplingConfig, StopStrings};
use glm5_burn::io::{check_output_file, write_sequences, TokenInputs};
use glm5_burn::{ForwardOptions, Glm5Backend};

#[derive(Clone, Copy, ValueEnum)]
enum Precision {
    F32,
    Bf16,
}

#[derive(Clone, Copy, ValueEnum)]
enum BackendChoice {
    Flex,
    Tch,
    Cuda,
    Vulkan,
}

/// Generate tokens with a GLM-5.3-Flash checkpoint.
#[derive(Parser)]
#[command(allow_negative_numbers = true)]
struct Args {
    /// Checkpoint directory (config.json + safetensors).
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
    /// Input safetensors (`input_ids`, optional `attention_mask`, `pixel_values`, `image_grid_thw`).
    #[arg(long, required_unless_present = "prompt", conflicts_with = "prompt")]
    input: Option<PathBuf>,
    /// Output safetensors receiving `sequences` (I64 [B, S+n]).
    #[arg(long, required_unless_present = "prompt")]
    output: Option<PathBuf>,
    /// A question, rendered with the tokenizer's chat template (images first); the answer is printed as generated.
    #[arg(long, requires = "tokenizer")]
    prompt: Option<String>,
    /// Images for the prompt (repeatable).
    #[arg(long = "image", requires = "prompt")]
    images: Vec<PathBuf>,
    /// Tokenizer directory (tokenizer.json and its chat template).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// At most this many new tokens per row.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// EOS ids (repeatable; default: the checkpoint's).
    #[arg(long = "eos")]
    eos: Vec<i64>,
    /// Stop strings (repeatable): a row ends once its text shows one (needs `--tokenizer`).
    #[arg(long = "stop", requires = "tokenizer")]
    stop: Vec<String>,
    /// Sample instead of greedy decoding.
    #[arg(long)]
    do_sample: bool,
    /// Sampling temperature (> 0; with `--do-sample`) [default: 1.0].
    #[arg(long)]
    temperature: Option<f32>,
    /// Top-k filter (0: off; with `--do-sample`) [default: 50].
    #[arg(long)]
    top_k: Option<usize>,
    /// Top-p (nucleus) filter, in (0, 1] (1: off; with `--do-sample`) [default: 1.0].
    #[arg(long)]
    top_p: Option<f32>,
    /// Seed of the draws (with `--do-sample`) [default: 0].
    #[arg(long)]
    seed: Option<u64>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendChoice,
    /// Weight and activation precision.
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Precision,
}

fn main() {
    // one forward's buffers are freed and reallocated by the next layer: keep them (docs/throughput.md)
    glm5_burn::train::alloc::keep_freed_memory();
    let args = Args::parse();
    let result = match args.backend {
        BackendChoice::Flex => run::<burn::backend::Flex>(&args, &Default::default()),
        #[cfg(feature = "tch")]
        BackendChoice::Tch => run::<burn::backend::LibTorch>(&args, &burn::backend::libtorch::LibTorchDevice::Cpu),
        #[cfg(feature = "cuda")]
        BackendChoice::Cuda => run::<burn::backend::Cuda>(&args, &Default::default()),
        #[cfg(feature = "vulkan")]
        BackendChoice::Vulkan => run::<burn::backend::Vulkan>(&args, &Default::default()),
        #[allow(unreachable_patterns)]
        _ => Err(anyhow::anyhow!("this binary was built without that backend's cargo feature")),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The sampling settings, refused when out of range or given without `--do-sample` (greedy
/// decoding would ignore them without a word).
fn sampling(args: &Args) -> Result<SamplingConfig> {
    if !args.do_sample {
        let given: Vec<&str> =
            [args.temperature.map(|_| "--temperature"), args.top_k.map(|_| "--top-k"), args.top_p.map(|_| "--top-p"), args.seed.map(|_| "--seed")]
                .into_iter()
                .flatten()
                .collect();
        if !given.is_empty() {
            bail!(
                "{}: sampling settings, used only with --do-sample (decoding is greedy without it): add --do-sample or drop them",
                given.join(", ")
            );
        }
    }
    let temperature = args.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && temperature > 0.0) {
        bail!("--temperature {temperature}: must be a finite number > 0 (for greedy decoding drop --do-sample)");
    }
    let top_p = args.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        bail!("--top-p {top_p}: must be in (0, 1] (1 keeps every token)");
    }
    Ok(SamplingConfig { do_sample: args.do_sample, temperature, top_k: args.top_k.unwrap_or(50), top_p, seed: args.seed.unwrap_or(0) })
}

/// EOS ids must be token ids of the checkpoint's vocabulary.
fn check_eos(eos: &[i64], vocab: usize, source: &str) -> Result<()> {
    if let Some(bad) = eos.iter().find(|&&t| t < 0 || t as u64 >= vocab as u64) {
        bail!("{source}: EOS id {bad} is not a token id of this checkpoint (vocab_size {vocab}: ids 0..{})", vocab.saturating_sub(1));
    }
    Ok(())
}

/// A row whose mask has a 0 after a token is right-padded: generation appends after the last
/// position, so its new tokens would follow padding.
fn check_left_padded(mask: &[bool], batch: usize, seq: usize, input: &std::path::Path) -> Result<()> {
    for b in 0..batch {
        let row = &mask[b * seq..(b + 1) * seq];
        if let Some(first) = row.iter().position(|&m| m) {
            if let Some(gap) = row[first..].iter().position(|&m| !m) {
                bail!(
                    "{}: attention_mask row {b} has padding at position {} after its tokens: decoder-only generation continues \
                     from the last position, so pad prompts on the left (HF: tokenizer.padding_side = \"left\")",
                    input.display(),
                    first + gap
                );
            }
        }
    }
    Ok(())
}

fn run<B: Glm5Backend>(args: &Args, device: &B::Device) -> Result<()> {
    let dtype = if matches!(args.dtype, Precision::Bf16) { DType::BF16 } else { DType::F32 };
    let sampling = sampling(args)?;
    // everything the arguments can be checked against before a weight is read
    let config = glm5_burn::checkpoint::read_config(&args.checkpoint)?.resolved;
    let vocab = config.text_config.vocab_size;
    let eos = if args.eos.is_empty() {
        let eos = checkpoint_eos_ids(&args.checkpoint)?;
        check_eos(&eos, vocab, &format!("{} (generation_config.json / config.json)", args.checkpoint.display()))?;
        eos
    } else {
        check_eos(&args.eos, vocab, "--eos")?;
        args.eos.clone()
    };
    if let Some(question) = &args.prompt {
        return answer::<B>(args, question, dtype, eos, sampling, device);
    }
    let (input, output) = (args.input.clone().expect("clap requires it"), args.output.clone().expect("clap requires it"));
    let mut inputs_of = vec![("--input", input.as_path()), ("--checkpoint", args.checkpoint.as_path())];
    if let Some(a) = &args.adapter {
        inputs_of.push(("--adapter", a.as_path()));
    }
    check_output_file("--output", &output, &inputs_of)?;
    let inputs = TokenInputs::read(&input)?;
    check_left_padded(&inputs.mask, inputs.batch, inputs.seq, &input)?;
    if let Some(note) = inputs.placeholder_note(config.image_token_id) {
        eprintln!("note: {note}");
    }
    let tokenizer = match &args.tokenizer {
        Some(dir) => Some(load_tokenizer(dir)?),
        None => None,
    };
    let load = LoadOptions { vision: inputs.images.is_some(), fp8_base: args.fp8_base, ..LoadOptions::with_dtype(dtype) };
    let mut loaded = load_causal_lm::<B>(&args.checkpoint, device, &load)?;
    loaded.model = with_adapter(loaded.model, args.adapter.as_deref())?;
    let text = &loaded.config.resolved.text_config;
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling,
        eos_token_ids: eos,
        pad_token_id: text.pad_token_id.unwrap_or(0),
        max_positions: text.max_position_embeddings,
    };
    let prompt = inputs.input();
    let start = std::time::Instant::now();
    let out = match &tokenizer {
        Some(tok) if !args.stop.is_empty() => {
            let mut stop = StopStrings::new(tok, &args.stop)?;
            generate_with(&loaded.model, prompt, &opts, &ForwardOptions::default(), &mut stop, |_| {})
        }
        _ => generate(&loaded.model, prompt, &opts, &ForwardOptions::default(), |_| {}),
    }
    .with_context(|| input.display().to_string())?;
    let len = inputs.seq + out.new_tokens;
    eprintln!("generated {} tokens per row in {:.2?}; rows ended (EOS or stop string): {:?}", out.new_tokens, start.elapsed(), out.ended);
    write_sequences(&output, &out.sequences, [inputs.batch, len])?;
    eprintln!("wrote {}", output.display());
    Ok(())
}

/// `model` with the PEFT adapter in `dir` attached, when one is given.
fn with_adapter<B: Glm5Backend>(model: glm5_burn::Glm5ForCausalLM<B>, dir: Option<&std::path::Path>) -> Result<glm5_burn::Glm5ForCausalLM<B>> {
    let Some(dir) = dir else { return Ok(model) };
    let (model, config, attached) = glm5_burn::checkpoint::adapter::load_adapter(model, dir)?;
    eprintln!("adapter {}: r {}, alpha {}: {attached}", dir.display(), config.r, config.lora_alpha);
    Ok(model)
}

fn answer<B: Glm5Backend>(args: &Args, question: &str, dtype: DType, eos: Vec<i64>, sampling: SamplingConfig, device: &B::Device) -> Result<()> {
    use glm5_burn::data::chat::ChatFormat;
    use glm5_burn::data::image_processor::{ImageProcessor, RgbImage};
    // `--tokenizer` names tokenizer.json or the directory holding it
    let dir = args.tokenizer.as_ref().expect("clap requires it");
    let chat = ChatFormat::from_dir(dir).with_context(|| format!("loading the tokenizer and chat template from {}", dir.display()))?;
    let images = args.images.iter().map(|p| RgbImage::open(p)).collect::<Result<Vec<_>, _>>()?;
    let p = glm5_burn::data::user_prompt(&chat, &ImageProcessor::default(), &images, question)?;
    let mut loaded = load_causal_lm::<B>(
        &args.checkpoint,
        device,
        &LoadOptions { vision: !images.is_empty(), fp8_base: args.fp8_base, ..LoadOptions::with_dtype(dtype) },
    )?;
    loaded.model = with_adapter(loaded.model, args.adapter.as_deref())?;
    let image_id = chat.tokenizer.token_to_id("<|image|>").map(|x| x as i64);
    if !images.is_empty() && image_id != Some(loaded.config.resolved.image_token_id) {
        bail!("the tokenizer's <|image|> id {image_id:?} differs from the checkpoint's image_token_id {}", loaded.config.resolved.image_token_id);
    }
    // the chat format's turn end stops an answer too
    let mut eos = eos;
    eos.extend(["<|user|>", "<|endoftext|>"].iter().filter_map(|t| chat.tokenizer.token_to_id(t)).map(|x| x as i64));
    let text = &loaded.config.resolved.text_config;
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling,
        eos_token_ids: eos.clone(),
        pad_token_id: text.pad_token_id.unwrap_or(0),
        max_positions: text.max_position_embeddings,
    };
    let prompt = p.input();
    let mut answer: Vec<u32> = Vec::new();
    let mut shown = 0;
    let mut stdout = std::io::stdout();
    let mut stop = StopStrings::new(&chat.tokenizer, &args.stop)?;
    generate_with(&loaded.model, prompt, &opts, &ForwardOptions::default(), &mut stop, |t| {
        if !eos.contains(&t[0]) {
            answer.push(t[0] as u32);
            // print what the new token adds to the decoded answer
            if let Ok(text) = chat.tokenizer.decode(&answer, true) {
                if text.len() > shown && text.is_char_boundary(shown) {
                    let _ = write!(stdout, "{}", &text[shown..]);
                    let _ = stdout.flush();
                    shown = text.len();
                }
            }
        }
    })?;
    println!();
    Ok(())
}

/// The tokenizer of `dir` (its `tokenizer.json`), or `dir` itself when it is that file.
fn load_tokenizer(dir: &std::path::Path) -> Result<tokenizers::Tokenizer> {
    let file = if dir.is_dir() { dir.join("tokenizer.json") } else { dir.to_path_buf() };
    tokenizers::Tokenizer::from_file(&file).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))
}
