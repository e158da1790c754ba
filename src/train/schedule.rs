//! Learning-rate schedules with linear warm-up (Megatron/NeMo style).
//!
//! For optimizer step `s` (0-based), peak `lr`, floor `min_lr`, `W` warm-up steps and `T` total:
//!
//! ```text
//! s < W:      lr · (s + 1) / W
//! otherwise:  p = (s − W) / max(T − W, 1)  (clamped to [0, 1])
//!             constant: lr;  linear: min_lr + (lr − min_lr)(1 − p);
//!             cosine: min_lr + (lr − min_lr)·½(1 + cos πp)
//! ```

use super::recipe::DecayStyle;

/// A schedule for `total_steps` optimizer steps.
#[derive(Debug, Clone, Copy)]
pub struct LrSchedule {
    /// Decay after warm-up.
    pub style: DecayStyle,
    /// Peak learning rate.
    pub lr: f64,
    /// Floor of the decay.
    pub min_lr: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// Steps of the run.
    pub total_steps: usize,
}

impl LrSchedule {
    /// Learning rate of optimizer step `step` (0-based).
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let p = ((step - self.warmup_steps) as f64 / span).clamp(0.0, 1.0);
        match self.style {
            DecayStyle::Constant => self.lr,
            DecayStyle::Linear => self.min_lr + (self.lr - self.min_lr) * (1.0 - p),
            DecayStyle::Cosine => self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_decay() {
        let s = LrSchedule { style: DecayStyle::Cosine, lr: 1.0, min_lr: 0.1, warmup_steps: 4, total_steps: 14 };
        assert_eq!(s.at(0), 0.25);
        assert_eq!(s.at(3), 1.0);
        assert_eq!(s.at(4), 1.0);
        assert!((s.at(9) - 0.55).abs() < 1e-12);
        assert!((s.at(14) - 0.1).abs() < 1e-12);
        let l = LrSchedule { style: DecayStyle::Linear, ..s };
        assert!((l.at(9) - 0.55).abs() < 1e-12);
        assert_eq!(LrSchedule { style: DecayStyle::Constant, ..s }.at(13), 1.0);
    }
}
