//! Where `--data` comes from, one document at a time: text files (a document each), JSON lines
//! (`.jsonl`: a document per line, its field `text` or `--text-field`), parquet (`.parquet`: a
//! document per row, the column `text` or `--text-field`, read a page at a time so that memory
//! stays flat), directories of any of these (recursively, in name order), and Hub datasets
//! (`hf://datasets/ORG/NAME[@REV][/PATH]`: the repository's files of these kinds, under `PATH`
//! if given, from the shared Hub cache or downloaded into it). Token files (llm.c's, nanoGPT's)
//! are read by `token_files`.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use gpt::hub::{HubId, RepoKind, Snapshot};

use super::token_files::{token_format, DataFormat};

/// Bytes of a text file handed over at a time.
pub const PIECE: usize = 64 << 10;

/// The prefix of a Hub dataset in `--data`.
pub const HUB_DATASETS: &str = "hf://datasets/";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    JsonLines,
    Parquet,
    /// Token ids in a trainer's format (`DataFormat::Llmc` or `DataFormat::Nanogpt`).
    Tokens(DataFormat),
}

/// One file of `--data` and how it is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub path: PathBuf,
    pub kind: Kind,
}

/// The kind of a file under `--data-format`: by its extension when `Auto`.
fn kind_of(path: &Path, format: DataFormat) -> Result<Kind> {
    if let Some(tokens) = token_format(path, format)? {
        return Ok(Kind::Tokens(tokens));
    }
    Ok(match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl" | "ndjson") => Kind::JsonLines,
        Some("parquet") => Kind::Parquet,
        _ => Kind::Text,
    })
}

/// Whether a directory walk takes this file.
fn readable(path: &Path, format: DataFormat) -> bool {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match format {
        DataFormat::Llmc | DataFormat::Nanogpt => ext == "bin",
        DataFormat::Text => matches!(ext, "txt" | "jsonl" | "ndjson" | "parquet"),
        DataFormat::Chat => matches!(ext, "jsonl" | "ndjson"),
        DataFormat::Auto => matches!(ext, "txt" | "jsonl" | "ndjson" | "parquet" | "bin"),
    }
}

/// The sources that `--data` names, in order: files as given, directories walked, Hub datasets
/// resolved to their files in the cache. A directory or dataset without any readable file is an
/// error naming it.
pub fn sources(data: &[PathBuf], format: DataFormat) -> Result<Vec<Source>> {
    let mut out = Vec::new();
    for named in data {
        let text = named.to_string_lossy();
        if let Some(dataset) = text.strip_prefix(HUB_DATASETS) {
            for path in hub_dataset_files(dataset, format)? {
                out.push(Source {
                    kind: kind_of(&path, format)?,
                    path,
                });
            }
        } else if named.is_dir() {
            let mut files = Vec::new();
            walk(named, format, &mut files)?;
            if files.is_empty() {
                bail!(
                    "{} holds no files to read (.txt, .jsonl, .parquet{})",
                    named.display(),
                    if format == DataFormat::Text { "" } else { ", .bin" }
                );
            }
            for path in files {
                out.push(Source {
                    kind: kind_of(&path, format)?,
                    path,
                });
            }
        } else {
            if !named.exists() {
                bail!("{}: file not found", named.display());
            }
            out.push(Source {
                kind: kind_of(named, format)?,
                path: named.clone(),
            });
        }
    }
    Ok(out)
}

fn walk(dir: &Path, format: DataFormat, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| Ok(e?.path()))
        .collect::<std::io::Result<_>>()
        .with_context(|| format!("reading {}", dir.display()))?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            walk(&path, format, out)?;
        } else if readable(&path, format) {
            out.push(path);
        }
    }
    Ok(())
}

/// `ORG/NAME[@REV][/PATH]`'s readable files, in the Hub cache (downloaded where missing), in
/// name order.
fn hub_dataset_files(spec: &str, format: DataFormat) -> Result<Vec<PathBuf>> {
    let parts: Vec<&str> = spec.splitn(3, '/').collect();
    let (repo, prefix) = match parts.as_slice() {
        [org, name] => (format!("{org}/{name}"), ""),
        [org, name, path] => (format!("{org}/{name}"), *path),
        _ => bail!("{HUB_DATASETS}{spec}: expected {HUB_DATASETS}ORG/NAME[@REVISION][/PATH]"),
    };
    let id = HubId::parse(&repo, RepoKind::Dataset)
        .with_context(|| format!("{HUB_DATASETS}{spec}: `{repo}` is not a Hub id"))?;
    let snapshot = Snapshot::open(&id)?;
    let prefix = prefix.trim_end_matches('/');
    let mut files: Vec<&String> = snapshot
        .files
        .iter()
        .filter(|f| prefix.is_empty() || *f == prefix || f.starts_with(&format!("{prefix}/")))
        .filter(|f| readable(Path::new(f), format))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!(
            "{HUB_DATASETS}{spec}: no .parquet, .jsonl or .txt files{} among the dataset's {} files ({})",
            if prefix.is_empty() {
                String::new()
            } else {
                format!(" under `{prefix}`")
            },
            snapshot.files.len(),
            snapshot.files.iter().take(10).cloned().collect::<Vec<_>>().join(", ")
        );
    }
    files.into_iter().map(|f| Ok(snapshot.get(f)?)).collect()
}

impl Source {
    /// Calls `f(text, first)` for the text of each document in turn: a text file's in pieces of
    /// about [`PIECE`] bytes (`first` at its first), a line's or a row's whole. Returns the
    /// bytes of text read. Errors name the file and the line or row.
    pub fn for_each_document(&self, field: &str, mut f: impl FnMut(&str, bool) -> Result<()>) -> Result<u64> {
        match self.kind {
            Kind::Text => {
                let mut first = true;
                let bytes = gpt::files::for_each_piece(&self.path, PIECE, |piece| {
                    f(piece, std::mem::take(&mut first)).map_err(|e| gpt::Error::Tokenize(format!("{e:#}")))
                })?;
                if bytes == 0 {
                    bail!("{} is empty", self.path.display());
                }
                Ok(bytes)
            }
            Kind::JsonLines => json_lines(&self.path, field, f),
            Kind::Parquet => parquet(&self.path, field, f),
            Kind::Tokens(_) => bail!(
                "{}: a token file, not text (it is read as tokens, with --tokenizer naming their vocabulary)",
                self.path.display()
            ),
        }
    }
}

fn json_lines(path: &Path, field: &str, mut f: impl FnMut(&str, bool) -> Result<()>) -> Result<u64> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut reader = std::io::BufReader::new(file);
    let mut line = Vec::new();
    let (mut number, mut bytes, mut documents) = (0usize, 0u64, 0usize);
    loop {
        line.clear();
        if reader
            .read_until(b'\n', &mut line)
            .with_context(|| format!("reading {}", path.display()))?
            == 0
        {
            break;
        }
        number += 1;
        let at = || format!("{}:{number}", path.display());
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_slice(&line).map_err(|e| anyhow::anyhow!("{}: invalid JSON: {e}", at()))?;
        let Some(object) = value.as_object() else {
            bail!(
                "{}: a JSON {}, not an object with a `{field}` field",
                at(),
                json_kind(&value)
            );
        };
        let text = match object.get(field) {
            Some(serde_json::Value::String(text)) => text,
            Some(other) => bail!("{}: field `{field}` is a JSON {}, not a string", at(), json_kind(other)),
            None => bail!(
                "{}: no field `{field}` (fields: {}); name the text's field with --text-field",
                at(),
                object.keys().cloned().collect::<Vec<_>>().join(", ")
            ),
        };
        f(text, true)?;
        bytes += text.len() as u64;
        documents += 1;
    }
    if documents == 0 {
        bail!("{} holds no documents", path.display());
    }
    Ok(bytes)
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

/// Rows of the column `field` of a parquet file, a batch of values at a time (pages are
/// decompressed one by one, so memory does not grow with the file). Null values are skipped.
fn parquet(path: &Path, field: &str, mut f: impl FnMut(&str, bool) -> Result<()>) -> Result<u64> {
    use parquet::column::reader::ColumnReader;
    use parquet::file::reader::{FileReader, SerializedFileReader};

    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let reader = SerializedFileReader::new(file)
        .map_err(|e| anyhow::anyhow!("{}: not a readable parquet file: {e}", path.display()))?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let columns: Vec<String> = (0..schema.num_columns())
        .map(|i| schema.column(i).path().string())
        .collect();
    let Some(index) = columns.iter().position(|c| c == field) else {
        bail!(
            "{}: no column `{field}` (columns: {}); name the text's column with --text-field",
            path.display(),
            columns.join(", ")
        );
    };
    let column = schema.column(index);
    if column.physical_type() != parquet::basic::Type::BYTE_ARRAY || column.max_rep_level() > 0 {
        bail!(
            "{}: column `{field}` holds {}{}, not strings",
            path.display(),
            column.physical_type(),
            if column.max_rep_level() > 0 { " lists" } else { "" }
        );
    }
    let max_def = column.max_def_level();
    let (mut bytes, mut row, mut documents) = (0u64, 0u64, 0u64);
    let (mut values, mut defs) = (Vec::new(), Vec::new());
    for group in 0..reader.num_row_groups() {
        let corrupt = |e: parquet::errors::ParquetError| {
            anyhow::anyhow!("{}: row group {group}: corrupt or unreadable: {e}", path.display())
        };
        let row_group = reader.get_row_group(group).map_err(corrupt)?;
        let ColumnReader::ByteArrayColumnReader(mut column) = row_group.get_column_reader(index).map_err(corrupt)?
        else {
            bail!("{}: column `{field}` is not a byte-array column", path.display());
        };
        loop {
            values.clear();
            defs.clear();
            let (records, _, _) = column
                .read_records(1024, Some(&mut defs), None, &mut values)
                .map_err(corrupt)?;
            if records == 0 {
                break;
            }
            let mut next = values.iter();
            for r in 0..records {
                let present = max_def == 0 || defs.get(r).is_some_and(|&d| d == max_def);
                if present {
                    let value = next
                        .next()
                        .ok_or_else(|| anyhow::anyhow!("{}: row {row}: missing value", path.display()))?;
                    let text = std::str::from_utf8(value.data()).map_err(|e| {
                        anyhow::anyhow!("{}: row {row}: `{field}` is not UTF-8 text: {e}", path.display())
                    })?;
                    f(text, true)?;
                    bytes += text.len() as u64;
                    documents += 1;
                }
                row += 1;
            }
        }
    }
    if documents == 0 {
        bail!("{}: no rows with text in column `{field}`", path.display());
    }
    Ok(bytes)
}

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
