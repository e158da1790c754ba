//! KDA scan on the host (Flex's [`crate::ops::backend::Glm5Backend::kda_chunk_scan`]): the
//! token recurrence as fused loops, one thread per head, with a hand-written backward.
//!
//! Inputs in the model's layout, as the op takes them (`q, k, g` `[B, T, H, dk]`, `v`
//! `[B, T, H, dv]`, `β` `[B, T, H]`, `h0` `[B, H, dk, dv]`, fp32, `q`/`k` already normalised
//! and scaled): a head's tokens are read with a stride, so nothing is transposed. Per token,
//! with `α = e^{g_t}` (`g ≤ 0` in the model) and `S` `[dk, dv]` row-major:
//!
//! ```text
//! A = α ⊙ S_{t−1} (rows)   κ = Aᵀ k_t   u = β_t (v_t − κ)   S_t = A + k_t uᵀ   o_t = S_tᵀ q_t
//! ```
//!
//! Backward, in reverse over tokens with `∂S` carrying `∂S_t` (starting from `∂S_T`):
//!
//! ```text
//! ∂S += q_t ∂o_tᵀ   ∂q_t = S_t ∂o_t   ∂u = ∂Sᵀ k_t   ∂k_t = ∂S u + A ∂κ   with ∂κ = −β_t ∂u
//! ∂v_t = β_t ∂u   ∂β_t = ∂u·(v_t − κ)   ∂A = ∂S + k_t ∂κᵀ   ∂g_t = rowsum(∂A ⊙ A)   ∂S_{t−1} = α ⊙ ∂A
//! ```
//!
//! The backward recomputes the forward keeping the state at every chunk start (`T/C + 1`
//! states per head) and, chunk by chunk in reverse, the `C + 1` states inside one chunk — so
//! its memory is `O(T/C · dk·dv + C · dk·dv)` per head, not `O(T · dk·dv)`.
//!
//! Why a recurrence rather than the chunk form on a CPU: per token it costs `~4·dk·dv` fused
//! multiply-adds over contiguous rows (vectorised, cache-resident state), where the chunk
//! form spends `O(C·d)` exponentials per token on its pair terms and many small batched
//! matmuls. The chunk form (`ops::kda`, `ops::kda_scan`) stays the reference; the two agree
//! to fp32 rounding (`tests/kda_scan.rs`).

use rayon::prelude::*;

use super::host::{dot, par_zeros};

/// Shapes of one scan: batch `b`, `t` tokens, `h` heads, key width `dk`, value width `dv`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
}

/// One head's view of the inputs: token `t`'s row of `q` starts at `q[t · H·dk]`, and so on.
struct Head<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    /// `H`: the stride of β and (times the row width) of the rows.
    heads: usize,
}

impl Head<'_> {
    fn qr(&self, t: usize, dk: usize) -> &[f32] {
        &self.q[t * self.heads * dk..][..dk]
    }
    fn kr(&self, t: usize, dk: usize) -> &[f32] {
        &self.k[t * self.heads * dk..][..dk]
    }
    fn gr(&self, t: usize, dk: usize) -> &[f32] {
        &self.g[t * self.heads * dk..][..dk]
    }
    fn vr(&self, t: usize, dv: usize) -> &[f32] {
        &self.v[t * self.heads * dv..][..dv]
    }
    fn beta(&self, t: usize) -> f32 {
        self.beta[t * self.heads]
    }
}

/// All heads' inputs, flat as in the module docs.
pub(crate) struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
    pub h0: &'a [f32],
}

impl<'a> Inputs<'a> {
    /// Head `x = b·H + h`.
    fn head(&self, d: Dims, x: usize) -> Head<'a> {
        let (bi, hi) = (x / d.h, x % d.h);
        let (ok, ov) = ((bi * d.t * d.h + hi) * d.dk, (bi * d.t * d.h + hi) * d.dv);
        Head { q: &self.q[ok..], k: &self.k[ok..], v: &self.v[ov..], g: &self.g[ok..], beta: &self.beta[bi * d.t * d.h + hi..], heads: d.h }
    }
}

/// Scatters per-head `[T, w]` rows (head `x = b·H + h`) into `[B, T, H, w]`.
fn scatter_heads(per_head: &[Vec<f32>], d: Dims, w: usize) -> Vec<f32> {
    let mut out = par_zeros(d.b * d.t * d.h * w);
    out.par_chunks_mut(d.t * d.h * w).enumerate().for_each(|(bi, ob)| {
        for hi in 0..d.h {
            let src = &per_head[bi * d.h + hi];
            for t in 0..d.t {
                ob[(t * d.h + hi) * w..][..w].copy_from_slice(&src[t * w..][..w]);
            }
        }
    });
    out
}

/// `y += a·x`.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yj, xj) in y.iter_mut().zip(x) {
        *yj += a * xj;
    }
}

/// One token's step on `s` (`S_{t−1}` in, `S_t` out); leaves `κ` in `kappa`, `u` in `u` and,
/// if given, writes `o_t` into `o`.
#[inline]
fn step(s: &mut [f32], h: &Head, t: usize, d: Dims, kappa: &mut [f32], u: &mut [f32], o: Option<&mut [f32]>) {
    let (dk, dv) = (d.dk, d.dv);
    let (k, g) = (h.kr(t, dk), h.gr(t, dk));
    kappa.fill(0.0);
    for i in 0..dk {
        let a = g[i].exp();
        for (sj, kj) in s[i * dv..][..dv].iter_mut().zip(kappa.iter_mut()) {
            *sj *= a;
            *kj += k[i] * *sj;
        }
    }
    let (v, b) = (h.vr(t, dv), h.beta(t));
    for j in 0..dv {
        u[j] = b * (v[j] - kappa[j]);
    }
    let q = h.qr(t, dk);
    let mut o = o;
    if let Some(o) = o.as_deref_mut() {
        o.fill(0.0);
    }
    for i in 0..dk {
        let row = &mut s[i * dv..][..dv];
        axpy(row, k[i], u);
        if let Some(o) = o.as_deref_mut() {
            axpy(o, q[i], row);
        }
    }
}

/// Forward: `(o [B, T, H, dv], S_T [B, H, dk, dv])`. The state restarts from zero before
/// every token in `resets` (packed documents).
pub(crate) fn forward(x: &Inputs, d: Dims, resets: &[usize]) -> (Vec<f32>, Vec<f32>) {
    let (dk, dv, t) = (d.dk, d.dv, d.t);
    let mut fin = x.h0[..d.b * d.h * dk * dv].to_vec();
    let outs: Vec<Vec<f32>> = fin
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(xi, s)| {
            let h = x.head(d, xi);
            let mut o = vec![0f32; t * dv];
            let (mut kappa, mut u) = (vec![0f32; dv], vec![0f32; dv]);
            for ti in 0..t {
                if resets.binary_search(&ti).is_ok() {
                    s.fill(0.0);
                }
                step(s, &h, ti, d, &mut kappa, &mut u, Some(&mut o[ti * dv..][..dv]));
            }
            o
        })
        .collect();
    (scatter_heads(&outs, d, dv), fin)
}

/// Gradients `(∂q, ∂k, ∂v, ∂g, ∂β, ∂h0)` (in the inputs' layouts) for upstream `∂o`
/// `[B, T, H, dv]` and `∂S_T` `[B, H, dk, dv]`; `chunk` sets the checkpoint spacing. With
/// `resets` as in [`forward`]: a token after a reset reads a zero state, and no gradient
/// flows back across it.
pub(crate) fn backward(x: &Inputs, d: Dims, d_o: &[f32], d_final: &[f32], chunk: usize, resets: &[usize]) -> [Vec<f32>; 6] {
    let reset = |ti: usize| resets.binary_search(&ti).is_ok();
    let (dk, dv, t) = (d.dk, d.dv, d.t);
    let chunk = chunk.clamp(1, t.max(1));
    let n = t.div_ceil(chunk);
    let sz = dk * dv;
    let mut dh = d_final[..d.b * d.h * sz].to_vec();
    let per_head: Vec<[Vec<f32>; 5]> = dh
        .par_chunks_mut(sz)
        .enumerate()
        .map(|(xi, ds)| {
            let h = x.head(d, xi);
            let (mut dq, mut dkk, mut dg) = (vec![0f32; t * dk], vec![0f32; t * dk], vec![0f32; t * dk]);
            let (mut dv_, mut db) = (vec![0f32; t * dv], vec![0f32; t]);
            let o_base = ((xi / d.h) * t * d.h + xi % d.h) * dv;
            let d_o_row = |ti: usize| &d_o[o_base + ti * d.h * dv..][..dv];
            // states at chunk starts
            let mut starts = vec![0f32; n * sz];
            let mut s = x.h0[xi * sz..][..sz].to_vec();
            let (mut kappa, mut u) = (vec![0f32; dv], vec![0f32; dv]);
            for c in 0..n {
                starts[c * sz..][..sz].copy_from_slice(&s);
                for ti in c * chunk..((c + 1) * chunk).min(t) {
                    if reset(ti) {
                        s.fill(0.0);
                    }
                    step(&mut s, &h, ti, d, &mut kappa, &mut u, None);
                }
            }
            // states[r] is S after token lo + r − 1; the state token lo + r reads is that, or
            // zero after a reset
            let zero = vec![0f32; sz];
            // per chunk in reverse: the states inside it, then the tokens in reverse
            let mut states = vec![0f32; (chunk + 1) * sz];
            let mut kappas = vec![0f32; chunk * dv];
            let (mut du, mut dkap, mut vmk) = (vec![0f32; dv], vec![0f32; dv], vec![0f32; dv]);
            for c in (0..n).rev() {
                let (lo, hi) = (c * chunk, ((c + 1) * chunk).min(t));
                states[..sz].copy_from_slice(&starts[c * sz..][..sz]);
                for ti in lo..hi {
                    let r = ti - lo;
                    let (prev, next) = states.split_at_mut((r + 1) * sz);
                    next[..sz].copy_from_slice(if reset(ti) { &zero } else { &prev[r * sz..] });
                    step(&mut next[..sz], &h, ti, d, &mut kappas[r * dv..][..dv], &mut u, None);
                }
                for ti in (lo..hi).rev() {
                    let r = ti - lo;
                    let s_prev = if reset(ti) { &zero[..] } else { &states[r * sz..][..sz] };
                    let s_t = &states[(r + 1) * sz..][..sz];
                    let kap = &kappas[r * dv..][..dv];
                    let (q, k, g) = (h.qr(ti, dk), h.kr(ti, dk), h.gr(ti, dk));
                    let (v, b) = (h.vr(ti, dv), h.beta(ti));
                    let d_o = d_o_row(ti);
                    for j in 0..dv {
                        u[j] = b * (v[j] - kap[j]);
                    }
                    // o_t = S_tᵀ q and S_t = A + k uᵀ
                    du.fill(0.0);
                    for i in 0..dk {
                        let (row, st) = (&mut ds[i * dv..][..dv], &s_t[i * dv..][..dv]);
                        axpy(row, q[i], d_o);
                        dq[ti * dk + i] = dot(st, d_o);
                        dkk[ti * dk + i] = dot(row, &u);
                        axpy(&mut du, k[i], row);
                    }
                    // u = β (v − κ)
                    for j in 0..dv {
                        dv_[ti * dv + j] = b * du[j];
                        vmk[j] = v[j] - kap[j];
                        dkap[j] = -b * du[j];
                    }
                    db[ti] = dot(&du, &vmk);
                    // κ = Aᵀ k and A = α ⊙ S_{t−1}:  ∂A = ∂S + k ∂κᵀ,  ∂g = α·rowsum(∂A ⊙ S_{t−1})
                    for i in 0..dk {
                        let a = g[i].exp();
                        let (row, sp) = (&mut ds[i * dv..][..dv], &s_prev[i * dv..][..dv]);
                        axpy(row, k[i], &dkap);
                        dkk[ti * dk + i] += a * dot(sp, &dkap);
                        dg[ti * dk + i] = a * dot(row, sp);
                        row.iter_mut().for_each(|r| *r *= a);
                    }
                    if reset(ti) {
                        // the state before the reset reaches nothing after it
                        ds.fill(0.0);
                    }
                }
            }
            [dq, dkk, dg, dv_, db]
        })
        .collect();
    let mut parts: [Vec<Vec<f32>>; 5] = Default::default();
    for grads in per_head {
        for (dst, g) in parts.iter_mut().zip(grads) {
            dst.push(g);
        }
    }
    let [dq, dkk, dg, dv_, db] = parts;
    [scatter_heads(&dq, d, dk), scatter_heads(&dkk, d, dk), scatter_heads(&dv_, d, dv), scatter_heads(&dg, d, dk), scatter_heads(&db, d, 1), dh]
}
