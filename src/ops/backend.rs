//! Backend extension ops: [`Glm5Backend`] holds the model's hot spots as backend methods whose
//! default bodies are the reference tensor-op paths; a backend may override them with a fused
//! implementation (Flex: host loops, see below), and `Autodiff<B>` gives each a hand-written
//! backward that calls `B`'s backward method — the custom-op pattern of Burn 0.21.
//!
//! Every backend the library runs on implements the trait; one with no fused code just writes
//! `impl Glm5Backend for MyBackend {}`.
//!
//! ## KDA pair sums
//!
//! For one batch of chunks, `k`, `q`, `Γ` `[x, C, d]` (fp32, `Γ` the in-chunk cumulative log
//! decay) → `[x, C, 2C]`:
//!
//! ```text
//! out[:, r, s]     = Σ_d k_rd k_sd e^{min(Γ_rd − Γ_sd, 0)}    (s ≤ r, else 0)
//! out[:, r, C + s] = Σ_d q_rd k_sd e^{min(Γ_rd − Γ_sd, 0)}    (s ≤ r, else 0)
//! ```
//!
//! (the `L` and `P` terms of the chunked KDA form before masking and β). Its backward, for an
//! upstream gradient split into `G` (first half) and `H` (second half), with `E_rsd` as above
//! and `u_rsd = G_rs k_rd + H_rs q_rd`:
//!
//! ```text
//! ∂k_r += Σ_{s≤r} G_rs k_s E_rs,   ∂k_s += Σ_{r≥s} u_rs E_rs,   ∂q_r += Σ_{s≤r} H_rs k_s E_rs,
//! ∂Γ_r += Σ_{s≤r} u_rs k_s E_rs [Γ_r ≤ Γ_s],   ∂Γ_s −= the same terms
//! ```

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData, TensorPrimitive};
use rayon::prelude::*;

/// The library's backend requirements: Burn's `Backend` plus the model's custom ops.
pub trait Glm5Backend: Backend {
    /// KDA pair sums (module docs). Default: the reference gather path.
    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        let f = |t| Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(t));
        reference::kda_pair_sums(f(k), f(q), f(gam)).into_primitive().tensor()
    }

    /// Backward of [`Self::kda_pair_sums`]: `(∂k, ∂q, ∂Γ)`. Default: reference tensor ops.
    fn kda_pair_sums_backward(
        k: FloatTensor<Self>,
        q: FloatTensor<Self>,
        gam: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let f = |t| Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(t));
        let (dk, dq, dg) = reference::kda_pair_sums_backward(f(k), f(q), f(gam), f(grad));
        (dk.into_primitive().tensor(), dq.into_primitive().tensor(), dg.into_primitive().tensor())
    }
}

/// `kda_pair_sums` on tensors.
pub fn kda_pair_sums<B: Glm5Backend>(k: Tensor<B, 3>, q: Tensor<B, 3>, gam: Tensor<B, 3>) -> Tensor<B, 3> {
    let p = |t: Tensor<B, 3>| t.into_primitive().tensor();
    Tensor::from_primitive(TensorPrimitive::Float(B::kda_pair_sums(p(k), p(q), p(gam))))
}

/// The reference (pure tensor-op) forms: the specification the fused ones are tested against.
pub mod reference {
    use super::*;

    /// Row indices of the causal pairs `(x, r, s ≤ r)`: rows of `r`, rows of `s`, and the
    /// flat position `(x, r, s)` in `[x, C, C]`.
    pub fn pair_rows<B: Backend>(x: usize, c: usize, device: &B::Device) -> [Tensor<B, 1, Int>; 3] {
        let per = c * (c + 1) / 2;
        let (mut r_rows, mut s_rows, mut at_rs) = (Vec::with_capacity(x * per), Vec::with_capacity(x * per), Vec::with_capacity(x * per));
        for xi in 0..x {
            for r in 0..c {
                for s in 0..=r {
                    r_rows.push((xi * c + r) as i64);
                    s_rows.push((xi * c + s) as i64);
                    at_rs.push(((xi * c + r) * c + s) as i64);
                }
            }
        }
        [r_rows, s_rows, at_rs].map(|v| Tensor::<B, 1, Int>::from_data(TensorData::new(v.clone(), [v.len()]), device))
    }

    /// The causal pairs gathered into contiguous `[(x, r, s), d]` rows (Flex's broadcasting
    /// binary ops are far slower than equal-shape ones), summed over `d`, then placed.
    pub fn kda_pair_sums<B: Backend>(k: Tensor<B, 3>, q: Tensor<B, 3>, gam: Tensor<B, 3>) -> Tensor<B, 3> {
        let [x, c, d] = k.dims();
        let device = k.device();
        let per = c * (c + 1) / 2;
        let [r_rows, s_rows, at_rs] = pair_rows::<B>(x, c, &device);
        let at = |a: &Tensor<B, 3>, rows: &Tensor<B, 1, Int>| a.clone().reshape([x * c, d]).select(0, rows.clone());
        // e^{Γ_r − Γ_s} (≤ 0 exponents: Γ is non-increasing; the clamp guards rounding)
        let decay = (at(&gam, &r_rows) - at(&gam, &s_rows)).clamp_max(0.0).exp();
        let k_s = at(&k, &s_rows);
        let pair = |a: Tensor<B, 2>| {
            let sums = (a * k_s.clone() * decay.clone()).sum_dim(1).reshape([x * per]);
            Tensor::<B, 1>::zeros([x * c * c], (&device, DType::F32))
                .select_assign(0, at_rs.clone(), sums, IndexingUpdateOp::Add)
                .reshape([x, c, c])
        };
        Tensor::cat(vec![pair(at(&k, &r_rows)), pair(at(&q, &r_rows))], 2)
    }

    /// Backward of [`kda_pair_sums`] (module docs), in the same gathered layout.
    pub fn kda_pair_sums_backward<B: Backend>(
        k: Tensor<B, 3>,
        q: Tensor<B, 3>,
        gam: Tensor<B, 3>,
        grad: Tensor<B, 3>,
    ) -> (Tensor<B, 3>, Tensor<B, 3>, Tensor<B, 3>) {
        let [x, c, d] = k.dims();
        let device = k.device();
        let per = c * (c + 1) / 2;
        let [r_rows, s_rows, at_rs] = pair_rows::<B>(x, c, &device);
        let at = |a: &Tensor<B, 3>, rows: &Tensor<B, 1, Int>| a.clone().reshape([x * c, d]).select(0, rows.clone());
        let half = |lo: usize| {
            grad.clone().slice([0..x, 0..c, lo..lo + c]).reshape([x * c * c]).select(0, at_rs.clone()).reshape([x * per, 1])
        };
        let (g, h) = (half(0), half(c));
        let diff = at(&gam, &r_rows) - at(&gam, &s_rows);
        let live = diff.clone().lower_equal_elem(0.0).float();
        let e = diff.clamp_max(0.0).exp();
        let (k_r, k_s, q_r) = (at(&k, &r_rows), at(&k, &s_rows), at(&q, &r_rows));
        let u = g.clone() * k_r + h.clone() * q_r;
        let zeros = || Tensor::<B, 2>::zeros([x * c, d], (&device, DType::F32));
        let add = |t: Tensor<B, 2>, rows: &Tensor<B, 1, Int>, v: Tensor<B, 2>| t.select_assign(0, rows.clone(), v, IndexingUpdateOp::Add);
        let ks_e = k_s * e.clone();
        let dk = add(add(zeros(), &r_rows, g * ks_e.clone()), &s_rows, u.clone() * e);
        let dq = add(zeros(), &r_rows, h * ks_e.clone());
        let t = u * ks_e * live;
        let dg = add(add(zeros(), &r_rows, t.clone()), &s_rows, t.neg());
        (dk.reshape([x, c, d]), dq.reshape([x, c, d]), dg.reshape([x, c, d]))
    }
}

fn host(t: FloatTensor<Flex>) -> (Vec<f32>, [usize; 3]) {
    let t = Tensor::<Flex, 3>::from_primitive(TensorPrimitive::Float(t));
    let dims = t.dims();
    (t.into_data().convert::<f32>().into_vec::<f32>().expect("f32 data"), dims)
}

fn device_tensor(v: Vec<f32>, dims: [usize; 3]) -> FloatTensor<Flex> {
    Tensor::<Flex, 3>::from_data(TensorData::new(v, dims), &Default::default()).into_primitive().tensor()
}

/// Flex: the pair sums as host loops over each chunk, in parallel over chunks — no `[pairs, d]`
/// intermediates, one `exp` per pair and channel shared by both halves.
impl Glm5Backend for Flex {
    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        let ((k, [x, c, d]), (q, _), (g, _)) = (host(k), host(q), host(gam));
        let mut out = vec![0f32; x * c * 2 * c];
        out.par_chunks_mut(c * 2 * c).enumerate().for_each(|(xi, o)| {
            let base = xi * c * d;
            for r in 0..c {
                let (kr, qr, gr) = (&k[base + r * d..][..d], &q[base + r * d..][..d], &g[base + r * d..][..d]);
                for s in 0..=r {
                    let (ks, gs) = (&k[base + s * d..][..d], &g[base + s * d..][..d]);
                    let (mut lk, mut lq) = (0f32, 0f32);
                    for j in 0..d {
                        let e = (gr[j] - gs[j]).min(0.0).exp();
                        lk += kr[j] * ks[j] * e;
                        lq += qr[j] * ks[j] * e;
                    }
                    o[r * 2 * c + s] = lk;
                    o[r * 2 * c + c + s] = lq;
                }
            }
        });
        device_tensor(out, [x, c, 2 * c])
    }

    fn kda_pair_sums_backward(
        k: FloatTensor<Self>,
        q: FloatTensor<Self>,
        gam: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let ((k, [x, c, d]), (q, _), (g, _), (gr_all, _)) = (host(k), host(q), host(gam), host(grad));
        let mut dk = vec![0f32; x * c * d];
        let mut dq = vec![0f32; x * c * d];
        let mut dg = vec![0f32; x * c * d];
        dk.par_chunks_mut(c * d).zip(dq.par_chunks_mut(c * d)).zip(dg.par_chunks_mut(c * d)).enumerate().for_each(
            |(xi, ((dk, dq), dg))| {
                let base = xi * c * d;
                let gb = &gr_all[xi * c * 2 * c..][..c * 2 * c];
                for r in 0..c {
                    for s in 0..=r {
                        let (gl, hp) = (gb[r * 2 * c + s], gb[r * 2 * c + c + s]);
                        if gl == 0.0 && hp == 0.0 {
                            continue;
                        }
                        for j in 0..d {
                            let (kr, ks, qr) = (k[base + r * d + j], k[base + s * d + j], q[base + r * d + j]);
                            let diff = g[base + r * d + j] - g[base + s * d + j];
                            let e = diff.min(0.0).exp();
                            let u = gl * kr + hp * qr;
                            dk[r * d + j] += gl * ks * e;
                            dk[s * d + j] += u * e;
                            dq[r * d + j] += hp * ks * e;
                            if diff <= 0.0 {
                                let t = u * ks * e;
                                dg[r * d + j] += t;
                                dg[s * d + j] -= t;
                            }
                        }
                    }
                }
            },
        );
        (device_tensor(dk, [x, c, d]), device_tensor(dq, [x, c, d]), device_tensor(dg, [x, c, d]))
    }
}

#[cfg(feature = "tch")]
impl Glm5Backend for burn::backend::LibTorch {}
#[cfg(feature = "cuda")]
impl Glm5Backend for burn::backend::Cuda {}
#[cfg(feature = "vulkan")]
impl Glm5Backend for burn::backend::Vulkan {}

#[derive(Debug)]
struct KdaPairSumsBackward;

impl<B: Glm5Backend> Backward<B, 3> for KdaPairSumsBackward {
    type State = (NodeId, NodeId, NodeId);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let [node_k, node_q, node_g] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (k, q, g) = ops.state;
        let mut get = |id| checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(id);
        let (k, q, g) = (get(k), get(q), get(g));
        let (dk, dq, dg) = B::kda_pair_sums_backward(k, q, g, grad);
        for (node, grad) in [(node_k, dk), (node_q, dq), (node_g, dg)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Glm5Backend, C: CheckpointStrategy> Glm5Backend for Autodiff<B, C> {
    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        match KdaPairSumsBackward.prepare::<C>([k.node.clone(), q.node.clone(), gam.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&k), prep.checkpoint(&q), prep.checkpoint(&gam));
                prep.finish(state, B::kda_pair_sums(k.primitive, q.primitive, gam.primitive))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kda_pair_sums(k.primitive, q.primitive, gam.primitive)),
        }
    }
}
