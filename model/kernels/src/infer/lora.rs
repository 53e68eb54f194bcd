//! A LoRA adapter's update of some rows of a batched step, on the CPU: `y[row] += s · B (A x[row])`
//! for each of the rows, with `A` `(r, in)` and `B` given as `Bᵀ` `(r, out)`. Punica's BGMV (batched
//! gather matrix-vector) for the rows of one adapter: a decode step's handful of rows per adapter
//! and layer cost more as candle ops (a gather, two products, a scale, a scatter, each a dispatch
//! and an allocation) than as this loop, which reads `A` and `Bᵀ` once per row and writes in
//! place. A row's result does not depend on which other rows share its step.

use crate::simd::vectorised;

/// Adds `scale · Bᵀᵀ (A x[row])` to `y[row]` for every `row` of `rows`: `x` holds rows of
/// `d_in` values, `y` rows of `d_out`, `a` is `(r, d_in)` and `b_t` `(r, d_out)`, row-major.
///
/// # Panics
/// If a row is out of `x` or `y`, or `a` and `b_t` do not hold `r` rows of their widths.
#[allow(clippy::too_many_arguments)]
pub fn lora_rows(
    x: &[f32],
    d_in: usize,
    y: &mut [f32],
    d_out: usize,
    rows: &[u32],
    a: &[f32],
    b_t: &[f32],
    scale: f32,
) {
    let r = a.len() / d_in.max(1);
    assert!(
        a.len() == r * d_in && b_t.len() == r * d_out,
        "lora_rows: A and Bᵀ are not (r, in) and (r, out)"
    );
    vectorised(
        #[inline(always)]
        || {
            // Each row of `A`, then each of `Bᵀ`, against every row in turn: the matrices are read
            // once per call rather than once per row (four adapters' matrices of a GPT-2 block
            // outgrow the L2 cache). Each row's sums run in the same order whatever the others.
            let mut low = vec![0f32; rows.len() * r]; // (rows, r)
            for (k, ak) in a.chunks_exact(d_in).enumerate() {
                for (j, &row) in rows.iter().enumerate() {
                    let row = row as usize;
                    low[j * r + k] = scale * dot(&x[row * d_in..(row + 1) * d_in], ak);
                }
            }
            for (k, bk) in b_t.chunks_exact(d_out).enumerate() {
                for (j, &row) in rows.iter().enumerate() {
                    let (c, row) = (low[j * r + k], row as usize);
                    for (y, &b) in y[row * d_out..(row + 1) * d_out].iter_mut().zip(bk) {
                        *y += c * b;
                    }
                }
            }
        },
    )
}

/// `Σ x[i] y[i]` over sixteen partial sums (which the compiler keeps in vector lanes).
#[inline(always)]
fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (xc, yc) = (x.chunks_exact(16), y.chunks_exact(16));
    let tail: f32 = xc.remainder().iter().zip(yc.remainder()).map(|(a, b)| a * b).sum();
    for (xs, ys) in xc.zip(yc) {
        for i in 0..16 {
            acc[i] += xs[i] * ys[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_get_the_low_rank_update_and_others_nothing() {
        let (d_in, d_out, r) = (37, 21, 3);
        let value = |i: usize| ((i * 7919 % 113) as f32 - 56.0) / 50.0;
        let x: Vec<f32> = (0..4 * d_in).map(value).collect();
        let a: Vec<f32> = (0..r * d_in).map(|i| value(i + 5)).collect();
        let b_t: Vec<f32> = (0..r * d_out).map(|i| value(i + 11)).collect();
        let y0: Vec<f32> = (0..4 * d_out).map(|i| value(i + 17)).collect();
        let mut y = y0.clone();
        lora_rows(&x, d_in, &mut y, d_out, &[3, 1], &a, &b_t, 0.5);
        for row in 0..4 {
            for o in 0..d_out {
                let mut want = y0[row * d_out + o] as f64;
                if row == 1 || row == 3 {
                    for k in 0..r {
                        let low: f64 = (0..d_in).map(|i| (x[row * d_in + i] * a[k * d_in + i]) as f64).sum();
                        want += 0.5 * low * b_t[k * d_out + o] as f64;
                    }
                }
                let got = y[row * d_out + o] as f64;
                assert!((got - want).abs() < 1e-4, "row {row}, column {o}: {got} vs {want}");
            }
        }
    }
}
