//! The tokenizer a run uses, as `--tokenizer` names it: trained on the data (`char`, `bpe:N`), a
//! tokenizer.json, or a Hub model's; `gpt-train tokenizer` saves one on its own.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use gpt::{checkpoint, Tokenizer};

use crate::data;

/// The tokenizer `spec` names: `char` or `bpe:N` trained on `data` (documents of JSON lines and
/// parquet written as text under `scratch/tokens/` first), a tokenizer.json (or a directory
/// holding one), or a Hub model's tokenizer.
pub fn build_tokenizer(spec: &str, data: &[PathBuf], reading: &data::Reading, scratch: &Path) -> Result<Tokenizer> {
    if spec == "char" || spec.starts_with("bpe:") {
        if data.is_empty() {
            bail!("no training data: pass --data FILE");
        }
        // Empty, non-UTF-8 and malformed files are named before tokenizer training.
        let text = scratch.join("tokens").join("tokenizer-corpus");
        let files = data::text_files(data, reading, &text)?;
        let tok = match spec.strip_prefix("bpe:") {
            None => Tokenizer::train_char(&files)?,
            Some(n) => {
                let n: usize = n
                    .parse()
                    .with_context(|| format!("--tokenizer {spec}: N must be a number"))?;
                Tokenizer::train_bpe(&files, n)?
            }
        };
        let _ = std::fs::remove_dir_all(&text);
        return Ok(tok);
    }
    let path = PathBuf::from(spec);
    if path.exists() {
        let path = if path.is_dir() {
            path.join(checkpoint::TOKENIZER_FILE)
        } else {
            path
        };
        return Ok(Tokenizer::from_file(&path)?);
    }
    match gpt::hub::HubId::parse(spec, gpt::hub::RepoKind::Model) {
        Some(id) => Ok(checkpoint::fetch_tokenizer(&id).with_context(|| format!("--tokenizer {spec}"))?),
        None => bail!(
            "--tokenizer {spec}: expected char, bpe:N, the path of a tokenizer.json, or a Hub model id (not found)"
        ),
    }
}
