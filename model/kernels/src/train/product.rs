//! Training's matrix products on the CPU, `a @ B^T` for operands read where they are (any
//! layout: a transposed view is not copied first), in f32 on the packed kernel
//! ([`PackedMatrix`]) or rounded to bf16 under autocast ([`crate::train::bf16`]).

use std::mem::MaybeUninit;

use candle_core::Result;

use crate::packed::{matmul_rows_in_place, InPlace, PackedMatrix};
use crate::simd::Simd;
use crate::train::bf16::{Bf16Dot, Bf16Panels, Bf16Rows};
pub use crate::train::operand::Operand;

/// The matrix products of training (projections, LM head; the attention's own products stay
/// f32 on the CPU) in f32, or as `torch.autocast(dtype=torch.bfloat16)`: f32 operands rounded to
/// bf16, multiplied, the products summed in f32 and returned in f32; parameters, gradients,
/// LayerNorm, softmax, GELU and the loss stay f32. A setting of the model
/// ([`crate::Gpt::with_autocast`]); `gpt-train --dtype bf16` sets it. (No f16: without loss
/// scaling its gradients underflow.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Autocast {
    #[default]
    Off,
    Bf16,
}

/// The right-hand operand `B` `(n, k)` of `a @ B^T`, packed once for several products (the LM
/// head's weight, for every chunk of rows).
pub enum Rhs {
    F32(PackedMatrix),
    Bf16(Bf16Panels),
}

impl Rhs {
    pub fn new(b: Operand, autocast: Autocast) -> Self {
        match autocast {
            Autocast::Off => Self::F32(PackedMatrix::from_strided_f32(
                b.data,
                b.offset,
                (b.rows, b.cols),
                b.stride,
            )),
            Autocast::Bf16 => Self::Bf16(Bf16Panels::new(b, Bf16Dot::detect())),
        }
    }

    /// `a @ B^T`, `(a.rows, n)` in f32.
    pub fn matmul(&self, a: Operand) -> Result<Vec<f32>> {
        // SAFETY: `matmul_into` writes every value of `y` when it returns `Ok`.
        unsafe { written(a.rows * self.n(), |y| self.matmul_into(a, y)) }
    }

    /// `a @ B^T` written into `y` `(a.rows, n)`, which may start uninitialised.
    pub fn matmul_into(&self, a: Operand, y: &mut [MaybeUninit<f32>]) -> Result<()> {
        match self {
            Self::F32(w) => f32_product(Right::Packed(w), a, y, false),
            Self::Bf16(w) => w.matmul_into(&Bf16Rows::new(a, w.dot()), y),
        }
    }

    /// The rows of `B` (the product's columns).
    pub fn n(&self) -> usize {
        match self {
            Self::F32(w) => w.dims().0,
            Self::Bf16(w) => w.dims().0,
        }
    }

    /// `y += a @ B^T` for `y` `(a.rows, n)`: each output's chain continues from its value (sums
    /// over chunks of `k` in one buffer).
    pub fn matmul_add(&self, a: Operand, y: &mut [f32]) -> Result<()> {
        match self {
            Self::F32(w) => {
                // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; every value is initialised and
                // stays so.
                let y = unsafe { &mut *(y as *mut [f32] as *mut [MaybeUninit<f32>]) };
                f32_product(Right::Packed(w), a, y, true)
            }
            Self::Bf16(w) => w.matmul_add(&Bf16Rows::new(a, w.dot()), y),
        }
    }
}

/// The right operand of [`f32_product`]: packed, or read in place ([`Operand::rows_in_place`]).
enum Right<'a> {
    Packed(&'a PackedMatrix),
    Rows(Operand<'a>, &'a [f32], usize),
}

/// Whether the kernel on `simd` reads an operand in place where it has to step across rows or
/// columns (a transposed left operand, a right operand from its row-major transpose) rather than
/// from a row-major copy or packed panels: each value read so serves one register tile's rows, 12
/// on AVX-512 and 6 on AVX2 (2 when this was measured). In place paid on AVX-512 (GPT-2 small's f32
/// step 5% faster with the transposed left operands, nanoGPT's CPU recipe's `x @ W` 4-16% with the
/// right ones; EPYC-Zen4).
/// On AVX2 it cost half the rate (EPYC, Zen 3, one thread, `DTYPE=f32 [SHAPE=recipe] cargo bench
/// -p gpt --bench train_products`): GPT-2 small's weight gradients `dW = dY^T x` ran at 31-43
/// GFLOP/s against 67-79 from the copy, and the recipe's products took 70 ms a step against 49
/// with the right operands packed.
fn reads_in_place(simd: Simd) -> bool {
    simd.tile_rows() >= 8
}

/// `y = a @ W^T`, or with `accumulate` `y += a @ W^T`, on the f32 kernel: `a` read where it is
/// when the kernel can and it pays on this CPU's tile ([`reads_in_place`]), else from
/// its row-major copy; the same bits either way.
fn f32_product(w: Right, a: Operand, y: &mut [MaybeUninit<f32>], accumulate: bool) -> Result<()> {
    f32_product_on(Simd::detect(), w, a, y, accumulate)
}

/// [`f32_product`] on the instruction set `simd` (tests run each the host has).
fn f32_product_on(simd: Simd, w: Right, a: Operand, y: &mut [MaybeUninit<f32>], accumulate: bool) -> Result<()> {
    let copy;
    let in_place = a.in_place().filter(|x| !x.transposed || reads_in_place(simd));
    let x = match in_place {
        Some(x) => x,
        None => {
            copy = a.row_major();
            InPlace {
                values: &copy,
                ldx: a.cols,
                transposed: false,
            }
        }
    };
    match w {
        Right::Packed(w) => w.matmul_in_place(x, a.rows, simd, y, accumulate),
        Right::Rows(b, values, ld) => {
            if a.cols != b.cols {
                candle_core::bail!("product: a is ({}, {}), B ({}, {})", a.rows, a.cols, b.rows, b.cols)
            }
            matmul_rows_in_place(values, ld, (b.cols, b.rows), x, a.rows, simd, y, accumulate)
        }
    }
}

/// `a @ B^T` written into `y` `(a.rows, b.rows)` (which may start uninitialised), at
/// `autocast`'s precision. In f32, a `B` whose transpose is row-major and small is read in
/// place, unpacked, where that pays on this CPU ([`reads_in_place`]: on AVX-512 each weight of
/// nanoGPT's CPU recipe was packed at every product, ~5% of its step with the activations'
/// gradients packed for `dW`); the same bits either way.
pub fn product_into(a: Operand, b: Operand, autocast: Autocast, y: &mut [MaybeUninit<f32>]) -> Result<()> {
    let simd = Simd::detect();
    match (autocast, b.rows_in_place()) {
        (Autocast::Off, Some((values, ld))) if reads_in_place(simd) => {
            f32_product_on(simd, Right::Rows(b, values, ld), a, y, false)
        }
        _ => Rhs::new(b, autocast).matmul_into(a, y),
    }
}

/// `a @ B^T` `(a.rows, b.rows)` in f32, at `autocast`'s precision (see [`product_into`]).
pub fn product(a: Operand, b: Operand, autocast: Autocast) -> Result<Vec<f32>> {
    // SAFETY: `product_into` writes every value of `y` when it returns `Ok`.
    unsafe { written(a.rows * b.rows, |y| product_into(a, b, autocast, y)) }
}

/// `len` values written by `write` into a buffer not zeroed first.
///
/// # Safety
/// `write` writes every one of the `len` values when it returns `Ok`.
unsafe fn written(len: usize, write: impl FnOnce(&mut [MaybeUninit<f32>]) -> Result<()>) -> Result<Vec<f32>> {
    let mut y = Vec::with_capacity(len);
    write(&mut y.spare_capacity_mut()[..len])?;
    // SAFETY: the caller's contract: all `len` values are written.
    unsafe { y.set_len(len) };
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` values in [-2, 2), varied.
    fn values(len: usize) -> Vec<f32> {
        (0..len).map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 250.0).collect()
    }

    /// `(m, k)` left operands in `data` from an offset, rows further apart than their length:
    /// row-major, and column-major (a transposed view).
    fn left_operands(data: &[f32], m: usize, k: usize) -> [Operand<'_>; 2] {
        let ld = k.max(m) + 3;
        [(ld, 1), (1, ld)].map(|stride| Operand {
            data,
            offset: 11,
            rows: m,
            cols: k,
            stride,
        })
    }

    /// [`f32_product_on`] into `y`: written over, or added to with `accumulate`.
    fn product_on(simd: Simd, w: Right, a: Operand, mut y: Vec<f32>, accumulate: bool) -> Result<Vec<f32>> {
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; every value is initialised and stays so.
        let out = unsafe { &mut *(y.as_mut_slice() as *mut [f32] as *mut [MaybeUninit<f32>]) };
        f32_product_on(simd, w, a, out, accumulate)?;
        Ok(y)
    }

    fn same(x: &[f32], y: &[f32]) -> bool {
        x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
    }

    /// The left operand read in place (rows further apart than their length, or a transposed
    /// view, after an offset; or from its row-major copy where the tile is too short to read
    /// columns) gives, written and added to, the bits of one chain of multiply-adds per output in
    /// ascending `k`, on every instruction set this CPU runs: sizes with partial tiles, partial
    /// panels, one row, and `k` past the kernel's chunk; the last in blocks of rows and columns
    /// (three blocks of rows, 120, 120 and 20; two of columns, three tasks and one).
    #[test]
    fn the_left_operand_read_in_place_gives_the_bits_of_one_chain_per_output() -> Result<()> {
        let data = values(400_000);
        for (m, k, n) in [(1, 5, 3), (7, 130, 33), (30, 200, 70), (64, 257, 40), (260, 520, 100)] {
            let b = Operand::rows(&data[300_000..], n, k);
            let Rhs::F32(packed) = Rhs::new(b, Autocast::Off) else {
                unreachable!("f32 panels")
            };
            for a in left_operands(&data, m, k) {
                assert!(a.in_place().is_some());
                let chain =
                    |i: usize, j: usize, start: f32| (0..k).fold(start, |acc, c| a.at(i, c).mul_add(b.at(j, c), acc));
                let want: Vec<f32> = (0..m).flat_map(|i| (0..n).map(move |j| chain(i, j, 0.0))).collect();
                let first = &want;
                let want_added: Vec<f32> = (0..m)
                    .flat_map(|i| (0..n).map(move |j| chain(i, j, first[i * n + j])))
                    .collect();
                for &simd in Simd::available() {
                    let got = product_on(simd, Right::Packed(&packed), a, vec![f32::NAN; m * n], false)?;
                    assert!(same(&got, &want), "{simd:?} {m}x{k}x{n} stride {:?}", a.stride);
                    let added = product_on(simd, Right::Packed(&packed), a, want.clone(), true)?;
                    assert!(
                        same(&added, &want_added),
                        "{simd:?} {m}x{k}x{n} stride {:?}, added",
                        a.stride
                    );
                }
            }
        }
        Ok(())
    }

    /// A right operand read in place from its row-major transpose (rows further apart than
    /// their length, after an offset) gives the bits of the same operand packed, written and
    /// added to, with the left operand row-major and transposed; shapes the kernel cannot read
    /// so are packed instead, and bad bounds are an error.
    #[test]
    fn the_right_operand_read_in_place_gives_the_bits_of_it_packed() -> Result<()> {
        let data = values(300_000);
        for (m, k, n) in [
            (1, 5, 32),
            (7, 130, 64),
            (20, 40, 32),
            (30, 200, 96),
            (64, 257, 32),
            (25, 3, 128),
        ] {
            let ldb = n + 5;
            let b = Operand {
                data: &data,
                offset: 100_003,
                rows: n,
                cols: k,
                stride: (1, ldb),
            };
            assert!(b.rows_in_place().is_some(), "{m}x{k}x{n}");
            for a in left_operands(&data, m, k) {
                let packed = Rhs::new(b, Autocast::Off);
                let want = packed.matmul(a)?;
                let got = product(a, b, Autocast::Off)?;
                assert!(same(&got, &want), "{m}x{k}x{n} stride {:?}", a.stride);
                let (added, mut want_added) = (want.clone(), want.clone());
                packed.matmul_add(a, &mut want_added)?;
                let (values, ldb) = b.rows_in_place().expect("in place");
                let added = product_on(Simd::detect(), Right::Rows(b, values, ldb), a, added, true)?;
                assert!(same(&added, &want_added), "{m}x{k}x{n} stride {:?}, added", a.stride);
                // Read in place on every instruction set this CPU runs, whether or not `product`
                // reads it so there.
                for &simd in Simd::available() {
                    let got = product_on(simd, Right::Rows(b, values, ldb), a, vec![f32::NAN; m * n], false)?;
                    assert!(same(&got, &want), "{simd:?} {m}x{k}x{n} stride {:?}", a.stride);
                }
            }
        }
        // Columns not a whole task, or a row-major B: packed.
        let b = Operand::columns(&data, 33, 10);
        assert!(b.rows_in_place().is_none());
        assert!(Operand::rows(&data, 32, 10).rows_in_place().is_none());
        // B's rows past the data: an error naming the shapes.
        let short = Operand::columns(&data[..100], 32, 10);
        let a = Operand::rows(&data, 4, 10);
        let mut y = vec![MaybeUninit::new(0f32); 4 * 32];
        let (values, ldb) = short.rows_in_place().expect("in place");
        let err = f32_product(Right::Rows(short, values, ldb), a, &mut y, false)
            .expect_err("B is past its data")
            .to_string();
        assert!(err.contains("B (10, 32)"), "{err}");
        Ok(())
    }

    /// Row-major copies of strided operands (a transposed view, with an offset and a row stride
    /// wider than the matrix, in sizes that leave partial blocks) hold every value where `at`
    /// reads it, on the pool and on one thread.
    #[test]
    fn row_major_copies_every_value_of_a_strided_operand() {
        let data: Vec<f32> = (0..200_000).map(|i| i as f32).collect();
        for (rows, cols, ld, offset) in [(37, 53, 41, 5), (16, 16, 16, 0), (1, 70, 3, 2), (300, 120, 310, 7)] {
            for stride in [(1, ld), (ld * 2, 3)] {
                let a = Operand {
                    data: &data,
                    offset,
                    rows,
                    cols,
                    stride,
                };
                let want: Vec<f32> = (0..rows).flat_map(|r| (0..cols).map(move |c| a.at(r, c))).collect();
                assert_eq!(*a.row_major(), want[..], "{rows}x{cols} stride {stride:?}");
                let serial = crate::parallel::serially(|| a.row_major().into_owned());
                assert_eq!(serial, want, "{rows}x{cols} stride {stride:?}, one thread");
            }
        }
    }
}
