//! Token files as other trainers write them, read where they are (memory-mapped, no copy) and
//! written by `gpt-train prepare`:
//! - llm.c's shards (`dev/data/data_common.py`'s `write_datafile`): a header of 256 little-endian
//!   int32 (magic 20240520, version 1 for uint16 tokens or 2 for uint32, the token count), then
//!   the tokens;
//! - nanoGPT's `train.bin` / `val.bin` (`prepare.py`): uint16 tokens and nothing else, with
//!   `meta.pkl` beside them for a character vocabulary.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use memmap2::Mmap;

/// llm.c's magic number, the first int32 of a shard.
pub const LLMC_MAGIC: i32 = 20240520;
/// llm.c's header: 256 int32.
pub const LLMC_HEADER: usize = 256 * 4;
/// Tokens per llm.c shard that `prepare` writes (fineweb.py writes 10^8).
pub const LLMC_SHARD_TOKENS: usize = 100_000_000;

/// How `--data` is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DataFormat {
    /// By each file's name: `.txt` (or any other) text, `.jsonl` JSON lines, `.parquet`, and
    /// `.bin` token files (llm.c's when the header says so, else nanoGPT's uint16).
    #[default]
    Auto,
    /// Text in any of the formats above (a `.bin` file read as text).
    Text,
    /// llm.c's token shards.
    Llmc,
    /// nanoGPT's raw uint16 token files.
    Nanogpt,
    /// Conversations for chat fine-tuning, JSON lines: each line's `messages` (OpenAI's roles,
    /// as Hugging Face chat datasets hold them), or its `prompt` and `completion` (strings, or
    /// lists of messages). Rendered with the model's chat template, the loss on the assistant's
    /// tokens (the completion's) only (`data::chat`).
    Chat,
}

/// The token format of a file under `format`, or `None` for text.
pub fn token_format(path: &Path, format: DataFormat) -> Result<Option<DataFormat>> {
    Ok(match format {
        DataFormat::Llmc | DataFormat::Nanogpt => Some(format),
        DataFormat::Text | DataFormat::Chat => None,
        DataFormat::Auto if path.extension().is_some_and(|e| e == "bin") => Some(if is_llmc(path)? {
            DataFormat::Llmc
        } else {
            DataFormat::Nanogpt
        }),
        DataFormat::Auto => None,
    })
}

/// Whether `path` starts with llm.c's magic number.
fn is_llmc(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut magic = [0u8; 4];
    Ok(file.read_exact(&mut magic).is_ok() && i32::from_le_bytes(magic) == LLMC_MAGIC)
}

/// One token file, mapped: its tokens start `offset` bytes in, `width` bytes each.
pub struct TokenFile {
    pub path: PathBuf,
    mmap: Option<Mmap>,
    offset: usize,
    width: usize,
    len: usize,
}

impl TokenFile {
    /// Opens and checks a token file in `format` (llm.c or nanoGPT): the header (magic,
    /// version, count against the file's size) or the byte count, and every token against
    /// `vocab_size` (an id outside it is an error naming the file and the token's position).
    pub fn open(path: &Path, format: DataFormat, vocab_size: usize) -> Result<Self> {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let size = file.metadata()?.len() as usize;
        // SAFETY: the file is mapped read-only; as with any memory-mapped input, it must not be
        // changed by another process while training reads it.
        let mmap = if size == 0 {
            None
        } else {
            Some(unsafe { Mmap::map(&file) }?)
        };
        let bytes: &[u8] = mmap.as_deref().unwrap_or(&[]);
        let (offset, width, len) = match format {
            DataFormat::Llmc => {
                if size < LLMC_HEADER {
                    bail!(
                        "{}: {size} bytes, shorter than llm.c's {LLMC_HEADER}-byte header",
                        path.display()
                    );
                }
                let int =
                    |i: usize| i32::from_le_bytes([bytes[4 * i], bytes[4 * i + 1], bytes[4 * i + 2], bytes[4 * i + 3]]);
                if int(0) != LLMC_MAGIC {
                    bail!(
                        "{}: magic number {} at byte 0, not llm.c's {LLMC_MAGIC}: not an llm.c token shard",
                        path.display(),
                        int(0)
                    );
                }
                let width = match int(1) {
                    1 => 2,
                    2 => 4,
                    v => bail!(
                        "{}: llm.c format version {v} (header int 1); this reads versions 1 (uint16) and 2 (uint32)",
                        path.display()
                    ),
                };
                let count = int(2);
                if count < 0 || LLMC_HEADER + count as usize * width != size {
                    bail!(
                        "{}: the header announces {count} tokens of {width} bytes ({} bytes with the header), but the \
                         file has {size} bytes",
                        path.display(),
                        LLMC_HEADER as i64 + count as i64 * width as i64
                    );
                }
                (LLMC_HEADER, width, count as usize)
            }
            _ => {
                if !size.is_multiple_of(2) {
                    bail!(
                        "{}: {size} bytes, an odd count: not uint16 tokens (nanoGPT's train.bin / val.bin)",
                        path.display()
                    );
                }
                (0, 2, size / 2)
            }
        };
        let tokens = Self {
            path: path.to_path_buf(),
            mmap,
            offset,
            width,
            len,
        };
        tokens.check_vocab(vocab_size)?;
        Ok(tokens)
    }

    /// A flat file of little-endian tokens of `width` bytes that this trainer wrote itself (its
    /// token cache): mapped as it is, unchecked.
    pub fn raw(path: &Path, width: usize) -> Result<Self> {
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let size = file.metadata()?.len() as usize;
        if !size.is_multiple_of(width) {
            bail!(
                "{}: size {size} is not a multiple of {width}; delete it to re-tokenise",
                path.display()
            );
        }
        // SAFETY: the token cache is written once (atomically) by `prepare` and never modified.
        let mmap = if size == 0 {
            None
        } else {
            Some(unsafe { Mmap::map(&file) }?)
        };
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            offset: 0,
            width,
            len: size / width,
        })
    }

    fn check_vocab(&self, vocab_size: usize) -> Result<()> {
        const CHUNK: usize = 1 << 20;
        for start in (0..self.len).step_by(CHUNK) {
            let window = self.window(start, CHUNK.min(self.len - start));
            if let Some(i) = window.iter().position(|&t| t as usize >= vocab_size) {
                bail!(
                    "{}: token {} at position {} (byte {}) is outside the tokenizer's vocabulary of {vocab_size}; \
                     pass the --tokenizer the tokens were made with",
                    self.path.display(),
                    window[i],
                    start + i,
                    self.offset + (start + i) * self.width
                );
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens `start..start + n`.
    pub fn window(&self, start: usize, n: usize) -> Vec<u32> {
        let Some(m) = &self.mmap else { return vec![] };
        let bytes = &m[self.offset + start * self.width..self.offset + (start + n) * self.width];
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

/// Writes token files in a trainer's format, a token at a time: llm.c shards of
/// [`LLMC_SHARD_TOKENS`] (`NAME_000000.bin`, ...; the header's count is written when a shard
/// closes), or one nanoGPT file (`NAME.bin`). Each file is written under a temporary name and
/// renamed when complete.
pub struct TokenWriter {
    dir: PathBuf,
    name: String,
    format: DataFormat,
    width: usize,
    shard: usize,
    in_shard: usize,
    file: Option<(std::io::BufWriter<std::fs::File>, PathBuf)>,
    pub written: Vec<PathBuf>,
}

impl TokenWriter {
    pub fn new(dir: &Path, name: &str, format: DataFormat, vocab_size: usize) -> Result<Self> {
        let width = match format {
            DataFormat::Llmc if vocab_size > 1 << 16 => 4,
            DataFormat::Llmc => 2,
            DataFormat::Nanogpt if vocab_size > 1 << 16 => bail!(
                "nanoGPT's token files hold uint16 ids; this tokenizer has {vocab_size} tokens (use --format llmc)"
            ),
            DataFormat::Nanogpt => 2,
            other => bail!("token files are written as llmc or nanogpt, not {other:?}"),
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            name: name.to_string(),
            format,
            width,
            shard: 0,
            in_shard: 0,
            file: None,
            written: Vec::new(),
        })
    }

    fn final_path(&self) -> PathBuf {
        match self.format {
            DataFormat::Llmc => self.dir.join(format!("{}_{:06}.bin", self.name, self.shard)),
            _ => self.dir.join(format!("{}.bin", self.name)),
        }
    }

    fn open(&mut self) -> Result<()> {
        let path = self.final_path();
        let tmp = path.with_extension("bin.tmp");
        let mut file = std::io::BufWriter::new(
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?,
        );
        if self.format == DataFormat::Llmc {
            file.write_all(&[0u8; LLMC_HEADER])?; // filled in when the shard closes
        }
        self.file = Some((file, tmp));
        self.in_shard = 0;
        Ok(())
    }

    pub fn write(&mut self, ids: &[u32]) -> Result<()> {
        for &id in ids {
            if self.file.is_none() {
                self.open()?;
            }
            if let Some((file, tmp)) = &mut self.file {
                let result = match self.width {
                    2 => file.write_all(&(id as u16).to_le_bytes()),
                    _ => file.write_all(&id.to_le_bytes()),
                };
                result.with_context(|| format!("writing {}", tmp.display()))?;
            }
            self.in_shard += 1;
            if self.format == DataFormat::Llmc && self.in_shard == LLMC_SHARD_TOKENS {
                self.close()?;
                self.shard += 1;
            }
        }
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        let Some((file, tmp)) = self.file.take() else {
            return Ok(());
        };
        let mut file = file
            .into_inner()
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", tmp.display()))?;
        if self.format == DataFormat::Llmc {
            use std::io::{Seek, SeekFrom};
            let mut header = [0i32; 256];
            header[0] = LLMC_MAGIC;
            header[1] = if self.width == 2 { 1 } else { 2 };
            header[2] = i32::try_from(self.in_shard).context("an llm.c shard holds at most 2^31 tokens")?;
            let bytes: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&bytes)?;
        }
        file.sync_all()?;
        let path = self.final_path();
        std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
        self.written.push(path);
        Ok(())
    }

    /// Closes the last file (a split with no tokens still gets its file).
    pub fn finish(mut self) -> Result<Vec<PathBuf>> {
        if self.file.is_none() && self.written.is_empty() {
            self.open()?;
        }
        self.close()?;
        Ok(self.written)
    }
}

/// nanoGPT's `meta.pkl` for a character vocabulary: `{'vocab_size': N, 'itos': {i: ch},
/// 'stoi': {ch: i}}` as Python's pickle (protocol 2), which nanoGPT's `train.py` reads for the
/// vocabulary size and `sample.py` for decoding. (No pickle crate: this one dictionary is a few
/// opcodes.)
pub fn nanogpt_meta(chars: &[(u32, String)]) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.push(b'X'); // BINUNICODE
        out.extend((s.len() as u32).to_le_bytes());
        out.extend(s.as_bytes());
    }
    fn int(out: &mut Vec<u8>, v: u32) {
        out.push(b'J'); // BININT
        out.extend((v as i32).to_le_bytes());
    }
    let mut out = vec![0x80, 2, b'}', b'(']; // PROTO 2, EMPTY_DICT, MARK
    string(&mut out, "vocab_size");
    int(&mut out, chars.len() as u32);
    string(&mut out, "itos");
    out.extend([b'}', b'(']);
    for (id, ch) in chars {
        int(&mut out, *id);
        string(&mut out, ch);
    }
    out.push(b'u'); // SETITEMS
    string(&mut out, "stoi");
    out.extend([b'}', b'(']);
    for (id, ch) in chars {
        string(&mut out, ch);
        int(&mut out, *id);
    }
    out.extend([b'u', b'u', b'.']); // SETITEMS (inner), SETITEMS (outer), STOP
    out
}
