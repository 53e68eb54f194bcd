//! How a [`PackedMatrix`] lays out its weights: packing from a dense tensor or candle's GGML
//! blocks into panels of 16 columns, and reading them back.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Result, Tensor};
use half::{bf16, f16};

use super::*;

impl PackedMatrix {
    /// `w` `(n, k)` (any dtype and device) in `format`; quantized formats quantize with candle's
    /// GGML code and need `k` a multiple of 32.
    pub fn from_dense(w: &Tensor, format: WeightFormat) -> Result<Self> {
        let (n, k) = w.dims2()?;
        let w = w.to_device(&Device::Cpu)?.to_dtype(DType::F32)?.contiguous()?;
        if let Some(ggml) = format.ggml() {
            if !k.is_multiple_of(BLOCK) {
                candle_core::bail!("{format} needs rows of a multiple of {BLOCK} values, these have {k}")
            }
            return Self::from_qtensor(&QTensor::quantize(&w, ggml)?);
        }
        let values = w.flatten_all()?.to_vec1::<f32>()?;
        let mut packed = Self::zeros(format, n, k);
        let (size, panel) = (format_bytes(format), panel_bytes(format, k));
        let bytes = packed.bytes_mut();
        for (r, row) in values.chunks_exact(k.max(1)).enumerate().take(n) {
            let start = r / LANES * panel + r % LANES * size;
            for (c, &v) in row.iter().enumerate() {
                let at = start + c * LANES * size;
                match format {
                    WeightFormat::F16 => bytes[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes()),
                    WeightFormat::Bf16 => bytes[at..at + 2].copy_from_slice(&bf16::from_f32(v).to_le_bytes()),
                    _ => bytes[at..at + 4].copy_from_slice(&v.to_le_bytes()),
                }
            }
        }
        Ok(packed)
    }

    /// f32 weights `W` `(n, k)` read from `data` at `offset + r * strides.0 + c * strides.1`
    /// (any layout: a transposed view packs without a copy first). Training packs its weights
    /// and activations this way at every product, so it is one pass over the values.
    pub(crate) fn from_strided_f32(
        data: &[f32],
        offset: usize,
        (n, k): (usize, usize),
        strides: (usize, usize),
    ) -> Self {
        let panels = n.div_ceil(LANES * GROUP) * GROUP;
        // f32 values, a whole number of lines (64 bytes = 16). Every value is written below,
        // padding included, so the lines start uninitialised (zeroing them first was a pass of
        // its own, at every training product).
        let len = panels * k * LANES;
        let mut lines: Vec<Line> = Vec::with_capacity(len / LANES);
        let out = lines.spare_capacity_mut();
        // SAFETY: `Line` is 64-byte aligned plain bytes, valid as 16 f32 each; the slice covers
        // exactly the spare capacity, written as f32 only.
        let out = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut MaybeUninit<f32>, len) };
        // Panel by panel (spread over the pool: training packs its weights at every product),
        // position by position, the panel's 16 rows: 16 sequential streams from a row-major
        // source, one contiguous run of 16 from a transposed one.
        let panel = (k * LANES).max(1);
        let simd = crate::simd::Simd::detect();
        let per_chunk = (crate::parallel::GRAIN / panel).max(1);
        crate::parallel::chunks_mut(
            out,
            per_chunk * panel,
            #[inline(always)]
            |start, out| {
                for (i, out) in out.chunks_exact_mut(panel).enumerate() {
                    let p = start / panel + i;
                    let rows = n.saturating_sub(p * LANES).min(LANES);
                    let base = offset + p * LANES * strides.0;
                    // A row-major source: the panel's rows transposed into its positions
                    // (`simd::transpose`; value by value, ~4.7 GB/s), its padding lanes zeroed
                    // below.
                    let row_major = strides.1 == 1 && rows > 0 && k > 0;
                    if row_major {
                        let panel_rows = &data[base..base + (rows - 1) * strides.0 + k];
                        // SAFETY: `panel_rows` holds the panel's `rows` rows of `k` values,
                        // `strides.0` apart; `out` is the panel's `k` positions of 16 lanes
                        // (`MaybeUninit<f32>` has `f32`'s layout), a new buffer.
                        unsafe {
                            let to = out.as_mut_ptr() as *mut f32;
                            crate::simd::transpose(simd, panel_rows.as_ptr(), strides.0, to, LANES, rows, k)
                        };
                    }
                    for (c, lanes) in out.chunks_exact_mut(LANES).enumerate() {
                        let at = base + c * strides.1;
                        let (values, padding) = lanes.split_at_mut(rows);
                        if rows == 0 || row_major {
                            // A padding panel (zeros only), or values written above.
                        } else if strides.0 == 1 {
                            // A transposed source: the panel's 16 rows are adjacent, one copy
                            // (value by value, ~5 GB/s).
                            let from = &data[at..at + rows];
                            // SAFETY: `MaybeUninit<f32>` has `f32`'s layout; `values` and
                            // `from` are `rows` long and do not overlap (`out` is new).
                            unsafe {
                                std::ptr::copy_nonoverlapping(from.as_ptr(), values.as_mut_ptr() as *mut f32, rows)
                            };
                        } else {
                            for (lane, v) in values.iter_mut().enumerate() {
                                v.write(data[at + lane * strides.0]);
                            }
                        }
                        for v in padding {
                            v.write(0.0);
                        }
                    }
                }
            },
        );
        // SAFETY: all `len / 16` lines written above.
        unsafe { lines.set_len(len / LANES) };
        Self {
            format: WeightFormat::F32,
            n,
            k,
            lines,
            amx: None,
        }
    }

    /// A GGML tensor `(n, k)` in f32, f16, bf16, q8_0 or q4_0; quantized blocks are moved as
    /// they are.
    pub fn from_qtensor(q: &QTensor) -> Result<Self> {
        let Some(format) = WeightFormat::from_ggml(q.dtype()) else {
            candle_core::bail!(
                "weights in {:?} are not supported: use f32, f16, bf16, q8_0 or q4_0",
                q.dtype()
            )
        };
        let (n, k) = q.shape().dims2()?;
        if format.ggml().is_none() {
            return Self::from_dense(&q.dequantize(&Device::Cpu)?, format);
        }
        let data = q.data()?;
        let (block_bytes, codes) = (q.dtype().type_size(), code_bytes(format));
        let blocks = k / BLOCK;
        if data.len() != n * blocks * block_bytes {
            candle_core::bail!(
                "{format} tensor ({n}, {k}) holds {} bytes, expected {}",
                data.len(),
                n * blocks * block_bytes
            )
        }
        let mut packed = Self::zeros(format, n, k);
        for r in 0..n {
            for b in 0..blocks {
                let src = &data[(r * blocks + b) * block_bytes..][..block_bytes];
                let at = packed.block_start(r, b);
                let lane = r % LANES;
                let bytes = packed.bytes_mut();
                // GGML's block: the f16 scale, then the codes (`codes / 16` bytes per row).
                for (t, &code) in src[2..].iter().enumerate() {
                    bytes[at + int8::code_offset(t, lane)] = code;
                }
                bytes[at + codes + 2 * lane..][..2].copy_from_slice(&src[..2]);
            }
        }
        Ok(packed)
    }

    /// The GGML tensor of the same weights (quantized blocks moved back as they are).
    pub fn to_qtensor(&self) -> Result<QTensor> {
        let Some(ggml) = self.format.ggml() else {
            let dense = match self.format {
                WeightFormat::F16 => GgmlDType::F16,
                WeightFormat::Bf16 => GgmlDType::BF16,
                _ => GgmlDType::F32,
            };
            return QTensor::quantize(&self.dense()?, dense);
        };
        let (n, k, blocks, codes) = (self.n, self.k, self.k / BLOCK, code_bytes(self.format));
        let block_bytes = ggml.type_size();
        let mut data = vec![0u8; n * blocks * block_bytes];
        let bytes = self.bytes();
        for r in 0..n {
            for b in 0..blocks {
                let dst = &mut data[(r * blocks + b) * block_bytes..][..block_bytes];
                let at = self.block_start(r, b);
                let lane = r % LANES;
                dst[..2].copy_from_slice(&bytes[at + codes + 2 * lane..][..2]);
                for (t, code) in dst[2..].iter_mut().enumerate() {
                    *code = bytes[at + int8::code_offset(t, lane)];
                }
            }
        }
        candle_core::quantized::ggml_file::qtensor_from_ggml(ggml, &data, vec![n, k], &Device::Cpu)
    }

    pub(super) fn zeros(format: WeightFormat, n: usize, k: usize) -> Self {
        let panels = n.div_ceil(LANES * GROUP) * GROUP;
        let bytes = panels * panel_bytes(format, k);
        Self {
            format,
            n,
            k,
            lines: vec![Line([0; 64]); bytes.div_ceil(64)],
            amx: None,
        }
    }

    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is plain bytes with no padding.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const u8, self.lines.len() * 64) }
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut u8, self.lines.len() * 64) }
    }

    /// Byte offset of row `r`'s panel.
    pub(super) fn panel_start(&self, r: usize) -> usize {
        r / LANES * panel_bytes(self.format, self.k)
    }

    /// Byte offset of block `b` of row `r`'s panel (quantized formats).
    pub(super) fn block_start(&self, r: usize, b: usize) -> usize {
        self.panel_start(r) + b * (code_bytes(self.format) + 2 * LANES)
    }

    /// `W[r, c]` in f32.
    pub(super) fn value(&self, r: usize, c: usize) -> f32 {
        let (bytes, lane) = (self.bytes(), r % LANES);
        let read2 = |at: usize| [bytes[at], bytes[at + 1]];
        match self.format {
            WeightFormat::F32 => {
                let at = self.panel_start(r) + (c * LANES + lane) * 4;
                f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
            }
            WeightFormat::F16 => f16::from_le_bytes(read2(self.panel_start(r) + (c * LANES + lane) * 2)).to_f32(),
            WeightFormat::Bf16 => bf16::from_le_bytes(read2(self.panel_start(r) + (c * LANES + lane) * 2)).to_f32(),
            WeightFormat::Q8_0 | WeightFormat::Q4_0 => {
                let at = self.block_start(r, c / BLOCK);
                let codes = code_bytes(self.format);
                let scale = f16::from_le_bytes(read2(at + codes + 2 * lane)).to_f32();
                let j = c % BLOCK;
                let q = if self.format == WeightFormat::Q8_0 {
                    bytes[at + int8::code_offset(j, lane)] as i8 as f32
                } else {
                    // GGML's pairs: byte `t` holds positions `t` (low) and `t + 16` (high).
                    let byte = bytes[at + int8::code_offset(j % 16, lane)];
                    (if j < 16 { byte & 15 } else { byte >> 4 }) as f32 - 8.0
                };
                q * scale
            }
        }
    }
}

/// Bytes of one dense weight.
pub(super) fn format_bytes(format: WeightFormat) -> usize {
    match format {
        WeightFormat::F16 | WeightFormat::Bf16 => 2,
        _ => 4,
    }
}

/// Bytes of a quantized block's codes in a panel (16 columns x 32 positions).
pub(super) fn code_bytes(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Q4_0 => LANES * BLOCK / 2,
        _ => LANES * BLOCK,
    }
}

/// Bytes of one panel: 16 columns by `k`.
pub(super) fn panel_bytes(format: WeightFormat, k: usize) -> usize {
    match format.ggml() {
        Some(_) => k / BLOCK * (code_bytes(format) + 2 * LANES),
        None => k * LANES * format_bytes(format),
    }
}
