//! KPool top-k selection of the DSA indexer (HF
//! `Glm5NextTextIndexer.forward`, `get_pooled_states`, `append_visible_tail`).
//!
//! Given per-query pool scores `I[b, t, p]`, this picks, for every non-padding query `t`,
//! the `min(index_topk / kpool, #selectable)` best *selectable* pools — complete pools (all
//! `kpool` tokens present and not padding, anchored at the first valid token `f`) whose last
//! token is `≤ t` — expands them to their raw token indices, appends the visible tail (the
//! `n_vis(t) mod kpool` most recent tokens) when `always_select_tail`, and pads with −1 to
//! the output width. Padding queries get a row of −1.
//!
//! Ties are broken toward the **lower pool index** (documented; `torch.topk` on CPU follows
//! no rule). The selection runs on the host: it is cheap next to the scoring, it is the
//! specification the indexer kernel is tested against, and the indexer takes no gradient.

use burn::tensor::activation::{relu, softmax};
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};
use rayon::prelude::*;

/// Pool scores `[B, S, P]` from the indexer's queries `q` `[B, S, H, d]`, head weights `w`
/// `[B, S, H]` (already × `H^{-1/2}`) and pooled keys `[B, P, d]` (all fp32):
/// `I_{t,p} = Σ_h w_{t,h} ReLU(scale · q_{t,h} · K̄_p)` — the reference scoring (dense
/// `S × P`), whose output [`KpoolSelect::select`] consumes.
pub fn reference_scores<B: Backend>(q: Tensor<B, 4>, w: Tensor<B, 3>, pooled: Tensor<B, 3>, scale: f32) -> Tensor<B, 3> {
    let [b, s, h, d] = q.dims();
    let n_pools = pooled.dims()[1];
    let scores = relu(q.reshape([b, s * h, d]).matmul(pooled.swap_dims(1, 2)) * scale).reshape([b, s, h, n_pools]);
    (scores * w.unsqueeze_dim::<4>(3)).sum_dim(2).reshape([b, s, n_pools])
}

/// Pooled keys `[B, P, d]` (fp32), `P = ceil(S / kpool)` with `kpool = ape.dims()[0]`, the
/// reference form of HF `get_pooled_states`: for row `b` (first valid token `first[b]`), pool
/// `p` and channel `c`, over the pool's members `t_j = min(first[b] + p·kpool + j, S − 1)`,
/// `K̄[b, p, c] = Σ_j softmax_j(gate[b, t_j, c] + ape[j, c]) · k[b, t_j, c]`. Members past the
/// end are clamped: such pools are incomplete and never selected ([`complete_pools`]), but
/// their values are defined. `k`, `gate` `[B, S, d]`, `ape` `[kpool, d]`.
pub fn reference_compress<B: Backend>(k: Tensor<B, 3>, gate: Tensor<B, 3>, ape: Tensor<B, 2>, first: &[usize]) -> Tensor<B, 3> {
    let [b, s, d] = k.dims();
    let kp = ape.dims()[0];
    assert_eq!(first.len(), b, "kpool compress: {} first tokens for {b} rows", first.len());
    let n_pools = s.div_ceil(kp);
    let mut idx = Vec::with_capacity(b * n_pools * kp * d);
    for &f in first {
        let layout = PoolLayout { first: f, n_pools };
        for p in 0..n_pools {
            for j in 0..kp {
                let tok = pool_token(&layout, kp, p, j).min(s - 1) as i64;
                idx.extend(std::iter::repeat_n(tok, d));
            }
        }
    }
    let idx = Tensor::<B, 3, Int>::from_data(TensorData::new(idx, [b, n_pools * kp, d]), &k.device());
    let gk = k.cast(DType::F32).gather(1, idx.clone()).reshape([b, n_pools, kp, d]);
    let gg = gate.cast(DType::F32).gather(1, idx).reshape([b, n_pools, kp, d]);
    let probs = softmax(gg + ape.cast(DType::F32).reshape([1, 1, kp, d]), 2);
    (probs * gk).sum_dim(2).reshape([b, n_pools, d])
}

/// The reference indexer selection: [`reference_scores`], then [`KpoolSelect::select`] and
/// [`KpoolSelect::boundary_margin`] on the host. Returns (indices `[B, S, width]`, margin).
pub fn reference_select<B: Backend>(
    q: Tensor<B, 4>,
    w: Tensor<B, 3>,
    pooled: Tensor<B, 3>,
    mask: &[bool],
    sel: KpoolSelect,
    scale: f32,
) -> (Vec<i64>, f32) {
    let scores = reference_scores(q, w, pooled, scale);
    let [b, s, _] = scores.dims();
    let host: Vec<f32> = scores.into_data().convert::<f32>().into_vec().expect("pool scores are f32");
    (sel.select(&host, mask, b, s), sel.boundary_margin(&host, mask, b, s))
}

/// Host-side geometry the indexer kernel needs, from the `[B, S]` validity mask: per row the
/// first valid token; per pool its last token if complete, else −1; per position the number
/// of valid tokens up to and including it.
pub struct KernelLayout {
    /// Per row, the first valid token.
    pub first: Vec<i32>,
    /// Per pool, its last token if complete, else −1.
    pub last: Vec<i32>,
    /// Per position, valid tokens up to it.
    pub visible: Vec<i32>,
}

impl KernelLayout {
    /// The layout of `mask` `[batch, seq]` with pools of `kpool`.
    pub fn new(mask: &[bool], batch: usize, seq: usize, kpool: usize) -> Self {
        let n_pools = seq.div_ceil(kpool);
        let layouts = pool_layouts(mask, batch, seq, kpool);
        let (mut first, mut last, mut visible) = (Vec::with_capacity(batch), Vec::with_capacity(batch * n_pools), Vec::with_capacity(batch * seq));
        for (b, lay) in layouts.iter().enumerate() {
            let row = &mask[b * seq..(b + 1) * seq];
            first.push(lay.first as i32);
            for (p, complete) in complete_pools(lay, row, kpool).into_iter().enumerate() {
                last.push(if complete { pool_token(lay, kpool, p, kpool - 1) as i32 } else { -1 });
            }
            let mut n = 0i32;
            for &m in row {
                n += m as i32;
                visible.push(n);
            }
        }
        Self { first, last, visible }
    }
}

/// Geometry of the pools of one batch row.
#[derive(Debug, Clone, Copy)]
pub struct PoolLayout {
    /// First non-padding position (`seq_len` when the row is all padding).
    pub first: usize,
    /// Number of pools `ceil(seq_len / kpool)` (pools past the end are never complete).
    pub n_pools: usize,
}

/// Pool layout of every row of a `[B, S]` validity mask (row-major).
pub(crate) fn pool_layouts(mask: &[bool], batch: usize, seq: usize, kpool: usize) -> Vec<PoolLayout> {
    (0..batch)
        .map(|b| {
            let row = &mask[b * seq..(b + 1) * seq];
            let first = row.iter().position(|&m| m).unwrap_or(seq);
            PoolLayout { first, n_pools: seq.div_ceil(kpool) }
        })
        .collect()
}

/// Token index of slot `j` of pool `p` (may be past the end).
#[inline]
pub(crate) fn pool_token(layout: &PoolLayout, kpool: usize, p: usize, j: usize) -> usize {
    layout.first + p * kpool + j
}

/// Which of a row's `n_pools` pools are complete: all `kpool` tokens inside the sequence and
/// valid (`row_mask`, one row of the `[B, S]` mask). Only complete pools are ever selected.
pub(crate) fn complete_pools(layout: &PoolLayout, row_mask: &[bool], kpool: usize) -> Vec<bool> {
    let seq = row_mask.len();
    (0..layout.n_pools).map(|p| (0..kpool).all(|j| pool_token(layout, kpool, p, j) < seq && row_mask[pool_token(layout, kpool, p, j)])).collect()
}

/// Selection parameters.
#[derive(Debug, Clone, Copy)]
pub struct KpoolSelect {
    /// Tokens per pool.
    pub kpool: usize,
    /// Tokens selected per query.
    pub index_topk: usize,
    /// Always select the query's own incomplete pool.
    pub always_select_tail: bool,
}

impl KpoolSelect {
    /// Output width: `index_topk (+ kpool − 1 with the tail)`.
    pub fn width(&self) -> usize {
        if self.always_select_tail {
            self.index_topk + self.kpool - 1
        } else {
            self.index_topk
        }
    }

    /// Select token indices.
    ///
    /// * `scores`: `[B, S, P]` row-major pool scores (`P = ceil(S / kpool)`).
    /// * `mask`: `[B, S]` validity (true = token).
    ///
    /// Returns `[B, S, width]` row-major indices, −1 = none.
    pub fn select(&self, scores: &[f32], mask: &[bool], batch: usize, seq: usize) -> Vec<i64> {
        self.select_queries(scores, mask, batch, seq, 0)
    }

    /// [`Self::select`] for the queries at positions `q0..seq` only — the rows a decode step
    /// adds to a cached context of `q0` positions. `scores` is `[B, seq − q0, P]` with
    /// `P = ceil(seq / kpool)`, `mask` the `[B, seq]` validity of the whole context; returns
    /// `[B, seq − q0, width]`. The selection of a query depends only on the positions up to it,
    /// so these rows equal the last rows of a selection over the whole context.
    pub fn select_queries(&self, scores: &[f32], mask: &[bool], batch: usize, seq: usize, q0: usize) -> Vec<i64> {
        let kp = self.kpool;
        let n_pools = seq.div_ceil(kp);
        let rows = seq - q0.min(seq);
        assert_eq!(scores.len(), batch * rows * n_pools, "pool score buffer has the wrong size");
        let width = self.width();
        let budget = self.index_topk / kp;
        let layouts = pool_layouts(mask, batch, seq, kp);
        let mut out = vec![-1i64; batch * rows * width];
        // descending score, then ascending pool index: a total order, so the top `budget` is
        // one set and its order one list, whatever the selection algorithm
        let order = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        for (b, lay) in layouts.iter().enumerate() {
            let row_mask = &mask[b * seq..(b + 1) * seq];
            let complete = complete_pools(lay, row_mask, kp);
            // valid tokens up to and including each position
            let visible: Vec<usize> = row_mask
                .iter()
                .scan(0usize, |n, &m| {
                    *n += m as usize;
                    Some(*n)
                })
                .collect();
            // queries are independent: in parallel, each with its own candidate buffer
            out[b * rows * width..(b + 1) * rows * width].par_chunks_mut(width.max(1)).enumerate().for_each_init(
                || Vec::with_capacity(n_pools),
                |cand: &mut Vec<(f32, usize)>, (r, o)| {
                    let t = q0 + r;
                    if !row_mask[t] {
                        return;
                    }
                    let srow = &scores[(b * rows + r) * n_pools..(b * rows + r + 1) * n_pools];
                    cand.clear();
                    for p in 0..n_pools {
                        if complete[p] && pool_token(lay, kp, p, kp - 1) <= t {
                            cand.push((srow[p], p));
                        }
                    }
                    if cand.len() > budget && budget > 0 {
                        cand.select_nth_unstable_by(budget - 1, order);
                    }
                    cand.truncate(budget);
                    cand.sort_by(order);
                    let mut w = 0;
                    for &(_, p) in cand.iter() {
                        for j in 0..kp {
                            o[w] = pool_token(lay, kp, p, j) as i64;
                            w += 1;
                        }
                    }
                    if self.always_select_tail {
                        let tail = visible[t] % kp;
                        let start = lay.first + visible[t] - tail;
                        for j in 0..tail {
                            let idx = start + j;
                            if idx < seq && idx <= t && row_mask[idx] {
                                o[w] = idx as i64;
                                w += 1;
                            }
                        }
                    }
                },
            );
        }
        out
    }
}

impl KpoolSelect {
    /// Smallest gap, over all rows, between the last selected and the best rejected
    /// candidate pool (`f32::INFINITY` when no row rejects anything). A gap of 0 is a tie at
    /// the top-k boundary, where the choice depends on the tie rule.
    pub fn boundary_margin(&self, scores: &[f32], mask: &[bool], batch: usize, seq: usize) -> f32 {
        let kp = self.kpool;
        let n_pools = seq.div_ceil(kp);
        let budget = self.index_topk / kp;
        let layouts = pool_layouts(mask, batch, seq, kp);
        let mut margin = f32::INFINITY;
        for (b, lay) in layouts.iter().enumerate() {
            let row_mask = &mask[b * seq..(b + 1) * seq];
            let complete = complete_pools(lay, row_mask, kp);
            let row_margin = (0..seq)
                .into_par_iter()
                .filter(|&t| row_mask[t])
                .map(|t| {
                    let srow = &scores[(b * seq + t) * n_pools..(b * seq + t + 1) * n_pools];
                    let mut c: Vec<f32> = (0..n_pools).filter(|&p| complete[p] && pool_token(lay, kp, p, kp - 1) <= t).map(|p| srow[p]).collect();
                    if c.len() > budget && budget > 0 {
                        // the budget-th best and the best rejected score
                        let (_, last, rest) = c.select_nth_unstable_by(budget - 1, |a, b| b.total_cmp(a));
                        let last = *last;
                        let best_rejected = rest.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        last - best_rejected
                    } else {
                        f32::INFINITY
                    }
                })
                .reduce(|| f32::INFINITY, f32::min); // min is exact: any order gives the same value
            margin = margin.min(row_margin);
        }
        margin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_when_budget_covers_all_pools() {
        // 10 tokens, kpool 4, budget 4 pools: every complete pool plus the tail is selected
        let sel = KpoolSelect { kpool: 4, index_topk: 16, always_select_tail: true };
        let seq = 10;
        let scores = vec![0.0; seq * 3];
        let mask = vec![true; seq];
        let out = sel.select(&scores, &mask, 1, seq);
        for t in 0..seq {
            let mut row: Vec<i64> = out[t * 19..(t + 1) * 19].iter().copied().filter(|&x| x >= 0).collect();
            row.sort();
            assert_eq!(row, (0..=t as i64).collect::<Vec<_>>(), "row {t}");
        }
    }

    #[test]
    fn ties_go_to_the_lower_pool() {
        let sel = KpoolSelect { kpool: 2, index_topk: 2, always_select_tail: false };
        let seq = 6; // pools {0,1} {2,3} {4,5}
        let scores = vec![1.0; seq * 3];
        let out = sel.select(&scores, &[true; 6], 1, seq);
        assert_eq!(&out[5 * 2..6 * 2], &[0, 1]);
    }

    #[test]
    fn left_padding_anchors_pools_at_the_first_token() {
        let sel = KpoolSelect { kpool: 2, index_topk: 2, always_select_tail: true };
        let seq = 5;
        let mask = [false, true, true, true, true];
        // pools anchored at 1: {1,2} {3,4} {5,..}; pool 1 scores higher
        let mut scores = vec![0.0; seq * 3];
        for t in 0..seq {
            scores[t * 3 + 1] = 1.0;
        }
        let out = sel.select(&scores, &mask, 1, seq);
        assert_eq!(&out[0..3], &[-1, -1, -1]); // padding query
        assert_eq!(&out[3 * 3..4 * 3], &[1, 2, 3]); // pool {1,2} + tail {3}
        assert_eq!(&out[4 * 3..5 * 3], &[3, 4, -1]); // best pool {3,4}, no tail
    }
}
