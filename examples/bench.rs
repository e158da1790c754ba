//! Throughput and memory of a forward pass or a full training step on a seeded model built
//! from an HF `config.json` (no checkpoint needed).
//!
//! ```text
//! cargo run --release --example bench -- --config configs/bench_small.json --seq 512 \
//!     [--batch 1] [--mode forward|train|both|decode] [--warmup 10] [--steps 5] [--threads 2] [--profile] \
//!     [--dtype f32|bf16] [--set text_config.num_hidden_layers=4 --set text_config.n_routed_experts=16] \
//!     [--freeze embeddings,head]
//! ```
//!
//! `--set PATH=JSON` edits the config before it is resolved, so a cut of the release config
//! (`configs/glm5_3_flash.json`: fewer layers and routed experts, every width and the
//! vocabulary kept) runs at the real width.
//!
//! Steady state: `--warmup` untimed iterations first (default 10), then the median of the
//! `--steps` timed ones. Prints one JSON line per mode: `{"impl", "mode", "tokens", "median_s",
//! "min_s", "max_s", "tokens_per_s", "peak_rss_mb", "run_peak_rss_mb"}` (peak RSS: Linux
//! `VmHWM` after the mode ran, forward first; `run_peak_rss_mb`, forward only: the peak since
//! the model existed, without building it — a bf16 model is built in f32 and cast), the same
//! shape as `tests/reference/bench_reference.py`, which runs the HF reference on the same config.
//! A train step is forward, cross-entropy over all tokens, backward and the AdamW update
//! (the library's `Trainer` with fp32 weights, no clipping). `--profile` adds the time per
//! model part (forward scopes; backward and the AdamW update as wholes) for the timed iterations.
//!
//! `--mode decode` prefills a `--seq`-token prompt (timed once, `prefill_s`), then runs
//! `--warmup` untimed and `--steps` timed decode steps of one greedy token per row, at context
//! lengths `seq + warmup ..= seq + warmup + steps`: `median_s` is the median step time,
//! `tokens_per_s` rows per second, `cache_bytes` the caches' size after the last step and
//! `cache_bytes_per_token` what one more position adds (DSA latents and indexer keys; the KDA
//! states are constant, `kda_cache_bytes`).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;
use burn::backend::{Autodiff, Flex};
use burn::module::Module;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use clap::{Parser, ValueEnum};
use glm5_burn::config::Glm5Config;
use glm5_burn::data::batch::MicroBatch;
use glm5_burn::data::loader::SplitMix64;
use glm5_burn::distributed::Distributed;
use glm5_burn::text::AttentionImpl;
use glm5_burn::train::recipe::{DecayStyle, FreezeConfig, NonFinitePolicy, Precision};
use glm5_burn::train::schedule::LrSchedule;
use glm5_burn::train::trainer::{OptimizerSettings, ParallelLayout, TrainOptions, Trainer};
use glm5_burn::{profile, ForwardOptions, Glm5Backend, Glm5ForCausalLM, ModelInput, Outputs};
use serde_json::json;

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Mode {
    Forward,
    Train,
    Both,
    /// Prefill `--seq` tokens, then decode one token per row per step with the caches.
    Decode,
}

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

/// A part a train step leaves frozen (`--freeze`).
#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Frozen {
    /// `language_model.embed_tokens` (recipe `freeze_embeddings`).
    Embeddings,
    /// `lm_head`.
    Head,
}

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Attention {
    Auto,
    Dense,
    Sparse,
}

#[derive(Parser)]
struct Args {
    /// HF config.json (nested or flat).
    #[arg(long, required_unless_present = "matmul")]
    config: Option<std::path::PathBuf>,
    /// Tokens per row (≥ 1).
    #[arg(long, required_unless_present = "matmul", default_value_t = 0)]
    seq: usize,
    /// Rows (≥ 1).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, value_enum, default_value = "both")]
    mode: Mode,
    /// Timed iterations after the warm-up (≥ 1); the median is reported.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed iterations first, so the timed ones are steady state (allocator pools filled,
    /// caches warm).
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Worker threads (rayon pool used by Flex).
    #[arg(long)]
    threads: Option<usize>,
    /// Print time per model part.
    #[arg(long)]
    profile: bool,
    /// Context parallelism for `--mode train` (built with `--features mpi`, launched with
    /// `mpirun -np N`, N the CP size): the `--seq`-token row (one document, batch 1) split into
    /// N shards; rank 0 reports (its peak RSS: the ranks hold alike).
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Train with activation checkpointing (`Autodiff<Distributed<Flex>, BalancedCheckpointing>`).
    #[arg(long)]
    checkpointing: bool,
    /// DSA attention form: `auto` (the library default: dense up to 1024 tokens, sparse
    /// above), `dense` (S×S masked, the reference's form) or `sparse` (over the selected
    /// indices).
    #[arg(long, value_enum, default_value = "auto")]
    attention: Attention,
    /// Weights and compute: `f32`, or `bf16` (forward and decode on bf16 weights, the tensors
    /// the checkpoint keeps in fp32 excepted; train with bf16 compute copies of fp32 masters,
    /// as recipe `model.dtype: bf16`).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
    /// Override a field the config has, before it is resolved, as `PATH=JSON`
    /// (`text_config.num_hidden_layers=4`, `text_config.n_routed_experts=16`); repeatable. Cuts
    /// of the release config keep its widths and vocabulary.
    #[arg(long = "set", value_name = "PATH=JSON")]
    set: Vec<String>,
    /// Under `--dtype bf16`, keep the mHC residual streams in fp32 (`true`) or round them to
    /// bf16 after every layer as HF does (`false`): `ForwardOptions::fp32_residual`, whose
    /// default this takes.
    #[arg(long, action = clap::ArgAction::Set, default_value_t = ForwardOptions::default().fp32_residual)]
    fp32_residual: bool,
    /// Parts a train step leaves frozen, comma-separated (`embeddings,head`): at the real
    /// width the two 154,880 × 4,096 matrices' fp32 AdamW state alone is 20 GB.
    #[arg(long, value_enum, value_delimiter = ',')]
    freeze: Vec<Frozen>,
    /// Instead: measure the linear layers' product (`Glm5Backend::linear_layer`, the op every
    /// projection runs through) in `--dtype` at the shapes of `MATMUL_SHAPES`, printed as
    /// `{"dtype", "gflops": {...}}` (`tests/reference/bench_matmul.py` measures PyTorch's).
    #[arg(long)]
    matmul: bool,
}

/// `(name, tokens, in, out)`: the real width at 512 tokens (`configs/glm5_3_flash.json`: FFN
/// 4,096 → 12,288 → 4,096, the KDA q/k/v projections 4,096 → 64 × 128, a routed expert's
/// gate+up at 512 · 8 / 16 rows, the LM head at vocabulary 154,880), the small bench model's
/// FFN and a square.
const MATMUL_SHAPES: [(&str, usize, usize, usize); 7] = [
    ("ffn_up 512x4096x12288", 512, 4096, 12288),
    ("ffn_down 512x12288x4096", 512, 12288, 4096),
    ("kda_qkv 512x4096x8192", 512, 4096, 8192),
    ("expert 256x4096x4096", 256, 4096, 4096),
    ("lm_head 512x4096x154880", 512, 4096, 154880),
    ("small 512x256x768", 512, 256, 768),
    ("square 2048x2048x2048", 2048, 2048, 2048),
];

/// Which product of a linear layer `bench --matmul` times.
#[derive(Clone, Copy, PartialEq)]
enum Product {
    /// `y = x·W`.
    Forward,
    /// `∂x = ∂y·Wᵀ` (the backward of a frozen or trained layer).
    GradInput,
    /// `∂W = xᵀ·∂y` (the backward of a trained layer).
    GradWeight,
}

/// GFLOP/s of Flex's linear layer (`product` of `x` `[n, k]` · `w` `[k, m]`) in `dtype`: the
/// best of timed calls after two warm-up calls, repeated for ~2 s (at least three timed calls).
fn matmul_gflops(n: usize, k: usize, m: usize, dtype: Dtype, product: Product) -> f64 {
    use burn::tensor::{Distribution, TensorPrimitive};
    let device = Default::default();
    let cast = |t: Tensor<Flex, 2>| if dtype == Dtype::Bf16 { glm5_burn::ops::backend::cast(t, burn::tensor::DType::BF16) } else { t };
    let x = cast(Tensor::<Flex, 2>::random([n, k], Distribution::Default, &device));
    let w = cast(Tensor::<Flex, 2>::random([k, m], Distribution::Default, &device));
    let g = cast(Tensor::<Flex, 2>::random([n, m], Distribution::Default, &device));
    let p = |t: &Tensor<Flex, 2>| t.clone().into_primitive().tensor();
    let call = || {
        let y = match product {
            Product::Forward => <Flex as Glm5Backend>::linear_layer(p(&x), p(&w), None),
            Product::GradInput => <Flex as Glm5Backend>::linear_layer_backward(None, Some(p(&w)), p(&g), false).0.expect("∂x"),
            Product::GradWeight => <Flex as Glm5Backend>::linear_layer_backward(Some(p(&x)), None, p(&g), false).1.expect("∂W"),
        };
        let _ = Tensor::<Flex, 2>::from_primitive(TensorPrimitive::Float(y)).slice([0..1, 0..1]).into_data();
    };
    call();
    call();
    let (mut best, mut reps, t0) = (f64::INFINITY, 0, Instant::now());
    while reps < 3 || t0.elapsed().as_secs_f64() < 2.0 {
        let t = Instant::now();
        call();
        best = best.min(t.elapsed().as_secs_f64());
        reps += 1;
    }
    2.0 * (n * k * m) as f64 / best / 1e9
}

/// `path` (an HF config.json) with the `--set PATH=JSON` overrides applied, resolved.
fn read_config(path: &std::path::Path, overrides: &[String]) -> Result<Glm5Config> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let mut json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    for o in overrides {
        let (key, value) = o.split_once('=').with_context(|| format!("--set {o}: expected PATH=JSON"))?;
        let value: serde_json::Value = serde_json::from_str(value).with_context(|| format!("--set {o}: the value is not JSON"))?;
        // only fields the config has: a misspelt key would otherwise change nothing
        let pointer = format!("/{}", key.replace('.', "/"));
        let at = json.pointer_mut(&pointer).with_context(|| format!("--set {o}: {} has no field `{key}`", path.display()))?;
        *at = value;
    }
    Glm5Config::from_hf_value(&json).with_context(|| format!("{} with {overrides:?}", path.display()))
}

/// Restarts the kernel's peak-RSS count (`VmHWM`) from the current RSS (Linux: `5` to
/// `/proc/self/clear_refs`), so a later [`peak_rss_mb`] is the peak of what ran since; false
/// where it cannot.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn peak_rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// A seeded f32 model in the benchmark's dtype.
fn weights(model: Glm5ForCausalLM<Flex>, dtype: Dtype) -> Glm5ForCausalLM<Flex> {
    match dtype {
        Dtype::F32 => model,
        Dtype::Bf16 => glm5_burn::train::params::cast_weights(model, burn::tensor::DType::BF16),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn print_profile(total: f64) {
    let mut rows: Vec<(String, f64, u64)> = profile::report().into_iter().map(|(k, d, n)| (k.to_string(), d.as_secs_f64(), n)).collect();
    rows.sort_by(|a, b| b.1.total_cmp(&a.1));
    eprintln!("  {:<34} {:>9} {:>7} {:>7}", "part (nested parts are inside their parent)", "seconds", "share", "calls");
    for (k, s, n) in rows {
        eprintln!("  {k:<34} {s:>9.3} {:>6.1}% {n:>7}", 100.0 * s / total);
    }
}

fn main() -> Result<()> {
    glm5_burn::train::alloc::keep_freed_memory();
    let a = Args::parse();
    if let Some(t) = a.threads {
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().context("rayon thread pool")?;
    }
    if a.matmul {
        // the forward at every shape; the backward's two products at the real width's
        let mut rates = serde_json::Map::new();
        for &(name, n, k, m) in &MATMUL_SHAPES {
            for (product, suffix) in [(Product::Forward, ""), (Product::GradInput, " dx"), (Product::GradWeight, " dw")] {
                if product != Product::Forward && (name.starts_with("small") || name.starts_with("square")) {
                    continue;
                }
                rates.insert(format!("{name}{suffix}"), json!((matmul_gflops(n, k, m, a.dtype, product) * 10.0).round() / 10.0));
            }
        }
        println!("{}", json!({"impl": "burn", "dtype": format!("{:?}", a.dtype).to_lowercase(), "gflops": rates}));
        return Ok(());
    }
    for (name, v) in [("--seq", a.seq), ("--batch", a.batch), ("--steps", a.steps)] {
        if v == 0 {
            bail!("{name} 0: must be at least 1");
        }
    }
    let config = read_config(a.config.as_deref().context("--config is required")?, &a.set)?;
    // active parameters per token without the input embedding (a lookup, no FLOPs); the LM
    // head is a matmul and counts
    let counts = glm5_burn::checkpoint::inventory::ParamCounts::of(&config);
    let active_non_embedding = counts.trunk_active - (config.text_config.vocab_size * config.text_config.hidden_size) as u64;
    let vocab = config.text_config.vocab_size;
    let tokens = a.batch * a.seq;
    let mut rng = SplitMix64(1);
    let ids: Vec<i64> = (0..tokens).map(|_| 1 + (rng.next_u64() % (vocab as u64 - 1)) as i64).collect();
    let threads = a.threads.unwrap_or_else(rayon::current_num_threads);
    // `before`: the process peak when VmHWM was restarted once the model existed (a bf16 model
    // is built in f32 and cast, a transient the process peak includes); the current VmHWM is
    // then the run's own peak
    let report = |mode: &str, times: Vec<f64>, before: Option<f64>| {
        let current = peak_rss_mb();
        let process = before.into_iter().chain(current).reduce(f64::max);
        let run = before.and(current);
        let (min, max) = (times.iter().copied().fold(f64::INFINITY, f64::min), times.iter().copied().fold(0.0, f64::max));
        let med = median(times);
        println!(
            "{}",
            json!({"impl": "glm5-burn-flex", "mode": mode, "tokens": tokens, "median_s": med, "min_s": min, "max_s": max,
                   "warmup": a.warmup, "dtype": format!("{:?}", a.dtype).to_lowercase(), "fp32_residual": a.fp32_residual, "tokens_per_s": tokens as f64 / med,
                   "peak_rss_mb": process, "run_peak_rss_mb": run,
                   "threads": threads, "active_non_embedding": active_non_embedding})
        );
    };
    let mut opts = ForwardOptions { fp32_residual: a.fp32_residual, ..Default::default() };
    match a.attention {
        Attention::Auto => {}
        Attention::Dense => opts.attention = AttentionImpl::Dense,
        Attention::Sparse => opts.attention = AttentionImpl::Sparse,
    }

    if matches!(a.mode, Mode::Forward | Mode::Both) {
        let device = Default::default();
        Flex::seed(&device, 0);
        let model = weights(Glm5ForCausalLM::<Flex>::try_new(&config, &device)?, a.dtype);
        let before = peak_rss_mb().filter(|_| reset_peak_rss());
        let times = timed(&a, "forward", || {
            let out = model.forward(ModelInput::new(ids.clone(), a.batch, a.seq), &opts, Outputs::default())?;
            let _: f32 = out.logits.sum().into_scalar();
            Ok(())
        })?;
        report("forward", times, before);
    }

    if a.mode == Mode::Decode {
        let device = Default::default();
        Flex::seed(&device, 0);
        let model = weights(Glm5ForCausalLM::<Flex>::try_new(&config, &device)?, a.dtype);
        let t0 = Instant::now();
        let (logits, mut cache) = model.prefill(ModelInput::new(ids.clone(), a.batch, a.seq), &opts)?;
        let greedy = |logits: Tensor<Flex, 3>| -> Vec<i64> {
            let [b, t, v] = logits.dims();
            logits.slice([0..b, t - 1..t, 0..v]).argmax(2).reshape([b]).into_data().convert::<i64>().into_vec().expect("ids")
        };
        let mut next = greedy(logits);
        let prefill_s = t0.elapsed().as_secs_f64();
        let before = cache.bytes();
        let times = timed(&a, "decode", || {
            next = greedy(model.decode_step(&next, &mut cache, &opts)?);
            Ok(())
        })?;
        let after = cache.bytes();
        let grown = (after.latent + after.indexer - before.latent - before.indexer) as f64 / (a.warmup + a.steps) as f64;
        let med = median(times.clone());
        println!(
            "{}",
            json!({"impl": "glm5-burn-flex", "mode": "decode", "prompt_tokens": tokens, "context": cache.len(), "median_s": med,
                   "min_s": times.iter().copied().fold(f64::INFINITY, f64::min), "max_s": times.iter().copied().fold(0.0, f64::max),
                   "warmup": a.warmup, "dtype": format!("{:?}", a.dtype).to_lowercase(), "fp32_residual": a.fp32_residual, "tokens_per_s": a.batch as f64 / med, "prefill_s": prefill_s,
                   "cache_bytes": after.total(), "cache_bytes_per_token": grown / a.batch as f64, "kda_cache_bytes": after.kda,
                   "peak_rss_mb": peak_rss_mb(), "threads": threads})
        );
        return Ok(());
    }

    if matches!(a.mode, Mode::Train | Mode::Both) {
        // the decorator runs `--cp`'s collectives; with one process it is Flex itself
        let times = if a.checkpointing {
            train::<Autodiff<Distributed<Flex>, BalancedCheckpointing>>(&a, &config, &ids, opts)?
        } else {
            train::<Autodiff<Distributed<Flex>>>(&a, &config, &ids, opts)?
        };
        report(if a.checkpointing { "train (activation checkpointing)" } else { "train" }, times, None);
    }
    Ok(())
}

/// Timed training steps on the autodiff backend `A`.
fn train<A: AutodiffBackend + Glm5Backend>(a: &Args, config: &Glm5Config, ids: &[i64], opts: ForwardOptions) -> Result<Vec<f64>>
where
    A::InnerBackend: Glm5Backend,
{
    let device = Default::default();
    A::seed(&device, 0);
    let mut model = Glm5ForCausalLM::<A>::try_new(config, &device)?;
    if a.freeze.contains(&Frozen::Head) {
        // a tied head is the embedding: freezing it alone would silently train it
        if model.lm_head.is_none() && !a.freeze.contains(&Frozen::Embeddings) {
            bail!("--freeze head: this config ties the LM head to the token embedding; freeze `embeddings` to freeze both");
        }
        model.lm_head = model.lm_head.map(|h| h.no_grad());
    }
    let options = TrainOptions {
        optimizer: OptimizerSettings {
            lr: LrSchedule { style: DecayStyle::Constant, lr: 1e-4, min_lr: 0.0, warmup_steps: 0, total_steps: a.warmup + a.steps },
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: None,
        },
        aux_loss_coef: 0.0,
        router_bias_update_rate: 0.0,
        precision: match a.dtype {
            Dtype::F32 => Precision::F32,
            Dtype::Bf16 => Precision::Bf16,
        },
        on_nonfinite: NonFinitePolicy::Abort,
        freeze: FreezeConfig { freeze_embeddings: a.freeze.contains(&Frozen::Embeddings), freeze_vision_tower: false, freeze_language_model: false },
        forward: opts,
        parallel: ParallelLayout::default(),
        peft: None,
    };
    let mut options = options;
    let mut micro = MicroBatch::text(ids.to_vec(), ids.to_vec(), a.batch, a.seq, None);
    if a.cp > 1 {
        if a.batch != 1 {
            bail!("--cp {} splits one row: use --batch 1", a.cp);
        }
        options.parallel.context_parallel = a.cp;
        options.parallel = options.parallel.with_world(context_group(a.cp)?)?;
        micro.documents = Some(vec![a.seq]);
    }
    let mut trainer = Trainer::<A>::try_new(model, options)?;
    let micro = [micro];
    timed(a, "train-step", || trainer.step(&micro).map(|_| ()).map_err(anyhow::Error::from))
}

/// The MPI world as the context-parallel group (it must hold `cp` processes).
#[cfg(feature = "mpi")]
fn context_group(cp: usize) -> Result<glm5_burn::distributed::Group> {
    use glm5_burn::distributed::ProcessGroup;
    let world = glm5_burn::distributed::MpiGroup::world()?;
    if world.size() != cp {
        bail!("--cp {cp} but mpirun started {} processes", world.size());
    }
    if world.rank() != 0 {
        // one report: rank 0's (the ranks hold alike)
        quiet();
    }
    Ok(std::sync::Arc::new(world))
}

#[cfg(not(feature = "mpi"))]
fn context_group(cp: usize) -> Result<glm5_burn::distributed::Group> {
    bail!("--cp {cp} needs the MPI engine: build with `--features mpi` and launch with `mpirun -np {cp}`")
}

/// Send this process's stdout to /dev/null.
#[cfg(feature = "mpi")]
fn quiet() {
    use std::os::fd::AsRawFd;
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2 onto stdout's descriptor; `null` stays open until then
        unsafe { libc::dup2(null.as_raw_fd(), libc::STDOUT_FILENO) };
    }
}

/// Warm-up plus timed iterations of `f`; profiles the timed ones when asked.
fn timed(a: &Args, what: &str, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    let mut times = Vec::new();
    profile::enable(false);
    for i in 0..a.warmup + a.steps {
        if i == a.warmup {
            profile::reset();
            profile::enable(a.profile);
        }
        let t0 = Instant::now();
        f()?;
        if i >= a.warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    profile::enable(false);
    if a.profile {
        eprintln!("{what} profile ({} iterations):", a.steps);
        print_profile(times.iter().sum());
    }
    Ok(times)
}
