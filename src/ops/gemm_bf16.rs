//! The BF16 matrix product with f32 accumulation, as PyTorch's BF16 `matmul` computes it on a
//! CPU (oneDNN): `C = A·B` (or `C += A·B`) for BF16 `A` `[m, k]` and `B` `[k, n]` read with
//! any strides, into a row-major f32 `C` `[m, n]`. The callers round `C` to BF16 once.
//!
//! Three bodies, the same sums up to their order:
//!
//! * **AMX** (Sapphire Rapids and later, where Linux grants the tiles; module `amx`): the
//!   AVX512-BF16 loop nest below hands whole 32-row strips of whole panels to `tdpbf16ps`
//!   on four 16 × 16 f32 accumulator tiles; the rest runs on the vector kernel.
//! * **AVX512-BF16** (x86-64 Zen 4 and later, Cooper Lake / Sapphire Rapids and later;
//!   detected at run time). `vdpbf16ps` multiplies 16 pairs of BF16 values from each operand
//!   and adds both products into 16 f32 lanes — 32 multiply-adds per instruction, twice an
//!   f32 FMA's, on operands half the size. The products of BF16 values are exact in f32; the
//!   instruction treats subnormal inputs and results as zero (values below 1.2·10⁻³⁸, which
//!   PyTorch's oneDNN path on the same instruction flushes alike). The loop nest is the
//!   GotoBLAS one: blocks of `KC` inner-dimension elements; `B` packed per block as `k`-pairs
//!   of `NR` columns (one 32-bit lane per pair), so the `MR × NR` micro-kernel reads one
//!   cache line per pair per 16 columns; `A` read in place where its rows are contiguous
//!   (each pair one 32-bit broadcast), packed alike otherwise. `NR = 64` columns × `MR = 6`
//!   rows keep 24 accumulator registers of the 32.
//! * **Portable**: the operands widened to f32 (`B` one panel of columns per task) and
//!   multiplied by the `gemm` crate, the f32 matmul Flex itself uses.
//!
//! Burn-flex 0.21's own BF16 matmul converts both whole operands to f32 on one thread per
//! product (`matmul_bf16`), then runs the f32 product: slower than f32 throughout.

use half::bf16;
use rayon::prelude::*;

/// A BF16 matrix operand as used in the product: element `(r, c)` is
/// `data[r·row_stride + c·col_stride]`.
#[derive(Clone, Copy)]
pub(crate) struct Bf16Operand<'a> {
    pub data: &'a [bf16],
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a> Bf16Operand<'a> {
    /// Row-major `[_, cols]` data.
    pub fn plain(data: &'a [bf16], cols: usize) -> Self {
        Bf16Operand { data, row_stride: cols, col_stride: 1 }
    }

    /// The transpose of row-major `[_, cols]` data, read in place.
    pub fn transposed(data: &'a [bf16], cols: usize) -> Self {
        Bf16Operand { data, row_stride: 1, col_stride: cols }
    }

    /// The index of the last element of a `[rows, cols]` view (0 for an empty one).
    fn last(&self, rows: usize, cols: usize) -> usize {
        (rows.max(1) - 1) * self.row_stride + (cols.max(1) - 1) * self.col_stride
    }
}

/// `c` `[m, n]` (row-major) `= a·b`, or `+= a·b` with `accumulate`, `k` the inner dimension;
/// sums in f32.
///
/// # Panics
/// If an operand or `c` is shorter than its shape needs (a bug of the caller: every caller
/// passes buffers of the shapes it checked).
pub(crate) fn gemm_bf16(c: &mut [f32], accumulate: bool, a: Bf16Operand, b: Bf16Operand, m: usize, n: usize, k: usize) {
    assert!(m * k == 0 || a.last(m, k) < a.data.len(), "gemm_bf16: lhs buffer shorter than [{m}, {k}]");
    assert!(k * n == 0 || b.last(k, n) < b.data.len(), "gemm_bf16: rhs buffer shorter than [{k}, {n}]");
    assert_eq!(c.len(), m * n, "gemm_bf16: output of {} elements for [{m}, {n}]", c.len());
    if m * n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // SAFETY: the CPU has the instructions (checked just above), and AMX's tiles where
        // `amx::available` says so; the operands' extents were checked against their buffers.
        unsafe { avx512::gemm(c, accumulate, a, b, m, n, k, amx::available()) };
        return;
    }
    portable(c, accumulate, a, b, m, n, k);
}

/// Columns of `B` widened per task of [`portable`]: `k × PANEL_COLS` f32 stay within a core's
/// L2 for `k` up to ~4,096 (the model's widths).
const PANEL_COLS: usize = 128;

/// Below this many multiply-adds a product runs on the calling thread.
const PARALLEL_FLOPS: usize = 192 * 192 * 192;

/// The portable body: `A` widened whole (it is the activation side in every caller), `B` one
/// panel of columns per task, each panel multiplied into its columns of `C` by `gemm`.
fn portable(c: &mut [f32], accumulate: bool, a: Bf16Operand, b: Bf16Operand, m: usize, n: usize, k: usize) {
    let af: Vec<f32> = (0..m * k).into_par_iter().map(|i| a.data[(i / k) * a.row_stride + (i % k) * a.col_stride].to_f32()).collect();
    let out = SharedOut(c.as_mut_ptr());
    let panels = n.div_ceil(PANEL_COLS);
    let serial = m.saturating_mul(n).saturating_mul(k) < PARALLEL_FLOPS;
    let run = |panel: &mut Vec<f32>, p: usize| {
        let (c0, c1) = (p * PANEL_COLS, ((p + 1) * PANEL_COLS).min(n));
        let width = c1 - c0;
        panel.clear();
        panel.extend((0..k * width).map(|i| b.data[(i / width) * b.row_stride + (c0 + i % width) * b.col_stride].to_f32()));
        // SAFETY: `af` is `[m, k]` and `panel` `[k, width]`, both row-major; the task writes
        // only columns `c0..c1` of the `[m, n]` output (row stride `n`), which no other task
        // touches, and `c` outlives the loop.
        unsafe {
            gemm::gemm(
                m,
                width,
                k,
                out.at(c0),
                1,
                n as isize,
                accumulate,
                af.as_ptr(),
                1,
                k as isize,
                panel.as_ptr(),
                1,
                width as isize,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    };
    if serial {
        let mut panel = Vec::new();
        (0..panels).for_each(|p| run(&mut panel, p));
    } else {
        (0..panels).into_par_iter().for_each_init(Vec::new, run);
    }
}

/// An f32 output written by tasks that own disjoint elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

// SAFETY: the tasks sharing it write disjoint elements (each user says which).
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

impl SharedOut {
    /// The address `i` elements in. A method, so that closures capture the wrapper (which is
    /// `Sync`), not the raw pointer field.
    fn at(&self, i: usize) -> *mut f32 {
        // SAFETY: callers pass an index inside the output.
        unsafe { self.0.add(i) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::sync::OnceLock;

    use half::bf16;
    use rayon::prelude::*;

    use super::{amx, Bf16Operand, SharedOut, PARALLEL_FLOPS};

    /// Rows of the micro-kernel's tile.
    const MR: usize = 6;
    /// Columns of the micro-kernel's tile: four registers of 16 f32 lanes.
    const NR: usize = 64;
    const NV: usize = NR / 16;
    /// Inner-dimension elements per block (even: blocks start on a pair). Measured on this
    /// project's 2-core AVX512-BF16 host (`bench --matmul --dtype bf16`): 512 beat 128 and 256
    /// at every model shape (fewer passes over the f32 accumulators of `C`); the packed
    /// `KC × NR` slice of `B` a row tile streams is 64 KB, read from L2.
    const KC: usize = 512;
    /// Rows per block of the loop over `A`.
    const MC: usize = 192;
    /// Most columns per task: the task's packed `KC × NC` block of `B` (1 MB) stays in L2.
    const NC: usize = 1024;

    pub(super) fn available() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16"))
    }

    /// A pair of BF16 bit patterns as one 32-bit lane: the even-`k` element in the low half,
    /// as it sits in memory, which is how `vdpbf16ps` pairs its operands.
    #[inline(always)]
    fn pair(lo: bf16, hi: bf16) -> u32 {
        lo.to_bits() as u32 | (hi.to_bits() as u32) << 16
    }

    /// Packs `outer` indices `o0..o1` (rows of `A`, or columns of `B`) by inner indices
    /// `t0..t1` of `src` (`element(o, t) = data[o·outer + t·inner]`) into `dst`: groups of `g`
    /// outer indices, each `pairs × g` lanes, pair-major; past `o1` or `t1` the lanes are 0.
    fn pack(dst: &mut Vec<u32>, src: &[bf16], outer: usize, inner: usize, (o0, o1): (usize, usize), (t0, t1): (usize, usize), g: usize) {
        let pairs = (t1 - t0).div_ceil(2);
        let groups = (o1 - o0).div_ceil(g);
        dst.clear();
        dst.resize(groups * pairs * g, 0);
        let at = |o: usize, t: usize| src[o * outer + t * inner];
        for gi in 0..groups {
            let (go, width) = (o0 + gi * g, g.min(o1 - o0 - gi * g));
            let block = &mut dst[gi * pairs * g..(gi + 1) * pairs * g];
            // a pair of adjacent elements is one 32-bit word of its outer row: whole 16 × 16
            // blocks of words are transposed in registers (a transposed `B`, the backward's
            // `∂y·Wᵀ`), and the loop below fills the rest
            let (pw, cw) = if inner == 1 && outer != 1 {
                // SAFETY: `gemm` runs only where AVX512F is (`available`); the words read are
                // whole pairs inside `src` (the caller checked the operand's extent)
                unsafe { pack_words(block, src, outer, go, width, t0, (t1 - t0) / 2, g) }
            } else {
                (0, 0)
            };
            for p in 0..pairs {
                let t = t0 + 2 * p;
                let skip = if p < pw { cw } else { 0 };
                let (go, width) = (go + skip, width - skip);
                let lanes = &mut block[p * g + skip..p * g + skip + width];
                if t + 1 < t1 {
                    if outer == 1 {
                        // two contiguous runs (row-major B's rows, or a transposed A's)
                        let (r0, r1) = (&src[go + t * inner..go + t * inner + width], &src[go + (t + 1) * inner..go + (t + 1) * inner + width]);
                        lanes.iter_mut().zip(r0.iter().zip(r1)).for_each(|(l, (&lo, &hi))| *l = pair(lo, hi));
                    } else {
                        lanes.iter_mut().enumerate().for_each(|(i, l)| *l = pair(at(go + i, t), at(go + i, t + 1)));
                    }
                } else {
                    lanes.iter_mut().enumerate().for_each(|(i, l)| *l = pair(at(go + i, t), bf16::ZERO));
                }
            }
        }
    }

    /// [`pack`]'s lanes where each pair is one 32-bit word of an outer row (`inner == 1`):
    /// 16 outer indices × 16 pairs at a time, loaded as 16 rows of words and transposed in
    /// registers, into `block` (`g` lanes per pair). Fills pairs `0..pw` × outer `0..cw` of the
    /// group at `go` (`pw`, `cw` the whole multiples of 16 of `pairs` and `width`) and returns
    /// them; the caller fills the rest.
    ///
    /// # Safety
    /// AVX512F; `src` holds elements `(go + i)·outer + t0 + j` for `i < width`, `j < 2·pairs`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_words(
        block: &mut [u32],
        src: &[bf16],
        outer: usize,
        go: usize,
        width: usize,
        t0: usize,
        pairs: usize,
        g: usize,
    ) -> (usize, usize) {
        let (pw, cw) = (pairs / 16 * 16, width / 16 * 16);
        let base = src.as_ptr();
        for p0 in (0..pw).step_by(16) {
            for c0 in (0..cw).step_by(16) {
                let rows: [__m512i; 16] = std::array::from_fn(|i| _mm512_loadu_si512(base.add((go + c0 + i) * outer + t0 + 2 * p0) as *const _));
                for (j, v) in transpose16(rows).into_iter().enumerate() {
                    debug_assert!((p0 + j) * g + c0 + 16 <= block.len());
                    _mm512_storeu_si512(block.as_mut_ptr().add((p0 + j) * g + c0) as *mut _, v);
                }
            }
        }
        (pw, cw)
    }

    /// The transpose of a 16 × 16 matrix of 32-bit words held as 16 row registers: words
    /// interleaved, then pairs of words, then the four 128-bit lanes of four registers.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
        // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved (words 0,1 | 2,3 of each 128-bit lane)
        let t: [__m512i; 16] = std::array::from_fn(|i| {
            let (a, b) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(a, b)
            } else {
                _mm512_unpackhi_epi32(a, b)
            }
        });
        // u[4j + e]: in each 128-bit lane L, word 4L + e of rows 4j..4j+4
        let u: [__m512i; 16] = std::array::from_fn(|i| {
            let (j, e) = (i / 4, i % 4);
            let (a, b) = (t[4 * j + e / 2], t[4 * j + 2 + e / 2]);
            if e % 2 == 0 {
                _mm512_unpacklo_epi64(a, b)
            } else {
                _mm512_unpackhi_epi64(a, b)
            }
        });
        // output row 4L + e: lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
        let mut out = [_mm512_setzero_si512(); 16];
        for e in 0..4 {
            let (a0, a1, a2, a3) = (u[e], u[4 + e], u[8 + e], u[12 + e]);
            let (v0, v1) = (_mm512_shuffle_i32x4::<0x88>(a0, a1), _mm512_shuffle_i32x4::<0xDD>(a0, a1));
            let (v2, v3) = (_mm512_shuffle_i32x4::<0x88>(a2, a3), _mm512_shuffle_i32x4::<0xDD>(a2, a3));
            out[e] = _mm512_shuffle_i32x4::<0x88>(v0, v2);
            out[8 + e] = _mm512_shuffle_i32x4::<0xDD>(v0, v2);
            out[4 + e] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
            out[12 + e] = _mm512_shuffle_i32x4::<0xDD>(v1, v3);
        }
        out
    }

    /// See [`super::gemm_bf16`].
    ///
    /// # Safety
    /// The CPU must have AVX512F and AVX512-BF16 ([`available`]); `a` and `b` must cover their
    /// `[m, k]` and `[k, n]` extents and `c` hold `m·n` elements.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm(c: &mut [f32], accumulate: bool, a: Bf16Operand, b: Bf16Operand, m: usize, n: usize, k: usize, amx: bool) {
        // A is read in place when each row's inner elements are contiguous and every pair
        // starts on an even element; otherwise (a transposed activation, an odd k) it is packed once, whole —
        // every caller's A is activation-sized. The AMX tiles read rows of A, so there a
        // non-direct A is copied once into rows of an even length instead.
        // Too small for one 32 × 64 block of whole 16-pair steps: no tile would run, so
        // neither copy of A is made.
        let amx = amx && m >= amx::ROWS && n >= NR && k >= 2 * amx::STEP;
        let mut direct = a.col_stride == 1 && k.is_multiple_of(2) && a.row_stride.is_multiple_of(2);
        let mut a_packed = Vec::new();
        let a_rows = if !direct && amx { rows_even(a, m, k) } else { Vec::new() };
        let a = if !direct && amx {
            direct = true;
            Bf16Operand::plain(&a_rows, k.next_multiple_of(2))
        } else {
            a
        };
        if !direct {
            a_packed = pack_a_whole(a, m, k);
        }
        let threads = rayon::current_num_threads().max(1);
        // task columns: at most NC, few enough tasks for every thread to get two when n allows
        let tw = n.div_ceil(2 * threads).next_multiple_of(NR).clamp(NR, NC);
        let col_tasks = n.div_ceil(tw);
        // split rows too when the columns alone leave threads idle
        let row_tasks = if col_tasks >= 2 * threads { 1 } else { (2 * threads).div_ceil(col_tasks).min(m.div_ceil(MR)) };
        // tiled strips start on a 16-row group of the packed tiles (96: a multiple of MR too)
        let th = m.div_ceil(row_tasks).next_multiple_of(if amx { 96 } else { MR });
        let row_tasks = m.div_ceil(th);
        let out = SharedOut(c.as_mut_ptr());
        let a_packed = &a_packed[..];
        let a_tiles = if amx { amx::pack_a(a, m, k, KC) } else { Vec::new() };
        let a_tiles = amx.then_some(&a_tiles[..]);
        let task = |b_pack: &mut Vec<u32>, t: usize| {
            let (ri, ci) = (t / col_tasks, t % col_tasks);
            let (r0, r1) = (ri * th, ((ri + 1) * th).min(m));
            let (c0, c1) = (ci * tw, ((ci + 1) * tw).min(n));
            // SAFETY: AMX was granted to the process (`amx::available`, checked by the caller)
            let _tiles = amx.then(|| unsafe { super::amx::Tiles::configure() });
            for k0 in (0..k).step_by(KC) {
                let k1 = (k0 + KC).min(k);
                pack(b_pack, b.data, b.col_stride, b.row_stride, (c0, c1), (k0, k1), NR);
                // SAFETY: the task writes rows r0..r1 × columns c0..c1 of `c`, which no other
                // task touches; the reads stay inside the operands (checked by the caller).
                unsafe { block(out, n, accumulate || k0 > 0, a, a_packed, direct, a_tiles, m, (r0, r1), (c0, c1), (k0, k1), b_pack) };
            }
        };
        let tasks = row_tasks * col_tasks;
        if m.saturating_mul(n).saturating_mul(k) < PARALLEL_FLOPS || tasks == 1 {
            let mut b_pack = Vec::new();
            (0..tasks).for_each(|t| task(&mut b_pack, t));
        } else {
            (0..tasks).into_par_iter().for_each_init(Vec::new, task);
        }
    }

    /// `A` `[m, k]` as row-major rows of `k` rounded up to even (the pad a zero).
    fn rows_even(a: Bf16Operand, m: usize, k: usize) -> Vec<bf16> {
        let ke = k.next_multiple_of(2);
        let mut rows = vec![bf16::ZERO; m * ke];
        rows.par_chunks_mut(ke).enumerate().for_each(|(r, row)| {
            row[..k].iter_mut().enumerate().for_each(|(t, v)| *v = a.data[r * a.row_stride + t * a.col_stride]);
        });
        rows
    }

    /// `A` `[m, k]` packed whole: for each block of `KC` inner elements, for each group of `MR`
    /// rows, `pairs × MR` lanes (the layout [`block`] reads at `a_offset`).
    fn pack_a_whole(a: Bf16Operand, m: usize, k: usize) -> Vec<u32> {
        let groups = m.div_ceil(MR);
        let blocks: Vec<(usize, usize)> = (0..k).step_by(KC).map(|k0| (k0, (k0 + KC).min(k))).collect();
        let parts: Vec<Vec<u32>> = blocks
            .par_iter()
            .map(|&(k0, k1)| {
                let mut v = Vec::new();
                pack(&mut v, a.data, a.row_stride, a.col_stride, (0, m), (k0, k1), MR);
                debug_assert_eq!(v.len(), groups * (k1 - k0).div_ceil(2) * MR);
                v
            })
            .collect();
        parts.concat()
    }

    /// One `KC` block of a task: rows `r0..r1` × columns `c0..c1` of `c` (row stride `ldc`)
    /// `(+)= A[rows, k0..k1] · B[k0..k1, cols]`, `b_pack` holding that block of `B` packed.
    ///
    /// # Safety
    /// As [`gemm`]; the caller owns the output rectangle.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn block(
        out: SharedOut,
        ldc: usize,
        accumulate: bool,
        a: Bf16Operand,
        a_packed: &[u32],
        direct: bool,
        a_tiles: Option<&[bf16]>,
        m: usize,
        (r0, r1): (usize, usize),
        (c0, c1): (usize, usize),
        (k0, k1): (usize, usize),
        b_pack: &[u32],
    ) {
        let pairs = (k1 - k0).div_ceil(2);
        let a_words = a.data.as_ptr() as *const u32;
        // packed A: the blocks before k0 hold `groups · pairs_of_block · MR` lanes each
        let groups = m.div_ceil(MR);
        let a_block = groups * (k0 / 2) * MR;
        // the AMX tiles take whole steps of 16 pairs; the vector kernel the pairs after them
        let tile_pairs = if a_tiles.is_some() && direct { pairs / amx::STEP * amx::STEP } else { 0 };
        for i0 in (r0..r1).step_by(MC) {
            let i1 = (i0 + MC).min(r1);
            for (jp, j0) in (c0..c1).step_by(NR).enumerate() {
                let cols = NR.min(c1 - j0);
                let bp = b_pack.as_ptr().add(jp * pairs * NR);
                // rows in whole 32-row strips of a whole panel go through the tiles first
                let tiled_to = if tile_pairs > 0 && cols == NR { i0 + (i1 - i0) / amx::ROWS * amx::ROWS } else { i0 };
                for r in (i0..tiled_to).step_by(amx::ROWS) {
                    let a_at = amx::a_tile(a_tiles.unwrap_or_default(), m, KC, k0, r);
                    for jj in (0..NR).step_by(amx::COLS) {
                        amx::tile(a_at, bp.add(jj), NR, out.at(r * ldc + j0 + jj), ldc, tile_pairs / amx::STEP, accumulate);
                    }
                }
                // the tiled rows' last pairs, then the other rows whole
                let spans = [(i0, tiled_to, tile_pairs), (tiled_to, i1, 0)];
                let rest = spans.iter().filter(|&&(_, _, done)| done < pairs);
                for (r, end, done) in rest.flat_map(|&(s, e, done)| (s..e).step_by(MR).map(move |r| (r, e, done))) {
                    let rows = MR.min(end - r);
                    let (rows_at, step) = if direct {
                        // rows past the end repeat the last one: computed, never stored
                        let at: [*const u32; MR] = std::array::from_fn(|i| a_words.add(((r + i.min(rows - 1)) * a.row_stride + k0) / 2 + done));
                        (at, 1)
                    } else {
                        debug_assert!(r % MR == 0);
                        let base = a_packed.as_ptr().add(a_block + (r / MR) * pairs * MR);
                        (std::array::from_fn(|i| base.add(i)), MR)
                    };
                    kernel(pairs - done, rows_at, step, bp.add(done * NR), out.at(r * ldc + j0), ldc, rows, cols, accumulate || done > 0);
                }
            }
        }
    }

    /// The `MR × NR` tile at `c` (row stride `ldc`, of which `rows × cols` are stored)
    /// `(+)= Σ_p a_i[p] · b[p]`: `a[i]` points at row `i`'s pairs (`step` lanes apart), `b` at
    /// `pairs × NR` packed lanes.
    ///
    /// # Safety
    /// As [`gemm`]; the pointers cover `pairs` steps.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn kernel(
        pairs: usize,
        a: [*const u32; MR],
        step: usize,
        b: *const u32,
        c: *mut f32,
        ldc: usize,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        for p in 0..pairs {
            let bp = b.add(p * NR);
            let bv: [__m512bh; NV] = std::array::from_fn(|v| std::mem::transmute(_mm512_loadu_si512(bp.add(16 * v) as *const _)));
            for i in 0..MR {
                let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(a[i].add(p * step).read_unaligned() as i32));
                for v in 0..NV {
                    acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, bv[v]);
                }
            }
        }
        if rows == MR && cols == NR {
            for (i, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    let dst = c.add(i * ldc + 16 * v);
                    let x = if accumulate { _mm512_add_ps(_mm512_loadu_ps(dst), x) } else { x };
                    _mm512_storeu_ps(dst, x);
                }
            }
        } else {
            let mut tile = [[0f32; NR]; MR];
            for (i, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    _mm512_storeu_ps(tile[i].as_mut_ptr().add(16 * v), x);
                }
            }
            for (i, row) in tile.iter().enumerate().take(rows) {
                let dst = std::slice::from_raw_parts_mut(c.add(i * ldc), cols);
                if accumulate {
                    dst.iter_mut().zip(row).for_each(|(d, x)| *d += x);
                } else {
                    dst.copy_from_slice(&row[..cols]);
                }
            }
        }
    }
}

/// Intel AMX (Sapphire Rapids and later): eight tile registers of 16 rows × 64 bytes, and
/// `tdpbf16ps`, which multiplies a 16 × 32 BF16 tile by a 16-pair × 16-column tile in the
/// same pair layout as the packed `B` above and adds the products into a 16 × 16 f32 tile —
/// 8,192 multiply-adds per instruction, in f32 like `vdpbf16ps` (subnormals as zero). PyTorch's
/// BF16 `matmul` runs on it through oneDNN; on this project's 2-core host it multiplies at
/// 1.8–2.1 TFLOP/s there, where the `vdpbf16ps` kernel reaches ~0.2 (`bench --matmul --dtype
/// bf16`, `tests/reference/bench_matmul.py`). A 32 × 32 block of `C` is four tiles, `A`'s two
/// row tiles read in place and `B`'s two column tiles from the packed panel; the
/// [`avx512`] loop nest hands it whole 32-row strips of whole 64-column panels and whole steps
/// of 16 pairs, and runs the rest (edges, the last pairs of a block) on the vector kernel.
///
/// Linux lends a process the tiles' 8 KB of state only on request
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); [`available`] asks once. Set
/// `GLM5_NO_AMX=1` to run the vector kernel instead (for comparison).
#[cfg(target_arch = "x86_64")]
mod amx {
    use std::arch::asm;
    use std::sync::OnceLock;

    use half::bf16;

    /// Rows of `C` per [`tile`] call (two tiles of 16).
    pub(super) const ROWS: usize = 32;
    /// Columns of `C` per [`tile`] call (two tiles of 16 f32).
    pub(super) const COLS: usize = 32;
    /// Inner-dimension pairs per tile step (a tile row of `A`: 32 BF16, 64 bytes).
    pub(super) const STEP: usize = 16;

    /// Whether the CPU has AMX-TILE and AMX-BF16 (and the AVX512-BF16 kernel the edges take),
    /// the OS granted the tile state, and `GLM5_NO_AMX` is unset.
    pub(super) fn available() -> bool {
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| std::env::var_os("GLM5_NO_AMX").is_none() && cpu_has() && os_grants())
    }

    fn cpu_has() -> bool {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE
        if __cpuid(0).eax < 7 {
            return false;
        }
        let edx = __cpuid_count(7, 0).edx;
        edx & (1 << 22) != 0 && edx & (1 << 24) != 0 && super::avx512::available()
    }

    #[cfg(target_os = "linux")]
    fn os_grants() -> bool {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a request for a process-wide permission; no memory is passed
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }

    #[cfg(not(target_os = "linux"))]
    fn os_grants() -> bool {
        false
    }

    /// BF16 elements in one tile of `A` (16 rows × 32).
    const TILE: usize = 16 * 32;

    /// `A` `[m, k]` (rows read in place: `col_stride` 1, rows of at least `k` rounded up to
    /// even) as contiguous tiles: for each block of `kc` inner elements, for each 32-row
    /// strip, for each whole step of 16 pairs, the strip's two tiles of 16 rows × 32 (rows
    /// past `m` zero). Read in place, a tile's 16 rows lie a row stride apart — a page apart
    /// at the model's widths — and its loads were half the kernel's time (`perf annotate`);
    /// packed, each is 1 KB in a row.
    pub(super) fn pack_a(a: super::Bf16Operand, m: usize, k: usize, kc: usize) -> Vec<bf16> {
        use rayon::prelude::*;
        let (strips, blocks, steps) = (m.div_ceil(ROWS), k.div_ceil(kc), kc / (2 * STEP));
        let mut out = vec![bf16::ZERO; blocks * strips * steps * 2 * TILE];
        out.par_chunks_mut(steps * 2 * TILE).enumerate().for_each(|(i, chunk)| {
            let (kb, strip) = (i / strips, i % strips);
            let k0 = kb * kc;
            // whole steps only; the block's last pairs are read in place by the vector kernel
            let whole = (k.min(k0 + kc) - k0).div_ceil(2) / STEP;
            for (s, tiles) in chunk.chunks_exact_mut(2 * TILE).enumerate().take(whole) {
                for (row, dst) in tiles.chunks_exact_mut(32).enumerate() {
                    let r = strip * ROWS + row;
                    if r < m {
                        let at = r * a.row_stride + k0 + 32 * s;
                        dst.copy_from_slice(&a.data[at..at + 32]);
                    }
                }
            }
        });
        out
    }

    /// Where [`pack_a`]'s tiles for rows `r..r + 32` (`r` a multiple of 32) of the block at
    /// `k0` start.
    pub(super) fn a_tile(tiles: &[bf16], m: usize, kc: usize, k0: usize, r: usize) -> *const bf16 {
        let (strips, steps) = (m.div_ceil(ROWS), kc / (2 * STEP));
        debug_assert!(r.is_multiple_of(ROWS) && k0.is_multiple_of(kc));
        tiles[((k0 / kc) * strips + r / ROWS) * steps * 2 * TILE..].as_ptr()
    }

    /// The tile configuration `ldtilecfg` reads: palette 1, every tile 16 rows × 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    /// This thread's tiles, configured while the value lives (`tilerelease` on drop).
    pub(super) struct Tiles(());

    impl Tiles {
        /// # Safety
        /// [`available`] must have returned true; no other `Tiles` may be alive on this thread.
        pub(super) unsafe fn configure() -> Self {
            let mut cfg = Config([0; 64]);
            cfg.0[0] = 1;
            for t in 0..8 {
                // bytes per row (u16 at 16 + 2t) and rows (u8 at 48 + t) of tile t
                cfg.0[16 + 2 * t] = 64;
                cfg.0[48 + t] = 16;
            }
            // SAFETY: a valid configuration for palette 1 (caller: AMX is granted)
            unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
            Tiles(())
        }
    }

    impl Drop for Tiles {
        fn drop(&mut self) {
            // SAFETY: the tiles were configured by this value
            unsafe { asm!("tilerelease", options(nostack, nomem)) };
        }
    }

    /// `C` `[32, 32]` (row stride `ldc`) `(+)= A · B` over `steps × 16` pairs: `a` at the
    /// strip's first pair of tiles ([`pack_a`]), `b` at pair 0 of the block's first column in
    /// a packed panel (`ldb` lanes per pair).
    ///
    /// # Safety
    /// A live [`Tiles`] on this thread; `a` covers `steps` pairs of tiles, `b` `16 · steps`
    /// pairs of 32 lanes, `c` 32 rows of 32 f32.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile(a: *const bf16, b: *const u32, ldb: usize, c: *mut f32, ldc: usize, steps: usize, accumulate: bool) {
        let (sa, sb, sc) = (64usize, ldb * 4, ldc * 4);
        // SAFETY: the caller's extents; tmm0–3 hold C's four 16 × 16 quarters, tmm4–5 A's two
        // row tiles, tmm6–7 B's two column tiles
        unsafe {
            let (c1, c2) = (c.add(16), c.add(16 * ldc));
            let c3 = c2.add(16);
            if accumulate {
                asm!(
                    "tileloadd tmm0, [{c0} + {s}*1]",
                    "tileloadd tmm1, [{c1} + {s}*1]",
                    "tileloadd tmm2, [{c2} + {s}*1]",
                    "tileloadd tmm3, [{c3} + {s}*1]",
                    c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, s = in(reg) sc,
                    options(nostack, readonly)
                );
            } else {
                asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem));
            }
            let (a1, b1) = (a.add(TILE), b.add(16));
            for s in 0..steps {
                asm!(
                    "tileloadd tmm4, [{a0} + {sa}*1]",
                    "tileloadd tmm5, [{a1} + {sa}*1]",
                    "tileloadd tmm6, [{b0} + {sb}*1]",
                    "tileloadd tmm7, [{b1} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    a0 = in(reg) a.add(2 * TILE * s), a1 = in(reg) a1.add(2 * TILE * s),
                    b0 = in(reg) b.add(STEP * s * ldb), b1 = in(reg) b1.add(STEP * s * ldb),
                    sa = in(reg) sa, sb = in(reg) sb,
                    options(nostack, readonly)
                );
            }
            asm!(
                "tilestored [{c0} + {s}*1], tmm0",
                "tilestored [{c1} + {s}*1], tmm1",
                "tilestored [{c2} + {s}*1], tmm2",
                "tilestored [{c3} + {s}*1], tmm3",
                c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, s = in(reg) sc,
                options(nostack)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic BF16 values in [−2, 2) with all 8 mantissa bits in play.
    fn data(len: usize, seed: u64) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0)
            })
            .collect()
    }

    /// The product in f64 over the operands' exact values: an independent oracle.
    fn naive(a: Bf16Operand, b: Bf16Operand, m: usize, n: usize, k: usize) -> Vec<f64> {
        let at = |o: &Bf16Operand, r: usize, c: usize| o.data[r * o.row_stride + c * o.col_stride].to_f64();
        (0..m * n).map(|i| (0..k).map(|t| at(&a, i / n, t) * at(&b, t, i % n)).sum()).collect()
    }

    /// f32 sums of `k` products of magnitude ≤ 4: each within `k · 4 · 2⁻²³ · k`-ish of the
    /// exact value; the bound below is loose against ordering but fails any wrong element.
    fn check(c: &[f32], want: &[f64], k: usize, what: &str) {
        let tol = 4.0 * k as f64 * k as f64 * f32::EPSILON as f64 + 1e-6;
        for (i, (&got, &w)) in c.iter().zip(want).enumerate() {
            assert!((got as f64 - w).abs() <= tol, "{what}: element {i}: {got} vs {w} (tolerance {tol:e})");
        }
    }

    fn shapes() -> Vec<(usize, usize, usize)> {
        // tiles, tails in every dimension, an odd k, k across blocks, one row, one column
        vec![
            (1, 1, 1),
            (6, 64, 2),
            (7, 65, 3),
            (13, 130, 257),
            (1, 300, 512),
            (300, 1, 33),
            (37, 2100, 70),
            (200, 70, 600),
            (9, 130, 1101),
            (64, 64, 0),
            // the AMX tiles' strips, panels and steps, whole and with every kind of rest
            (64, 128, 64),
            (96, 200, 1030),
            (33, 64, 32),
            (230, 192, 544),
        ]
    }

    fn run(f: impl Fn(&mut [f32], bool, Bf16Operand, Bf16Operand, usize, usize, usize), what: &str) {
        for (m, n, k) in shapes() {
            let (a, b) = (data(m * k, 1 + m as u64), data(k * n, 7 + n as u64));
            let layouts = [
                (Bf16Operand::plain(&a, k), Bf16Operand::plain(&b, n), "A·B"),
                (Bf16Operand::transposed(&a, m), Bf16Operand::transposed(&b, k), "Aᵀ·Bᵀ"),
                (Bf16Operand::plain(&a, k), Bf16Operand::transposed(&b, k), "A·Bᵀ"),
            ];
            for (ao, bo, form) in layouts {
                let want = naive(ao, bo, m, n, k);
                let mut c = vec![f32::NAN; m * n];
                f(&mut c, false, ao, bo, m, n, k);
                check(&c, &want, k, &format!("{what} {form} [{m}, {k}]·[{k}, {n}]"));
                // accumulate onto a known start
                let mut c: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32).collect();
                let want: Vec<f64> = want.iter().enumerate().map(|(i, w)| w + (i % 5) as f64).collect();
                f(&mut c, true, ao, bo, m, n, k);
                check(&c, &want, k, &format!("{what} {form} += [{m}, {k}]·[{k}, {n}]"));
            }
        }
    }

    #[test]
    fn portable_matches_f64_products() {
        run(portable, "portable");
    }

    #[test]
    fn dispatched_matches_f64_products() {
        // the AVX512-BF16 body where the CPU has it, with AMX's tiles where it has those (said,
        // so a run shows which body it tested)
        #[cfg(target_arch = "x86_64")]
        eprintln!("avx512-bf16: {}, amx: {}", avx512::available(), amx::available());
        run(gemm_bf16, "dispatched");
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_kernel_alone_matches_f64_products() {
        // on an AMX machine the dispatched body tiles most of each product: the vector kernel
        // on its own too
        if avx512::available() {
            // SAFETY: the CPU has AVX512-BF16 (checked); `run` passes buffers of the shapes
            let vector = |c: &mut [f32], acc: bool, a: Bf16Operand, b: Bf16Operand, m: usize, n: usize, k: usize| match k {
                // the dispatcher's own case
                0 => {
                    if !acc {
                        c.fill(0.0)
                    }
                }
                _ => unsafe { avx512::gemm(c, acc, a, b, m, n, k, false) },
            };
            run(vector, "avx512-bf16 without AMX");
        }
    }

    #[test]
    fn sums_are_f32_not_bf16() {
        // 1 + 256 · 2⁻⁹: every partial sum has more bits than BF16 holds (8); rounding the
        // accumulator to BF16 on the way would lose the small terms entirely.
        let k = 257;
        let mut a = vec![bf16::from_f32(2f32.powi(-9)); k];
        a[0] = bf16::ONE;
        let b = vec![bf16::ONE; k];
        let mut c = [0f32];
        gemm_bf16(&mut c, false, Bf16Operand::plain(&a, k), Bf16Operand::plain(&b, 1), 1, 1, k);
        assert_eq!(c[0], 1.5);
    }
}
