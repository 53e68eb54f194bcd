//! The token cache under `OUT/tokens/`: text tokenised once into a flat little-endian file (u16
//! when the vocabulary fits, else u32) and split into train and val, reused while its inputs are
//! unchanged; token files that llm.c or nanoGPT wrote are read where they are instead.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use gpt::files::write_atomic;
use gpt::Tokenizer;
use serde::{Deserialize, Serialize};

use super::batches::{Dataset, Tokens};
use super::sources::{sources, Reading, Source};
use super::token_files::TokenFile;
use super::tokenize::{encode_to_file, token_files};

/// What the cached token files were made from; a change means re-tokenising.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct CacheKey {
    sources: Vec<(PathBuf, u64, u128)>, // path, size, mtime (ns)
    val_data: Option<Vec<(PathBuf, u64, u128)>>,
    val_fraction: f64,
    tokenizer_hash: u64,
    width: usize,
    text_field: String,
}

fn fingerprint(path: &Path) -> Result<(PathBuf, u64, u128)> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    Ok((
        path.canonicalize().unwrap_or_else(|_| path.to_path_buf()),
        meta.len(),
        mtime,
    ))
}

/// Moves the last `n` tokens of the token file `from` into a new file `to`.
fn split_tail(from: &Path, to: &Path, n: u64, width: usize) -> Result<()> {
    let mut src = std::fs::OpenOptions::new().read(true).write(true).open(from)?;
    let len = src.metadata()?.len();
    let keep = len - n * width as u64;
    src.seek(SeekFrom::Start(keep))?;
    let tmp = to.with_extension("tmp");
    let mut dst = std::fs::File::create(&tmp)?;
    std::io::copy(&mut (&mut src).take(n * width as u64), &mut dst)?;
    dst.sync_all()?;
    std::fs::rename(&tmp, to)?;
    src.set_len(keep)?;
    src.sync_all()?;
    Ok(())
}

/// The training and validation tokens of `files` (and `val_data`, or the last `val_fraction` of
/// the training tokens): token files read where they are; text tokenised into `cache_dir`, unless
/// a cache made from the same inputs is already there; both memory-mapped.
pub fn prepare(
    files: &[PathBuf],
    val_data: Option<&Path>,
    val_fraction: f64,
    tokenizer: &Tokenizer,
    cache_dir: &Path,
    reading: &Reading,
) -> Result<Dataset> {
    if files.is_empty() {
        bail!("no training data: pass --data FILE");
    }
    if val_data.is_none() && !(0.0..1.0).contains(&val_fraction) {
        bail!("--val-fraction must be in [0, 1), got {val_fraction}");
    }
    let found = sources(files, reading.format)?;
    let val_found = val_data
        .map(|v| sources(&[v.to_path_buf()], reading.format))
        .transpose()?;
    if let Some(train) = token_files(&found, tokenizer.vocab_size())? {
        let train = Tokens::whole(train);
        return Ok(match &val_found {
            Some(val) => {
                let val = token_files(val, tokenizer.vocab_size())?
                    .context("--val-data must be token files too when --data is")?;
                Dataset {
                    train,
                    val: Tokens::whole(val),
                }
            }
            None => {
                let n_val = (train.len() as f64 * val_fraction).round() as usize;
                let (train, val) = train.split_at(train.len() - n_val);
                Dataset { train, val }
            }
        });
    }
    let width = if tokenizer.vocab_size() <= 1 << 16 { 2 } else { 4 };
    let prints = |found: &[Source]| -> Result<Vec<_>> { found.iter().map(|s| fingerprint(&s.path)).collect() };
    let key = CacheKey {
        sources: prints(&found)?,
        val_data: val_found.as_deref().map(prints).transpose()?,
        val_fraction,
        tokenizer_hash: gpt_kernels::rng::hash_bytes(tokenizer.inner().to_string(false).unwrap_or_default().as_bytes()),
        width,
        text_field: reading.text_field.clone(),
    };
    let (train_path, val_path, key_path) = (
        cache_dir.join("train.bin"),
        cache_dir.join("val.bin"),
        cache_dir.join("key.json"),
    );
    let cached = std::fs::read_to_string(&key_path)
        .ok()
        .and_then(|s| serde_json::from_str::<CacheKey>(&s).ok())
        .is_some_and(|k| k == key);
    if !cached {
        std::fs::create_dir_all(cache_dir).with_context(|| format!("creating {}", cache_dir.display()))?;
        let _ = std::fs::remove_file(&key_path); // the cache is invalid until the key is written
        let field = &reading.text_field;
        let train = encode_to_file(&found, field, tokenizer, width, &train_path)?;
        let (train, val) = match &val_found {
            Some(val) => {
                if token_files(val, tokenizer.vocab_size())?.is_some() {
                    bail!("--val-data is token files but --data is text: give both in one form");
                }
                (train, encode_to_file(val, field, tokenizer, width, &val_path)?)
            }
            None => {
                let n_val = (train as f64 * val_fraction).round() as u64;
                split_tail(&train_path, &val_path, n_val, width)?;
                (train - n_val, n_val)
            }
        };
        write_atomic(&key_path, serde_json::to_string(&key)?.as_bytes())?;
        tracing::info!(train, val, sources = found.len(), "tokenised the corpus");
    }
    Ok(Dataset {
        train: Tokens::whole(vec![TokenFile::raw(&train_path, width)?]),
        val: Tokens::whole(vec![TokenFile::raw(&val_path, width)?]),
    })
}
