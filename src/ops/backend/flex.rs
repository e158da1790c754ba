//! Flex's fused bodies: host loops over contiguous fp32 buffers, in parallel (rayon), for
//! fp32 inputs; other dtypes take the reference ops, keeping their rounding. The exceptions,
//! all for 16-bit floats: the linear layers' and the routed experts' BF16 products have their
//! own bodies (`ops::linear::host_{forward,backward}_bf16`, `ops::grouped_matmul::host_*_bf16`,
//! on the BF16 matrix product `ops::gemm_bf16`: f32 accumulation, one rounding, as the
//! reference's); the sparse latent attention and mHC's stream products (`hc_collapse`,
//! `hc_post`, and their backwards) run their f32 bodies on widened BF16/F16 inputs and round
//! each result once ([`widenable`]; `hc_post` reads BF16 streams in place). SwiGLU and SiLU
//! keep the reference's (HF's) rounding after each step: rounding them once measured farther
//! from the fp32 truth on the release-like bf16 fixture (mean KL 1.20e-3 vs 2.09e-4, HF
//! 1.14e-3; `cargo test --test parity bf16 -- --nocapture`).

use burn::backend::Flex;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Int, Tensor};

use super::prim::*;
use super::Glm5Backend;
use crate::ops::adamw::{self, AdamWScalars};
use crate::ops::backend::ScanInputs;
use crate::ops::OpImpl;
use crate::ops::{conv, hc_streams, kda_gate, kda_host, kda_pairs, rms, sinkhorn, sparse_attn, swiglu};
use crate::ops::{cross_entropy, grouped_matmul, linear};

/// A Flex tensor as contiguous fp32 host memory — the tensor's own buffer when it already
/// is one (no copy), a converted copy otherwise.
struct HostF32(burn_flex::FlexTensor);

impl std::ops::Deref for HostF32 {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        self.0.as_slice::<f32>().expect("a contiguous fp32 tensor")
    }
}

/// `t` in `dtype`, every value rounded once to nearest even ([`Glm5Backend::cast_float`]):
/// between f32 and the 16-bit floats straight through `half` (no f64 copy), in parallel;
/// f64 sources and targets take Flex's own cast.
pub(crate) fn flex_cast(t: FloatTensor<Flex>, dtype: DType) -> FloatTensor<Flex> {
    use burn::tensor::ops::FloatTensorOps;
    use half::slice::HalfFloatSliceExt;
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let from = t.dtype();
    if from == dtype {
        return t;
    }
    let t = t.to_contiguous();
    let dims = t.layout().shape().clone();
    let n = t.layout().num_elements();
    let out = |bytes: burn::tensor::Bytes| burn_flex::FlexTensor::new(bytes, burn_flex::Layout::contiguous(dims.clone()), dtype);
    macro_rules! narrow {
        ($half:ty) => {{
            let src = t.as_slice::<f32>().expect("a contiguous fp32 tensor");
            let mut v = vec![<$half>::ZERO; n];
            v.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| d.convert_from_f32_slice(s));
            out(burn::tensor::Bytes::from_elems(v))
        }};
    }
    macro_rules! widen {
        ($half:ty) => {{
            let src = t.as_slice::<$half>().expect("a contiguous 16-bit tensor");
            let mut v = vec![0f32; n];
            v.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)).for_each(|(d, s)| s.convert_to_f32_slice(d));
            out(burn::tensor::Bytes::from_elems(v))
        }};
    }
    match (from, dtype) {
        (DType::F32, DType::BF16) => narrow!(half::bf16),
        (DType::F32, DType::F16) => narrow!(half::f16),
        (DType::BF16, DType::F32) => widen!(half::bf16),
        (DType::F16, DType::F32) => widen!(half::f16),
        // exact to f32, then one rounding
        (DType::BF16 | DType::F16, DType::BF16 | DType::F16) => flex_cast(flex_cast(t, DType::F32), dtype),
        _ => Flex::float_cast(t, dtype.into()),
    }
}

/// A rank-`D` Flex tensor as host fp32 data and its shape.
fn host_n<const D: usize>(t: FloatTensor<Flex>) -> (HostF32, [usize; D]) {
    use burn::tensor::TensorMetadata;
    let t = flex_cast(t, DType::F32);
    let t = t.to_contiguous();
    let dims = t.shape().dims::<D>();
    (HostF32(t), dims)
}

/// A rank-`D` BF16 Flex tensor, contiguous (its own buffer when it already is).
fn host_bf16<const D: usize>(t: FloatTensor<Flex>) -> (burn_flex::FlexTensor, [usize; D]) {
    use burn::tensor::TensorMetadata;
    let t = t.to_contiguous();
    let dims = t.shape().dims::<D>();
    (t, dims)
}

/// A Flex tensor owning host BF16 data (no copy).
fn flex_bf16(v: Vec<half::bf16>, dims: Vec<usize>) -> FloatTensor<Flex> {
    debug_assert_eq!(v.len(), dims.iter().product::<usize>());
    burn_flex::FlexTensor::new(burn::tensor::Bytes::from_elems(v), burn_flex::Layout::contiguous(dims.into()), DType::BF16)
}

fn bf16_slice(t: &burn_flex::FlexTensor) -> &[half::bf16] {
    t.as_slice::<half::bf16>().expect("a contiguous bf16 tensor")
}

fn host(t: FloatTensor<Flex>) -> (HostF32, [usize; 3]) {
    host_n::<3>(t)
}

/// An integer Flex tensor's elements as `i64` host values (a copy).
fn host_i64(t: IntTensor<Flex>) -> Vec<i64> {
    let data = Tensor::<Flex, 2, Int>::from_primitive(t).into_data().convert::<i64>();
    data.into_vec::<i64>().expect("converted to i64")
}

/// A rank-`D` Flex tensor owning host fp32 data (no copy).
fn flex_tensor<const D: usize>(v: Vec<f32>, dims: [usize; D]) -> FloatTensor<Flex> {
    debug_assert_eq!(v.len(), dims.iter().product::<usize>());
    burn_flex::FlexTensor::new(burn::tensor::Bytes::from_elems(v), burn_flex::Layout::contiguous(dims.into()), DType::F32)
}

/// A flat fp32 tensor whose storage is exactly its elements, so `storage_mut` writes them in
/// place (copy-on-write only where the buffer is shared or holds more than the view).
fn owned_flat(t: FloatTensor<Flex>) -> FloatTensor<Flex> {
    let n = t.layout().num_elements();
    if t.layout().contiguous_offsets() == Some((0, n)) && t.bytes().len() == n * 4 {
        t
    } else {
        let (h, _) = host_n::<1>(t);
        flex_tensor(h.to_vec(), [n])
    }
}

/// Whether every given tensor is fp32 (the fused host ops' domain; other dtypes take the
/// reference ops, keeping their rounding).
fn all_f32(ts: &[Option<&FloatTensor<Flex>>]) -> bool {
    all_dtype(ts, DType::F32)
}

/// An fp32 result in `dtype` (rounded once; unchanged when `dtype` is F32).
fn in_dtype(t: FloatTensor<Flex>, dtype: DType) -> FloatTensor<Flex> {
    flex_cast(t, dtype)
}

/// Whether every given tensor is fp32 or a 16-bit float (BF16/F16): mHC's stream products
/// run their f32 body on the widened 16-bit inputs (`post` and `C` kept fp32) and round the
/// result once, where the reference rounds after each product. f64 keeps the reference.
fn widenable(ts: &[Option<&FloatTensor<Flex>>]) -> bool {
    ts.iter().flatten().all(|t| matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16))
}

fn all_dtype(ts: &[Option<&FloatTensor<Flex>>], dtype: DType) -> bool {
    ts.iter().flatten().all(|t| t.dtype() == dtype)
}

/// FP8 codes as contiguous host bytes and the weight's geometry; `None` (the reference runs)
/// unless the codes are `U8` and the scale grid fits them and `block`.
fn fp8_host(
    codes: &IntTensor<Flex>,
    scales: &FloatTensor<Flex>,
    block: [usize; 2],
) -> Option<(burn_flex::FlexTensor, crate::ops::fp8_linear::Fp8Geometry)> {
    use burn::tensor::TensorMetadata;
    let ([rows, cols], sdims) = (codes.shape().dims::<2>(), scales.shape().dims::<2>());
    let g = crate::ops::fp8_linear::Fp8Geometry { rows, cols, block };
    (codes.dtype() == DType::U8 && block[0] > 0 && block[1] > 0 && sdims == g.scale_shape()).then(|| (codes.clone().to_contiguous(), g))
}

/// [`fp8_host`] for a stack of experts' FP8 weights `[G, N, K]` with scales `[G, gn, gk]`: the
/// bytes and one expert's geometry.
fn fp8_stack_host(
    codes: &IntTensor<Flex>,
    scales: &FloatTensor<Flex>,
    block: [usize; 2],
) -> Option<(burn_flex::FlexTensor, crate::ops::fp8_linear::Fp8Geometry)> {
    use burn::tensor::TensorMetadata;
    let ([e, rows, cols], [se, gn, gk]) = (codes.shape().dims::<3>(), scales.shape().dims::<3>());
    let g = crate::ops::fp8_linear::Fp8Geometry { rows, cols, block };
    (codes.dtype() == DType::U8 && block[0] > 0 && block[1] > 0 && se == e && [gn, gk] == g.scale_shape()).then(|| (codes.clone().to_contiguous(), g))
}

/// Flex: each op as host loops over its buffers (the equations and loops live with the op in
/// `ops::*`); fp32 only, other dtypes take the reference bodies.
impl Glm5Backend for Flex {
    fn cast_float(x: FloatTensor<Self>, dtype: burn::tensor::FloatDType) -> FloatTensor<Self> {
        flex_cast(x, dtype.into())
    }

    fn kda_pairs_impl() -> OpImpl {
        OpImpl::Fused
    }

    fn kda_scan_impl() -> OpImpl {
        OpImpl::Fused
    }

    fn causal_conv1d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x), Some(&w)]) {
            return conv::reference_forward(f3::<Self>(x), f2::<Self>(w)).into_primitive().tensor();
        }
        let ((x, [b, t, c]), (w, [_, taps])) = (host(x), host_n::<2>(w));
        flex_tensor(conv::host_forward(&x, &w, t, c, taps), [b, t, c])
    }

    fn causal_conv1d_backward(x: FloatTensor<Self>, w: FloatTensor<Self>, grad: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&x), Some(&w), Some(&grad)]) {
            let (dx, dw) = conv::reference_backward(f3::<Self>(x), f2::<Self>(w), f3::<Self>(grad));
            return (dx.into_primitive().tensor(), dw.into_primitive().tensor());
        }
        let ((x, [b, t, c]), (w, [_, taps]), (g, _)) = (host(x), host_n::<2>(w), host(grad));
        let (dx, dw) = conv::host_backward(&x, &w, &g, t, c, taps);
        (flex_tensor(dx, [b, t, c]), flex_tensor(dw, [c, taps]))
    }

    fn rms_norm(x: FloatTensor<Self>, w: Option<FloatTensor<Self>>, eps: f64) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x), w.as_ref()]) {
            return rms::reference_forward(f2::<Self>(x), w.map(f1::<Self>), eps).into_primitive().tensor();
        }
        let (x, [r, d]) = host_n::<2>(x);
        let w = w.map(|w| host_n::<1>(w).0);
        flex_tensor(rms::host_forward(&x, w.as_deref(), d, eps as f32), [r, d])
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        w: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, Option<FloatTensor<Self>>) {
        if !all_f32(&[Some(&x), w.as_ref(), Some(&grad)]) {
            let (dx, dw) = rms::reference_backward(f2::<Self>(x), w.map(f1::<Self>), f2::<Self>(grad), eps);
            return (dx.into_primitive().tensor(), dw.map(|t| t.into_primitive().tensor()));
        }
        let ((x, [r, d]), (g, _)) = (host_n::<2>(x), host_n::<2>(grad));
        let w = w.map(|w| host_n::<1>(w).0);
        let (dx, dw) = rms::host_backward(&x, w.as_deref(), &g, d, eps as f32);
        (flex_tensor(dx, [r, d]), dw.map(|dw| flex_tensor(dw, [d])))
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, limit: f64) -> FloatTensor<Self> {
        if !all_f32(&[Some(&gate), Some(&up)]) {
            return swiglu::reference_forward(f1::<Self>(gate), f1::<Self>(up), limit).into_primitive().tensor();
        }
        let ((g, [n]), (u, _)) = (host_n::<1>(gate), host_n::<1>(up));
        flex_tensor(swiglu::host_forward(&g, &u, limit as f32), [n])
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        limit: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&gate), Some(&up), Some(&grad)]) {
            let (dg, du) = swiglu::reference_backward(f1::<Self>(gate), f1::<Self>(up), f1::<Self>(grad), limit);
            return (dg.into_primitive().tensor(), du.into_primitive().tensor());
        }
        let ((g, [n]), (u, _), (gr, _)) = (host_n::<1>(gate), host_n::<1>(up), host_n::<1>(grad));
        let (dg, du) = swiglu::host_backward(&g, &u, &gr, limit as f32);
        (flex_tensor(dg, [n]), flex_tensor(du, [n]))
    }

    fn silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x)]) {
            return swiglu::reference_silu(f1::<Self>(x)).into_primitive().tensor();
        }
        let (x, [n]) = host_n::<1>(x);
        flex_tensor(swiglu::host_silu(&x), [n])
    }

    fn silu_backward(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&x), Some(&grad)]) {
            return swiglu::reference_silu_backward(f1::<Self>(x), f1::<Self>(grad)).into_primitive().tensor();
        }
        let ((x, [n]), (g, _)) = (host_n::<1>(x), host_n::<1>(grad));
        flex_tensor(swiglu::host_silu_backward(&x, &g), [n])
    }

    fn linear_layer(x: FloatTensor<Self>, w: FloatTensor<Self>, b: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        if all_dtype(&[Some(&x), Some(&w), b.as_ref()], DType::BF16) {
            let ((x, [n, k]), (w, [_, m])) = (host_bf16::<2>(x), host_bf16::<2>(w));
            let b = b.map(|b| host_bf16::<1>(b).0);
            let y = linear::host_forward_bf16(bf16_slice(&x), bf16_slice(&w), b.as_ref().map(bf16_slice), n, k, m);
            return flex_bf16(y, vec![n, m]);
        }
        if !all_f32(&[Some(&x), Some(&w), b.as_ref()]) {
            return linear::reference_forward(f2::<Self>(x), f2(w), b.map(f1)).into_primitive().tensor();
        }
        let ((x, [n, k]), (w, [_, m])) = (host_n::<2>(x), host_n::<2>(w));
        let b = b.map(|b| host_n::<1>(b).0);
        flex_tensor(linear::host_forward(&x, &w, b.as_deref(), n, k, m), [n, m])
    }

    fn linear_layer_backward(
        x: Option<FloatTensor<Self>>,
        w: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        bias: bool,
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        if all_dtype(&[x.as_ref(), w.as_ref(), Some(&grad)], DType::BF16) {
            let (g, [n, m]) = host_bf16::<2>(grad);
            let (x, w) = (x.map(host_bf16::<2>), w.map(host_bf16::<2>));
            let k = x.as_ref().map(|(_, [_, k])| *k).or(w.as_ref().map(|(_, [k, _])| *k)).unwrap_or(0);
            let (dx, dw, db) = linear::host_backward_bf16(
                x.as_ref().map(|(x, _)| bf16_slice(x)),
                w.as_ref().map(|(w, _)| bf16_slice(w)),
                bf16_slice(&g),
                (n, k, m),
                bias,
            );
            return (dx.map(|v| flex_bf16(v, vec![n, k])), dw.map(|v| flex_bf16(v, vec![k, m])), db.map(|v| flex_bf16(v, vec![m])));
        }
        if !all_f32(&[x.as_ref(), w.as_ref(), Some(&grad)]) {
            return super::linear_reference_backward::<Self>(x, w, grad, bias);
        }
        let (g, [n, m]) = host_n::<2>(grad);
        let (x, w) = (x.map(host_n::<2>), w.map(host_n::<2>));
        let k = x.as_ref().map(|(_, [_, k])| *k).or(w.as_ref().map(|(_, [k, _])| *k)).unwrap_or(0);
        let (dx, dw, db) = linear::host_backward(x.as_ref().map(|(x, _)| &x[..]), w.as_ref().map(|(w, _)| &w[..]), &g, (n, k, m), bias);
        (dx.map(|v| flex_tensor(v, [n, k])), dw.map(|v| flex_tensor(v, [k, m])), db.map(|v| flex_tensor(v, [m])))
    }

    fn fp8_linear_impl() -> OpImpl {
        OpImpl::Fused
    }

    fn fp8_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let dtype = x.dtype();
        let Some((codes, g)) = fp8_host(&codes, &scales, block).filter(|_| matches!(dtype, DType::F32 | DType::BF16)) else {
            let codes = Tensor::<Self, 2, Int>::from_primitive(codes);
            return crate::ops::fp8_linear::reference_forward(f2::<Self>(x), codes, f2(scales), block, b.map(f1)).into_primitive().tensor();
        };
        // BF16 inputs widened once, the products summed in f32 and rounded once
        let ((x, [n, _]), (s, _)) = (host_n::<2>(x), host_n::<2>(scales));
        let b = b.map(|b| host_n::<1>(b).0);
        let y = crate::ops::fp8_linear::host_forward(&x, codes.as_slice::<u8>().expect("contiguous U8 codes"), &s, g, n, b.as_deref());
        in_dtype(flex_tensor(y, [n, g.rows]), dtype)
    }

    fn fp8_linear_backward(grad: FloatTensor<Self>, codes: IntTensor<Self>, scales: FloatTensor<Self>, block: [usize; 2]) -> FloatTensor<Self> {
        let dtype = grad.dtype();
        let Some((codes, g)) = fp8_host(&codes, &scales, block).filter(|_| matches!(dtype, DType::F32 | DType::BF16)) else {
            let codes = Tensor::<Self, 2, Int>::from_primitive(codes);
            return crate::ops::fp8_linear::reference_backward(f2::<Self>(grad), codes, f2(scales), block).into_primitive().tensor();
        };
        let ((grad, [n, _]), (s, _)) = (host_n::<2>(grad), host_n::<2>(scales));
        let dx = crate::ops::fp8_linear::host_backward(&grad, codes.as_slice::<u8>().expect("contiguous U8 codes"), &s, g, n);
        in_dtype(flex_tensor(dx, [n, g.cols]), dtype)
    }

    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
    ) -> FloatTensor<Self> {
        let dtype = x.dtype();
        let Some((codes, g)) = fp8_stack_host(&codes, &scales, block).filter(|_| matches!(dtype, DType::F32 | DType::BF16)) else {
            let codes = Tensor::<Self, 3, Int>::from_primitive(codes);
            return crate::ops::fp8_linear::grouped_reference_forward(f2::<Self>(x), codes, f3(scales), block, sizes).into_primitive().tensor();
        };
        let ((x, [m, _]), (s, _)) = (host_n::<2>(x), host_n::<3>(scales));
        let y = crate::ops::fp8_linear::host_grouped_forward(&x, codes.as_slice::<u8>().expect("contiguous U8 codes"), &s, g, sizes);
        in_dtype(flex_tensor(y, [m, g.rows]), dtype)
    }

    fn fp8_grouped_matmul_backward(
        grad: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
    ) -> FloatTensor<Self> {
        let dtype = grad.dtype();
        let Some((codes, g)) = fp8_stack_host(&codes, &scales, block).filter(|_| matches!(dtype, DType::F32 | DType::BF16)) else {
            let codes = Tensor::<Self, 3, Int>::from_primitive(codes);
            return crate::ops::fp8_linear::grouped_reference_backward(f2::<Self>(grad), codes, f3(scales), block, sizes).into_primitive().tensor();
        };
        let ((grad, [m, _]), (s, _)) = (host_n::<2>(grad), host_n::<3>(scales));
        let dx = crate::ops::fp8_linear::host_grouped_backward(&grad, codes.as_slice::<u8>().expect("contiguous U8 codes"), &s, g, sizes);
        in_dtype(flex_tensor(dx, [m, g.cols]), dtype)
    }

    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, sizes: &[usize]) -> FloatTensor<Self> {
        if all_dtype(&[Some(&x), Some(&w)], DType::BF16) {
            let ((x, [m, k]), (w, [_, _, n])) = (host_bf16::<2>(x), host_bf16::<3>(w));
            return flex_bf16(grouped_matmul::host_forward_bf16(bf16_slice(&x), bf16_slice(&w), sizes, k, n), vec![m, n]);
        }
        if !all_f32(&[Some(&x), Some(&w)]) {
            return grouped_matmul::reference_forward(f2::<Self>(x), f3(w), sizes).into_primitive().tensor();
        }
        let ((x, [m, k]), (w, [_, _, n])) = (host_n::<2>(x), host_n::<3>(w));
        flex_tensor(grouped_matmul::host_forward(&x, &w, sizes, k, n), [m, n])
    }

    fn grouped_matmul_backward(
        x: Option<FloatTensor<Self>>,
        w: Option<FloatTensor<Self>>,
        grad: FloatTensor<Self>,
        sizes: &[usize],
    ) -> (Option<FloatTensor<Self>>, Option<FloatTensor<Self>>) {
        use burn::tensor::TensorMetadata;
        let k = x.as_ref().map(|x| x.shape()[1]).or(w.as_ref().map(|w| w.shape()[1])).unwrap_or(0);
        let g = sizes.len();
        if all_dtype(&[x.as_ref(), w.as_ref(), Some(&grad)], DType::BF16) {
            let (gr, [m, n]) = host_bf16::<2>(grad);
            let (x, w) = (x.map(|x| host_bf16::<2>(x).0), w.map(|w| host_bf16::<3>(w).0));
            let (dx, dw) = grouped_matmul::host_backward_bf16(x.as_ref().map(bf16_slice), w.as_ref().map(bf16_slice), bf16_slice(&gr), sizes, (k, n));
            return (dx.map(|v| flex_bf16(v, vec![m, k])), dw.map(|v| flex_bf16(v, vec![g, k, n])));
        }
        if !all_f32(&[x.as_ref(), w.as_ref(), Some(&grad)]) {
            let (dx, dw) = grouped_matmul::reference_backward(x.map(f2::<Self>), w.map(f3::<Self>), f2::<Self>(grad), sizes);
            return (dx.map(|t| t.into_primitive().tensor()), dw.map(|t| t.into_primitive().tensor()));
        }
        let (gr, [m, n]) = host_n::<2>(grad);
        let (x, w) = (x.map(|x| host_n::<2>(x).0), w.map(|w| host_n::<3>(w).0));
        let (dx, dw) = grouped_matmul::host_backward(x.as_deref(), w.as_deref(), &gr, sizes, (k, n));
        (dx.map(|v| flex_tensor(v, [m, k])), dw.map(|v| flex_tensor(v, [g, k, n])))
    }

    fn cross_entropy_sum(logits: FloatTensor<Self>, targets: &[i64]) -> FloatTensor<Self> {
        if !all_f32(&[Some(&logits)]) {
            return cross_entropy::reference_forward(f2::<Self>(logits), targets).into_primitive().tensor();
        }
        let (x, [n, v]) = host_n::<2>(logits);
        assert_eq!(targets.len(), n, "cross_entropy_sum: {} targets for {n} rows of logits", targets.len());
        flex_tensor(vec![cross_entropy::host_forward(&x, targets, v)], [1])
    }

    fn cross_entropy_sum_backward(logits: FloatTensor<Self>, targets: &[i64], grad: FloatTensor<Self>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&logits), Some(&grad)]) {
            return cross_entropy::reference_backward(f2::<Self>(logits), targets, f1(grad)).into_primitive().tensor();
        }
        let ((x, [n, v]), (g, _)) = (host_n::<2>(logits), host_n::<1>(grad));
        assert_eq!(targets.len(), n, "cross_entropy_sum_backward: {} targets for {n} rows of logits", targets.len());
        flex_tensor(cross_entropy::host_backward(&x, targets, v, g[0]), [n, v])
    }

    fn adamw_step(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&p), Some(&g), Some(&m), Some(&v)]) {
            let (p, m, v) = adamw::reference(f1::<Self>(p), f1::<Self>(g), f1::<Self>(m), f1::<Self>(v), s);
            return (p.into_primitive().tensor(), m.into_primitive().tensor(), v.into_primitive().tensor());
        }
        let (mut p, (g, _), mut m, mut v) = (owned_flat(p), host_n::<1>(g), owned_flat(m), owned_flat(v));
        adamw::host(p.storage_mut::<f32>(), &g, m.storage_mut::<f32>(), v.storage_mut::<f32>(), s);
        (p, m, v)
    }

    fn hc_collapse(x: FloatTensor<Self>, pre: FloatTensor<Self>) -> FloatTensor<Self> {
        if !widenable(&[Some(&x), Some(&pre)]) {
            return hc_streams::reference_collapse(f3::<Self>(x), f2::<Self>(pre)).into_primitive().tensor();
        }
        let dtype = x.dtype();
        if dtype == DType::BF16 {
            let ((x, [t, n, d]), (pre, _)) = (host_bf16::<3>(x), host_n::<2>(pre));
            return flex_bf16(hc_streams::host_collapse_bf16(bf16_slice(&x), &pre, n, d), vec![t, d]);
        }
        let ((x, [t, n, d]), (pre, _)) = (host(x), host_n::<2>(pre));
        in_dtype(flex_tensor(hc_streams::host_collapse(&x, &pre, n, d), [t, d]), dtype)
    }

    fn hc_collapse_backward(x: FloatTensor<Self>, pre: FloatTensor<Self>, grad: FloatTensor<Self>) -> (FloatTensor<Self>, FloatTensor<Self>) {
        if !widenable(&[Some(&x), Some(&pre), Some(&grad)]) {
            let (dx, dp) = hc_streams::reference_collapse_backward(f3::<Self>(x), f2::<Self>(pre), f2::<Self>(grad));
            return (dx.into_primitive().tensor(), dp.into_primitive().tensor());
        }
        let (xt, pt) = (x.dtype(), pre.dtype());
        let ((x, [t, n, d]), (pre, _), (g, _)) = (host(x), host_n::<2>(pre), host_n::<2>(grad));
        let (dx, dp) = hc_streams::host_collapse_backward(&x, &pre, &g, n, d);
        (in_dtype(flex_tensor(dx, [t, n, d]), xt), in_dtype(flex_tensor(dp, [t, n]), pt))
    }

    fn hc_post(post: FloatTensor<Self>, comb: FloatTensor<Self>, y: FloatTensor<Self>, res: FloatTensor<Self>) -> FloatTensor<Self> {
        if !widenable(&[Some(&post), Some(&comb), Some(&y), Some(&res)]) {
            return hc_streams::reference_post(f2::<Self>(post), f3::<Self>(comb), f2::<Self>(y), f3::<Self>(res)).into_primitive().tensor();
        }
        let dtype = res.dtype();
        if dtype == DType::BF16 && y.dtype() == DType::BF16 {
            let ((post, _), (comb, _), (y, _), (res, [t, n, d])) = (host_n::<2>(post), host(comb), host_bf16::<2>(y), host_bf16::<3>(res));
            return flex_bf16(hc_streams::host_post_bf16(&post, &comb, bf16_slice(&y), bf16_slice(&res), n, d), vec![t, n, d]);
        }
        let ((post, _), (comb, _), (y, _), (res, [t, n, d])) = (host_n::<2>(post), host(comb), host_n::<2>(y), host(res));
        in_dtype(flex_tensor(hc_streams::host_post(&post, &comb, &y, &res, n, d), [t, n, d]), dtype)
    }

    fn hc_post_backward(
        post: FloatTensor<Self>,
        comb: FloatTensor<Self>,
        y: FloatTensor<Self>,
        res: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !widenable(&[Some(&post), Some(&comb), Some(&y), Some(&res), Some(&grad)]) {
            let (a, b, c, d) =
                hc_streams::reference_post_backward(f2::<Self>(post), f3::<Self>(comb), f2::<Self>(y), f3::<Self>(res), f3::<Self>(grad));
            return (a.into_primitive().tensor(), b.into_primitive().tensor(), c.into_primitive().tensor(), d.into_primitive().tensor());
        }
        let dtypes = [post.dtype(), comb.dtype(), y.dtype(), res.dtype()];
        let ((post, _), (comb, _), (y, _), (res, [t, n, d]), (g, _)) = (host_n::<2>(post), host(comb), host_n::<2>(y), host(res), host(grad));
        let [dp, dc, dy, dx] = hc_streams::host_post_backward(&post, &comb, &y, &res, &g, n, d);
        (
            in_dtype(flex_tensor(dp, [t, n]), dtypes[0]),
            in_dtype(flex_tensor(dc, [t, n, n]), dtypes[1]),
            in_dtype(flex_tensor(dy, [t, d]), dtypes[2]),
            in_dtype(flex_tensor(dx, [t, n, d]), dtypes[3]),
        )
    }

    fn hc_sinkhorn(z: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        let (z, [x, n, _]) = host(z);
        flex_tensor(sinkhorn::host_forward(&z, n, iters, eps as f32), [x, n, n])
    }

    fn hc_sinkhorn_backward(z: FloatTensor<Self>, grad: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        let ((z, [x, n, _]), (g, _)) = (host(z), host(grad));
        flex_tensor(sinkhorn::host_backward(&z, &g, n, iters, eps as f32), [x, n, n])
    }

    fn kda_forget_gate(f: FloatTensor<Self>, dt_bias: FloatTensor<Self>, a_log: FloatTensor<Self>, bound: Option<f64>) -> FloatTensor<Self> {
        if !all_f32(&[Some(&f), Some(&dt_bias), Some(&a_log)]) {
            return kda_gate::reference_forward(f2::<Self>(f), f1(dt_bias), f1(a_log), bound).into_primitive().tensor();
        }
        let ((f, [n, c]), (b, _), (a, _)) = (host_n::<2>(f), host_n::<1>(dt_bias), host_n::<1>(a_log));
        flex_tensor(kda_gate::host_forward(&f, &b, &a, bound.map(|l| l as f32)), [n, c])
    }

    fn kda_forget_gate_backward(
        f: FloatTensor<Self>,
        dt_bias: FloatTensor<Self>,
        a_log: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        bound: Option<f64>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        if !all_f32(&[Some(&f), Some(&dt_bias), Some(&a_log), Some(&grad)]) {
            let (df, db, da) = kda_gate::reference_backward(f2::<Self>(f), f1(dt_bias), f1(a_log), f2(grad), bound);
            return (df.into_primitive().tensor(), db.into_primitive().tensor(), da.into_primitive().tensor());
        }
        let ((f, [n, c]), (b, _), (a, [h]), (g, _)) = (host_n::<2>(f), host_n::<1>(dt_bias), host_n::<1>(a_log), host_n::<2>(grad));
        let (df, db, da) = kda_gate::host_backward(&f, &b, &a, &g, bound.map(|l| l as f32));
        (flex_tensor(df, [n, c]), flex_tensor(db, [c]), flex_tensor(da, [h]))
    }

    fn sparse_attention_impl() -> OpImpl {
        OpImpl::Fused
    }

    fn sparse_latent_attention(
        q: FloatTensor<Self>,
        kv: FloatTensor<Self>,
        idx: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        // BF16/F16 inputs are widened and the f32 body runs; the output is rounded once to
        // the input dtype and the log-sum-exp stays f32, as the reference's does. The
        // reference's BF16 attention rounds its scores and products to BF16 (only its softmax
        // runs in f32), so the f32 body is closer to the f32 truth; and its BF16 products
        // widened whole operands per gathered key block (14 % of a 128-token BF16 forward on
        // the real-width cut, `perf`).
        let dtype = q.dtype();
        let ((q, [n, h, r]), (kv, _), idx) = (host(q), host_n::<2>(kv), host_i64(idx));
        let (o, lse) = sparse_attn::host_forward(&q, &kv, &idx, sparse_attn::Heads { h, r, scale });
        (in_dtype(flex_tensor(o, [n, h, r]), dtype), flex_tensor(lse, [n, h]))
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
        if !all_f32(&[Some(&q), Some(&kv), Some(&o), Some(&d_o)]) {
            let (dq, dkv) =
                sparse_attn::latent_reference_backward::<Self>(f3(q), f2(kv), Tensor::from_primitive(idx), f3(o), f2(lse), f3(d_o), scale);
            return (dq.into_primitive().tensor(), dkv.into_primitive().tensor());
        }
        let ((q, [n, h, r]), (kv, [m, _]), idx) = (host(q), host_n::<2>(kv), host_i64(idx));
        let ((o, _), (lse, _), (d_o, _)) = (host(o), host_n::<2>(lse), host(d_o));
        let (dq, dkv) = sparse_attn::host_backward(&q, &kv, &idx, &o, &lse, &d_o, sparse_attn::Heads { h, r, scale });
        (flex_tensor(dq, [n, h, r]), flex_tensor(dkv, [m, r]))
    }

    /// The token recurrence as fused host loops (`ops::kda_host`).
    fn kda_chunk_scan(x: ScanInputs<FloatTensor<Self>>, _chunk: usize, resets: &[usize]) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (q, k, v, g) = (host_n::<4>(x.q), host_n::<4>(x.k), host_n::<4>(x.v), host_n::<4>(x.g));
        let (beta, h0) = (host(x.beta), host_n::<4>(x.h0));
        let [b, t, h, dk] = q.1;
        let d = kda_host::Dims { b, t, h, dk, dv: v.1[3] };
        let x = kda_host::Inputs { q: &q.0, k: &k.0, v: &v.0, g: &g.0, beta: &beta.0, h0: &h0.0 };
        let (o, s) = kda_host::forward(&x, d, resets);
        (flex_tensor(o, [b, t, h, d.dv]), flex_tensor(s, [b, h, dk, d.dv]))
    }

    fn kda_chunk_scan_backward(
        x: ScanInputs<FloatTensor<Self>>,
        d_o: FloatTensor<Self>,
        d_final: FloatTensor<Self>,
        chunk: usize,
        resets: &[usize],
    ) -> ScanInputs<FloatTensor<Self>> {
        let (q, k, v, g) = (host_n::<4>(x.q), host_n::<4>(x.k), host_n::<4>(x.v), host_n::<4>(x.g));
        let (beta, h0, d_o, d_final) = (host(x.beta), host_n::<4>(x.h0), host_n::<4>(d_o), host_n::<4>(d_final));
        let [b, t, h, dk] = q.1;
        let d = kda_host::Dims { b, t, h, dk, dv: v.1[3] };
        let x = kda_host::Inputs { q: &q.0, k: &k.0, v: &v.0, g: &g.0, beta: &beta.0, h0: &h0.0 };
        let [dq, dk_, dv, dg, db, dh] = kda_host::backward(&x, d, &d_o.0, &d_final.0, chunk, resets);
        let key = |x| flex_tensor(x, [b, t, h, dk]);
        ScanInputs {
            q: key(dq),
            k: key(dk_),
            v: flex_tensor(dv, [b, t, h, d.dv]),
            g: key(dg),
            beta: flex_tensor(db, [b, t, h]),
            h0: flex_tensor(dh, [b, h, dk, d.dv]),
        }
    }

    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        let ((k, [x, c, d]), (q, _), (g, _)) = (host(k), host(q), host(gam));
        flex_tensor(kda_pairs::host_forward(&k, &q, &g, x, c, d), [x, c, 2 * c])
    }

    fn kda_pair_sums_backward(
        k: FloatTensor<Self>,
        q: FloatTensor<Self>,
        gam: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let ((k, [x, c, d]), (q, _), (g, _), (gr, _)) = (host(k), host(q), host(gam), host(grad));
        let (dk, dq, dg) = kda_pairs::host_backward(&k, &q, &g, &gr, x, c, d);
        (flex_tensor(dk, [x, c, d]), flex_tensor(dq, [x, c, d]), flex_tensor(dg, [x, c, d]))
    }
}
