//! Reference paths of the model's hot spots, written with ordinary Burn tensor ops.
//!
//! They are the readable specification: the CubeCL kernels (`cubecl_kernels/`) are tested
//! against them, and they run on every backend.
//!
//! * [`kda`]: Kimi Delta Attention, chunked (default) and token-recurrent (oracle) forms.
//! * [`kda_scan`]: the chunked scan as one op — chunk-parallel parts batched, the state
//!   recurrences as backend ops — with its hand-written backward.
//! * [`kpool`]: KPool scoring and top-k selection of the DSA indexer (host-side selection,
//!   deterministic ties).
//! * [`sparse_attn`]: MLA over the selected indices, dense-masked and absorbed-latent sparse,
//!   and the absorbed core as a flat op (`latent_reference`) with its closed-form backward.
//! * [`conv`], [`rms`], [`hc_streams`], [`sinkhorn`], [`swiglu`]: KDA's short convolution, RMS
//!   normalisation, mHC's stream collapse/update, its Sinkhorn mixing matrix and the MLPs'
//!   clamped SiLU gate, each a
//!   reference tensor-op form with a closed-form backward and a fused host form for Flex.
//! * [`linear`]: the linear layers' `x·W + b` and its backward as one op.
//! * [`fp8_linear`]: the same on a frozen FP8 E4M3 weight with block scales ([`e4m3`]),
//!   dequantised per use.
//! * [`grouped_matmul`]: the routed experts' products, each expert's rows times its weight.
//! * [`cross_entropy`]: the summed token cross-entropy (the LM loss) and its backward.
//! * [`adamw`]: one AdamW update of a parameter tensor, the optimizer's fused step.
//! * [`backend`]: [`backend::Glm5Backend`], the custom-op trait: ops whose default bodies are
//!   reference paths and which a backend overrides (Flex: KDA's scan as a host recurrence,
//!   its pair sums and the ops above as fused loops; CubeCL backends: the
//!   `glm5-cubecl-kernels` kernels), with hand-written backwards under `Autodiff`. [`PathKind`] selects, per forward pass, the op or the reference.

pub mod adamw;
pub mod backend;
pub mod block_attn;
pub mod collective;
pub mod conv;
pub mod cross_entropy;
pub mod e4m3;
pub mod fp8_linear;
mod gemm_bf16;
pub mod grouped_matmul;
pub mod hc_streams;
mod host;
pub mod kda;
pub mod kda_gate;
mod kda_host;
pub mod kda_pairs;
pub mod kda_scan;
pub mod kpool;
pub mod linear;
pub mod rms;
pub mod sinkhorn;
pub mod sparse_attn;
pub mod swiglu;

use std::collections::BTreeSet;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// What a backend runs for one of the model's ops ([`backend::Glm5Backend`]'s `*_impl`
/// queries).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpImpl {
    /// Only the reference tensor ops (the trait's default body).
    Reference,
    /// Fused host loops (Flex): one pass over host memory instead of a chain of tensor ops.
    Fused,
    /// A CubeCL kernel (`glm5-cubecl-kernels`, on `Vulkan`/`Cuda`).
    Kernel,
}

impl OpImpl {
    /// Words for logs and the `finetune` example's paths line.
    pub fn describe(self) -> &'static str {
        match self {
            OpImpl::Reference => "reference tensor ops",
            OpImpl::Fused => "fused host loops",
            OpImpl::Kernel => "CubeCL kernel",
        }
    }
}

/// Which implementation of a hot spot the model runs (recipe `model.backend.attn` / `.linear`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PathKind {
    /// The reference tensor-op path (this module's functions), on every backend.
    Reference,
    /// The backend's own implementation of the op where it has one — CubeCL kernels on
    /// `Vulkan`/`Cuda`, fused host loops on Flex for KDA — and the reference elsewhere, with a
    /// one-time warning (`log`) naming the op and the backend. Recipe value `op`; `kernel`, its
    /// name before Flex's fused loops were told apart from kernels, is still read.
    #[default]
    #[serde(alias = "kernel")]
    Op,
}

impl PathKind {
    /// Whether to call the backend op: `Op` and the backend has more than the reference for
    /// it. Warns once per (op, backend) when `Op` falls back.
    pub fn use_op<B: burn::tensor::backend::Backend>(self, op: &'static str, available: OpImpl) -> bool {
        if self == PathKind::Reference {
            return false;
        }
        let available = available != OpImpl::Reference;
        if !available {
            static WARNED: Mutex<BTreeSet<(&'static str, String)>> = Mutex::new(BTreeSet::new());
            let key = (op, std::any::type_name::<B>().to_string());
            let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
            if !warned.contains(&key) {
                log::warn!("{op}: backend `{}` has only the reference tensor ops for it", key.1);
                warned.insert(key);
            }
        }
        available
    }
}
