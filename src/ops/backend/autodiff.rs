//! `Autodiff<B>`: every op forwards to `B`'s and registers a hand-written backward that calls
//! `B`'s backward method (Burn 0.21's custom-op pattern; `burn-autodiff`'s own ops have the
//! same shape). Ops without a gradient (`kpool_*`, `adamw_step`) run on the inner primitives.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::NodeId;
use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};

use burn::tensor::Tensor;

use super::prim::*;
use super::Glm5Backend;
use crate::ops::adamw::AdamWScalars;
use crate::ops::kpool::KpoolSelect;

/// RMS norm without a weight; holds `x` (the backward recomputes `r` and `y`).
#[derive(Debug)]
struct RmsNormBackward;

impl<B: Glm5Backend> Backward<B, 1> for RmsNormBackward {
    type State = (FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, eps) = ops.state;
        if let Some(node) = node {
            grads.register::<B>(node.id, B::rms_norm_backward(x, None, grad, eps).0);
        }
    }
}

/// RMS norm with a weight; holds `x` and `w`.
#[derive(Debug)]
struct RmsNormWeightedBackward;

impl<B: Glm5Backend> Backward<B, 2> for RmsNormWeightedBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_x, node_w] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (x, w, eps) = ops.state;
        let (dx, dw) = B::rms_norm_backward(x, Some(w), grad, eps);
        if let Some(node) = node_x {
            grads.register::<B>(node.id, dx);
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<B>(node.id, dw);
        }
    }
}

/// Clamped SiLU-gated product; holds `gate` and `up` (the backward recomputes the sigmoid).
#[derive(Debug)]
struct SwigluBackward;

impl<B: Glm5Backend> Backward<B, 2> for SwigluBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, f64);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node_g, node_u] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (gate, up, limit) = ops.state;
        let (dg, du) = B::swiglu_backward(gate, up, grad, limit);
        if let Some(node) = node_g {
            grads.register::<B>(node.id, dg);
        }
        if let Some(node) = node_u {
            grads.register::<B>(node.id, du);
        }
    }
}

/// SiLU; holds `x`.
#[derive(Debug)]
struct SiluBackward;

impl<B: Glm5Backend> Backward<B, 1> for SiluBackward {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(node) = node {
            grads.register::<B>(node.id, B::silu_backward(ops.state, grad));
        }
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
        for (node, g) in ops.parents.into_iter().zip([dx, dw]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
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
        for (node, g) in ops.parents.into_iter().zip([dx, dp]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
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
        for (node, g) in ops.parents.into_iter().zip([dp, dc, dy, dx]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, g);
            }
        }
    }
}

/// Holds the logits `Z` (`[X, n, n]`, 16 floats a token): the backward recomputes the
/// normalisation chain from them.
#[derive(Debug)]
struct SinkhornBackward;

impl<B: Glm5Backend> Backward<B, 1> for SinkhornBackward {
    type State = (FloatTensor<B>, usize, f64);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (z, iters, eps) = ops.state;
        if let Some(node) = node {
            grads.register::<B>(node.id, B::hc_sinkhorn_backward(z, grad, iters, eps));
        }
    }
}

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

/// The scan's inputs (the backward recomputes the forward's intermediates from them: one
/// extra forward instead of holding every chunk's `T`, `W`, states, … per layer).
#[derive(Debug, Clone)]
struct KdaScanState<B: Backend> {
    inputs: [FloatTensor<B>; 6],
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
        let [q, k, v, g, beta, h0] = inputs;
        let (dq, dk_, dv_, dg, db, dh) =
            B::kda_chunk_scan_backward(q, k, v, g, beta, h0, d_o.into_primitive().tensor(), d_final.into_primitive().tensor(), chunk, &resets);
        for (node, grad) in ops.parents.into_iter().zip([dq, dk_, dv_, dg, db, dh]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
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
        let [node_q, node_kv] = ops.parents;
        let d_o = grads.consume::<B>(&ops.node);
        let SparseLatentState { q, kv, idx, o, lse, scale } = ops.state;
        let (dq, dkv) = B::sparse_latent_attention_backward(q, kv, idx, o, lse, d_o, scale);
        for (node, grad) in [(node_q, dq), (node_kv, dkv)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
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
        for (node, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: Glm5Backend, C: CheckpointStrategy> Glm5Backend for Autodiff<B, C> {
    fn has_kda_kernel() -> bool {
        B::has_kda_kernel()
    }

    fn has_sparse_attention_kernel() -> bool {
        B::has_sparse_attention_kernel()
    }

    fn has_kpool_kernel() -> bool {
        B::has_kpool_kernel()
    }

    fn has_kda_scan_kernel() -> bool {
        B::has_kda_scan_kernel()
    }

    fn kda_chunk_scan(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        g: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        h0: FloatTensor<Self>,
        chunk: usize,
        resets: &[usize],
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        use burn::tensor::TensorMetadata;
        let [b, t, h, dk] = q.primitive.shape().dims::<4>();
        let dv = v.primitive.shape().dims::<4>()[3];
        let nodes = [&q, &k, &v, &g, &beta, &h0].map(|x| x.node.clone());
        let prims = [&q, &k, &v, &g, &beta, &h0].map(|x| x.primitive.clone());
        let [pq, pk, pv, pg, pb, ph] = prims.clone();
        let (o, s) = B::kda_chunk_scan(pq, pk, pv, pg, pb, ph, chunk, resets);
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
        let o = match BlockAttentionBackward.prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let state = BlockAttentionState { q: q.primitive, k: k.primitive, v: v.primitive, o: o.clone(), lse, scale };
                prep.finish(state, o)
            }
            OpsKind::UnTracked(prep) => prep.finish(o),
        };
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
        let o = match SparseLatentBackward.prepare::<C>([q.node.clone(), kv.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let state = SparseLatentState { q: q.primitive, kv: kv.primitive, idx, o: o.clone(), lse, scale };
                prep.finish(state, o)
            }
            OpsKind::UnTracked(prep) => prep.finish(o),
        };
        (o, lse_out)
    }

    fn rms_norm(x: FloatTensor<Self>, w: Option<FloatTensor<Self>>, eps: f64) -> FloatTensor<Self> {
        match w {
            None => match RmsNormBackward.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let out = B::rms_norm(x.primitive.clone(), None, eps);
                    prep.finish((x.primitive, eps), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::rms_norm(x.primitive, None, eps)),
            },
            Some(w) => match RmsNormWeightedBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let out = B::rms_norm(x.primitive.clone(), Some(w.primitive.clone()), eps);
                    prep.finish((x.primitive, w.primitive, eps), out)
                }
                OpsKind::UnTracked(prep) => prep.finish(B::rms_norm(x.primitive, Some(w.primitive), eps)),
            },
        }
    }

    fn causal_conv1d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        match CausalConvBackward.prepare::<C>([x.node.clone(), w.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::causal_conv1d(x.primitive.clone(), w.primitive.clone());
                prep.finish((x.primitive, w.primitive), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::causal_conv1d(x.primitive, w.primitive)),
        }
    }

    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>, limit: f64) -> FloatTensor<Self> {
        match SwigluBackward.prepare::<C>([gate.node.clone(), up.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::swiglu(gate.primitive.clone(), up.primitive.clone(), limit);
                prep.finish((gate.primitive, up.primitive, limit), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::swiglu(gate.primitive, up.primitive, limit)),
        }
    }

    fn silu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match SiluBackward.prepare::<C>([x.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::silu(x.primitive.clone());
                prep.finish(x.primitive, out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::silu(x.primitive)),
        }
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
        match HcCollapseBackward.prepare::<C>([x.node.clone(), pre.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::hc_collapse(x.primitive.clone(), pre.primitive.clone());
                prep.finish((x.primitive, pre.primitive), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::hc_collapse(x.primitive, pre.primitive)),
        }
    }

    fn hc_post(post: FloatTensor<Self>, comb: FloatTensor<Self>, y: FloatTensor<Self>, res: FloatTensor<Self>) -> FloatTensor<Self> {
        let nodes = [&post, &comb, &y, &res].map(|t| t.node.clone());
        match HcPostBackward.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::hc_post(post.primitive.clone(), comb.primitive.clone(), y.primitive.clone(), res.primitive.clone());
                prep.finish([post.primitive, comb.primitive, y.primitive, res.primitive], out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::hc_post(post.primitive, comb.primitive, y.primitive, res.primitive)),
        }
    }

    fn hc_sinkhorn(z: FloatTensor<Self>, iters: usize, eps: f64) -> FloatTensor<Self> {
        match SinkhornBackward.prepare::<C>([z.node.clone()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let out = B::hc_sinkhorn(z.primitive.clone(), iters, eps);
                prep.finish((z.primitive, iters, eps), out)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::hc_sinkhorn(z.primitive, iters, eps)),
        }
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
}
