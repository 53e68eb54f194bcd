//! What the kernel benches share: their sizes from the environment and a median timer.

// Each bench uses a part of this module.
#![allow(dead_code)]

use std::time::Instant;

/// The comma-separated sizes in environment variable `name`, or `default`'s.
pub fn sizes(name: &str, default: &str) -> anyhow::Result<Vec<usize>> {
    let list = std::env::var(name).unwrap_or_else(|_| default.into());
    list.split(',')
        .map(|s| {
            s.trim()
                .parse()
                .map_err(|e| anyhow::anyhow!("{name}: {s:?} is not a size: {e}"))
        })
        .collect()
}

/// The median of `repeats` timed calls of `f`, in seconds, after one untimed call.
pub fn median_secs<F: FnMut() -> anyhow::Result<()>>(repeats: usize, mut f: F) -> anyhow::Result<f64> {
    f()?;
    let mut t = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

/// The fastest of `repeats` timed calls of `f`, in seconds (for bandwidth: the least disturbed).
pub fn best_secs<F: FnMut() -> anyhow::Result<()>>(repeats: usize, mut f: F) -> anyhow::Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..repeats {
        let s = Instant::now();
        f()?;
        best = best.min(s.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Bytes a weight takes in `format`, from candle's sizes (a quantized block's bytes per weight).
pub fn bytes_per_weight(format: gpt::WeightFormat) -> f64 {
    match format.ggml() {
        Some(block) => block.type_size() as f64 / block.block_size() as f64,
        None => format.dtype().size_in_bytes() as f64,
    }
}
