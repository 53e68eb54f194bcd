//! Fine-tuning the decoder families with `gpt-train train --init-from` (the checkpoints
//! `transformers` saved in `tests/fixtures/families`): the first evaluation is `gpt-train eval`'s
//! loss of the checkpoint itself, the loss falls, a resumed run equals an uninterrupted one bit
//! for bit, and what is saved is a checkpoint of the same family. (The gradients themselves are
//! checked against `transformers`' in tests/families.rs.)

mod common;

use common::{eval_losses, eval_mean_nll, gpt_train, prefix_of_tokens, state, stderr, train_from, train_losses, write};
use gpt_test_support::{family_dir, shakespeare};
use safetensors::SafeTensors;

/// The first evaluation of a run.
fn first_eval(out: &std::path::Path) -> anyhow::Result<f64> {
    eval_losses(out)?
        .first()
        .map(|e| e.1)
        .ok_or_else(|| anyhow::anyhow!("no evaluation in {}", out.display()))
}

#[test]
fn families_fine_tune_from_their_checkpoints_and_resume_exactly() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let text = shakespeare(40_000)?;
    let corpus = write(dir.path(), "corpus.txt", &text)?;
    let tok = gpt::Tokenizer::from_file(&family_dir("llama-gqa").join("tokenizer.json"))?;
    // Its evaluation window is `gpt-train eval`'s single window.
    let val_text = prefix_of_tokens(&text, &tok, 33)?;
    let val = write(dir.path(), "val.txt", val_text)?;
    let v = val.to_str().unwrap_or_default();
    let run_with = |out: &std::path::Path, flags: &[&str]| train_from(&corpus, out, flags);
    for case in ["llama-gqa", "gemma3-local", "gemma2-softcap"] {
        let base = family_dir(case);
        let b = base.to_str().unwrap_or_default();
        let (whole, halves) = (
            dir.path().join(format!("{case}-a")),
            dir.path().join(format!("{case}-b")),
        );
        let flags = |iters: &'static str| -> Vec<&str> {
            vec![
                "--init-from",
                b,
                "--val-data",
                v,
                "--block-size",
                "32",
                "--max-iters",
                iters,
                "--lr-decay-iters",
                "12",
                "--eval-interval",
                "6",
                "--learning-rate",
                "3e-3",
            ]
        };
        let run = run_with(&whole, &flags("12"))?;
        assert!(run.status.success(), "{case}: {}", stderr(&run));
        let (first, mean_nll) = (first_eval(&whole)?, eval_mean_nll(b, v, "32")?);
        assert!(
            (first - mean_nll).abs() < 1e-5,
            "{case}: step 0 val loss {first} vs gpt-train eval of the checkpoint {mean_nll}"
        );
        let losses = train_losses(&whole)?;
        let (start, end) = (losses[0].1, losses[losses.len() - 1].1);
        assert!(end < start - 0.1, "{case}: the loss falls: {losses:?}");

        let run = run_with(&halves, &flags("6"))?;
        assert!(run.status.success(), "{case}: {}", stderr(&run));
        let h = halves.to_str().unwrap_or_default();
        let run = gpt_train(&["train", "--out", h, "--resume", "--max-iters", "12"])?;
        assert!(run.status.success(), "{case}: {}", stderr(&run));
        assert_eq!(state(&halves)?["step"], 12);
        for file in ["model.safetensors", "optimizer.safetensors"] {
            let (fa, fb) = (
                std::fs::read(whole.join("latest").join(file))?,
                std::fs::read(halves.join("latest").join(file))?,
            );
            let (ta, tb) = (SafeTensors::deserialize(&fa)?, SafeTensors::deserialize(&fb)?);
            let mut names = ta.names();
            names.sort();
            for name in names {
                assert!(
                    ta.tensor(name)?.data() == tb.tensor(name)?.data(),
                    "{case}, {file}: {name} differs"
                );
            }
        }
        assert_eq!(train_losses(&whole)?, train_losses(&halves)?, "{case}");
        // Saved as the family it came from, under its checkpoint names.
        let (tuned, _) = gpt::load_dir(
            &whole.join("latest"),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )?;
        let cfg = gpt::Config::from_file(&base.join("config.json"))?;
        assert_eq!(tuned.config().variant, cfg.variant, "{case}");
        let saved = std::fs::read(whole.join("latest/model.safetensors"))?;
        let saved = SafeTensors::deserialize(&saved)?;
        let original = std::fs::read(base.join("model.safetensors"))?;
        let original = SafeTensors::deserialize(&original)?;
        let (mut a, mut b) = (saved.names(), original.names());
        a.sort();
        b.sort();
        assert_eq!(a, b, "{case}: the checkpoint's tensor names");
    }
    // From llama.cpp's GGUF file of the same checkpoint: its weights (dequantized) and tokenizer.
    let gguf = dir.path().join("llama-gqa.gguf");
    gpt_test_support::write_llama_cpp_gguf(&family_dir("llama-gqa"), &gguf, candle_core::quantized::GgmlDType::F32)?;
    let g = gguf.to_str().unwrap_or_default();
    let out = dir.path().join("from-gguf");
    let run = run_with(
        &out,
        &[
            "--init-from",
            g,
            "--val-data",
            v,
            "--block-size",
            "32",
            "--max-iters",
            "2",
            "--eval-interval",
            "2",
        ],
    )?;
    assert!(run.status.success(), "{}", stderr(&run));
    let mean_nll = eval_mean_nll(g, v, "32")?;
    assert!(
        (first_eval(&out)? - mean_nll).abs() < 1e-5,
        "from the GGUF file: {} vs {mean_nll}",
        first_eval(&out)?
    );

    // QLoRA: an adapter on the Q8_0 file's base left quantized (`--lora-base stored`) against
    // the same adapter on the base dequantized: the same start within the int8 products'
    // rounding, and it learns as that one does.
    let q8 = dir.path().join("llama-gqa-q8_0.gguf");
    gpt_test_support::write_llama_cpp_gguf(&family_dir("llama-gqa"), &q8, candle_core::quantized::GgmlDType::Q8_0)?;
    let q = q8.to_str().unwrap_or_default();
    let lora_from = |file: &str, out: &std::path::Path, extra: &[&str]| {
        let flags = [
            "--init-from",
            file,
            "--val-data",
            v,
            "--block-size",
            "32",
            "--max-iters",
            "20",
            "--eval-interval",
            "20",
            "--log-interval",
            "1",
            "--learning-rate",
            "3e-3",
            "--lora-r",
            "4",
            "--lora-targets",
            "all-linear",
        ];
        run_with(out, &[&flags[..], extra].concat())
    };
    let lora = |out: &std::path::Path, extra: &[&str]| lora_from(q, out, extra);
    let (dense, quantized) = (dir.path().join("qlora-f32"), dir.path().join("qlora-stored"));
    let run = lora(&dense, &[])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let run = lora(&quantized, &["--lora-base", "stored"])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let (a, b) = (eval_losses(&dense)?, eval_losses(&quantized)?);
    // The base packed in f32 (the inference kernels, no int8 products): the dense run's
    // losses to f32's rounding, its gradient through the frozen products the same.
    let packed = dir.path().join("qlora-packed-f32");
    let run = lora(&packed, &["--lora-base", "f32"])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let c = eval_losses(&packed)?;
    assert!(
        a.iter().zip(&c).all(|(a, c)| (a.1 - c.1).abs() < 1e-5),
        "packed f32 against dense: {a:?} vs {c:?}"
    );
    assert!((a[0].1 - b[0].1).abs() < 2e-2, "the start: {a:?} vs {b:?}");
    assert!(b[1].1 < b[0].1 - 0.05, "the quantized base's adapter learns: {b:?}");
    assert!(
        (a[1].1 - b[1].1).abs() < 0.1 * (a[0].1 - a[1].1),
        "as the dense base's does: {a:?} vs {b:?}"
    );
    assert!(quantized.join("best/adapter_model.safetensors").is_file());
    // Q4_1 (held as Q4_0's codes and an offset per block): the same against its own file
    // dequantized.
    let q41 = dir.path().join("llama-gqa-q4_1.gguf");
    gpt_test_support::write_llama_cpp_gguf(&family_dir("llama-gqa"), &q41, candle_core::quantized::GgmlDType::Q4_1)?;
    let q41 = q41.to_str().unwrap_or_default();
    let on = |out: &str, extra: &[&str]| -> anyhow::Result<Vec<(u64, f64)>> {
        let out = dir.path().join(out);
        let run = lora_from(q41, &out, extra)?;
        assert!(run.status.success(), "{}", stderr(&run));
        eval_losses(&out)
    };
    let (a, b) = (on("q41-f32", &[])?, on("q41-stored", &["--lora-base", "stored"])?);
    assert!((a[0].1 - b[0].1).abs() < 2e-2, "Q4_1, the start: {a:?} vs {b:?}");
    assert!(
        (a[1].1 - b[1].1).abs() < 0.1 * (a[0].1 - a[1].1),
        "Q4_1: {a:?} vs {b:?}"
    );
    // The base keeps its own dropout; a format that is not one is named.
    let run = lora(
        &dir.path().join("qlora-dropout"),
        &["--lora-base", "stored", "--dropout", "0.3"],
    )?;
    assert!(
        !run.status.success() && stderr(&run).contains("--dropout"),
        "{}",
        stderr(&run)
    );
    let run = lora(&dir.path().join("qlora-bad"), &["--lora-base", "q3_k"])?;
    assert!(
        !run.status.success() && stderr(&run).contains("q3_k"),
        "{}",
        stderr(&run)
    );
    Ok(())
}

/// `--arch`: a Llama, Qwen3, Gemma 3 or Arcee (squared ReLU) trained from scratch at a preset's shape (grouped-query
/// attention from --n-kv-head) learns, and its checkpoint is that family's: `transformers` loads
/// it as its own class and computes the logits this project computes (`check_family_load.py`).
#[test]
fn families_train_from_scratch_and_load_in_transformers() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(40_000)?)?;
    let mut pairs = Vec::new();
    // Qwen3 with the modern recipe's choices: its own head, output projections from zero, Muon.
    let modern = ["--untied-head", "--zero-init-proj", "--recipe", "modern"];
    for arch in ["llama", "qwen3", "gemma3", "arcee"] {
        let out = dir.path().join(arch);
        let flags = [
            "--arch",
            arch,
            "--n-kv-head",
            "2",
            "--n-embd",
            "64",
            "--max-iters",
            "30",
            "--eval-interval",
            "30",
        ];
        let extra: &[&str] = if arch == "qwen3" { &modern } else { &[] };
        let run = common::train(&corpus, &out, &[&flags[..], extra].concat())?;
        assert!(run.status.success(), "{arch}: {}", stderr(&run));
        let losses = train_losses(&out)?;
        assert!(
            losses[losses.len() - 1].1 < losses[0].1 - 0.5,
            "{arch}: the loss falls: {losses:?}"
        );
        let best = out.join("best");
        let (model, _) = gpt::load_dir(&best, candle_core::DType::F32, &candle_core::Device::Cpu)?;
        assert_eq!(
            model.config().variant.family.model_type().trim_end_matches("_text"),
            arch
        );
        assert_eq!(model.config().n_kv_head(), 2);
        assert_eq!(model.config().tie_word_embeddings, arch != "qwen3");
        // Our logits of a window, as the reference `check_family_load.py` reads them.
        let ids: Vec<u32> = (0..24).map(|i| (i * 7 % 50) as u32).collect();
        let logits = model
            .forward(
                &candle_core::Tensor::new(vec![ids.clone()], &candle_core::Device::Cpu)?,
                None,
            )?
            .squeeze(0)?;
        let expected = dir.path().join(format!("{arch}-expected"));
        std::fs::create_dir_all(&expected)?;
        candle_core::safetensors::save(
            &std::collections::HashMap::from([("logits_0".to_string(), logits)]),
            expected.join("expected.safetensors"),
        )?;
        std::fs::write(
            expected.join("expected.json"),
            serde_json::json!({"sequences": [ids]}).to_string(),
        )?;
        pairs.push((best, expected));
    }
    gpt_test_support::check_in_transformers(&pairs)?;
    Ok(())
}

/// Chat fine-tuning a family on its own chat template (`tokenizer_config.json`'s, as a Hub
/// checkpoint has it): conversations rendered by it, the loss on the replies, and the template
/// kept in what is saved.
#[test]
fn a_family_chat_fine_tunes_on_its_own_template() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let base = dir.path().join("base");
    std::fs::create_dir_all(&base)?;
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(family_dir("qwen3-qknorm").join(file), base.join(file))?;
    }
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}\
                    {% if add_generation_prompt %}<assistant>{% endif %}";
    std::fs::write(
        base.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )?;
    let lines: Vec<String> = (0..64)
        .map(|i| {
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("What is {i} and {i}?")},
                {"role": "assistant", "content": format!("{i} and {i} is {}.", 2 * i)},
            ]})
            .to_string()
        })
        .collect();
    let chat = write(dir.path(), "chat.jsonl", lines.join("\n"))?;
    let out = dir.path().join("run");
    let run = train_from(
        &chat,
        &out,
        &[
            "--init-from",
            base.to_str().unwrap_or_default(),
            "--data-format",
            "chat",
            "--block-size",
            "48",
            "--max-iters",
            "20",
            "--eval-interval",
            "20",
        ],
    )?;
    assert!(run.status.success(), "{}", stderr(&run));
    let losses = train_losses(&out)?;
    assert!(
        losses[losses.len() - 1].1 < losses[0].1 - 0.3,
        "the loss falls: {losses:?}"
    );
    let (_, tok) = gpt::load_dir(&out.join("best"), candle_core::DType::F32, &candle_core::Device::Cpu)?;
    assert_eq!(tok.chat_template(), Some(template));
    Ok(())
}

/// A LoRA adapter trained on a family (every linear layer of Gemma 3; PEFT's default q and v of
/// Llama): the loss falls, and `PeftModel` with the saved adapter computes the logits this
/// project computes with it.
#[test]
fn families_train_lora_adapters_that_peft_reads() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(40_000)?)?;
    for (case, targets) in [("gemma3-local", Some("all-linear")), ("llama-gqa", None)] {
        let out = dir.path().join(case);
        let base = family_dir(case);
        let mut flags = vec![
            "--init-from",
            base.to_str().unwrap_or_default(),
            "--lora-r",
            "4",
            "--block-size",
            "32",
            "--max-iters",
            "30",
            "--eval-interval",
            "30",
            "--learning-rate",
            "1e-2",
        ];
        if let Some(targets) = targets {
            flags.extend(["--lora-targets", targets]);
        }
        let run = train_from(&corpus, &out, &flags)?;
        assert!(run.status.success(), "{case}: {}", stderr(&run));
        let losses = train_losses(&out)?;
        assert!(
            losses[losses.len() - 1].1 < losses[0].1 - 0.1,
            "{case}: the loss falls: {losses:?}"
        );
        let adapter = out.join("best");
        let ids: Vec<u32> = (0..20).map(|i| (i * 13 % 300) as u32).collect();
        let peft = std::process::Command::new(gpt_test_support::python())
            .arg(gpt_test_support::repo("tests/fixtures/peft_lora.py"))
            .args([
                "logits".as_ref(),
                base.as_os_str(),
                adapter.as_os_str(),
                serde_json::to_string(&ids)?.as_ref(),
            ])
            .output()?;
        assert!(
            peft.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&peft.stderr)
        );
        let want: Vec<Vec<f32>> = serde_json::from_slice(&peft.stdout)?;
        let (mut model, _) = gpt::load_dir(&base, candle_core::DType::F32, &candle_core::Device::Cpu)?;
        let lora = gpt::Adapter::load(
            &adapter,
            model.config(),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )?;
        model.set_adapter(Some(&lora))?;
        let got = model
            .forward(
                &candle_core::Tensor::new(vec![ids.clone()], &candle_core::Device::Cpu)?,
                None,
            )?
            .squeeze(0)?;
        let d = gpt_test_support::max_abs_diff(&got, &candle_core::Tensor::new(want, &candle_core::Device::Cpu)?)?;
        assert!(d < 1e-4, "{case}: {d} from PeftModel's logits with the trained adapter");
    }
    Ok(())
}

/// `--zero-init-proj` starts the blocks' output projections at zero and nothing else; refused
/// where there is no new model to start (`--init-from`), and `--untied-head` for GPT-2.
#[test]
fn zero_init_proj_zeroes_the_output_projections_only() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    for arch in ["gpt2", "llama"] {
        let out = dir.path().join(arch);
        let flags = [
            "--arch",
            arch,
            "--max-iters",
            "1",
            "--learning-rate",
            "0",
            "--zero-init-proj",
        ];
        let run = common::train(&corpus, &out, &flags)?;
        assert!(run.status.success(), "{arch}: {}", stderr(&run));
        let weights = candle_core::safetensors::load(out.join("latest/model.safetensors"), &candle_core::Device::Cpu)?;
        let (mut zero, mut other) = (0, 0);
        for (name, t) in &weights {
            let largest = t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            let projection = ["c_proj.weight", "o_proj.weight", "down_proj.weight"]
                .iter()
                .any(|end| name.ends_with(end));
            match projection {
                true => {
                    assert_eq!(largest, 0.0, "{arch}: {name}");
                    zero += 1;
                }
                false if name.ends_with(".weight") && !name.contains("norm") && !name.contains("ln_") => {
                    assert!(largest > 0.0, "{arch}: {name} is zero too");
                    other += 1;
                }
                false => {}
            }
        }
        assert!(
            zero >= 2 && other >= 3,
            "{arch}: {zero} projections, {other} other matrices"
        );
    }
    let base = dir.path().join("gpt2");
    let refused = common::train(
        &corpus,
        &dir.path().join("from"),
        &["--init-from", base.to_str().unwrap_or_default(), "--zero-init-proj"],
    )?;
    assert!(
        !refused.status.success() && stderr(&refused).contains("--zero-init-proj"),
        "{}",
        stderr(&refused)
    );
    let refused = common::train(&corpus, &dir.path().join("untied"), &["--untied-head"])?;
    assert!(
        !refused.status.success() && stderr(&refused).contains("--untied-head"),
        "{}",
        stderr(&refused)
    );
    Ok(())
}
