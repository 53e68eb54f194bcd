//! Parity with the reference implementation: `tests/fixtures/tiny-gpt2` was written by
//! `transformers` (`make_gpt2_fixture.py`), with the logits it computes for a few texts, and the
//! gradients of a training loss by PyTorch's autograd (`make_grad_fixture.py`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use gpt::{LogitsFor, SeqStep};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-gpt2")
}

struct Case {
    text: String,
    ids: Vec<u32>,
    decoded: String,
    logits: Tensor, // (T, V)
}

fn cases() -> anyhow::Result<Vec<Case>> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture().join("expected.json"))?)?;
    let mut logits = candle_core::safetensors::load(fixture().join("expected.safetensors"), &Device::Cpu)?;
    let cases = json["cases"].as_array().ok_or_else(|| anyhow::anyhow!("no cases"))?;
    cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            Ok(Case {
                text: c["text"].as_str().unwrap_or_default().to_string(),
                ids: serde_json::from_value(c["ids"].clone())?,
                decoded: c["decoded"].as_str().unwrap_or_default().to_string(),
                logits: logits
                    .remove(&format!("logits_{i}"))
                    .ok_or_else(|| anyhow::anyhow!("logits_{i}"))?,
            })
        })
        .collect()
}

use gpt_test_support as support;
use support::max_abs_diff;

fn check_logits(model: &gpt::Gpt, what: &str) -> anyhow::Result<()> {
    for (i, case) in cases()?.iter().enumerate() {
        let idx = Tensor::new(vec![case.ids.clone()], &Device::Cpu)?;
        let full = model.forward(&idx, None)?.squeeze(0)?;
        let diff = max_abs_diff(&full, &case.logits)?;
        assert!(
            diff < 1e-4,
            "{what}, case {i}: max abs diff {diff} against transformers"
        );

        // And through the KV cache: a prefill of half, then one token at a time.
        let mut cache = model.new_cache();
        let half = case.ids.len() / 2;
        let mut rows = vec![model.forward_step(
            &mut [SeqStep {
                tokens: &case.ids[..half],
                cache: &mut cache,
            }],
            LogitsFor::All,
        )?];
        for id in &case.ids[half..] {
            rows.push(model.forward_step(
                &mut [SeqStep {
                    tokens: std::slice::from_ref(id),
                    cache: &mut cache,
                }],
                LogitsFor::Last,
            )?);
        }
        let diff = max_abs_diff(&Tensor::cat(&rows, 0)?, &case.logits)?;
        assert!(diff < 1e-4, "{what}, case {i} with cache: max abs diff {diff}");
    }
    Ok(())
}

#[test]
fn logits_match_transformers() -> anyhow::Result<()> {
    let (model, _) = gpt::load_dir(&fixture(), DType::F32, &Device::Cpu)?;
    assert_eq!(model.num_parameters(), 37_760); // as printed by make_gpt2_fixture.py
    check_logits(&model, "fixture")
}

#[test]
fn tokenizer_matches_python_tokenizers() -> anyhow::Result<()> {
    let (_, tok) = gpt::load_dir(&fixture(), DType::F32, &Device::Cpu)?;
    for case in cases()? {
        assert_eq!(tok.encode(&case.text)?, case.ids, "{:?}", case.text);
        assert_eq!(tok.decode(&case.ids)?, case.decoded);
        assert_eq!(case.decoded, case.text);
    }
    Ok(())
}

/// The Hub's own GPT-2 files have no `transformer.` prefix and carry `attn.bias` /
/// `attn.masked_bias` buffers (and sometimes `lm_head.weight`); they must load unchanged.
#[test]
fn hub_layout_without_prefix_and_with_buffers_loads() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture().join(file), dir.path().join(file))?;
    }
    let tensors = candle_core::safetensors::load(fixture().join("model.safetensors"), &Device::Cpu)?;
    let mut hub: HashMap<String, Tensor> = HashMap::new();
    for (name, t) in tensors {
        if name == "transformer.wte.weight" {
            hub.insert("lm_head.weight".into(), t.clone());
        }
        hub.insert(name.trim_start_matches("transformer.").to_string(), t);
    }
    for layer in 0..2 {
        hub.insert(
            format!("h.{layer}.attn.bias"),
            Tensor::tril2(64, DType::F32, &Device::Cpu)?.reshape((1, 1, 64, 64))?,
        );
        hub.insert(
            format!("h.{layer}.attn.masked_bias"),
            Tensor::new(-1e4f32, &Device::Cpu)?,
        );
    }
    candle_core::safetensors::save(&hub, dir.path().join("model.safetensors"))?;
    let (model, _) = gpt::load_dir(dir.path(), DType::F32, &Device::Cpu)?;
    check_logits(&model, "hub layout")
}

/// What we save has exactly the names, shapes, dtypes and metadata `save_pretrained` wrote.
/// With GPT_SAVE_FOR_HF=DIR the re-saved checkpoint is also left in DIR, for
/// `tests/fixtures/check_hf_load.py` to load in `transformers`.
#[test]
fn saved_checkpoint_has_the_transformers_layout() -> anyhow::Result<()> {
    let (model, tok) = gpt::load_dir(&fixture(), DType::F32, &Device::Cpu)?;
    let tmp = tempfile::tempdir()?;
    let out = std::env::var_os("GPT_SAVE_FOR_HF")
        .map(PathBuf::from)
        .unwrap_or_else(|| tmp.path().to_path_buf());
    gpt::save_dir(&out, &model, &tok, DType::F32)?;

    let ours = std::fs::read(out.join("model.safetensors"))?;
    let theirs = std::fs::read(fixture().join("model.safetensors"))?;
    let metadata = |bytes: &[u8]| -> anyhow::Result<_> {
        Ok(safetensors::SafeTensors::read_metadata(bytes)?.1.metadata().clone())
    };
    assert_eq!(metadata(&ours)?, metadata(&theirs)?);
    let (ours, theirs) = (
        safetensors::SafeTensors::deserialize(&ours)?,
        safetensors::SafeTensors::deserialize(&theirs)?,
    );
    let mut names: Vec<_> = ours.names();
    names.sort();
    let mut expected: Vec<_> = theirs.names();
    expected.sort();
    assert_eq!(names, expected);
    for name in names {
        let (a, b) = (ours.tensor(name)?, theirs.tensor(name)?);
        assert_eq!((a.shape(), a.dtype()), (b.shape(), b.dtype()), "{name}");
        assert_eq!(a.data(), b.data(), "{name}: values changed in the round trip");
    }
    // transformers is told to use tokenizer.json as it is, with GPT-2's end-of-text token.
    let hf: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json"))?)?;
    assert_eq!(hf["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(
        (hf["eos_token"].as_str(), hf["bos_token"].as_str()),
        (Some("<|endoftext|>"), Some("<|endoftext|>"))
    );
    // Half-precision saves convert every tensor.
    gpt::save_dir(tmp.path(), &model, &tok, DType::F16)?;
    let half = gpt::load_model(tmp.path(), DType::F32, &Device::Cpu)?;
    let diff = max_abs_diff(&half.named_tensors()?[0].1, &model.named_tensors()?[0].1)?;
    assert!(diff > 0.0 && diff < 1e-2, "f16 save: {diff}");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json"))?)?;
    assert_eq!(cfg["torch_dtype"], "float16");
    Ok(())
}

/// One backward pass's result: its name, the loss, and every variable's gradient.
type Way = (&'static str, f32, Vec<Option<Tensor>>);

/// The gradient fixture (`make_grad_fixture.py`): PyTorch's reference tensors, and the fixture
/// model built for training (its weights in fresh variables) with the fixture's batch.
struct GradFixture {
    reference: HashMap<String, Tensor>,
    model: gpt::Gpt,
    named: Vec<(String, candle_core::Var)>,
    x: Tensor,
    y: Tensor,
}

impl GradFixture {
    fn load(autocast: gpt::Autocast) -> anyhow::Result<Self> {
        let dev = Device::Cpu;
        let reference = candle_core::safetensors::load(fixture().join("grads.safetensors"), &dev)?;
        let cfg = gpt::Config::from_file(&fixture().join("config.json"))?;
        let varmap = candle_nn::VarMap::new();
        let model =
            gpt::Gpt::new(candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &dev), &cfg)?.with_autocast(autocast);
        let named = gpt_train::init::named_vars(&varmap)?;
        let base = gpt::load_model(&fixture(), DType::F32, &dev)?;
        let weights: HashMap<String, Tensor> = base
            .named_tensors()?
            .into_iter()
            .map(|(name, t)| (name.trim_start_matches("transformer.").to_string(), t))
            .collect();
        for (name, var) in &named {
            let t = weights.get(name).ok_or_else(|| anyhow::anyhow!("no weight `{name}`"))?;
            var.set(&t.contiguous()?)?;
        }
        let mut fixture = Self {
            reference,
            model,
            named,
            x: Tensor::zeros(1, DType::U32, &dev)?,
            y: Tensor::zeros(1, DType::U32, &dev)?,
        };
        let ids = fixture.get("ids")?.to_dtype(DType::U32)?;
        let t = ids.dim(1)? - 1;
        (fixture.x, fixture.y) = (ids.narrow(1, 0, t)?, ids.narrow(1, 1, t)?);
        Ok(fixture)
    }

    fn get(&self, name: &str) -> anyhow::Result<Tensor> {
        (self.reference.get(name).cloned()).ok_or_else(|| anyhow::anyhow!("grads.safetensors: no `{name}`"))
    }

    /// The training loss with label smoothing `eps` and the gradient of every variable (in
    /// `named`'s order), by candle's backward pass and by the tape's (what `gpt-train` runs).
    fn loss_and_grads(&self, eps: f32) -> anyhow::Result<Vec<Way>> {
        let train = Some(gpt::Dropout { key: 0, first_row: 0 });
        let leaves: Vec<&Tensor> = self.named.iter().map(|(_, v)| v.as_tensor()).collect();
        let loss = self.model.loss(&self.x, &self.y, train, eps)?;
        let mut grads = loss.backward()?;
        let candle = leaves.iter().map(|t| grads.remove(t)).collect();
        let (tape_loss, tape) = gpt_kernels::tape::record(|| self.model.loss(&self.x, &self.y, train, eps))?;
        let on_tape = tape.backward(&tape_loss, 1.0, &leaves)?;
        Ok(vec![
            ("candle's backward", loss.to_scalar::<f32>()?, candle),
            ("the tape", tape_loss.to_scalar::<f32>()?, on_tape),
        ])
    }
}

/// The training path's loss and the gradient of every parameter (the packed linear products, the
/// fused LM head and loss, LayerNorm, GELU, softmax and adds, each with its backward) against
/// PyTorch autograd in f64 on the fixture model (`make_grad_fixture.py`): three windows of the
/// whole context, plain and with label smoothing 0.1. Each gradient within 1e-5 of its largest
/// magnitude. Both backward passes: candle's and the tape's.
#[test]
fn training_gradients_match_pytorch_autograd() -> anyhow::Result<()> {
    let f = GradFixture::load(gpt::Autocast::Off)?;
    let get = |name: &str| f.get(name);
    for eps in [0.0f32, 0.1] {
        for (way, got, grads) in f.loss_and_grads(eps)? {
            let want = get(&format!("eps{eps}.loss"))?.flatten_all()?.to_vec1::<f32>()?[0];
            assert!(
                (got - want).abs() <= 1e-5 * want.abs(),
                "{way}, eps {eps}: loss {got} vs {want}"
            );
            for ((name, _), got) in f.named.iter().zip(&grads) {
                let want = get(&format!("eps{eps}.transformer.{name}"))?;
                let got = got
                    .as_ref()
                    .ok_or_else(|| anyhow::anyhow!("{way}, eps {eps}: no gradient for `{name}`"))?;
                let size = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
                let diff = max_abs_diff(got, &want)?;
                assert!(
                    diff <= 1e-5 * size,
                    "{way}, eps {eps}: `{name}` differs by {diff:e} of {size:e}"
                );
            }
        }
    }
    Ok(())
}

/// bf16 mixed precision (`gpt-train --dtype bf16`: the linear products and the LM head on bf16
/// operands, f32 sums; attention, LayerNorm, GELU and the loss in f32) against PyTorch autograd in
/// f64 on the fixture: each gradient within twice the deviation of PyTorch's own
/// `torch.autocast(bfloat16)` from f64 on the same batch (`bf16_error.*` in the fixture), and
/// within 2% of its largest magnitude. The loss within 0.5%.
#[test]
fn bf16_training_gradients_stay_within_pytorch_autocasts_deviation() -> anyhow::Result<()> {
    let f = GradFixture::load(gpt::Autocast::Bf16)?;
    let get = |name: &str| f.get(name);
    let mut worst = 0f32;
    for (way, got, grads) in f.loss_and_grads(0.0)? {
        let want = get("eps0.loss")?.flatten_all()?.to_vec1::<f32>()?[0];
        assert!((got - want).abs() <= 5e-3 * want.abs(), "{way}: loss {got} vs {want}");
        for ((name, _), got) in f.named.iter().zip(&grads) {
            let want = get(&format!("eps0.transformer.{name}"))?;
            let torch = get(&format!("bf16_error.transformer.{name}"))?
                .flatten_all()?
                .to_vec1::<f32>()?[0];
            let got = got
                .as_ref()
                .ok_or_else(|| anyhow::anyhow!("{way}: no gradient for `{name}`"))?;
            let size = want.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            let diff = max_abs_diff(got, &want)?;
            worst = worst.max(diff / torch);
            assert!(
                diff <= 2.0 * torch && diff <= 0.02 * size,
                "{way}: `{name}` differs by {diff:e} (PyTorch's autocast: {torch:e}; largest gradient {size:e})"
            );
        }
    }
    println!("bf16 gradients: at most {worst:.2}x PyTorch autocast's deviation from f64");
    Ok(())
}
