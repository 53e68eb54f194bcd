//! Learning-rate schedules: nanoGPT's linear warmup + cosine decay, warmup-stable-decay (the
//! trapezoid of modded-nanogpt and nanochat: the peak held, then a linear cool-down), and the
//! original transformer's inverse-square-root ("noam") schedule.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// Linear warmup to --learning-rate, cosine decay to --min-lr at --lr-decay-iters.
    Cosine,
    /// lr = n_embd^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al., 2017, §5.3).
    Noam,
    /// --learning-rate throughout.
    Constant,
    /// Warmup-stable-decay: linear warmup to --learning-rate, held, then linear decay to --min-lr
    /// over the last --cooldown-fraction of --lr-decay-iters (Hägele et al., 2024).
    Wsd,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub learning_rate: f64,
    pub min_lr: f64,
    pub warmup_iters: usize,
    pub lr_decay_iters: usize,
    /// The share of `lr_decay_iters` the WSD schedule spends cooling down.
    pub cooldown_fraction: f64,
    pub d_model: usize,
}

impl Schedule {
    /// The learning rate for iteration `it` (0-based, the update about to be made).
    pub fn lr(&self, it: usize) -> f64 {
        match self.kind {
            ScheduleKind::Constant => self.learning_rate,
            ScheduleKind::Cosine => {
                if it < self.warmup_iters {
                    return self.learning_rate * (it + 1) as f64 / (self.warmup_iters + 1) as f64;
                }
                if it > self.lr_decay_iters {
                    return self.min_lr;
                }
                let span = (self.lr_decay_iters - self.warmup_iters).max(1) as f64;
                let ratio = (it - self.warmup_iters) as f64 / span;
                let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()); // 1 → 0
                self.min_lr + coeff * (self.learning_rate - self.min_lr)
            }
            ScheduleKind::Wsd => {
                if it < self.warmup_iters {
                    return self.learning_rate * (it + 1) as f64 / (self.warmup_iters + 1) as f64;
                }
                let cooldown = (self.cooldown_fraction * self.lr_decay_iters as f64).round() as usize;
                let start = self.lr_decay_iters.saturating_sub(cooldown).max(self.warmup_iters);
                if it >= self.lr_decay_iters {
                    return self.min_lr;
                }
                if it < start {
                    return self.learning_rate;
                }
                let left = (self.lr_decay_iters - it) as f64 / (self.lr_decay_iters - start) as f64; // 1 → 0
                self.min_lr + left * (self.learning_rate - self.min_lr)
            }
            ScheduleKind::Noam => {
                let step = (it + 1) as f64; // the paper counts steps from 1
                let warmup = self.warmup_iters.max(1) as f64;
                (self.d_model as f64).powf(-0.5) * step.powf(-0.5).min(step * warmup.powf(-1.5))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cosine() -> Schedule {
        Schedule {
            kind: ScheduleKind::Cosine,
            learning_rate: 1e-3,
            min_lr: 1e-4,
            warmup_iters: 100,
            lr_decay_iters: 2000,
            cooldown_fraction: 0.4,
            d_model: 128,
        }
    }

    #[test]
    fn wsd_holds_the_peak_then_cools_down_linearly() {
        let s = Schedule {
            kind: ScheduleKind::Wsd,
            ..cosine()
        };
        assert!(close(s.lr(0), 1e-3 / 101.0));
        assert!(close(s.lr(100), 1e-3));
        assert!(close(s.lr(1199), 1e-3)); // the cool-down starts at 2000 - 800
        assert!(close(s.lr(1200), 1e-3));
        assert!(close(s.lr(1600), 1e-4 + 0.5 * 9e-4));
        assert!(close(s.lr(2000), 1e-4));
        assert!(close(s.lr(9000), 1e-4));
        assert!(
            (1200..2000).all(|i| s.lr(i + 1) < s.lr(i)),
            "strictly decreasing while it cools"
        );
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 + 1e-9 * b.abs()
    }

    #[test]
    fn cosine_warms_up_linearly_then_decays_to_min_lr() {
        let s = cosine();
        assert!(close(s.lr(0), 1e-3 / 101.0));
        assert!(close(s.lr(49), 1e-3 * 50.0 / 101.0));
        assert!(close(s.lr(100), 1e-3)); // warmup done: the peak
        assert!(close(s.lr(1050), 1e-4 + 0.5 * 9e-4)); // half way: cos(pi/2) = 0
        assert!(close(s.lr(2000), 1e-4));
        assert!(close(s.lr(5000), 1e-4));
        assert!((100..2000).all(|i| s.lr(i + 1) <= s.lr(i)), "monotone decay");
    }

    #[test]
    fn noam_peaks_at_warmup() {
        let s = Schedule {
            kind: ScheduleKind::Noam,
            warmup_iters: 4000,
            d_model: 512,
            ..cosine()
        };
        let peak = 512f64.powf(-0.5) * 4000f64.powf(-0.5);
        assert!(close(s.lr(3999), peak));
        assert!(close(s.lr(0), 512f64.powf(-0.5) * 4000f64.powf(-1.5)));
        assert!(close(s.lr(15999), 512f64.powf(-0.5) / 16000f64.sqrt()));
        assert!(s.lr(1999) < peak && s.lr(7999) < peak);
    }

    #[test]
    fn constant_is_constant() {
        let s = Schedule {
            kind: ScheduleKind::Constant,
            ..cosine()
        };
        assert_eq!(s.lr(0), 1e-3);
        assert_eq!(s.lr(10_000), 1e-3);
    }
}
