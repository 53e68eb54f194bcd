//! Reading and writing files: text that must be UTF-8, and writes that are all or nothing. Used
//! by checkpoints, tokenizers and the trainer alike.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so a
/// reader never sees a half-written file and a crash leaves the old file in place.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// A UTF-8 text file; an error names the file and the first invalid byte.
pub fn read_utf8(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
    String::from_utf8(bytes).map_err(|e| Error::NotText {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

/// The tensors of a safetensors file, each read into memory of its own: at most the tensors and
/// the largest of them in memory while reading. (candle's `safetensors::load` reads the whole
/// file into one buffer and copies each tensor out of it, twice the file at its peak, the
/// largest memory of a LoRA run over GPT-2 small with activation checkpointing.) An error names
/// the file and what is wrong in it.
pub fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let corrupt = |reason: String| Error::CorruptCheckpoint {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| corrupt("shorter than its header's length".into()))?;
    let n = u64::from_le_bytes(n);
    if n > (100 << 20) || 8 + n > len {
        return Err(corrupt(format!("a header of {n} bytes in a file of {len}")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(|e| Error::io(path, e))?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| corrupt(format!("its header: {e}")))?;
    let data = 8 + n;
    let mut out = HashMap::new();
    for (name, info) in meta.tensors() {
        use safetensors::Dtype as S;
        let dtype = match info.dtype {
            S::F32 => DType::F32,
            S::F16 => DType::F16,
            S::BF16 => DType::BF16,
            S::F64 => DType::F64,
            S::U8 => DType::U8,
            S::U32 => DType::U32,
            S::I64 => DType::I64,
            other => return Err(corrupt(format!("tensor `{name}` is {other:?}, a dtype not read here"))),
        };
        let (start, end) = info.data_offsets;
        let bytes = info.shape.iter().product::<usize>() * dtype.size_in_bytes();
        if end < start || end - start != bytes || data + end as u64 > len {
            return Err(corrupt(format!(
                "tensor `{name}` ({:?}, {:?}) at bytes {start}..{end} of {} (truncated?)",
                info.dtype,
                info.shape,
                len - data
            )));
        }
        let mut buf = vec![0u8; bytes];
        file.seek(SeekFrom::Start(data + start as u64))
            .and_then(|_| file.read_exact(&mut buf))
            .map_err(|e| Error::io(path, e))?;
        let tensor = Tensor::from_raw_buffer(&buf, dtype, &info.shape, device)?;
        out.insert(name, tensor);
    }
    Ok(out)
}

/// Bytes a piece of [`for_each_piece`] may grow to while looking for a place to end.
const MAX_PIECE: usize = 64 << 20;

/// Reads a UTF-8 text file in pieces of about `target` bytes and calls `f` with each, so that a
/// corpus of any size is read in bounded memory. A piece ends just after a newline that a
/// non-space character follows: GPT-2's byte-level pre-tokenizer never joins text across such a
/// place (nor does a character vocabulary), so the pieces encode to the tokens of the whole text.
/// A line longer than 64 MiB is cut at a character boundary. Returns the file's size in bytes;
/// an invalid byte is an error naming the file and its offset.
pub fn for_each_piece(path: &Path, target: usize, mut f: impl FnMut(&str) -> Result<()>) -> Result<u64> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let target = target.max(1);
    let mut buf: Vec<u8> = Vec::with_capacity(2 * target);
    let mut chunk = vec![0u8; 1 << 16];
    let mut offset = 0u64; // bytes of the file before `buf`
    let mut eof = false;
    while !(eof && buf.is_empty()) {
        while !eof && buf.len() < target {
            let n = file.read(&mut chunk).map_err(|e| Error::io(path, e))?;
            eof = n == 0;
            buf.extend_from_slice(&chunk[..n]);
        }
        let cut = if eof {
            buf.len()
        } else {
            let at_line = (1..buf.len())
                .rev()
                .find(|&i| buf[i - 1] == b'\n' && !buf[i].is_ascii_whitespace());
            match at_line {
                Some(i) => i,
                // No such place yet: read on, up to MAX_PIECE, then cut at a character boundary.
                None if buf.len() < MAX_PIECE => {
                    let more = buf.len() + target;
                    while !eof && buf.len() < more {
                        let n = file.read(&mut chunk).map_err(|e| Error::io(path, e))?;
                        eof = n == 0;
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    continue;
                }
                None => (1..buf.len())
                    .rev()
                    .find(|&i| buf[i] & 0xC0 != 0x80)
                    .unwrap_or(buf.len()),
            }
        };
        let piece = std::str::from_utf8(&buf[..cut]).map_err(|e| Error::NotText {
            path: path.to_path_buf(),
            offset: offset as usize + e.valid_up_to(),
        })?;
        f(piece)?;
        offset += cut as u64;
        buf.drain(..cut);
    }
    Ok(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_file_and_end_where_lines_begin() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.txt");
        let text = "First Citizen:\n  Before we proceed,\n\nhear me speak. café 東京\nAll:\nSpeak.\n".repeat(50);
        std::fs::write(&path, &text).expect("write");
        for target in [1, 7, 100, 1 << 20] {
            let mut pieces = Vec::new();
            let size = for_each_piece(&path, target, |p| {
                pieces.push(p.to_string());
                Ok(())
            })
            .expect("read");
            assert_eq!(size as usize, text.len());
            assert_eq!(pieces.concat(), text, "target {target}");
            for p in &pieces[..pieces.len() - 1] {
                assert!(p.ends_with('\n'), "target {target}: {p:?}");
            }
            for p in &pieces[1..] {
                assert!(!p.starts_with(char::is_whitespace), "target {target}: {p:?}");
            }
        }
        std::fs::write(&path, b"ok\nbad \xff byte\n").expect("write");
        let err = for_each_piece(&path, 4, |_| Ok(()))
            .expect_err("invalid UTF-8")
            .to_string();
        assert!(err.contains("t.txt") && err.contains("offset 7"), "{err}");
    }
}
