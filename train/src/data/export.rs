//! Token files for other trainers (`gpt-train prepare`): llm.c's shards or nanoGPT's `train.bin`
//! and `val.bin`, from the token cache.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use gpt::files::write_atomic;
use gpt::Tokenizer;

use super::cache::prepare;
use super::sources::Reading;
use super::token_files::{nanogpt_meta, DataFormat, TokenWriter, LLMC_SHARD_TOKENS};

/// `gpt-train prepare`: the documents of `data` tokenised by `tokenizer` and written to `out` as
/// `format`'s token files (llm.c's shards `train_000000.bin`, ..., `val_000000.bin`; nanoGPT's
/// `train.bin` and `val.bin`, with `meta.pkl` for a character vocabulary), the validation split
/// from `val_data` or the last `val_fraction` of the tokens; `tokenizer.json` beside them.
/// Returns the files written with their token counts.
pub fn write_token_files(
    data: &[PathBuf],
    val_data: Option<&Path>,
    val_fraction: f64,
    tokenizer: &Tokenizer,
    reading: &Reading,
    format: DataFormat,
    out: &Path,
) -> Result<Vec<(PathBuf, usize)>> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let scratch = out.join(".gpt-train-tokens");
    let dataset = prepare(data, val_data, val_fraction, tokenizer, &scratch, reading)?;
    let mut written = Vec::new();
    for (name, split) in [("train", &dataset.train), ("val", &dataset.val)] {
        let mut writer = TokenWriter::new(out, name, format, tokenizer.vocab_size())?;
        const CHUNK: usize = 1 << 20;
        for start in (0..split.len()).step_by(CHUNK) {
            writer.write(&split.window(start, CHUNK.min(split.len() - start)))?;
        }
        let files = writer.finish()?;
        let mut left = split.len();
        for path in files {
            let n = match format {
                DataFormat::Llmc => left.min(LLMC_SHARD_TOKENS),
                _ => left,
            };
            left -= n;
            written.push((path, n));
        }
    }
    drop(dataset);
    let _ = std::fs::remove_dir_all(&scratch);
    tokenizer.save(&out.join(gpt::checkpoint::TOKENIZER_FILE))?;
    if format == DataFormat::Nanogpt && tokenizer.is_char_level() {
        let mut chars: Vec<(u32, String)> = tokenizer
            .inner()
            .get_vocab(true)
            .into_iter()
            .map(|(s, id)| (id, s))
            .collect();
        chars.sort();
        write_atomic(&out.join("meta.pkl"), &nanogpt_meta(&chars))?;
    }
    Ok(written)
}
