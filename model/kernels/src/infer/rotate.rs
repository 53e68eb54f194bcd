//! A generation step's q and k heads normalised (QK-norm) and rotated to their positions, in one
//! pass over the fused projection's rows. As candle ops this is about fifteen dispatches per
//! layer (q and k narrowed and copied out, the two tables' rows gathered, RMSNorm and `rope_thd`
//! twice, the three parts concatenated back), each an allocation and a pass over a few kilobytes:
//! about 450 per SmolLM2 decode step at batch 1, on the main thread while the pool's worker waits
//! (perf: 0.68% of a Q4_1 decode's samples, 0.20% as this pass; EPYC Zen 4). Here each row is read
//! and written once. The arithmetic is candle-nn's, operation for
//! operation (`rms_norm`: the squares summed in order, `x / sqrt(mean + eps) * gain`; `rope_thd`:
//! `x1 cos - x2 sin`, `x1 sin + x2 cos` over the two halves of each head), so the values are the
//! same bits as those ops give.

/// The heads of a fused projection's row: `n_head` query heads, then `n_kv_head` key heads, then
/// as many value heads, each `head_dim` wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkvHeads {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

impl QkvHeads {
    /// Values in one row: `(n_head + 2 n_kv_head) head_dim`.
    pub fn width(&self) -> usize {
        (self.n_head + 2 * self.n_kv_head) * self.head_dim
    }
}

/// QK-norm's gains of q's and of k's heads (`head_dim` each) and its epsilon.
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub eps: f32,
}

/// The rows of `qkv` (each [`QkvHeads::width`] values) with every q and k head normalised by
/// `norm` (where given), then rotated by the angles of its row's position (`cos` and `sin`:
/// `(positions, head_dim / 2)` tables, row `positions[n]` for row `n`, where given); v copied.
///
/// # Errors
/// Where `qkv` is not whole rows of the heads, the positions are not one per row, a position is
/// past the tables, or the tables or gains are not of the heads' width.
pub fn rotate_qkv(
    qkv: &[f32],
    heads: QkvHeads,
    positions: &[u32],
    tables: Option<(&[f32], &[f32])>,
    norm: Option<QkNorm<'_>>,
) -> candle_core::Result<Vec<f32>> {
    let QkvHeads {
        n_head,
        n_kv_head,
        head_dim,
    } = heads;
    let width = heads.width();
    let half = head_dim / 2;
    if width == 0 || !head_dim.is_multiple_of(2) || qkv.len() != positions.len() * width {
        candle_core::bail!(
            "rotate_qkv: {} values for {} rows of {n_head} + 2 x {n_kv_head} heads of {head_dim}",
            qkv.len(),
            positions.len()
        )
    }
    if let Some((cos, sin)) = tables {
        let rows = cos.len() / half.max(1);
        if cos.len() != sin.len() || cos.len() != rows * half {
            candle_core::bail!(
                "rotate_qkv: tables of {} and {} values for heads of {head_dim}",
                cos.len(),
                sin.len()
            )
        }
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= rows) {
            candle_core::bail!("rotate_qkv: position {p} past the tables' {rows}")
        }
    }
    if let Some(n) = norm {
        if n.q.len() != head_dim || n.k.len() != head_dim {
            candle_core::bail!(
                "rotate_qkv: QK-norm gains of {} and {} for heads of {head_dim}",
                n.q.len(),
                n.k.len()
            )
        }
    }
    let rotated = (n_head + n_kv_head) * head_dim;
    let mut out = vec![0f32; qkv.len()];
    for (row, (x, y)) in qkv.chunks_exact(width).zip(out.chunks_exact_mut(width)).enumerate() {
        let angles = tables.map(|(cos, sin)| {
            let at = positions[row] as usize * half;
            (&cos[at..at + half], &sin[at..at + half])
        });
        for (h, (xh, yh)) in x[..rotated]
            .chunks_exact(head_dim)
            .zip(y[..rotated].chunks_exact_mut(head_dim))
            .enumerate()
        {
            head(
                xh,
                yh,
                angles,
                norm.map(|n| (if h < n_head { n.q } else { n.k }, n.eps)),
            );
        }
        y[rotated..].copy_from_slice(&x[rotated..]);
    }
    Ok(out)
}

/// One head `x` into `y`: normalised by `norm` (its gain and epsilon), then rotated by `angles`.
/// Each normalised value is computed where the rotation reads it (the same operations, so the
/// same bits as normalising first).
#[inline(always)]
fn head(x: &[f32], y: &mut [f32], angles: Option<(&[f32], &[f32])>, norm: Option<(&[f32], f32)>) {
    let norm = norm.map(|(gain, eps)| {
        let sum2: f32 = x.iter().map(|&v| v * v).sum();
        (gain, (sum2 / x.len() as f32 + eps).sqrt())
    });
    let value = |i: usize| match norm {
        Some((gain, m)) => x[i] / m * gain[i],
        None => x[i],
    };
    let Some((cos, sin)) = angles else {
        y.iter_mut().enumerate().for_each(|(i, y)| *y = value(i));
        return;
    };
    let half = x.len() / 2;
    for j in 0..half {
        let (x1, x2) = (value(j), value(j + half));
        y[j] = x1 * cos[j] - x2 * sin[j];
        y[j + half] = x1 * sin[j] + x2 * cos[j];
    }
}
