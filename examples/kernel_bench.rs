//! Each custom op against its reference path on the same backend, at growing sequence length.
//!
//! ```text
//! cargo run --release --features vulkan --example kernel_bench -- --backend vulkan \
//!     [--seqs 512,2048,8192] [--heads 8] [--dim 64] [--reps 3] [--ops kda,kpool,sparse]
//! cargo run --release --features cuda --example kernel_bench -- --backend cuda --heads 64 --dim 128 \
//!     --seqs 2048,4096,16384 --latent 512 --topk 2048
//! ```
//!
//! One JSON line per (op, path, pass, seq): `{"backend", "op", "path", "pass", "seq",
//! "median_ms", "tokens_per_s", "gflop_per_s"}`. Paths: `kernel` (the backend's op: CubeCL
//! kernels on `vulkan`/`cuda`, fused loops for KDA on `flex`) and `reference` (the pure tensor-op
//! path, run by the same backend). Passes: `fwd`, and `fwd+bwd` (`Autodiff<B>`, backward of
//! Σ out ⊙ w) for KDA and sparse attention; the indexer is forward only. KDA also reports
//! `scan_op`: the whole scan as one op with its hand-written backward (`ops::kda_scan`,
//! which recomputes the forward's intermediates in the backward).
//!
//! FLOP counts (multiply-add = 2):
//! * KDA (`ops::kda::kda_chunked`, chunk C = 64, per token and head, nominal): pair terms
//!   `2·C·d` (L and P over the causal half), `2·C·2d` (W, U), `2·C·d` (P V'), `8·d²` (W S,
//!   Q S, state update); the reference path's in-chunk inverse (`⌈log₂C⌉` C×C products; the
//!   kernel path solves instead) is not counted.
//! * KPool indexer: `2·S·P·H_I·d_I` with `P = S / kpool` (scoring; selection is integer work).
//! * KPool pooled keys (`kpool_compress`): memory-bound, reported in bytes moved (`gbyte_per_s`):
//!   `4·(2·S·d_I + P·d_I)` (keys and gate logits read once, pooled keys written).
//! * Sparse attention (absorbed MLA core): `4·S·H·W·R` (scores and weighted sum), `W =
//!   min(topk, S)`; backward counted as 2× forward.
//!
//! The reference paths run as the model runs them where their memory would otherwise exceed a
//! device buffer: sparse attention in query blocks of 256, KDA's gathered pair terms in blocks
//! of chunks (`ops::kda_pairs`), and here the indexer's dense scores in query blocks.
//!
//! Each measurement is the median of `--reps` runs after one warm-up (which also compiles the
//! shaders), with a device sync before the clock stops.

use std::time::Instant;

use anyhow::{bail, Result};
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor, TensorData, TensorPrimitive};
use clap::Parser;
use glm5_burn::ops::backend::sparse_latent_attention;
use glm5_burn::ops::kda::{kda_chunked, kda_chunked_op, KdaInputs};
use glm5_burn::ops::kpool::{reference_compress, reference_scores, KpoolSelect};
use glm5_burn::ops::sparse_attn::latent_reference;
use glm5_burn::{Glm5Backend, PathKind};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// flex | vulkan (feature `vulkan`) | cuda (feature `cuda`).
    #[arg(long, default_value = "flex")]
    backend: String,
    #[arg(long, value_delimiter = ',', default_value = "512,2048,8192")]
    seqs: Vec<usize>,
    /// KDA heads and head dim.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    #[arg(long, default_value_t = 64)]
    dim: usize,
    /// Sparse attention: query heads, latent width, selected entries per query.
    #[arg(long, default_value_t = 8)]
    attn_heads: usize,
    #[arg(long, default_value_t = 128)]
    latent: usize,
    #[arg(long, default_value_t = 256)]
    topk: usize,
    /// Indexer: heads, head dim, pool size.
    #[arg(long, default_value_t = 4)]
    index_heads: usize,
    #[arg(long, default_value_t = 32)]
    index_dim: usize,
    #[arg(long, default_value_t = 4)]
    kpool: usize,
    #[arg(long, default_value_t = 3)]
    reps: usize,
    #[arg(long, value_delimiter = ',', default_value = "kda,kpool,sparse")]
    ops: Vec<String>,
}

fn median_ms<B: Backend>(device: &B::Device, reps: usize, mut f: impl FnMut()) -> f64 {
    let sync = || B::sync(device).unwrap_or_else(|e| panic!("device error during the benchmark: {e:?}"));
    f();
    sync();
    let mut times: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t0 = Instant::now();
            f();
            sync();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// The work a measurement did: floating-point operations, or bytes moved for a memory-bound op.
enum Work {
    Flop(f64),
    Bytes(f64),
}

fn path_name(path: PathKind) -> &'static str {
    match path {
        PathKind::Op => "kernel",
        PathKind::Reference => "reference",
    }
}

fn emit(backend: &str, op: &str, path: &str, pass: &str, seq: usize, ms: f64, work: Work) {
    let mut line = json!({"backend": backend, "op": op, "path": path, "pass": pass, "seq": seq, "median_ms": (ms * 100.0).round() / 100.0,
                          "tokens_per_s": (seq as f64 / (ms / 1e3)).round()});
    let (key, amount) = match work {
        Work::Flop(f) => ("gflop_per_s", f),
        Work::Bytes(b) => ("gbyte_per_s", b),
    };
    line[key] = json!(((amount / (ms / 1e3) / 1e9) * 100.0).round() / 100.0);
    println!("{line}");
}

fn kda<B: Glm5Backend>(a: &Args, name: &str, device: &B::Device) {
    let (h, d) = (a.heads, a.dim);
    for &s in &a.seqs {
        let flop = (s * h) as f64 * (2.0 * 64.0 * d as f64 * 4.0 + 8.0 * (d * d) as f64);
        let rand = |shape: [usize; 4], dist| Tensor::<Autodiff<B>, 4>::random(shape, dist, device);
        let q = rand([1, s, h, d], Distribution::Normal(0.0, 1.0));
        let k = rand([1, s, h, d], Distribution::Normal(0.0, 1.0));
        let v = rand([1, s, h, d], Distribution::Normal(0.0, 1.0));
        let g = rand([1, s, h, d], Distribution::Uniform(-0.5, 0.0));
        let beta = Tensor::<Autodiff<B>, 3>::random([1, s, h], Distribution::Uniform(0.0, 1.0), device);
        let wts = rand([1, s, h, d], Distribution::Normal(0.0, 1.0));
        for path in [PathKind::Op, PathKind::Reference] {
            let inner = |t: &Tensor<Autodiff<B>, 4>| t.clone().inner();
            let ms = median_ms::<B>(device, a.reps, || {
                let x = KdaInputs { q: inner(&q), k: inner(&k), v: inner(&v), g: inner(&g), beta: beta.clone().inner(), initial_state: None };
                let (o, _) = kda_chunked::<B>(x, 64, path);
                drop(o);
            });
            emit(name, "kda_chunked", path_name(path), "fwd", s, ms, Work::Flop(flop));
            let ms = median_ms::<B>(device, a.reps, || {
                let [q, k, v] = [&q, &k, &v].map(|t| t.clone().require_grad());
                let (o, _) = kda_chunked(KdaInputs { q: q.clone(), k, v, g: g.clone(), beta: beta.clone(), initial_state: None }, 64, path);
                let grads = (o * wts.clone()).sum().backward();
                drop(q.grad(&grads));
            });
            emit(name, "kda_chunked", path_name(path), "fwd+bwd", s, ms, Work::Flop(3.0 * flop));
        }
        // the whole scan as one op with its hand-written backward (`ops::kda_scan`)
        let ms = median_ms::<B>(device, a.reps, || {
            let [q, k, v] = [&q, &k, &v].map(|t| t.clone().require_grad());
            let (o, _) = kda_chunked_op(KdaInputs { q: q.clone(), k, v, g: g.clone(), beta: beta.clone(), initial_state: None }, 64);
            let grads = (o * wts.clone()).sum().backward();
            drop(q.grad(&grads));
        });
        emit(name, "kda_chunked", "scan_op", "fwd+bwd", s, ms, Work::Flop(3.0 * flop));
    }
}

fn kpool<B: Glm5Backend>(a: &Args, name: &str, device: &B::Device) {
    let (h, d, kp) = (a.index_heads, a.index_dim, a.kpool);
    for &s in &a.seqs {
        let p = s.div_ceil(kp);
        let flop = 2.0 * (s * p * h * d) as f64;
        let q = Tensor::<B, 4>::random([1, s, h, d], Distribution::Normal(0.0, 1.0), device);
        let w = Tensor::<B, 3>::random([1, s, h], Distribution::Normal(0.0, 1.0), device);
        let pooled = Tensor::<B, 3>::random([1, p, d], Distribution::Normal(0.0, 1.0), device);
        let mask = vec![true; s];
        // pooled keys: k, gate [1, S, d] → [1, P, d], memory-bound (reads 2·S·d, writes P·d)
        let k = Tensor::<B, 3>::random([1, s, d], Distribution::Normal(0.0, 1.0), device);
        let gate = Tensor::<B, 3>::random([1, s, d], Distribution::Normal(0.0, 1.0), device);
        let ape = Tensor::<B, 2>::random([kp, d], Distribution::Normal(0.0, 1.0), device);
        let bytes = 4.0 * (2 * s * d + p * d) as f64;
        for path in [PathKind::Op, PathKind::Reference] {
            let ms = median_ms::<B>(device, a.reps, || {
                let out = if path == PathKind::Op {
                    let prim = |t: Tensor<B, 3>| t.into_primitive().tensor();
                    Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(B::kpool_compress(
                        prim(k.clone()),
                        prim(gate.clone()),
                        ape.clone().into_primitive().tensor(),
                        &[0],
                    )))
                } else {
                    reference_compress(k.clone(), gate.clone(), ape.clone(), &[0])
                };
                drop(out);
            });
            emit(name, "kpool_compress", path_name(path), "fwd", s, ms, Work::Bytes(bytes));
        }
        let sel = KpoolSelect { kpool: kp, index_topk: a.topk, always_select_tail: true };
        let scale = (d as f32).powf(-0.5);
        for path in [PathKind::Op, PathKind::Reference] {
            let ms = median_ms::<B>(device, a.reps, || {
                let out = if path == PathKind::Op {
                    let prim = |t: Tensor<B, 3>| t.into_primitive().tensor();
                    B::kpool_select(q.clone().into_primitive().tensor(), prim(w.clone()), prim(pooled.clone()), &mask, sel, scale)
                } else {
                    // dense scores in query blocks (a [S·H, P] matmul at once exceeds lavapipe's
                    // 128 MiB buffers at 8192), then the host selection on all of them
                    let block = (1usize << 22) / (h * p).max(1);
                    let mut scores = Vec::with_capacity(s * p);
                    for lo in (0..s).step_by(block.max(1)) {
                        let hi = (lo + block.max(1)).min(s);
                        let part = reference_scores(
                            q.clone().slice([0..1, lo..hi, 0..h, 0..d]),
                            w.clone().slice([0..1, lo..hi, 0..h]),
                            pooled.clone(),
                            scale,
                        );
                        scores.extend(part.into_data().convert::<f32>().into_vec::<f32>().expect("f32 scores"));
                    }
                    (sel.select(&scores, &mask, 1, s), sel.boundary_margin(&scores, &mask, 1, s))
                };
                drop(out);
            });
            emit(name, "kpool_indexer", path_name(path), "fwd", s, ms, Work::Flop(flop));
        }
    }
}

fn sparse<B: Glm5Backend>(a: &Args, name: &str, device: &B::Device) {
    let (h, r) = (a.attn_heads, a.latent);
    for &s in &a.seqs {
        let w = a.topk.min(s);
        let flop = 4.0 * (s * h * w * r) as f64;
        // causal-style index rows: query t selects w of the tokens ≤ t (−1 where fewer exist)
        let mut rows = Vec::with_capacity(s * w);
        for t in 0..s {
            for j in 0..w {
                rows.push(if j <= t { ((t - j) * 7919 % (t + 1)) as i64 } else { -1 });
            }
        }
        let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(rows, [s, w]), device);
        let q = Tensor::<Autodiff<B>, 3>::random([s, h, r], Distribution::Normal(0.0, 0.1), device);
        let kv = Tensor::<Autodiff<B>, 2>::random([s, r], Distribution::Normal(0.0, 1.0), device);
        let wts = Tensor::<Autodiff<B>, 3>::random([s, h, r], Distribution::Normal(0.0, 1.0), device);
        let scale = (r as f32).powf(-0.5);
        // in query blocks of 256, as the model runs it (`ForwardOptions::sparse_block`): bounds
        // the [block, H, W] scores and the reference's [block, W, R] gather
        let block = 256;
        let attend = |path: PathKind, q: Tensor<Autodiff<B>, 3>, kv: Tensor<Autodiff<B>, 2>| {
            let outs: Vec<Tensor<Autodiff<B>, 3>> = (0..s)
                .step_by(block)
                .map(|lo| {
                    let hi = (lo + block).min(s);
                    let qb = q.clone().slice([lo..hi, 0..h, 0..r]);
                    let ib = Tensor::<Autodiff<B>, 2, Int>::from_inner(idx.clone().slice([lo..hi, 0..w]));
                    match path {
                        PathKind::Op => sparse_latent_attention(qb, kv.clone(), ib, scale).0,
                        PathKind::Reference => latent_reference(qb, kv.clone(), ib, scale).0,
                    }
                })
                .collect();
            Tensor::cat(outs, 0)
        };
        for path in [PathKind::Op, PathKind::Reference] {
            let ms = median_ms::<B>(device, a.reps, || drop(attend(path, q.clone(), kv.clone())));
            emit(name, "sparse_attention", path_name(path), "fwd", s, ms, Work::Flop(flop));
            let ms = median_ms::<B>(device, a.reps, || {
                let (qg, kvg) = (q.clone().require_grad(), kv.clone().require_grad());
                let grads = (attend(path, qg.clone(), kvg) * wts.clone()).sum().backward();
                drop(qg.grad(&grads));
            });
            emit(name, "sparse_attention", path_name(path), "fwd+bwd", s, ms, Work::Flop(3.0 * flop));
        }
    }
}

fn run<B: Glm5Backend>(a: &Args, name: &str) {
    let device = B::Device::default();
    for op in &a.ops {
        match op.as_str() {
            "kda" => kda::<B>(a, name, &device),
            "kpool" => kpool::<B>(a, name, &device),
            "sparse" => sparse::<B>(a, name, &device),
            other => eprintln!("unknown op `{other}` (kda, kpool, sparse)"),
        }
    }
}

fn main() -> Result<()> {
    let a = Args::parse();
    match a.backend.as_str() {
        "flex" => run::<Flex>(&a, "flex"),
        #[cfg(feature = "vulkan")]
        "vulkan" => run::<burn::backend::Vulkan>(&a, "vulkan"),
        #[cfg(feature = "cuda")]
        "cuda" => run::<burn::backend::Cuda>(&a, "cuda"),
        other => bail!("backend `{other}` is not available in this build (features: vulkan, cuda)"),
    }
    Ok(())
}
