//! The tile products of `hardware` in plain Rust, on any CPU: the same operands in the same
//! layout, each product as Intel's definition of `tdpbf16ps` writes it (per output, for each pair
//! of positions along `k` in order, `c += a[2p] * b[2p]`, then `c += a[2p + 1] * b[2p + 1]`, in
//! f32: the products of two bf16 are exact in f32). So the layout, the split into halves and the
//! order of the products are checked on machines without AMX.

use super::{Operands, KB, LANES, TILE_BYTES, TILE_ROWS};

/// `acc[tile] (16 x 16) += a (16 rows x 32 bf16) · b (16 pairs x 16 columns x 2 bf16)`.
///
/// # Safety
/// `a` and `b` hold a tile each, `acc` 256 f32.
unsafe fn product(acc: *mut f32, a: *const u16, b: *const u16) {
    let widen = |h: u16| f32::from_bits((h as u32) << 16);
    for i in 0..TILE_ROWS {
        for j in 0..LANES {
            // SAFETY: i, j < 16 and the pair index below 16: within the tiles (the caller's).
            unsafe {
                let c = acc.add(i * LANES + j);
                let mut v = *c;
                for p in 0..KB / 2 {
                    let (a0, a1) = (*a.add(i * KB + 2 * p), *a.add(i * KB + 2 * p + 1));
                    let (b0, b1) = (*b.add((p * LANES + j) * 2), *b.add((p * LANES + j) * 2 + 1));
                    v += widen(a0) * widen(b0);
                    v += widen(a1) * widen(b1);
                }
                *c = v;
            }
        }
    }
}

/// `super::hardware::block` (`per_block` 2: `hi·lo`, `hi·hi`, `lo·hi` per block) or
/// `super::hardware::block_bf16` (1: `hi·w`, `lo·w`), with the same operands and output.
///
/// # Safety
/// As `super::hardware::block`, without the tile configuration.
pub(super) unsafe fn block(a: &Operands, two: bool, per_block: usize, acc: *mut f32) {
    let lb = a.blocks * 2 * TILE_BYTES;
    // SAFETY: `acc` holds four tiles (the caller's contract).
    unsafe { std::ptr::write_bytes(acc, 0, 4 * TILE_ROWS * LANES) };
    for kb in 0..a.blocks {
        for half in 0..if two { 2 } else { 1 } {
            // SAFETY: the block's activation tiles of this row half and weight tiles of the
            // two panels lie within the operands (the caller's contract).
            unsafe {
                let ah = a.a.add(kb * 2 * TILE_BYTES + half * lb) as *const u16;
                let al = ah.add(TILE_BYTES / 2);
                for panel in 0..2 {
                    let w = a.b.add(panel * a.panel_bytes + kb * per_block * TILE_BYTES) as *const u16;
                    let c = acc.add((half * 2 + panel) * TILE_ROWS * LANES);
                    if per_block == 2 {
                        let wl = w.add(TILE_BYTES / 2);
                        product(c, ah, wl);
                        product(c, ah, w);
                        product(c, al, w);
                    } else {
                        product(c, ah, w);
                        product(c, al, w);
                    }
                }
            }
        }
    }
}
