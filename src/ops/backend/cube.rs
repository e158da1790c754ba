//! CubeCL backends (`Vulkan`/`Wgpu`, `Cuda`): the kernels of `glm5-cubecl-kernels`.

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorData, TensorPrimitive};

use super::prim::*;
use super::Glm5Backend;
use crate::ops::kpool::{self, KpoolSelect};
use crate::ops::sparse_attn;
use crate::ops::OpImpl;

use glm5_cubecl_kernels::{kda_pairs, sparse_attn as sa, BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};

impl<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement> Glm5Backend for CubeBackend<R, F, I, BT> {
    fn kda_pairs_impl() -> OpImpl {
        OpImpl::Kernel
    }

    fn sparse_attention_impl() -> OpImpl {
        OpImpl::Kernel
    }

    fn kpool_impl() -> OpImpl {
        OpImpl::Kernel
    }

    fn kda_scan_impl() -> OpImpl {
        OpImpl::Kernel
    }

    fn kda_states_forward(
        w: FloatTensor<Self>,
        u: FloatTensor<Self>,
        kd: FloatTensor<Self>,
        a: FloatTensor<Self>,
        h0: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        glm5_cubecl_kernels::kda_states::forward(w, u, kd, a, h0)
    }

    fn kda_unit_lower_solve(l: FloatTensor<Self>, rhs: FloatTensor<Self>, transposed: bool) -> FloatTensor<Self> {
        glm5_cubecl_kernels::kda_solve::solve(l, rhs, transposed)
    }

    fn kda_states_backward(
        p: FloatTensor<Self>,
        qg: FloatTensor<Self>,
        kd: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        d_final: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        glm5_cubecl_kernels::kda_states::backward(p, qg, kd, w, a, d_o, d_final)
    }

    fn kpool_select(
        q: FloatTensor<Self>,
        w: FloatTensor<Self>,
        pooled: FloatTensor<Self>,
        mask: &[bool],
        sel: KpoolSelect,
        scale: f32,
    ) -> (Vec<i64>, f32) {
        kpool_on_cube::<R, F, I, BT>(q, w, pooled, mask, sel, scale)
    }

    fn kpool_compress(k: FloatTensor<Self>, gate: FloatTensor<Self>, ape: FloatTensor<Self>, first: &[usize]) -> FloatTensor<Self> {
        let first: Vec<i32> = first.iter().map(|&f| i32::try_from(f).expect("sequence positions fit in i32")).collect();
        let n = first.len();
        let first = Tensor::<Self, 1, Int>::from_data(TensorData::new(first, [n]), &k.device).cast(burn::tensor::IntDType::I32);
        glm5_cubecl_kernels::kpool_compress::compress(k, gate, ape, first.into_primitive())
    }

    fn fp8_linear_impl() -> OpImpl {
        OpImpl::Kernel
    }

    fn fp8_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let codes = Tensor::<Self, 2, Int>::from_primitive(codes).unsqueeze_dim::<3>(0);
        let w = dequantize_on_cube(codes, f2::<Self>(scales).unsqueeze_dim(0), block, x.dtype).squeeze_dim::<2>(0);
        crate::ops::linear::reference_forward(f2::<Self>(x), w.transpose(), b.map(f1)).into_primitive().tensor()
    }

    fn fp8_linear_backward(grad: FloatTensor<Self>, codes: IntTensor<Self>, scales: FloatTensor<Self>, block: [usize; 2]) -> FloatTensor<Self> {
        let codes = Tensor::<Self, 2, Int>::from_primitive(codes).unsqueeze_dim::<3>(0);
        let w = dequantize_on_cube(codes, f2::<Self>(scales).unsqueeze_dim(0), block, grad.dtype).squeeze_dim::<2>(0);
        f2::<Self>(grad).matmul(w).into_primitive().tensor()
    }

    /// The stack dequantised by the kernel, then the backend's grouped product on it.
    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
    ) -> FloatTensor<Self> {
        let w = dequantize_on_cube(Tensor::<Self, 3, Int>::from_primitive(codes), f3::<Self>(scales), block, x.dtype);
        Self::grouped_matmul(x, w.swap_dims(1, 2).into_primitive().tensor(), sizes)
    }

    fn fp8_grouped_matmul_backward(
        grad: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
    ) -> FloatTensor<Self> {
        let w = dequantize_on_cube(Tensor::<Self, 3, Int>::from_primitive(codes), f3::<Self>(scales), block, grad.dtype);
        let w = w.swap_dims(1, 2).into_primitive().tensor();
        Self::grouped_matmul_backward(None, Some(w), grad, sizes).0.expect("∂x when the weight is given")
    }

    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        kda_pairs::pair_sums(k, q, gam)
    }

    fn kda_pair_sums_backward(
        k: FloatTensor<Self>,
        q: FloatTensor<Self>,
        gam: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        kda_pairs::pair_sums_backward(k, q, gam, grad)
    }

    fn sparse_latent_attention(
        q: FloatTensor<Self>,
        kv: FloatTensor<Self>,
        idx: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        sa::forward(q, kv, i32_indices::<Self>(idx), scale)
    }

    fn sparse_latent_attention_backward(
        q: FloatTensor<Self>,
        kv: FloatTensor<Self>,
        idx: IntTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let kv_dtype = kv.dtype;
        let [m, _] = f2::<Self>(kv.clone()).dims();
        let rows = sparse_attn::entry_rows(Tensor::<Self, 2, Int>::from_primitive(idx.clone()), m);
        let (dq, partial) = sa::backward(q, kv, i32_indices::<Self>(idx), o, lse, d_o, scale);
        let dkv = sparse_attn::scatter_entries(f3::<Self>(partial), rows, m).cast(kv_dtype);
        (dq, dkv.into_primitive().tensor())
    }
}

/// Queries per indexer-kernel launch: bounds the `[tile, P]` score buffer to 16 M floats.
const KPOOL_TILE_SCORES: usize = 1 << 24;

/// A stack of FP8 codes `[G, M, K]` and their scales dequantised by the `fp8_dequant` kernel
/// into `dtype`. Codes the backend holds in an integer dtype other than `U8` are cast first.
fn dequantize_on_cube<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    codes: Tensor<CubeBackend<R, F, I, BT>, 3, Int>,
    scales: Tensor<CubeBackend<R, F, I, BT>, 3>,
    block: [usize; 2],
    dtype: burn::tensor::DType,
) -> Tensor<CubeBackend<R, F, I, BT>, 3> {
    let codes = if codes.dtype() == burn::tensor::DType::U8 { codes } else { codes.cast(burn::tensor::IntDType::U8) };
    let scales = scales.cast(burn::tensor::DType::F32).into_primitive().tensor();
    Tensor::from_primitive(TensorPrimitive::Float(glm5_cubecl_kernels::fp8_dequant::dequantize(codes.into_primitive(), scales, block, dtype)))
}

fn kpool_on_cube<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    q: FloatTensor<CubeBackend<R, F, I, BT>>,
    w: FloatTensor<CubeBackend<R, F, I, BT>>,
    pooled: FloatTensor<CubeBackend<R, F, I, BT>>,
    mask: &[bool],
    sel: KpoolSelect,
    scale: f32,
) -> (Vec<i64>, f32) {
    type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    let q = Tensor::<Cb<R, F, I, BT>, 4>::from_primitive(TensorPrimitive::Float(q));
    let w = f3::<Cb<R, F, I, BT>>(w);
    let [b, s, h, d] = q.dims();
    let n_pools = s.div_ceil(sel.kpool);
    let device = q.device();
    let ints = |v: Vec<i32>| {
        let n = v.len();
        Tensor::<Cb<R, F, I, BT>, 1, Int>::from_data(TensorData::new(v, [n]), &device).cast(burn::tensor::IntDType::I32)
    };
    let lay = kpool::KernelLayout::new(mask, b, s, sel.kpool);
    let valid: Vec<i32> = mask.iter().map(|&m| m as i32).collect();
    let layout = glm5_cubecl_kernels::kpool::KpoolLayout {
        last: ints(lay.last).reshape([b, n_pools]).into_primitive(),
        first: ints(lay.first).into_primitive(),
        valid: ints(valid).reshape([b, s]).into_primitive(),
    };
    let params = glm5_cubecl_kernels::kpool::KpoolParams {
        kpool: sel.kpool,
        budget: sel.index_topk / sel.kpool,
        tail: sel.always_select_tail,
        width: sel.width(),
        scale,
    };
    let (q, w) = (q.reshape([b * s, h, d]), w.reshape([b * s, h]));
    let tile = (KPOOL_TILE_SCORES / n_pools.max(1)).clamp(1, (b * s).max(1));
    let mut out = Vec::with_capacity(b * s * params.width);
    let mut margin = f32::INFINITY;
    for lo in (0..b * s).step_by(tile) {
        let hi = (lo + tile).min(b * s);
        let queries = glm5_cubecl_kernels::kpool::KpoolQueries {
            row: ints((lo..hi).map(|i| (i / s) as i32).collect()).into_primitive(),
            pos: ints((lo..hi).map(|i| (i % s) as i32).collect()).into_primitive(),
            vis: ints(lay.visible[lo..hi].to_vec()).into_primitive(),
        };
        let qt = q.clone().slice([lo..hi, 0..h, 0..d]).into_primitive().tensor();
        let wt = w.clone().slice([lo..hi, 0..h]).into_primitive().tensor();
        let (idx, m) = glm5_cubecl_kernels::kpool::select(qt, wt, pooled.clone(), &layout, &queries, params);
        let idx = Tensor::<Cb<R, F, I, BT>, 2, Int>::from_primitive(idx).into_data().convert::<i64>();
        out.extend(idx.into_vec::<i64>().expect("indexer kernel output is integer"));
        let m = Tensor::<Cb<R, F, I, BT>, 1>::from_primitive(TensorPrimitive::Float(m)).into_data().convert::<f32>();
        margin = m.iter::<f32>().fold(margin, f32::min);
    }
    // the kernel reports 3e38 where nothing was rejected; the host path reports +∞
    (out, if margin >= 3.0e38 { f32::INFINITY } else { margin })
}

fn i32_indices<B: Backend>(idx: IntTensor<B>) -> IntTensor<B> {
    Tensor::<B, 2, Int>::from_primitive(idx).cast(burn::tensor::IntDType::I32).into_primitive()
}
