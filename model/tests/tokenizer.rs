//! Training, saving and loading tokenizers.

use std::path::{Path, PathBuf};

use gpt::{Error, Tokenizer};

const TEXT: &str = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n";

fn corpus(dir: &Path, text: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join("corpus.txt");
    std::fs::write(&path, text)?;
    Ok(path)
}

#[test]
fn char_vocabulary_is_the_sorted_character_set_and_round_trips() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tok = Tokenizer::train_char(&[corpus(dir.path(), TEXT)?])?;
    let mut chars: Vec<char> = TEXT.chars().collect();
    chars.sort();
    chars.dedup();
    assert_eq!(tok.vocab_size(), chars.len());
    let ids = tok.encode("Speak, speak.\n")?;
    assert_eq!(ids.len(), 14);
    assert_eq!(
        ids[0] as usize,
        chars.iter().position(|&c| c == 'S').unwrap_or(usize::MAX)
    );
    assert_eq!(tok.decode(&ids)?, "Speak, speak.\n");

    let path = dir.path().join("tokenizer.json");
    tok.save(&path)?;
    let loaded = Tokenizer::from_file(&path)?;
    assert!(loaded.is_char_level());
    assert_eq!(loaded.encode(TEXT)?, tok.encode(TEXT)?);

    assert!(matches!(
        tok.encode("Speak, Zed"),
        Err(Error::UnknownCharacter { ch: 'Z' })
    ));
    Ok(())
}

#[test]
fn byte_level_bpe_trains_to_size_and_round_trips_any_text() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let tok = Tokenizer::train_bpe(&[corpus(dir.path(), &TEXT.repeat(20))?], 300)?;
    assert!(
        tok.vocab_size() <= 300 && tok.vocab_size() > 257,
        "{}",
        tok.vocab_size()
    );
    assert!(tok.eos_token_id().is_some());
    let text = "Speak, speak. Unseen: naïve 東京 🙂";
    let ids = tok.encode(text)?;
    assert!(ids.len() < text.len(), "merges should shorten the text");
    assert_eq!(tok.decode(&ids)?, text);
    assert!(!tok.is_char_level());

    let path = dir.path().join("tokenizer.json");
    tok.save(&path)?;
    assert_eq!(Tokenizer::from_file(&path)?.encode(text)?, ids);
    Ok(())
}

#[test]
fn bad_corpora_and_files_give_clear_errors() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9\n")?;
    let err = Tokenizer::train_char(std::slice::from_ref(&latin1)).unwrap_err();
    assert!(
        err.to_string().contains("latin1.txt") && err.to_string().contains("UTF-8"),
        "{err}"
    );
    assert!(Tokenizer::train_bpe(&[latin1], 300)
        .unwrap_err()
        .to_string()
        .contains("UTF-8"));

    let empty = corpus(dir.path(), "")?;
    assert!(matches!(
        Tokenizer::train_char(std::slice::from_ref(&empty)),
        Err(Error::EmptyInput(_))
    ));
    assert!(Tokenizer::train_bpe(&[empty], 300)
        .unwrap_err()
        .to_string()
        .contains("empty"));
    let err = Tokenizer::train_bpe(&[corpus(dir.path(), TEXT)?], 100).unwrap_err();
    assert!(err.to_string().contains("at least 257"), "{err}");

    let missing = dir.path().join("nope.json");
    assert!(matches!(Tokenizer::from_file(&missing), Err(Error::MissingFile { .. })));
    let broken = corpus(dir.path(), "{\"model\": 3}")?;
    let err = Tokenizer::from_file(&broken).unwrap_err();
    assert!(
        matches!(err, Error::Tokenizer { .. }) && err.to_string().contains("corpus.txt"),
        "{err}"
    );
    Ok(())
}
