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
//! projection runs as one grouped product of every expert's gathered rows with its weight
//! (`ops::grouped_matmul`), and the weighted rows
//! are scattered back with an add (HF `Glm5NextTextExperts.forward` does the same per expert).
//!
//! Expert parallelism ([`ExpertParallel`], `distributed.ep_size = P`): rank `r` of the expert
//! group holds experts `r·E/P .. (r+1)·E/P`. The layer's one seam is route → dispatch → local
//! grouped experts → combine: each (token, expert) slot's row is sent to the rank holding the
//! expert (`all_to_all_v`, counts exchanged first — Megatron's all-to-all dispatcher, one row
//! per slot), the received rows run through the local experts, the results come back by the
//! reverse `all_to_all_v`, and the source applies the weights and sums. Dropless: any
//! imbalance works, a rank may receive nothing. Gradients flow through both exchanges (the
//! adjoint of an all-to-all is the all-to-all with the counts swapped).
//! Ties in the selection go to the lower expert index.
//! Routed experts always use SiLU; the shared expert uses `hidden_act` (like the reference).
//! Shapes: `x` `[B, S, D]`; stacked experts `gate_proj`, `up_proj` `[E, D, I]`,
//! `down_proj` `[E, I, D]`; router `weight` `[E, D]` (checkpoint layout).

use crate::ops::backend::ToDtype;
use burn::module::{Initializer, Module, Param};
use burn::tensor::activation::sigmoid;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData};

use super::fp8_weight::Fp8Experts;
use super::lora::ExpertLora;
use super::mlp::{clamped_swiglu, Mlp};
use crate::config::{Activation, TextConfig};
use crate::distributed::{typed, Group};
use crate::ops::backend::{fp8_grouped_matmul, fp8_grouped_matmul_refetched, grouped_matmul};
use crate::ops::collective::all_to_all_rows;

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
    /// `[E, D, I]`; `None` when the experts' base is held in FP8 (`fp8`).
    pub gate_proj: Option<Param<Tensor<B, 3>>>,
    /// `[E, D, I]`; `None` with `fp8`.
    pub up_proj: Option<Param<Tensor<B, 3>>>,
    /// `[E, I, D]`; `None` with `fp8`.
    pub down_proj: Option<Param<Tensor<B, 3>>>,
    /// The experts' frozen base in FP8 E4M3 with block scales, instead of the three stacks
    /// ([`crate::checkpoint::LoadOptions::fp8_base`]).
    pub fp8: Option<Fp8Experts<B>>,
    /// SwiGLU clamp limit.
    pub limit: f64,
    /// LoRA on the fused `gate_up_proj` (HF `[E, 2I, D]`): stacks `[E, D, r]`, `[E, r, 2I]`,
    /// gate columns first (PEFT `target_parameters`).
    pub lora_gate_up: Option<ExpertLora<B>>,
    /// LoRA on `down_proj`: stacks `[E, I, r]`, `[E, r, D]`.
    pub lora_down: Option<ExpertLora<B>>,
    /// Set under expert parallelism: the stacks hold this rank's `E/P` experts only, and
    /// tokens travel to the ranks of their experts. Not part of the checkpoint.
    #[module(skip)]
    pub parallel: Option<std::sync::Arc<ExpertParallel>>,
}

/// Expert parallelism of a MoE layer: the group whose ranks split the routed experts in
/// contiguous equal ranges (rank `r` holds `r·E/P .. (r+1)·E/P`).
#[derive(Debug, Clone)]
pub struct ExpertParallel {
    /// The expert-parallel group (size `P = distributed.ep_size`).
    pub group: Group,
    /// Routed experts of the whole layer `E` (a multiple of `P`).
    pub n_experts: usize,
    /// What this rank's exchanges moved (shared by the layers of one plan).
    pub stats: std::sync::Arc<ExchangeStats>,
}

/// Bytes a rank sent to the other ranks of its expert-parallel group through the MoE layers'
/// forward exchanges (the backward sends as much again: the adjoint exchanges with the counts
/// swapped), and the layer calls that sent them.
#[derive(Debug, Default)]
pub struct ExchangeStats {
    /// Routed rows sent to other ranks' experts (dispatch).
    pub dispatch_bytes: std::sync::atomic::AtomicU64,
    /// Expert outputs sent back to their tokens' ranks (combine).
    pub combine_bytes: std::sync::atomic::AtomicU64,
    /// Routed (token, expert) rows this rank dispatched, its own experts' included.
    pub rows: std::sync::atomic::AtomicU64,
    /// MoE layer forwards.
    pub calls: std::sync::atomic::AtomicU64,
}

impl ExpertParallel {
    /// `E / P` experts per rank; an error naming both when `P` does not divide `E`.
    pub fn new(group: Group, n_experts: usize) -> Result<Self, crate::distributed::DistError> {
        let p = group.size();
        if p == 0 || !n_experts.is_multiple_of(p) {
            return Err(crate::distributed::DistError::Counts {
                op: "expert parallelism",
                message: format!("ep_size {p} does not divide n_routed_experts {n_experts}"),
            });
        }
        Ok(Self { group, n_experts, stats: Default::default() })
    }

    /// Experts per rank.
    pub fn local_experts(&self) -> usize {
        self.n_experts / self.group.size()
    }

    /// The global index of this rank's first expert.
    pub fn first_expert(&self) -> usize {
        self.group.rank() * self.local_experts()
    }
}

/// One of the experts' three projections.
#[derive(Clone, Copy)]
enum Proj {
    Gate,
    Up,
    Down,
}

const NO_EXPERT_WEIGHTS: &str = "routed experts with neither dense stacks nor an FP8 base (built by hand without them)";

impl<B: Backend> Experts<B> {
    /// `[E, D, I]`: the experts held, the hidden size and one expert's intermediate width.
    pub fn dims(&self) -> [usize; 3] {
        match (&self.gate_proj, &self.fp8) {
            // the shape without initialising a lazy stack (a load replacing it by FP8 asks)
            (Some(g), _) => g.lazy_shape().dims::<3>(),
            (None, Some(q)) => {
                let [e, i, d] = q.gate_proj.codes.dims();
                [e, d, i]
            }
            (None, None) => panic!("{NO_EXPERT_WEIGHTS}"),
        }
    }

    /// Replace an FP8 base by dense f32 stacks (frozen), for merging adapters into it; dense
    /// experts stay as they are.
    pub fn dequantize_base(&mut self) {
        use burn::tensor::DType;
        if let Some(q) = self.fp8.take() {
            let dense = |s: &super::fp8_weight::Fp8Stack<B>| Some(Param::initialized(burn::module::ParamId::new(), s.dequantize(DType::F32)));
            self.gate_proj = dense(&q.gate_proj);
            self.up_proj = dense(&q.up_proj);
            self.down_proj = dense(&q.down_proj);
        }
    }

    /// The base product of projection `p` on rows grouped by expert (`sizes`): the dense
    /// stack through [`grouped_matmul`], or the FP8 stack through [`fp8_grouped_matmul`].
    fn product(&self, p: Proj, x: Tensor<B, 2>, sizes: &[usize]) -> Tensor<B, 2>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let dense = match p {
            Proj::Gate => &self.gate_proj,
            Proj::Up => &self.up_proj,
            Proj::Down => &self.down_proj,
        };
        match (dense, &self.fp8) {
            (Some(w), _) => grouped_matmul(x, w.val(), sizes),
            (None, Some(q)) => {
                let stack = match p {
                    Proj::Gate => &q.gate_proj,
                    Proj::Up => &q.up_proj,
                    Proj::Down => &q.down_proj,
                };
                match stack.refetch.as_ref().and_then(|r| r.get::<B>()) {
                    None => fp8_grouped_matmul(x, stack.codes.clone(), stack.scale_inv.clone(), stack.block(), sizes),
                    // a gathered FSDP slice freed after the layer's forward: re-gathered for backward
                    Some(r) => fp8_grouped_matmul_refetched(x, stack.codes.clone(), stack.scale_inv.clone(), stack.block(), sizes, r),
                }
            }
            (None, None) => panic!("{NO_EXPERT_WEIGHTS}"),
        }
    }

    /// `x` `[N, D]`, routing of those rows → `[N, D]`: `Σ_k w_k Expert_{idx_k}(x)` per row,
    /// over this rank's experts or, under expert parallelism, over every rank's.
    pub fn forward(&self, x: Tensor<B, 2>, routing: &Routing<B>) -> Tensor<B, 2>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let _t = crate::profile::scope("moe routed experts");
        let [n, d] = x.dims();
        let k = routing.experts.len() / n.max(1);
        let device = x.device();
        let (y, order) = match &self.parallel {
            None => {
                let held = self.dims()[0];
                assert!(
                    routing.experts.iter().all(|&x| x < held),
                    "this MoE layer holds {held} routed experts (an expert-parallel rank's share) and has no expert-parallel group: set Experts::parallel before running it"
                );
                // every slot, in slot order: row = token s / k, expert = its selection
                let tokens: Vec<i64> = (0..n * k).map(|s| (s / k) as i64).collect();
                (self.grouped(x.clone(), &tokens, &routing.experts), None)
            }
            Some(ep) => {
                let (y, order) = self.dispatch_combine(x.clone(), routing, ep);
                (y, Some(order))
            }
        };
        // y holds slot `order[j]` in row j (slot order when `order` is None)
        let slots: Vec<i64> = match &order {
            Some(o) => o.iter().map(|&s| s as i64).collect(),
            None => (0..(n * k) as i64).collect(),
        };
        let tokens: Vec<i64> = slots.iter().map(|&s| s / k as i64).collect();
        let tok_t = Tensor::<B, 1, Int>::from_data(TensorData::new(tokens, [n * k]), &device);
        let w = routing.weights.clone().reshape([n * k]);
        let w = match order {
            Some(_) => w.select(0, Tensor::<B, 1, Int>::from_data(TensorData::new(slots, [n * k]), &device)),
            None => w,
        };
        // HF weights each expert's output in fp32, rounds it, and adds the k rounded rows in the
        // activation dtype (`index_add_`); here the k weighted rows are summed in fp32 and the
        // sum rounded once
        let dtype = x.dtype();
        let weighted = y.to_dtype(DType::F32) * w.unsqueeze_dim(1);
        Tensor::zeros([n, d], (&device, DType::F32)).select_assign(0, tok_t, weighted, IndexingUpdateOp::Add).to_dtype(dtype)
    }

    /// The local experts on rows: row `j` is `x[src[j]]`, computed with (local) expert
    /// `expert[j]`; returns `[M, D]` in that row order. Rows are sorted by expert (stably) and
    /// each projection is one grouped product over the experts' row groups
    /// ([`grouped_matmul`]: no padding to the largest group, one whole weight gradient).
    fn grouped(&self, x: Tensor<B, 2>, src: &[i64], expert: &[usize]) -> Tensor<B, 2>
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let m = src.len();
        let e = self.dims()[0];
        let device = x.device();
        let mut order: Vec<usize> = (0..m).collect();
        order.sort_by_key(|&r| expert[r]);
        let mut sizes = vec![0usize; e];
        for &x in expert {
            sizes[x] += 1;
        }
        let sorted_src: Vec<i64> = order.iter().map(|&r| src[r]).collect();
        let rows = x.select(0, Tensor::<B, 1, Int>::from_data(TensorData::new(sorted_src, [m]), &device)); // [M, D] by expert
                                                                                                           // the inputs are kept for the adapters only when there are any
        let lora_in = self.lora_gate_up.as_ref().map(|_| rows.clone());
        let mut gate = self.product(Proj::Gate, rows.clone(), &sizes);
        let mut up = self.product(Proj::Up, rows, &sizes);
        if let (Some(lora), Some(rows)) = (&self.lora_gate_up, lora_in) {
            let [_, i] = gate.dims();
            let t = lora.forward(rows, &sizes).to_dtype(gate.dtype());
            gate = gate + t.clone().slice([0..m, 0..i]);
            up = up + t.slice([0..m, i..2 * i]);
        }
        let h = clamped_swiglu(gate, up, self.limit, Activation::Silu);
        let y = match &self.lora_down {
            None => self.product(Proj::Down, h, &sizes),
            Some(lora) => {
                let y = self.product(Proj::Down, h.clone(), &sizes);
                let dtype = y.dtype();
                y + lora.forward(h, &sizes).to_dtype(dtype)
            }
        };
        // back to row order: row r sits at its rank in `order`
        let mut inverse = vec![0i64; m];
        for (j, &r) in order.iter().enumerate() {
            inverse[r] = j as i64;
        }
        y.select(0, Tensor::<B, 1, Int>::from_data(TensorData::new(inverse, [m]), &device))
    }

    /// These experts split over `ep`'s ranks: this rank keeps its `E/P` experts (their
    /// slices, under the same parameter ids and trainability) and exchanges tokens with the others. For a
    /// model built whole; a rank-local load reads only these experts' bytes instead.
    pub fn into_parallel(self, ep: std::sync::Arc<ExpertParallel>) -> Result<Self, crate::distributed::DistError> {
        let e = self.dims()[0];
        if e != ep.n_experts {
            return Err(crate::distributed::DistError::Counts {
                op: "expert parallelism",
                message: format!("the layer has {e} experts, the expert-parallel plan {}", ep.n_experts),
            });
        }
        let range = ep.first_expert()..ep.first_expert() + ep.local_experts();
        // the parameter ids stay: an optimizer state or a trainer's id table still names them
        let local = |p: Param<Tensor<B, 3>>| {
            let (id, t) = (p.id, p.val());
            let [_, a, b] = t.dims();
            let t = t.slice([range.clone(), 0..a, 0..b]).detach();
            Param::initialized(id, if p.is_require_grad() { t.require_grad() } else { t })
        };
        Ok(Self {
            gate_proj: self.gate_proj.map(local),
            up_proj: self.up_proj.map(local),
            down_proj: self.down_proj.map(local),
            fp8: self.fp8.map(|q| Fp8Experts {
                gate_proj: q.gate_proj.slice(range.clone()),
                up_proj: q.up_proj.slice(range.clone()),
                down_proj: q.down_proj.slice(range.clone()),
            }),
            limit: self.limit,
            // an expert's adapters live with the expert
            lora_gate_up: self.lora_gate_up.map(|l| ExpertLora { a: local(l.a), b: local(l.b), scaling: l.scaling }),
            lora_down: self.lora_down.map(|l| ExpertLora { a: local(l.a), b: local(l.b), scaling: l.scaling }),
            parallel: Some(ep),
        })
    }

    /// Expert-parallel dispatch, local experts and combine. Returns the expert outputs of this
    /// rank's slots `[N·K, D]` (unweighted) and the slot each row belongs to.
    fn dispatch_combine(&self, x: Tensor<B, 2>, routing: &Routing<B>, ep: &ExpertParallel) -> (Tensor<B, 2>, Vec<usize>)
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let [n, width] = x.dims();
        let k = routing.experts.len() / n.max(1);
        fn fail(e: crate::distributed::DistError) -> ! {
            panic!("expert-parallel MoE exchange failed: {e}")
        }
        // the device's mesh decides the group; the layer's experts were cut for one alike
        let group = crate::distributed::seam_group(&x.device(), crate::distributed::MeshRole::Expert, &ep.group).unwrap_or_else(|e| fail(e));
        let (p, el) = (group.size(), ep.local_experts());
        let g = &*group;
        // slots by destination rank (stable: slot order inside a rank)
        let mut order: Vec<usize> = (0..n * k).collect();
        order.sort_by_key(|&s| routing.experts[s] / el);
        let mut send = vec![0usize; p];
        for &s in &order {
            send[routing.experts[s] / el] += 1;
        }
        // how many rows each rank sends here, then which local expert each of them is for
        let send_u64: Vec<u64> = send.iter().map(|&c| c as u64).collect();
        let recv: Vec<usize> =
            typed::all_to_all_v(g, &send_u64, &vec![1; p], &vec![1; p]).unwrap_or_else(|e| fail(e)).into_iter().map(|c| c as usize).collect();
        let local_ids: Vec<u32> = order.iter().map(|&s| (routing.experts[s] % el) as u32).collect();
        let recv_ids: Vec<usize> =
            typed::all_to_all_v(g, &local_ids, &send, &recv).unwrap_or_else(|e| fail(e)).into_iter().map(|x| x as usize).collect();
        let tokens: Vec<i64> = order.iter().map(|&s| (s / k) as i64).collect();
        let device = x.device();
        let rows = x.select(0, Tensor::<B, 1, Int>::from_data(TensorData::new(tokens, [n * k]), &device));
        let arrived = all_to_all_rows(rows, &send, &recv, &group).unwrap_or_else(|e| fail(e));
        let m = recv_ids.len();
        // a rank that received nothing passes its empty block on, so its graph still holds both
        // exchanges and the backward runs them on every rank
        let done = if m == 0 {
            arrived
        } else {
            let identity: Vec<i64> = (0..m as i64).collect();
            self.grouped(arrived, &identity, &recv_ids)
        };
        let y = all_to_all_rows(done, &recv, &send, &group).unwrap_or_else(|e| fail(e));
        let me = g.rank();
        let remote = |counts: &[usize]| counts.iter().enumerate().filter(|(j, _)| *j != me).map(|(_, c)| c).sum::<usize>() as u64;
        let row_bytes = (width * y.dtype().size()) as u64;
        use std::sync::atomic::Ordering::Relaxed;
        ep.stats.dispatch_bytes.fetch_add(remote(&send) * row_bytes, Relaxed);
        ep.stats.combine_bytes.fetch_add(remote(&recv) * row_bytes, Relaxed);
        ep.stats.rows.fetch_add((n * k) as u64, Relaxed);
        ep.stats.calls.fetch_add(1, Relaxed);
        (y, order)
    }
}

impl<B: AutodiffBackend> Router<B> {
    /// Aux-loss-free balancing (DeepSeek-V3), once per optimizer step: count the tokens each
    /// expert was selected for in `batches` (router logits `[N·E]` and the tokens' validity, per
    /// micro-batch), choosing with the current bias as routing does, and move the bias by
    /// `rate` toward the mean load: `b_e += rate · sign(mean − load_e)`. No gradient is
    /// involved; the bias keeps its `require_grad` flag. Under data parallelism the loads of
    /// every rank's micro-batches count: see [`Self::expert_loads`] and [`Self::add_to_bias`].
    pub fn update_bias(&mut self, batches: &[(&[f32], &[bool])], rate: f64) {
        let bias: Vec<f32> = self.e_score_correction_bias.val().into_data().convert::<f32>().into_vec().unwrap_or_default();
        let loads = self.expert_loads(batches, &bias);
        self.add_to_bias(&Self::bias_delta(&loads, rate));
    }

    /// Tokens each of the `E` experts was selected for in `batches`, choosing with `bias` (the
    /// whole `[E]` bias) as routing does; padding tokens do not count.
    pub fn expert_loads(&self, batches: &[(&[f32], &[bool])], bias: &[f32]) -> Vec<f64> {
        let e = bias.len();
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
        load
    }

    /// The bias step for `loads`: `rate · sign(mean − load_e)` per expert.
    pub fn bias_delta(loads: &[f64], rate: f64) -> Vec<f32> {
        let mean = loads.iter().sum::<f64>() / loads.len().max(1) as f64;
        loads
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
            .collect()
    }

    /// Add `delta` (one value per row of the bias parameter as held: the whole bias, or a
    /// shard's rows) to the bias, keeping its `require_grad` flag.
    pub fn add_to_bias(&mut self, delta: &[f32]) {
        let device = self.e_score_correction_bias.device();
        let d = Tensor::<B::InnerBackend, 1>::from_data(TensorData::new(delta.to_vec(), [delta.len()]), &device);
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
                gate_proj: Some(std.init([e, d, i], device)),
                up_proj: Some(std.init([e, d, i], device)),
                down_proj: Some(std.init([e, i, d], device)),
                fp8: None,
                limit: c.swiglu_limit,
                lora_gate_up: None,
                lora_down: None,
                parallel: None,
            },
            shared_experts: Mlp::new(d, i * c.n_shared_experts, c.hidden_act, c.swiglu_limit, device),
        }
    }

    /// Replace the stacked experts by uninitialised ones of `n` experts (see
    /// [`crate::model::Glm5ForCausalLM::keep_experts`]).
    pub fn keep_experts(&mut self, n: usize, c: &TextConfig, device: &B::Device) {
        let (d, i) = (c.hidden_size, c.moe_intermediate_size);
        self.experts.gate_proj = Some(Initializer::Zeros.init([n, d, i], device));
        self.experts.up_proj = Some(Initializer::Zeros.init([n, d, i], device));
        self.experts.down_proj = Some(Initializer::Zeros.init([n, i, d], device));
        self.experts.fp8 = None;
    }

    /// `x` `[B, S, D]` → (`[B, S, D]`, router logits `[B·S, E]`).
    pub fn forward(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 2>)
    where
        B: crate::ops::backend::Glm5Backend,
    {
        self.forward_routed(x, None)
    }

    /// [`Self::forward`] with the router reading `route` `[B, S, D]` (the same hidden state
    /// before its rounding to `x`'s dtype) instead of `x`.
    pub fn forward_routed(&self, x: Tensor<B, 3>, route: Option<Tensor<B, 3>>) -> (Tensor<B, 3>, Tensor<B, 2>)
    where
        B: crate::ops::backend::Glm5Backend,
    {
        let [b, s, d] = x.dims();
        let flat = x.clone().reshape([b * s, d]);
        let routing = self.gate.forward(route.map_or_else(|| flat.clone(), |r| r.reshape([b * s, d])));
        let routed = self.experts.forward(flat, &routing).reshape([b, s, d]);
        (routed + self.shared_experts.forward(x), routing.logits)
    }
}
