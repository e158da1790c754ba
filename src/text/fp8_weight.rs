//! A frozen projection weight kept in its released precision: FP8 E4M3FN codes with one scale
//! per block (DeepSeek-V3's convention, `weight_scale_inv` per 128×128 block), dequantised per
//! use by [`crate::ops::backend::Glm5Backend::fp8_linear`] — a byte a weight instead of two
//! (BF16) or four (f32), for LoRA on a frozen base.
//!
//! ```text
//! W[m, k] = round_bf16(e4m3(codes[m, k]) · scale_inv[⌊m/b_r⌋, ⌊k/b_c⌋])      codes [M, K]
//! ```
//!
//! The codes keep HF's `nn.Linear` layout `[out, in]` (the checkpoint's bytes, unconverted).
//! Both tensors are module *constants*, not parameters: no optimizer, gradient, dtype cast,
//! sharding plan or checkpoint writer sees them, which is what a frozen base needs. Built by
//! the loader ([`crate::checkpoint::LoadOptions::fp8_base`]). Under FSDP a weight is split by
//! whole blocks of rows ([`Fp8Weight::into_shard`]) and gathered with its decoder layer
//! ([`Fp8Weight::gathered`]): freed after the layer's forward, re-gathered for its backward
//! by the next layer's first parameter gather, as the parameters are
//! ([`crate::distributed::fsdp`]).

use std::sync::Arc;

use burn::module::Module;
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};

use crate::distributed::regather::Regather;
use crate::distributed::{typed, DistError, Group, RowShard};
use crate::ops::backend::Fp8Refetch;

/// An FP8 weight `[M, K]` and its block scales.
#[derive(Module, Debug)]
pub struct Fp8Weight<B: Backend> {
    /// E4M3FN codes `[M, K]` (`U8`); with [`Self::shard`], this rank's rows only.
    pub codes: Tensor<B, 2, Int>,
    /// `weight_scale_inv` `[⌈M/b_r⌉, ⌈K/b_c⌉]`, f32 (multiplies on dequantisation); with
    /// [`Self::shard`], this rank's block rows only.
    pub scale_inv: Tensor<B, 2>,
    /// Rows a scale covers (`b_r`, 128 in the release).
    pub block_rows: usize,
    /// Columns a scale covers (`b_c`, 128 in the release).
    pub block_cols: usize,
    /// Set when the weight is split over an FSDP group ([`Self::into_shard`]): the slice this
    /// rank holds and the full `M`.
    #[module(skip)]
    pub shard: Option<(RowShard, usize)>,
    /// Set on a gathered copy whose unit is freed after its forward: where the backward finds
    /// the weight again ([`Self::gathered`]).
    #[module(skip)]
    pub refetch: Option<Refetcher>,
}

/// An [`Fp8Refetch`] of the weight's backend, as a module field (type-erased: Burn's derive
/// takes a backend-generic field for a module).
#[derive(Clone)]
pub struct Refetcher(Arc<dyn std::any::Any + Send + Sync>);

impl Refetcher {
    /// The refetch, when it is one of `B`'s.
    pub fn get<B: Backend>(&self) -> Option<Fp8Refetch<B>> {
        self.0.downcast_ref::<Fp8Refetch<B>>().cloned()
    }
}

impl std::fmt::Debug for Refetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Refetcher")
    }
}

impl<B: Backend> Fp8Weight<B> {
    /// `(K, M)`: input and output features.
    pub fn in_out(&self) -> (usize, usize) {
        let [m, k] = self.codes.dims();
        (k, m)
    }

    /// `[b_r, b_c]`.
    pub fn block(&self) -> [usize; 2] {
        [self.block_rows, self.block_cols]
    }

    /// The dequantised weight in Burn's `Linear` layout `[K, M]`, in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Tensor<B, 2> {
        crate::ops::fp8_linear::dequantize(self.codes.clone(), self.scale_inv.clone(), self.block(), dtype).transpose()
    }

    /// Bytes held by the codes (a byte each when stored as `U8`) and the scales.
    pub fn num_bytes(&self) -> usize {
        let ([m, k], [gm, gk]) = (self.codes.dims(), self.scale_inv.dims());
        m * k * self.codes.dtype().size() + gm * gk * self.scale_inv.dtype().size()
    }

    /// Bytes of the whole weight, sharded or not (U8 codes, f32 scales).
    pub fn whole_bytes(&self) -> usize {
        let ([m, k], [_, gk]) = (self.codes.dims(), self.scale_inv.dims());
        let rows = self.shard.map_or(m, |(_, rows)| rows);
        rows * k + rows.div_ceil(self.block_rows) * gk * 4
    }

    /// A whole weight built from its codes and scales (the loader's).
    pub fn new(codes: Tensor<B, 2, Int>, scale_inv: Tensor<B, 2>, [block_rows, block_cols]: [usize; 2]) -> Self {
        Self { codes, scale_inv, block_rows, block_cols, shard: None, refetch: None }
    }

    /// Rank `shard.rank`'s FSDP slice: whole blocks of rows, so that each scale stays with its
    /// codes — block rows `[r·c, (r+1)·c)` of `⌈M/b_r⌉` (`c` = their count over the ranks,
    /// rounded up), zero-padded to `c·b_r` code rows and `c` scale rows on every rank. Module
    /// constants are no parameters, so [`crate::distributed::ShardPlan`] does not cut them;
    /// the text model gathers them per unit ([`super::model::TextModel`]).
    pub fn into_shard(self, shard: RowShard) -> Self {
        let ([m, k], [gm, gk]) = (self.codes.dims(), self.scale_inv.dims());
        let c = gm.div_ceil(shard.size.max(1));
        let blocks = (shard.rank * c).min(gm)..((shard.rank + 1) * c).min(gm);
        let rows = (blocks.start * self.block_rows).min(m)..(blocks.end * self.block_rows).min(m);
        let device = self.codes.device();
        let codes = self.codes.to_data();
        let mine = padded_rows(codes.as_slice::<u8>().unwrap_or_else(|e| panic!("FP8 codes are U8: {e:?}")), k, rows, c * self.block_rows);
        let scales = self.scale_inv.to_data().convert::<f32>();
        let my_scales = padded_rows(scales.as_slice::<f32>().unwrap_or_else(|e| panic!("FP8 scales are f32: {e:?}")), gk, blocks, c);
        Self {
            codes: Tensor::from_data(TensorData::new(mine, [c * self.block_rows, k]), (&device, DType::U8)),
            scale_inv: Tensor::from_data(TensorData::new(my_scales, [c, gk]), &device),
            block_rows: self.block_rows,
            block_cols: self.block_cols,
            shard: Some((shard, m)),
            refetch: None,
        }
    }

    /// The whole weight from every rank's slice ([`Self::into_shard`]) over `group`: an
    /// all-gather of the codes' bytes and the scales on the host. With `regather` (the unit is
    /// freed after its forward and `B` has a backward), the result's `refetch` is set and the
    /// same all-gather is recorded for the next anchored FSDP gather to run in backward
    /// ([`Regather::push_task`]), so the backward does not keep the gathered weight. A weight
    /// that is not sharded is returned as it is.
    pub fn gathered(&self, group: &Group, regather: Option<&Arc<Regather>>) -> Result<Self, DistError> {
        let Some((shard, rows)) = self.shard else { return Ok(self.clone()) };
        if (group.rank(), group.size()) != (shard.rank, shard.size) {
            return Err(DistError::Mesh {
                message: format!(
                    "an FP8 weight sharded as rank {} of {} is gathered over rank {} of {}",
                    shard.rank,
                    shard.size,
                    group.rank(),
                    group.size()
                ),
                reported: false,
            });
        }
        let [_, k] = self.codes.dims();
        let [_, gk] = self.scale_inv.dims();
        let full = ([rows, k], [rows.div_ceil(self.block_rows), gk]);
        let (codes, scales, refetch) = gather_fp8(&self.codes, &self.scale_inv, full, group, regather)?;
        Ok(Self { codes, scale_inv: scales, block_rows: self.block_rows, block_cols: self.block_cols, shard: None, refetch })
    }
}

/// Every rank's equal, padded slice (dim 0) of `codes` and `scales` over `group`,
/// concatenated and cut to the whole tensors' dims `full` — an all-gather of the codes' bytes and
/// the scales on the host. With `regather`, the same all-gather is also recorded for the next
/// anchored FSDP gather to run in backward, and a refetch that takes its result is returned.
#[allow(clippy::type_complexity)]
fn gather_fp8<B: Backend, const D: usize>(
    codes: &Tensor<B, D, Int>,
    scales: &Tensor<B, D>,
    full: ([usize; D], [usize; D]),
    group: &Group,
    regather: Option<&Arc<Regather>>,
) -> Result<(Tensor<B, D, Int>, Tensor<B, D>, Option<Refetcher>), DistError> {
    let (codes_full, scales_full) = gather_host(codes, scales, full, group)?;
    let refetch = regather.map(|regather| {
        let key = regather.key();
        let (codes, scales, group, store) = (codes.clone(), scales.clone(), group.clone(), regather.clone());
        regather.push_task(Box::new(move || {
            // a failing engine aborts the MPI job; the counts are equal by construction
            let (c, s) = gather_host(&codes, &scales, full, &group)
                .unwrap_or_else(|e| panic!("the re-gather of a sharded FP8 weight failed in backward: {e}"));
            store.put_ready(key, (c.into_primitive(), s.into_primitive().tensor()));
        }));
        let store = regather.clone();
        Refetcher(Arc::new(Arc::new(move || store.take_ready(key)) as Fp8Refetch<B>))
    });
    Ok((codes_full, scales_full, refetch))
}

/// [`gather_fp8`]'s all-gather.
fn gather_host<B: Backend, const D: usize>(
    codes: &Tensor<B, D, Int>,
    scales: &Tensor<B, D>,
    (code_dims, scale_dims): ([usize; D], [usize; D]),
    group: &Group,
) -> Result<(Tensor<B, D, Int>, Tensor<B, D>), DistError> {
    let device = codes.device();
    let data = codes.to_data();
    let mine = data.as_slice::<u8>().unwrap_or_else(|e| panic!("FP8 codes are U8: {e:?}"));
    let mut all = typed::all_gather::<u8>(&**group, mine)?;
    all.truncate(code_dims.iter().product());
    let data = scales.to_data().convert::<f32>();
    let mine = data.as_slice::<f32>().unwrap_or_else(|e| panic!("FP8 scales are f32: {e:?}"));
    let mut all_scales = typed::all_gather::<f32>(&**group, mine)?;
    all_scales.truncate(scale_dims.iter().product());
    Ok((
        Tensor::from_data(TensorData::new(all, code_dims), (&device, DType::U8)),
        Tensor::from_data(TensorData::new(all_scales, scale_dims), &device),
    ))
}

/// Rows `range` of a row-major tensor of `width` values a row, zero-padded to `rows` rows
/// (one rank's slice along dim 0).
fn padded_rows<T: Copy + Default>(data: &[T], width: usize, range: std::ops::Range<usize>, rows: usize) -> Vec<T> {
    let mut out = vec![T::default(); rows * width];
    out[..range.len() * width].copy_from_slice(&data[range.start * width..range.end * width]);
    out
}

/// How a stack of FP8 experts is split: over `group`, `experts` in all (this rank's
/// `⌈experts/size⌉`, the last ones padded with zero experts).
#[derive(Debug, Clone)]
pub struct StackShard {
    /// The group the stack is split over (the expert-data-parallel group under expert
    /// parallelism, else the data-parallel world).
    pub group: Group,
    /// The experts of the whole stack.
    pub experts: usize,
}

/// The routed experts' weights of one projection in FP8: every expert's `[N, K]` codes
/// (HF's per-expert `[out, in]`) stacked, with their block scales.
#[derive(Module, Debug)]
pub struct Fp8Stack<B: Backend> {
    /// E4M3FN codes `[E, N, K]` (`U8`).
    pub codes: Tensor<B, 3, Int>,
    /// `weight_scale_inv` per expert, `[E, ⌈N/b_r⌉, ⌈K/b_c⌉]`, f32.
    pub scale_inv: Tensor<B, 3>,
    /// Rows a scale covers (`b_r`).
    pub block_rows: usize,
    /// Columns a scale covers (`b_c`).
    pub block_cols: usize,
    /// Set when the stack is split over an FSDP group ([`Self::into_shard`]).
    #[module(skip)]
    pub shard: Option<StackShard>,
    /// Set on a gathered copy whose layer is freed after its forward ([`Fp8Weight::refetch`]).
    #[module(skip)]
    pub refetch: Option<Refetcher>,
}

impl<B: Backend> Fp8Stack<B> {
    /// A whole stack from its codes `[E, N, K]` and scales (the loader's).
    pub fn new(codes: Tensor<B, 3, Int>, scale_inv: Tensor<B, 3>, [block_rows, block_cols]: [usize; 2]) -> Self {
        Self { codes, scale_inv, block_rows, block_cols, shard: None, refetch: None }
    }

    /// This rank's FSDP slice over `group`: experts `[r·c, (r+1)·c)` (`c = ⌈E/size⌉`), with
    /// their scales, zero-padded to `c` experts on every rank.
    pub fn into_shard(self, group: Group) -> Self {
        let ([e, n, k], [_, gn, gk]) = (self.codes.dims(), self.scale_inv.dims());
        let c = e.div_ceil(group.size().max(1));
        let range = (group.rank() * c).min(e)..((group.rank() + 1) * c).min(e);
        let device = self.codes.device();
        let codes = self.codes.to_data();
        let codes = padded_rows(codes.as_slice::<u8>().unwrap_or_else(|err| panic!("FP8 codes are U8: {err:?}")), n * k, range.clone(), c);
        let scales = self.scale_inv.to_data().convert::<f32>();
        let scales = padded_rows(scales.as_slice::<f32>().unwrap_or_else(|err| panic!("FP8 scales are f32: {err:?}")), gn * gk, range, c);
        Self {
            codes: Tensor::from_data(TensorData::new(codes, [c, n, k]), (&device, DType::U8)),
            scale_inv: Tensor::from_data(TensorData::new(scales, [c, gn, gk]), &device),
            block_rows: self.block_rows,
            block_cols: self.block_cols,
            shard: Some(StackShard { group, experts: e }),
            refetch: None,
        }
    }

    /// The whole stack from every rank's slice ([`Self::into_shard`]), as
    /// [`Fp8Weight::gathered`]: with `regather`, re-gathered for the backward instead of kept.
    pub fn gathered(&self, regather: Option<&Arc<Regather>>) -> Result<Self, DistError> {
        let Some(shard) = &self.shard else { return Ok(self.clone()) };
        let ([_, n, k], [_, gn, gk]) = (self.codes.dims(), self.scale_inv.dims());
        let e = shard.experts;
        let (codes, scale_inv, refetch) = gather_fp8(&self.codes, &self.scale_inv, ([e, n, k], [e, gn, gk]), &shard.group, regather)?;
        Ok(Self { codes, scale_inv, block_rows: self.block_rows, block_cols: self.block_cols, shard: None, refetch })
    }

    /// Bytes of the whole stack, split or not (U8 codes, f32 scales).
    pub fn whole_bytes(&self) -> usize {
        let ([e, n, k], [_, gn, gk]) = (self.codes.dims(), self.scale_inv.dims());
        self.shard.as_ref().map_or(e, |s| s.experts) * (n * k + gn * gk * 4)
    }

    /// `[b_r, b_c]`.
    pub fn block(&self) -> [usize; 2] {
        [self.block_rows, self.block_cols]
    }

    /// The experts `range` only (an expert-parallel rank's share).
    pub fn slice(self, range: std::ops::Range<usize>) -> Self {
        let ([_, n, k], [_, gn, gk]) = (self.codes.dims(), self.scale_inv.dims());
        Self::new(self.codes.slice([range.clone(), 0..n, 0..k]), self.scale_inv.slice([range, 0..gn, 0..gk]), [self.block_rows, self.block_cols])
    }

    /// The dequantised weights in the experts' Burn layout `[E, K, N]`, in `dtype`.
    pub fn dequantize(&self, dtype: DType) -> Tensor<B, 3> {
        let ([e, n, k], [_, gn, gk]) = (self.codes.dims(), self.scale_inv.dims());
        let experts = (0..e)
            .map(|x| {
                let codes = self.codes.clone().slice([x..x + 1, 0..n, 0..k]).reshape([n, k]);
                let scales = self.scale_inv.clone().slice([x..x + 1, 0..gn, 0..gk]).reshape([gn, gk]);
                crate::ops::fp8_linear::dequantize(codes, scales, self.block(), dtype).transpose().unsqueeze_dim::<3>(0)
            })
            .collect();
        Tensor::cat(experts, 0)
    }

    /// Bytes held by the codes and the scales.
    pub fn num_bytes(&self) -> usize {
        self.codes.shape().num_elements() * self.codes.dtype().size() + self.scale_inv.shape().num_elements() * self.scale_inv.dtype().size()
    }
}

/// A MoE layer's routed experts in FP8: `gate_proj`, `up_proj` `[E, I, D]`, `down_proj`
/// `[E, D, I]` (HF's per-expert layouts), frozen.
#[derive(Module, Debug)]
pub struct Fp8Experts<B: Backend> {
    /// `gate_proj` of every expert.
    pub gate_proj: Fp8Stack<B>,
    /// `up_proj` of every expert.
    pub up_proj: Fp8Stack<B>,
    /// `down_proj` of every expert.
    pub down_proj: Fp8Stack<B>,
}

impl<B: Backend> Fp8Experts<B> {
    /// The three stacks.
    pub fn stacks_mut(&mut self) -> [&mut Fp8Stack<B>; 3] {
        [&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj]
    }

    /// Whether a stack is split over an FSDP group.
    pub fn is_sharded(&self) -> bool {
        [&self.gate_proj, &self.up_proj, &self.down_proj].iter().any(|s| s.shard.is_some())
    }
}
