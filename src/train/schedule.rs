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
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
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

/// The schedule a resumed run follows, and what to tell the user when the recipe asks for
/// another one. Megatron and NeMo keep the schedule of the run that wrote the checkpoint (its
/// `max_steps` horizon included): raising `max_steps` to train longer then continues at the
/// rate the run had, which stays at the final rate past the old horizon, instead of jumping to
/// a re-derived curve. `rederive` follows the recipe's schedule instead, saying where the rate
/// jumps. A checkpoint without a recorded schedule follows the recipe's.
pub fn resume_schedule(saved: Option<LrSchedule>, recipe: LrSchedule, step: usize, rederive: bool) -> (LrSchedule, Option<String>) {
    let Some(saved) = saved.filter(|s| *s != recipe) else { return (recipe, None) };
    let describe = |s: &LrSchedule| {
        format!("{:?} from {:.3e} to {:.3e} over {} steps ({} warm-up)", s.style, s.lr, s.min_lr, s.total_steps, s.warmup_steps).to_lowercase()
    };
    if rederive {
        let note = format!(
            "--new-schedule: following the recipe's schedule ({}) instead of the run's ({}); the learning rate moves from {:.3e} to {:.3e} at step {}",
            describe(&recipe),
            describe(&saved),
            saved.at(step),
            recipe.at(step),
            step + 1
        );
        return (recipe, Some(note));
    }
    let past = if recipe.total_steps > saved.total_steps && !matches!(saved.style, DecayStyle::Constant) {
        format!("; after step {} it stays at {:.3e}", saved.total_steps, saved.at(saved.total_steps))
    } else {
        String::new()
    };
    let note = format!(
        "the recipe's schedule ({}) differs from the run's ({}): keeping the run's, so the learning rate continues at {:.3e} \
         from step {}{past}; pass --new-schedule to follow the recipe's (the rate would jump to {:.3e})",
        describe(&recipe),
        describe(&saved),
        saved.at(step),
        step + 1,
        recipe.at(step)
    );
    (saved, Some(note))
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

    #[test]
    fn a_resumed_run_keeps_its_schedule_unless_told() {
        let run = LrSchedule { style: DecayStyle::Cosine, lr: 1.0, min_lr: 0.1, warmup_steps: 4, total_steps: 14 };
        let longer = LrSchedule { total_steps: 40, ..run };
        // the same schedule: nothing to say
        assert_eq!(resume_schedule(Some(run), run, 9, false), (run, None));
        // a longer max_steps keeps the run's curve: no jump at the resumed step
        let (kept, note) = resume_schedule(Some(run), longer, 9, false);
        assert_eq!(kept, run);
        assert!((kept.at(9) - run.at(9)).abs() < 1e-15 && (kept.at(30) - 0.1).abs() < 1e-12);
        let note = note.expect("a note");
        assert!(note.contains("keeping the run's") && note.contains("--new-schedule") && note.contains("after step 14"), "{note}");
        // told otherwise, the recipe's, saying where it jumps
        let (new, note) = resume_schedule(Some(run), longer, 9, true);
        assert_eq!(new, longer);
        assert!(note.expect("a note").contains("at step 10"));
        // an old checkpoint without a schedule: the recipe's
        assert_eq!(resume_schedule(None, longer, 9, false), (longer, None));
    }
}
