//! Randomness and hashing with fixed definitions, so that a run is the same from its seed on
//! every machine and with every Rust release (`std`'s `DefaultHasher` may change its algorithm,
//! and so may `rand`'s `StdRng`). SplitMix64 (Steele, Lea and Flood, 2014) mixes keys and, run
//! from a key as a counter, gives the i-th number of a stream directly: what dropout masks need,
//! since any element's draw can be computed anywhere, in any order, on any device.

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective mix of 64 bits.
#[inline(always)]
pub const fn mix(z: u64) -> u64 {
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The `i`-th number of the SplitMix64 stream seeded with `key`.
#[inline(always)]
pub const fn nth(key: u64, i: u64) -> u64 {
    mix(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// `nth(key, i)` as a float uniform in [0, 1), from its top 24 bits.
#[inline(always)]
pub fn uniform(key: u64, i: u64) -> f32 {
    (nth(key, i) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// One key from several words (a seed, a step, a stream, ...): order matters.
pub fn key(words: &[u64]) -> u64 {
    words.iter().fold(GOLDEN, |h, &w| mix(h ^ mix(w.wrapping_add(GOLDEN))))
}

/// A 64-bit hash of some bytes (FNV-1a), for content keys such as a token cache's.
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xCBF2_9CE4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_values() {
        // SplitMix64 seeded with 0: its published first outputs.
        assert_eq!(nth(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(nth(0, 1), 0x6E78_9E6A_A1B9_65F4);
        // FNV-1a's published test vectors.
        assert_eq!(hash_bytes(b""), 0xCBF2_9CE4_8422_2325);
        assert_eq!(hash_bytes(b"a"), 0xAF63_DC4C_8601_EC8C);
        // Keys depend on every word and on their order.
        assert_ne!(key(&[1, 2]), key(&[2, 1]));
        assert_ne!(key(&[1, 2]), key(&[1, 2, 0]));
    }

    #[test]
    fn uniform_draws_look_uniform() {
        let n = 100_000;
        let draws: Vec<f32> = (0..n).map(|i| uniform(key(&[7, 3]), i)).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f32>() / n as f32;
        assert!((mean - 0.5).abs() < 0.005, "{mean}");
        let below = draws.iter().filter(|&&u| u < 0.2).count() as f32 / n as f32;
        assert!((below - 0.2).abs() < 0.005, "{below}");
    }
}
