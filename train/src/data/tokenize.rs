//! Sources to token ids: checking `--data`'s documents, the text a tokenizer is trained on, the
//! tokens of a source for evaluation, and encoding sources into a token file piece by piece.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use gpt::Tokenizer;

use super::sources::{sources, Kind, Reading, Source};
use super::token_files::TokenFile;

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

/// The token files among `found`, opened and checked against the vocabulary; an error if they
/// are mixed with text.
pub(super) fn token_files(found: &[Source], vocab_size: usize) -> Result<Option<Vec<TokenFile>>> {
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
pub(super) fn encode_to_file(
    sources: &[Source],
    field: &str,
    tokenizer: &Tokenizer,
    width: usize,
    path: &Path,
) -> Result<u64> {
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
