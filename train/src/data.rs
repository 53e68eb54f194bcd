//! Training data: text files → token ids, cached once as a flat little-endian file (u16 when the
//! vocabulary fits, else u32) under `OUT/tokens/`, memory-mapped, split into train and val, and
//! read as random contiguous windows of block_size + 1 tokens from a seeded RNG.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use gpt::checkpoint::write_atomic;
use gpt::Tokenizer;
use memmap2::Mmap;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Reads a corpus file as UTF-8, rejecting empty and non-UTF-8 files by name.
pub fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if bytes.is_empty() {
        bail!("{} is empty", path.display());
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
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

fn encode_files(files: &[PathBuf], tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for path in files {
        let text = read_text(path)?;
        ids.extend(
            tokenizer
                .encode(&text)
                .with_context(|| format!("tokenising {}", path.display()))?,
        );
    }
    Ok(ids)
}

fn write_tokens(path: &Path, ids: &[u32], width: usize) -> Result<()> {
    let bytes: Vec<u8> = match width {
        2 => ids.iter().flat_map(|&id| (id as u16).to_le_bytes()).collect(),
        _ => ids.iter().flat_map(|&id| id.to_le_bytes()).collect(),
    };
    Ok(write_atomic(path, &bytes)?)
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
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    tokenizer.inner().to_string(false).unwrap_or_default().hash(&mut hasher);
    let key = CacheKey {
        sources: files.iter().map(|p| fingerprint(p)).collect::<Result<_>>()?,
        val_data: val_data.map(fingerprint).transpose()?,
        val_fraction,
        tokenizer_hash: hasher.finish(),
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
        let mut train = encode_files(files, tokenizer)?;
        let val = match val_data {
            Some(path) => encode_files(&[path.to_path_buf()], tokenizer)?,
            None => {
                let n_val = (train.len() as f64 * val_fraction).round() as usize;
                train.split_off(train.len() - n_val)
            }
        };
        write_tokens(&train_path, &train, width)?;
        write_tokens(&val_path, &val, width)?;
        write_atomic(&key_path, serde_json::to_string(&key)?.as_bytes())?;
        tracing::info!(train = train.len(), val = val.len(), "tokenised the corpus");
    }
    Ok(Dataset {
        train: Tokens::open(&train_path, width)?,
        val: Tokens::open(&val_path, width)?,
    })
}

/// A generator for one batch, derived from (seed, step, stream): the batches of a step do not
/// depend on anything that happened before it, so a resumed run draws the same ones.
pub fn batch_rng(seed: u64, step: usize, stream: u64) -> rand::rngs::StdRng {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (seed, step as u64, stream).hash(&mut h);
    rand::rngs::StdRng::seed_from_u64(h.finish())
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
