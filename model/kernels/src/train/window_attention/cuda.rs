//! The CUDA launchers of window attention's kernels (`window_attention.cu`, beside this file).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::LaunchConfig;
use candle_core::{CudaStorage, Layout, Result, Shape};

use crate::cuda::{f32_view, output, wrap};

const MODULE: crate::cuda::Module = crate::ptx_module!("window_attention");

/// [`crate::window_attention`]'s shape and dropout on the GPU.
#[derive(Debug, Clone, Copy)]
pub struct WindowAttentionArgs {
    /// Windows, positions per window, heads, head size.
    pub b: usize,
    pub t: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Dropout of the attention weights (0: none), keyed by `key`, `first` the index of this
    /// call's first weight in the batch's `(B, nh, T, T)` probabilities.
    pub p: f32,
    pub key: u64,
    pub first: u64,
}

/// Largest head the attention kernels take (a multiple of 4; see window_attention.cu's instances).
pub const WINDOW_ATTENTION_MAX_HEAD: usize = 128;
/// Warps per block of the attention kernels (`ATT_WARPS` in window_attention.cu).
const ATTENTION_WARPS: u32 = 8;

impl WindowAttentionArgs {
    /// The kernels' instance for this head (name suffix) and the rows each warp takes: 4 for
    /// heads of up to 64, else 1.
    fn instance(&self) -> (&'static str, u32) {
        if self.head_dim <= 64 {
            ("_h64", 4)
        } else {
            ("_h128", 1)
        }
    }

    fn config(&self) -> LaunchConfig {
        let rows = ATTENTION_WARPS * self.instance().1;
        LaunchConfig {
            grid_dim: ((self.t as u32).div_ceil(rows), self.n_head as u32, self.b as u32),
            block_dim: (32 * ATTENTION_WARPS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn kernel(&self, name: &str) -> String {
        format!("{name}{}", self.instance().0)
    }

    fn check(&self) -> Result<()> {
        if self.head_dim == 0
            || self.head_dim > WINDOW_ATTENTION_MAX_HEAD
            || !self.head_dim.is_multiple_of(4)
            || self.n_head > 65_535
            || self.b > 65_535
        {
            candle_core::bail!(
                "window-attention on CUDA: {} windows of {} heads of {} (at most {WINDOW_ATTENTION_MAX_HEAD} per head, a multiple of 4)",
                self.b,
                self.n_head,
                self.head_dim
            )
        }
        Ok(())
    }

    /// The kernels' shared arguments after the buffers: t, nh, hs, scale, p, 1 / (1 - p), key, first.
    fn scalars(&self) -> (i32, i32, i32, f32, f32, f32) {
        let keep_scale = if self.p > 0.0 { 1.0 / (1.0 - self.p) } else { 1.0 };
        (
            self.t as i32,
            self.n_head as i32,
            self.head_dim as i32,
            self.scale,
            self.p,
            keep_scale,
        )
    }
}

/// Causal attention over whole windows: `qkv` `(B * T, 3C)` → `(B * T, C)`.
pub fn window_attention(s: &CudaStorage, l: &Layout, a: &WindowAttentionArgs) -> Result<(CudaStorage, Shape)> {
    a.check()?;
    let dev = s.device();
    let qkv = f32_view(s, l, "window-attention")?;
    let c = a.n_head * a.head_dim;
    let y = output(dev, a.b * a.t * c)?; // each warp writes its rows' outputs whole
    let (t, nh, hs, scale, p, keep_scale) = a.scalars();
    crate::launch!(dev, MODULE, &a.kernel("window_attention_fwd"), a.config();
        &qkv, &y, &t, &nh, &hs, &scale, &p, &keep_scale, &a.key, &a.first);
    Ok(wrap(y, dev, Shape::from((a.b * a.t, c))))
}

/// The gradient of [`window_attention`]'s input from the input `qkv`, its output `y` and the
/// output's gradient `dy`: `(B * T, 3C)`.
pub fn window_attention_grad(
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
    a: &WindowAttentionArgs,
) -> Result<(CudaStorage, Shape)> {
    a.check()?;
    let dev = s1.device();
    let qkv = f32_view(s1, l1, "window-attention-grad")?;
    let (y, dy) = (
        f32_view(s2, l2, "window-attention-grad")?,
        f32_view(s3, l3, "window-attention-grad")?,
    );
    let rows = a.b * a.t;
    let c = a.n_head * a.head_dim;
    if qkv.len() != rows * 3 * c || y.len() != rows * c || dy.len() != rows * c {
        candle_core::bail!(
            "window-attention-grad: {} inputs, {} outputs and {} gradients for ({rows}, {c})",
            qkv.len(),
            y.len(),
            dy.len()
        )
    }
    // Every element of dqkv is written: q's columns by the first kernel, k's and v's by the
    // second; the first writes lse_d whole for the second.
    let dqkv = output(dev, rows * 3 * c)?;
    let lse_d = output(dev, 2 * a.b * a.n_head * a.t)?;
    let (t, nh, hs, scale, p, keep_scale) = a.scalars();
    crate::launch!(dev, MODULE, &a.kernel("window_attention_bwd_q"), a.config();
        &qkv, &y, &dy, &dqkv, &lse_d, &t, &nh, &hs, &scale, &p, &keep_scale, &a.key, &a.first);
    crate::launch!(dev, MODULE, &a.kernel("window_attention_bwd_kv"), a.config();
        &qkv, &dy, &lse_d, &dqkv, &t, &nh, &hs, &scale, &p, &keep_scale, &a.key, &a.first);
    Ok(wrap(dqkv, dev, Shape::from((rows, 3 * c))))
}
