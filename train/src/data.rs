//! Training data: the documents of `--data` (text files, JSON lines, parquet, directories of
//! them, Hub datasets: see [`crate::sources`]) → token ids, documents separated by the
//! end-of-text token where the tokenizer has one. Tokenised once, streamed piece by piece into a
//! flat little-endian file (u16 when the vocabulary fits, else u32) under `OUT/tokens/`, so that
//! a corpus of any size needs little memory; or, for token files that llm.c or nanoGPT wrote,
//! read where they are. Memory-mapped, split into train and val, and read as random contiguous
//! windows of block_size + 1 tokens from a seeded RNG.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use gpt::files::write_atomic;
use gpt::Tokenizer;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::sources::{sources, Kind, Source};
use crate::token_files::{DataFormat, TokenFile};

/// How the text of `--data` is found in its documents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    /// JSON lines' field and parquet's column holding the text.
    pub text_field: String,
    pub format: DataFormat,
}

impl Default for Reading {
    fn default() -> Self {
        Self {
            text_field: "text".into(),
            format: DataFormat::Auto,
        }
    }
}

/// Checks that every text source of `data` is readable, non-empty UTF-8 (reading it through),
/// so that a bad file is named before any tokenizer training; returns the sources.
pub fn checked_sources(data: &[PathBuf], reading: &Reading) -> Result<Vec<Source>> {
    let found = sources(data, reading.format)?;
    for source in &found {
        if !matches!(source.kind, Kind::Tokens(_)) {
            source.for_each_document(&reading.text_field, |_, _| Ok(()))?;
        }
    }
    Ok(found)
}

/// The text sources of `data` as plain text files a tokenizer can be trained on: text files as
/// they are, the documents of JSON lines and parquet written under `scratch` (a document per
/// paragraph). Token files have no text: an error says to name their tokenizer.
pub fn text_files(data: &[PathBuf], reading: &Reading, scratch: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for (i, source) in checked_sources(data, reading)?.iter().enumerate() {
        match source.kind {
            Kind::Text => out.push(source.path.clone()),
            Kind::Tokens(_) => bail!(
                "{} holds tokens, not text: a tokenizer cannot be trained on it; pass the one the tokens were \
                 made with (--tokenizer PATH/tokenizer.json or a Hub id such as gpt2)",
                source.path.display()
            ),
            _ => {
                std::fs::create_dir_all(scratch).with_context(|| format!("creating {}", scratch.display()))?;
                let path = scratch.join(format!("{i:05}.txt"));
                let mut file = std::io::BufWriter::new(
                    std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?,
                );
                source.for_each_document(&reading.text_field, |text, _| {
                    file.write_all(text.as_bytes())?;
                    file.write_all(b"\n\n")?;
                    Ok(())
                })?;
                file.flush()?;
                out.push(path);
            }
        }
    }
    Ok(out)
}

/// The tokens of `data` (a file, a directory, a Hub dataset, or token files) for evaluation:
/// documents separated by the end-of-text token as in training; with the UTF-8 bytes of their
/// text (of token files: of the decoded text).
pub fn tokens_of(data: &Path, reading: &Reading, tokenizer: &Tokenizer) -> Result<(Vec<u32>, usize)> {
    let found = sources(&[data.to_path_buf()], reading.format)?;
    let mut ids = Vec::new();
    let mut bytes = 0usize;
    if found.iter().all(|s| matches!(s.kind, Kind::Tokens(_))) && !found.is_empty() {
        for source in &found {
            let Kind::Tokens(format) = source.kind else { continue };
            let file = TokenFile::open(&source.path, format, tokenizer.vocab_size())?;
            ids.extend(file.window(0, file.len()));
        }
        bytes = tokenizer.decode(&ids)?.len();
        return Ok((ids, bytes));
    }
    let mut documents = 0usize;
    for source in &found {
        source.for_each_document(&reading.text_field, |text, first| {
            if let (true, true, Some(eot)) = (first, documents > 0, tokenizer.eos_token_id()) {
                ids.push(eot);
            }
            documents += usize::from(first);
            ids.extend(tokenizer.encode(text)?);
            bytes += text.len();
            Ok(())
        })?;
    }
    Ok((ids, bytes))
}

/// One split's tokens: ranges of memory-mapped token files, one after another.
#[derive(Clone)]
pub struct Tokens {
    parts: Vec<(Arc<TokenFile>, std::ops::Range<usize>)>,
    /// Tokens before each part.
    starts: Vec<usize>,
    len: usize,
}

impl Tokens {
    fn new(parts: Vec<(Arc<TokenFile>, std::ops::Range<usize>)>) -> Self {
        let parts: Vec<_> = parts.into_iter().filter(|(_, r)| !r.is_empty()).collect();
        let mut starts = Vec::with_capacity(parts.len());
        let mut len = 0;
        for (_, range) in &parts {
            starts.push(len);
            len += range.len();
        }
        Self { parts, starts, len }
    }

    fn whole(files: Vec<TokenFile>) -> Self {
        Self::new(
            files
                .into_iter()
                .map(|f| {
                    let n = f.len();
                    (Arc::new(f), 0..n)
                })
                .collect(),
        )
    }

    /// The first `at` tokens and the rest.
    fn split_at(&self, at: usize) -> (Self, Self) {
        let (mut head, mut tail) = (Vec::new(), Vec::new());
        for ((file, range), &start) in self.parts.iter().zip(&self.starts) {
            let cut = at.saturating_sub(start).min(range.len());
            head.push((file.clone(), range.start..range.start + cut));
            tail.push((file.clone(), range.start + cut..range.end));
        }
        (Self::new(head), Self::new(tail))
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens `start..start + n` (across files where a window spans two).
    pub fn window(&self, start: usize, n: usize) -> Vec<u32> {
        let mut out = Vec::with_capacity(n);
        let mut part = self.starts.partition_point(|&s| s <= start).saturating_sub(1);
        let mut at = start;
        while out.len() < n && part < self.parts.len() {
            let (file, range) = &self.parts[part];
            let offset = at - self.starts[part];
            let take = (n - out.len()).min(range.len() - offset);
            out.extend(file.window(range.start + offset, take));
            at += take;
            part += 1;
        }
        out
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

/// Tokenises the documents of `sources` into `path`, tokens of `width` bytes, piece by piece,
/// separated by the end-of-text token where the tokenizer has one; returns the number of tokens.
fn encode_to_file(sources: &[Source], field: &str, tokenizer: &Tokenizer, width: usize, path: &Path) -> Result<u64> {
    let total: u64 = sources
        .iter()
        .filter_map(|s| std::fs::metadata(&s.path).ok())
        .map(|m| m.len())
        .sum();
    let bar = progress(total);
    let tmp = path.with_extension("tmp");
    let mut out =
        std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    let mut count = 0u64;
    let mut documents = 0u64;
    let mut done = 0u64;
    for source in sources {
        source.for_each_document(field, |text, first| {
            if first {
                if let (true, Some(eot)) = (documents > 0, tokenizer.eos_token_id()) {
                    write_ids(&mut out, &[eot], width)?;
                    count += 1;
                }
                documents += 1;
            }
            let ids = tokenizer
                .encode(text)
                .with_context(|| format!("tokenising {}", source.path.display()))?;
            write_ids(&mut out, &ids, width)?;
            count += ids.len() as u64;
            if let (Some(bar), Kind::Text) = (&bar, source.kind) {
                bar.inc(text.len() as u64);
            }
            Ok(())
        })?;
        done += std::fs::metadata(&source.path).map_or(0, |m| m.len());
        if let Some(bar) = &bar {
            bar.set_position(done);
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

fn write_ids(out: &mut impl Write, ids: &[u32], width: usize) -> Result<()> {
    for &id in ids {
        match width {
            2 => out.write_all(&(id as u16).to_le_bytes())?,
            _ => out.write_all(&id.to_le_bytes())?,
        }
    }
    Ok(())
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

/// The token files among `found`, opened and checked against the vocabulary; an error if they
/// are mixed with text.
fn token_files(found: &[Source], vocab_size: usize) -> Result<Option<Vec<TokenFile>>> {
    let tokens = found.iter().filter(|s| matches!(s.kind, Kind::Tokens(_))).count();
    if tokens == 0 {
        return Ok(None);
    }
    if tokens < found.len() {
        bail!(
            "--data mixes token files with text ({} and {}): give one or the other",
            found
                .iter()
                .find(|s| matches!(s.kind, Kind::Tokens(_)))
                .map_or(String::new(), |s| s.path.display().to_string()),
            found
                .iter()
                .find(|s| !matches!(s.kind, Kind::Tokens(_)))
                .map_or(String::new(), |s| s.path.display().to_string())
        );
    }
    found
        .iter()
        .map(|s| match s.kind {
            Kind::Tokens(format) => TokenFile::open(&s.path, format, vocab_size),
            _ => unreachable!("all token files"),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
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
    use crate::token_files::{nanogpt_meta, TokenWriter};
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
                DataFormat::Llmc => left.min(crate::token_files::LLMC_SHARD_TOKENS),
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

/// A generator for one batch, derived from (seed, step, stream): the batches of a step do not
/// depend on anything that happened before it, so a resumed run draws the same ones.
pub fn batch_rng(seed: u64, step: usize, stream: u64) -> rand_chacha::ChaCha12Rng {
    rand_chacha::ChaCha12Rng::seed_from_u64(gpt_kernels::rng::key(&[seed, step as u64, stream]))
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
