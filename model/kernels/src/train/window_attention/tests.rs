use super::*;

/// The softmax of a row's first `len` scores, each exponential and sum in the order of
/// `softmax_row` before its last partial vector was taken whole: 16 lane sums, then the
/// rest one by one.
fn reference(scores: &[f32], scale: f32) -> Vec<f32> {
    let x: Vec<f32> = scores.iter().map(|s| s * scale).collect();
    let max = crate::rows::max(&x);
    let e: Vec<f32> = x.iter().map(|v| crate::rows::exp(v - max)).collect();
    let whole = x.len() / LANES * LANES;
    let mut sums = [0f32; LANES];
    for (j, v) in e[..whole].iter().enumerate() {
        sums[j % LANES] += v;
    }
    let rest = e[whole..].iter().fold(0f32, |s, v| s + v);
    let inv = 1.0 / (sums.iter().sum::<f32>() + rest);
    e.iter().map(|v| v * inv).collect()
}

/// Every length of a 64-wide row, with whatever the entries past it hold (NaN, infinities,
/// scores far above the row's maximum): the first `len` probabilities are the reference's
/// bits, the rest zero.
#[test]
fn softmax_rows_keep_their_bits_whatever_lies_past_them() {
    for len in 1..=64 {
        let scores: Vec<f32> = (0..len).map(|j| ((j * 37 % 23) as f32 - 11.0) * 0.7).collect();
        for junk in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, 0.0] {
            let mut row = vec![junk; 64];
            row[..len].copy_from_slice(&scores);
            softmax_row(&mut row, 0, len, 0.125);
            let want = reference(&scores, 0.125);
            for j in 0..len {
                assert_eq!(row[j].to_bits(), want[j].to_bits(), "len {len}, junk {junk}, entry {j}");
            }
            assert!(
                row[len..].iter().all(|&v| v == 0.0),
                "len {len}, junk {junk}: {:?}",
                &row[len..]
            );
        }
    }
}

/// A backward pass that reads the probabilities its forward pass kept gives the bits of one
/// that recomputes them, and the forward pass's output is the same either way: several
/// query blocks with a partial last one, heads read where they are and copied, dropout, packed
/// windows, one-row windows, on every instruction set this CPU has.
#[test]
fn kept_probabilities_give_the_recomputed_gradients_bit_for_bit() -> Result<()> {
    for &simd in Simd::available() {
        for (b, t, nh, hs, p, packed) in [
            (2, 150, 2, 24, 0.0, false),
            (2, 150, 2, 32, 0.0, true),
            (2, 130, 2, 16, 0.2, false),
            (2, 70, 3, 16, 0.2, true),
            (3, 1, 1, 16, 0.0, false),
        ] {
            let c = nh * hs;
            let values = |len: usize, seed: usize| -> Vec<f32> {
                (0..len).map(|i| ((i * seed % 1000) as f32 - 500.0) / 250.0).collect()
            };
            let (qkv, dy) = (values(b * t * 3 * c, 7919), values(b * t * c, 104_729));
            // Packed: each window holds a sequence of t / 3 rows, then one of the rest.
            let starts: Option<Arc<[u32]>> = packed.then(|| {
                (0..b * t)
                    .map(|r| if r % t < t / 3 { 0 } else { (t / 3) as u32 })
                    .collect()
            });
            let op = |probs| WindowAttention {
                t,
                n_head: nh,
                scale: 1.0 / (hs as f32).sqrt(),
                dropout: (p > 0.0).then_some(Dropout { key: 7, first: 11, p }),
                simd,
                starts: starts.clone(),
                probs,
            };
            let d = Dims::of(&Layout::contiguous((b * t, 3 * c)), t, nh)?;
            let what = format!("{simd:?} ({b}, {t}, {nh} x {hs}) p {p} packed {packed}");
            let (recomputes, keeps) = (op(None), op(Some(Arc::default())));
            let (y, y_kept) = (forward(&recomputes, d, &qkv), forward(&keeps, d, &qkv));
            assert!(recomputes.kept(d).is_none() && keeps.kept(d).is_some(), "{what}");
            assert!(keeps_probs(b * t, t, nh), "{what}: small enough to keep");
            let (g, g_kept) = (backward(&recomputes, d, &qkv, &dy), backward(&keeps, d, &qkv, &dy));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&y), bits(&y_kept), "{what}: forward");
            assert_eq!(bits(&g), bits(&g_kept), "{what}: gradient");
            assert!(g.iter().any(|&v| v != 0.0), "{what}: a gradient of zeros tests nothing");
        }
    }
    Ok(())
}

/// The probabilities are kept up to [`KEEP_PROBS_MAX`] bytes a call, and a size too large to
/// count is too large to keep.
#[test]
fn probabilities_are_kept_up_to_the_limit() {
    // nanoGPT's CPU recipe a thread: 6 windows of 64, 4 heads (384 KiB).
    assert!(keeps_probs(6 * 64, 64, 4));
    // GPT-2 small's 4 windows of 256 with 12 heads (12 MiB).
    assert!(!keeps_probs(4 * 256, 256, 12));
    // Exactly the limit, and one window more.
    let per_window = 64 * 64 * 4 * 4;
    let windows = KEEP_PROBS_MAX / per_window;
    assert!(keeps_probs(windows * 64, 64, 4) && !keeps_probs((windows + 1) * 64, 64, 4));
    assert!(!keeps_probs(usize::MAX / 2, 1 << 20, 1 << 10));
    assert!(!keeps_probs(0, 0, 4));
}
