//! KPool-DSA token mixer: NoPE multi-head latent attention over the indexer's selection
//! (`self_attn` of an `indexed_attention` layer).
//!
//! ```text
//! c^Q = RMSNorm(W_qa x),  q = W_qb c^Q            [B, S, H, dq]
//! c   = RMSNorm(W_kva x)                          [B, S, R]    (R = kv_lora_rank)
//! k_h = W_UK,h c,  v_h = W_UV,h c                 (kv_b_proj rows: per head dq then dv)
//! o_{t,h} = Σ_{s∈Sel(t)} softmax(q_{t,h}·k_{s,h} / √dq) v_{s,h};   y = W_o concat_h o
//! ```
//!
//! `Sel(t)` comes from this layer's indexer, or — for an `indexer_types[i] == "shared"`
//! layer — from the most recent full DSA layer (the reference only supports that directly
//! after a full layer; we also carry it across KDA layers, see `Glm5NextTextModel.forward`).
//! HF: `Glm5NextTextAttention.forward`. The two attention forms are in
//! [`crate::ops::sparse_attn`]; [`crate::text::AttentionImpl`] picks one.

use crate::ops::backend::ToDtype;
use burn::module::Module;
use burn::tensor::{backend::Backend, Bool, Int, Tensor, TensorData};

use super::indexer::Indexer;
use super::linear::{linear, Linear};
use super::norm::RmsNorm;
use super::{AttentionImpl, ForwardOptions, PathKind, TokenMask};
use crate::config::TextConfig;
use crate::distributed::DistError;
use crate::ops::backend::sparse_latent_attention;
use crate::ops::backend::Glm5Backend;
use crate::ops::collective::all_gather_rows;
use crate::ops::sparse_attn::{dense_masked, masked_softmax};
use crate::ops::OpImpl;
use crate::text::cache::DsaCache;
use crate::text::context::ContextShard;

/// A DSA layer's output: `[B, S, D]`, the index rows used, the indexer's boundary margin.
pub type MlaOutput<B> = (Tensor<B, 3>, Vec<i64>, Option<f32>);

/// The DSA layer: MLA with a shared latent (`kv_lora_rank`), NoPE heads and KPool-indexed token selection (HF `Glm5NextTextAttention`).
#[derive(Module, Debug)]
pub struct MlaAttention<B: Backend> {
    /// `[D, q_lora_rank]` (bias with `attention_bias`).
    pub q_a_proj: Linear<B>,
    /// RMSNorm of the query latent (also the indexer's query input).
    pub q_a_layernorm: RmsNorm<B>,
    /// `[q_lora_rank, H·d_qk]`.
    pub q_b_proj: Linear<B>,
    /// `[D, kv_lora_rank]`: the shared latent, the per-token KV cache entry.
    pub kv_a_proj_with_mqa: Linear<B>,
    /// RMSNorm of the latent.
    pub kv_a_layernorm: RmsNorm<B>,
    /// `[kv_lora_rank, H·(d_qk + d_v)]`: per-head keys and values from the latent.
    pub kv_b_proj: Linear<B>,
    /// `[H·d_v, D]`.
    pub o_proj: Linear<B>,
    /// This layer's KPool indexer (`None` for `shared` indexer layers).
    pub indexer: Option<Indexer<B>>,
    /// Heads H.
    pub num_heads: usize,
    /// Query/key head dim.
    pub qk_head_dim: usize,
    /// Value head dim.
    pub v_head_dim: usize,
    /// Latent width R.
    pub kv_lora_rank: usize,
    /// Indices per query (`index_topk`, plus the tail pool).
    pub index_width: usize,
}

impl<B: Backend> MlaAttention<B> {
    /// Random init with the shapes of `c`; `with_indexer` for `full` indexer layers.
    pub fn new(c: &TextConfig, with_indexer: bool, device: &B::Device) -> Self {
        let (d, h) = (c.hidden_size, c.num_attention_heads);
        let dq = c.qk_nope_head_dim + c.qk_rope_head_dim;
        Self {
            q_a_proj: Linear::new(d, c.q_lora_rank, c.attention_bias, device),
            q_a_layernorm: RmsNorm::new(c.q_lora_rank, c.rms_norm_eps, device),
            q_b_proj: Linear::new(c.q_lora_rank, h * dq, false, device),
            kv_a_proj_with_mqa: Linear::new(d, c.kv_lora_rank + c.qk_rope_head_dim, c.attention_bias, device),
            kv_a_layernorm: RmsNorm::new(c.kv_lora_rank, c.rms_norm_eps, device),
            kv_b_proj: Linear::new(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), false, device),
            o_proj: Linear::new(h * c.v_head_dim, d, c.attention_bias, device),
            indexer: with_indexer.then(|| Indexer::new(c, device)),
            num_heads: h,
            qk_head_dim: dq,
            v_head_dim: c.v_head_dim,
            kv_lora_rank: c.kv_lora_rank,
            index_width: c.index_width(),
        }
    }

    /// Packed documents: each document attends (and selects pools) only within itself; the
    /// index rows come back in row coordinates.
    pub fn forward_documents(
        &self,
        x: Tensor<B, 3>,
        docs: &[std::ops::Range<usize>],
        shared_indices: Option<&[i64]>,
        opts: &ForwardOptions,
    ) -> (Tensor<B, 3>, Vec<i64>, Option<f32>)
    where
        B: Glm5Backend,
    {
        let [_, s, d] = x.dims();
        let device = x.device();
        let w = self.index_width;
        let mut all = vec![-1i64; s * w];
        let mut outs = Vec::with_capacity(docs.len());
        let mut margin: Option<f32> = None;
        for r in docs {
            let local: Option<Vec<i64>> =
                shared_indices.map(|idx| idx[r.start * w..r.end * w].iter().map(|&i| if i >= 0 { i - r.start as i64 } else { -1 }).collect());
            let part = x.clone().slice([0..1, r.clone(), 0..d]);
            let (y, idx, m) = self.forward(part, &TokenMask::all(1, r.len(), &device), local.as_deref(), opts);
            for (dst, &i) in all[r.start * w..r.end * w].iter_mut().zip(&idx) {
                *dst = if i >= 0 { i + r.start as i64 } else { -1 };
            }
            margin = match (margin, m) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            outs.push(y);
        }
        (Tensor::cat(outs, 1), all, margin)
    }

    /// [`Self::forward_documents`] on this rank's shard of a packed row under context
    /// parallelism ([`crate::text::context`]): `x` `[1, T, D]` holds the row's tokens
    /// `cp.shard` (global rows), `cp.row_documents` are the row's documents (global). The
    /// latent is all-gathered over `cp.group` with its global positions (backward reduce-scatters its
    /// gradient to the owner); a full layer's indexer runs over the gathered row, document by
    /// document (its inputs gathered untracked: it takes no gradient), so the selection — causal
    /// masks, pools anchored at each document's first token, the always-selected tail — is
    /// exactly the unsplit row's; this shard's queries attend in the sparse absorbed form over
    /// the row's latent. `shared_indices` (a shared layer) are this shard's rows in row
    /// coordinates. Returns (`[1, T, D]`, this shard's index rows in row coordinates, the
    /// indexer's margin). Every rank of the group calls it; the shard's chain orders the
    /// forward's collectives.
    pub fn forward_context(
        &self,
        x: Tensor<B, 3>,
        cp: &ContextShard<B>,
        shared_indices: Option<&[i64]>,
        opts: &ForwardOptions,
    ) -> Result<MlaOutput<B>, DistError>
    where
        B: Glm5Backend,
    {
        let (docs, shard, group) = (&cp.row_documents[..], cp.shard.clone(), &cp.group);
        let mut chain = cp.chain();
        let [_, t, _] = x.dims();
        let p = group.size();
        let s = t * p;
        let (h, dq, dv, r) = (self.num_heads, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank);
        let device = x.device();
        let q_resid = self.q_a_layernorm.forward(linear(&self.q_a_proj, x.clone()));
        let q = linear(&self.q_b_proj, q_resid.clone()).reshape([1, t, h, dq]);
        let latent = self.kv_a_layernorm.forward(linear(&self.kv_a_proj_with_mqa, x.clone()));
        let latent = all_gather_rows(chain.tie(latent.reshape([t, r])), &vec![t; p], group)?;
        chain.link(&latent);
        let latent = latent.reshape([1, s, r]);
        let w = self.index_width;
        let (indices, margin) = match (&self.indexer, shared_indices) {
            (Some(ix), _) => {
                let gather = |y: Tensor<B, 3>| -> Result<Tensor<B, 3>, DistError> {
                    let width = y.dims()[2];
                    Ok(all_gather_rows(y.detach().reshape([t, width]), &vec![t; p], group)?.reshape([1, s, width]))
                };
                let (xa, qa) = (gather(x)?, gather(q_resid)?);
                let (mut all, mut margin) = (vec![-1i64; s * w], None::<f32>);
                for dr in docs {
                    let part = |y: &Tensor<B, 3>| {
                        let width = y.dims()[2];
                        y.clone().slice([0..1, dr.clone(), 0..width])
                    };
                    let (idx, m) = ix.forward(part(&xa), part(&qa), &TokenMask::all(1, dr.len(), &device), opts.attn_path);
                    for (dst, &i) in all[dr.start * w..dr.end * w].iter_mut().zip(&idx) {
                        *dst = if i >= 0 { i + dr.start as i64 } else { -1 };
                    }
                    margin = Some(margin.map_or(m, |a| a.min(m)));
                }
                (all[shard.start * w..shard.end * w].to_vec(), margin)
            }
            (None, Some(prev)) => (prev.to_vec(), None),
            (None, None) => panic!("shared DSA layer without a preceding full indexer (rejected by config validation)"),
        };
        let w_ukv = self.kv_b_proj.effective_weight(q.dtype()).reshape([r, h, dq + dv]).permute([1, 2, 0]);
        let scale = (dq as f64).powf(-0.5);
        let o = sparse_absorbed(q, latent, w_ukv, &indices, scale, opts.sparse_block, opts.attn_path);
        Ok((linear(&self.o_proj, o.reshape([1, t, h * dv])), indices, margin))
    }

    /// `x` `[B, S, D]` → (`[B, S, D]`, the index rows used, the indexer's boundary margin).
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        mask: &TokenMask<B>,
        shared_indices: Option<&[i64]>,
        opts: &ForwardOptions,
    ) -> (Tensor<B, 3>, Vec<i64>, Option<f32>)
    where
        B: Glm5Backend,
    {
        let (y, idx, margin, _) = self.forward_latent(x, mask, shared_indices, opts);
        (y, idx, margin)
    }

    /// Prefill of a prompt `x` `[B, S, D]`: [`Self::forward`], also returning the layer's
    /// decoding cache (the prompt's latent rows and, for a full layer, its indexer keys).
    pub fn forward_prefill(
        &self,
        x: Tensor<B, 3>,
        mask: &TokenMask<B>,
        shared_indices: Option<&[i64]>,
        opts: &ForwardOptions,
    ) -> (Tensor<B, 3>, Vec<i64>, DsaCache<B>)
    where
        B: Glm5Backend,
    {
        let indexer = self.indexer.as_ref().map(|ix| ix.prompt_cache(x.clone(), mask));
        let (y, idx, _, latent) = self.forward_latent(x, mask, shared_indices, opts);
        (y, idx, DsaCache { latent, indexer })
    }

    /// A decode step: `x` `[B, T, D]` are the context's last `T` positions (`context`: its
    /// `[B, L]` validity, these included). Appends their latent rows (and indexer keys) to
    /// `cache`, selects with the indexer's cached pools (or takes `shared_indices` `[B, T, W]`,
    /// the preceding full layer's rows of this step) and attends in the absorbed form over the
    /// selected latent rows — O(index width) per query, whatever the context length.
    /// Returns (`[B, T, D]`, the index rows `[B, T, W]`).
    pub fn forward_cached(
        &self,
        x: Tensor<B, 3>,
        context: &[bool],
        cache: &mut DsaCache<B>,
        shared_indices: Option<&[i64]>,
        opts: &ForwardOptions,
    ) -> (Tensor<B, 3>, Vec<i64>)
    where
        B: Glm5Backend,
    {
        let [b, t, _] = x.dims();
        let (h, dq, dv, r) = (self.num_heads, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank);
        let q_resid = self.q_a_layernorm.forward(linear(&self.q_a_proj, x.clone()));
        let q = linear(&self.q_b_proj, q_resid.clone()).reshape([b, t, h, dq]);
        let latent = self.kv_a_layernorm.forward(linear(&self.kv_a_proj_with_mqa, x.clone()));
        cache.latent = Tensor::cat(vec![cache.latent.clone(), latent], 1);
        let indices = match (&self.indexer, &mut cache.indexer, shared_indices) {
            (Some(ix), Some(ic), _) => ix.forward_cached(x, q_resid, ic, context),
            (None, _, Some(prev)) => prev.to_vec(),
            _ => panic!("DSA cache and layer disagree (a cache built for another model)"),
        };
        let w_ukv = self.kv_b_proj.effective_weight(q.dtype()).reshape([r, h, dq + dv]).permute([1, 2, 0]);
        let scale = (dq as f64).powf(-0.5);
        let o = sparse_absorbed(q, cache.latent.clone(), w_ukv, &indices, scale, opts.sparse_block, opts.attn_path);
        (linear(&self.o_proj, o.reshape([b, t, h * dv])), indices)
    }

    /// [`Self::forward`], also returning the normalised latent `[B, S, R]`.
    fn forward_latent(
        &self,
        x: Tensor<B, 3>,
        mask: &TokenMask<B>,
        shared_indices: Option<&[i64]>,
        opts: &ForwardOptions,
    ) -> (Tensor<B, 3>, Vec<i64>, Option<f32>, Tensor<B, 3>)
    where
        B: Glm5Backend,
    {
        let [b, s, _] = x.dims();
        let (h, dq, dv, r) = (self.num_heads, self.qk_head_dim, self.v_head_dim, self.kv_lora_rank);
        let q_resid = self.q_a_layernorm.forward(linear(&self.q_a_proj, x.clone()));
        let q = linear(&self.q_b_proj, q_resid.clone()).reshape([b, s, h, dq]);
        let latent = self.kv_a_layernorm.forward(linear(&self.kv_a_proj_with_mqa, x.clone()));

        let (indices, margin) = match (&self.indexer, shared_indices) {
            (Some(ix), _) => {
                let (idx, m) = ix.forward(x, q_resid, mask, opts.attn_path);
                (idx, Some(m))
            }
            (None, Some(prev)) => (prev.to_vec(), None),
            (None, None) => panic!("shared DSA layer without a preceding full indexer (rejected by config validation)"),
        };
        let width = indices.len() / (b * s).max(1);
        let scale = (dq as f64).powf(-0.5);
        let sparse = match opts.attention {
            AttentionImpl::Dense => false,
            AttentionImpl::Sparse => true,
            // Flex's fused sparse op beats the dense form wherever it does less work (bench,
            // small model, train step at 512 tokens: 0.567 vs 0.607 s; release width, forward
            // at 512 tokens: DSA 1.34 vs 1.00 s in f32, 1.57 vs 0.94 s in bf16, where
            // the absorbed form costs 2.1× the dense one); elsewhere dense up to the threshold
            AttentionImpl::Auto { dense_max_len } => {
                s > dense_max_len
                    || (opts.attn_path == PathKind::Op
                        && B::sparse_attention_impl() == OpImpl::Fused
                        && absorbed_macs(h, dq, dv, r, width) <= dense_macs(h, dq, dv, r, s))
            }
        };
        let o = if sparse {
            // kv_b_proj weight is [R, H·(dq+dv)] (Burn layout): split per head
            let w_ukv = self.kv_b_proj.effective_weight(q.dtype()).reshape([r, h, dq + dv]).permute([1, 2, 0]); // [H, dq+dv, R]
            sparse_absorbed(q, latent.clone(), w_ukv, &indices, scale, opts.sparse_block, opts.attn_path)
        } else {
            let kv = linear(&self.kv_b_proj, latent.clone()).reshape([b, s, h, dq + dv]);
            let k = kv.clone().slice([0..b, 0..s, 0..h, 0..dq]);
            let v = kv.slice([0..b, 0..s, 0..h, dq..dq + dv]);
            dense_masked(q, k, v, &indices, width, scale)
        };
        (linear(&self.o_proj, o.reshape([b, s, h * dv])), indices, margin, latent)
    }
}

/// Multiply-adds per query of the absorbed sparse form over `width` entries: `q̃ = W_UKᵀ q`,
/// scores and output over the `R`-wide latent, `o = W_UV õ` (all per head).
fn absorbed_macs(h: usize, dq: usize, dv: usize, r: usize, width: usize) -> usize {
    h * (dq * r + 2 * width * r + r * dv)
}

/// Multiply-adds per query of the dense form over `s` positions: that position's `kv_b_proj`
/// row (`R → H·(dq + dv)`), then `S` scores and `S` values per head.
fn dense_macs(h: usize, dq: usize, dv: usize, r: usize, s: usize) -> usize {
    r * h * (dq + dv) + h * s * (dq + dv)
}

/// Absorbed-latent sparse form, processed in blocks of `block` queries: `q` `[B, S, H, dq]`,
/// the normalised latent `[B, M, R]` of the `M` positions the indices point into (`M = S` in
/// a forward; the cached context in a decode step, whose queries are its last `S`), `w_ukv` = `kv_b_proj`'s weight per head
/// `[H, dq + dv, R]` (`W_UK` rows first, then `W_UV`), `indices` `[B, S, W]` row-major
/// (−1 = none) → `[B, S, H, dv]`. With `path = Op` on a backend that has one, each block's
/// attention is the backend op
/// [`crate::ops::backend::Glm5Backend::sparse_latent_attention`] (CubeCL kernel, hand-written
/// backward); otherwise tensor ops (gather, masked softmax) under ordinary autodiff.
pub(crate) fn sparse_absorbed<B: Glm5Backend>(
    q: Tensor<B, 4>,
    latent: Tensor<B, 3>,
    w_ukv: Tensor<B, 3>,
    indices: &[i64],
    scale: f64,
    block: usize,
    path: PathKind,
) -> Tensor<B, 4> {
    let kernel = path.use_op::<B>("sparse attention", B::sparse_attention_impl());
    let [b, s, h, dq] = q.dims();
    let [_, m, r] = latent.dims();
    let dv = w_ukv.dims()[1] - dq;
    let width = indices.len() / (b * s).max(1);
    assert_eq!(indices.len(), b * s * width, "sparse attention: {} indices for {b}×{s} queries", indices.len());
    let w_uk = w_ukv.clone().slice([0..h, 0..dq, 0..r]);
    let w_uv = w_ukv.slice([0..h, dq..dq + dv, 0..r]);
    let device = q.device();
    let block = block.max(1);
    // q̃ = W_UKᵀ q per head: [H, B·S, dq] @ [H, dq, R] -> [H, B·S, R]
    let q_lat = q.reshape([b * s, h, dq]).swap_dims(0, 1).matmul(w_uk);
    let q_lat = q_lat.swap_dims(0, 1).reshape([b, s, h, r]);
    let lat_flat = latent.reshape([b * m, r]);
    let mut outs = Vec::new();
    for lo in (0..s).step_by(block) {
        let hi = (lo + block).min(s);
        let n = hi - lo;
        let qb = q_lat.clone().slice([0..b, lo..hi, 0..h, 0..r]).reshape([b * n, h, r]);
        if kernel {
            // rows of the flat latent, −1 kept for "none"
            let mut rows = Vec::with_capacity(b * n * width);
            for bi in 0..b {
                for t in lo..hi {
                    for &i in &indices[(bi * s + t) * width..(bi * s + t + 1) * width] {
                        rows.push(if i >= 0 && (i as usize) < m { (bi * m) as i64 + i } else { -1 });
                    }
                }
            }
            let rows = Tensor::<B, 2, Int>::from_data(TensorData::new(rows, [b * n, width]), &device);
            let (o_lat, _lse) = sparse_latent_attention(qb, lat_flat.clone(), rows, scale as f32);
            let o = o_lat.swap_dims(0, 1).matmul(w_uv.clone().swap_dims(1, 2)); // [H, B·n, dv]
            outs.push(o.swap_dims(0, 1).reshape([b, n, h, dv]));
            continue;
        }
        // flat gather positions and validity for this block: [B, n, W]
        let mut pos = Vec::with_capacity(b * n * width);
        let mut valid = Vec::with_capacity(b * n * width);
        for bi in 0..b {
            for t in lo..hi {
                for &i in &indices[(bi * s + t) * width..(bi * s + t + 1) * width] {
                    let ok = i >= 0 && (i as usize) < m;
                    valid.push(ok);
                    pos.push(if ok { (bi * m) as i64 + i } else { (bi * m) as i64 });
                }
            }
        }
        let pos = Tensor::<B, 1, Int>::from_data(TensorData::new(pos, [b * n * width]), &device);
        let valid = Tensor::<B, 3, Bool>::from_data(TensorData::new(valid, [b * n, 1, width]), &device);
        let kv = lat_flat.clone().select(0, pos).reshape([b * n, width, r]); // [B·n, W, R]
                                                                             // (K q̃ᵀ)ᵀ rather than q̃ Kᵀ: the gathered rows then reach both matmuls untransposed,
                                                                             // so their two gradients add as contiguous tensors, not as a strided add of every
                                                                             // [B·n, W, R] block
        let scores = kv.clone().matmul(qb.swap_dims(1, 2)).swap_dims(1, 2) * scale; // [B·n, H, W]
        let p = masked_softmax(scores, valid.expand([b * n, h, width])).to_dtype(kv.dtype());
        let o_lat = p.matmul(kv); // [B·n, H, R]
                                  // o = W_UV õ per head: [H, B·n, R] @ [H, R, dv]
        let o = o_lat.swap_dims(0, 1).matmul(w_uv.clone().swap_dims(1, 2)); // [H, B·n, dv]
        outs.push(o.swap_dims(0, 1).reshape([b, n, h, dv]));
    }
    Tensor::cat(outs, 1)
}
