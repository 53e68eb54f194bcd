//! Weight matrices packed for the CPU's inference products `y = x @ W^T`, in f32, f16, bf16,
//! q8_0 or q4_0, with f32 activations and f32 accumulation; q8_0 weights take the activations
//! quantized to q8_0 too and sum each block's products in integers (`int8.rs`).
//!
//! Why not candle's kernels: decoding reads every weight once per step, so its limit is memory
//! bandwidth, which candle's gemm reaches at about half (its one-row path) and its quantized
//! matmul at ~11 GB/s on the LM head; prefill and batched decode are arithmetic, where the `gemm`
//! crate on stable Rust runs AVX2 kernels (half an AVX-512 machine's rate) and `QMatMul` is slower
//! still (q4_0 prefill: 128 tokens/s). One layout serves both regimes here.
//!
//! The layout: output columns (weight rows) in panels of 16; a panel holds, for each position
//! along `k`, its 16 weights side by side, so a panel is read front to back as a stream of
//! 16-wide vectors (64 bytes in f32). Quantized panels keep GGML's blocks of 32 along `k`: each
//! block is its 16 x 32 codes followed by the 16 columns' f16 scales. GGML's codes are moved,
//! never requantized, so a GGUF file round-trips exactly (q8_0's codes in the integer kernel's
//! order, `int8.rs`); q4_0's two codes per byte are regrouped
//! on the way (GGML pairs positions `t` and `t + 16`, here a byte holds `2t` and `2t + 1`) so that
//! every format yields its weights in ascending positions.
//! Columns are padded with zeros to a multiple of 32 (two panels: a task).
//!
//! The kernel is the classic outer-product form: a tile of up to 12 activation rows times 2
//! panels (24 vector accumulators with AVX-512), each step one weight vector per panel (widened
//! or dequantized in registers) and one broadcast per row. With more rows than one tile, `k` goes
//! in chunks whose weights are widened once for all the tiles (see `kernel::task`); linear layers
//! add their bias and GELU as each task finishes (`matmul_bias`). Every output is a single chain of
//! fused multiply-adds along `k` in one fixed order, whatever the tile, the batch or the
//! instruction set (AVX-512, AVX2 or plain Rust give the same bits): a sequence decodes the same
//! alone or batched, with or without a cached prefix. Tasks (two panels each) run on candle's
//! own persistent thread pool.
//!
//! [`MatmulPrecision::High`] adds a second copy of f32 weights split into bf16 halves (of bf16
//! weights as they are) for Intel's AMX tiles (`amx.rs`), which then take every product of that
//! matrix.

use std::mem::MaybeUninit;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use crate::simd::Simd;
pub use format::{MatmulPrecision, WeightFormat};

/// Output columns per panel: one AVX-512 vector of f32.
const LANES: usize = crate::simd::LANES;
/// Panels per task and per register tile.
const GROUP: usize = 2;
/// How far ahead of the kernel, in bytes, the first row tile asks for its panels' next lines.
const PREFETCH: usize = 1024;
/// The quantized formats' block along `k`, as in GGML.
const BLOCK: usize = 32;

/// Storage unit, so that panels start on cache lines.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// A left operand `x` `(m, k)` that the f32 kernel reads where it is: row `i`, position `c` at
/// `values[i * ldx + c]`, or, `transposed` (column-major: a transposed view), at
/// `values[c * ldx + i]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InPlace<'a> {
    pub values: &'a [f32],
    pub ldx: usize,
    pub transposed: bool,
}

impl InPlace<'_> {
    /// Whether the values hold an `(m, k)` matrix laid out as this says.
    fn holds(&self, m: usize, k: usize) -> bool {
        let (inner, outer) = if self.transposed { (m, k) } else { (k, m) };
        self.ldx >= inner && (outer == 0 || inner == 0 || self.values.len() >= (outer - 1) * self.ldx + inner)
    }

    /// The layout, for errors.
    fn describe(&self) -> String {
        format!(
            "with leading dimension {}{} in {} values",
            self.ldx,
            if self.transposed { ", transposed" } else { "" },
            self.values.len()
        )
    }
}

/// A weight matrix `W` `(n, k)` packed for [`PackedMatrix::matmul`]; see the module's notes.
#[derive(Clone)]
pub struct PackedMatrix {
    format: WeightFormat,
    n: usize,
    k: usize,
    lines: Vec<Line>,
    /// The same weights laid out (f32 ones split) for AMX's bf16 tiles ([`MatmulPrecision::High`];
    /// `amx.rs`).
    amx: Option<std::sync::Arc<amx::AmxWeights>>,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PackedMatrix({}, {}x{}, {:?})",
            self.format,
            self.n,
            self.k,
            self.precision()
        )
    }
}

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
                    for (c, lanes) in out.chunks_exact_mut(LANES).enumerate() {
                        let at = base + c * strides.1;
                        let (values, padding) = lanes.split_at_mut(rows);
                        if rows == 0 {
                            // A padding panel: zeros only.
                        } else if strides.0 == 1 {
                            // A transposed source: the panel's 16 rows are adjacent.
                            for (v, &x) in values.iter_mut().zip(&data[at..at + rows]) {
                                v.write(x);
                            }
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
                let src_codes = match format {
                    WeightFormat::Q4_0 => q4_pairs(&src[2..]),
                    _ => src[2..].to_vec(),
                };
                for (t, &code) in src_codes.iter().enumerate() {
                    bytes[at + code_offset(format, t, lane)] = code;
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
                    *code = bytes[at + code_offset(self.format, t, lane)];
                }
                if self.format == WeightFormat::Q4_0 {
                    let ggml = ggml_q4_halves(&dst[2..]);
                    dst[2..].copy_from_slice(&ggml);
                }
            }
        }
        candle_core::quantized::ggml_file::qtensor_from_ggml(ggml, &data, vec![n, k], &Device::Cpu)
    }

    pub fn format(&self) -> WeightFormat {
        self.format
    }

    /// The matrix with its products taken at `precision` (see [`Self::set_precision`]).
    pub fn with_precision(mut self, precision: MatmulPrecision) -> Result<Self> {
        self.set_precision(precision)?;
        Ok(self)
    }

    /// Takes this matrix's products at `precision`. [`MatmulPrecision::High`] needs f32 or bf16
    /// weights and a CPU with AMX-BF16 ([`MatmulPrecision::available`]), and keeps a second copy
    /// of the weights for the tiles (f32 ones split into bf16 halves: the same bytes again). On
    /// error nothing changes.
    pub fn set_precision(&mut self, precision: MatmulPrecision) -> Result<()> {
        match precision {
            MatmulPrecision::Highest => self.amx = None,
            MatmulPrecision::High => {
                if !matches!(self.format, WeightFormat::F32 | WeightFormat::Bf16) {
                    candle_core::bail!(
                        "matmul precision `high` takes f32 weights (split into bf16 halves) or bf16 ones; \
                         these weights are {}",
                        self.format
                    )
                }
                if !crate::simd::amx::available() {
                    candle_core::bail!(
                        "matmul precision `high` runs on AMX tiles (Intel Sapphire Rapids or later, Linux 5.16 \
                         or later); this CPU or kernel has none"
                    )
                }
                if self.amx.is_none() {
                    self.amx = Some(std::sync::Arc::new(amx::AmxWeights::new(self)));
                }
            }
        }
        Ok(())
    }

    pub fn precision(&self) -> MatmulPrecision {
        match self.amx {
            Some(_) => MatmulPrecision::High,
            None => MatmulPrecision::Highest,
        }
    }

    /// `(n, k)`: output columns, inputs.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// `W` `(n, k)` in f32 (dequantized if quantized).
    pub fn dense(&self) -> Result<Tensor> {
        let mut values = Vec::with_capacity(self.n * self.k);
        for r in 0..self.n {
            values.extend((0..self.k).map(|c| self.value(r, c)));
        }
        Tensor::from_vec(values, (self.n, self.k), &Device::Cpu)
    }

    /// Rows `ids` of `W`, `(ids.len(), k)` in f32: the token embedding of a tied LM head.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let mut values = Vec::with_capacity(ids.len() * self.k);
        for &id in ids {
            let r = id as usize;
            if r >= self.n {
                candle_core::bail!("token id {id} is outside the embedding's {} rows", self.n)
            }
            values.extend((0..self.k).map(|c| self.value(r, c)));
        }
        Tensor::from_vec(values, (ids.len(), self.k), &Device::Cpu)
    }

    /// `x @ W^T` for `x` `(m, k)` f32 on the CPU: `(m, n)` f32. Not differentiable.
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        x.contiguous()?.apply_op1_no_bwd(self)
    }

    /// [`PackedMatrix::matmul`] on a chosen instruction set, which must be available
    /// ([`Simd::available`]); every one gives the same bits. (At [`MatmulPrecision::High`] the
    /// AMX tiles run whatever `simd` says.)
    pub fn matmul_with(&self, x: &[f32], m: usize, simd: Simd) -> Vec<f32> {
        self.matmul_epilogue(x, m, simd, Epilogue::default())
    }

    /// [`MatmulPrecision::High`]'s products of `x` `(m, k)` with the AMX tile products computed
    /// in plain Rust as the instruction defines them, on any CPU (f32 or bf16 weights): the
    /// layout, the split into bf16 halves and the order of the products, checked where there is
    /// no AMX. Slow; for tests.
    #[doc(hidden)]
    pub fn matmul_high_emulated(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        if !matches!(self.format, WeightFormat::F32 | WeightFormat::Bf16) || x.len() != m * self.k || self.k == 0 {
            candle_core::bail!("matmul_high_emulated: f32 or bf16 weights and x of (m, k)")
        }
        let tiles = match &self.amx {
            Some(tiles) => tiles.clone(),
            None => std::sync::Arc::new(amx::AmxWeights::new(self)),
        };
        let len = m * self.n;
        let mut y = Vec::with_capacity(len);
        amx::run(
            self,
            &tiles,
            x,
            &mut y.spare_capacity_mut()[..len],
            m,
            Epilogue::default(),
            amx::Tiles::Emulated,
        );
        // SAFETY: the kernel initialised all `len` elements (its contract).
        unsafe { y.set_len(len) };
        Ok(y)
    }

    /// `x @ W^T + bias`, then GELU (tanh form) if `gelu`: a linear layer in one pass, the
    /// bias and activation applied by each task to the outputs it has just written (while they
    /// are in cache, and on the thread pool rather than in separate passes). The same bits as
    /// [`Self::matmul`], then `ops::add_tiled` and `ops::gelu`.
    pub fn matmul_bias(&self, x: &Tensor, bias: &Tensor, gelu: bool) -> Result<Tensor> {
        if bias.dims() != [self.n] {
            candle_core::bail!(
                "packed-matmul: the bias has shape {:?}, the weight ({}, {}) needs ({},)",
                bias.dims(),
                self.n,
                self.k,
                self.n
            )
        }
        // The bias is read where it is (an f32 model's is f32 already, no copy).
        let bias = bias.to_dtype(DType::F32)?.contiguous()?;
        x.contiguous()?.apply_op2_no_bwd(&bias, &WithEpilogue { w: self, gelu })
    }

    /// [`Self::matmul_with`] and an epilogue.
    pub(crate) fn matmul_epilogue(&self, x: &[f32], m: usize, simd: Simd, ep: Epilogue) -> Vec<f32> {
        let len = m * self.n;
        if len == 0 || self.k == 0 || x.len() != m * self.k {
            return vec![0f32; len];
        }
        // Not zeroed first: the kernels write every output (zeroing the LM head's 50257 columns
        // per row was ~3% of a prompt's time).
        let mut y = Vec::with_capacity(len);
        match &self.amx {
            Some(tiles) => amx::run(
                self,
                tiles,
                x,
                &mut y.spare_capacity_mut()[..len],
                m,
                ep,
                amx::Tiles::Hardware,
            ),
            None => kernel::run(self, x, &mut y.spare_capacity_mut()[..len], m, simd, ep, false),
        }
        // SAFETY: the kernels initialised all `len` elements (their contract).
        unsafe { y.set_len(len) };
        y
    }

    /// `y = x @ W^T`, or with `accumulate` `y += x @ W^T` (then `y` must be initialised), for
    /// f32 panels and `x` `(m, k)` read where it is ([`InPlace`]). The bits of
    /// [`Self::matmul`] on a dense copy.
    pub(crate) fn matmul_in_place(
        &self,
        x: InPlace,
        m: usize,
        simd: Simd,
        y: &mut [MaybeUninit<f32>],
        accumulate: bool,
    ) -> Result<()> {
        if self.format != WeightFormat::F32 || y.len() != m * self.n || !x.holds(m, self.k) {
            candle_core::bail!(
                "packed-matmul: x ({m}, {}) {}, y {} values, {:?} panels",
                self.k,
                x.describe(),
                y.len(),
                self.format
            )
        }
        if !nothing_to_multiply(y, self.k, accumulate) {
            kernel::run_f32_in_place(self, x, y, m, simd, accumulate);
        }
        Ok(())
    }

    fn zeros(format: WeightFormat, n: usize, k: usize) -> Self {
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

    fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is plain bytes with no padding.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr() as *const u8, self.lines.len() * 64) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut u8, self.lines.len() * 64) }
    }

    /// Byte offset of row `r`'s panel.
    fn panel_start(&self, r: usize) -> usize {
        r / LANES * panel_bytes(self.format, self.k)
    }

    /// Byte offset of block `b` of row `r`'s panel (quantized formats).
    fn block_start(&self, r: usize, b: usize) -> usize {
        self.panel_start(r) + b * (code_bytes(self.format) + 2 * LANES)
    }

    /// `W[r, c]` in f32.
    fn value(&self, r: usize, c: usize) -> f32 {
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
                    bytes[at + code_offset(self.format, j, lane)] as i8 as f32
                } else {
                    let byte = bytes[at + code_offset(self.format, j / 2, lane)];
                    (if j.is_multiple_of(2) { byte & 15 } else { byte >> 4 }) as f32 - 8.0
                };
                q * scale
            }
        }
    }
}

/// Byte offset, within its block, of code byte `t` of column `lane`: q8_0 in the order of the
/// integer kernel (`int8.rs`), q4_0's 16 pair bytes a 16-byte row each.
fn code_offset(format: WeightFormat, t: usize, lane: usize) -> usize {
    match format {
        WeightFormat::Q8_0 => int8::code_offset(t, lane),
        _ => t * LANES + lane,
    }
}

/// A q4_0 block's 16 code bytes from GGML's order (byte `t`: positions `t` low, `t + 16` high)
/// to this layout's (byte `t`: positions `2t` low, `2t + 1` high).
fn q4_pairs(ggml: &[u8]) -> Vec<u8> {
    let code = |j: usize| if j < 16 { ggml[j] & 15 } else { ggml[j - 16] >> 4 };
    (0..16).map(|t| code(2 * t) | code(2 * t + 1) << 4).collect()
}

/// The inverse of [`q4_pairs`].
fn ggml_q4_halves(pairs: &[u8]) -> Vec<u8> {
    let code = |j: usize| {
        if j.is_multiple_of(2) {
            pairs[j / 2] & 15
        } else {
            pairs[j / 2] >> 4
        }
    };
    (0..16).map(|t| code(t) | code(t + 16) << 4).collect()
}

/// Bytes of one dense weight.
fn format_bytes(format: WeightFormat) -> usize {
    match format {
        WeightFormat::F16 | WeightFormat::Bf16 => 2,
        _ => 4,
    }
}

/// Bytes of a quantized block's codes in a panel (16 columns x 32 positions).
fn code_bytes(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Q4_0 => LANES * BLOCK / 2,
        _ => LANES * BLOCK,
    }
}

/// `y = x @ B`, or with `accumulate` `y += x @ B` (then `y` must be initialised), for `B`
/// `(k, n)` f32, row-major with rows `ldb` apart in `b`, read where it is, without packing
/// (the kernel reads it as the panels of its transpose), and `x` `(m, k)` read where it is
/// ([`InPlace`]). The bits of [`PackedMatrix::matmul`] on `B^T` packed. `n` must be a multiple
/// of 32 (the kernel's task: no padding panels).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_rows_in_place(
    b: &[f32],
    ldb: usize,
    (k, n): (usize, usize),
    x: InPlace,
    m: usize,
    simd: Simd,
    y: &mut [MaybeUninit<f32>],
    accumulate: bool,
) -> Result<()> {
    if !n.is_multiple_of(GROUP * LANES)
        || ldb < n
        || (k > 0 && b.len() < (k - 1) * ldb + n)
        || y.len() != m * n
        || !x.holds(m, k)
    {
        candle_core::bail!(
            "rows-matmul: x ({m}, {k}) {}, B ({k}, {n}) with rows {ldb} apart in {} values, y {} values",
            x.describe(),
            b.len(),
            y.len(),
        )
    }
    if !nothing_to_multiply(y, k, accumulate) {
        // SAFETY: checked above: `b` holds the matrix, `n` is whole tasks, `k > 0`, `x` and `y`
        // hold theirs.
        unsafe { kernel::run_f32_rows_in_place(b, ldb, (k, n), x, y, m, simd, accumulate) };
    }
    Ok(())
}

/// Whether a product into `y` over `k` positions is done before the kernel: `y` empty, or `k`
/// 0 (then its sums are zeros, written unless `accumulate`).
fn nothing_to_multiply(y: &mut [MaybeUninit<f32>], k: usize, accumulate: bool) -> bool {
    if k == 0 && !accumulate {
        y.iter_mut().for_each(|v| {
            v.write(0.0);
        });
    }
    y.is_empty() || k == 0
}

/// Bytes of one panel: 16 columns by `k`.
fn panel_bytes(format: WeightFormat, k: usize) -> usize {
    match format.ggml() {
        Some(_) => k / BLOCK * (code_bytes(format) + 2 * LANES),
        None => k * LANES * format_bytes(format),
    }
}

/// What each task applies to the outputs it has written: the bias, then GELU.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Epilogue<'a> {
    pub bias: Option<&'a [f32]>,
    pub gelu: bool,
}

impl CustomOp1 for PackedMatrix {
    fn name(&self) -> &'static str {
        "packed-matmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward_cpu(storage, layout, Epilogue::default())
    }
}

impl PackedMatrix {
    fn forward_cpu(&self, storage: &CpuStorage, layout: &Layout, ep: Epilogue) -> Result<(CpuStorage, Shape)> {
        let x = crate::f32_slice(storage, layout, "packed-matmul")?;
        let (m, k) = layout.shape().dims2()?;
        if k != self.k {
            candle_core::bail!(
                "packed-matmul: x is (.., {k}) but the weight is ({}, {})",
                self.n,
                self.k
            )
        }
        Ok((
            CpuStorage::F32(self.matmul_epilogue(x, m, Simd::detect(), ep)),
            Shape::from((m, self.n)),
        ))
    }
}

/// [`PackedMatrix::matmul_bias`] as a candle op of `x` and the bias.
struct WithEpilogue<'a> {
    w: &'a PackedMatrix,
    gelu: bool,
}

impl CustomOp2 for WithEpilogue<'_> {
    fn name(&self) -> &'static str {
        "packed-matmul-bias"
    }

    fn cpu_fwd(&self, x: &CpuStorage, lx: &Layout, b: &CpuStorage, lb: &Layout) -> Result<(CpuStorage, Shape)> {
        let ep = Epilogue {
            bias: Some(crate::f32_slice(b, lb, "packed-matmul-bias")?),
            gelu: self.gelu,
        };
        self.w.forward_cpu(x, lx, ep)
    }
}

mod amx;
mod format;
mod int8;
mod kernel;

#[cfg(test)]
mod tests {
    use super::*;

    /// Packing a strided f32 matrix gives the panels of packing its dense copy: row-major
    /// sources and transposed views, whole and partial panels, and an offset.
    #[test]
    fn strided_packing_matches_packing_the_dense_copy() -> Result<()> {
        for (n, k) in [(37, 53), (32, 48), (16, 16), (70, 5), (5, 33)] {
            let values: Vec<f32> = (0..n * k + 3).map(|i| (i as f32 * 0.37).sin()).collect();
            let dense = Tensor::from_slice(&values[3..], (n, k), &candle_core::Device::Cpu)?;
            let want = PackedMatrix::from_dense(&dense, WeightFormat::F32)?;
            let row_major = PackedMatrix::from_strided_f32(&values, 3, (n, k), (k, 1));
            assert_eq!(row_major.bytes(), want.bytes(), "{n}x{k} row-major");
            let t: Vec<f32> = (0..k)
                .flat_map(|c| (0..n).map(move |r| (r, c)))
                .map(|(r, c)| values[3 + r * k + c])
                .collect();
            let transposed = PackedMatrix::from_strided_f32(&t, 0, (n, k), (1, n));
            assert_eq!(transposed.bytes(), want.bytes(), "{n}x{k} transposed");
        }
        Ok(())
    }
}
