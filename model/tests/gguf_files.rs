//! llama.cpp's GGUF files from strangers ([`gpt::llamacpp`]): a small valid file loads, and every
//! kind of bad file is an error that names the file and what is wrong (truncated, another magic
//! or version, counts and dimensions past the end, overlapping or overflowing offsets, an
//! unknown block format, metadata of the wrong type, an alignment of 0), never a panic or an
//! allocation larger than the file. A seeded mutation run over the header then checks that no
//! byte pattern there panics.

use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

const VOCAB: usize = 64;
const C: usize = 32;

/// A one-layer Llama in llama.cpp's layout: f32 norms, Q8_0 matrices, a byte-level vocabulary of
/// 64 single characters.
fn tiny_file(metadata_override: &[(&str, Value)]) -> anyhow::Result<Vec<u8>> {
    tiny_file_in(metadata_override, GgmlDType::Q8_0)
}

/// [`tiny_file`] with its matrices in `format`.
fn tiny_file_in(metadata_override: &[(&str, Value)], format: GgmlDType) -> anyhow::Result<Vec<u8>> {
    tiny_file_mixed(metadata_override, format, &[])
}

/// [`tiny_file_in`] with the tensors named in `formats` in their own formats.
fn tiny_file_mixed(
    metadata_override: &[(&str, Value)],
    format: GgmlDType,
    formats: &[(&str, GgmlDType)],
) -> anyhow::Result<Vec<u8>> {
    let dev = Device::Cpu;
    let tokens: Vec<Value> = (0..VOCAB)
        .map(|i| Value::String(char::from(b'0' + i as u8).to_string()))
        .collect();
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("llama.block_count".into(), Value::U32(1)),
        ("llama.context_length".into(), Value::U32(32)),
        ("llama.embedding_length".into(), Value::U32(C as u32)),
        ("llama.feed_forward_length".into(), Value::U32(64)),
        ("llama.attention.head_count".into(), Value::U32(4)),
        ("llama.attention.head_count_kv".into(), Value::U32(2)),
        ("llama.rope.freq_base".into(), Value::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon".into(), Value::F32(1e-5)),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.merges".into(), Value::Array(vec![])),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(0)),
    ];
    for (key, value) in metadata_override {
        match metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value.clone(),
            None => metadata.push((key.to_string(), value.clone())),
        }
    }
    let matrix = |name: &str, rows: usize, cols: usize| -> candle_core::Result<QTensor> {
        let format = formats.iter().find(|(n, _)| *n == name).map_or(format, |(_, f)| *f);
        // Offset from zero, so that Q4_1's minimum per block matters.
        QTensor::quantize(&(Tensor::randn(0f32, 0.1, (rows, cols), &dev)? + 0.05)?, format)
    };
    let vector = |len: usize| -> candle_core::Result<QTensor> {
        QTensor::quantize(&(Tensor::randn(0f32, 0.1, len, &dev)? + 1.0)?, GgmlDType::F32)
    };
    let tensors: Vec<(&str, QTensor)> = vec![
        ("token_embd.weight", matrix("token_embd.weight", VOCAB, C)?),
        ("output_norm.weight", vector(C)?),
        ("blk.0.attn_norm.weight", vector(C)?),
        ("blk.0.attn_q.weight", matrix("blk.0.attn_q.weight", C, C)?),
        ("blk.0.attn_k.weight", matrix("blk.0.attn_k.weight", 16, C)?),
        ("blk.0.attn_v.weight", matrix("blk.0.attn_v.weight", 16, C)?),
        ("blk.0.attn_output.weight", matrix("blk.0.attn_output.weight", C, C)?),
        ("blk.0.ffn_norm.weight", vector(C)?),
        ("blk.0.ffn_gate.weight", matrix("blk.0.ffn_gate.weight", 64, C)?),
        ("blk.0.ffn_up.weight", matrix("blk.0.ffn_up.weight", 64, C)?),
        ("blk.0.ffn_down.weight", matrix("blk.0.ffn_down.weight", C, 64)?),
    ];
    let metadata: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (*k, v)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    candle_core::quantized::gguf_file::write(&mut out, &metadata, &tensors)?;
    Ok(out.into_inner())
}

/// The load of `bytes` as a GGUF file: its error message, or `None` where it loaded. A panic
/// fails the test with what caused it.
fn load(bytes: &[u8], what: &str) -> Option<String> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, bytes).expect("the file written");
    let result = std::panic::catch_unwind(|| gpt::llamacpp::load(&path, None, &Device::Cpu));
    match result {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => panic!("loading {what} panicked"),
    }
}

/// The error of `bytes`, which must name the file.
fn error(bytes: &[u8], what: &str) -> String {
    let err = load(bytes, what).unwrap_or_else(|| panic!("{what} loaded"));
    assert!(
        err.contains("model.gguf"),
        "{what}: the error does not name the file: {err}"
    );
    err
}

/// Where tensor `name`'s info starts in the header (its name's length prefix).
fn tensor_info_at(bytes: &[u8], name: &str) -> usize {
    let needle = [&(name.len() as u64).to_le_bytes()[..], name.as_bytes()].concat();
    bytes
        .windows(needle.len())
        .rposition(|w| w == needle.as_slice())
        .unwrap_or_else(|| panic!("{name} in the header"))
}

#[test]
fn a_small_llama_cpp_file_loads_and_runs() -> anyhow::Result<()> {
    let bytes = tiny_file(&[])?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, &bytes)?;
    assert!(gpt::llamacpp::is_gguf_file(&path));
    let (model, tok) = gpt::load_dir_as(&path, None, &Device::Cpu)?;
    assert_eq!((model.config().n_kv_head(), model.config().vocab_size), (2, VOCAB));
    assert_eq!(model.weight_format(), Some(gpt::WeightFormat::Q8_0));
    let ids = tok.encode("0123")?;
    assert_eq!(ids, [0, 1, 2, 3]);
    let logits = model.forward(&Tensor::new(vec![ids], &Device::Cpu)?, None)?;
    assert_eq!(logits.dims(), [1, 4, VOCAB]);
    assert!(logits.flatten_all()?.to_vec1::<f32>()?.iter().all(|x| x.is_finite()));
    Ok(())
}

/// Q4_1, Q5_0 and Q5_1 matrices (run as Q4_0 or Q8_0 codes, plus an offset per block for Q4_1
/// and Q5_1: `Weight::Recoded`): their values are the file's own (dequantized by candle, exactly
/// up to the offset's f32 rounding), and the model computes what the same values in f32
/// compute, within the activations' 8-bit quantization.
#[test]
fn recoded_matrices_hold_the_files_values_and_compute_with_them() -> anyhow::Result<()> {
    for format in [GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1] {
        let bytes = tiny_file_in(&[], format)?;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("model.gguf");
        std::fs::write(&path, &bytes)?;
        let (mut recoded, tok) = gpt::load_dir_as(&path, None, &Device::Cpu)?;
        let (f32s, _) = gpt::load_dir_as(&path, Some(gpt::WeightFormat::F32), &Device::Cpu)?;
        for (name, w) in recoded.matrices_mut() {
            if !name.contains("wte") {
                let ok = matches!(w, gpt::layers::Weight::Recoded { stored, .. } if *stored == format);
                assert!(ok, "{format:?}: {name} is not recoded");
            }
        }
        let (a, b) = (recoded.named_tensors()?, f32s.named_tensors()?);
        for ((name, x), (_, y)) in a.iter().zip(&b) {
            let d = (x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            assert!(
                d < 1e-6,
                "{format:?}: {name}: the values differ from candle's dequantization by {d}"
            );
        }
        let ids = Tensor::new(vec![tok.encode("0123456789")?], &Device::Cpu)?;
        let (x, y) = (recoded.forward(&ids, None)?, f32s.forward(&ids, None)?);
        let scale = y.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let d = (x - &y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(
            d < 0.02 * scale,
            "{format:?} logits {d} from the f32 ones' (largest {scale})"
        );
    }
    // llama.cpp's Q4_K_M keeps some `attn_v` in Q8_0 beside Q5_0 q and k: they stack into one
    // Q8_0 product of the same values.
    let mixed = tiny_file_mixed(&[], GgmlDType::Q5_0, &[("blk.0.attn_v.weight", GgmlDType::Q8_0)])?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, &mixed)?;
    let (mut model, _) = gpt::load_dir_as(&path, None, &Device::Cpu)?;
    let (f32s, _) = gpt::load_dir_as(&path, Some(gpt::WeightFormat::F32), &Device::Cpu)?;
    let qkv: Vec<_> = (model.matrices_mut().into_iter())
        .filter(|(name, _)| name.contains(gpt::arch::names::QKV))
        .map(|(name, w)| {
            (
                name,
                matches!(w, gpt::layers::Weight::Packed(p) if p.format() == gpt::WeightFormat::Q8_0),
            )
        })
        .collect();
    assert!(qkv.len() == 1 && qkv[0].1, "q, k and v: not one Q8_0 product: {qkv:?}");
    for ((name, x), (_, y)) in model.named_tensors()?.iter().zip(&f32s.named_tensors()?) {
        let d = (x - y)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(d < 1e-6, "{name}: {d}");
    }
    Ok(())
}

/// `tokenizer.ggml.add_bos_token`: every prompt starts with the BOS, once, also where the text
/// itself begins with it (a chat template that writes `bos_token`); pieces of text do not.
#[test]
fn the_bos_token_starts_every_text_once_where_the_file_asks() -> anyhow::Result<()> {
    let bytes = tiny_file(&[
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ("tokenizer.ggml.bos_token_id", Value::U32(10)),
    ])?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, &bytes)?;
    let (_, tok) = gpt::load_dir_as(&path, None, &Device::Cpu)?;
    assert_eq!(tok.encode_prompt("0123")?, [10, 0, 1, 2, 3]);
    assert_eq!(
        tok.encode_prompt(":012")?,
        [10, 0, 1, 2],
        "token 10 is `:`: not doubled"
    );
    assert_eq!(
        tok.encode("0123")?,
        [0, 1, 2, 3],
        "pieces of text (a grammar's) without it"
    );
    let (_, plain) = gpt::load_dir_as(
        &{
            let p = dir.path().join("plain.gguf");
            std::fs::write(&p, tiny_file(&[])?)?;
            p
        },
        None,
        &Device::Cpu,
    )?;
    assert_eq!(plain.encode_prompt("0123")?, [0, 1, 2, 3]);
    let err = error(
        &tiny_file(&[("tokenizer.ggml.add_bos_token", Value::Bool(true))])?,
        "a BOS without its id",
    );
    assert!(err.contains("bos_token_id"), "{err}");
    Ok(())
}

#[test]
fn bad_files_are_errors_that_name_the_file_and_the_field() -> anyhow::Result<()> {
    let good = tiny_file(&[])?;

    // Truncated anywhere: in the magic, the counts, the metadata, the tensor infos, the data.
    for len in [0, 3, 4, 10, 24, 100, 1000, good.len() / 2, good.len() - 1] {
        error(&good[..len], &format!("the file cut at {len} bytes"));
    }
    let mut magic = good.clone();
    magic[..4].copy_from_slice(b"GGUX");
    assert!(error(&magic, "another magic").contains("GGUF"));
    let mut version = good.clone();
    version[4..8].copy_from_slice(&99u32.to_le_bytes());
    error(&version, "version 99");

    // Counts past the end of the file: tensors, metadata entries.
    for (at, what) in [(8, "tensor count"), (16, "metadata count")] {
        let mut bad = good.clone();
        bad[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
        error(&bad, what);
    }

    // A tensor's info: name, n_dims (u32), dims (u64 each), dtype (u32), offset (u64).
    let info = |name: &str| tensor_info_at(&good, name) + 8 + name.len();
    let name = "blk.0.ffn_down.weight";
    let dims_at = info(name) + 4;
    let (dtype_at, offset_at) = (dims_at + 16, dims_at + 20);

    let mut huge = good.clone();
    huge[dims_at..dims_at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let err = error(&huge, "a dimension past the file");
    assert!(err.contains(name) || err.contains("remaining"), "{err}");
    let mut overflow = good.clone();
    overflow[dims_at..dims_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    overflow[dims_at + 8..dims_at + 16].copy_from_slice(&u64::MAX.to_le_bytes());
    error(&overflow, "dimensions whose product overflows");

    let mut past = good.clone();
    past[offset_at..offset_at + 8].copy_from_slice(&(good.len() as u64).to_le_bytes());
    let err = error(&past, "an offset past the end");
    assert!(err.contains(name), "{err}");
    let mut wraps = good.clone();
    wraps[offset_at..offset_at + 8].copy_from_slice(&(u64::MAX - 8).to_le_bytes());
    assert!(error(&wraps, "an offset that overflows").contains(name));
    let mut overlap = good.clone();
    overlap[offset_at..offset_at + 8].copy_from_slice(&0u64.to_le_bytes());
    assert!(error(&overlap, "overlapping tensors").contains("overlap"));

    let mut dtype = good.clone();
    dtype[dtype_at..dtype_at + 4].copy_from_slice(&77u32.to_le_bytes());
    error(&dtype, "an unknown block format");

    // Metadata of the wrong type, missing, or out of range; an alignment of 0.
    let err = error(
        &tiny_file(&[("llama.block_count", Value::String("one".into()))])?,
        "a string count",
    );
    assert!(err.contains("llama.block_count"), "{err}");
    let err = error(
        &tiny_file(&[("llama.context_length", Value::U64(u64::MAX))])?,
        "a huge context",
    );
    assert!(err.contains("llama.context_length"), "{err}");
    let err = error(
        &tiny_file(&[("llama.attention.head_count", Value::U32(0))])?,
        "no heads",
    );
    assert!(err.contains("llama.attention.head_count"), "{err}");
    let err = error(
        &tiny_file(&[("general.architecture", Value::String("mamba".into()))])?,
        "mamba",
    );
    assert!(err.contains("mamba") && err.contains("qwen3"), "{err}");
    let err = error(
        &tiny_file(&[("tokenizer.ggml.model", Value::String("bert".into()))])?,
        "bert",
    );
    assert!(err.contains("tokenizer.ggml.model"), "{err}");
    let err = error(
        &tiny_file(&[("tokenizer.ggml.pre", Value::String("whatever".into()))])?,
        "a pre-tokenizer",
    );
    assert!(err.contains("whatever") && err.contains("smollm"), "{err}");
    error(
        &tiny_file(&[("general.alignment", Value::U32(0))])?,
        "an alignment of 0",
    );
    // A tensor of the wrong shape names it.
    let err = error(
        &tiny_file(&[("llama.feed_forward_length", Value::U32(96))])?,
        "a wrong MLP width",
    );
    assert!(err.contains("ffn_gate"), "{err}");
    Ok(())
}

/// Seeded random mutations of the header (its first 4 KiB: the counts, the metadata and the
/// tensor infos): each load either succeeds or fails with an error; none panics. Bounded at a
/// few hundred files, about a second.
#[test]
fn mutated_headers_never_panic() -> anyhow::Result<()> {
    let good = tiny_file(&[])?;
    let header = 4096.min(good.len());
    let mut rng = rand::rngs::StdRng::seed_from_u64(90);
    let (mut loaded, mut refused) = (0, 0);
    for trial in 0..300 {
        let mut bytes = good.clone();
        for _ in 0..rng.random_range(1..=4) {
            let at = rng.random_range(8..header);
            bytes[at] = match rng.random_range(0..3) {
                0 => rng.random(),
                1 => 0xff,
                _ => 0,
            };
        }
        match load(&bytes, &format!("mutation {trial}")) {
            Some(_) => refused += 1,
            None => loaded += 1,
        }
    }
    assert!(
        refused > 0 && loaded + refused == 300,
        "{loaded} loaded, {refused} refused"
    );
    Ok(())
}
