//! SentencePiece tokenizers from llama.cpp GGUF files (`tokenizer.ggml.model` `llama`: Llama 2,
//! TinyLlama, Mistral 7B, Gemma) against llama.cpp's own `llama-tokenize` on the same files
//! (`tests/fixtures/make_spm_fixtures.py`): pieces merged by score, bytes for what no piece holds,
//! user-defined pieces matched whole, a space prefix before each run of text (Llama 2's files) or
//! none (Gemma's), the BOS once where `add_bos_token`, and the text decoded back.

use candle_core::Device;

fn fixture(name: &str) -> std::path::PathBuf {
    gpt_test_support::repo("tests/fixtures/spm").join(name)
}

#[test]
fn sentencepiece_gguf_tokenizers_equal_llama_cpp() -> anyhow::Result<()> {
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("expected.json"))?)?;
    for name in ["llama", "gemma"] {
        let (_, tok) = gpt::load_dir_as(&fixture(&format!("{name}.gguf")), None, &Device::Cpu)
            .map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        let cases = expected[name].as_array().cloned().unwrap_or_default();
        assert!(cases.len() >= 8, "{name}: the fixture's cases");
        for case in cases {
            let text = case["text"].as_str().unwrap_or_default();
            let ids: Vec<u32> = serde_json::from_value(case["ids"].clone())?;
            assert_eq!(tok.encode(text)?, ids, "{name}: {text:?}");
            // The file's add_bos_token: the prompt starts with the BOS (id 1), once.
            let prompt = tok.encode_prompt(text)?;
            assert_eq!(prompt.first(), Some(&1), "{name}: {text:?}");
            assert_eq!(&prompt[1..], &ids[..], "{name}: {text:?}");
            // Decoded back, where no piece was matched whole (llama.cpp puts a space before the
            // text after one, which decoding keeps).
            if !text.contains("_of_turn>") {
                assert_eq!(tok.decode(&ids)?, text, "{name}: decoded");
            }
        }
    }
    Ok(())
}

/// A file whose scores do not match its pieces, or whose tokenizer model is unknown, is an error
/// that names the field.
#[test]
fn sentencepiece_metadata_that_does_not_fit_is_an_error() -> anyhow::Result<()> {
    use candle_core::quantized::gguf_file::{self, Value};
    let path = fixture("llama.gguf");
    let mut file = std::fs::File::open(&path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| Ok((name.clone(), content.tensor(&mut file, name, &Device::Cpu)?)))
        .collect::<anyhow::Result<_>>()?;
    for (key, value, named) in [
        (
            "tokenizer.ggml.scores",
            Value::Array(vec![Value::F32(0.0); 3]),
            "tokenizer.ggml.scores has 3 scores for 1000 tokens",
        ),
        (
            "tokenizer.ggml.model",
            Value::String("rwkv".into()),
            "tokenizer.ggml.model `rwkv`",
        ),
    ] {
        let mut metadata = content.metadata.clone();
        metadata.insert(key.to_string(), value);
        let out = tempfile::Builder::new().suffix(".gguf").tempfile()?;
        let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensors: Vec<(&str, &candle_core::quantized::QTensor)> =
            tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut std::fs::File::create(out.path())?, &metadata, &tensors)?;
        let err = match gpt::load_dir_as(out.path(), None, &Device::Cpu) {
            Ok(_) => anyhow::bail!("{key}: loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(named), "{key}: {err}");
    }
    Ok(())
}
