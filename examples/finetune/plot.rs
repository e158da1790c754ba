//! A small loss-curve PNG: train loss as a line, validation loss as dots, labelled axes. Drawn
//! directly with the `image` crate (a 5×7 bitmap font for the few glyphs needed) to keep the
//! example free of font files and plotting dependencies.

use std::path::Path;

use image::{Rgb, RgbImage};

const W: u32 = 900;
const H: u32 = 540;
const LEFT: f64 = 90.0;
const RIGHT: f64 = 30.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;

fn glyph(c: char) -> Option<[u8; 7]> {
    Some(match c {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        'a' => [0, 0, 0x0E, 0x01, 0x0F, 0x11, 0x0F],
        'd' => [0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F],
        'e' => [0, 0, 0x0E, 0x11, 0x1F, 0x10, 0x0E],
        'i' => [0x04, 0, 0x0C, 0x04, 0x04, 0x04, 0x0E],
        'l' => [0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'n' => [0, 0, 0x16, 0x19, 0x11, 0x11, 0x11],
        'o' => [0, 0, 0x0E, 0x11, 0x11, 0x11, 0x0E],
        'p' => [0, 0, 0x1E, 0x11, 0x11, 0x1E, 0x10],
        'r' => [0, 0, 0x16, 0x19, 0x10, 0x10, 0x10],
        's' => [0, 0, 0x0E, 0x10, 0x0E, 0x01, 0x1E],
        't' => [0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06],
        'v' => [0, 0, 0x11, 0x11, 0x11, 0x0A, 0x04],
        ' ' => [0; 7],
        _ => return None,
    })
}

/// Draw `text` with its top-left corner at `(x, y)`, glyphs scaled by 2.
fn text(img: &mut RgbImage, x: i64, y: i64, s: &str, color: Rgb<u8>) {
    for (k, c) in s.chars().enumerate() {
        let Some(g) = glyph(c) else { continue };
        for (row, bits) in g.iter().enumerate() {
            for col in 0..5 {
                if bits & (0x10 >> col) != 0 {
                    for dy in 0..2 {
                        for dx in 0..2 {
                            put(img, x + k as i64 * 12 + col * 2 + dx, y + row as i64 * 2 + dy, color);
                        }
                    }
                }
            }
        }
    }
}

fn text_width(s: &str) -> i64 {
    s.chars().count() as i64 * 12
}

fn put(img: &mut RgbImage, x: i64, y: i64, c: Rgb<u8>) {
    if x >= 0 && y >= 0 && (x as u32) < W && (y as u32) < H {
        img.put_pixel(x as u32, y as u32, c);
    }
}

fn line(img: &mut RgbImage, (x0, y0): (f64, f64), (x1, y1): (f64, f64), c: Rgb<u8>, width: i64) {
    let n = ((x1 - x0).abs().max((y1 - y0).abs()).ceil() as usize).max(1);
    for i in 0..=n {
        let t = i as f64 / n as f64;
        let (x, y) = ((x0 + (x1 - x0) * t).round() as i64, (y0 + (y1 - y0) * t).round() as i64);
        for d in 0..width {
            put(img, x, y + d - width / 2, c);
            put(img, x + d - width / 2, y, c);
        }
    }
}

/// Round tick spacing covering `span` in about `n` steps (1, 2 or 5 × 10^k).
fn tick(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1e-12);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * p).find(|&s| s >= raw).unwrap_or(10.0 * p)
}

fn fmt(v: f64, step: f64) -> String {
    let decimals = if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize };
    format!("{v:.decimals$}")
}

/// Write the plot of `train` and `val` (`(step, loss)`) to `path`.
pub fn loss_curve(path: &Path, train: &[(f64, f64)], val: &[(f64, f64)]) -> Result<(), String> {
    let mut img = RgbImage::from_pixel(W, H, Rgb([255, 255, 255]));
    let all: Vec<&(f64, f64)> = train.iter().chain(val).filter(|p| p.1.is_finite()).collect();
    if all.is_empty() {
        return Err("no finite losses to plot".into());
    }
    let (mut x0, mut x1) = (0.0f64, all.iter().map(|p| p.0).fold(1.0, f64::max));
    let (mut y0, mut y1) = (all.iter().map(|p| p.1).fold(f64::INFINITY, f64::min), all.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max));
    let (xt, yt) = (tick(x1 - x0, 8.0), tick((y1 - y0).max(1e-6), 6.0));
    x0 = (x0 / xt).floor() * xt;
    x1 = ((x1 / xt).ceil() * xt).max(x0 + xt);
    y0 = (y0 / yt).floor() * yt;
    y1 = ((y1 / yt).ceil() * yt).max(y0 + yt); // a flat curve still gets a band
    let (pw, ph) = (W as f64 - LEFT - RIGHT, H as f64 - TOP - BOTTOM);
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * pw;
    let sy = |y: f64| TOP + (1.0 - (y - y0) / (y1 - y0)) * ph;
    let (grid, axis, ink) = (Rgb([228, 228, 228]), Rgb([60, 60, 60]), Rgb([30, 30, 30]));
    let mut v = y0;
    while v <= y1 + yt * 1e-6 {
        line(&mut img, (LEFT, sy(v)), (LEFT + pw, sy(v)), grid, 1);
        let label = fmt(v, yt);
        text(&mut img, LEFT as i64 - 10 - text_width(&label), sy(v) as i64 - 7, &label, ink);
        v += yt;
    }
    let mut v = x0;
    while v <= x1 + xt * 1e-6 {
        line(&mut img, (sx(v), TOP), (sx(v), TOP + ph), grid, 1);
        let label = fmt(v, xt);
        text(&mut img, sx(v) as i64 - text_width(&label) / 2, (TOP + ph) as i64 + 10, &label, ink);
        v += xt;
    }
    line(&mut img, (LEFT, TOP + ph), (LEFT + pw, TOP + ph), axis, 2);
    line(&mut img, (LEFT, TOP), (LEFT, TOP + ph), axis, 2);
    text(&mut img, (LEFT + pw / 2.0) as i64 - text_width("step") / 2, H as i64 - 24, "step", ink);
    text(&mut img, 10, 14, "loss", ink);
    let (blue, orange) = (Rgb([31, 119, 180]), Rgb([230, 120, 20]));
    for w in train.windows(2) {
        if w[0].1.is_finite() && w[1].1.is_finite() {
            line(&mut img, (sx(w[0].0), sy(w[0].1)), (sx(w[1].0), sy(w[1].1)), blue, 2);
        }
    }
    for &(x, y) in val.iter().filter(|p| p.1.is_finite()) {
        for dy in -4..=4i64 {
            for dx in -4..=4i64 {
                if dx * dx + dy * dy <= 16 {
                    put(&mut img, sx(x) as i64 + dx, sy(y) as i64 + dy, orange);
                }
            }
        }
    }
    // legend
    let lx = (LEFT + pw) as i64 - 260;
    line(&mut img, (lx as f64, 22.0), (lx as f64 + 30.0, 22.0), blue, 3);
    text(&mut img, lx + 40, 15, "train", ink);
    for dy in -4..=4i64 {
        for dx in -4..=4i64 {
            if dx * dx + dy * dy <= 16 {
                put(&mut img, lx + 125 + dx, 22 + dy, orange);
            }
        }
    }
    text(&mut img, lx + 140, 15, "validation", ink);
    let tmp = path.with_extension("png.partial");
    img.save_with_format(&tmp, image::ImageFormat::Png).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| format!("{}: {e}", path.display()))
}
