//! A matrix operand of training's products read where it is, in any 2-D layout (a transposed
//! view is not copied first), and how the packed kernel can read it so.

use candle_core::{CpuStorage, Layout, Result};

use crate::packed::InPlace;

/// The largest right operand (values) that the kernel reads in place from its row-major
/// transpose rather than packing it ([`Operand::rows_in_place`]): a task's positions are a row
/// apart, which pays while they stay in cache. At nanoGPT's CPU recipe's sizes (a shard's 384
/// rows, 128 wide) `x @ W` ran 4-16% faster so and `dW = x^T dY` 13-28% (its step ~3%); at
/// GPT-2 small's, `x @ W` of the `(3072, 768)` projection was 30% slower (the others within 10%),
/// and with the product in blocks the step still 8% slower (all on AVX-512, EPYC-Zen4; on
/// AVX2's short tiles it does not pay at any size: `train::product`'s `reads_in_place`).
const IN_PLACE_RIGHT_MAX: usize = 1 << 18;

/// A 2-D f32 matrix read in place: element `(r, c)` at `data[offset + r * stride.0 + c * stride.1]`.
#[derive(Debug, Clone, Copy)]
pub struct Operand<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub stride: (usize, usize),
}

impl<'a> Operand<'a> {
    /// `(rows, cols)` row-major in `data`.
    pub fn rows(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            offset: 0,
            rows,
            cols,
            stride: (cols, 1),
        }
    }

    /// `(rows, cols)` whose transpose `(cols, rows)` is row-major in `data`.
    pub fn columns(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self {
            data,
            offset: 0,
            rows,
            cols,
            stride: (1, rows),
        }
    }

    /// A 2-D f32 CPU tensor's storage as it is laid out.
    pub fn of(storage: &'a CpuStorage, layout: &Layout) -> Result<Self> {
        let (rows, cols) = layout.shape().dims2()?;
        let stride = layout.stride();
        Ok(Self {
            data: storage.as_slice::<f32>()?,
            offset: layout.start_offset(),
            rows,
            cols,
            stride: (stride[0], stride[1]),
        })
    }

    /// The transposed matrix, the same memory.
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            stride: (self.stride.1, self.stride.0),
            ..self
        }
    }

    #[inline(always)]
    pub fn at(&self, r: usize, c: usize) -> f32 {
        self.data[self.offset + r * self.stride.0 + c * self.stride.1]
    }

    /// How the packed kernel reads the matrix where it is, if it can: unit stride along one
    /// dimension. A column-major matrix is read so at any size: a tile's reads go across its
    /// columns, a cache line each, which pays while they stay in a core's L2, and the product's
    /// blocks of rows ([`crate::parallel::ProductBlocks`]) keep them there (GPT-2 small's f32
    /// step 5% faster than with a row-major copy of those over 1 MiB: `dW = dY^T x`'s `dY^T`).
    pub(crate) fn in_place(&self) -> Option<InPlace<'a>> {
        let values = &self.data[self.offset.min(self.data.len())..];
        if self.stride.1 == 1 || self.cols <= 1 {
            let ldx = if self.rows <= 1 { self.cols } else { self.stride.0 };
            Some(InPlace {
                values,
                ldx,
                transposed: false,
            })
        } else if self.stride.0 == 1 || self.rows <= 1 {
            Some(InPlace {
                values,
                ldx: self.stride.1,
                transposed: true,
            })
        } else {
            None
        }
    }

    /// As the right operand `B` `(n, k)` of `a @ B^T`: its transpose `(k, n)`, row-major with
    /// rows `ld` apart (`B` a transposed view: the weight of `x @ W`, `dY` of `dW = x^T dY`),
    /// that the kernel reads in place, unpacked, if `n` is whole tasks (32 columns) and the
    /// operand at most [`IN_PLACE_RIGHT_MAX`] values: `(values from the first, ld)`.
    pub(crate) fn rows_in_place(&self) -> Option<(&'a [f32], usize)> {
        let (n, k) = (self.rows, self.cols);
        let ld = self.stride.1;
        (self.stride.0 == 1
            && k > 0
            && n > 0
            && n.is_multiple_of(32)
            && ld >= n
            && n * k <= IN_PLACE_RIGHT_MAX
            && self.offset <= self.data.len())
        .then(|| (&self.data[self.offset..], ld))
    }

    /// The values row-major: borrowed where they already are, else copied (a transposed
    /// source in cache-sized blocks).
    pub fn row_major(&self) -> std::borrow::Cow<'a, [f32]> {
        let len = self.rows * self.cols;
        if self.stride.1 == 1 && (self.stride.0 == self.cols || self.rows <= 1) {
            return std::borrow::Cow::Borrowed(&self.data[self.offset..self.offset + len]);
        }
        const B: usize = 32;
        let cols = self.cols.max(1);
        // Blocks of B rows over the pool (the LM head's gradient copies 6.4M values a chunk).
        let out = crate::parallel::collect(
            len,
            B * cols,
            #[inline(always)]
            |start, out| {
                let (r0, rows) = (start / cols, out.len() / cols);
                if self.stride.0 == 1 {
                    return self.transpose_into(r0, rows, out);
                }
                for rb in (0..rows).step_by(B) {
                    for c0 in (0..cols).step_by(B) {
                        for r in rb..(rb + B).min(rows) {
                            for c in c0..(c0 + B).min(cols) {
                                out[r * cols + c].write(self.at(r0 + r, c));
                            }
                        }
                    }
                }
            },
        );
        std::borrow::Cow::Owned(out)
    }

    /// Rows `r0..r0 + rows` of a column-major operand (`stride.0 == 1`) into `out`, row-major
    /// ([`crate::simd::transpose`]: its columns are rows of `ld` apart).
    #[inline(always)]
    fn transpose_into(&self, r0: usize, rows: usize, out: &mut [std::mem::MaybeUninit<f32>]) {
        let (cols, ld) = (self.cols, self.stride.1);
        if rows == 0 || cols == 0 {
            return;
        }
        let first = self.offset + r0;
        let columns = &self.data[first..first + (cols - 1) * ld + rows];
        let out = &mut out[..rows * cols];
        // SAFETY: `columns` holds `cols` columns of `rows` values `ld` apart, `out` `rows` rows of
        // `cols` (`MaybeUninit<f32>` has `f32`'s layout); distinct buffers.
        unsafe {
            let to = out.as_mut_ptr() as *mut f32;
            crate::simd::transpose(crate::simd::Simd::detect(), columns.as_ptr(), ld, to, cols, cols, rows)
        }
    }
}
