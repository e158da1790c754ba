//! Building blocks of the fused host loops (the Flex bodies in `ops::*`).
//!
//! * [`dot`]: an inner product in 16 independent partial sums. A plain
//!   `zip().map().sum::<f32>()` is one sequential chain of adds (LLVM may not reorder float
//!   additions), so it runs one add per ~4 cycles; 16 partial sums become one vector register
//!   of adds. The order is fixed, so the result depends on the inputs only — never on the
//!   thread count.
//! * [`exp`]: `eˣ` without a branch or a library call, so loops over it vectorise (the C
//!   library's `expf` is one scalar call per element).
//!   [`sigmoid`] on top of it.
//! * [`par_rows`]: a new buffer written by parallel chunks, each chunk zeroed by the thread
//!   that then fills it. `vec![0.0; n]` zero-fills on the calling thread before any parallel
//!   work starts (glibc's `calloc` must clear reused heap memory), and `x.to_vec()` copies on
//!   it — single-threaded passes over every output that `perf` showed as a tenth of the main
//!   thread's samples in a train step.

use std::mem::MaybeUninit;

use rayon::prelude::*;

/// Lanes of [`dot`]'s partial sums (one AVX-512 register, two AVX2 registers).
const LANES: usize = 16;

/// `Σ_j a_j b_j` over the common length, in [`LANES`] partial sums summed pairwise.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    fold_lanes(acc) + tail
}

/// `Σ_j f(a_j)` in [`LANES`] partial sums summed pairwise (see [`dot`]).
#[inline(always)]
pub(crate) fn sum_map(a: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = a.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().map(|&x| f(x)).sum();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += f(c[l]);
        }
    }
    fold_lanes(acc) + tail
}

/// The largest element (−∞ for none; NaN if any is NaN), in [`LANES`] partial maxima.
#[inline(always)]
pub(crate) fn max(a: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = a.chunks_exact(LANES);
    let mut m = chunks.remainder().iter().fold(f32::NEG_INFINITY, |m, &x| if x > m || x.is_nan() { x } else { m });
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] || c[l].is_nan() { c[l] } else { acc[l] };
        }
    }
    for x in acc {
        m = if x > m || x.is_nan() { x } else { m };
    }
    m
}

/// The partial sums of [`LANES`] lanes, pairwise.
#[inline(always)]
fn fold_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// `eˣ` in f32, branch-free. `x = k·ln 2 + r` with `k` the nearest integer to `x / ln 2` and
/// `|r| ≤ ln 2 / 2` (ln 2 in two parts, the first with few enough bits that `k·LN2_HI` is
/// exact); `eʳ` by its Taylor polynomial to degree 7 (truncation below 6e-9 relative); the
/// result scaled by `2ᵏ` through the exponent bits. Within 2 ulp of the exact value (tested
/// against f64 over the range); 0 below −87 (where `eˣ` leaves the normal range), `∞` above
/// 88.7, NaN for NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_359_4; // 355/512
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 − 355/512
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding and subtracting it rounds to an integer
    let xc = x.clamp(-87.0, 88.7);
    let k = (xc * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2ᵏ as two normal factors (k reaches 128 near the top of the range)
    let pow2 = |e: i32| f32::from_bits(((e + 127) as u32) << 23);
    let (k1, k) = ((k as i32) >> 1, k as i32);
    let y = p * pow2(k1) * pow2(k - k1);
    if x < -87.0 {
        0.0
    } else if x > 88.7 {
        f32::INFINITY
    } else {
        y
    }
}

/// `σ(x) = 1 / (1 + e^{−x})` through [`exp`] (0 and 1 at the far ends, NaN for NaN).
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// A new buffer of `n` elements built by `f(chunk_index, chunk)` over chunks of `chunk`
/// elements (the last may be shorter), in parallel; each chunk arrives zeroed.
pub(crate) fn par_rows<F>(n: usize, chunk: usize, f: F) -> Vec<f32>
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let mut out: Vec<f32> = Vec::with_capacity(n);
    out.spare_capacity_mut()[..n].par_chunks_mut(chunk.max(1)).enumerate().for_each(|(i, c)| {
        c.fill(MaybeUninit::new(0.0));
        // SAFETY: every element of `c` was initialised just above, and `MaybeUninit<f32>` has
        // the layout of `f32`.
        let c = unsafe { &mut *(c as *mut [MaybeUninit<f32>] as *mut [f32]) };
        f(i, c);
    });
    // SAFETY: the chunks cover `0..n`, all initialised above.
    unsafe { out.set_len(n) };
    out
}

/// Elements per block of [`par_zeros`] and [`par_copy`].
const BLOCK: usize = 1 << 16;

/// `n` zeros, cleared in parallel blocks (for outputs filled by several passes).
pub(crate) fn par_zeros(n: usize) -> Vec<f32> {
    par_rows(n, BLOCK, |_, _| {})
}

/// A copy of `src`, made in parallel blocks (for outputs updated in place).
pub(crate) fn par_copy(src: &[f32]) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(src.len());
    out.spare_capacity_mut()[..src.len()].par_chunks_mut(BLOCK).zip(src.par_chunks(BLOCK)).for_each(|(d, s)| {
        d.iter_mut().zip(s).for_each(|(d, &s)| {
            d.write(s);
        })
    });
    // SAFETY: the chunks cover `0..src.len()`, every element written just above.
    unsafe { out.set_len(src.len()) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_f64_sum() {
        for n in [0usize, 1, 7, 16, 31, 64, 257] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.5).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            // small multiples of 1/8: every partial sum is exact in f32
            assert_eq!(dot(&a, &b) as f64, want, "n = {n}");
        }
    }

    #[test]
    fn exp_within_two_ulp_of_f64() {
        let ulp = |v: f64| {
            let f = v as f32;
            (f32::from_bits(f.to_bits() + 1) - f) as f64
        };
        let mut worst = 0f64;
        for i in 0..=2_000_000 {
            let x = -87.0 + 175.7 * i as f32 / 2e6;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max((got - want).abs() / ulp(want));
        }
        println!("exp: worst error {worst:.3} ulp");
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn par_rows_fills_every_chunk() {
        let v = par_rows(1000, 64, |i, c| c.iter_mut().enumerate().for_each(|(j, x)| *x += (i * 64 + j) as f32));
        assert!(v.iter().enumerate().all(|(j, &x)| x == j as f32));
        assert!(par_zeros(100_000).iter().all(|&x| x == 0.0));
    }
}
