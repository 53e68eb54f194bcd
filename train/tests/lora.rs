//! LoRA adapters in PEFT's format: read and written, set on a model, merged by `gpt-train merge`,
//! refused with the field or tensor named when they do not fit; and, with `GPT_TEST_PYTHON`
//! holding PEFT, interchanged with PEFT itself (`tests/fixtures/peft_lora.py`).

mod common;

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use common::{gpt_train, stderr};
use gpt::lora::{Adapter, LoraConfig, LoraLayer, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};

fn s(path: &Path) -> &str {
    path.to_str().unwrap_or_default()
}

fn base_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2")
}

/// Token ids of the base's vocabulary to run the models on.
const IDS: [u32; 12] = [5, 17, 200, 3, 99, 42, 7, 310, 64, 1, 128, 250];

fn logits(model: &gpt::Gpt) -> Result<Vec<Vec<f32>>> {
    let idx = Tensor::new(&IDS[..], &Device::Cpu)?.unsqueeze(0)?;
    Ok(model.forward(&idx, None)?.squeeze(0)?.to_vec2()?)
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A random adapter of rank 2 for the base (every block's c_attn, both c_proj and c_fc), B
/// not zero.
fn random_adapter(cfg: &gpt::Config) -> Result<Adapter> {
    let config = LoraConfig {
        r: 2,
        lora_alpha: 6.0,
        lora_dropout: 0.0,
        target_modules: vec!["c_attn".into(), "c_proj".into(), "mlp.c_fc".into()],
        layers_to_transform: None,
        use_rslora: false,
        base_model_name_or_path: Some("tiny-gpt2".into()),
    };
    let mut layers = std::collections::BTreeMap::new();
    for (name, d_in, d_out) in config.layers(cfg)? {
        let a = (Tensor::randn(0f32, 1.0, (config.r, d_in), &Device::Cpu)? * 0.2)?;
        let b = (Tensor::randn(0f32, 1.0, (d_out, config.r), &Device::Cpu)? * 0.2)?;
        layers.insert(
            name,
            LoraLayer {
                a,
                b,
                scale: config.scale(),
            },
        );
    }
    Ok(Adapter { config, layers })
}

/// `gpt-train merge` of `adapter` into the base, to `out`.
fn merge(adapter: &Path, out: &Path) -> Result<std::process::Output> {
    gpt_train(&[
        "merge",
        "--checkpoint",
        s(&base_dir()),
        "--adapter",
        s(adapter),
        "--out",
        s(out),
    ])
}

fn base() -> Result<gpt::Gpt> {
    Ok(gpt::load_dir(&base_dir(), DType::F32, &Device::Cpu)?.0)
}

#[test]
fn an_adapter_round_trips_and_merges_to_the_output_it_gives() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let mut model = base()?;
    let adapter = random_adapter(model.config())?;
    assert_eq!(
        adapter.layers.len(),
        2 * 4,
        "c_attn, both c_proj and c_fc in each of 2 blocks"
    );
    let dir = tmp.path().join("adapter");
    adapter.save(&dir)?;
    let read = Adapter::load(&dir, model.config(), DType::F32, &Device::Cpu)?;
    assert_eq!(read.config, adapter.config);
    for (name, l) in &adapter.layers {
        let r = &read.layers[name];
        assert_eq!(r.a.to_vec2::<f32>()?, l.a.to_vec2::<f32>()?, "{name}");
        assert_eq!(r.b.to_vec2::<f32>()?, l.b.to_vec2::<f32>()?, "{name}");
    }
    let plain = logits(&model)?;
    model.set_adapter(Some(&read))?;
    let adapted = logits(&model)?;
    assert!(max_diff(&plain, &adapted) > 1e-2, "the adapter changes the output");
    model.set_adapter(None)?;
    assert_eq!(max_diff(&plain, &logits(&model)?), 0.0, "removing it restores the base");

    let merged_dir = tmp.path().join("merged");
    let out = merge(&dir, &merged_dir)?;
    assert!(out.status.success(), "{}", stderr(&out));
    let merged = gpt::load_dir(&merged_dir, DType::F32, &Device::Cpu)?.0;
    let diff = max_diff(&adapted, &logits(&merged)?);
    assert!(
        diff < 1e-4,
        "the merged checkpoint's logits are {diff} from the adapter's"
    );
    Ok(())
}

/// `gpt-train merge` with `adapter` on the base: it fails, its error holds every `expected`
/// piece, and it writes nothing.
fn refused(tmp: &Path, adapter: &Path, expected: &[&str]) -> Result<()> {
    let out_dir = tmp.join("never");
    let out = merge(adapter, &out_dir)?;
    let err = stderr(&out);
    assert!(!out.status.success(), "accepted: {expected:?}");
    for piece in expected {
        assert!(err.contains(piece), "the error does not name {piece:?}: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    assert!(!out_dir.exists(), "a refused merge wrote {}", out_dir.display());
    Ok(())
}

fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> Result<()> {
    let path = dir.join(ADAPTER_CONFIG_FILE);
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    edit(&mut v);
    std::fs::write(&path, serde_json::to_string(&v)?)?;
    Ok(())
}

#[test]
fn adapters_that_do_not_fit_are_refused_naming_the_field_or_tensor() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = base()?;
    let good = tmp.path().join("good");
    random_adapter(model.config())?.save(&good)?;
    let copy = |name: &str| -> Result<PathBuf> {
        let dir = tmp.path().join(name);
        std::fs::create_dir_all(&dir)?;
        for f in [ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE] {
            std::fs::copy(good.join(f), dir.join(f))?;
        }
        Ok(dir)
    };

    // Another base: the same layers of a wider model.
    let mut wide = model.config().clone();
    wide.n_embd = 48;
    let other = copy("other-base")?;
    random_adapter(&wide)?.save(&other)?;
    refused(
        tmp.path(),
        &other,
        &[
            "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight",
            "[2, 32]",
            "[2, 48]",
        ],
    )?;

    let rank = copy("rank")?;
    edit_config(&rank, |v| v["r"] = 8.into())?;
    refused(tmp.path(), &rank, &["lora_A.weight", "[8, 32]", "[2, 32]"])?;

    let unknown = copy("unknown-target")?;
    edit_config(&unknown, |v| {
        v["target_modules"] = serde_json::json!(["c_attn", "q_proj"])
    })?;
    refused(
        tmp.path(),
        &unknown,
        &["\"q_proj\"", "matches no layer", ADAPTER_CONFIG_FILE],
    )?;

    let dora = copy("dora")?;
    edit_config(&dora, |v| v["use_dora"] = true.into())?;
    refused(tmp.path(), &dora, &["use_dora", "DoRA"])?;

    // Fewer targets than the tensors: the extra tensor is named.
    let extra = copy("extra")?;
    edit_config(&extra, |v| {
        v["target_modules"] = serde_json::json!(["c_attn", "c_proj"])
    })?;
    refused(tmp.path(), &extra, &["mlp.c_fc.lora_A.weight", "is not a LoRA matrix"])?;

    let missing = copy("missing")?;
    std::fs::remove_file(missing.join(ADAPTER_WEIGHTS_FILE))?;
    refused(tmp.path(), &missing, &[ADAPTER_WEIGHTS_FILE, "not found"])?;

    let broken = copy("broken")?;
    std::fs::write(broken.join(ADAPTER_CONFIG_FILE), "{\"r\": 2,")?;
    refused(tmp.path(), &broken, &[ADAPTER_CONFIG_FILE, "not valid JSON"])?;

    let truncated = copy("truncated")?;
    let bytes = std::fs::read(good.join(ADAPTER_WEIGHTS_FILE))?;
    std::fs::write(truncated.join(ADAPTER_WEIGHTS_FILE), &bytes[..bytes.len() / 2])?;
    refused(tmp.path(), &truncated, &[ADAPTER_WEIGHTS_FILE])?;
    Ok(())
}

#[cfg(gpt_test_peft)]
fn python(args: &[&str]) -> Result<String> {
    let python = std::env::var("GPT_TEST_PYTHON")?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/peft_lora.py");
    let out = std::process::Command::new(python).arg(script).args(args).output()?;
    anyhow::ensure!(
        out.status.success(),
        "peft_lora.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

#[cfg(gpt_test_peft)]
fn peft_logits(cmd: &str, adapter: &Path) -> Result<Vec<Vec<f32>>> {
    let ids = serde_json::to_string(&IDS)?;
    let out = python(&[cmd, s(&base_dir()), s(adapter), &ids])?;
    Ok(serde_json::from_str(&out)?)
}

#[test]
#[cfg_attr(
    not(gpt_test_peft),
    ignore = "needs GPT_TEST_PYTHON, a Python with PEFT, transformers and torch"
)]
fn a_peft_adapter_gives_peft_logits_here_and_merged() -> Result<()> {
    #[cfg(gpt_test_peft)]
    {
        let tmp = tempfile::tempdir()?;
        let dir = tmp.path().join("peft");
        python(&["make", s(&base_dir()), s(&dir), "7"])?;
        let mut model = base()?;
        let adapter = Adapter::load(&dir, model.config(), DType::F32, &Device::Cpu)?;
        assert_eq!(adapter.layers.len(), 2 * 4);
        model.set_adapter(Some(&adapter))?;
        let ours = logits(&model)?;
        let theirs = peft_logits("logits", &dir)?;
        let diff = max_diff(&ours, &theirs);
        assert!(diff < 1e-4, "PEFT's adapter: logits {diff} from PEFT's");
        assert!(
            max_diff(&ours, &logits(&base()?)?) > 1e-2,
            "the adapter changes the output"
        );

        let merged_dir = tmp.path().join("merged");
        let out = merge(&dir, &merged_dir)?;
        assert!(out.status.success(), "{}", stderr(&out));
        let merged = gpt::load_dir(&merged_dir, DType::F32, &Device::Cpu)?.0;
        let diff = max_diff(&logits(&merged)?, &peft_logits("merged-logits", &dir)?);
        assert!(diff < 1e-4, "merged: logits {diff} from PEFT's merge_and_unload");
    }
    Ok(())
}

#[test]
#[cfg_attr(
    not(gpt_test_peft),
    ignore = "needs GPT_TEST_PYTHON, a Python with PEFT, transformers and torch"
)]
fn an_adapter_saved_here_loads_in_peft_with_the_same_logits() -> Result<()> {
    #[cfg(gpt_test_peft)]
    {
        let tmp = tempfile::tempdir()?;
        let mut model = base()?;
        let adapter = random_adapter(model.config())?;
        let dir = tmp.path().join("ours");
        adapter.save(&dir)?;
        model.set_adapter(Some(&adapter))?;
        let diff = max_diff(&logits(&model)?, &peft_logits("logits", &dir)?);
        assert!(diff < 1e-4, "PeftModel.from_pretrained: logits {diff} from ours");
    }
    Ok(())
}
