//! Saving and loading checkpoint directories, and the typed errors for broken ones.

mod common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use common::{batch, max_abs_diff, random_model, tokens};
use gpt::{checkpoint, Config, Error, Tokenizer};

fn corpus(dir: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join("corpus.txt");
    std::fs::write(&path, "To be, or not to be, that is the question:\n")?;
    Ok(path)
}

/// A saved random tiny model in a fresh temporary directory.
fn saved(cfg: &Config) -> anyhow::Result<(tempfile::TempDir, gpt::Gpt)> {
    let dir = tempfile::tempdir()?;
    let (_vm, model) = random_model(cfg)?;
    let tok = Tokenizer::train_char(&[corpus(dir.path())?])?;
    gpt::save_dir(dir.path(), &model, &tok, DType::F32)?;
    Ok((dir, model))
}

#[test]
fn save_then_load_is_bit_exact() -> anyhow::Result<()> {
    for pe in [gpt::PositionEmbedding::Learned, gpt::PositionEmbedding::Sinusoidal] {
        let cfg = Config {
            position_embedding: pe,
            ..Config::tiny(50)
        };
        let (dir, model) = saved(&cfg)?;
        let (loaded, tok) = gpt::load_dir(dir.path(), DType::F32, &Device::Cpu)?;
        assert_eq!(loaded.config(), model.config());
        assert!(tok.is_char_level());
        let (before, after) = (model.named_tensors()?, loaded.named_tensors()?);
        assert_eq!(before.len(), after.len());
        for ((name_a, a), (name_b, b)) in before.iter().zip(&after) {
            assert_eq!(name_a, name_b);
            assert_eq!(
                a.flatten_all()?.to_vec1::<f32>()?,
                b.flatten_all()?.to_vec1::<f32>()?,
                "{name_a}"
            );
        }
        // transformers is told to use tokenizer.json as it is (a character vocabulary has no
        // end-of-text token).
        let hf: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("tokenizer_config.json"))?)?;
        assert_eq!(hf["tokenizer_class"], "PreTrainedTokenizerFast");
        assert_eq!(hf["model_max_length"], cfg.n_positions);
        assert!(hf["eos_token"].is_null());
        let idx = batch(&[tokens(12, cfg.vocab_size, 9)])?;
        // The loaded model multiplies with the inference kernel (another summation order).
        let diff = max_abs_diff(&model.forward(&idx, None)?, &loaded.forward(&idx, None)?)?;
        assert!(diff < 1e-5, "{diff}");
        // No temporary files are left behind.
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())?
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }
    Ok(())
}

/// `bias: false` (nanoGPT's variant): no bias is a parameter, every bias is saved as zeros in the
/// GPT-2 layout, and loading gives the same model.
#[test]
fn bias_free_models_save_zero_biases_and_load_back() -> anyhow::Result<()> {
    let cfg = Config {
        bias: false,
        ..Config::tiny(50)
    };
    let (dir, model) = saved(&cfg)?;
    let with_bias = random_model(&Config::tiny(50))?.1;
    let biases = cfg.n_layer * (3 * 32 + 32 + 4 * 32 + 32 + 2 * 32) + 32; // linear + LayerNorm biases, and ln_f
    assert_eq!(model.num_parameters() + biases, with_bias.num_parameters());
    let (loaded, _) = gpt::load_dir(dir.path(), DType::F32, &Device::Cpu)?;
    for (name, t) in loaded.named_tensors()? {
        if name.ends_with(".bias") {
            assert_eq!(t.abs()?.sum_all()?.to_scalar::<f32>()?, 0.0, "{name}");
        }
    }
    let idx = batch(&[tokens(12, cfg.vocab_size, 9)])?;
    let diff = max_abs_diff(&model.forward(&idx, None)?, &loaded.forward(&idx, None)?)?;
    assert!(diff < 1e-5, "{diff}");
    Ok(())
}

#[test]
fn missing_files_are_named() -> anyhow::Result<()> {
    for file in [
        checkpoint::CONFIG_FILE,
        checkpoint::WEIGHTS_FILE,
        checkpoint::TOKENIZER_FILE,
    ] {
        let (dir, _) = saved(&Config::tiny(50))?;
        std::fs::remove_file(dir.path().join(file))?;
        match gpt::load_dir(dir.path(), DType::F32, &Device::Cpu) {
            Err(Error::MissingFile { path }) => assert!(path.ends_with(file), "{path:?}"),
            other => panic!("{file}: expected MissingFile, got {other:?}"),
        }
    }
    let err = gpt::load_dir(Path::new("/nonexistent/ckpt"), DType::F32, &Device::Cpu).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/ckpt"), "{err}");
    Ok(())
}

#[test]
fn truncated_and_corrupt_weights_are_reported_not_panicked() -> anyhow::Result<()> {
    let (dir, _) = saved(&Config::tiny(50))?;
    let path = dir.path().join(checkpoint::WEIGHTS_FILE);
    let bytes = std::fs::read(&path)?;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", bytes[..bytes.len() - 100].to_vec()),
        ("header only", bytes[..20].to_vec()),
        ("empty", vec![]),
        ("garbage", b"this is not a safetensors file at all".to_vec()),
    ];
    for (what, content) in cases {
        std::fs::write(&path, content)?;
        match gpt::load_dir(dir.path(), DType::F32, &Device::Cpu) {
            Err(e @ Error::CorruptCheckpoint { .. }) => assert!(e.to_string().contains("model.safetensors"), "{e}"),
            other => panic!("{what}: expected CorruptCheckpoint, got {other:?}"),
        }
    }
    Ok(())
}

#[test]
fn missing_tensor_and_wrong_shape_name_the_tensor() -> anyhow::Result<()> {
    let cfg = Config::tiny(50);
    let (dir, model) = saved(&cfg)?;
    let path = dir.path().join(checkpoint::WEIGHTS_FILE);
    let write = |tensors: Vec<(String, candle_core::Tensor)>| -> anyhow::Result<()> {
        Ok(safetensors::serialize_to_file(tensors, None, &path)?)
    };

    let mut tensors = model.named_tensors()?;
    tensors.retain(|(name, _)| name != "transformer.h.1.mlp.c_fc.bias");
    write(tensors)?;
    match gpt::load_dir(dir.path(), DType::F32, &Device::Cpu) {
        Err(Error::MissingTensor { name, .. }) => assert_eq!(name, "transformer.h.1.mlp.c_fc.bias"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }

    let mut tensors = model.named_tensors()?;
    for (name, t) in tensors.iter_mut() {
        if name == "transformer.h.0.attn.c_attn.weight" {
            *t = t.t()?.contiguous()?; // stored (out, in) by mistake
        }
    }
    write(tensors)?;
    match gpt::load_dir(dir.path(), DType::F32, &Device::Cpu) {
        Err(e @ Error::ShapeMismatch { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("transformer.h.0.attn.c_attn.weight"), "{msg}");
            assert!(msg.contains("[32, 96]") && msg.contains("[96, 32]"), "{msg}");
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    Ok(())
}

#[test]
fn bad_config_and_vocab_mismatch_are_clear() -> anyhow::Result<()> {
    let (dir, _) = saved(&Config::tiny(50))?;
    let config_path = dir.path().join(checkpoint::CONFIG_FILE);
    let good = std::fs::read_to_string(&config_path)?;

    std::fs::write(&config_path, good.replace("\"n_head\": 4", "\"n_head\": 5"))?;
    let err = gpt::load_dir(dir.path(), DType::F32, &Device::Cpu).unwrap_err();
    assert!(
        matches!(err, Error::ConfigFile { .. }) && err.to_string().contains("divisible"),
        "{err}"
    );

    std::fs::write(&config_path, "{ not json")?;
    let err = gpt::load_dir(dir.path(), DType::F32, &Device::Cpu).unwrap_err();
    assert!(err.to_string().contains("config.json"), "{err}");

    // A tokenizer with more tokens than the model's embedding table has rows.
    std::fs::write(&config_path, &good)?;
    let big = dir.path().join("big.txt");
    std::fs::write(
        &big,
        (0..200u32)
            .filter_map(char::from_u32)
            .map(|c| c.to_string())
            .collect::<String>(),
    )?;
    Tokenizer::train_bpe(&[big], 400)?.save(&dir.path().join(checkpoint::TOKENIZER_FILE))?;
    let err = gpt::load_dir(dir.path(), DType::F32, &Device::Cpu).unwrap_err();
    assert!(matches!(err, Error::VocabMismatch { model: 50, .. }), "{err}");
    Ok(())
}

/// `gpt::files::read_safetensors` (one tensor at a time) reads what candle writes, every dtype,
/// as candle's own `load` reads it; a truncated file or a broken header is an error naming the
/// file (and the tensor cut short).
#[test]
fn safetensors_read_tensor_by_tensor_equal_candles_load() -> anyhow::Result<()> {
    use candle_core::Tensor;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("t.safetensors");
    let dev = &Device::Cpu;
    let base = Tensor::arange(0f32, 24.0, dev)?.reshape((2, 3, 4))?;
    let tensors = std::collections::HashMap::from([
        ("a.f32".to_string(), base.clone()),
        ("b.f16".to_string(), base.to_dtype(DType::F16)?),
        ("c.bf16".to_string(), base.narrow(0, 0, 1)?.to_dtype(DType::BF16)?),
        ("d.u32".to_string(), base.to_dtype(DType::U32)?.flatten_all()?),
        ("e.scalar".to_string(), Tensor::new(3.5f64, dev)?),
    ]);
    candle_core::safetensors::save(&tensors, &path)?;
    let ours = gpt::files::read_safetensors(&path, dev)?;
    let theirs = candle_core::safetensors::load(&path, dev)?;
    assert_eq!(ours.len(), theirs.len());
    for (name, t) in &theirs {
        let o = &ours[name];
        assert_eq!((o.dtype(), o.dims()), (t.dtype(), t.dims()), "{name}");
        let (o, t) = (
            o.to_dtype(DType::F64)?.flatten_all()?,
            t.to_dtype(DType::F64)?.flatten_all()?,
        );
        assert_eq!(o.to_vec1::<f64>()?, t.to_vec1::<f64>()?, "{name}");
    }
    let bytes = std::fs::read(&path)?;
    std::fs::write(&path, &bytes[..bytes.len() - 10])?;
    let err = gpt::files::read_safetensors(&path, dev)
        .expect_err("a truncated file")
        .to_string();
    assert!(err.contains("t.safetensors") && err.contains("truncated"), "{err}");
    std::fs::write(&path, b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")?;
    let err = gpt::files::read_safetensors(&path, dev)
        .expect_err("a broken header")
        .to_string();
    assert!(err.contains("t.safetensors") && err.contains("header"), "{err}");
    Ok(())
}
