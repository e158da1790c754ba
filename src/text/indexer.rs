//! KPool lightning indexer of a DSA layer (`self_attn.indexer`).
//!
//! For the normalised input `x` `[B, S, D]` and the MLA query latent `c^Q` `[B, S, q_lora]`:
//!
//! ```text
//! q^I_t = reshape(wq_b c^Q_t)            [H_I, d]       k^I_s = LayerNorm(wk x_s)  [d] (ε 1e-6)
//! γ_s   = compress_gate · x_s             [d]
//! K̄_p[c] = Σ_j softmax_j(γ_{f+kp+j}[c] + ape[j][c]) · k^I_{f+kp+j}[c]     (pools anchored at f)
//! I_{t,p} = Σ_h w_{t,h} ReLU(q^I_{t,h}·K̄_p / √d),   w_t = weights_proj(x_t) / √H_I
//! ```
//!
//! then [`crate::ops::kpool::KpoolSelect`] picks pools and expands them to token indices.
//! HF: `Glm5NextTextIndexer.forward` / `get_pooled_states`. No gradient flows through it
//! (the reference runs it under `no_grad`): inputs are detached and the parameters are used
//! untracked ([`Indexer::untracked`]).

use crate::ops::backend::ToDtype;
use burn::module::{Initializer, Module, ModuleVisitor, Param};
use burn::nn::Linear;
use burn::tensor::{backend::Backend, DType, Tensor, TensorPrimitive};

use super::mlp::new_linear;
use super::norm::LayerNorm;
use super::TokenMask;
use crate::config::TextConfig;
use crate::ops::backend::Glm5Backend;
use crate::ops::kpool::{pool_layouts, reference_compress, reference_scores, reference_select, KpoolSelect};
use crate::ops::PathKind;
use crate::text::cache::IndexerCache;

/// The KPool indexer of a full DSA layer (HF `Glm5NextTextIndexer`): scores pooled keys per query and selects `index_topk` tokens; detached (no gradient).
#[derive(Module, Debug)]
pub struct Indexer<B: Backend> {
    /// Query projection from the query latent `[q_lora_rank, H_i·d_i]`.
    pub wq_b: Linear<B>,
    /// Key projection `[D, d_i]`.
    pub wk: Linear<B>,
    /// LayerNorm of the keys.
    pub k_norm: LayerNorm<B>,
    /// Per-head weights `[D, H_i]`.
    pub weights_proj: Linear<B>,
    /// `[kpool, d]`.
    pub index_kpool_compress_ape: Param<Tensor<B, 2>>,
    /// `[d, D]` (a linear map applied as `x · gateᵀ`).
    pub index_kpool_compress_gate: Param<Tensor<B, 2>>,
    /// Indexer heads H_i.
    pub n_heads: usize,
    /// Indexer head dim d_i.
    pub head_dim: usize,
    /// Tokens selected per query.
    pub index_topk: usize,
    /// Tokens per pool.
    pub kpool: usize,
    /// Always attend to the query's incomplete pool.
    pub always_select_tail: bool,
}

impl<B: Backend> Indexer<B> {
    /// Random init with the shapes of `c`.
    pub fn new(c: &TextConfig, device: &B::Device) -> Self {
        let (d, hi, hd) = (c.hidden_size, c.index_n_heads, c.index_head_dim);
        Self {
            wq_b: new_linear(c.q_lora_rank, hi * hd, false, device),
            wk: new_linear(d, hd, false, device),
            k_norm: LayerNorm::new(hd, 1e-6, device),
            weights_proj: new_linear(d, hi, false, device),
            index_kpool_compress_ape: Initializer::Zeros.init([c.index_kpool, hd], device),
            index_kpool_compress_gate: Initializer::Ones.init([hd, d], device),
            n_heads: hi,
            head_dim: hd,
            index_topk: c.index_topk,
            kpool: c.index_kpool,
            always_select_tail: c.index_kpool_always_select_tail,
        }
    }

    /// This indexer with untracked parameters, for computing with them. The indexer's result
    /// is read on the host only (selected indices), so no gradient can reach its parameters;
    /// computing with the tracked parameters would still register autodiff graph nodes that
    /// no backward ever consumes. Burn 0.21 keeps such nodes — with the tensors they saved for
    /// a backward — for as long as their parameter leaves live, and every later backward scans
    /// them (`GraphCleaner::cleanup_orphaned_entries`): a fine-tune slowed ~10× in 40 steps and
    /// grew ~0.55 MiB per step on the tiny VLM (`tests/long_run.rs`). Untracked tensors
    /// register nothing. Cloning a module clones parameter handles, not their data — once the
    /// parameters exist: a clone of a still-lazy parameter would draw its own values, so they
    /// are materialised in `self` first.
    pub fn untracked(&self) -> Self {
        struct Materialise;
        impl<B: Backend> ModuleVisitor<B> for Materialise {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let _ = param.val();
            }
        }
        self.visit(&mut Materialise);
        self.clone().no_grad()
    }

    /// The selection parameters of this indexer.
    pub fn selector(&self) -> KpoolSelect {
        KpoolSelect { kpool: self.kpool, index_topk: self.index_topk, always_select_tail: self.always_select_tail }
    }

    /// The scoring inputs, fp32: queries `[B, S, H, d]`, head weights `[B, S, H]` (× `H^{-1/2}`)
    /// and pooled keys `[B, P, d]`, `P = ceil(S / kpool)`; pools that are not complete are
    /// pooled from clamped positions and never selected. With `kernel`, the pooled keys come
    /// from the backend's op ([`Glm5Backend::kpool_compress`]; a kernel on CubeCL backends),
    /// otherwise from the reference tensor ops ([`reference_compress`]).
    pub fn pool_inputs(&self, x: Tensor<B, 3>, q_resid: Tensor<B, 3>, mask: &TokenMask<B>, kernel: bool) -> (Tensor<B, 4>, Tensor<B, 3>, Tensor<B, 3>)
    where
        B: Glm5Backend,
    {
        let this = self.untracked();
        let x = x.detach();
        let q_resid = q_resid.detach();
        let [b, s, _] = x.dims();
        let (h, d) = (self.n_heads, self.head_dim);

        let q = this.wq_b.forward(q_resid).to_dtype(DType::F32).reshape([b, s, h, d]);
        let (k, gate) = this.key_inputs(x.clone());
        let ape = this.index_kpool_compress_ape.val();
        let first: Vec<usize> = pool_layouts(&mask.host, b, s, self.kpool).iter().map(|l| l.first).collect();
        let pooled = if kernel {
            let p = |t: Tensor<B, 3>| t.into_primitive().tensor();
            Tensor::from_primitive(TensorPrimitive::Float(B::kpool_compress(p(k), p(gate), ape.into_primitive().tensor(), &first)))
        } else {
            reference_compress(k, gate, ape, &first)
        };
        let w = this.weights_proj.forward(x).to_dtype(DType::F32) * (h as f64).powf(-0.5); // [B,S,H]
        (q, w, pooled)
    }

    /// Per-position pooling inputs of (detached) `x` `[B, S, D]`: the LayerNorm'd keys `k^I`
    /// and the compression gates `γ`, both `[B, S, d]`. Call on [`Self::untracked`].
    fn key_inputs(&self, x: Tensor<B, 3>) -> (Tensor<B, 3>, Tensor<B, 3>)
    where
        B: Glm5Backend,
    {
        let k = self.k_norm.forward(self.wk.forward(x.clone()));
        let gate = x.matmul(self.index_kpool_compress_gate.val().transpose().unsqueeze::<3>());
        (k, gate)
    }

    /// The decoding cache of a prompt `x` `[B, S, D]` with validity `mask`: its keys, gates
    /// and pooled keys (pools anchored at each row's first token, as in [`Self::forward`]).
    pub fn prompt_cache(&self, x: Tensor<B, 3>, mask: &TokenMask<B>) -> IndexerCache<B>
    where
        B: Glm5Backend,
    {
        let this = self.untracked();
        let [b, s, _] = x.dims();
        let (keys, gates) = this.key_inputs(x.detach());
        let first: Vec<usize> = pool_layouts(&mask.host, b, s, self.kpool).iter().map(|l| l.first).collect();
        let pooled = reference_compress(keys.clone(), gates.clone(), this.index_kpool_compress_ape.val(), &first);
        IndexerCache { keys, gates, pooled }
    }

    /// The selection of a decode step: `x` `[B, T, D]` and `q_resid` `[B, T, q_lora]` are the
    /// step's last `T` positions of the context whose validity is `context` (`[B, L]`
    /// row-major, these positions included). Appends their keys and gates to `cache`,
    /// recomputes only the pools they fall into (earlier pools are complete and final), then
    /// scores the `T` queries against the `ceil(L/kpool)` pooled keys — O(L / kpool) per
    /// query — and selects as [`Self::forward`] would for these rows. Returns `[B, T, width]`.
    pub fn forward_cached(&self, x: Tensor<B, 3>, q_resid: Tensor<B, 3>, cache: &mut IndexerCache<B>, context: &[bool]) -> Vec<i64>
    where
        B: Glm5Backend,
    {
        let this = self.untracked();
        let (x, q_resid) = (x.detach(), q_resid.detach());
        let [b, t, _] = x.dims();
        let (h, d, kp) = (self.n_heads, self.head_dim, self.kpool);
        let (keys, gates) = this.key_inputs(x.clone());
        cache.keys = Tensor::cat(vec![cache.keys.clone(), keys], 1);
        cache.gates = Tensor::cat(vec![cache.gates.clone(), gates], 1);
        let len = cache.keys.dims()[1];
        let q0 = len - t;
        let n_pools = len.div_ceil(kp);
        let ape = this.index_kpool_compress_ape.val();
        let device = x.device();
        let rows: Vec<Tensor<B, 3>> = pool_layouts(context, b, len, kp)
            .iter()
            .enumerate()
            .map(|(r, lay)| {
                // pools before `p0` end before the new positions
                let p0 = q0.saturating_sub(lay.first) / kp;
                let start = (lay.first + p0 * kp).min(len - 1);
                let part = |m: &Tensor<B, 3>| m.clone().slice([r..r + 1, start..len, 0..d]);
                let fresh = reference_compress(part(&cache.keys), part(&cache.gates), ape.clone(), &[0]);
                let mut row = vec![fresh];
                if p0 > 0 {
                    row.insert(0, cache.pooled.clone().slice([r..r + 1, 0..p0, 0..d]));
                }
                let row = Tensor::cat(row, 1);
                // pools past the row's end (left-padded rows have fewer) are never complete
                let have = row.dims()[1];
                match have.cmp(&n_pools) {
                    std::cmp::Ordering::Less => Tensor::cat(vec![row, Tensor::zeros([1, n_pools - have, d], (&device, DType::F32))], 1),
                    _ => row.slice([0..1, 0..n_pools, 0..d]),
                }
            })
            .collect();
        cache.pooled = Tensor::cat(rows, 0);
        let q = this.wq_b.forward(q_resid).cast(DType::F32).reshape([b, t, h, d]);
        let w = this.weights_proj.forward(x).cast(DType::F32) * (h as f64).powf(-0.5);
        let scores: Vec<f32> =
            reference_scores(q, w, cache.pooled.clone(), self.score_scale()).into_data().convert::<f32>().into_vec().expect("pool scores are f32");
        self.selector().select_queries(&scores, context, b, len, q0)
    }

    /// `1/√d`, the scale of the pool scores.
    fn score_scale(&self) -> f32 {
        (self.head_dim as f64).powf(-0.5) as f32
    }

    /// Selected token indices `[B, S, width]` (host buffer, −1 = none) and the smallest
    /// score gap at any row's top-k boundary (see [`KpoolSelect::boundary_margin`]). With
    /// `path = Kernel` on a backend that has one, scoring and selection run in the backend's
    /// indexer kernel ([`Glm5Backend::kpool_select`]); the selected sets are the same, listed
    /// in ascending pool order instead of by score.
    pub fn forward(&self, x: Tensor<B, 3>, q_resid: Tensor<B, 3>, mask: &TokenMask<B>, path: PathKind) -> (Vec<i64>, f32)
    where
        B: Glm5Backend,
    {
        let _t = crate::profile::scope("indexer");
        let sel = self.selector();
        let kernel = path.use_op::<B>("KPool indexer", B::kpool_impl());
        let (q, w, pooled) = self.pool_inputs(x, q_resid, mask, kernel);
        if kernel {
            let p = |t: Tensor<B, 3>| t.into_primitive().tensor();
            return B::kpool_select(q.into_primitive().tensor(), p(w), p(pooled), &mask.host, sel, self.score_scale());
        }
        reference_select(q, w, pooled, &mask.host, sel, self.score_scale())
    }
}
