//! The image processor against both reference backends (`Glm5NextImageProcessor`, torchvision,
//! HF's default; `Glm5NextImageProcessorPil`): grids identical, 16 sampled patch rows and the
//! sum over all values compared, for procedural images (tiny, odd aspect ratios, above the
//! token budget) and PNG files (grayscale, RGBA).

mod common;

use common::*;
use glm5_burn::data::image_processor::{ImageProcessor, RgbImage};
use glm5_burn::data::resize::Arithmetic;

/// Mirror of `pattern_image` in make_fixtures.py.
fn pattern(w: usize, h: usize, seed: i64) -> RgbImage {
    let mut data = Vec::with_capacity(w * h * 3);
    for y in 0..h as i64 {
        for x in 0..w as i64 {
            let hsh = ((x * 73856093) ^ (y * 19349663) ^ (seed * 83492791)) & 0xFFFF;
            let r = (x * 255 / (w as i64 - 1).max(1) + (hsh & 31)) & 0xFF;
            let g = (y * 255 / (h as i64 - 1).max(1) + ((hsh >> 5) & 31)) & 0xFF;
            let b = ((x + y) * 7 + ((hsh >> 10) & 63)) & 0xFF;
            data.extend([r as u8, g as u8, b as u8]);
        }
    }
    RgbImage { width: w, height: h, data }
}

const SIZES: [(usize, usize); 6] = [(10, 7), (33, 71), (640, 480), (1000, 333), (227, 1500), (4100, 3900)];

fn cases() -> Vec<(String, RgbImage)> {
    let mut v: Vec<(String, RgbImage)> = SIZES.iter().enumerate().map(|(i, &(w, h))| (format!("pattern_{w}x{h}"), pattern(w, h, i as i64))).collect();
    for f in ["gray", "rgba"] {
        let path = fixtures().join("images").join(format!("{f}.png"));
        v.push((format!("{f}_png"), RgbImage::open(&path).unwrap()));
    }
    v
}

#[test]
fn processor_matches_both_reference_backends() {
    let io = Io::open(&fixtures().join("images").join("reference.safetensors"));
    for (tag, arith) in [("tv", Arithmetic::Torch), ("pil", Arithmetic::Pil)] {
        let proc = ImageProcessor { arithmetic: arith, ..ImageProcessor::default() };
        let (mut worst, mut worst_other) = (0f32, 0f32);
        for (name, img) in cases() {
            let out = proc.process(&img).unwrap();
            let grid: Vec<usize> = io.i64(&format!("{name}.{tag}.grid")).iter().map(|&x| x as usize).collect();
            assert_eq!(out.grid_thw.to_vec(), grid, "{name}: grid");
            let dim = 1176;
            assert_eq!(out.pixel_values.len(), grid.iter().product::<usize>() * dim);
            let rows = io.i64(&format!("{name}.{tag}.rows"));
            let sample = io.f32(&format!("{name}.{tag}.sample"));
            let other = if tag == "tv" { "pil" } else { "tv" };
            let other_sample = io.f32(&format!("{name}.{other}.sample"));
            let (mut max_d, mut max_o, mut sum_d) = (0f32, 0f32, 0f64);
            for (k, &r) in rows.iter().enumerate() {
                let ours = &out.pixel_values[r as usize * dim..(r as usize + 1) * dim];
                for (j, v) in ours.iter().enumerate() {
                    let d = (v - sample[k * dim + j]).abs();
                    max_d = max_d.max(d);
                    sum_d += d as f64;
                    max_o = max_o.max((v - other_sample[k * dim + j]).abs());
                }
            }
            let total: f64 = out.pixel_values.iter().map(|&v| v as f64).sum();
            let ref_total = io.f64(&format!("{name}.{tag}.sum"))[0];
            println!("{tag:3} {name:20} grid {grid:?}: max|Δ| {max_d:.2e}, mean|Δ| {:.2e}, vs the other backend {max_o:.4}, sum {total:.3} vs {ref_total:.3}",
                sum_d / (rows.len() * dim) as f64);
            worst = worst.max(max_d);
            worst_other = worst_other.max(max_o);
            assert!((total - ref_total).abs() <= 1e-3 * ref_total.abs().max(1.0) + 1e-2, "{name}: sum {total} vs {ref_total}");
        }
        // Matching the backend's fixed-point arithmetic reproduces its 8-bit resize exactly;
        // what is left is f32 rounding of the normalisation (one ulp at |x| ≤ 2.2).
        assert!(worst <= 1e-6, "{tag}: max|Δ| {worst:e}");
        println!("{tag}: worst max|Δ| {worst:.2e}; the two reference backends differ by up to {worst_other:.4}");
    }
}

#[test]
fn jpeg_decodes_close_to_pil() {
    // JPEG decoders differ in IDCT and chroma upsampling (PIL's libjpeg "fancy" upsampling vs
    // image-rs), so only closeness is expected: measured mean 0.55 levels, max 22 at chroma edges
    let ours = RgbImage::open(&fixtures().join("images").join("photo.jpg")).unwrap();
    assert_eq!((ours.width, ours.height), (40, 30));
    let pil = Io::open(&fixtures().join("images").join("reference.safetensors")).f32("photo_jpg.pil_rgb");
    let diffs: Vec<f64> = ours.data.iter().zip(&pil).map(|(a, b)| (*a as f64 - *b as f64).abs()).collect();
    let (mean, max) = (diffs.iter().sum::<f64>() / diffs.len() as f64, diffs.iter().fold(0f64, |m, d| m.max(*d)));
    println!("JPEG decode vs PIL: mean |Δ| {mean:.3} levels, max {max}");
    assert!(mean < 1.0 && max <= 32.0, "mean |Δ| {mean}, max {max} levels from PIL's decode");
}

#[test]
fn bad_images_are_clear_errors() {
    let e = RgbImage::decode(b"\\x89PNG\\r\\n\\x1a\\nthis is not a png", "broken.png").unwrap_err().to_string();
    assert!(e.contains("broken.png") && e.contains("decode"), "{e}");
    let png = std::fs::read(fixtures().join("images").join("gray.png")).unwrap();
    let e = RgbImage::decode(&png[..png.len() / 2], "truncated.png").unwrap_err().to_string();
    assert!(e.contains("truncated.png"), "{e}");
    let e = RgbImage::open(std::path::Path::new("/nonexistent.png")).unwrap_err().to_string();
    assert!(e.contains("/nonexistent.png"), "{e}");
    let e = ImageProcessor::default().process(&RgbImage { width: 0, height: 5, data: vec![] }).unwrap_err().to_string();
    assert!(e.contains("zero-size"), "{e}");
}

/// Images in other modes than 8-bit RGB decode as HF's processor converts them
/// (`convert_to_rgb`: transparency composited onto white; `make_fixtures.py image_modes`), and
/// the processed pixels then match the torchvision processor's sum.
#[test]
fn image_modes_convert_as_the_reference_does() {
    let dir = fixtures().join("image_modes");
    let io = Io::open(&dir.join("reference.safetensors"));
    let proc = ImageProcessor::default();
    for (file, exact) in [
        ("rgba_semi.png", true),
        ("la.png", true),
        ("palette_trns.png", true),
        ("transparent.png", true),
        ("gray16.png", true),
        ("rgb16.png", true),
        // JPEG decoders differ in IDCT and upsampling (see jpeg_decodes_close_to_pil)
        ("cmyk.jpg", false),
    ] {
        let name = file.replace('.', "_");
        let ours = RgbImage::open(&dir.join(file)).unwrap();
        let reference = io.f32(&format!("{name}.rgb"));
        assert_eq!(ours.data.len(), reference.len(), "{file}: size");
        let diffs: Vec<f64> = ours.data.iter().zip(&reference).map(|(a, b)| (*a as f64 - *b as f64).abs()).collect();
        let (mean, max) = (diffs.iter().sum::<f64>() / diffs.len() as f64, diffs.iter().fold(0f64, |m, d| m.max(*d)));
        let out = proc.process(&ours).unwrap();
        let grid: Vec<usize> = io.i64(&format!("{name}.grid")).iter().map(|&x| x as usize).collect();
        let total: f64 = out.pixel_values.iter().map(|&v| v as f64).sum();
        let ref_total = io.f64(&format!("{name}.sum"))[0];
        println!("{file:18} vs convert_to_rgb: mean |Δ| {mean:.3} levels, max {max}; pixel sum {total:.3} vs {ref_total:.3}");
        assert_eq!(out.grid_thw.to_vec(), grid, "{file}: grid");
        if exact {
            assert_eq!(max, 0.0, "{file}: decoded RGB differs from the reference conversion (mean {mean}, max {max})");
            assert!((total - ref_total).abs() <= 1e-3 * ref_total.abs().max(1.0) + 1e-2, "{file}: sum {total} vs {ref_total}");
        } else {
            // measured: mean 0.012 levels, max 1 (the decoders' IDCT rounding)
            assert!(mean < 0.1 && max <= 2.0, "{file}: mean |Δ| {mean}, max {max} levels from PIL's decode");
        }
    }
}
