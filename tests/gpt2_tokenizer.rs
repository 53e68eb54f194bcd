//! GPT-2's own `tokenizer.json` (50257 tokens) loads and encodes as the Python `tokenizers` does.
//!
//! The file is rebuilt from GPT-2's vocabulary by `tests/fixtures/make_gpt2_tokenizer.py` (it is
//! 1.4 MB, so not committed); `.ci/run` does that and sets GPT2_TOKENIZER_DIR. Without the
//! variable this test has nothing to check and says so.

use std::path::PathBuf;

#[test]
fn gpt2_tokenizer_json_loads_and_encodes_like_python() -> anyhow::Result<()> {
    let Some(dir) = std::env::var_os("GPT2_TOKENIZER_DIR").map(PathBuf::from) else {
        eprintln!("GPT2_TOKENIZER_DIR is not set: GPT-2's tokenizer.json not checked (.ci/run sets it)");
        return Ok(());
    };
    let tok = gpt::Tokenizer::from_file(&dir.join("tokenizer.json"))?;
    assert_eq!(tok.vocab_size(), 50257);
    assert_eq!(tok.eos_token_id(), Some(50256));
    assert!(!tok.is_char_level());
    // Well-known GPT-2 ids, independent of the Python run.
    assert_eq!(tok.encode("Hello world")?, [15496, 995]);

    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json"))?)?;
    let cases = expected["cases"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no cases"))?;
    assert!(cases.len() >= 5);
    for case in cases {
        let text = case["text"].as_str().unwrap_or_default();
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
        assert_eq!(tok.encode(text)?, ids, "{text:?}");
        assert_eq!(tok.decode(&ids)?, text);
    }
    Ok(())
}
