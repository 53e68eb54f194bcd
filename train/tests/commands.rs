//! `gpt-train`'s other commands as a user runs them: the tokenizer, export, average, sample,
//! `--help`, `--init-from`, label smoothing and biases, and run directories named for their
//! checkpoint.

mod common;

use std::path::Path;
use std::process::Output;

use common::{eval_losses, eval_mean_nll, fails, gpt_train, prefix_of_tokens, stderr, train, train_args, write, BIN};
use gpt_test_support as support;
use safetensors::SafeTensors;
use support::shakespeare;

#[test]
fn tokenizer_subcommand_trains_and_saves() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(50_000)?)?;
    let out = dir.path().join("tok");
    let args = [
        "tokenizer",
        "--data",
        corpus.to_str().unwrap_or_default(),
        "--out",
        out.to_str().unwrap_or_default(),
        "--kind",
        "bpe",
        "--vocab-size",
        "300",
    ];
    let run = gpt_train(&args)?;
    assert!(run.status.success(), "{}", stderr(&run));
    let tok = gpt::Tokenizer::from_file(&out.join("tokenizer.json"))?;
    assert_eq!(tok.vocab_size(), 300);
    let text = "ROMEO: what light through yonder window breaks?";
    assert_eq!(tok.decode(&tok.encode(text)?)?, text);
    Ok(())
}

#[test]
fn bias_false_trains_without_biases_and_resume_checks_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    let out = dir.path().join("run");
    let run = train(&corpus, &out, &["--max-iters", "5", "--bias", "false"])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let bytes = std::fs::read(out.join("latest/model.safetensors"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    let (mut biases, mut weights_moved) = (0, false);
    for name in st.names() {
        let t = st.tensor(name)?;
        let values: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if name.ends_with(".bias") {
            biases += 1;
            assert!(values.iter().all(|&v| v == 0.0), "{name} is not zero");
        } else if name.ends_with("ln_1.weight") {
            weights_moved |= values.iter().any(|&v| v != 1.0);
        }
    }
    assert_eq!(biases, 2 * 6 + 1, "every bias is saved (GPT-2 layout)");
    assert!(weights_moved, "the other parameters trained");
    let resume = gpt_train(&[
        "train",
        "--out",
        out.to_str().unwrap_or_default(),
        "--resume",
        "--bias",
        "true",
    ])?;
    assert!(!resume.status.success());
    assert!(stderr(&resume).contains("--bias true"), "{}", stderr(&resume));
    Ok(())
}

#[test]
fn export_writes_a_half_precision_copy() -> anyhow::Result<()> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2");
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("f16");
    let args = [
        "export",
        "--checkpoint",
        fixture.to_str().unwrap_or_default(),
        "--out",
        out.to_str().unwrap_or_default(),
        "--dtype",
        "f16",
    ];
    let run = gpt_train(&args)?;
    assert!(run.status.success(), "{}", stderr(&run));
    let (full, half) = (
        std::fs::metadata(fixture.join("model.safetensors"))?.len(),
        std::fs::metadata(out.join("model.safetensors"))?.len(),
    );
    assert!(half < full * 6 / 10, "{half} vs {full} bytes");
    let bytes = std::fs::read(out.join("model.safetensors"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    assert!(st.tensors().iter().all(|(_, t)| t.dtype() == safetensors::Dtype::F16));
    let (model, _) = gpt::load_dir(&out, candle_core::DType::F32, &candle_core::Device::Cpu)?;
    assert_eq!(model.num_parameters(), 37_760);
    Ok(())
}

/// `--help`'s options: flag → its description (empty when it has none).
fn help_options(command: &str) -> anyhow::Result<Vec<(String, String)>> {
    let out = gpt_train(&[command, "--help"])?;
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout)?;
    let mut options: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.starts_with("--") && indent <= 6 {
            // "--flag <VALUE>  description", the description on this line or the next ones.
            let flag = trimmed.split_whitespace().next().unwrap_or_default().to_string();
            let rest = trimmed.split_once("  ").map_or("", |(_, d)| d.trim());
            options.push((flag, format!("{rest} ")));
        } else if indent > 6 {
            if let Some((_, desc)) = options.last_mut() {
                desc.push_str(trimmed);
                desc.push(' ');
            }
        }
    }
    Ok(options)
}

#[test]
fn help_shows_every_flags_meaning_and_the_defaults_a_run_gets() -> anyhow::Result<()> {
    for command in ["train", "eval", "tokenizer", "export"] {
        let options = help_options(command)?;
        assert!(options.len() >= 3, "{command}: {options:?}");
        for (flag, desc) in &options {
            let meaning = desc.split("[default").next().unwrap_or_default().trim();
            assert!(
                meaning.len() > 10,
                "gpt-train {command} {flag} has no description: {desc:?}"
            );
        }
    }
    // Every default that `train --help` states is the one a new run resolves to.
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: gpt_train::config::TrainArgs,
    }
    let cli = <Cli as clap::Parser>::try_parse_from(["gpt-train", "--out", "o", "--data", "d"])?;
    let run = cli.args.resolve(65, None, None)?;
    let json = serde_json::to_value(&run)?;
    let model = &json["model"];
    let resolved = |flag: &str| -> Option<String> {
        let field = flag.trim_start_matches("--").replace('-', "_");
        let value = match field.as_str() {
            "n_layer" | "n_head" | "n_embd" => model[&field].clone(),
            "block_size" => model["n_positions"].clone(),
            "dropout" => model["resid_pdrop"].clone(),
            _ => json.get(&field)?.clone(),
        };
        Some(value.to_string().trim_matches('"').to_lowercase())
    };
    let mut checked = 0;
    for (flag, desc) in help_options("train")? {
        let Some(stated) = desc.split("[default: ").nth(1).and_then(|d| d.split(']').next()) else {
            continue;
        };
        // "the preset's; shakespeare-char 6" states the preset's value; "--max-iters" another's.
        let stated = stated.rsplit(' ').next().unwrap_or_default().to_lowercase();
        let stated = match stated.strip_prefix("--") {
            Some(_) => resolved(&stated).unwrap_or_default(),
            None => stated,
        };
        if let Some(have) = resolved(&flag) {
            let same = have == stated
                || match (have.parse::<f64>(), stated.parse::<f64>()) {
                    (Ok(a), Ok(b)) => (a - b).abs() <= 1e-6 * b.abs(), // f32 fields print long
                    _ => false,
                };
            assert!(same, "{flag}: help says {stated}, a run gets {have}");
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} defaults compared");
    Ok(())
}

#[test]
fn label_smoothing_changes_the_training_loss_not_the_evaluation() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    let events = |eps: &str| -> anyhow::Result<Vec<serde_json::Value>> {
        let out = dir.path().join(format!("run-{eps}"));
        let run = train(&corpus, &out, &["--max-iters", "1", "--label-smoothing", eps])?;
        assert!(run.status.success(), "{}", stderr(&run));
        Ok(std::fs::read_to_string(out.join("metrics.jsonl"))?
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?)
    };
    let (plain, smooth) = (events("0")?, events("0.1")?);
    let first = |events: &[serde_json::Value], kind: &str, field: &str| {
        events
            .iter()
            .find(|e| e["event"] == kind)
            .map(|e| e[field].as_f64().unwrap_or(f64::NAN))
    };
    // Step 0's evaluation: the same weights, and plain NLL either way.
    assert_eq!(first(&plain, "eval", "val_loss"), first(&smooth, "eval", "val_loss"));
    // The training loss of the first step is the smoothed one.
    let (a, b) = (
        first(&plain, "train", "train_loss"),
        first(&smooth, "train", "train_loss"),
    );
    assert!(a.is_some() && a != b, "{a:?} vs {b:?}");
    let err = fails(&[
        "train",
        "--data",
        corpus.to_str().unwrap_or_default(),
        "--out",
        "x",
        "--label-smoothing",
        "1.5",
    ])?;
    assert!(err.contains("--label-smoothing"), "{err}");
    Ok(())
}

#[test]
fn average_takes_the_mean_of_known_weights_and_names_a_mismatch() -> anyhow::Result<()> {
    use candle_core::{DType, Device, Tensor};
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2");
    let dir = tempfile::tempdir()?;
    let (model, tok) = gpt::load_dir(&fixture, DType::F32, &Device::Cpu)?;
    // Three copies of the fixture with every parameter scaled by 1, 2 and 6: the mean is 3x.
    let mut dirs = Vec::new();
    for k in [1.0, 2.0, 6.0] {
        let scaled: std::collections::HashMap<String, Tensor> = model
            .named_tensors()?
            .into_iter()
            .map(|(name, t)| Ok((name.trim_start_matches("transformer.").to_string(), (t * k)?)))
            .collect::<anyhow::Result<_>>()?;
        let m = gpt::Gpt::new(
            candle_nn::VarBuilder::from_tensors(scaled, DType::F32, &Device::Cpu),
            model.config(),
        )?;
        let d = dir.path().join(format!("x{k}"));
        gpt::save_dir(&d, &m, &tok, DType::F32)?;
        dirs.push(d.to_str().unwrap_or_default().to_string());
    }
    let out = dir.path().join("mean");
    let mut args = vec!["average", "--out", out.to_str().unwrap_or_default(), "--checkpoints"];
    args.extend(dirs.iter().map(String::as_str));
    let run = gpt_train(&args)?;
    assert!(run.status.success(), "{}", stderr(&run));
    let (mean, _) = gpt::load_dir(&out, DType::F32, &Device::Cpu)?;
    for ((name, a), (_, b)) in mean.named_tensors()?.iter().zip(model.named_tensors()?) {
        let diff = (a - (b * 3.0)?)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{name}: {diff}");
    }
    // A checkpoint of another shape is refused, naming the field.
    let other = dir.path().join("other");
    let cfg = gpt::Config {
        n_layer: 1,
        ..model.config().clone()
    };
    let varmap = candle_nn::VarMap::new();
    let small = gpt::Gpt::new(
        candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu),
        &cfg,
    )?;
    gpt::save_dir(&other, &small, &tok, DType::F32)?;
    let err = fails(&[
        "average",
        "--out",
        "x",
        "--checkpoints",
        &dirs[0],
        other.to_str().unwrap_or_default(),
    ])?;
    assert!(err.contains("n_layer 1") && err.contains("other"), "{err}");
    Ok(())
}

#[test]
fn average_last_k_takes_a_runs_newest_checkpoints() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    let out = dir.path().join("run");
    let run = train(&corpus, &out, &["--max-iters", "30", "--keep-last", "3"])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let kept: Vec<String> = std::fs::read_dir(out.join("checkpoints"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(kept.len(), 3, "{kept:?}");
    let mean = dir.path().join("mean");
    let (o, m) = (out.to_str().unwrap_or_default(), mean.to_str().unwrap_or_default());
    let run = gpt_train(&["average", "--run", o, "--last", "3", "--out", m])?;
    assert!(run.status.success(), "{}", stderr(&run));
    assert!(String::from_utf8_lossy(&run.stdout).contains("mean of 3 checkpoints"));
    let err = fails(&["average", "--run", o, "--last", "5", "--out", m])?;
    assert!(err.contains("holds 3 complete checkpoints"), "{err}");
    Ok(())
}

#[test]
fn init_from_starts_where_the_checkpoint_is_and_learns_from_there() -> anyhow::Result<()> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2");
    let dir = tempfile::tempdir()?;
    let text = shakespeare(20_000)?;
    let corpus = write(dir.path(), "corpus.txt", &text)?;
    // A validation text of exactly context + 1 tokens: the trainer's evaluation windows and
    // `gpt-train eval`'s single window are then the same window.
    let tok = gpt::Tokenizer::from_file(&fixture.join("tokenizer.json"))?;
    let val_text = prefix_of_tokens(&text, &tok, 65)?;
    let val = write(dir.path(), "val.txt", val_text)?;
    let out = dir.path().join("run");
    let (c, v, o, f) = (
        corpus.to_str().unwrap_or_default(),
        val.to_str().unwrap_or_default(),
        out.to_str().unwrap_or_default(),
        fixture.to_str().unwrap_or_default(),
    );
    let run = gpt_train(&[
        "train",
        "--data",
        c,
        "--val-data",
        v,
        "--out",
        o,
        "--init-from",
        f,
        "--max-iters",
        "40",
        "--eval-interval",
        "40",
        "--eval-iters",
        "2",
        "--batch-size",
        "8",
        "--learning-rate",
        "3e-3",
        "--warmup-iters",
        "5",
        "--device",
        "cpu",
    ])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let evals = eval_losses(&out)?;
    let mean_nll = eval_mean_nll(f, v, "64")?;
    assert_eq!(evals[0].0, 0);
    assert!(
        (evals[0].1 - mean_nll).abs() < 1e-5,
        "step 0 val loss {} vs gpt-train eval {mean_nll}",
        evals[0].1
    );
    assert!(evals[1].1 < evals[0].1 - 0.1, "the loss falls from there: {evals:?}");
    // The checkpoint's shape rules: a model flag that disagrees is named.
    let err = fails(&[
        "train",
        "--data",
        c,
        "--out",
        &format!("{o}2"),
        "--init-from",
        f,
        "--n-layer",
        "3",
    ])?;
    assert!(err.contains("--n-layer 3") && err.contains("--init-from"), "{err}");
    // A shorter --block-size fine-tunes on shorter windows (nanoGPT's `crop_block_size`): the
    // checkpoint's first 32 positions; a longer one than the checkpoint's 64 is refused.
    let cropped = format!("{o}-cropped");
    let run = gpt_train(&[
        "train",
        "--data",
        c,
        "--out",
        &cropped,
        "--init-from",
        f,
        "--block-size",
        "32",
        "--max-iters",
        "2",
        "--eval-interval",
        "2",
        "--eval-iters",
        "1",
        "--batch-size",
        "2",
        "--device",
        "cpu",
    ])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let (base, _) = gpt::load_dir(&fixture, candle_core::DType::F32, &candle_core::Device::Cpu)?;
    let (tuned, _) = gpt::load_dir(
        &Path::new(&cropped).join("latest"),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    assert_eq!(tuned.config().n_positions, 32);
    let table = |m: &gpt::Gpt| -> anyhow::Result<candle_core::Tensor> {
        m.named_tensors()?
            .into_iter()
            .find(|(n, _)| n == "transformer.wpe.weight")
            .map(|(_, t)| t)
            .ok_or_else(|| anyhow::anyhow!("no position table"))
    };
    assert_eq!(table(&tuned)?.dims(), [32, base.config().n_embd]);
    let err = fails(&[
        "train",
        "--data",
        c,
        "--out",
        &format!("{o}3"),
        "--init-from",
        f,
        "--block-size",
        "128",
    ])?;
    assert!(err.contains("--block-size 128") && err.contains("(64)"), "{err}");
    Ok(())
}

#[test]
fn sample_prints_the_best_beam_and_greedy_text() -> anyhow::Result<()> {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let checkpoint = fixtures.join("tiny-gpt2");
    let tok = gpt::Tokenizer::from_file(&checkpoint.join("tokenizer.json"))?;
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixtures.join("beam_search.json"))?)?;
    // transformers' first case: 2 beams, length penalty 1, 12 new tokens, the real end-of-text.
    let case = &json["cases"][0];
    let prompt_ids: Vec<u32> = serde_json::from_value(case["prompt"].clone())?;
    let prompt = tok.decode(&prompt_ids)?;
    assert_eq!(tok.encode(&prompt)?, prompt_ids);
    let best: Vec<u32> = serde_json::from_value(case["beams"][0]["tokens"].clone())?;
    let c = checkpoint.to_str().unwrap_or_default();
    let out = gpt_train(&[
        "sample",
        "--checkpoint",
        c,
        "--prompt",
        &prompt,
        "--num-beams",
        "2",
        "--max-new-tokens",
        "12",
        "--device",
        "cpu",
    ])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let expected = format!("{prompt}{}\n", tok.decode_skip_special(&best)?);
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    // Greedy: the model crate's generation.
    let out = gpt_train(&[
        "sample",
        "--checkpoint",
        c,
        "--prompt",
        &prompt,
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
    ])?;
    assert!(out.status.success(), "{}", stderr(&out));
    let (model, _) = gpt::load_dir(&checkpoint, candle_core::DType::F32, &candle_core::Device::Cpu)?;
    let mut greedy = gpt::Sampler::new(gpt::SamplingParams::default());
    let ids = gpt::generate(&model, &prompt_ids, 8, &mut greedy, tok.eos_token_id())?;
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("{prompt}{}\n", tok.decode_skip_special(&ids)?)
    );
    // Speculative decoding, with n-grams and with a draft (the model itself here): the same
    // greedy text, and the acceptance reported.
    let greedy = |extra: &[&str]| {
        let base = ["sample", "--checkpoint", c, "--prompt", &prompt, "--temperature", "0"];
        let tail = ["--max-new-tokens", "30", "--device", "cpu"];
        gpt_train(&[&base[..], extra, &tail].concat())
    };
    let plain = greedy(&[])?;
    assert!(plain.status.success(), "{}", stderr(&plain));
    for extra in [
        &["--speculative", "ngram"][..],
        &["--draft-checkpoint", c, "--num-speculative-tokens", "3"],
    ] {
        let out = greedy(extra)?;
        assert!(out.status.success(), "{extra:?}: {}", stderr(&out));
        assert_eq!(out.stdout, plain.stdout, "{extra:?}");
        assert!(stderr(&out).contains("proposed tokens accepted"), "{}", stderr(&out));
    }
    let out = greedy(&["--speculative", "draft"])?;
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--draft-checkpoint"), "{}", stderr(&out));
    Ok(())
}

/// Every subcommand that names a checkpoint takes a run directory for its `best/` (as gpt-server
/// does), and a directory that is neither is an error that names it.
#[test]
fn every_command_takes_a_run_directory_for_its_best_checkpoint() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    let out = dir.path().join("run");
    let run = train(&corpus, &out, &["--max-iters", "10"])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let (run_dir, best) = (out.to_str().unwrap_or_default(), out.join("best"));
    let best = best.to_str().unwrap_or_default();
    let c = corpus.to_str().unwrap_or_default();
    let same_output = |args: &[&str]| -> anyhow::Result<()> {
        let with = |checkpoint: &str| -> anyhow::Result<Output> {
            let args: Vec<&str> = args.iter().map(|&a| if a == "CKPT" { checkpoint } else { a }).collect();
            gpt_train(&args)
        };
        let (a, b) = (with(run_dir)?, with(best)?);
        assert!(a.status.success(), "{args:?}: {}", stderr(&a));
        assert_eq!(a.stdout, b.stdout, "{args:?}");
        Ok(())
    };
    same_output(&["eval", "--checkpoint", "CKPT", "--data", c, "--device", "cpu", "--json"])?;
    let sample = [
        "sample",
        "--checkpoint",
        "CKPT",
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "8",
    ];
    same_output(&[&sample[..], &["--device", "cpu"]].concat())?;
    let exported = dir.path().join("exported");
    let export = gpt_train(&[
        "export",
        "--checkpoint",
        run_dir,
        "--out",
        exported.to_str().unwrap_or_default(),
    ])?;
    assert!(export.status.success(), "{}", stderr(&export));
    assert!(exported.join("model.safetensors").is_file());
    // Neither a checkpoint nor a run: named, and said what it is not.
    let err = fails(&[
        "eval",
        "--checkpoint",
        dir.path().to_str().unwrap_or_default(),
        "--data",
        c,
    ])?;
    assert!(
        err.contains(dir.path().to_str().unwrap_or_default()) && err.contains("not a checkpoint"),
        "{err}"
    );
    Ok(())
}

/// `GPT_BF16_DOT` picks the kernel of the bf16 products: a kind this CPU lacks, or no kind at
/// all, stops the run at start with an error that names the variable and the kinds there are;
/// the slowest kind, which every CPU runs, trains.
#[test]
fn bf16_kernel_named_in_the_environment_is_checked() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    let run_with = |kind: &str, out: &str| -> anyhow::Result<std::process::Output> {
        let args = train_args(&corpus, &dir.path().join(out), &["--max-iters", "1", "--dtype", "bf16"]);
        Ok(std::process::Command::new(BIN)
            .args(&args)
            .env("RUST_LOG", "warn")
            .env("GPT_BF16_DOT", kind)
            .output()?)
    };
    let bad = run_with("Avx1024", "bad")?;
    assert!(!bad.status.success(), "{}", stderr(&bad));
    assert!(
        stderr(&bad).contains("GPT_BF16_DOT=Avx1024") && stderr(&bad).contains("Emulated"),
        "{}",
        stderr(&bad)
    );
    let slow = run_with("Emulated", "slow")?;
    assert!(slow.status.success(), "{}", stderr(&slow));
    Ok(())
}

/// `--dtype bf16` on a CPU with neither AVX512-BF16 nor AVX2 and FMA says at start that its
/// products run emulated in plain Rust (far slower than f32's), and says nothing of it where
/// either kernel runs; it trains either way.
#[test]
fn bf16_says_when_its_products_run_emulated() -> anyhow::Result<()> {
    use gpt_kernels::train::bf16::Bf16Dot;
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    let run = train(
        &corpus,
        &dir.path().join("run"),
        &["--max-iters", "2", "--dtype", "bf16"],
    )?;
    assert!(run.status.success(), "{}", stderr(&run));
    let warned = stderr(&run).contains("the bf16 products run emulated");
    assert_eq!(warned, Bf16Dot::detect() == Bf16Dot::Emulated, "{}", stderr(&run));
    Ok(())
}
