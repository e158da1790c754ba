//! The image processor (HF `Glm5NextImageProcessor`, `image_processing_glm5_next.py`): decode → RGB →
//! `smart_resize` canvas (28-pixel factor, 16…8000 tokens of 2·28² pixels) → aspect-preserving
//! antialiased bicubic resize of the content → zero padding right/bottom → rescale + CLIP
//! normalisation → two identical frames → patches `[gh·gw, 3·2·14·14]` in merge-block-major
//! order, and `image_grid_thw = [1, gh, gw]`.

use std::path::Path;

use super::resize::{resize_u8, Arithmetic};

/// OpenAI CLIP mean and std (the reference's `OPENAI_CLIP_MEAN`/`_STD` literals).
#[allow(clippy::excessive_precision)]
pub const CLIP_MEAN: [f32; 3] = [0.48145466, 0.4578275, 0.40821073];
/// Per-channel std of the normalisation (OpenAI CLIP's).
#[allow(clippy::excessive_precision)]
pub const CLIP_STD: [f32; 3] = [0.26862954, 0.26130258, 0.27577711];

/// Errors of the image pipeline, naming the image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The file could not be read.
    #[error("{path}: cannot read image: {message}")]
    Read {
        /// The image's path or origin.
        path: String,
        /// The OS error.
        message: String,
    },
    /// The bytes are not a decodable image.
    #[error("{path}: cannot decode image (corrupt or truncated?): {message}")]
    Decode {
        /// The image's path or origin.
        path: String,
        /// The decoder's error.
        message: String,
    },
    /// An image whose decoded pixels exceed the decoder's memory limit.
    #[error(
        "{path}: image of {width}×{height} pixels is too large: decoding it needs about {needed_mib} MiB, over the \
         decoder's limit of {limit_mib} MiB (the processor resizes every image to at most {max_pixels} pixels anyway; \
         downscale it first)"
    )]
    TooLarge {
        /// The image's path or origin.
        path: String,
        /// Its width.
        width: u32,
        /// Its height.
        height: u32,
        /// What its decoded 8-bit RGBA pixels take.
        needed_mib: u64,
        /// The decoder's allocation limit.
        limit_mib: u64,
        /// The processor's largest image (merged tokens × patch area).
        max_pixels: u64,
    },
    /// An image without pixels.
    #[error("{what}: zero-size image ({width}×{height})")]
    Empty {
        /// The image's path or origin.
        what: String,
        /// Its width.
        width: usize,
        /// Its height.
        height: usize,
    },
    /// An image that cannot fit the token budget.
    #[error("image budget: {0}")]
    Budget(String),
}

/// An 8-bit RGB image, row-major `[h, w, 3]`.
#[derive(Debug, Clone, PartialEq)]
pub struct RgbImage {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// `[h, w, 3]` row-major.
    pub data: Vec<u8>,
}

impl RgbImage {
    /// Decode PNG or JPEG bytes to 8-bit RGB as HF's processor does (`convert_to_rgb` in
    /// `transformers/image_transforms.py`, on the PIL image): transparency — an alpha channel,
    /// a palette or gray key with `tRNS` — is composited onto white,
    /// `round((c·a + 255·(255 − a)) / 255)` (PIL's `alpha_composite`, exact); grayscale is
    /// replicated; 16-bit grayscale is clipped to 255 (PIL's `I;16` → `RGB`), 16-bit colour
    /// keeps the high byte (PIL reads it as `RGB;16B`). CMYK JPEGs come out of the decoder as
    /// RGB (`(255−c)(255−k)/255`, as PIL converts).
    pub fn decode(bytes: &[u8], what: &str) -> Result<Self, ImageError> {
        use image::DynamicImage as D;
        let img = image::load_from_memory(bytes).map_err(|e| match e {
            image::ImageError::Limits(_) => {
                let dims = image::ImageReader::new(std::io::Cursor::new(bytes)).with_guessed_format().ok().and_then(|r| r.into_dimensions().ok());
                let (width, height) = dims.unwrap_or((0, 0));
                let limit = image::Limits::default().max_alloc.unwrap_or(512 << 20);
                let p = ImageProcessor::default();
                ImageError::TooLarge {
                    path: what.into(),
                    width,
                    height,
                    needed_mib: (width as u64 * height as u64 * 4) >> 20,
                    limit_mib: limit >> 20,
                    max_pixels: (p.max_image_tokens * p.merge_size * p.merge_size * p.patch_size * p.patch_size) as u64,
                }
            }
            e => ImageError::Decode { path: what.into(), message: e.to_string() },
        })?;
        let (w, h) = (img.width() as usize, img.height() as usize);
        if w == 0 || h == 0 {
            return Err(ImageError::Empty { what: what.into(), width: w, height: h });
        }
        let over_white = |c: u16, a: u16| -> u8 { ((c as u32 * a as u32 + 255 * (255 - a as u32) + 127) / 255) as u8 };
        let hi = |v: u16| (v >> 8) as u8;
        let data: Vec<u8> = match &img {
            D::ImageRgb8(i) => i.as_raw().clone(),
            D::ImageLuma8(i) => i.as_raw().iter().flat_map(|&g| [g; 3]).collect(),
            D::ImageLumaA8(i) => i.as_raw().chunks_exact(2).flat_map(|p| [over_white(p[0] as u16, p[1] as u16); 3]).collect(),
            D::ImageRgba8(i) => i.as_raw().chunks_exact(4).flat_map(|p| [0, 1, 2].map(|c| over_white(p[c] as u16, p[3] as u16))).collect(),
            D::ImageLuma16(i) => i.as_raw().iter().flat_map(|&g| [g.min(255) as u8; 3]).collect(),
            D::ImageLumaA16(i) => i.as_raw().chunks_exact(2).flat_map(|p| [over_white(hi(p[0]) as u16, hi(p[1]) as u16); 3]).collect(),
            D::ImageRgb16(i) => i.as_raw().iter().map(|&v| hi(v)).collect(),
            D::ImageRgba16(i) => i.as_raw().chunks_exact(4).flat_map(|p| [0, 1, 2].map(|c| over_white(hi(p[c]) as u16, hi(p[3]) as u16))).collect(),
            other => other.to_rgb8().into_raw(),
        };
        Ok(Self { width: w, height: h, data })
    }

    /// Read and decode a file.
    pub fn open(path: &Path) -> Result<Self, ImageError> {
        let bytes = std::fs::read(path).map_err(|e| ImageError::Read { path: path.display().to_string(), message: e.to_string() })?;
        Self::decode(&bytes, &path.display().to_string())
    }
}

/// Processor settings (the checkpoint's `preprocessor_config.json` defaults).
#[derive(Debug, Clone)]
pub struct ImageProcessor {
    /// Patch side in pixels (14).
    pub patch_size: usize,
    /// Frames per temporal patch (2; an image is repeated).
    pub temporal_patch_size: usize,
    /// Merge block side (2).
    pub merge_size: usize,
    /// Fewest merged tokens per image.
    pub min_image_tokens: usize,
    /// Most merged tokens per image.
    pub max_image_tokens: usize,
    /// Per-channel mean of the normalisation.
    pub mean: [f32; 3],
    /// Per-channel std of the normalisation.
    pub std: [f32; 3],
    /// Resampling arithmetic: torchvision's (HF's default backend) or PIL's.
    pub arithmetic: Arithmetic,
}

impl Default for ImageProcessor {
    fn default() -> Self {
        Self {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            min_image_tokens: 16,
            max_image_tokens: 8000,
            mean: CLIP_MEAN,
            std: CLIP_STD,
            arithmetic: Arithmetic::Torch,
        }
    }
}

/// One processed image.
#[derive(Debug, Clone)]
pub struct ProcessedImage {
    /// `[gh·gw, 3·T·P·P]` row-major.
    pub pixel_values: Vec<f32>,
    /// `[1, gh, gw]`.
    pub grid_thw: [usize; 3],
}

impl ProcessedImage {
    /// LM placeholder tokens of this image (`gh·gw / merge²`).
    pub fn n_tokens(&self, merge: usize) -> usize {
        self.grid_thw.iter().product::<usize>() / (merge * merge)
    }
}

/// `(height, width)`.
pub type Size = (usize, usize);

fn align(v: usize, f: usize) -> usize {
    v.div_ceil(f) * f
}

/// HF `smart_resize`: the aligned canvas `(height, width)` within the token budget.
pub(crate) fn smart_resize(
    num_frames: usize,
    height: usize,
    width: usize,
    temporal_factor: usize,
    factor: usize,
    min_tokens: usize,
    max_tokens: usize,
) -> Result<(usize, usize), ImageError> {
    let per_token = temporal_factor * factor * factor;
    let (min_px, max_px) = (min_tokens * per_token, max_tokens * per_token);
    // round(num_frames / t) * t with Python's banker's rounding
    let ratio = num_frames as f64 / temporal_factor as f64;
    let frames = temporal_factor.max((round_half_even(ratio) as usize) * temporal_factor);
    let (mut h, mut w) = (align(height, factor), align(width, factor));
    if frames * h * w < min_px {
        let scale = (min_px as f64 / (num_frames * height * width) as f64).sqrt();
        h = align(((height as f64 * scale).ceil() as usize).max(1), factor);
        w = align(((width as f64 * scale).ceil() as usize).max(1), factor);
    }
    if frames * h * w > max_px {
        if max_px < frames * factor * factor {
            return Err(ImageError::Budget(format!(
                "max_pixels={max_px} is too small: at least {} pixels are required for one aligned patch",
                frames * factor * factor
            )));
        }
        let (mut lo, mut hi) = (1usize, height);
        let (mut best_h, mut best_w) = (factor, factor);
        while lo <= hi {
            let ch = (lo + hi) / 2;
            let cw = ((width as f64 * ch as f64 / height as f64).floor() as usize).max(1);
            let (ah, aw) = (align(ch, factor), align(cw, factor));
            if frames * ah * aw <= max_px {
                (best_h, best_w) = (ah, aw);
                lo = ch + 1;
            } else {
                hi = ch - 1;
            }
        }
        (h, w) = (best_h, best_w);
    }
    Ok((h, w))
}

fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

impl ImageProcessor {
    /// The canvas and content sizes for an image: `((canvas_h, canvas_w), (content_h, content_w))`.
    pub fn geometry(&self, height: usize, width: usize) -> Result<(Size, Size), ImageError> {
        let factor = self.patch_size * self.merge_size;
        let t = self.temporal_patch_size;
        let (th, tw) = smart_resize(t, height, width, t, factor, self.min_image_tokens, self.max_image_tokens)?;
        let per_token = t * factor * factor;
        let mut scale = (th as f64 / height as f64).min(tw as f64 / width as f64);
        if t * height * width >= per_token * self.min_image_tokens {
            scale = scale.min(1.0);
        }
        let ch = th.min((height as f64 * scale).floor() as usize).max(1);
        let cw = tw.min((width as f64 * scale).floor() as usize).max(1);
        Ok(((th, tw), (ch, cw)))
    }

    /// Process one image.
    pub fn process(&self, img: &RgbImage) -> Result<ProcessedImage, ImageError> {
        if img.width == 0 || img.height == 0 {
            return Err(ImageError::Empty { what: "image".into(), width: img.width, height: img.height });
        }
        let ((th, tw), (ch, cw)) = self.geometry(img.height, img.width)?;
        let content = if (ch, cw) != (img.height, img.width) {
            resize_u8(&img.data, img.height, img.width, 3, ch, cw, self.arithmetic)
        } else {
            img.data.clone()
        };
        // normalise (fused like the reference: (x − 255·mean) / (255·std), in f32) and pad with
        // zeros, which normalise to −mean/std
        let mean: Vec<f32> = self.mean.iter().map(|m| m * (1.0f64 / (1.0 / 255.0)) as f32).collect();
        let std: Vec<f32> = self.std.iter().map(|s| s * (1.0f64 / (1.0 / 255.0)) as f32).collect();
        let mut chw = vec![0f32; 3 * th * tw]; // [3, th, tw]
        for c in 0..3 {
            for y in 0..th {
                for x in 0..tw {
                    let v = if y < ch && x < cw { content[(y * cw + x) * 3 + c] as f32 } else { 0.0 };
                    chw[(c * th + y) * tw + x] = (v - mean[c]) / std[c];
                }
            }
        }
        // patchify: [gh/m, gw/m, m, m] blocks of [C, T, P, P] values
        let (p, m, t) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (gh, gw) = (th / p, tw / p);
        let dim = 3 * t * p * p;
        let mut out = Vec::with_capacity(gh * gw * dim);
        for br in 0..gh / m {
            for bc in 0..gw / m {
                for a in 0..m {
                    for b in 0..m {
                        let (py, px) = ((br * m + a) * p, (bc * m + b) * p);
                        for c in 0..3 {
                            for _ in 0..t {
                                for yy in 0..p {
                                    let row = (c * th + py + yy) * tw + px;
                                    out.extend_from_slice(&chw[row..row + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(ProcessedImage { pixel_values: out, grid_thw: [1, gh, gw] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_images_reach_the_minimum_budget() {
        // 16 tokens of 2·28² pixels: a 10×10 image becomes a 112×112 canvas (4×4 merge blocks)
        assert_eq!(smart_resize(2, 10, 10, 2, 28, 16, 8000).unwrap(), (112, 112));
    }

    #[test]
    fn huge_images_fit_the_maximum_budget() {
        let (h, w) = smart_resize(2, 10_000, 3_000, 2, 28, 16, 8000).unwrap();
        assert!(h * w / (28 * 28) <= 8000 && h % 28 == 0 && w % 28 == 0, "{h}×{w}");
    }
}
