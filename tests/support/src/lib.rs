//! Helpers shared by the test suites of every crate (a dev-dependency of each): the repository's
//! files and corpus, tensor comparisons, and [`fake_hub`], a stand-in for the Hugging Face Hub.

pub mod fake_hub;

use std::path::{Path, PathBuf};

use candle_core::Tensor;

/// `path` under the repository root.
pub fn repo(path: &str) -> PathBuf {
    // This crate sits at tests/support.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(path)
}

/// The repository's copy of tinyshakespeare (`data/`).
pub fn shakespeare_path() -> PathBuf {
    repo("data/tinyshakespeare.txt")
}

/// The first `chars` characters of tinyshakespeare (all of it for `usize::MAX`).
pub fn shakespeare(chars: usize) -> anyhow::Result<String> {
    let path = shakespeare_path();
    let text = std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(text.chars().take(chars).collect())
}

/// The largest absolute difference between two tensors of one shape (on `a`'s device).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> anyhow::Result<f32> {
    let b = b.to_device(a.device())?;
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// The Python the tests that need its packages run (`GPT_TEST_PYTHON`, which the build scripts
/// probe), else `python3`.
pub fn python() -> String {
    std::env::var("GPT_TEST_PYTHON").unwrap_or_else(|_| "python3".into())
}
