//! Weight matrices packed for the CPU's inference products `y = x @ W^T`, in f32, f16, bf16,
//! q8_0 or q4_0, with f32 activations and f32 accumulation; q8_0 and q4_0 weights take the
//! activations quantized to q8_0 and sum each block's products in integers (`int8.rs`).
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
//! never requantized, so a GGUF file round-trips exactly; their code bytes are in the integer
//! kernel's order (`int8.rs`), q4_0's each holding GGML's pair of positions `t` and `t + 16`.
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

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Result, Shape, Tensor};

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
/// Output columns per task (every kernel's), the offsets' group ([`PackedMatrix::group_offsets`]).
pub(crate) const OFFSET_GROUP: usize = GROUP * LANES;

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

    /// Bytes of the packed panels (what a product with one row of `x` reads).
    pub fn size_in_bytes(&self) -> usize {
        self.bytes().len()
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

    /// Rows `r0..r0 + n` of `W`, `(n, k)` in f32 (dequantized if quantized).
    pub fn dense_rows(&self, r0: usize, n: usize) -> Result<Tensor> {
        Tensor::from_vec(self.decode_rows(r0, n)?, (n, self.k), &Device::Cpu)
    }

    /// [`Self::dense_rows`]' values, row after row.
    fn decode_rows(&self, r0: usize, n: usize) -> Result<Vec<f32>> {
        if r0 + n > self.n {
            candle_core::bail!("rows {r0}..{} of a matrix of {} rows", r0 + n, self.n)
        }
        let mut values = Vec::with_capacity(n * self.k);
        for r in r0..r0 + n {
            self.decode_row(r, &mut values);
        }
        Ok(values)
    }

    /// Appends row `r` of `W` in f32 to `out`: [`Self::value`]'s values, a block at a time for
    /// the quantized formats (a tenth of the time of one value at a time, which made a QLoRA
    /// step's gradient through its base a third slower).
    fn decode_row(&self, r: usize, out: &mut Vec<f32>) {
        let quantized = matches!(self.format, WeightFormat::Q8_0 | WeightFormat::Q4_0);
        if !quantized {
            out.extend((0..self.k).map(|c| self.value(r, c)));
            return;
        }
        let (bytes, lane) = (self.bytes(), r % LANES);
        let codes = code_bytes(self.format);
        for b in 0..self.k / BLOCK {
            let at = self.block_start(r, b);
            let scale =
                half::f16::from_le_bytes([bytes[at + codes + 2 * lane], bytes[at + codes + 2 * lane + 1]]).to_f32();
            match self.format {
                WeightFormat::Q8_0 => {
                    out.extend((0..BLOCK).map(|t| bytes[at + int8::code_offset(t, lane)] as i8 as f32 * scale))
                }
                _ => {
                    // GGML's pairs: byte `t` holds positions `t` (low) and `t + 16` (high).
                    let pairs: [u8; 16] = std::array::from_fn(|t| bytes[at + int8::code_offset(t, lane)]);
                    out.extend(pairs.iter().map(|&p| ((p & 15) as f32 - 8.0) * scale));
                    out.extend(pairs.iter().map(|&p| ((p >> 4) as f32 - 8.0) * scale));
                }
            }
        }
    }

    /// `dy W` for `dy` `(m, n)`: the gradient of [`Self::matmul`]'s `x Wᵀ` with respect to `x`,
    /// `(m, k)`, with `W` dequantized a few hundred rows at a time (never whole: a frozen
    /// quantized base stays quantized while an adapter on it trains, as QLoRA's does).
    pub fn input_gradient(&self, dy: &Tensor) -> Result<Tensor> {
        use crate::train::product::Rhs;
        use crate::train::{Autocast, Operand};
        const ROWS: usize = 256;
        let (m, n) = dy.dims2()?;
        if n != self.n {
            candle_core::bail!(
                "packed-matmul gradient: dy is ({m}, {n}) but the weight is ({}, {})",
                self.n,
                self.k
            )
        }
        let dy = dy.to_dtype(DType::F32)?.contiguous()?;
        let (storage, layout) = dy.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("packed-matmul gradient: dy is not on the CPU")
        };
        let dy_values = crate::f32_slice(cpu, layout, "packed-matmul gradient")?;
        // dx = Σ over chunks of W's rows of dy[:, chunk] · W[chunk, :], on the training products.
        let mut dx = vec![0f32; m * self.k];
        for r0 in (0..n).step_by(ROWS) {
            let rows = ROWS.min(n - r0);
            let w = self.decode_rows(r0, rows)?;
            let a = Operand {
                data: dy_values,
                offset: r0,
                rows: m,
                cols: rows,
                stride: (n, 1),
            };
            Rhs::new(Operand::columns(&w, self.k, rows), Autocast::Off).matmul_add(a, &mut dx)?;
        }
        Tensor::from_vec(dx, (m, self.k), &Device::Cpu)
    }

    /// Rows `ids` of `W`, `(ids.len(), k)` in f32: the token embedding of a tied LM head.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let mut values = Vec::with_capacity(ids.len() * self.k);
        for &id in ids {
            let r = id as usize;
            if r >= self.n {
                candle_core::bail!("token id {id} is outside the embedding's {} rows", self.n)
            }
            self.decode_row(r, &mut values);
        }
        Tensor::from_vec(values, (ids.len(), self.k), &Device::Cpu)
    }

    /// Groups of [`OFFSET_GROUP`] output columns (the last padded).
    fn column_groups(&self) -> usize {
        self.n.div_ceil(OFFSET_GROUP)
    }

    /// Each block's offsets `table` `(k / 32, n)` f32 in the order [`Self::matmul_offsets`]
    /// reads them: `(groups · k / 32, 32)`, for each task's group of 32 output columns its row of
    /// 32 offsets for block after block (`n` padded with zeros to whole groups). As `(k / 32, n)`,
    /// a task read 18-48 pieces of 128 bytes each `4n` bytes apart, and the offsets (a sixth of a
    /// Q4_1 matrix's bytes) took about a quarter of its decode products' time; in this order
    /// SmolLM2's Q4_1 decode ran 1.10-1.35x faster (four alternated pairs, EPYC Zen 4).
    pub fn group_offsets(&self, table: &Tensor) -> Result<Tensor> {
        self.grouped(table, DType::F32)
    }

    /// Q4_1's and Q5_1's offsets as each block's `m` (`(k / 32, n)`, f16 as the file holds it),
    /// in [`Self::group_offsets`]'s order: a block's offset is `m + shift · d` ([`Self::min_shift`]:
    /// 8 over Q4_0 codes, 16 over Q8_0 ones), `d` the block's scale that the panels hold already,
    /// computed where a task adds it. Half the bytes of the f32 offsets, which were a sixth of a
    /// Q4_1 matrix's; the same values (`shift · d` is exact, so the sum rounds once, as the f32
    /// offset was rounded).
    pub fn group_mins(&self, mins: &Tensor) -> Result<Tensor> {
        self.min_shift()?;
        if mins.dtype() != DType::F16 {
            candle_core::bail!(
                "offsets: minima in {:?}, not f16 as a GGUF file holds them",
                mins.dtype()
            )
        }
        self.grouped(mins, DType::F16)
    }

    /// What an f16 table's `m` adds `d` times ([`Self::group_mins`]): the codes' zero point, 8
    /// for Q4_0's (Q4_1's codes `q − 8`), 16 for Q8_0's (Q5_1's `q − 16`).
    pub fn min_shift(&self) -> Result<f32> {
        match self.format {
            WeightFormat::Q4_0 => Ok(8.0),
            WeightFormat::Q8_0 => Ok(16.0),
            other => candle_core::bail!("offsets as each block's minimum need Q4_0 or Q8_0 codes, not {other}"),
        }
    }

    /// `table` `(k / 32, n)` in the tasks' order, in `dtype`.
    fn grouped(&self, table: &Tensor, dtype: DType) -> Result<Tensor> {
        let blocks = self.k / BLOCK;
        if table.dims() != [blocks, self.n] {
            candle_core::bail!(
                "offsets: a table of {:?} for a ({}, {}) weight in blocks of {BLOCK}",
                table.dims(),
                self.n,
                self.k
            )
        }
        let groups = self.column_groups();
        table
            .to_dtype(dtype)?
            .pad_with_zeros(1, 0, groups * OFFSET_GROUP - self.n)?
            .reshape((blocks, groups, OFFSET_GROUP))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((groups * blocks, OFFSET_GROUP))
    }

    /// Block `b`'s scale of output column `r` (quantized formats; a padded column's is 0).
    fn scale(&self, r: usize, b: usize) -> f32 {
        let at = self.block_start(r, b) + code_bytes(self.format) + 2 * (r % LANES);
        let bytes = self.bytes();
        half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
    }

    /// A grouped table's offsets in f32: as they are, or from an f16 table of minima
    /// ([`Self::group_mins`]) `m + shift · d`.
    fn offset_values(&self, grouped: &Tensor) -> Result<Tensor> {
        self.check_grouped(grouped.dims())?;
        if grouped.dtype() != DType::F16 {
            return grouped.to_dtype(DType::F32);
        }
        let (shift, blocks) = (self.min_shift()?, self.k / BLOCK);
        let mins = grouped.flatten_all()?.to_vec1::<half::f16>()?;
        let values = mins.iter().enumerate().map(|(i, m)| {
            let (group, b, lane) = (i / (blocks * OFFSET_GROUP), i / OFFSET_GROUP % blocks, i % OFFSET_GROUP);
            m.to_f32() + shift * self.scale(group * OFFSET_GROUP + lane, b)
        });
        Tensor::from_vec(values.collect(), grouped.shape(), &Device::Cpu)
    }

    /// [`Self::group_offsets`]'s (or [`Self::group_mins`]'s) table back in its `(k / 32, n)`
    /// order, the offsets in f32.
    pub fn offsets_by_block(&self, grouped: &Tensor) -> Result<Tensor> {
        let (blocks, groups) = (self.k / BLOCK, self.column_groups());
        self.offset_values(grouped)?
            .reshape((groups, blocks, OFFSET_GROUP))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((blocks, groups * OFFSET_GROUP))?
            .narrow(1, 0, self.n)?
            .contiguous()
    }

    /// The offsets (f32) of output columns `ids` from [`Self::group_offsets`]'s (or
    /// [`Self::group_mins`]'s) table, `(ids.len(), k / 32)`: a tied LM head's rows as token
    /// embeddings (only those values gathered).
    pub fn offsets_of_rows(&self, grouped: &Tensor, ids: &[u32]) -> Result<Tensor> {
        self.check_grouped(grouped.dims())?;
        let blocks = self.k / BLOCK;
        let mut at = Vec::with_capacity(ids.len() * blocks);
        for &id in ids {
            let c = id as usize;
            if c >= self.n {
                candle_core::bail!("token id {id} is outside the embedding's {} rows", self.n)
            }
            let (group, lane) = (c / OFFSET_GROUP, c % OFFSET_GROUP);
            at.extend((0..blocks).map(|b| ((group * blocks + b) * OFFSET_GROUP + lane) as u32));
        }
        let at = Tensor::from_vec(at, ids.len() * blocks, grouped.device())?;
        let picked = grouped.flatten_all()?.index_select(&at, 0)?;
        let picked = if grouped.dtype() == DType::F16 {
            let shift = self.min_shift()?;
            let mins = picked.to_vec1::<half::f16>()?;
            let values = mins
                .iter()
                .enumerate()
                .map(|(i, m)| m.to_f32() + shift * self.scale(ids[i / blocks] as usize, i % blocks));
            Tensor::from_vec(values.collect(), picked.shape(), &Device::Cpu)?
        } else {
            picked.to_dtype(DType::F32)?
        };
        picked.reshape((ids.len(), blocks))
    }

    /// Whether a table of `dims` is of [`Self::group_offsets`]'s shape for this matrix.
    pub(crate) fn check_grouped(&self, dims: &[usize]) -> Result<()> {
        let want = [self.column_groups() * (self.k / BLOCK), OFFSET_GROUP];
        if !self.k.is_multiple_of(BLOCK) || dims != want {
            candle_core::bail!(
                "offsets: a table of {dims:?} for a ({}, {}) weight, not {want:?} (blocks of {BLOCK} by groups of \
                 {OFFSET_GROUP} columns)",
                self.n,
                self.k
            )
        }
        Ok(())
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

    /// `x @ W^T` plus each block's offsets: `y[i, c] += Σ_b (Σ of x[i] over block b) ·
    /// offsets[b, c]`, as a Q4_1 or Q5_1 matrix held as the codes of Q4_0 or Q8_0
    /// ([`WeightFormat`]) computes, `offsets` in the tasks' order ([`Self::group_offsets`]). Each
    /// task adds its columns' offsets to the outputs it has just written: at decode the separate
    /// product, sum and add had taken 8% of a Q4_1 model's time on the main thread, the pool
    /// waiting (perf). An f16 `offsets` table is read as each block's minimum `m` instead
    /// ([`Self::group_mins`]); any other dtype as the offsets. Not differentiable.
    pub fn matmul_offsets(&self, x: &Tensor, offsets: &Tensor) -> Result<Tensor> {
        let offsets = offsets_operand(offsets)?;
        x.contiguous()?.apply_op2_no_bwd(&offsets, &WithOffsets(self))
    }

    /// [`Self::matmul_offsets`] plus `bias`, then GELU (tanh form) if `gelu`, all in the tasks'
    /// epilogue, as [`Self::matmul_bias`] (a separate add of the bias had been 1.5% of a Q4_1
    /// decode's main thread, perf).
    pub fn matmul_offsets_bias(&self, x: &Tensor, offsets: &Tensor, bias: &Tensor, gelu: bool) -> Result<Tensor> {
        if bias.dims() != [self.n] {
            candle_core::bail!(
                "packed-matmul-offsets: the bias has shape {:?}, the weight ({}, {}) needs ({},)",
                bias.dims(),
                self.n,
                self.k,
                self.n
            )
        }
        let offsets = offsets_operand(offsets)?;
        let bias = bias.to_dtype(DType::F32)?.contiguous()?;
        x.contiguous()?
            .apply_op3_no_bwd(&offsets, &bias, &WithEpilogue { w: self, gelu })
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

/// `y = x @ W^T`, or with `accumulate` `y += x @ W^T` (then `y` must be initialised), for `W`
/// `(n, k)` given as bf16 panels in this module's layout (`n` rounded up to whole tasks, each
/// panel `k` positions of 16 values) and `x` `(m, k)` row-major f32 read where it is, with
/// values below f32's normal range read as and flushed to zero (MXCSR's DAZ and FTZ): training's
/// bf16 products ([`crate::train::bf16`]) on this kernel.
#[cfg(target_arch = "x86_64")]
pub(crate) fn matmul_bf16_panels_flushed(
    panels: &[u16],
    (n, k): (usize, usize),
    x: InPlace,
    m: usize,
    simd: Simd,
    y: &mut [MaybeUninit<f32>],
    accumulate: bool,
) -> Result<()> {
    if panels.len() < n.div_ceil(GROUP * LANES) * GROUP * k * LANES
        || x.transposed
        || !x.holds(m, k)
        || y.len() != m * n
    {
        candle_core::bail!(
            "bf16-panels matmul: x ({m}, {k}) {}, B ({n}, {k}) in {} values, y {} values",
            x.describe(),
            panels.len(),
            y.len()
        )
    }
    if !nothing_to_multiply(y, k, accumulate) {
        // SAFETY: checked above: the panels hold whole tasks of `k` positions, `k > 0`, `x`
        // and `y` hold theirs; x86-64.
        unsafe { kernel::run_bf16_split_in_place(panels, (n, k), x, y, m, simd, accumulate) };
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

/// An offsets' table as the products read it: f32 offsets, or f16 minima as they are.
fn offsets_operand(table: &Tensor) -> Result<Tensor> {
    match table.dtype() {
        DType::F16 => table.contiguous(),
        _ => table.to_dtype(DType::F32)?.contiguous(),
    }
}

mod amx;
mod epilogue;
mod format;
mod int8;
mod kernel;
mod layout;

use epilogue::{Epilogue, WithEpilogue, WithOffsets};
use layout::{code_bytes, format_bytes, panel_bytes};

#[cfg(test)]
mod tests {
    use super::*;

    /// Packing a strided f32 matrix gives the panels of packing its dense copy: row-major
    /// sources and transposed views, whole and partial panels, and an offset.
    #[test]
    fn strided_packing_matches_packing_the_dense_copy() -> Result<()> {
        for (n, k) in [(37, 53), (32, 48), (16, 16), (70, 5), (5, 33), (48, 7)] {
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
            // Rows further apart than their length (a view of the first k columns of wider rows).
            let ld = k + 5;
            let wide: Vec<f32> = (0..n * ld)
                .map(|i| values[3 + i / ld * k + (i % ld).min(k - 1)])
                .collect();
            let wide = PackedMatrix::from_strided_f32(&wide, 0, (n, k), (ld, 1));
            assert_eq!(wide.bytes(), want.bytes(), "{n}x{k} rows {ld} apart");
        }
        Ok(())
    }

    /// A table of each block's `m` ([`PackedMatrix::group_mins`], Q4_1's and Q5_1's) gives the
    /// bits of the f32 offsets `m + shift · d` with `d` read from GGML's blocks of the same
    /// matrix: through the products (one row, a few, a prefill's 37; with a bias and GELU), the
    /// table by block and a tied head's rows. 70 columns: a partial last group.
    #[test]
    fn minima_give_the_bits_of_their_offsets() -> Result<()> {
        let device = candle_core::Device::Cpu;
        let (n, k) = (70, 256);
        let blocks = k / BLOCK;
        let w = Tensor::from_vec((0..n * k).map(|i| (i as f32 * 0.61).sin()).collect(), (n, k), &device)?;
        let mins: Vec<half::f16> = (0..blocks * n)
            .map(|i| half::f16::from_f32((i as f32 * 0.29).cos() * 0.3))
            .collect();
        let mins = Tensor::from_vec(mins, (blocks, n), &device)?;
        let bias = Tensor::from_vec((0..n).map(|i| (i as f32 * 0.7).sin()).collect(), n, &device)?;
        for (format, shift, block_bytes) in [(WeightFormat::Q4_0, 8f32, 18), (WeightFormat::Q8_0, 16f32, 34)] {
            let packed = PackedMatrix::from_dense(&w, format)?;
            assert_eq!(packed.min_shift()?, shift);
            // Each block's `d`, from GGML's blocks: the f16 before the codes.
            let ggml = packed.to_qtensor()?.data()?.to_vec();
            let d = |r: usize, b: usize| {
                let at = (r * blocks + b) * block_bytes;
                half::f16::from_le_bytes([ggml[at], ggml[at + 1]]).to_f32()
            };
            let m = mins.to_vec2::<half::f16>()?;
            let table: Vec<f32> = (0..blocks * n)
                .map(|i| m[i / n][i % n].to_f32() + shift * d(i % n, i / n))
                .collect();
            let table = Tensor::from_vec(table, (blocks, n), &device)?;
            let (grouped, values) = (packed.group_mins(&mins)?, packed.group_offsets(&table)?);
            assert_eq!(grouped.dtype(), DType::F16);
            assert!(packed.group_mins(&mins.to_dtype(DType::F32)?).is_err(), "f32 minima");
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
            };
            assert_eq!(
                bits(&packed.offsets_by_block(&grouped)?)?,
                bits(&table)?,
                "{format} by block"
            );
            let ids = [69u32, 0, 31, 32, 40];
            assert_eq!(
                bits(&packed.offsets_of_rows(&grouped, &ids)?)?,
                bits(&packed.offsets_of_rows(&values, &ids)?)?,
                "{format} rows"
            );
            for rows in [1, 3, 37] {
                let x = Tensor::from_vec(
                    (0..rows * k).map(|i| (i as f32 * 0.17).cos()).collect(),
                    (rows, k),
                    &device,
                )?;
                assert_eq!(
                    bits(&packed.matmul_offsets(&x, &grouped)?)?,
                    bits(&packed.matmul_offsets(&x, &values)?)?,
                    "{format} m={rows}"
                );
                assert_eq!(
                    bits(&packed.matmul_offsets_bias(&x, &grouped, &bias, true)?)?,
                    bits(&packed.matmul_offsets_bias(&x, &values, &bias, true)?)?,
                    "{format} m={rows} with bias and GELU"
                );
            }
        }
        // Minima need codes with a zero point.
        let f32_panels = PackedMatrix::from_dense(&w, WeightFormat::F32)?;
        assert!(f32_panels.group_mins(&mins).is_err());
        Ok(())
    }

    /// The offsets' terms added by each task ([`PackedMatrix::matmul_offsets`]) are the separate
    /// product's (`y + sums(x) · table`): the integer and the f32 kernels, one row and the
    /// several row blocks of a prefill (300 rows of 2 KiB), a partial last group of columns.
    #[test]
    fn offsets_added_by_the_tasks_match_the_separate_product() -> Result<()> {
        let device = candle_core::Device::Cpu;
        let (n, k) = (70, 512);
        let w = Tensor::from_vec((0..n * k).map(|i| (i as f32 * 0.61).sin()).collect(), (n, k), &device)?;
        let table = Tensor::from_vec(
            (0..k / BLOCK * n).map(|i| (i as f32 * 0.29).cos()).collect(),
            (k / BLOCK, n),
            &device,
        )?;
        for format in [WeightFormat::Q4_0, WeightFormat::Q8_0, WeightFormat::F32] {
            let packed = PackedMatrix::from_dense(&w, format)?;
            let grouped = packed.group_offsets(&table)?;
            assert_eq!(
                grouped.dims(),
                [3 * k / BLOCK, OFFSET_GROUP],
                "70 columns: three groups"
            );
            let back = packed.offsets_by_block(&grouped)?;
            assert_eq!(
                back.flatten_all()?.to_vec1::<f32>()?,
                table.flatten_all()?.to_vec1::<f32>()?
            );
            let ids = [69u32, 0, 31, 32, 40];
            let picked = packed.offsets_of_rows(&grouped, &ids)?;
            let want = table
                .t()?
                .contiguous()?
                .index_select(&Tensor::new(&ids[..], &device)?, 0)?;
            assert_eq!(
                picked.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?
            );
            assert!(packed.offsets_of_rows(&grouped, &[70]).is_err(), "a column past n");
            for m in [1, 3, 37, 300] {
                let x = Tensor::from_vec((0..m * k).map(|i| (i as f32 * 0.17).cos()).collect(), (m, k), &device)?;
                let sums = x.reshape((m, k / BLOCK, BLOCK))?.sum(2)?;
                let want = (packed.matmul(&x)? + sums.matmul(&table)?)?;
                let got = packed.matmul_offsets(&x, &grouped)?;
                // With a bias (and GELU) in the same epilogue: the bits of the separate ops.
                let bias = Tensor::from_vec((0..n).map(|i| (i as f32 * 0.7).sin()).collect(), n, &device)?;
                let biased = crate::add_tiled(&got, &bias)?;
                for (gelu, want) in [(false, biased.clone()), (true, crate::gelu(&biased)?)] {
                    let fused = packed.matmul_offsets_bias(&x, &grouped, &bias, gelu)?;
                    assert_eq!(
                        fused.flatten_all()?.to_vec1::<f32>()?,
                        want.flatten_all()?.to_vec1::<f32>()?,
                        "{format} m={m} gelu {gelu}"
                    );
                }
                let diff = (got - &want)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                let scale = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                assert!(
                    diff <= 1e-5 * scale,
                    "{format} m={m}: {diff} off (outputs up to {scale})"
                );
            }
            // The table in its (k / 32, n) order, or of another matrix, is refused.
            let x = Tensor::zeros((1, k), candle_core::DType::F32, &device)?;
            let err = packed.matmul_offsets(&x, &table).unwrap_err().to_string();
            assert!(err.contains("a table of [16, 70]"), "{err}");
            let wrong = Tensor::zeros((k / BLOCK + 1, n), candle_core::DType::F32, &device)?;
            assert!(packed.group_offsets(&wrong).is_err());
            assert!(packed.offsets_by_block(&table).is_err());
            let short = Tensor::zeros(n - 1, candle_core::DType::F32, &device)?;
            assert!(
                packed.matmul_offsets_bias(&x, &grouped, &short, false).is_err(),
                "a bias of n - 1"
            );
        }
        Ok(())
    }
}
