//! `Autodiff<B>`: every op forwards to `B`'s and registers a hand-written backward that calls
//! `B`'s backward method (Burn 0.21's custom-op pattern; `burn-autodiff`'s own ops have the
//! same shape). Ops without a gradient (`kpool_*`, `adamw_step`) run on the inner primitives.

use std::sync::Arc;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use burn::tensor::Tensor;

use super::autodiff_collective as coll;
use super::prim::*;
use super::Glm5Backend;
use crate::comm::{DistError, Group, ParamGather};
use crate::ops::adamw::AdamWScalars;
use crate::ops::backend::ScanInputs;
use crate::ops::kpool::KpoolSelect;
use crate::ops::OpImpl;

/// Adds each computed gradient to its parent's, skipping parents that are not tracked (the
/// bookkeeping every backward below shares).
macro_rules! register {
    ($grads:expr, $parents:expr, [$($g:expr),+ $(,)?]) => {
        for (node, grad) in $parents.into_iter().zip([$($g),+]) {
            if let Some(node) = node {
                $grads.register::<B>(node.id, grad);
            }
        }
    };
}

/// Puts the inner backend's result `$out` on the graph: with the backward `$op` holding
/// `$state` when any of the inputs `[$x, …]` is tracked, as a leaf otherwise (`$state` is only
/// built in the tracked case).
macro_rules! record {
    ($op:expr, [$($x:expr),+ $(,)?], $state:expr, $out:expr) => {{
        let out = $out;
        match $op.prepare::<C>([$($x.node.clone()),+]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish($state, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }};
}

/// RMS norm without a weight; holds `x` (the backward recomputes `r` and `y`).
#[derive(Debug)]
struct RmsNormBackward;

impl<B: Glm5Backend> Backward<B, 1> for RmsNormBackward {
    type State = (FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, eps) = ops.state;
        register!(grads, ops.parents, [B::rms_norm_backward(x, None, grad, eps).0]);
    }
}

/// RMS norm with a weight; holds `x` and `w`.
#[derive(Debug)]
struct RmsNormWeightedBackward;

impl<B: Glm5Backend> Backward<B, 2> for RmsNormWeightedBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, w, eps) = ops.state;
        let (dx, dw) = B::rms_norm_backward(x, Some(w), grad, eps);
        let [node_x, node_w] = ops.parents;
        register!(grads, [node_x], [dx]);
        if let Some(dw) = dw {
            register!(grads, [node_w], [dw]);
        }
    }
}

/// Clamped SiLU-gated product; holds `gate` and `up` (the backward recomputes the sigmoid).
#[derive(Debug)]
struct SwigluBackward;

impl<B: Glm5Backend> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up, limit) = ops.state;
        let (dg, du) = B::swiglu_backward(gate, up, grad, limit);
        register!(grads, ops.parents, [dg, du]);
    }
}

/// KDA's forget gate; holds `f`, `dt_bias`, `a_log` (the backward recomputes the rest).
#[derive(Debug)]
struct KdaGateBackward;

impl<B: Glm5Backend> Backward<B, 3> for KdaGateBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>, Option<f64>);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (f, dt_bias, a_log, bound) = ops.state;
        let (df, db, da) = B::kda_forget_gate_backward(f, dt_bias, a_log, grad, bound);
        register!(grads, ops.parents, [df, db, da]);
    }
}

/// A linear layer. Like Burn's own `linear`, it checkpoints `x` only when `W` is tracked and
/// `W` only when `x` is (what the wanted gradients need: a frozen layer keeps no activation
/// alive) and takes them back through the checkpointer in the backward, so a parameter that
/// a checkpointing strategy or the sharded model recomputes (FSDP re-gathers a sharded
/// weight for the backward) is recomputed rather than kept from the forward. `N = 3` with a
/// bias.
#[derive(Debug)]
struct LinearBackward;

impl<B: Glm5Backend, const N: usize> Backward<B, N> for LinearBackward {
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let x = x.map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let w = w.map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let bias = N == 3 && ops.parents[2].is_some();
        let (dx, dw, db) = B::linear_layer_backward(x, w, grad, bias);
        for (node, g) in ops.parents.into_iter().zip([dx, dw, db]) {
            if let (Some(node), Some(g)) = (node, g) {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// The FP8 weight an FP8 linear's backward multiplies by: kept from the forward (the base,
/// held anyway), or asked for again (an FSDP-sharded base freed after its unit's forward and
/// re-gathered for the backward, [`Glm5Backend::fp8_linear_refetched`]).
#[derive(Clone)]
enum Fp8Held<B: Backend> {
    Kept(IntTensor<B>, FloatTensor<B>),
    Refetch(super::Fp8Refetch<B>),
}

impl<B: Backend> std::fmt::Debug for Fp8Held<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Kept(..) => "Fp8Held::Kept",
            Self::Refetch(_) => "Fp8Held::Refetch",
        })
    }
}

impl<B: Backend> Fp8Held<B> {
    fn take(self) -> (IntTensor<B>, FloatTensor<B>) {
        match self {
            Self::Kept(codes, scales) => (codes, scales),
            Self::Refetch(refetch) => refetch().unwrap_or_else(|| {
                panic!(
                    "FSDP: a resharded FP8 weight was needed in backward before it was re-gathered — a unit's FP8 base was \
                     used outside the unit, or a resharded unit was not followed by an anchored gather (distributed::fsdp)"
                )
            }),
        }
    }
}

/// A linear layer on a frozen FP8 weight: holds the codes and scales (or where to get them
/// again) and gives `∂x` and, with a bias (`N = 2`), `∂b`.
#[derive(Debug)]
struct Fp8LinearBackward;

impl<B: Glm5Backend, const N: usize> Backward<B, N> for Fp8LinearBackward {
    type State = (Fp8Held<B>, [usize; 2]);

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (held, block) = ops.state;
        let (codes, scales) = held.take();
        let mut parents = ops.parents.into_iter();
        let (x, b) = (parents.next().flatten(), parents.next().flatten());
        if let Some(b) = b {
            let g = f2::<B>(grad.clone());
            let m = g.dims()[1];
            grads.register::<B>(b.id, g.sum_dim(0).reshape([m]).into_primitive().tensor());
        }
        if let Some(x) = x {
            grads.register::<B>(x.id, B::fp8_linear_backward(grad, codes, scales, block));
        }
    }
}

/// [`Glm5Backend::fp8_linear`] on `B`, put on the graph with the weight held as `state` says.
fn fp8_linear_tracked<B: Glm5Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    codes: IntTensor<B>,
    scales: FloatTensor<Autodiff<B, C>>,
    b: Option<FloatTensor<Autodiff<B, C>>>,
    state: (Fp8Held<B>, [usize; 2]),
) -> FloatTensor<Autodiff<B, C>> {
    let out = B::fp8_linear(x.primitive.clone(), codes, scales.primitive, state.1, b.as_ref().map(|b| b.primitive.clone()));
    macro_rules! finish {
        ($prep:expr) => {
            match $prep.compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish(state, out),
                OpsKind::UnTracked(prep) => prep.finish(out),
            }
        };
    }
    match b {
        None => finish!(Fp8LinearBackward.prepare::<C>([x.node.clone()])),
        Some(b) => finish!(Fp8LinearBackward.prepare::<C>([x.node.clone(), b.node.clone()])),
    }
}

/// The routed experts' products on frozen FP8 weights: holds the codes and scales (or where to
/// get them again) and the group sizes, and gives `∂x`.
#[derive(Debug)]
struct Fp8GroupedBackward;

impl<B: Glm5Backend> Backward<B, 1> for Fp8GroupedBackward {
    type State = (Fp8Held<B>, [usize; 2], Vec<usize>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (held, block, sizes) = ops.state;
        let (codes, scales) = held.take();
        register!(grads, ops.parents, [B::fp8_grouped_matmul_backward(grad, codes, scales, block, &sizes)]);
    }
}

/// The routed experts' grouped product; checkpoints `x` only when `w` is tracked and `w` only
/// when `x` is, as [`LinearBackward`] (a sharded expert weight is re-gathered, not kept).
#[derive(Debug)]
struct GroupedMatmulBackward;

impl<B: Glm5Backend> Backward<B, 2> for GroupedMatmulBackward {
    type State = (Option<NodeId>, Option<NodeId>, Vec<usize>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, w, sizes) = ops.state;
        let x = x.map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let w = w.map(|id| checkpointer.retrieve_node_output::<FloatTensor<B>>(id));
        let (dx, dw) = B::grouped_matmul_backward(x, w, grad, &sizes);
        for (node, g) in ops.parents.into_iter().zip([dx, dw]) {
            if let (Some(node), Some(g)) = (node, g) {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// The summed cross-entropy; holds the logits and the targets.
#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: Glm5Backend> Backward<B, 1> for CrossEntropyBackward {
    type State = (FloatTensor<B>, Vec<i64>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (logits, targets) = ops.state;
        register!(grads, ops.parents, [B::cross_entropy_sum_backward(logits, &targets, grad)]);
    }
}

/// A cast; holds the source dtype (the gradient goes back in it).
#[derive(Debug)]
struct CastBackward;

impl<B: Glm5Backend> Backward<B, 1> for CastBackward {
    type State = burn::tensor::FloatDType;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        register!(grads, ops.parents, [B::cast_float(grad, ops.state)]);
    }
}

/// SiLU; holds `x`.
#[derive(Debug)]
struct SiluBackward;

impl<B: Glm5Backend> Backward<B, 1> for SiluBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        register!(grads, ops.parents, [B::silu_backward(ops.state, grad)]);
    }
}

/// Causal depthwise conv; holds `x` and the taps.
#[derive(Debug)]
struct CausalConvBackward;

impl<B: Glm5Backend> Backward<B, 2> for CausalConvBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, w) = ops.state;
        let (dx, dw) = B::causal_conv1d_backward(x, w, grad);
        register!(grads, ops.parents, [dx, dw]);
    }
}

/// mHC collapse; holds `X` and `pre`.
#[derive(Debug)]
struct HcCollapseBackward;

impl<B: Glm5Backend> Backward<B, 2> for HcCollapseBackward {
    type State = (FloatTensor<B>, FloatTensor<B>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (x, pre) = ops.state;
        let (dx, dp) = B::hc_collapse_backward(x, pre, grad);
        register!(grads, ops.parents, [dx, dp]);
    }
}

/// mHC stream update; holds its four inputs.
#[derive(Debug)]
struct HcPostBackward;

impl<B: Glm5Backend> Backward<B, 4> for HcPostBackward {
    type State = [FloatTensor<B>; 4];

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [post, comb, y, res] = ops.state;
        let (dp, dc, dy, dx) = B::hc_post_backward(post, comb, y, res, grad);
        register!(grads, ops.parents, [dp, dc, dy, dx]);
    }
}

/// Holds the logits `Z` (`[X, n, n]`, 16 floats a token): the backward recomputes the
/// normalisation chain from them.
#[derive(Debug)]
struct SinkhornBackward;

impl<B: Glm5Backend> Backward<B, 1> for SinkhornBackward {
    type State = (FloatTensor<B>, usize, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (z, iters, eps) = ops.state;
        register!(grads, ops.parents, [B::hc_sinkhorn_backward(z, grad, iters, eps)]);
    }
}

#[derive(Debug)]
struct KdaPairSumsBackward;

impl<B: Glm5Backend> Backward<B, 3> for KdaPairSumsBackward {
    type State = (NodeId, NodeId, NodeId);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, checkpointer: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (k, q, g) = ops.state;
        let mut get = |id| checkpointer.retrieve_node_output::<B::FloatTensorPrimitive>(id);
        let (k, q, g) = (get(k), get(q), get(g));
        let (dk, dq, dg) = B::kda_pair_sums_backward(k, q, g, grad);
        register!(grads, ops.parents, [dk, dq, dg]);
    }
}

/// The scan's inputs (the backward recomputes the forward's intermediates from them: one
/// extra forward instead of holding every chunk's `T`, `W`, states, … per layer).
#[derive(Debug, Clone)]
struct KdaScanState<B: Backend> {
    inputs: ScanInputs<FloatTensor<B>>,
    dims: [usize; 5], // b, t, h, dk, dv
    chunk: usize,
    resets: Vec<usize>,
}

#[derive(Debug)]
struct KdaScanBackward;

impl<B: Glm5Backend> Backward<B, 6> for KdaScanBackward {
    type State = KdaScanState<B>;

    fn backward(self, ops: Ops<Self::State, 6>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let KdaScanState { inputs, dims: [b, t, h, dk, dv], chunk, resets } = ops.state;
        let packed = f2::<B>(grads.consume::<B>(&ops.node));
        let (no, ns) = (t * h * dv, h * dk * dv);
        let d_o = packed.clone().slice([0..b, 0..no]).reshape([b, t, h, dv]);
        let d_final = packed.slice([0..b, no..no + ns]).reshape([b, h, dk, dv]);
        let d = B::kda_chunk_scan_backward(inputs, d_o.into_primitive().tensor(), d_final.into_primitive().tensor(), chunk, &resets);
        register!(grads, ops.parents, [d.q, d.k, d.v, d.g, d.beta, d.h0]);
    }
}

/// What the sparse attention backward needs: its inputs and outputs (held, not recomputed:
/// `o` and `lse` are small next to the gathered rows a recompute would need).
#[derive(Debug, Clone)]
struct SparseLatentState<B: Backend> {
    q: FloatTensor<B>,
    kv: FloatTensor<B>,
    idx: IntTensor<B>,
    o: FloatTensor<B>,
    lse: FloatTensor<B>,
    scale: f32,
}

#[derive(Debug)]
struct SparseLatentBackward;

impl<B: Glm5Backend> Backward<B, 2> for SparseLatentBackward {
    type State = SparseLatentState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let d_o = grads.consume::<B>(&ops.node);
        let SparseLatentState { q, kv, idx, o, lse, scale } = ops.state;
        let (dq, dkv) = B::sparse_latent_attention_backward(q, kv, idx, o, lse, d_o, scale);
        register!(grads, ops.parents, [dq, dkv]);
    }
}

/// What the blocked attention backward needs: inputs, output and row log-sum-exp, all linear
/// in the sequence (the probabilities are recomputed block by block).
#[derive(Debug, Clone)]
struct BlockAttentionState<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    o: FloatTensor<B>,
    lse: FloatTensor<B>,
    scale: f32,
}

#[derive(Debug)]
struct BlockAttentionBackward;

impl<B: Glm5Backend> Backward<B, 3> for BlockAttentionBackward {
    type State = BlockAttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let d_o = grads.consume::<B>(&ops.node);
        let BlockAttentionState { q, k, v, o, lse, scale } = ops.state;
        let (dq, dk, dv) = B::block_attention_backward(q, k, v, o, lse, d_o, scale);
        register!(grads, ops.parents, [dq, dk, dv]);
    }
}

impl<B: Glm5Backend, C: CheckpointStrategy> Glm5Backend for Autodiff<B, C> {
    fn cast_float(x: FloatTensor<Self>, dtype: burn::tensor::FloatDType) -> FloatTensor<Self> {
        use burn::tensor::TensorMetadata;
        let source = x.primitive.dtype().into();
        let out = B::cast_float(x.primitive, dtype);
        match CastBackward.prepare::<C>([x.node]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(source, out),
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn kda_pairs_impl() -> OpImpl {
        B::kda_pairs_impl()
    }

    fn sparse_attention_impl() -> OpImpl {
        B::sparse_attention_impl()
    }

    fn kpool_impl() -> OpImpl {
        B::kpool_impl()
    }

    fn kda_scan_impl() -> OpImpl {
        B::kda_scan_impl()
    }

    fn kda_chunk_scan(x: ScanInputs<FloatTensor<Self>>, chunk: usize, resets: &[usize]) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::TensorMetadata;
        let [b, t, h, dk] = x.q.primitive.shape().dims::<4>();
        let dv = x.v.primitive.shape().dims::<4>()[3];
        let nodes = [&x.q, &x.k, &x.v, &x.g, &x.beta, &x.h0].map(|t| t.node.clone());
        let prims = x.map(|t| t.primitive, |t| t.primitive);
        let (o, s) = B::kda_chunk_scan(prims.clone(), chunk, resets);
        // one tracked output: [B, T·H·dv + H·dk·dv] = (O | S_T), split below
        let (no, ns) = (t * h * dv, h * dk * dv);
        let packed = Tensor::cat(vec![f4::<B>(o).reshape([b, no]), f4::<B>(s).reshape([b, ns])], 1).into_primitive().tensor();
        let out = match KdaScanBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => prep.finish(KdaScanState { inputs: prims, dims: [b, t, h, dk, dv], chunk, resets: resets.to_vec() }, packed),
            OpsKind::UnTracked(prep) => prep.finish(packed),
        };
        let out = f2::<Self>(out);
        let o = out.clone().slice([0..b, 0..no]).reshape([b, t, h, dv]);
        let s = out.slice([0..b, no..no + ns]).reshape([b, h, dk, dv]);
        (o.into_primitive().tensor(), s.into_primitive().tensor())
    }

    fn kpool_select(
        q: FloatTensor<Self>,
        w: FloatTensor<Self>,
        pooled: FloatTensor<Self>,
        mask: &[bool],
        sel: KpoolSelect,
        scale: f32,
    ) -> (Vec<i64>, f32) {
        B::kpool_select(q.primitive, w.primitive, pooled.primitive, mask, sel, scale)
    }

    fn kpool_compress(k: FloatTensor<Self>, gate: FloatTensor<Self>, ape: FloatTensor<Self>, first: &[usize]) -> FloatTensor<Self> {
        use burn::tensor::backend::AutodiffBackend;
        <Self as AutodiffBackend>::from_inner(B::kpool_compress(k.primitive, gate.primitive, ape.primitive, first))
    }

    fn block_attention(q: FloatTensor<Self>, k: FloatTensor<Self>, v: FloatTensor<Self>, scale: f32) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::backend::AutodiffBackend;
        let (o, lse) = B::block_attention(q.primitive.clone(), k.primitive.clone(), v.primitive.clone(), scale);
        let lse_out = <Self as AutodiffBackend>::from_inner(lse.clone());
        let state = BlockAttentionState { q: q.primitive.clone(), k: k.primitive.clone(), v: v.primitive.clone(), o: o.clone(), lse, scale };
        let o = record!(BlockAttentionBackward, [q, k, v], state, o);
        (o, lse_out)
    }

    fn sparse_latent_attention(
        q: FloatTensor<Self>,
        kv: FloatTensor<Self>,
        idx: IntTensor<Self>,
        scale: f32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::backend::AutodiffBackend;
        let (o, lse) = B::sparse_latent_attention(q.primitive.clone(), kv.primitive.clone(), idx.clone(), scale);
        let lse_out = <Self as AutodiffBackend>::from_inner(lse.clone());
        let state = SparseLatentState { q: q.primitive.clone(), kv: kv.primitive.clone(), idx, o: o.clone(), lse, scale };
        let o = record!(SparseLatentBackward, [q, kv], state, o);
        (o, lse_out)
    }

    fn rms_norm(x: FloatTensor<Self>, w: Option<FloatTensor<Self>>, eps: f64) -> FloatTensor<Self> {
        match w {
            None => record!(RmsNormBackward, [x], (x.primitive, eps), B::rms_norm(x.primitive.clone(), None, eps)),
            Some(w) => {
                let out = B::rms_norm(x.primitive.clone(), Some(w.primitive.clone()), eps);
                record!(RmsNormWeightedBackward, [x, w], (x.primitive, w.primitive, eps), out)
            }
        }
    }

    fn causal_conv1d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = B::causal_conv1d(x.primitive.clone(), w.primitive.clone());
        record!(CausalConvBackward, [x, w], (x.primitive, w.primitive), out)
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, limit: f64) -> FloatTensor<Self> {
        let out = B::swiglu(gate.primitive.clone(), up.primitive.clone(), limit);
        record!(SwigluBackward, [gate, up], (gate.primitive, up.primitive, limit), out)
    }

    fn kda_forget_gate(f: FloatTensor<Self>, dt_bias: FloatTensor<Self>, a_log: FloatTensor<Self>, bound: Option<f64>) -> FloatTensor<Self> {
        let out = B::kda_forget_gate(f.primitive.clone(), dt_bias.primitive.clone(), a_log.primitive.clone(), bound);
        record!(KdaGateBackward, [f, dt_bias, a_log], (f.primitive, dt_bias.primitive, a_log.primitive, bound), out)
    }

    fn grouped_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>, sizes: &[usize]) -> FloatTensor<Self> {
        let out = B::grouped_matmul(x.primitive.clone(), w.primitive.clone(), sizes);
        let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
        match GroupedMatmulBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                let state = (w_tracked.then(|| prep.checkpoint(&x)), x_tracked.then(|| prep.checkpoint(&w)), sizes.to_vec());
                prep.finish(state, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(out),
        }
    }

    fn linear_layer(x: FloatTensor<Self>, w: FloatTensor<Self>, b: Option<FloatTensor<Self>>) -> FloatTensor<Self> {
        let out = B::linear_layer(x.primitive.clone(), w.primitive.clone(), b.as_ref().map(|b| b.primitive.clone()));
        let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
        macro_rules! finish {
            ($prep:expr) => {
                match $prep.compute_bound().stateful() {
                    OpsKind::Tracked(mut prep) => {
                        let state = (w_tracked.then(|| prep.checkpoint(&x)), x_tracked.then(|| prep.checkpoint(&w)));
                        prep.finish(state, out)
                    }
                    OpsKind::UnTracked(prep) => prep.finish(out),
                }
            };
        }
        match b {
            None => finish!(LinearBackward.prepare::<C>([x.node.clone(), w.node.clone()])),
            Some(b) => finish!(LinearBackward.prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])),
        }
    }

    fn fp8_linear_impl() -> OpImpl {
        B::fp8_linear_impl()
    }

    fn fp8_linear(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        b: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let state = (Fp8Held::Kept(codes.clone(), scales.primitive.clone()), block);
        fp8_linear_tracked::<B, C>(x, codes, scales, b, state)
    }

    fn fp8_linear_refetched(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        b: Option<FloatTensor<Self>>,
        refetch: crate::ops::backend::Fp8Refetch<Self>,
    ) -> FloatTensor<Self> {
        let inner = move || refetch().map(|(codes, scales)| (codes, scales.primitive));
        fp8_linear_tracked::<B, C>(x, codes, scales, b, (Fp8Held::Refetch(Arc::new(inner)), block))
    }

    fn fp8_grouped_matmul(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
    ) -> FloatTensor<Self> {
        let out = B::fp8_grouped_matmul(x.primitive.clone(), codes.clone(), scales.primitive.clone(), block, sizes);
        record!(Fp8GroupedBackward, [x], (Fp8Held::Kept(codes, scales.primitive), block, sizes.to_vec()), out)
    }

    fn fp8_grouped_matmul_refetched(
        x: FloatTensor<Self>,
        codes: IntTensor<Self>,
        scales: FloatTensor<Self>,
        block: [usize; 2],
        sizes: &[usize],
        refetch: crate::ops::backend::Fp8Refetch<Self>,
    ) -> FloatTensor<Self> {
        let out = B::fp8_grouped_matmul(x.primitive.clone(), codes, scales.primitive, block, sizes);
        let inner = move || refetch().map(|(codes, scales)| (codes, scales.primitive));
        let held: Fp8Held<B> = Fp8Held::Refetch(Arc::new(inner));
        record!(Fp8GroupedBackward, [x], (held, block, sizes.to_vec()), out)
    }

    fn cross_entropy_sum(logits: FloatTensor<Self>, targets: &[i64]) -> FloatTensor<Self> {
        let out = B::cross_entropy_sum(logits.primitive.clone(), targets);
        record!(CrossEntropyBackward, [logits], (logits.primitive, targets.to_vec()), out)
    }

    fn silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        record!(SiluBackward, [x], x.primitive, B::silu(x.primitive.clone()))
    }

    /// Optimizer state is never differentiated: the inner backend's op on the primitives.
    fn adamw_step(
        p: FloatTensor<Self>,
        g: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::backend::AutodiffBackend;
        let (p, m, v) = B::adamw_step(p.primitive, g.primitive, m.primitive, v.primitive, s);
        (<Self as AutodiffBackend>::from_inner(p), <Self as AutodiffBackend>::from_inner(m), <Self as AutodiffBackend>::from_inner(v))
    }

    fn hc_collapse(x: FloatTensor<Self>, pre: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = B::hc_collapse(x.primitive.clone(), pre.primitive.clone());
        record!(HcCollapseBackward, [x, pre], (x.primitive, pre.primitive), out)
    }

    fn hc_post(post: FloatTensor<Self>, comb: FloatTensor<Self>, y: FloatTensor<Self>, res: FloatTensor<Self>) -> FloatTensor<Self> {
        let out = B::hc_post(post.primitive.clone(), comb.primitive.clone(), y.primitive.clone(), res.primitive.clone());
        record!(HcPostBackward, [post, comb, y, res], [post.primitive, comb.primitive, y.primitive, res.primitive], out)
    }

    fn hc_sinkhorn(z: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        record!(SinkhornBackward, [z], (z.primitive, iters, eps), B::hc_sinkhorn(z.primitive.clone(), iters, eps))
    }

    fn kda_pair_sums(k: FloatTensor<Self>, q: FloatTensor<Self>, gam: FloatTensor<Self>) -> FloatTensor<Self> {
        match KdaPairSumsBackward.prepare::<C>([k.node.clone(), q.node.clone(), gam.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(mut prep) => {
                let state = (prep.checkpoint(&k), prep.checkpoint(&q), prep.checkpoint(&gam));
                prep.finish(state, B::kda_pair_sums(k.primitive, q.primitive, gam.primitive))
            }
            OpsKind::UnTracked(prep) => prep.finish(B::kda_pair_sums(k.primitive, q.primitive, gam.primitive)),
        }
    }

    fn all_gather_rows(x: FloatTensor<Self>, rows: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        coll::all_gather_rows::<B, C>(x, rows, group)
    }

    fn reduce_scatter_rows(x: FloatTensor<Self>, rows: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        coll::reduce_scatter_rows::<B, C>(x, rows, group)
    }

    fn all_to_all_rows(x: FloatTensor<Self>, send: &[usize], recv: &[usize], group: &Group) -> Result<FloatTensor<Self>, DistError> {
        coll::all_to_all_rows::<B, C>(x, send, recv, group)
    }

    fn all_reduce_sum(x: FloatTensor<Self>, group: &Group) -> Result<FloatTensor<Self>, DistError> {
        coll::all_reduce_sum::<B, C>(x, group)
    }

    fn shift_rows(x: FloatTensor<Self>, to: usize, from: usize, recv_rows: usize, group: &Group) -> Result<FloatTensor<Self>, DistError> {
        coll::shift_rows::<B, C>(x, to, from, recv_rows, group)
    }

    fn gather_param(x: FloatTensor<Self>, links: [Option<FloatTensor<Self>>; 2], site: &ParamGather) -> Result<[FloatTensor<Self>; 2], DistError> {
        coll::gather_param::<B, C>(x, links, site)
    }
}
