//! KPool indexer selection: pool scoring, per-query top-k with the library's tie rule, and the
//! expansion to token indices (HF `Glm5NextTextIndexer.forward`).
//!
//! For a tile of `N` queries (query `n` is token `t_n` of batch row `b_n`), pooled keys
//! `K̄` `[Bp, P, d]`, indexer queries `q` `[N, H, d]` and head weights `w` `[N, H]`:
//!
//! ```text
//! I_{n,p} = Σ_h w_{n,h} · ReLU(scale · q_{n,h} · K̄_{b_n,p})        (candidates only)
//! ```
//!
//! A pool is a candidate for query `n` when it is complete (`last[b, p] ≥ 0`, computed by the
//! caller from the padding mask) and its last token is `≤ t_n`. Each query keeps the
//! `min(budget, #candidates)` best candidates — descending score, ties to the **lower pool
//! index** (the reference's documented rule) — and writes their tokens
//! `first_b + p·kpool + j` in ascending pool order, then the visible tail (the
//! `vis_n mod kpool` most recent valid tokens, `≤ t_n`) when asked, then −1 up to the row
//! width. A query that is padding gets a row of −1.
//!
//! Two kernels, on a tile of queries (the caller tiles them, so at most `N × P` scores exist
//! at a time):
//! * scores: one unit per query and group of 4 pools (each query element loaded serves four
//!   pooled keys), summed in the same order as one pool at a time;
//! * selection: one unit per query, a radix select on order-preserving u32 keys of the f32
//!   scores — 8 passes over the query's candidates, each a 16-bin histogram of the next 4-bit
//!   digit of the keys that match the threshold's digits so far; exact, deterministic, no
//!   sort. Each query also reports its top-k boundary margin (score of the last kept pool −
//!   best rejected score; +3e38 when nothing is rejected), the diagnostic
//!   `KpoolSelect::boundary_margin` gives on the host.
//!
//! Queries are the innermost index throughout — the tile's queries are transposed once to
//! `[H, d, N]` and the scores kept as `[P, N]` — so neighbouring units (consecutive queries)
//! read and write neighbouring addresses and share the pooled keys they read: coalesced on a
//! GPU, vector loads on lavapipe.
//!
//! Reference: `glm5_burn::ops::kpool::KpoolSelect::select` (host) on the scores of
//! `glm5_burn::text::indexer::Indexer::pool_scores`.

use burn::tensor::DType;
use cubecl::prelude::*;

use crate::{contiguous, dims, elementwise, empty_like, CubeRuntime, CubeTensor};

/// Pools per unit of the scoring kernel: each query element loaded is used for this many
/// pooled keys (register blocking).
const POOLS_PER_UNIT: usize = 4;

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn scores_kernel<F: Float>(
    q_t: &Tensor<F>,
    pooled: &Tensor<F>,
    w: &Tensor<F>,
    query_row: &Tensor<i32>,
    query_pos: &Tensor<i32>,
    last: &Tensor<i32>,
    scores_t: &mut Tensor<f32>,
    scale: f32,
    #[define(F)] _dtype: StorageType,
) {
    // unit (pool group, n), queries fastest: neighbouring units read neighbouring `q_t` and
    // `scores_t` entries and (within a batch row) the same pooled keys; each unit scores
    // POOLS_PER_UNIT pools, in the same order of summation as one pool at a time
    let n_q = q_t.shape(2);
    let h_n = q_t.shape(0);
    let d = q_t.shape(1);
    let p_n = pooled.shape(1);
    let pos = ABSOLUTE_POS;
    if pos >= n_q * p_n.div_ceil(POOLS_PER_UNIT) {
        terminate!();
    }
    let n = pos % n_q;
    let p0 = (pos / n_q) * POOLS_PER_UNIT;
    let b = usize::cast_from(query_row[n]);
    let row = b * p_n;
    // pools past the end read the last pool (discarded below)
    let k0 = (row + min(p0, p_n - 1)) * d;
    let k1 = (row + min(p0 + 1, p_n - 1)) * d;
    let k2 = (row + min(p0 + 2, p_n - 1)) * d;
    let k3 = (row + min(p0 + 3, p_n - 1)) * d;
    let mut acc0 = 0.0f32;
    let mut acc1 = 0.0f32;
    let mut acc2 = 0.0f32;
    let mut acc3 = 0.0f32;
    for h in 0..h_n {
        let qb = h * d * n_q + n; // q_t[h, c, n] at qb + c·N
        let mut dot0 = 0.0f32;
        let mut dot1 = 0.0f32;
        let mut dot2 = 0.0f32;
        let mut dot3 = 0.0f32;
        for c in 0..d {
            let qv = f32::cast_from(q_t[qb + c * n_q]);
            dot0 += qv * f32::cast_from(pooled[k0 + c]);
            dot1 += qv * f32::cast_from(pooled[k1 + c]);
            dot2 += qv * f32::cast_from(pooled[k2 + c]);
            dot3 += qv * f32::cast_from(pooled[k3 + c]);
        }
        let wh = f32::cast_from(w[n * h_n + h]);
        acc0 += wh * max(dot0 * scale, 0.0f32);
        acc1 += wh * max(dot1 * scale, 0.0f32);
        acc2 += wh * max(dot2 * scale, 0.0f32);
        acc3 += wh * max(dot3 * scale, 0.0f32);
    }
    let t = query_pos[n];
    let mut accs = Array::<f32>::new(POOLS_PER_UNIT);
    accs[0] = acc0;
    accs[1] = acc1;
    accs[2] = acc2;
    accs[3] = acc3;
    #[unroll]
    for i in 0..POOLS_PER_UNIT {
        let p = p0 + i;
        if p < p_n {
            let l = last[row + p];
            let mut v = 0.0f32;
            if l >= 0i32 && l <= t {
                v = accs[i];
            }
            scores_t[p * n_q + n] = v;
        }
    }
}

/// Order-preserving u32 key of an f32 (larger score ⇒ larger key; −0 < +0 does not matter
/// here: both come only from exact zeros of the same sum).
#[cube]
fn order_key(x: f32) -> u32 {
    let bits = u32::reinterpret(x);
    let mut key = bits | 0x8000_0000u32;
    if bits >= 0x8000_0000u32 {
        key = !bits;
    }
    key
}

#[cube]
fn from_key(key: u32) -> f32 {
    let mut bits = key & 0x7fff_ffffu32;
    if key < 0x8000_0000u32 {
        bits = !key;
    }
    f32::reinterpret(bits)
}

#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn select_kernel(
    scores_t: &Tensor<f32>,
    query_row: &Tensor<i32>,
    query_pos: &Tensor<i32>,
    query_vis: &Tensor<i32>,
    last: &Tensor<i32>,
    first: &Tensor<i32>,
    valid: &Tensor<i32>,
    out: &mut Tensor<i32>,
    margin: &mut Tensor<f32>,
    budget: u32,
    kpool: u32,
    tail: u32,
) {
    let n = ABSOLUTE_POS;
    if n >= margin.len() {
        terminate!();
    }
    let p_n = scores_t.shape(0);
    let n_q = scores_t.shape(1);
    let width = out.shape(1);
    let seq = valid.shape(1);
    let kp = usize::cast_from(kpool);
    let b = usize::cast_from(query_row[n]);
    let t = query_pos[n];
    let mut written = 0usize;
    let mut gap = 3.0e38f32;
    if valid[b * seq + usize::cast_from(t)] != 0i32 {
        let mut n_cand = 0u32;
        for p in 0..p_n {
            let l = last[b * p_n + p];
            if l >= 0i32 && l <= t {
                n_cand += 1u32;
            }
        }
        let take = min(budget, n_cand);
        // radix select, one 4-bit digit per pass from the top: the largest key K with
        // #{key ≥ K} ≥ take. `need` = how many of the keys matching K's digits so far are
        // still to be kept; each pass histograms the next digit of those keys.
        let mut thresh = 0u32;
        let mut n_above = 0u32; // #{key > K}
        let mut eq_take = 0u32; // how many of the keys == K to keep (lowest pools first)
        let mut rejects = n_cand > take;
        if take > 0u32 {
            let mut need = take;
            let mut hist = Array::<u32>::new(16usize);
            for pass in 0..8u32 {
                let shift = 28u32 - pass * 4u32;
                for i in 0..16usize {
                    hist[i] = 0u32;
                }
                for p in 0..p_n {
                    let l = last[b * p_n + p];
                    if l >= 0i32 && l <= t {
                        let key = order_key(scores_t[p * n_q + n]);
                        // the digits above this one equal K's (two shifts: never by 32)
                        if ((key ^ thresh) >> shift) >> 4u32 == 0u32 {
                            let digit = usize::cast_from((key >> shift) & 15u32);
                            hist[digit] += 1u32;
                        }
                    }
                }
                let mut above = 0u32;
                let mut found = false;
                for i in 0..16u32 {
                    let digit = 15u32 - i;
                    let h = hist[usize::cast_from(digit)];
                    if !found {
                        if above + h >= need {
                            thresh |= digit << shift;
                            found = true;
                        } else {
                            above += h;
                        }
                    }
                }
                need -= above;
            }
            for p in 0..p_n {
                let l = last[b * p_n + p];
                if l >= 0i32 && l <= t && order_key(scores_t[p * n_q + n]) > thresh {
                    n_above += 1u32;
                }
            }
            eq_take = take - n_above;
        } else {
            rejects = false;
        }
        // emit in ascending pool order; track the best rejected key for the margin
        let mut eq_seen = 0u32;
        let mut best_rejected = 0u32;
        let mut any_rejected = false;
        let f = usize::cast_from(first[b]);
        for p in 0..p_n {
            let l = last[b * p_n + p];
            if l >= 0i32 && l <= t {
                let key = order_key(scores_t[p * n_q + n]);
                let mut keep = key > thresh;
                if key == thresh && take > 0u32 {
                    keep = eq_seen < eq_take;
                    eq_seen += 1u32;
                }
                if take == 0u32 {
                    keep = false;
                }
                if keep {
                    for j in 0..kp {
                        out[n * width + written] = i32::cast_from(f + p * kp + j);
                        written += 1;
                    }
                } else if !any_rejected || key > best_rejected {
                    best_rejected = key;
                    any_rejected = true;
                }
            }
        }
        if rejects && any_rejected {
            gap = from_key(thresh) - from_key(best_rejected);
        }
        if tail != 0u32 {
            let vis = usize::cast_from(query_vis[n]);
            let n_tail = vis % kp;
            let start = f + vis - n_tail;
            for j in 0..n_tail {
                let idx = start + j;
                // nested, not `&&`: the bounds check must guard the read
                #[allow(clippy::collapsible_if)]
                if idx < seq && idx <= usize::cast_from(t) {
                    if valid[b * seq + idx] != 0i32 {
                        out[n * width + written] = i32::cast_from(idx);
                        written += 1;
                    }
                }
            }
        }
    }
    for i in written..width {
        out[n * width + i] = -1i32;
    }
    margin[n] = gap;
}

/// Host-side layout of one batch of rows, uploaded once per indexer call.
pub struct KpoolLayout<R: CubeRuntime> {
    /// `[Bp, P]` i32: last token of each complete pool, −1 for incomplete pools.
    pub last: CubeTensor<R>,
    /// `[Bp]` i32: first valid token of each row (pools are anchored there).
    pub first: CubeTensor<R>,
    /// `[Bp, S]` i32: 1 = token, 0 = padding.
    pub valid: CubeTensor<R>,
}

/// Query tile: which row/position each query is, and its visible-token count.
pub struct KpoolQueries<R: CubeRuntime> {
    /// `[N]` i32 batch row of each query.
    pub row: CubeTensor<R>,
    /// `[N]` i32 token position.
    pub pos: CubeTensor<R>,
    /// `[N]` i32 number of valid tokens at positions `≤ pos` of its row.
    pub vis: CubeTensor<R>,
}

/// Selection parameters (`KpoolSelect`'s, plus the score scale `1/√d`).
#[derive(Debug, Clone, Copy)]
pub struct KpoolParams {
    pub kpool: usize,
    pub budget: usize,
    pub tail: bool,
    pub width: usize,
    pub scale: f32,
}

/// One tile of queries: `q` `[N, H, d]`, `w` `[N, H]`, `pooled` `[Bp, P, d]` →
/// `(indices [N, width] i32, margin [N] f32)`.
pub fn select<R: CubeRuntime>(
    q: CubeTensor<R>,
    w: CubeTensor<R>,
    pooled: CubeTensor<R>,
    layout: &KpoolLayout<R>,
    queries: &KpoolQueries<R>,
    params: KpoolParams,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (q, w, pooled) = (contiguous(q), contiguous(w), contiguous(pooled));
    let [n, h, d] = dims::<_, 3>(&q, "kpool: q");
    let [_bp, p, dk] = dims::<_, 3>(&pooled, "kpool: pooled");
    assert_eq!(dk, d, "kpool: pooled width {dk} differs from q's {d}");
    assert_eq!(dims::<_, 2>(&w, "kpool: w"), [n, h], "kpool: w shape");
    assert!(params.kpool > 0, "kpool: pool size must be positive");
    for (t, what) in [
        (&layout.last, "last"),
        (&layout.first, "first"),
        (&layout.valid, "valid"),
        (&queries.row, "row"),
        (&queries.pos, "pos"),
        (&queries.vis, "vis"),
    ] {
        assert_eq!(t.dtype, DType::I32, "kpool: {what} must be i32");
    }
    let dtype = q.dtype;
    let client = q.client.clone();
    // queries innermost: [N, H, d] → [H, d, N], scores [P, N] (one copy of the tile's queries)
    let q_t = contiguous(burn_cubecl::ops::permute(q, &[1, 2, 0]));
    let scores = empty_like(&q_t, [p, n], DType::F32);
    let (count, dim) = elementwise(&client, n * p.div_ceil(POOLS_PER_UNIT));
    scores_kernel::launch::<R>(
        &client,
        count,
        dim,
        q_t.clone().into_tensor_arg(),
        pooled.into_tensor_arg(),
        w.into_tensor_arg(),
        queries.row.clone().into_tensor_arg(),
        queries.pos.clone().into_tensor_arg(),
        layout.last.clone().into_tensor_arg(),
        scores.clone().into_tensor_arg(),
        params.scale,
        dtype.into(),
    );
    let out = empty_like(&q_t, [n, params.width], DType::I32);
    let margin = empty_like(&q_t, [n], DType::F32);
    let (count, dim) = elementwise(&client, n);
    select_kernel::launch::<R>(
        &client,
        count,
        dim,
        scores.into_tensor_arg(),
        queries.row.clone().into_tensor_arg(),
        queries.pos.clone().into_tensor_arg(),
        queries.vis.clone().into_tensor_arg(),
        layout.last.clone().into_tensor_arg(),
        layout.first.clone().into_tensor_arg(),
        layout.valid.clone().into_tensor_arg(),
        out.clone().into_tensor_arg(),
        margin.clone().into_tensor_arg(),
        params.budget as u32,
        params.kpool as u32,
        params.tail as u32,
    );
    (out, margin)
}
