//! Building blocks of the fused host loops (the Flex bodies in `ops::*`).
//!
//! * [`dot`]: an inner product in 16 independent partial sums. A plain
//!   `zip().map().sum::<f32>()` is one sequential chain of adds (LLVM may not reorder float
//!   additions), so it runs one add per ~4 cycles; 16 partial sums become one vector register
//!   of adds. The order is fixed, so the result depends on the inputs only — never on the
//!   thread count.
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
#[inline]
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
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0] + tail
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
    par_rows(src.len(), BLOCK, |i, c| c.copy_from_slice(&src[i * BLOCK..][..c.len()]))
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
    fn par_rows_fills_every_chunk() {
        let v = par_rows(1000, 64, |i, c| c.iter_mut().enumerate().for_each(|(j, x)| *x += (i * 64 + j) as f32));
        assert!(v.iter().enumerate().all(|(j, &x)| x == j as f32));
        assert!(par_zeros(100_000).iter().all(|&x| x == 0.0));
    }
}
