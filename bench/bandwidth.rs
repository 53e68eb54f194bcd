//! The machine's memory read bandwidth on THREADS threads (default 2): each thread sums its own
//! 512 MiB of f64 with AVX-512 (four independent vector sums, a cache line each; on CPUs without
//! it, AVX2's eight, two a line), best of 5 passes; prints GB/s. Compiled alone by bench/memory_bound.sh (`rustc -O`), the reference
//! against which a decode step's weight reads are set (the memory bound).
use std::arch::x86_64::*;
use std::time::Instant;

/// The sum of `x`'s values, 32 at a time.
///
/// # Safety
/// The CPU must have AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn sum(x: &[f64]) -> f64 {
    let mut acc = [_mm512_setzero_pd(); 4];
    for chunk in x.chunks_exact(32) {
        for (a, line) in acc.iter_mut().zip(0..4) {
            // SAFETY: the chunk holds 32 values, 8 a line.
            *a = _mm512_add_pd(*a, unsafe { _mm512_loadu_pd(chunk.as_ptr().add(8 * line)) });
        }
    }
    let total = _mm512_add_pd(_mm512_add_pd(acc[0], acc[1]), _mm512_add_pd(acc[2], acc[3]));
    _mm512_reduce_add_pd(total)
}

/// [`sum`] with AVX2: eight vector sums, two to a cache line.
///
/// # Safety
/// The CPU must have AVX.
#[target_feature(enable = "avx")]
unsafe fn sum_avx2(x: &[f64]) -> f64 {
    let mut acc = [_mm256_setzero_pd(); 8];
    for chunk in x.chunks_exact(32) {
        for (a, half) in acc.iter_mut().zip(0..8) {
            // SAFETY: the chunk holds 32 values, 4 a half line.
            *a = _mm256_add_pd(*a, unsafe { _mm256_loadu_pd(chunk.as_ptr().add(4 * half)) });
        }
    }
    let mut lanes = [0f64; 4];
    let total = acc.iter().fold(_mm256_setzero_pd(), |t, a| _mm256_add_pd(t, *a));
    // SAFETY: four values.
    unsafe { _mm256_storeu_pd(lanes.as_mut_ptr(), total) };
    lanes.iter().sum()
}

fn main() {
    let avx512 = std::is_x86_feature_detected!("avx512f");
    assert!(avx512 || std::is_x86_feature_detected!("avx"), "this reader needs AVX-512F or AVX");
    let threads: usize = std::env::var("THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
    let words = 512 << 20 >> 3;
    let buffers: Vec<Vec<f64>> = (0..threads).map(|t| vec![1.0 + t as f64; words]).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let start = Instant::now();
        let total: f64 = std::thread::scope(|s| {
            let handles: Vec<_> = buffers
                .iter()
                // SAFETY: AVX-512F or AVX checked above.
                .map(|b| s.spawn(move || unsafe { if avx512 { sum(b) } else { sum_avx2(b) } }))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        let gbs = (threads * words * 8) as f64 / start.elapsed().as_secs_f64() / 1e9;
        std::hint::black_box(total);
        best = best.max(gbs);
    }
    println!("{{\"threads\": {threads}, \"read_gb_per_s\": {best:.2}}}");
}
