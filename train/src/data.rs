//! Training data: text files (or directories of `.txt` files), each a document, → token ids,
//! documents separated by the end-of-text token where the tokenizer has one. Tokenised once,
//! streamed piece by piece into a flat little-endian file (u16 when the vocabulary fits, else u32)
//! under `OUT/tokens/`, so that a corpus of any size needs little memory; memory-mapped, split
//! into train and val, and read as random contiguous windows of block_size + 1 tokens from a
//! seeded RNG.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use gpt::files::write_atomic;
use gpt::Tokenizer;
use memmap2::Mmap;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Bytes of text tokenised at a time: the tokenizer's encoding of a piece (a string and offsets
/// per token) takes about 200 bytes per token, so pieces stay small.
const PIECE: usize = 64 << 10;

/// The documents of `--data`: each file, and the `.txt` files under each directory (recursively,
/// sorted by path). A directory without any is an error naming it.
pub fn documents(data: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .map(|e| Ok(e?.path()))
            .collect::<std::io::Result<_>>()
            .with_context(|| format!("reading {}", dir.display()))?;
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(&path, out)?;
            } else if path.extension().is_some_and(|e| e == "txt") {
                out.push(path);
            }
        }
        Ok(())
    }
    let mut files = Vec::new();
    for path in data {
        if path.is_dir() {
            let before = files.len();
            walk(path, &mut files)?;
            if files.len() == before {
                bail!("{} holds no .txt files", path.display());
            }
        } else {
            files.push(path.clone());
        }
    }
    Ok(files)
}

/// Reads a text file whole as UTF-8 (for evaluation), rejecting empty and non-UTF-8 files by name.
pub fn read_text(path: &Path) -> Result<String> {
    let text = gpt::files::read_utf8(path)?;
    if text.is_empty() {
        bail!("{} is empty", path.display());
    }
    Ok(text)
}

/// Checks that a corpus file is non-empty UTF-8 (reading it piece by piece); errors name it.
pub fn check_text(path: &Path) -> Result<()> {
    if gpt::files::for_each_piece(path, PIECE, |_| Ok(()))? == 0 {
        bail!("{} is empty", path.display());
    }
    Ok(())
}

/// One split's tokens, memory-mapped.
pub struct Tokens {
    mmap: Option<Mmap>, // None for an empty split (a zero-length file cannot be mapped)
    width: usize,       // bytes per token: 2 or 4
}

impl Tokens {
    fn open(path: &Path, width: usize) -> Result<Self> {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let len = file.metadata()?.len();
        if len % width as u64 != 0 {
            bail!(
                "{}: size {len} is not a multiple of {width}; delete it to re-tokenise",
                path.display()
            );
        }
        // SAFETY: the token files are written once (atomically) by `prepare` and never modified.
        let mmap = if len == 0 {
            None
        } else {
            Some(unsafe { Mmap::map(&file) }?)
        };
        Ok(Self { mmap, width })
    }

    pub fn len(&self) -> usize {
        self.mmap.as_ref().map_or(0, |m| m.len() / self.width)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tokens `start..start + n`.
    pub fn window(&self, start: usize, n: usize) -> Vec<u32> {
        let bytes = match &self.mmap {
            Some(m) => &m[start * self.width..(start + n) * self.width],
            None => return vec![],
        };
        match self.width {
            2 => bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as u32)
                .collect(),
            _ => bytes
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        }
    }
}

pub struct Dataset {
    pub train: Tokens,
    pub val: Tokens,
}

/// What the cached token files were made from; a change means re-tokenising.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct CacheKey {
    sources: Vec<(PathBuf, u64, u128)>, // path, size, mtime (ns)
    val_data: Option<(PathBuf, u64, u128)>,
    val_fraction: f64,
    tokenizer_hash: u64,
    width: usize,
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

/// A progress bar over bytes on a terminal.
fn progress(total: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal().then(|| {
        let bar = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "tokenising {bar:30.cyan/blue} {bytes}/{total_bytes} ({bytes_per_sec}, ETA {eta})",
        ) {
            bar.set_style(style);
        }
        bar
    })
}

/// Tokenises `files` as documents into `path`, tokens of `width` bytes, piece by piece; returns
/// the number of tokens.
fn encode_to_file(files: &[PathBuf], tokenizer: &Tokenizer, width: usize, path: &Path) -> Result<u64> {
    let total: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    let bar = progress(total);
    let tmp = path.with_extension("tmp");
    let mut out =
        std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let mut count = 0u64;
    let mut write = |ids: &[u32], out: &mut std::io::BufWriter<std::fs::File>| -> Result<()> {
        for &id in ids {
            match width {
                2 => out.write_all(&(id as u16).to_le_bytes())?,
                _ => out.write_all(&id.to_le_bytes())?,
            }
        }
        count += ids.len() as u64;
        Ok(())
    };
    for (i, file) in files.iter().enumerate() {
        if let (true, Some(eot)) = (i > 0, tokenizer.eos_token_id()) {
            write(&[eot], &mut out)?;
        }
        let bytes = gpt::files::for_each_piece(file, PIECE, |piece| {
            let ids = tokenizer
                .encode(piece)
                .map_err(|e| gpt::Error::Tokenize(format!("{}: {e}", file.display())))?;
            write(&ids, &mut out).map_err(|e| gpt::Error::Tokenize(e.to_string()))?;
            if let Some(bar) = &bar {
                bar.inc(piece.len() as u64);
            }
            Ok(())
        })?;
        if bytes == 0 {
            bail!("{} is empty", file.display());
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let file = out
        .into_inner()
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", tmp.display()))?;
    file.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(count)
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

/// Tokenises `files` (and `val_data`, or the last `val_fraction` of the tokens) into
/// `cache_dir`, unless a cache made from the same inputs is already there, and maps it.
pub fn prepare(
    files: &[PathBuf],
    val_data: Option<&Path>,
    val_fraction: f64,
    tokenizer: &Tokenizer,
    cache_dir: &Path,
) -> Result<Dataset> {
    if files.is_empty() {
        bail!("no training data: pass --data FILE");
    }
    if val_data.is_none() && !(0.0..1.0).contains(&val_fraction) {
        bail!("--val-fraction must be in [0, 1), got {val_fraction}");
    }
    let width = if tokenizer.vocab_size() <= 1 << 16 { 2 } else { 4 };
    let docs = documents(files)?;
    let key = CacheKey {
        sources: docs.iter().map(|p| fingerprint(p)).collect::<Result<_>>()?,
        val_data: val_data.map(fingerprint).transpose()?,
        val_fraction,
        tokenizer_hash: gpt::rng::hash_bytes(tokenizer.inner().to_string(false).unwrap_or_default().as_bytes()),
        width,
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
        let train = encode_to_file(&docs, tokenizer, width, &train_path)?;
        let (train, val) = match val_data {
            Some(path) => (
                train,
                encode_to_file(&[path.to_path_buf()], tokenizer, width, &val_path)?,
            ),
            None => {
                let n_val = (train as f64 * val_fraction).round() as u64;
                split_tail(&train_path, &val_path, n_val, width)?;
                (train - n_val, n_val)
            }
        };
        write_atomic(&key_path, serde_json::to_string(&key)?.as_bytes())?;
        tracing::info!(train, val, documents = docs.len(), "tokenised the corpus");
    }
    Ok(Dataset {
        train: Tokens::open(&train_path, width)?,
        val: Tokens::open(&val_path, width)?,
    })
}

/// A generator for one batch, derived from (seed, step, stream): the batches of a step do not
/// depend on anything that happened before it, so a resumed run draws the same ones.
pub fn batch_rng(seed: u64, step: usize, stream: u64) -> rand_chacha::ChaCha12Rng {
    rand_chacha::ChaCha12Rng::seed_from_u64(gpt::rng::key(&[seed, step as u64, stream]))
}

/// `batch_size` random windows: inputs `(B, T)` and next-token targets `(B, T)`.
pub fn get_batch(
    tokens: &Tokens,
    batch_size: usize,
    block_size: usize,
    rng: &mut impl Rng,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    if tokens.len() < block_size + 1 {
        bail!(
            "split has {} tokens, but a block of {block_size} needs at least {}",
            tokens.len(),
            block_size + 1
        );
    }
    let (mut x, mut y) = (
        Vec::with_capacity(batch_size * block_size),
        Vec::with_capacity(batch_size * block_size),
    );
    for _ in 0..batch_size {
        let start = rng.random_range(0..=tokens.len() - block_size - 1);
        let w = tokens.window(start, block_size + 1);
        x.extend_from_slice(&w[..block_size]);
        y.extend_from_slice(&w[1..]);
    }
    Ok((
        Tensor::from_vec(x, (batch_size, block_size), device)?,
        Tensor::from_vec(y, (batch_size, block_size), device)?,
    ))
}
