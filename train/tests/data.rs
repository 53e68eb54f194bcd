//! Corpora: tokenised piece by piece exactly as a whole, documents separated by end-of-text,
//! directories of .txt files, and a large corpus prepared in bounded memory.

use std::path::{Path, PathBuf};

use gpt::Tokenizer;
use gpt_train::data;

mod common;

use gpt_test_support as support;

fn shakespeare() -> anyhow::Result<String> {
    support::shakespeare(usize::MAX)
}

fn tokenizers(corpus: &Path) -> anyhow::Result<Vec<(&'static str, Tokenizer)>> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2/tokenizer.json");
    let mut out = vec![
        ("char", Tokenizer::train_char(&[corpus.to_path_buf()])?),
        ("fixture BPE", Tokenizer::from_file(&fixture)?),
    ];
    // GPT-2's own, where CI has rebuilt it.
    if let Some(dir) = std::env::var_os("GPT2_TOKENIZER_DIR") {
        out.push((
            "GPT-2",
            Tokenizer::from_file(&PathBuf::from(dir).join("tokenizer.json"))?,
        ));
    }
    Ok(out)
}

#[test]
fn a_corpus_tokenised_piece_by_piece_equals_the_whole_encoded_at_once() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Over a megabyte, so several pieces; with blank lines and indented lines at the seams.
    let text = shakespeare()?.replace("\n\n", "\n\n  \n");
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, &text)?;
    for (name, tok) in tokenizers(&corpus)? {
        let cache = dir.path().join(format!("tokens-{name}"));
        let set = data::prepare(
            std::slice::from_ref(&corpus),
            None,
            0.0,
            &tok,
            &cache,
            &Default::default(),
        )?;
        let whole = tok.encode(&text)?;
        assert_eq!(set.train.len(), whole.len(), "{name}");
        assert!(
            set.train.window(0, whole.len()) == whole,
            "{name}: the pieces encode differently"
        );
        assert!(set.val.is_empty());
    }
    Ok(())
}

#[test]
fn documents_from_files_and_directories_are_separated_by_end_of_text() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let docs = dir.path().join("docs");
    std::fs::create_dir_all(docs.join("more"))?;
    std::fs::write(docs.join("b.txt"), "Second document.\n")?;
    std::fs::write(docs.join("a.txt"), "First document.\n")?;
    std::fs::write(docs.join("more/c.txt"), "Third, in a sub-directory.\n")?;
    std::fs::write(docs.join("notes.md"), "not a .txt file")?;
    let single = dir.path().join("single.txt");
    std::fs::write(&single, "A file named on its own.\n")?;
    let found: Vec<_> = gpt_train::data::sources::sources(&[docs.clone(), single.clone()], Default::default())?
        .into_iter()
        .map(|s| s.path)
        .collect();
    let names: Vec<String> = found
        .iter()
        .map(|p| p.strip_prefix(dir.path()).unwrap_or(p).display().to_string())
        .collect();
    assert_eq!(names, ["docs/a.txt", "docs/b.txt", "docs/more/c.txt", "single.txt"]);

    let bpe = Tokenizer::from_file(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2/tokenizer.json"),
    )?;
    let eot = bpe.eos_token_id().unwrap_or(u32::MAX);
    let set = data::prepare(
        &[docs.clone(), single],
        None,
        0.0,
        &bpe,
        &dir.path().join("t"),
        &Default::default(),
    )?;
    let ids = set.train.window(0, set.train.len());
    let mut expected = Vec::new();
    for (i, doc) in found.iter().enumerate() {
        if i > 0 {
            expected.push(eot);
        }
        expected.extend(bpe.encode(&std::fs::read_to_string(doc)?)?);
    }
    assert_eq!(ids, expected);
    assert_eq!(ids.iter().filter(|&&t| t == eot).count(), 3);

    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty)?;
    let err = gpt_train::data::sources::sources(&[empty], Default::default())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("empty") && err.contains("no files to read"), "{err}");
    Ok(())
}

/// Peak resident memory of finished child processes, in bytes.
#[cfg(target_os = "linux")]
fn children_peak_rss() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a rusage into the pointer it is given.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr());
        usage.assume_init()
    };
    usage.ru_maxrss as u64 * 1024
}

#[cfg(target_os = "linux")]
#[test]
fn a_large_corpus_is_prepared_in_bounded_memory() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let text = shakespeare()?;
    let corpus = dir.path().join("big.txt");
    {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(&corpus)?);
        for _ in 0..48 {
            f.write_all(text.as_bytes())?; // about 54 MB
        }
    }
    let size = std::fs::metadata(&corpus)?.len();
    let out = dir.path().join("run");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_gpt-train"))
        .args(common::train_args(
            &corpus,
            &out,
            &[
                "--batch-size",
                "4",
                "--max-iters",
                "1",
                "--eval-iters",
                "1",
                "--threads",
                "1",
            ],
        ))
        .env("RUST_LOG", "warn")
        .output()?;
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let tokens =
        std::fs::metadata(out.join("tokens/train.bin"))?.len() + std::fs::metadata(out.join("tokens/val.bin"))?.len();
    assert_eq!(tokens, 2 * size, "one u16 per character");
    // Reading it whole would hold the text and its tokens (u32 while encoding): over 5x its size.
    let peak = children_peak_rss();
    assert!(
        peak < size * 2,
        "peak memory {} MB for a {} MB corpus",
        peak >> 20,
        size >> 20
    );
    Ok(())
}
