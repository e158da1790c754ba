//! Antialiased bicubic resampling of 8-bit images, the algorithm of PIL's `ImagingResample`
//! that PyTorch's CPU uint8 `interpolate(mode="bicubic", antialias=True)` also follows.
//!
//! Per axis: output pixel `i` reads the input window around `c = (i + ½)·s` (`s = in/out`) of
//! half-width `2·max(s, 1)`, with weights `K((j − c + ½)/max(s, 1))` of the cubic kernel
//! (`a = −½`) normalised to sum 1, rounded to fixed point. The horizontal pass runs first into
//! an 8-bit intermediate, then the vertical one; each output is rounded and clamped to 0..255.
//!
//! The only difference between the two references is the fixed-point format of the weights:
//! PIL uses 22 fractional bits in i32 ([`Arithmetic::Pil`]); PyTorch (which torchvision, and so
//! HF's default image processor, calls) packs them into i16 with as many fractional bits as
//! the largest weight allows ([`Arithmetic::Torch`]). That is the ±1-level difference between
//! HF's torchvision and PIL backends.

/// Fixed-point format of the filter weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arithmetic {
    /// i32 weights with 22 fractional bits (Pillow).
    Pil,
    /// i16 weights with the largest precision that keeps every weight below 2^15 (PyTorch CPU).
    Torch,
}

fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One axis: per output pixel, the first input index and its fixed-point weights.
struct Taps {
    start: Vec<usize>,
    weights: Vec<Vec<i32>>,
    precision: u32,
}

fn taps(input: usize, output: usize, arith: Arithmetic) -> Taps {
    let scale = input as f64 / output as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    let mut start = Vec::with_capacity(output);
    let mut float_weights = Vec::with_capacity(output);
    for i in 0..output {
        let center = (i as f64 + 0.5) * scale;
        let lo = ((center - support + 0.5) as i64).max(0) as usize; // C cast: truncation
        let hi = ((center + support + 0.5) as i64).min(input as i64).max(lo as i64) as usize;
        let mut w: Vec<f64> = (lo..hi).map(|j| cubic((j as f64 - center + 0.5) / filter_scale)).collect();
        let total: f64 = w.iter().sum();
        if total != 0.0 {
            w.iter_mut().for_each(|x| *x /= total);
        }
        start.push(lo);
        float_weights.push(w);
    }
    let precision = match arith {
        Arithmetic::Pil => 22,
        Arithmetic::Torch => {
            let max = float_weights.iter().flatten().fold(0f64, |m, w| m.max(*w));
            let mut p = 0u32;
            while p < 22 && (((max * (1u64 << (p + 1)) as f64) + 0.5) as i64) < (1 << 15) {
                p += 1;
            }
            p
        }
    };
    let weights = float_weights
        .into_iter()
        .map(|w| {
            w.into_iter()
                .map(|x| {
                    let v = x * (1u64 << precision) as f64;
                    // round half away from zero
                    if v < 0.0 {
                        (v - 0.5) as i32
                    } else {
                        (v + 0.5) as i32
                    }
                })
                .collect()
        })
        .collect();
    Taps { start, weights, precision }
}

fn clamp8(acc: i64, precision: u32) -> u8 {
    (acc >> precision).clamp(0, 255) as u8
}

/// Resize an interleaved `[h, w, c]` 8-bit image to `[oh, ow, c]`.
pub(crate) fn resize_u8(src: &[u8], h: usize, w: usize, c: usize, oh: usize, ow: usize, arith: Arithmetic) -> Vec<u8> {
    assert_eq!(src.len(), h * w * c, "image buffer size");
    // horizontal pass
    let horizontal = if ow != w {
        let t = taps(w, ow, arith);
        let half = 1i64 << t.precision.saturating_sub(1);
        let mut out = vec![0u8; h * ow * c];
        for y in 0..h {
            for (x, (s, ws)) in t.start.iter().zip(&t.weights).enumerate() {
                for ch in 0..c {
                    let mut acc = if t.precision > 0 { half } else { 0 };
                    for (k, wk) in ws.iter().enumerate() {
                        acc += *wk as i64 * src[(y * w + s + k) * c + ch] as i64;
                    }
                    out[(y * ow + x) * c + ch] = clamp8(acc, t.precision);
                }
            }
        }
        out
    } else {
        src.to_vec()
    };
    if oh == h {
        return horizontal;
    }
    // vertical pass
    let t = taps(h, oh, arith);
    let half = 1i64 << t.precision.saturating_sub(1);
    let mut out = vec![0u8; oh * ow * c];
    for (y, (s, ws)) in t.start.iter().zip(&t.weights).enumerate() {
        for x in 0..ow {
            for ch in 0..c {
                let mut acc = if t.precision > 0 { half } else { 0 };
                for (k, wk) in ws.iter().enumerate() {
                    acc += *wk as i64 * horizontal[((s + k) * ow + x) * c + ch] as i64;
                }
                out[(y * ow + x) * c + ch] = clamp8(acc, t.precision);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_images_stay_constant() {
        for arith in [Arithmetic::Pil, Arithmetic::Torch] {
            let img = vec![77u8; 13 * 9 * 3];
            assert!(resize_u8(&img, 13, 9, 3, 5, 20, arith).iter().all(|&v| v == 77));
            assert!(resize_u8(&img, 13, 9, 3, 40, 4, arith).iter().all(|&v| v == 77));
        }
    }

    #[test]
    fn identity_size_is_a_copy() {
        let img: Vec<u8> = (0..6 * 4 * 3).map(|i| i as u8).collect();
        assert_eq!(resize_u8(&img, 6, 4, 3, 6, 4, Arithmetic::Torch), img);
    }
}
