//! LoRA adapters in PEFT's format: read and written, set on a model, merged by `gpt-train merge`,
//! refused with the field or tensor named when they do not fit; and, with `GPT_TEST_PYTHON`
//! holding PEFT, interchanged with PEFT itself (`tests/fixtures/peft_lora.py`).

mod common;

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use common::{gpt_train, stderr};
use gpt::lora::{Adapter, LoraConfig, LoraLayer, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE};
use gpt_test_support as support;

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
        layers.insert(name, LoraLayer::new(a, b, config.scale()));
    }
    Ok(Adapter::new(config, layers, cfg)?)
}

/// `gpt-train merge` of `adapter` into the base, to `out`.
fn merge(adapter: &Path, out: &Path) -> Result<std::process::Output> {
    merge_onto(&base_dir(), adapter, out)
}

fn merge_onto(base: &Path, adapter: &Path, out: &Path) -> Result<std::process::Output> {
    gpt_train(&[
        "merge",
        "--checkpoint",
        s(base),
        "--adapter",
        s(adapter),
        "--out",
        s(out),
    ])
}

/// The logits of `IDS` as gpt-server computes them with `adapter`: the base loaded for inference
/// (packed weights) and the adapter's rows updated in a step that also runs a sequence on the
/// base alone.
#[cfg(gpt_test_peft)]
fn served_logits(adapter: &Adapter) -> Result<Vec<Vec<f32>>> {
    let (model, _) = gpt::load_dir_as(&base_dir(), None, &Device::Cpu)?;
    let (mut adapted, mut plain) = (model.new_cache(), model.new_cache());
    let mut steps = [
        gpt::SeqStep {
            tokens: &IDS,
            cache: &mut adapted,
        },
        gpt::SeqStep {
            tokens: &IDS[..5],
            cache: &mut plain,
        },
    ];
    let which = [gpt::LogitsFor::All; 2];
    let hidden = model.forward_step_adapted(&mut steps, &which, &[Some(adapter), None])?;
    Ok(model.logits(&hidden.narrow(0, 0, IDS.len())?)?.to_vec2()?)
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

/// A tiny base model, fully trained for 10 steps, in `dir/base`.
fn tiny_base(dir: &Path) -> Result<PathBuf> {
    let out = dir.join("base");
    let o = common::train(&support::shakespeare_path(), &out, &["--max-iters", "10"])?;
    anyhow::ensure!(o.status.success(), "{}", stderr(&o));
    Ok(out)
}

/// A LoRA run of rank 4 on `base` (c_attn and c_fc) to step `steps`, as `extra` changes it.
fn lora_run(base: &Path, out: &Path, steps: &str, extra: &[&str]) -> Result<std::process::Output> {
    let args = [
        &["--init-from", s(base), "--lora-r", "4", "--lora-targets", "c_attn,c_fc"][..],
        &["--max-iters", steps, "--lr-decay-iters", "20", "--warmup-iters", "2"],
        extra,
    ]
    .concat();
    common::train(&support::shakespeare_path(), out, &args)
}

/// Each tensor of the safetensors files of a checkpoint, as bytes.
fn file_tensors(dir: &Path, file: &str) -> Result<std::collections::BTreeMap<String, Vec<u8>>> {
    let bytes = std::fs::read(dir.join(file))?;
    Ok(safetensors::SafeTensors::deserialize(&bytes)?
        .tensors()
        .into_iter()
        .map(|(name, view)| (name, view.data().to_vec()))
        .collect())
}

#[test]
fn a_lora_run_trains_only_its_adapter_and_saves_it_as_peft_does() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let base = tiny_base(tmp.path())?;
    let run = tmp.path().join("lora");
    let out = lora_run(&base, &run, "20", &[])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let latest = run.join("latest");
    assert!(
        !latest.join(gpt::checkpoint::WEIGHTS_FILE).exists(),
        "a LoRA checkpoint holds no model"
    );
    let cfg = gpt::Config::from_file(&base.join("best/config.json"))?;
    let adapter = Adapter::load(&latest, &cfg, DType::F32, &Device::Cpu)?;
    assert_eq!((adapter.config.r, adapter.config.lora_alpha), (4, 8.0));
    assert_eq!(adapter.layers.len(), 2 * cfg.n_layer, "c_attn and c_fc of every block");
    assert!(adapter
        .layers
        .keys()
        .all(|k| k.ends_with("attn.c_attn") || k.ends_with("mlp.c_fc")));
    for (name, l) in &adapter.layers {
        let b = l.b.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(b > 0.0, "{name}: B is still zero after 20 steps");
    }
    // The optimizer's state is the adapter's alone: two moments per matrix.
    let moments = file_tensors(&latest, "optimizer.safetensors")?;
    let adapter_bytes: usize = file_tensors(&latest, ADAPTER_WEIGHTS_FILE)?
        .values()
        .map(Vec::len)
        .sum();
    assert_eq!(moments.values().map(Vec::len).sum::<usize>(), 2 * adapter_bytes);
    // The base is frozen: merged, only the adapted matrices differ from it.
    let merged = tmp.path().join("merged");
    let out = merge_onto(&base.join("best"), &latest, &merged)?;
    assert!(out.status.success(), "{}", stderr(&out));
    let (before, after) = (
        file_tensors(&base.join("best"), gpt::checkpoint::WEIGHTS_FILE)?,
        file_tensors(&merged, gpt::checkpoint::WEIGHTS_FILE)?,
    );
    for (name, bytes) in &before {
        let adapted = name.ends_with("attn.c_attn.weight") || name.ends_with("mlp.c_fc.weight");
        assert_eq!(after.get(name) != Some(bytes), adapted, "{name}");
    }
    Ok(())
}

#[test]
fn a_lora_run_resumes_exactly_and_keeps_its_shape() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let base = tiny_base(tmp.path())?;
    let (whole, parts) = (tmp.path().join("whole"), tmp.path().join("parts"));
    // With PEFT's lora_dropout, whose masks a resume must draw again as the run did.
    let dropout = ["--lora-dropout", "0.1"];
    assert!(lora_run(&base, &whole, "20", &dropout)?.status.success());
    assert!(lora_run(&base, &parts, "10", &dropout)?.status.success());
    let more = common::train(
        &support::shakespeare_path(),
        &parts,
        &[
            "--resume",
            "--max-iters",
            "20",
            "--lr-decay-iters",
            "20",
            "--warmup-iters",
            "2",
        ],
    )?;
    assert!(more.status.success(), "{}", stderr(&more));
    for file in [ADAPTER_WEIGHTS_FILE, "optimizer.safetensors"] {
        assert!(
            file_tensors(&whole.join("latest"), file)? == file_tensors(&parts.join("latest"), file)?,
            "{file}: resumed at step 10, not the same as the run straight to 20"
        );
    }
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        whole.join("latest").join(ADAPTER_CONFIG_FILE),
    )?)?;
    assert_eq!(config["lora_dropout"], 0.1);
    // The dropout is applied: without it the same run trains another adapter.
    let plain = tmp.path().join("plain");
    assert!(lora_run(&base, &plain, "20", &[])?.status.success());
    assert!(
        file_tensors(&whole.join("latest"), ADAPTER_WEIGHTS_FILE)?
            != file_tensors(&plain.join("latest"), ADAPTER_WEIGHTS_FILE)?,
        "--lora-dropout 0.1 trained the adapter that no dropout trains"
    );
    let err = common::fails(
        &common::train_args(&support::shakespeare_path(), &parts, &["--resume", "--lora-r", "8"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    )?;
    assert!(err.contains("rank 4") && err.contains("--lora-r 8"), "{err}");
    Ok(())
}

#[test]
fn lora_flags_that_cannot_train_are_refused() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let args = |extra: &[&str]| common::train_args(&corpus, &tmp.path().join("never"), extra);
    let run = |extra: &[&str]| -> Result<String> {
        common::fails(&args(extra).iter().map(String::as_str).collect::<Vec<_>>())
    };
    let err = run(&["--lora-r", "4"])?;
    assert!(err.contains("--init-from"), "{err}");
    let base = tiny_base(tmp.path())?;
    let err = run(&["--init-from", s(&base), "--lora-r", "4", "--lora-targets", "q_proj"])?;
    assert!(err.contains("\"q_proj\"") && err.contains("matches no layer"), "{err}");
    let err = run(&["--init-from", s(&base), "--lora-r", "0"])?;
    assert!(err.contains("`r` must be at least 1"), "{err}");
    let err = run(&["--init-from", s(&base), "--lora-r", "4", "--lora-dropout", "1.5"])?;
    assert!(err.contains("`lora_dropout` must be in [0, 1)"), "{err}");
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
        let diff = max_diff(&served_logits(&adapter)?, &theirs);
        assert!(
            diff < 1e-4,
            "PEFT's adapter as gpt-server serves it: logits {diff} from PEFT's"
        );
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
        let theirs = peft_logits("logits", &dir)?;
        let diff = max_diff(&logits(&model)?, &theirs);
        assert!(diff < 1e-4, "PeftModel.from_pretrained: logits {diff} from ours");
        let diff = max_diff(&served_logits(&adapter)?, &theirs);
        assert!(
            diff < 1e-4,
            "PeftModel.from_pretrained: logits {diff} from gpt-server's"
        );
    }
    Ok(())
}

/// QLoRA on GPT-2: the base packed in f32 (`--lora-base f32`) trains the adapter on candle's ops
/// to the dense base's losses (to f32's rounding), and quantized (`q8_0`) it learns as that one
/// does; a resume that would change the base's format is refused by name.
#[test]
fn a_lora_run_on_a_packed_or_quantized_base_learns_as_on_the_dense_one() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let base = tiny_base(tmp.path())?;
    let logged = ["--log-interval", "1"];
    let losses = |name: &str, extra: &[&str]| -> Result<Vec<(u64, f64)>> {
        let out = tmp.path().join(name);
        let o = lora_run(&base, &out, "20", &[&logged[..], extra].concat())?;
        anyhow::ensure!(o.status.success(), "{name}: {}", stderr(&o));
        common::train_losses(&out)
    };
    let dense = losses("dense", &[])?;
    let packed = losses("packed", &["--lora-base", "f32"])?;
    let quantized = losses("q8_0", &["--lora-base", "q8_0"])?;
    assert_eq!(dense.len(), packed.len());
    for ((step, a), (_, b)) in dense.iter().zip(&packed) {
        assert!((a - b).abs() < 1e-3, "step {step}: dense {a} against packed {b}");
    }
    let (first, last) = (dense[0].1, dense[dense.len() - 1].1);
    let (q_first, q_last) = (quantized[0].1, quantized[quantized.len() - 1].1);
    assert!((first - q_first).abs() < 2e-2, "the start: {first} against {q_first}");
    assert!(
        (last - q_last).abs() < 0.2 * (first - last).abs().max(0.05),
        "dense {dense:?} against q8_0 {quantized:?}"
    );
    let o = common::train(
        &support::shakespeare_path(),
        &tmp.path().join("q8_0"),
        &[
            "--resume",
            "--max-iters",
            "30",
            "--lora-r",
            "4",
            "--lora-targets",
            "c_attn,c_fc",
            "--lora-base",
            "q4_0",
        ],
    )?;
    assert!(!o.status.success() && stderr(&o).contains("q4_0"), "{}", stderr(&o));
    Ok(())
}
