//! A tokenizer whose words are whole texts (no pre-tokenizer, as the character-level ones) keeps
//! no cache of them: distinct prompts must not pile up in memory. Its own test binary, so that
//! no other test allocates while the heap is read.

use gpt::Tokenizer;
use rand::{Rng, SeedableRng};

#[test]
fn distinct_prompts_are_not_cached() -> anyhow::Result<()> {
    let Some(before) = gpt::device::heap_usage() else {
        return Ok(()); // glibc's statistics only
    };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("corpus.txt");
    let alphabet: Vec<char> = "abcdefghijklmnopqrstuvwxyz ,.\n".chars().collect();
    std::fs::write(&path, alphabet.iter().collect::<String>())?;
    let tok = Tokenizer::train_char(&[path])?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    // 4,000 prompts of 200 characters: cached, ~26 MB (each word ~32 bytes a character).
    for _ in 0..4000 {
        let prompt: String = (0..200)
            .map(|_| alphabet[rng.random_range(0..alphabet.len())])
            .collect();
        assert_eq!(tok.encode(&prompt)?.len(), 200);
    }
    let after = gpt::device::heap_usage().map_or(0, |h| h.allocated);
    let grown = after.saturating_sub(before.allocated);
    assert!(
        grown < 4 << 20,
        "the heap grew by {grown} bytes over 4,000 distinct prompts"
    );
    Ok(())
}
