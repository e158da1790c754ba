//! Mixture of experts: sigmoid router with bias-corrected, group-limited top-k selection,
//! routed clamped-SwiGLU experts computed grouped by expert, and a shared expert.
//!
//! Router (fp32; HF `Glm5NextTextTopkRouter.forward`, DeepSeek-V3 `noaux_tc`):
//!
//! ```text
//! ℓ = W_r x,  s = σ(ℓ),  ŝ = s + b  (b = e_score_correction_bias, selection only)
//! groups: score = sum of the top-2 ŝ per group; keep topk_group groups; top-k of ŝ among them
//! w_k = s[idx_k] (/ (Σ w + 1e-20) if norm_topk_prob) · routed_scaling_factor
//! y = Σ_k w_k Expert_{idx_k}(x) + Shared(x)
//! ```
//!
//! Dispatch: the selection is read back to the host, token slots are sorted by expert, each
//! expert that received tokens runs one matmul over its gathered rows, and the weighted rows
//! are scattered back with an add (HF `Glm5NextTextExperts.forward` does the same per expert).
//! Ties in the selection go to the lower expert index.
//! Routed experts always use SiLU; the shared expert uses `hidden_act` (like the reference).
//! Shapes: `x` `[B, S, D]`; stacked experts `gate_proj`, `up_proj` `[E, D, I]`,
//! `down_proj` `[E, I, D]`; router `weight` `[E, D]` (checkpoint layout).

use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::sigmoid;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};

use super::mlp::{clamped_swiglu, Mlp};
use crate::config::{Activation, TextConfig};

/// Router (`mlp.gate`).
#[derive(Module, Debug)]
pub struct Router<B: Backend> {
    /// `[E, D]`.
    pub weight: Param<Tensor<B, 2>>,
    /// `[E]`, fp32.
    pub e_score_correction_bias: Param<Tensor<B, 1>>,
    /// Experts per token.
    pub top_k: usize,
    /// Expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Renormalise the selected weights.
    pub norm_topk_prob: bool,
    /// `routed_scaling_factor`.
    pub scaling: f64,
}

/// Output of the router for `N` tokens.
pub struct Routing<B: Backend> {
    /// `[N, E]` fp32 router logits (for the load-balancing loss).
    pub logits: Tensor<B, 2>,
    /// `[N, K]` combine weights (fp32).
    pub weights: Tensor<B, 2>,
    /// `[N·K]` selected expert per slot, row-major.
    pub experts: Vec<usize>,
}

impl<B: Backend> Router<B> {
    /// Selection of `top_k` experts for each row of `choice` (`[N, E]` host, row-major).
    pub fn select(&self, choice: &[f32], n: usize, e: usize) -> Vec<usize> {
        let per_group = e / self.n_group;
        let mut out = Vec::with_capacity(n * self.top_k);
        let mut order: Vec<usize> = Vec::with_capacity(e);
        for row in choice.chunks(e).take(n) {
            let by_score = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
            let mut allowed = vec![true; e];
            if self.n_group > 1 {
                let mut gscore: Vec<(f32, usize)> = (0..self.n_group)
                    .map(|g| {
                        let mut s: Vec<f32> = row[g * per_group..(g + 1) * per_group].to_vec();
                        s.sort_by(|a, b| b.total_cmp(a));
                        (s.iter().take(2).sum(), g)
                    })
                    .collect();
                gscore.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let kept: Vec<usize> = gscore.iter().take(self.topk_group).map(|x| x.1).collect();
                for (x, a) in allowed.iter_mut().enumerate() {
                    *a = kept.contains(&(x / per_group));
                }
            }
            order.clear();
            order.extend((0..e).filter(|&x| allowed[x]));
            order.sort_by(by_score);
            out.extend(order.iter().take(self.top_k));
        }
        out
    }

    /// Route `x` `[N, D]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Routing<B> {
        let _t = crate::profile::scope("moe router");
        let [n, _] = x.dims();
        let e = self.weight.dims()[0];
        let device = x.device();
        let logits = x.cast(DType::F32).matmul(self.weight.val().cast(DType::F32).transpose());
        let scores = sigmoid(logits.clone());
        let choice = scores.clone().detach() + self.e_score_correction_bias.val().cast(DType::F32).detach().unsqueeze();
        let choice_host: Vec<f32> = choice.into_data().convert::<f32>().into_vec().expect("router scores are f32");
        let experts = self.select(&choice_host, n, e);
        let idx: Vec<i64> = experts.iter().map(|&x| x as i64).collect();
        let idx = Tensor::<B, 2, Int>::from_data(TensorData::new(idx, [n, self.top_k]), &device);
        let mut weights = scores.gather(1, idx);
        if self.norm_topk_prob {
            weights = weights.clone() / (weights.sum_dim(1) + 1e-20);
        }
        Routing { logits, weights: weights * self.scaling, experts }
    }
}

/// Routed experts stored stacked (`mlp.experts.*` in the checkpoint, one tensor per expert).
#[derive(Module, Debug)]
pub struct Experts<B: Backend> {
    /// `[E, D, I]`.
    pub gate_proj: Param<Tensor<B, 3>>,
    /// `[E, D, I]`.
    pub up_proj: Param<Tensor<B, 3>>,
    /// `[E, I, D]`.
    pub down_proj: Param<Tensor<B, 3>>,
    /// SwiGLU clamp limit.
    pub limit: f64,
}

impl<B: Backend> Experts<B> {
    /// `x` `[N, D]`, routing of those rows → `[N, D]`.
    pub fn forward(&self, x: Tensor<B, 2>, routing: &Routing<B>) -> Tensor<B, 2>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let _t = crate::profile::scope("moe routed experts");
        let [n, d] = x.dims();
        let [e, _, i] = self.gate_proj.dims();
        let k = routing.experts.len() / n.max(1);
        let device = x.device();
        // slots sorted by expert (stable: token order inside an expert)
        let mut slots: Vec<usize> = (0..n * k).collect();
        slots.sort_by_key(|&s| routing.experts[s]);
        let tokens: Vec<i64> = slots.iter().map(|&s| (s / k) as i64).collect();
        let slot_ids: Vec<i64> = slots.iter().map(|&s| s as i64).collect();
        let tok_t = Tensor::<B, 1, Int>::from_data(TensorData::new(tokens.clone(), [n * k]), &device);
        let slot_t = Tensor::<B, 1, Int>::from_data(TensorData::new(slot_ids, [n * k]), &device);
        let mut counts = vec![0usize; e];
        for &s in &slots {
            counts[routing.experts[s]] += 1;
        }
        let cap = counts.iter().copied().max().unwrap_or(0);

        let y = if e * cap <= 2 * n * k {
            // Near-balanced routing: every expert's rows padded to the largest group and run as
            // one batched matmul per projection, [E, cap, D] × [E, D, I]. The padding rows are
            // zeros (a zero row appended to x) and are never read back. The weights' gradients
            // come out whole, instead of one full-size zero tensor per expert slice.
            let mut src = vec![n as i64; e * cap]; // row of x (n = the zero row)
            let mut back = Vec::with_capacity(n * k); // padded row of each sorted slot
            let mut start = 0;
            for (ex, &c) in counts.iter().enumerate() {
                for r in 0..c {
                    src[ex * cap + r] = tokens[start + r];
                    back.push((ex * cap + r) as i64);
                }
                start += c;
            }
            let src = Tensor::<B, 1, Int>::from_data(TensorData::new(src, [e * cap]), &device);
            let back = Tensor::<B, 1, Int>::from_data(TensorData::new(back, [n * k]), &device);
            let x_pad = Tensor::cat(vec![x.clone(), Tensor::zeros([1, d], (&device, x.dtype()))], 0);
            let rows = x_pad.select(0, src).reshape([e, cap, d]);
            let gate = rows.clone().matmul(self.gate_proj.val());
            let up = rows.matmul(self.up_proj.val());
            let h = clamped_swiglu(gate, up, self.limit, Activation::Silu);
            h.matmul(self.down_proj.val()).reshape([e * cap, d]).select(0, back)
        // [N·K, D]
        } else {
            // skewed routing: one group at a time, so padding never multiplies the work
            let xs = x.clone().select(0, tok_t.clone()); // [N·K, D]
            let mut outs = Vec::new();
            let mut start = 0;
            for (ex, &count) in counts.iter().enumerate() {
                if count == 0 {
                    continue;
                }
                let rows = xs.clone().slice([start..start + count, 0..d]);
                let gate = rows.clone().matmul(self.gate_proj.val().slice([ex..ex + 1, 0..d, 0..i]).reshape([d, i]));
                let up = rows.matmul(self.up_proj.val().slice([ex..ex + 1, 0..d, 0..i]).reshape([d, i]));
                let h = clamped_swiglu(gate, up, self.limit, Activation::Silu);
                outs.push(h.matmul(self.down_proj.val().slice([ex..ex + 1, 0..i, 0..d]).reshape([i, d])));
                start += count;
            }
            Tensor::cat(outs, 0) // [N·K, D]
        };
        let w = routing.weights.clone().reshape([n * k]).select(0, slot_t).cast(y.dtype()).unsqueeze_dim(1);
        Tensor::zeros([n, d], (&device, x.dtype())).select_assign(0, tok_t, y * w, IndexingUpdateOp::Add)
    }
}

impl<B: AutodiffBackend> Router<B> {
    /// Aux-loss-free balancing (DeepSeek-V3), once per optimizer step: count the tokens each
    /// expert was selected for in `batches` (router logits `[N·E]` and the tokens' validity, per
    /// micro-batch), choosing with the current bias as routing does, and move the bias by
    /// `rate` toward the mean load: `b_e += rate · sign(mean − load_e)`. No gradient is
    /// involved; the bias keeps its `require_grad` flag.
    pub fn update_bias(&mut self, batches: &[(&[f32], &[bool])], rate: f64) {
        let e = self.weight.dims()[0];
        let bias: Vec<f32> = self.e_score_correction_bias.val().into_data().convert::<f32>().into_vec().unwrap_or_default();
        let mut load = vec![0f64; e];
        for &(logits, valid) in batches {
            let choice: Vec<f32> =
                logits.iter().enumerate().map(|(i, &l)| 1.0 / (1.0 + (-l).exp()) + bias.get(i % e).copied().unwrap_or(0.0)).collect();
            let n = logits.len() / e;
            for (r, experts) in self.select(&choice, n, e).chunks(self.top_k).enumerate() {
                if valid.get(r).copied().unwrap_or(true) {
                    for &x in experts {
                        load[x] += 1.0;
                    }
                }
            }
        }
        let mean = load.iter().sum::<f64>() / e as f64;
        let delta: Vec<f32> = load
            .iter()
            .map(|&l| {
                if l < mean {
                    rate as f32
                } else if l > mean {
                    -rate as f32
                } else {
                    0.0
                }
            })
            .collect();
        let device = self.e_score_correction_bias.device();
        let d = Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(delta, [e]), &device);
        self.e_score_correction_bias = self.e_score_correction_bias.clone().map(|t| {
            let grad = t.is_require_grad();
            let t = Tensor::<B, 1>::from_inner(t.inner() + d.cast(DType::F32));
            if grad {
                t.require_grad()
            } else {
                t
            }
        });
    }
}

/// MoE block (`mlp` of a sparse layer).
#[derive(Module, Debug)]
pub struct Moe<B: Backend> {
    /// The router (`gate`).
    pub gate: Router<B>,
    /// The routed experts, stacked.
    pub experts: Experts<B>,
    /// The shared expert(s).
    pub shared_experts: Mlp<B>,
}

impl<B: Backend> Moe<B> {
    /// Random init with the shapes of `c`.
    pub fn new(c: &TextConfig, device: &B::Device) -> Self {
        let (e, d, i) = (c.n_routed_experts, c.hidden_size, c.moe_intermediate_size);
        let std = Initializer::Normal { mean: 0.0, std: c.initializer_range };
        Self {
            gate: Router {
                weight: std.init([e, d], device),
                e_score_correction_bias: Initializer::Zeros.init([e], device),
                top_k: c.num_experts_per_tok,
                n_group: c.n_group,
                topk_group: c.topk_group,
                norm_topk_prob: c.norm_topk_prob,
                scaling: c.routed_scaling_factor,
            },
            experts: Experts {
                gate_proj: std.init([e, d, i], device),
                up_proj: std.init([e, d, i], device),
                down_proj: std.init([e, i, d], device),
                limit: c.swiglu_limit,
            },
            shared_experts: Mlp::new(d, i * c.n_shared_experts, c.hidden_act, c.swiglu_limit, device),
        }
    }

    /// `x` `[B, S, D]` → (`[B, S, D]`, router logits `[B·S, E]`).
    pub fn forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 2>)
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let [b, s, d] = x.dims();
        let flat = x.clone().reshape([b * s, d]);
        let routing = self.gate.forward(flat.clone());
        let routed = self.experts.forward(flat, &routing).reshape([b, s, d]);
        (routed + self.shared_experts.forward(x), routing.logits)
    }
}
