//! Reductions over one row of logits (a vocabulary's worth): the log-softmax normaliser and the
//! most likely token. The server takes both at every prompt position of an `echo` request and the
//! loss at every training position, so they are vectorised: `f32::exp` is a libm call per
//! element, and neither candle nor the standard library has a vectorised `exp` (written here:
//! Cephes' `expf` polynomial, branch-free so that it compiles to SIMD). Each is plain Rust
//! written in 16 lanes and compiled for the instruction set it runs on ([`Simd::run`]).

use crate::simd::{Kernel, Simd, Vec16};

/// `log Σ exp(row)`, the normaliser of a log-softmax (`-inf` for an empty row; the maximum
/// itself where it is not finite), on this CPU's widest instructions.
pub fn log_sum_exp(row: &[f32]) -> f32 {
    log_sum_exp_on(Simd::detect(), row)
}

/// [`log_sum_exp`] on `simd` (every instruction set gives the same bits).
pub fn log_sum_exp_on(simd: Simd, row: &[f32]) -> f32 {
    let (max, sum) = max_and_sum_exp(simd, row);
    if !max.is_finite() {
        return max;
    }
    max + sum.ln()
}

/// The row's maximum and `Σ exp(x - max)`, on `simd`.
pub(crate) fn max_and_sum_exp(simd: Simd, row: &[f32]) -> (f32, f32) {
    struct MaxAndSumExp<'a>(&'a [f32]);
    impl Kernel for MaxAndSumExp<'_> {
        type Output = (f32, f32);
        #[inline(always)]
        fn run<V: Vec16>(self) -> (f32, f32) {
            max_and_sum_exp_any(self.0)
        }
    }
    simd.run(MaxAndSumExp(row))
}

/// Lanes of the partial sums: independent accumulators that the compiler keeps in vector
/// registers (a single `f32` sum would have to be added in order).
const LANES: usize = 16;

/// The row's maximum (`-inf` when empty; NaNs passed over), in 16 lanes so that it vectorises
/// in the caller's instruction set (the maximum does not depend on the order).
#[inline(always)]
pub(crate) fn max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            // A comparison, not `f32::max`: one `vmaxps` without NaN fix-ups (NaN still loses).
            *m = if v > *m { v } else { *m };
        }
    }
    tail.iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, f32::max)
}

#[inline(always)]
fn max_and_sum_exp_any(row: &[f32]) -> (f32, f32) {
    let max = max(row);
    if !max.is_finite() {
        return (max, f32::NAN);
    }
    let mut sums = [0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (s, &v) in sums.iter_mut().zip(c) {
            *s += exp(v - max);
        }
    }
    let tail: f32 = tail.iter().map(|&v| exp(v - max)).sum();
    (max, sums.iter().sum::<f32>() + tail)
}

/// `e^x` to within 2 ulp for normal results (Cephes' `expf`: `x = n ln 2 + r`, `|r| <= ln 2 / 2`,
/// a degree-5 polynomial for `e^r`, then `2^n` in two exponent-bit factors so that each stays
/// normal); subnormal results through that last multiplication, 0 below -103.97, `+inf` above
/// 88.72, NaN for NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LO: f32 = -103.972_08;
    const HI: f32 = 88.722_84;
    // ln 2 in two parts, the first with few mantissa bits, so that `n * LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer, which then sits in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // n in -150..=128 as n1 + n2, each in -75..=64.
    let n = t.to_bits() as i32 - ROUND.to_bits() as i32;
    let n1 = n >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) << 23) as u32);
    let y = er * pow2(n1) * pow2(n - n1);
    if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        y
    }
}

/// The position of the row's largest value in `f32::total_cmp`'s order (the first of equal
/// ones), as a one-element `top_k` would pick it: the maximum of the values' integer keys, then
/// the first position with that key (both loops vectorise; no early exit in the first).
pub fn argmax(row: &[f32]) -> Option<usize> {
    argmax_on(Simd::detect(), row)
}

/// [`argmax`] on `simd`.
pub fn argmax_on(simd: Simd, row: &[f32]) -> Option<usize> {
    struct Argmax<'a>(&'a [f32]);
    impl Kernel for Argmax<'_> {
        type Output = Option<usize>;
        #[inline(always)]
        fn run<V: Vec16>(self) -> Option<usize> {
            argmax_any(self.0)
        }
    }
    simd.run(Argmax(row))
}

#[inline(always)]
fn argmax_any(row: &[f32]) -> Option<usize> {
    #[inline(always)]
    fn key(v: f32) -> i32 {
        // `total_cmp`'s key: negative values' magnitude bits flipped.
        let b = v.to_bits() as i32;
        b ^ (((b >> 31) as u32) >> 1) as i32
    }
    let best = row.iter().map(|&v| key(v)).max()?;
    row.iter().position(|&v| key(v) == best)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_within_two_ulp_of_f64_over_the_whole_range() {
        let (lo, hi) = (-103.9f32, 88.72f32);
        let steps = 2_000_000;
        let mut worst = (0, 0f32);
        for i in 0..=steps {
            let x = lo + (hi - lo) * i as f32 / steps as f32;
            let want = (x as f64).exp() as f32;
            let got = exp(x);
            if want >= f32::MIN_POSITIVE {
                let u = ulps(got, want);
                if u > worst.0 {
                    worst = (u, x);
                }
            } else {
                // Subnormal results: within a subnormal ulp of f64's, rounded once more.
                assert!(
                    (got - want).abs() <= 2.0 * f32::from_bits(1),
                    "exp({x}) = {got}, want {want}"
                );
            }
        }
        assert!(worst.0 <= 2, "exp({}) is {} ulp off", worst.1, worst.0);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    /// Uniform values in [0, 1) from a xorshift generator.
    fn uniform(mut state: u64) -> impl FnMut() -> f32 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    fn reference(row: &[f32]) -> f64 {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln()
    }

    #[test]
    fn log_sum_exp_matches_f64_on_rows_of_every_tail_length() {
        let mut next = uniform(0x2545_f491_4f6c_dd1d);
        for len in [1, 2, 15, 16, 17, 31, 100, 50257] {
            for scale in [0.01f32, 1.0, 30.0] {
                let row: Vec<f32> = (0..len).map(|_| (next() - 0.5) * 2.0 * scale).collect();
                let (got, want) = (log_sum_exp(&row) as f64, reference(&row));
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "len {len}, scale {scale}: {got} vs {want}"
                );
            }
        }
        assert_eq!(log_sum_exp(&[]), f32::NEG_INFINITY);
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY; 20]), f32::NEG_INFINITY);
        assert_eq!(log_sum_exp(&[0.0, f32::INFINITY, 1.0]), f32::INFINITY);
        assert!(log_sum_exp(&[0.0, f32::NAN, 1.0]).is_nan());
        // exp(-x) for x past -87 is subnormal or 0, yet the sum keeps the maximum's term.
        assert_eq!(log_sum_exp(&[-200.0, 0.0]), 0.0);
    }

    /// Every instruction set the host runs gives the portable path's bits.
    #[test]
    fn every_instruction_set_matches_the_portable_path() {
        let mut next = uniform(0x9e37_79b9_7f4a_7c15);
        for len in [0, 1, 15, 16, 17, 33, 1000, 50257] {
            let row: Vec<f32> = (0..len).map(|_| (next() - 0.5) * 40.0).collect();
            let lse = log_sum_exp_on(Simd::Portable, &row);
            for &simd in Simd::available() {
                assert_eq!(log_sum_exp_on(simd, &row).to_bits(), lse.to_bits(), "{simd:?}, {len}");
                assert_eq!(
                    argmax_on(simd, &row),
                    argmax_on(Simd::Portable, &row),
                    "{simd:?}, {len}"
                );
            }
        }
        eprintln!("instruction sets checked: {:?}", Simd::available());
    }

    #[test]
    fn argmax_is_the_first_maximum_in_total_order() {
        let by_sort = |row: &[f32]| {
            let mut ids: Vec<usize> = (0..row.len()).collect();
            // Largest first, lower id first among equals (as `top_k` orders them).
            ids.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            ids.first().copied()
        };
        let rows: Vec<Vec<f32>> = vec![
            vec![],
            vec![3.0],
            vec![1.0, 5.0, 5.0, 2.0],
            vec![-0.0, 0.0, -1.0],
            vec![0.0, -0.0],
            vec![-3.0, -1.0, -2.0, -1.0],
            vec![f32::NEG_INFINITY, f32::NEG_INFINITY],
            vec![1.0, f32::INFINITY, 2.0],
            (0..50257).map(|i| ((i * 7919) % 50257) as f32 * 1e-3).collect(),
            (0..37).map(|i| -(((i * 13) % 37) as f32)).collect(),
        ];
        for row in rows {
            assert_eq!(argmax(&row), by_sort(&row), "{:?}", &row[..row.len().min(8)]);
        }
    }
}
