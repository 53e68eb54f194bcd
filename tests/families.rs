//! The decoder families against `transformers`: each `tests/fixtures/families/<case>` was written
//! by `transformers` (`make_family_fixtures.py`: Llama with grouped-query and multi-query
//! attention, tied and untied heads and Llama 3's rotary rescaling; Qwen2's q, k, v biases;
//! Qwen3's QK-norm and head width; Arcee's ungated squared-ReLU MLP; Mistral with and without a sliding window shorter than the
//! sequences; Gemma 2's soft-capping and sliding layers; Gemma 3's QK-norm, local RoPE base and
//! query scalar, one config as `transformers` 4 wrote it), every parameter random, with the logits it computes
//! and its greedy continuation. Each must load from the checkpoint as saved, give those logits
//! within 1e-4 over whole windows and through the KV cache (alone and batched with another
//! sequence), the same greedy tokens, and save back to a checkpoint with the same tensors.

use candle_core::{DType, Device, Tensor};
use gpt::{LogitsFor, SeqStep};
use gpt_test_support::max_abs_diff;

use gpt_test_support::{family_dir as dir, FAMILY_CASES as CASES};

struct Expected {
    sequences: Vec<Vec<u32>>,
    logits: Vec<Tensor>,
    greedy_prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn expected(case: &str) -> anyhow::Result<Expected> {
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir(case).join("expected.json"))?)?;
    let mut tensors = candle_core::safetensors::load(dir(case).join("expected.safetensors"), &Device::Cpu)?;
    let sequences: Vec<Vec<u32>> = serde_json::from_value(json["sequences"].clone())?;
    let logits = (0..sequences.len())
        .map(|i| {
            tensors
                .remove(&format!("logits_{i}"))
                .ok_or_else(|| anyhow::anyhow!("logits_{i}"))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok(Expected {
        sequences,
        logits,
        greedy_prompt: serde_json::from_value(json["greedy_prompt"].clone())?,
        greedy: serde_json::from_value(json["greedy"].clone())?,
    })
}

fn step(model: &gpt::Gpt, cache: &mut gpt::KvCache, tokens: &[u32], which: LogitsFor) -> anyhow::Result<Tensor> {
    Ok(model.forward_step(&mut [SeqStep { tokens, cache }], which)?)
}

/// Whole windows, the cache token by token after a prefill of half, and each sequence batched
/// with another one in the same steps: every path within `tol` of `transformers`' logits.
fn check_logits(model: &gpt::Gpt, case: &str, tol: f32) -> anyhow::Result<()> {
    let e = expected(case)?;
    for (i, (ids, want)) in e.sequences.iter().zip(&e.logits).enumerate() {
        let full = model
            .forward(&Tensor::new(vec![ids.clone()], &Device::Cpu)?, None)?
            .squeeze(0)?;
        let d = max_abs_diff(&full, want)?;
        assert!(
            d < tol,
            "{case}, sequence {i}, whole window: max abs diff {d} against transformers"
        );

        let mut cache = model.new_cache();
        let half = ids.len().div_ceil(2);
        let mut rows = vec![step(model, &mut cache, &ids[..half], LogitsFor::All)?];
        for id in &ids[half..] {
            rows.push(step(model, &mut cache, std::slice::from_ref(id), LogitsFor::Last)?);
        }
        let d = max_abs_diff(&Tensor::cat(&rows, 0)?, want)?;
        assert!(d < tol, "{case}, sequence {i}, through the cache: max abs diff {d}");
    }
    // Batched: the first sequence in the same steps as the third, which starts later.
    let (a, b) = (&e.sequences[0], &e.sequences[2]);
    let (mut ca, mut cb) = (model.new_cache(), model.new_cache());
    step(model, &mut ca, &a[..4], LogitsFor::All)?;
    let both = model.forward_step(
        &mut [
            SeqStep {
                tokens: &a[4..],
                cache: &mut ca,
            },
            SeqStep {
                tokens: b,
                cache: &mut cb,
            },
        ],
        LogitsFor::All,
    )?;
    let d = max_abs_diff(
        &both.narrow(0, 0, a.len() - 4)?,
        &e.logits[0].narrow(0, 4, a.len() - 4)?,
    )?;
    let d2 = max_abs_diff(&both.narrow(0, a.len() - 4, b.len())?, &e.logits[2])?;
    assert!(d.max(d2) < tol, "{case}, batched: max abs diff {d}, {d2}");
    Ok(())
}

/// The greedy continuation, token by token through the cache.
fn greedy(model: &gpt::Gpt, prompt: &[u32], n: usize) -> anyhow::Result<Vec<u32>> {
    let mut cache = model.new_cache();
    let mut logits = step(model, &mut cache, prompt, LogitsFor::Last)?;
    let mut out = Vec::new();
    for _ in 0..n {
        let next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        out.push(next);
        logits = step(model, &mut cache, &[next], LogitsFor::Last)?;
    }
    Ok(out)
}

#[test]
fn every_family_gives_transformers_logits_and_greedy_text() -> anyhow::Result<()> {
    for case in CASES {
        let (model, _) =
            gpt::load_dir(&dir(case), DType::F32, &Device::Cpu).map_err(|e| anyhow::anyhow!("{case}: {e}"))?;
        check_logits(&model, case, 1e-4)?;
        let e = expected(case)?;
        assert_eq!(
            greedy(&model, &e.greedy_prompt, e.greedy.len())?,
            e.greedy,
            "{case}: greedy tokens"
        );
    }
    Ok(())
}

/// The same checkpoints in f16 activations and weights (candle's ops rather than the fused f32
/// kernels), within f16's rounding of the reference: 2% of the largest logit (Gemma's gains of
/// `1 + w` make its logits the largest here, up to 5).
#[test]
fn every_family_runs_in_half_precision() -> anyhow::Result<()> {
    for case in CASES {
        let model = gpt::load_model(&dir(case), DType::F16, &Device::Cpu)?;
        let mut largest = 0f32;
        for logits in expected(case)?.logits {
            largest = largest.max(logits.abs()?.max_all()?.to_scalar::<f32>()?);
        }
        check_logits(&model, case, 0.02 * largest.max(1.0))?;
    }
    Ok(())
}

/// Saved back (`save_dir`), a checkpoint holds the tensors `transformers` saved under the same
/// names and a config that loads back to the same model.
#[test]
fn every_family_saves_the_tensors_transformers_saved() -> anyhow::Result<()> {
    for case in CASES {
        let (model, tok) = gpt::load_dir(&dir(case), DType::F32, &Device::Cpu)?;
        let out = tempfile::tempdir()?;
        gpt::save_dir(out.path(), &model, &tok, DType::F32)?;
        let theirs = candle_core::safetensors::load(dir(case).join("model.safetensors"), &Device::Cpu)?;
        let ours = candle_core::safetensors::load(out.path().join("model.safetensors"), &Device::Cpu)?;
        let mut names: Vec<_> = theirs.keys().collect();
        names.sort();
        let mut our_names: Vec<_> = ours.keys().collect();
        our_names.sort();
        assert_eq!(our_names, names, "{case}: tensor names");
        // Gemma's gains are held as `1 + w` and saved as `w` again: within f32's rounding of
        // the sum (exact for gains stored in bf16 or f16).
        let tol = if case.starts_with("gemma") { 2e-7 } else { 0.0 };
        for (name, t) in &theirs {
            let d = max_abs_diff(&ours[name], t)?;
            assert!(d <= tol, "{case}: {name} differs by {d}");
        }
        let again = gpt::load_model(out.path(), DType::F32, &Device::Cpu)?;
        assert_eq!(again.config(), model.config(), "{case}: config.json round trip");
        check_logits(&again, case, 1e-4)?;
    }
    Ok(())
}

/// `gpt-train export --out FILE.gguf`: every family written as llama.cpp's GGUF file (its
/// tokenizer, Llama's rows interleaved, Llama 3's frequencies as `rope_freqs`, Gemma's gains as
/// `1 + w` and its windows and caps as metadata) reads back with `transformers`' logits and the
/// same tokenizer; in q8_0, a loss within 1% of f32's. (gemma3-scalar's query scalar is not the head
/// width llama.cpp assumes: refused, naming it.)
#[test]
fn every_family_exports_to_llama_cpp_gguf_and_reads_back() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    for case in CASES {
        let (model, tok) = gpt::load_dir(&dir(case), DType::F32, &Device::Cpu)?;
        let path = out.path().join(format!("{case}.gguf"));
        if case == "gemma3-scalar" {
            let err = gpt::llamacpp::save(&path, &model, &tok, gpt::WeightFormat::F32)
                .unwrap_err()
                .to_string();
            assert!(err.contains("query_pre_attn_scalar"), "{err}");
            continue;
        }
        gpt::llamacpp::save(&path, &model, &tok, gpt::WeightFormat::F32)?;
        let (back, back_tok) =
            gpt::load_dir_as(&path, None, &Device::Cpu).map_err(|e| anyhow::anyhow!("{case}: {e}"))?;
        check_logits(&back, case, 1e-4)?;
        let text = "First Citizen:\nBefore we proceed any further, hear me speak. 0123";
        assert_eq!(back_tok.encode(text)?, tok.encode(text)?, "{case}: tokenizer");
        assert_eq!(
            back.config().variant.eos_token_ids.first(),
            model.config().eos_ids().first(),
            "{case}"
        );
        gpt::llamacpp::save(&path, &model, &tok, gpt::WeightFormat::Q8_0)?;
        let (q8, _) = gpt::load_dir_as(&path, None, &Device::Cpu)?;
        let ids = expected(case)?.sequences[2].clone();
        let t = ids.len() - 1;
        let (idx, targets) = (
            Tensor::new(&ids[..t], &Device::Cpu)?.unsqueeze(0)?,
            Tensor::new(&ids[1..], &Device::Cpu)?.unsqueeze(0)?,
        );
        let nll = |m: &gpt::Gpt| -> anyhow::Result<f32> { Ok(m.loss(&idx, &targets, None, 0.0)?.to_scalar::<f32>()?) };
        let (exact, quantized) = (nll(&back)?, nll(&q8)?);
        assert!(
            (quantized - exact).abs() < 0.01 * exact,
            "{case}: q8_0's loss {quantized} against f32's {exact}"
        );
    }
    Ok(())
}

/// Saved by this project, each checkpoint loads in `transformers` as its family's class and gives
/// the logits `transformers` computed for the original (`check_family_load.py`): the config.json
/// as `transformers` reads it, Gemma's gains written back as `w`.
#[test]
fn every_family_saved_here_loads_in_transformers() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let mut pairs = Vec::new();
    for case in CASES {
        let (model, tok) = gpt::load_dir(&dir(case), DType::F32, &Device::Cpu)?;
        gpt::save_dir(&out.path().join(case), &model, &tok, DType::F32)?;
        pairs.push((out.path().join(case), dir(case)));
    }
    gpt_test_support::check_in_transformers(&pairs)?;
    Ok(())
}

/// Fine-tuning a family: the loss and every weight's gradient on a sequence, as the trainer
/// computes them (the weights as variables, candle's backward pass), equal to `transformers`'
/// (`family_grads.py`: `labels=`' mean cross-entropy, `backward()`), within 1e-4 of each
/// gradient's largest value.
#[test]
fn every_family_trains_with_transformers_gradients() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let run = std::process::Command::new(gpt_test_support::python())
        .arg(gpt_test_support::repo("tests/fixtures/family_grads.py"))
        .arg(out.path())
        .args(CASES.map(dir))
        .output()?;
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    for case in CASES {
        let cfg = gpt::Config::from_file(&dir(case).join("config.json"))?;
        let varmap = candle_nn::VarMap::new();
        let model = gpt::Gpt::new_trainable(
            candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
            &cfg,
        )?;
        let weights = candle_core::safetensors::load(dir(case).join("model.safetensors"), &Device::Cpu)?;
        let weights = gpt::arch::trainable_tensors(&cfg, weights)?;
        let vars = varmap.data().lock().map_err(|_| anyhow::anyhow!("varmap"))?.clone();
        assert_eq!(vars.len(), weights.len(), "{case}: a variable for every tensor");
        for (name, var) in &vars {
            let w = weights.get(name).ok_or_else(|| anyhow::anyhow!("{case}: no {name}"))?;
            var.set(w)?;
        }
        let ids = expected(case)?.sequences[0].clone();
        let t = ids.len() - 1;
        let idx = Tensor::new(&ids[..t], &Device::Cpu)?.unsqueeze(0)?;
        let targets = Tensor::new(&ids[1..], &Device::Cpu)?.unsqueeze(0)?;
        let train = gpt::layers::Dropout { key: 0, first_row: 0 };
        let loss = model.loss(&idx, &targets, Some(train), 0.0)?;
        let theirs = candle_core::safetensors::load(out.path().join(format!("{case}.safetensors")), &Device::Cpu)?;
        let want = theirs["loss"].to_vec1::<f32>()?[0];
        let got = loss.to_scalar::<f32>()?;
        assert!((got - want).abs() < 1e-5, "{case}: loss {got} vs transformers {want}");
        let grads = loss.backward()?;
        // transformers' gradients stacked as our variables are (q, k, v; gate, up), which is
        // exact; Gemma's gains' gradients are those of `1 + w`, the same (less `loss`).
        let mut theirs = theirs;
        theirs.remove("loss");
        let mut theirs = gpt::arch::trainable_tensors(&cfg, theirs)?;
        if cfg.variant.family.is_gemma() {
            for (name, g) in theirs.iter_mut() {
                if name.ends_with("norm.weight") {
                    *g = (&*g - 1.0)?;
                }
            }
        }
        for (name, var) in &vars {
            let want = &theirs[name.as_str()];
            let got = grads
                .get(var.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("{case}: no gradient reached {name}"))?;
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
            let d = max_abs_diff(got, want)?;
            assert!(
                d <= 1e-4 * scale + 1e-7,
                "{case}: {name}'s gradient differs by {d} (largest {scale})"
            );
        }
    }
    Ok(())
}

/// PEFT's LoRA adapters on the families (`q_proj` ... `down_proj`, PEFT's names; every linear
/// layer, or q and v alone, its default for Llama): the adapted model's logits equal
/// `PeftModel`'s within 1e-4, whole windows, through the cache batched beside a sequence without
/// the adapter (which keeps the base's logits), and merged (`merge_and_unload`).
#[test]
fn every_family_takes_peft_adapters() -> anyhow::Result<()> {
    let out = tempfile::tempdir()?;
    let peft = |args: &[&std::ffi::OsStr]| -> anyhow::Result<Vec<u8>> {
        let run = std::process::Command::new(gpt_test_support::python())
            .arg(gpt_test_support::repo("tests/fixtures/peft_lora.py"))
            .args(args)
            .output()?;
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        Ok(run.stdout)
    };
    let all = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj";
    for (case, targets) in [
        ("llama-gqa", all),
        ("gemma3-local", "q_proj,v_proj"),
        ("qwen2-bias", all),
        // An ungated MLP: up and down only.
        ("arcee-relu2", "q_proj,k_proj,v_proj,o_proj,up_proj,down_proj"),
    ] {
        let adapter = out.path().join(case);
        let ids = expected(case)?.sequences[0].clone();
        let json = serde_json::to_string(&ids)?;
        let made: serde_json::Value = serde_json::from_slice(&peft(&[
            "make-logits".as_ref(),
            dir(case).as_os_str(),
            adapter.as_os_str(),
            "3".as_ref(),
            targets.as_ref(),
            json.as_ref(),
        ])?)?;
        let rows = |key: &str| -> anyhow::Result<Tensor> {
            let rows: Vec<Vec<f32>> = serde_json::from_value(made[key].clone())?;
            Ok(Tensor::new(rows, &Device::Cpu)?)
        };
        let (want, merged_want) = (rows("logits")?, rows("merged")?);
        let (mut model, _) = gpt::load_dir(&dir(case), DType::F32, &Device::Cpu)?;
        let lora = gpt::Adapter::load(&adapter, model.config(), DType::F32, &Device::Cpu)?;
        // A step with the adapter on one sequence and none on another.
        let (mut with, mut without) = (model.new_cache(), model.new_cache());
        let both = model.forward_step_adapted(
            &mut [
                SeqStep {
                    tokens: &ids,
                    cache: &mut with,
                },
                SeqStep {
                    tokens: &ids,
                    cache: &mut without,
                },
            ],
            &[LogitsFor::All, LogitsFor::All],
            &[Some(&lora), None],
        )?;
        let both = model.logits(&both)?;
        let n = ids.len();
        let d = max_abs_diff(&both.narrow(0, 0, n)?, &want)?;
        assert!(d < 1e-4, "{case}: adapted in a step, {d} from PEFT's");
        let d = max_abs_diff(&both.narrow(0, n, n)?, &expected(case)?.logits[0])?;
        assert!(
            d < 1e-4,
            "{case}: the sequence without the adapter, {d} from the base's"
        );
        model.set_adapter(Some(&lora))?;
        let whole = model
            .forward(&Tensor::new(vec![ids.clone()], &Device::Cpu)?, None)?
            .squeeze(0)?;
        let d = max_abs_diff(&whole, &want)?;
        assert!(d < 1e-4, "{case}: adapted whole window, {d} from PEFT's");
        model.set_adapter(None)?;
        let mut tensors = model.named_tensors()?;
        lora.merge_into(&mut tensors)?;
        let merged = gpt::Gpt::new(
            candle_nn::VarBuilder::from_tensors(tensors.into_iter().collect(), DType::F32, &Device::Cpu),
            model.config(),
        )?;
        let merged = merged
            .forward(&Tensor::new(vec![ids.clone()], &Device::Cpu)?, None)?
            .squeeze(0)?;
        let d = max_abs_diff(&merged, &merged_want)?;
        assert!(d < 1e-4, "{case}: merged, {d} from PEFT's merge_and_unload");
    }
    Ok(())
}

/// The families' configs: an unknown `model_type` names itself and the supported ones; a field
/// a family needs, when missing, is named.
#[test]
fn configs_of_unknown_families_and_missing_fields_are_errors_that_name_them() -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let path = tmp.path().join("config.json");
    std::fs::write(&path, r#"{"model_type": "mamba", "vocab_size": 10}"#)?;
    let err = gpt::Config::from_file(&path).unwrap_err().to_string();
    assert!(
        err.contains("mamba") && err.contains("qwen3") && err.contains("llama"),
        "{err}"
    );
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir("qwen3-qknorm").join("config.json"))?)?;
    cfg.as_object_mut().map(|m| m.remove("num_hidden_layers"));
    std::fs::write(&path, cfg.to_string())?;
    let err = gpt::Config::from_file(&path).unwrap_err().to_string();
    assert!(err.contains("num_hidden_layers"), "{err}");
    cfg["num_hidden_layers"] = 2.into();
    cfg["num_key_value_heads"] = 3.into();
    std::fs::write(&path, cfg.to_string())?;
    let err = gpt::Config::from_file(&path).unwrap_err().to_string();
    assert!(err.contains("key/value heads (3)"), "{err}");
    cfg["num_key_value_heads"] = 2.into();
    cfg["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4});
    std::fs::write(&path, cfg.to_string())?;
    let err = gpt::Config::from_file(&path).unwrap_err().to_string();
    assert!(err.contains("yarn"), "{err}");
    Ok(())
}

/// The same checkpoints as llama.cpp's converter (`convert_hf_to_gguf.py`) writes them: GGUF
/// metadata (`llama.block_count`, ...), llama.cpp's tensor names, the Llama family's q and k rows
/// permuted as its `LlamaModel.permute` does (Qwen's left as they are), the tokenizer as
/// `tokenizer.ggml.*`. Loaded by [`gpt::llamacpp`], each must give `transformers`' logits.
#[test]
fn every_family_from_a_llama_cpp_gguf_file_gives_transformers_logits() -> anyhow::Result<()> {
    // llama.cpp derives Gemma's query scalar from the head width; gemma3-scalar's is another.
    for case in CASES
        .into_iter()
        .filter(|c| !matches!(*c, "llama3-scaled" | "gemma3-scalar"))
    {
        let file = tempfile::Builder::new().suffix(".gguf").tempfile()?;
        gpt_test_support::write_llama_cpp_gguf(&dir(case), file.path(), candle_core::quantized::GgmlDType::F32)?;
        let (model, tok) =
            gpt::load_dir_as(file.path(), None, &Device::Cpu).map_err(|e| anyhow::anyhow!("{case}: {e}"))?;
        check_logits(&model, case, 1e-4)?;
        let (_, hf_tok) = gpt::load_dir(&dir(case), DType::F32, &Device::Cpu)?;
        let text = "First Citizen:\nBefore we proceed any further, hear me speak. 0123";
        assert_eq!(
            tok.encode(text)?,
            hf_tok.encode(text)?,
            "{case}: the tokenizer from the GGUF file"
        );
    }
    Ok(())
}
