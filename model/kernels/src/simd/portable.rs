//! The portable lanes: plain Rust on arrays of 16 f32, the reference that every other instruction
//! set must match.

use super::{Vec16, LANES};

/// Plain Rust: the reference, and the path of other CPUs.
// SAFETY: every method reads or writes exactly the 16 lanes (64 bytes or fewer) that its
// contract names, with unaligned accesses; no instruction set is needed.
unsafe impl Vec16 for [f32; LANES] {
    const ROWS: usize = 2;
    unsafe fn zero() -> Self {
        [0.0; LANES]
    }
    unsafe fn set1(v: f32) -> Self {
        [v; LANES]
    }
    unsafe fn splat(p: *const f32) -> Self {
        // SAFETY: the trait's contract: the memory at the pointer holds the lanes read or written.
        [unsafe { *p }; LANES]
    }
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        std::array::from_fn(|l| a[l].mul_add(b[l], c[l]))
    }
    unsafe fn load_f32(p: *const u8) -> Self {
        // SAFETY: the trait's contract: the memory at the pointer holds the lanes read or written.
        std::array::from_fn(|l| unsafe { (p as *const f32).add(l).read_unaligned() })
    }
    unsafe fn load_f16(p: *const u8) -> Self {
        // SAFETY: the trait's contract: the memory at the pointer holds the lanes read or written.
        std::array::from_fn(|l| unsafe { (p as *const half::f16).add(l).read_unaligned() }.to_f32())
    }
    unsafe fn load_bf16(p: *const u8) -> Self {
        // SAFETY: the trait's contract: the memory at the pointer holds the lanes read or written.
        std::array::from_fn(|l| unsafe { (p as *const half::bf16).add(l).read_unaligned() }.to_f32())
    }
    unsafe fn store(self, p: *mut f32) {
        // SAFETY: the trait's contract: the memory at the pointer holds the lanes read or written.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr(), p, LANES) }
    }
}
