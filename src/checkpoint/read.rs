//! One module tensor from its checkpoint bytes, in one pass.
//!
//! Each source tensor (one, or one per routed expert for a stacked `[E, in, out]` weight) is
//! decoded — F32, BF16, F16, or FP8 E4M3 times its block scale, `W[i, j] = round_bf16(q[i, j]
//! · S[⌊i/b_r⌋, ⌊j/b_c⌋])` as in [`super::fp8`] — laid out as the module keeps it (copied, or
//! transposed `nn.Linear [out, in] → Burn Linear [in, out]`, [`super::hf_map::Transform`]),
//! and written straight into the destination buffer in the target dtype. There is no f32
//! staging copy, no second transpose buffer and no dtype conversion afterwards: the buffer
//! becomes the parameter's storage as it is (Flex takes [`TensorData`] without copying).
//!
//! The work goes in chunks of about [`CHUNK_BYTES`] of source rows, each split across rayon's
//! threads. After a chunk, its pages of the memory-mapped shard are released
//! (`madvise(MADV_DONTNEED)`: the kernel's page cache keeps them, this process stops mapping
//! them), so the loader's resident set is the destination tensors plus one chunk, not the
//! destination plus every checkpoint byte read so far.
//!
//! Non-finite values are detected in the same pass. Only then does the slower checked reader
//! ([`SafetensorsFiles::read_f32_finite`]) run on that tensor, to report it exactly as before:
//! the tensor, its shard, the first flat index, the count (or, for FP8, the element).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::{DType, TensorData};
use rayon::prelude::*;
use safetensors::tensor::Dtype;

use super::fp8::{BlockGrid, E4M3_TABLE};
use super::hf_map::Transform;
use super::safetensors_io::SafetensorsFiles;
use super::CheckpointError;

/// Checkpoint bytes per chunk: the bound on the source pages the loader keeps mapped at once.
pub const CHUNK_BYTES: usize = 32 << 20;

/// Transposes walk this many source rows at a time, so that every cache line of the source
/// rows read for one destination row is reused for the next ones.
const TILE_ROWS: usize = 16;

/// A module tensor in module layout and `dtype` (`F32`, `BF16` or `F16`), read from `sources`
/// in checkpoint layout by the rule `transform`.
pub(crate) fn read_module_tensor(
    files: &SafetensorsFiles,
    transform: Transform,
    sources: &[String],
    shape: &[usize],
    dtype: DType,
    allow_non_finite: bool,
) -> Result<TensorData, CheckpointError> {
    let rows = shape.first().copied().unwrap_or(1);
    read_module_rows(files, transform, sources, shape, 0..rows, rows, dtype, allow_non_finite)
}

/// Rows `window` (dim 0, module layout) of the module tensor of [`read_module_tensor`], as a
/// tensor of `padded` rows (`padded ≥ window.len()`; the rows past the window are zeros): an
/// FSDP rank's slice ([`crate::distributed::fsdp`]), decoded from only the checkpoint bytes
/// that hold it — source rows for a copied tensor, source columns for a transposed one, and
/// only the window's experts of an expert stack.
#[allow(clippy::too_many_arguments)]
pub(crate) fn read_module_rows(
    files: &SafetensorsFiles,
    transform: Transform,
    sources: &[String],
    shape: &[usize],
    window: Range<usize>,
    padded: usize,
    dtype: DType,
    allow_non_finite: bool,
) -> Result<TensorData, CheckpointError> {
    let rows = shape.first().copied().unwrap_or(1);
    if window.start > window.end || window.end > rows || padded < window.len() {
        return Err(CheckpointError::Internal(format!("rows {window:?} (padded to {padded}) of a tensor of {rows} rows")));
    }
    let width: usize = shape.iter().skip(1).product();
    let mut out_shape = shape.to_vec();
    if let Some(d0) = out_shape.first_mut() {
        *d0 = padded;
    }
    let n = padded * width;
    // zeroed by the allocator (pages appear on first write), then every element of the window written
    match dtype {
        DType::F32 => {
            let mut out = vec![0f32; n];
            fill(files, transform, sources, shape, window, &mut out, allow_non_finite)?;
            Ok(TensorData::new(out, out_shape))
        }
        DType::BF16 => {
            let mut out: Vec<half::bf16> = bytemuck::cast_vec(vec![0u16; n]);
            fill(files, transform, sources, shape, window, &mut out, allow_non_finite)?;
            Ok(TensorData::new(out, out_shape))
        }
        DType::F16 => {
            let mut out: Vec<half::f16> = bytemuck::cast_vec(vec![0u16; n]);
            fill(files, transform, sources, shape, window, &mut out, allow_non_finite)?;
            Ok(TensorData::new(out, out_shape))
        }
        other => Err(CheckpointError::Internal(format!("weights load as F32, BF16 or F16, not {other:?}"))),
    }
}

/// A destination element.
trait Dst: Copy + Send + Sync + Default {
    fn from_f32(v: f32) -> Self;

    /// From BF16 bits (exact into f32 and bf16; the checkpoints' usual dtype).
    #[inline(always)]
    fn from_bf16_bits(b: u16) -> Self {
        Self::from_f32(half::bf16::from_bits(b).to_f32())
    }
}

impl Dst for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }

    #[inline(always)]
    fn from_bf16_bits(b: u16) -> Self {
        f32::from_bits((b as u32) << 16)
    }
}

impl Dst for half::bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }

    #[inline(always)]
    fn from_bf16_bits(b: u16) -> Self {
        half::bf16::from_bits(b)
    }
}

impl Dst for half::f16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

/// Where each source goes: `dest` elements of the destination, copied or transposed, from
/// source rows `rows` (copied) or source columns `cols` (transposed; every source row read).
struct Placement<'a> {
    name: &'a str,
    dest: Range<usize>,
    transposed: bool,
    rows: Option<Range<usize>>,
    cols: Option<Range<usize>>,
}

/// The placements of module rows `window` of a module tensor of `shape`.
fn placements<'a>(transform: Transform, sources: &'a [String], shape: &[usize], window: Range<usize>) -> Vec<Placement<'a>> {
    let n: usize = shape.iter().product();
    let width = n / shape.first().copied().unwrap_or(1).max(1);
    let dest = 0..window.len() * width;
    match transform {
        // module rows are source rows
        Transform::Identity | Transform::SqueezeConv => {
            vec![Placement { name: &sources[0], dest, transposed: false, rows: Some(window), cols: None }]
        }
        // module rows are source columns
        Transform::Transpose | Transform::FlattenTranspose => {
            vec![Placement { name: &sources[0], dest, transposed: true, rows: None, cols: Some(window) }]
        }
        // module rows are experts, one source each
        Transform::ExpertSlice => window
            .clone()
            .map(|e| {
                let at = (e - window.start) * width;
                Placement { name: &sources[e], dest: at..at + width, transposed: true, rows: None, cols: None }
            })
            .collect(),
    }
}

fn fill<T: Dst>(
    files: &SafetensorsFiles,
    transform: Transform,
    sources: &[String],
    shape: &[usize],
    window: Range<usize>,
    out: &mut [T],
    allow_non_finite: bool,
) -> Result<(), CheckpointError> {
    for p in placements(transform, sources, shape, window) {
        let entry = files.tensors.get(p.name).ok_or_else(|| CheckpointError::MissingTensor { name: p.name.to_string() })?;
        // the checkpoint tensor as a matrix: dim 0 by the rest (a 1-D tensor is a column)
        let rows = entry.shape.first().copied().unwrap_or(1);
        let cols: usize = entry.shape.iter().skip(1).product();
        let src_rows = p.rows.clone().unwrap_or(0..rows);
        let src_cols = p.cols.clone().unwrap_or(0..cols);
        if src_rows.end > rows || src_cols.end > cols || src_rows.len() * src_cols.len() != p.dest.len() {
            return Err(CheckpointError::Internal(format!(
                "{}: rows {src_rows:?} × columns {src_cols:?} of {rows}×{cols} values for {} destination elements",
                p.name,
                p.dest.len()
            )));
        }
        let dest = &mut out[p.dest.clone()];
        let fp8 = match files.fp8_scales.get(p.name) {
            Some(scale_name) => Some(Fp8Scales::read(files, p.name, scale_name)?),
            None => None,
        };
        // FP8 NaN and overflow are always errors; other non-finite values unless allowed
        let check = fp8.is_some() || !allow_non_finite;
        let row_bytes = (entry.bytes.end - entry.bytes.start) / rows.max(1);
        let step = (CHUNK_BYTES / row_bytes.max(1)).clamp(1, rows.max(1));
        let mut bad = false;
        for r0 in src_rows.clone().step_by(step) {
            let chunk = r0..(r0 + step).min(src_rows.end);
            let bytes = files.row_bytes_cols(p.name, chunk.clone(), src_cols.clone())?;
            // the destination's rows of this chunk (copied), or its source rows (transposed)
            let at = if p.transposed { chunk.clone() } else { chunk.start - src_rows.start..chunk.end - src_rows.start };
            let (fp8, ctx) = (&fp8, Ctx { chunk: at, rows, cols, col0: src_cols.start, transposed: p.transposed });
            bad |= match (fp8, entry.dtype) {
                (Some(s), _) => place(&Fp8Src { codes: bytes, cols, row0: r0, scales: s }, &ctx, dest),
                (None, Dtype::BF16) => match bytemuck::try_cast_slice::<u8, u16>(bytes) {
                    Ok(bits) => place(&Bf16Bits { bits, cols }, &ctx, dest),
                    Err(_) => place(&PlainSrc::<Bf16Le>::new(bytes, cols), &ctx, dest),
                },
                (None, Dtype::F32) => match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                    Ok(values) => place(&F32Values { values, cols }, &ctx, dest),
                    Err(_) => place(&PlainSrc::<F32Le>::new(bytes, cols), &ctx, dest),
                },
                (None, Dtype::F16) => place(&PlainSrc::<F16Le>::new(bytes, cols), &ctx, dest),
                (None, other) => {
                    return Err(CheckpointError::Dtype {
                        name: p.name.to_string(),
                        path: files.shard_path(p.name).map(|p| p.to_path_buf()).unwrap_or_default(),
                        dtype: format!("{other:?}"),
                    })
                }
            } && check;
            files.release(p.name, chunk);
        }
        if bad {
            // the exact report (index, count, shard) comes from the checked reader
            files.read_f32_finite(p.name, allow_non_finite)?;
            return Err(CheckpointError::Internal(format!("{}: non-finite values seen in one pass, not in the other", p.name)));
        }
    }
    Ok(())
}

/// A chunk of a source tensor's rows, decoded into the destination type.
trait Src<T>: Sync {
    /// Write `out.len()` values of row `r` (counted within the chunk) from column `c0`;
    /// false if one was not finite.
    fn row(&self, r: usize, c0: usize, out: &mut [T]) -> bool;
}

/// BF16 values as their bits (aligned in the shard: the usual case).
struct Bf16Bits<'a> {
    bits: &'a [u16],
    cols: usize,
}

impl<T: Dst> Src<T> for Bf16Bits<'_> {
    #[inline(always)]
    fn row(&self, r: usize, c0: usize, out: &mut [T]) -> bool {
        let (i, n) = (r * self.cols + c0, out.len());
        let mut exp_all_ones = 0u16;
        for (o, &b) in out.iter_mut().zip(&self.bits[i..i + n]) {
            exp_all_ones |= u16::from(b & 0x7F80 == 0x7F80);
            *o = T::from_bf16_bits(b);
        }
        exp_all_ones == 0
    }
}

/// F32 values (aligned in the shard).
struct F32Values<'a> {
    values: &'a [f32],
    cols: usize,
}

impl<T: Dst> Src<T> for F32Values<'_> {
    #[inline(always)]
    fn row(&self, r: usize, c0: usize, out: &mut [T]) -> bool {
        let (i, n) = (r * self.cols + c0, out.len());
        let mut finite = true;
        for (o, &v) in out.iter_mut().zip(&self.values[i..i + n]) {
            finite &= v.is_finite();
            *o = T::from_f32(v);
        }
        finite
    }
}

struct PlainSrc<'a, D> {
    bytes: &'a [u8],
    cols: usize,
    _decode: std::marker::PhantomData<D>,
}

impl<'a, D> PlainSrc<'a, D> {
    fn new(bytes: &'a [u8], cols: usize) -> Self {
        PlainSrc { bytes, cols, _decode: std::marker::PhantomData }
    }
}

/// A little-endian element type of the checkpoint.
trait Decode: Sync {
    const WIDTH: usize;
    fn decode(b: &[u8]) -> f32;
}

struct F32Le;
struct Bf16Le;
struct F16Le;

impl Decode for F32Le {
    const WIDTH: usize = 4;
    #[inline(always)]
    fn decode(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
}

impl Decode for Bf16Le {
    const WIDTH: usize = 2;
    #[inline(always)]
    fn decode(b: &[u8]) -> f32 {
        half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }
}

impl Decode for F16Le {
    const WIDTH: usize = 2;
    #[inline(always)]
    fn decode(b: &[u8]) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
    }
}

impl<D: Decode, T: Dst> Src<T> for PlainSrc<'_, D> {
    #[inline(always)]
    fn row(&self, r: usize, c0: usize, out: &mut [T]) -> bool {
        let (i, n) = ((r * self.cols + c0) * D::WIDTH, out.len() * D::WIDTH);
        let mut finite = true;
        for (o, b) in out.iter_mut().zip(self.bytes[i..i + n].chunks_exact(D::WIDTH)) {
            let v = D::decode(b);
            finite &= v.is_finite();
            *o = T::from_f32(v);
        }
        finite
    }
}

/// An FP8 weight's scale grid, read and checked once per tensor.
struct Fp8Scales {
    values: Vec<f32>,
    grid: BlockGrid,
    scale_cols: usize,
    round_bf16: bool,
}

impl Fp8Scales {
    fn read(files: &SafetensorsFiles, name: &str, scale_name: &str) -> Result<Self, CheckpointError> {
        let grid = files.fp8_grid(name)?;
        let values = files.read_f32(scale_name)?;
        if values.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
            // the checked reader names the block
            files.read_f32(name)?;
        }
        Ok(Fp8Scales { values, scale_cols: grid.scale_shape()[1], grid, round_bf16: files.fp8_round_bf16 })
    }
}

struct Fp8Src<'a> {
    codes: &'a [u8],
    cols: usize,
    row0: usize,
    scales: &'a Fp8Scales,
}

impl<T: Dst> Src<T> for Fp8Src<'_> {
    fn row(&self, r: usize, c0: usize, out: &mut [T]) -> bool {
        let g = &self.scales.grid;
        let scales = &self.scales.values[((self.row0 + r) / g.block_rows) * self.scales.scale_cols..];
        let i = r * self.cols + c0;
        let codes = &self.codes[i..i + out.len()];
        let mut finite = true;
        // one scale per run of columns inside a block
        let mut c = 0;
        while c < out.len() {
            let block = (c0 + c) / g.block_cols;
            let end = ((block + 1) * g.block_cols - c0).min(out.len());
            let s = scales[block];
            for (o, &q) in out[c..end].iter_mut().zip(&codes[c..end]) {
                let v = E4M3_TABLE[q as usize] * s;
                finite &= v.is_finite();
                *o = if self.scales.round_bf16 { T::from_bf16_bits(half::bf16::from_f32(v).to_bits()) } else { T::from_f32(v) };
            }
            c = end;
        }
        finite
    }
}

/// Columns a transpose task decodes per source row (its tile of `TILE_ROWS` rows stays in L1).
const BAND_COLS: usize = 256;

/// Which rows a call writes, and the tensor's geometry: copied, `chunk` are destination rows
/// (the source's, counted from the chunk's first); transposed, `chunk` are source rows and the
/// destination rows are source columns `col0 ..`.
struct Ctx {
    chunk: Range<usize>,
    rows: usize,
    cols: usize,
    col0: usize,
    transposed: bool,
}

/// Write a chunk of source rows (`rows × cols` in all) into `dest`: destination rows
/// `ctx.chunk` of `cols` values, or, transposed, columns `ctx.chunk` of `dest.len() / rows`
/// destination rows of `rows` values (source columns from `col0`). True if a value was not
/// finite.
fn place<S: Src<T>, T: Dst>(src: &S, ctx: &Ctx, dest: &mut [T]) -> bool {
    let Ctx { chunk, rows, cols, col0, transposed } = ctx;
    let (rows, cols, col0) = (*rows, *cols, *col0);
    let bad = AtomicBool::new(false);
    let threads = rayon::current_num_threads().max(1);
    if !transposed {
        let part = &mut dest[chunk.start * cols..chunk.end * cols];
        let rows_per_task = chunk.len().div_ceil(threads * 4).max(1);
        part.par_chunks_mut(rows_per_task * cols.max(1)).enumerate().for_each(|(t, d)| {
            let mut finite = true;
            for (k, out) in d.chunks_exact_mut(cols.max(1)).enumerate() {
                finite &= src.row(t * rows_per_task + k, 0, out);
            }
            if !finite {
                bad.store(true, Ordering::Relaxed);
            }
        });
    } else {
        // destination rows are source columns; each task owns a band of them
        let dest_rows = dest.len() / rows.max(1);
        let band = dest_rows.div_ceil(threads * 4).clamp(1, BAND_COLS);
        dest.par_chunks_mut(band * rows).enumerate().for_each(|(t, d)| {
            let mut finite = true;
            let c0 = col0 + t * band;
            let nc = d.len() / rows;
            let mut tile = vec![T::default(); TILE_ROWS * nc];
            for r_tile in chunk.clone().step_by(TILE_ROWS) {
                let nr = (r_tile + TILE_ROWS).min(chunk.end) - r_tile;
                for i in 0..nr {
                    finite &= src.row(r_tile + i - chunk.start, c0, &mut tile[i * nc..(i + 1) * nc]);
                }
                for (k, row) in d.chunks_exact_mut(rows).enumerate() {
                    for (i, o) in row[r_tile..r_tile + nr].iter_mut().enumerate() {
                        *o = tile[i * nc + k];
                    }
                }
            }
            if !finite {
                bad.store(true, Ordering::Relaxed);
            }
        });
    }
    bad.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(chunk: Range<usize>, rows: usize, cols: usize, transposed: bool) -> Ctx {
        Ctx { chunk, rows, cols, col0: 0, transposed }
    }

    #[test]
    fn transposed_chunks_tile_the_destination() {
        // 37 × 300 (more than one band) in chunks of 5 rows: every element lands at [c, r]
        let (rows, cols) = (37, 300);
        let src: Vec<f32> = (0..rows * cols).map(|i| i as f32).collect();
        let mut dest = vec![f32::NAN; rows * cols];
        for r0 in (0..rows).step_by(5) {
            let chunk = r0..(r0 + 5).min(rows);
            let part = F32Values { values: &src[chunk.start * cols..chunk.end * cols], cols };
            assert!(!place(&part, &ctx(chunk, rows, cols, true), &mut dest));
        }
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(dest[c * rows + r], src[r * cols + c]);
            }
        }
        let mut copy = vec![0f32; rows * cols];
        assert!(!place(&F32Values { values: &src, cols }, &ctx(0..rows, rows, cols, false), &mut copy));
        assert_eq!(copy, src);
    }

    #[test]
    fn bf16_bits_convert_exactly_and_see_non_finite_values() {
        let vals = [1.5f32, -0.0, 3.0e38, 1.0e-30, f32::INFINITY, 2.0];
        let bits: Vec<u16> = vals.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
        let mut f = vec![0f32; 6];
        assert!(place(&Bf16Bits { bits: &bits, cols: 3 }, &ctx(0..2, 2, 3, true), &mut f));
        let mut b = vec![half::bf16::ZERO; 6];
        assert!(place(&Bf16Bits { bits: &bits, cols: 3 }, &ctx(0..2, 2, 3, false), &mut b));
        for (i, v) in vals.iter().enumerate() {
            let want = half::bf16::from_f32(*v);
            assert_eq!(b[i].to_bits(), want.to_bits());
            assert_eq!(f[(i % 3) * 2 + i / 3].to_bits(), want.to_f32().to_bits());
        }
        let finite: Vec<u16> = bits.iter().map(|b| if *b == 0x7F80 { 0 } else { *b }).collect();
        assert!(!place(&Bf16Bits { bits: &finite, cols: 3 }, &ctx(0..2, 2, 3, false), &mut b));
    }

    #[test]
    fn fp8_rows_match_the_reference_dequantiser_across_partial_blocks_and_chunks() {
        // 10 × 13 in 4 × 5 blocks (partial edge blocks both ways), read in chunks of 3 rows
        let grid = BlockGrid { rows: 10, cols: 13, block_rows: 4, block_cols: 5 };
        let [sr, sc] = grid.scale_shape();
        let codes: Vec<u8> = (0..130u32).map(|i| (i * 37 % 251) as u8 & 0x7E | (i as u8 & 1) << 7).collect();
        let values: Vec<f32> = (0..sr * sc).map(|i| 0.25 + i as f32 * 0.37).collect();
        for round_bf16 in [true, false] {
            let mut want = vec![0f32; 130];
            super::super::fp8::dequantize_rows(&codes, &values, grid, 0, round_bf16, &mut want).unwrap();
            let scales = Fp8Scales { values: values.clone(), grid, scale_cols: sc, round_bf16 };
            for transposed in [false, true] {
                let mut got = vec![f32::NAN; 130];
                for r0 in (0..10).step_by(3) {
                    let chunk = r0..(r0 + 3).min(10);
                    let src = Fp8Src { codes: &codes[r0 * 13..chunk.end * 13], cols: 13, row0: r0, scales: &scales };
                    assert!(!place(&src, &ctx(chunk, 10, 13, transposed), &mut got));
                }
                for r in 0..10 {
                    for c in 0..13 {
                        let at = if transposed { c * 10 + r } else { r * 13 + c };
                        assert_eq!(got[at].to_bits(), want[r * 13 + c].to_bits(), "[{r}, {c}] round {round_bf16} transposed {transposed}");
                    }
                }
            }
        }
    }
}
