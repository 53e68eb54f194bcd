//! `gpt-train` as a user runs it: exact resume, learning, perplexity against the Python
//! reference, signals, and a clear error for each bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use safetensors::SafeTensors;

const BIN: &str = env!("CARGO_BIN_EXE_gpt-train");

#[path = "../../tests/support.rs"]
mod support;
use support::shakespeare;

fn write(dir: &Path, name: &str, content: impl AsRef<[u8]>) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, content)?;
    Ok(path)
}

fn gpt_train(args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(BIN).args(args).env("RUST_LOG", "warn").output()?)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Small, fast settings.
const TINY: &[&str] = &[
    "--preset",
    "tiny",
    "--block-size",
    "32",
    "--batch-size",
    "8",
    "--learning-rate",
    "3e-3",
    "--warmup-iters",
    "5",
    "--eval-interval",
    "10",
    "--eval-iters",
    "2",
    "--log-interval",
    "1",
    "--device",
    "cpu",
    "--dropout",
    "0",
];

/// `gpt-train train` with the TINY settings, of which `extra` overrides any flag it repeats.
fn train(corpus: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<Output> {
    let mut args = vec![
        "train",
        "--data",
        corpus.to_str().unwrap_or_default(),
        "--out",
        out.to_str().unwrap_or_default(),
    ];
    for pair in TINY.chunks(2) {
        if !extra.contains(&pair[0]) {
            args.extend_from_slice(pair);
        }
    }
    args.extend_from_slice(extra);
    gpt_train(&args)
}

fn train_losses(out: &Path) -> anyhow::Result<Vec<(u64, f64)>> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let mut losses = vec![];
    for line in text.lines() {
        let e: serde_json::Value = serde_json::from_str(line)?;
        if e["event"] == "train" {
            losses.push((
                e["step"].as_u64().unwrap_or(0),
                e["train_loss"].as_f64().unwrap_or(f64::NAN),
            ));
        }
    }
    Ok(losses)
}

/// The trainer state of the run's latest checkpoint.
fn state(out: &Path) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        out.join("latest/trainer_state.json"),
    )?)?)
}

#[test]
fn resumed_run_matches_an_uninterrupted_one_bit_for_bit() -> anyhow::Result<()> {
    // With dropout too: its masks come from (seed, step, micro-batch, layer), not a generator's
    // state that a restart would lose.
    for dropout in ["0", "0.2"] {
        resumed_run_matches(dropout)?;
    }
    Ok(())
}

fn resumed_run_matches(dropout: &str) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(40_000)?)?;
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let schedule = ["--lr-decay-iters", "30", "--dropout", dropout];

    let out = train(&corpus, &a, &[&schedule[..], &["--max-iters", "30"]].concat())?;
    assert!(out.status.success(), "{}", stderr(&out));
    let out = train(&corpus, &b, &[&schedule[..], &["--max-iters", "15"]].concat())?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(state(&b)?["step"], 15);
    // Resume with nothing but the new length: every other setting comes from the checkpoint.
    let b_str = b.to_str().unwrap_or_default();
    let out = gpt_train(&["train", "--out", b_str, "--resume", "--max-iters", "30"])?;
    assert!(out.status.success(), "{}", stderr(&out));

    assert_eq!(state(&b)?["step"], 30);
    for file in ["model.safetensors", "optimizer.safetensors"] {
        // Tensor by tensor: the header's metadata map has no fixed key order.
        let (fa, fb) = (
            std::fs::read(a.join("latest").join(file))?,
            std::fs::read(b.join("latest").join(file))?,
        );
        let (ta, tb) = (SafeTensors::deserialize(&fa)?, SafeTensors::deserialize(&fb)?);
        let mut names = ta.names();
        names.sort();
        assert!(names.len() > 10);
        for name in names {
            assert!(
                ta.tensor(name)?.data() == tb.tensor(name)?.data(),
                "dropout {dropout}, {file}: {name} differs"
            );
        }
        let meta = |bytes: &[u8]| -> anyhow::Result<_> { Ok(SafeTensors::read_metadata(bytes)?.1.metadata().clone()) };
        assert_eq!(meta(&fa)?, meta(&fb)?);
    }
    let (la, lb) = (train_losses(&a)?, train_losses(&b)?);
    assert_eq!(la.len(), 30);
    assert_eq!(la, lb);
    assert!(la[29].1 < la[0].1, "the loss went down: {:?} -> {:?}", la[0], la[29]);
    Ok(())
}

/// `--parallel ops` splits every pass over the threads in chunks that each give the bits they
/// give alone, so a run is the same bit for bit on 1 or 2 threads; `--parallel shards` sums the
/// shards' gradients instead (another order of the same sums), so its losses agree to rounding.
#[test]
fn parallel_ops_runs_give_the_same_bits_on_any_number_of_threads() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(40_000)?)?;
    // Wide enough that the element-wise passes split into several chunks.
    let shape = [
        "--n-embd",
        "128",
        "--n-head",
        "4",
        "--batch-size",
        "16",
        "--block-size",
        "64",
        "--dropout",
        "0.1",
        "--max-iters",
        "8",
    ];
    let run = |name: &str, parallel: &str, threads: &str| -> anyhow::Result<PathBuf> {
        let out = dir.path().join(name);
        let args = [&shape[..], &["--parallel", parallel, "--threads", threads]].concat();
        let output = train(&corpus, &out, &args)?;
        assert!(output.status.success(), "{name}: {}", stderr(&output));
        Ok(out)
    };
    let (one, two, shards) = (
        run("one", "ops", "1")?,
        run("two", "ops", "2")?,
        run("shards", "shards", "2")?,
    );
    let (l1, l2, ls) = (train_losses(&one)?, train_losses(&two)?, train_losses(&shards)?);
    assert_eq!(l1.len(), 8);
    assert_eq!(l1, l2, "ops on 1 and 2 threads");
    let (fa, fb) = (
        std::fs::read(one.join("latest/model.safetensors"))?,
        std::fs::read(two.join("latest/model.safetensors"))?,
    );
    let (ta, tb) = (SafeTensors::deserialize(&fa)?, SafeTensors::deserialize(&fb)?);
    assert!(ta.names().len() > 10);
    for name in ta.names() {
        assert!(
            ta.tensor(name)?.data() == tb.tensor(name)?.data(),
            "{name} after 8 steps"
        );
    }
    for ((step, a), (_, b)) in l1.iter().zip(&ls) {
        assert!((a - b).abs() < 1e-4 * a.abs(), "step {step}: ops {a} vs shards {b}");
    }
    Ok(())
}

#[test]
fn a_short_run_beats_the_unigram_entropy_and_writes_its_outputs() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let text = shakespeare(100_000)?;
    let corpus = write(dir.path(), "corpus.txt", &text)?;
    let mut counts = std::collections::HashMap::new();
    for c in text.chars() {
        *counts.entry(c).or_insert(0usize) += 1;
    }
    let n = text.chars().count() as f64;
    let unigram: f64 = counts.values().map(|&k| -(k as f64 / n) * (k as f64 / n).ln()).sum();

    let out_dir = dir.path().join("run");
    let out = train(
        &corpus,
        &out_dir,
        &[
            "--max-iters",
            "300",
            "--batch-size",
            "16",
            "--eval-interval",
            "100",
            "--eval-iters",
            "10",
            "--log-interval",
            "50",
        ],
    )?;
    assert!(out.status.success(), "{}", stderr(&out));
    let best = state(&out_dir)?["best_val_loss"].as_f64().unwrap_or(f64::INFINITY);
    assert!(
        best < unigram,
        "best val loss {best} is not below the unigram entropy {unigram}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("best val loss"));

    for file in [
        "latest/config.json",
        "latest/model.safetensors",
        "latest/tokenizer.json",
        "latest/optimizer.safetensors",
        "latest/trainer_state.json",
        "checkpoints/step-00000300/model.safetensors",
        "loss.svg",
    ] {
        assert!(out_dir.join(file).is_file(), "{file} missing");
    }
    assert!(std::fs::read_to_string(out_dir.join("loss.svg"))?.contains("<svg"));
    // The best checkpoint is a GPT-2 directory the model crate loads.
    let (model, tok) = gpt::load_dir(
        &out_dir.join("best"),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    assert_eq!(model.config().vocab_size, tok.vocab_size());
    let events: Vec<serde_json::Value> = std::fs::read_to_string(out_dir.join("metrics.jsonl"))?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let eval = events
        .iter()
        .rfind(|e| e["event"] == "eval")
        .cloned()
        .unwrap_or_default();
    for key in ["step", "train_loss", "val_loss", "val_ppl", "lr", "elapsed_s"] {
        assert!(!eval[key].is_null(), "eval event lacks {key}: {eval}");
    }
    let logged = events
        .iter()
        .find(|e| e["event"] == "train")
        .cloned()
        .unwrap_or_default();
    assert!(logged["tokens_per_sec"].as_f64().unwrap_or(0.0) > 0.0, "{logged}");
    assert!((eval["val_ppl"].as_f64().unwrap_or(0.0) - eval["val_loss"].as_f64().unwrap_or(0.0).exp()).abs() < 1e-6);
    Ok(())
}

#[test]
fn eval_matches_the_python_reference_on_the_fixture() -> anyhow::Result<()> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2");
    let expected: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture.join("expected.json"))?)?;
    let runs = expected["eval"]["runs"].as_array().cloned().unwrap_or_default();
    assert!(runs.len() >= 3);
    for run in runs {
        let (block, stride) = (run["block_size"].to_string(), run["stride"].to_string());
        let out = gpt_train(&[
            "eval",
            "--checkpoint",
            fixture.to_str().unwrap_or_default(),
            "--data",
            fixture.join("eval.txt").to_str().unwrap_or_default(),
            "--block-size",
            &block,
            "--stride",
            &stride,
            "--json",
            "--device",
            "cpu",
        ])?;
        assert!(out.status.success(), "{}", stderr(&out));
        let got: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        assert_eq!(
            got["tokens_scored"], run["tokens_scored"],
            "block {block} stride {stride}"
        );
        let (ppl, want) = (
            got["perplexity"].as_f64().unwrap_or(0.0),
            run["perplexity"].as_f64().unwrap_or(1.0),
        );
        assert!(
            (ppl / want - 1.0).abs() < 1e-4,
            "block {block} stride {stride}: {ppl} vs {want}"
        );
        let bpb = got["mean_nll"].as_f64().unwrap_or(0.0) * got["tokens_scored"].as_f64().unwrap_or(0.0)
            / std::f64::consts::LN_2
            / expected["eval"]["bytes"].as_f64().unwrap_or(1.0);
        assert!((got["bits_per_byte"].as_f64().unwrap_or(0.0) - bpb).abs() < 1e-9);
    }
    Ok(())
}

#[test]
fn sigterm_saves_a_checkpoint_that_resumes() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    let out_dir = dir.path().join("run");
    let mut args = vec![
        "train",
        "--data",
        corpus.to_str().unwrap_or_default(),
        "--out",
        out_dir.to_str().unwrap_or_default(),
    ];
    args.extend_from_slice(TINY);
    args.extend_from_slice(&["--max-iters", "1000000"]);
    let child = Command::new(BIN)
        .args(&args)
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let started = Instant::now();
    while train_losses(&out_dir).map(|l| l.len()).unwrap_or(0) < 3 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "training never logged a step"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status()?;
    let out = child.wait_with_output()?;
    assert!(out.status.success(), "exit {:?}: {}", out.status, stderr(&out));
    assert!(stderr(&out).contains("--resume"), "{}", stderr(&out));
    let step = state(&out_dir)?["step"].as_u64().unwrap_or(0);
    assert!(step >= 3, "{step}");
    let more = (step + 2).to_string();
    let out = gpt_train(&[
        "train",
        "--out",
        out_dir.to_str().unwrap_or_default(),
        "--resume",
        "--max-iters",
        &more,
    ])?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(state(&out_dir)?["step"].as_u64(), Some(step + 2));
    Ok(())
}

/// Runs `gpt-train` expecting failure, and returns its stderr.
fn fails(args: &[&str]) -> anyhow::Result<String> {
    let out = gpt_train(args)?;
    assert!(!out.status.success(), "expected failure: {args:?}");
    Ok(stderr(&out))
}

fn snapshot(dir: &Path) -> anyhow::Result<Vec<(PathBuf, Vec<u8>)>> {
    let mut files = vec![];
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_file() {
            files.push((path.clone(), std::fs::read(&path)?));
        }
    }
    files.sort();
    Ok(files)
}

#[test]
fn bad_inputs_give_clear_errors_and_keep_what_was_saved() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let d = |p: &Path| p.to_str().unwrap_or_default().to_string();
    let out = d(&dir.path().join("out"));

    let empty = d(&write(dir.path(), "empty.txt", "")?);
    let err = fails(&["train", "--data", &empty, "--out", &out])?;
    assert!(err.contains("empty.txt") && err.contains("empty"), "{err}");

    let latin1 = d(&write(dir.path(), "latin1.txt", b"caf\xe9 au lait\n")?);
    let err = fails(&["train", "--data", &latin1, "--out", &out])?;
    assert!(err.contains("latin1.txt") && err.contains("UTF-8"), "{err}");

    let short = d(&write(dir.path(), "short.txt", "To be, or not to be.\n")?);
    let err = fails(&[
        "train",
        "--data",
        &short,
        "--out",
        &out,
        "--block-size",
        "32",
        "--device",
        "cpu",
    ])?;
    assert!(err.contains("block size + 1"), "{err}");

    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    let c = d(&corpus);
    let err = fails(&["train", "--data", &c, "--out", &out, "--device", "tpu"])?;
    assert!(err.contains("tpu") && err.contains("cuda:N"), "{err}");
    let err = fails(&["train", "--data", &c, "--out", &out, "--n-head", "5", "--n-embd", "32"])?;
    assert!(err.contains("divisible"), "{err}");

    let blocker = d(&write(dir.path(), "a-file", "x")?);
    let err = fails(&["train", "--data", &c, "--out", &format!("{blocker}/run")])?;
    assert!(err.contains("--out") && err.contains("a-file"), "{err}");

    let err = fails(&["train", "--out", &out, "--resume"])?;
    assert!(err.contains("no complete checkpoint to resume"), "{err}");

    // A real checkpoint, then runs that must fail without touching it.
    let run = train(&corpus, Path::new(&out), &["--max-iters", "3"])?;
    assert!(run.status.success(), "{}", stderr(&run));
    let before = snapshot(Path::new(&out))?;
    let err = fails(&["train", "--data", &c, "--out", &out])?;
    assert!(err.contains("already holds a training checkpoint"), "{err}");
    let err = fails(&["train", "--out", &out, "--resume", "--n-layer", "3"])?;
    assert!(err.contains("--n-layer 3") && err.contains("disagrees"), "{err}");
    let err = fails(&["train", "--out", &out, "--resume", "--block-size", "64"])?;
    assert!(err.contains("--block-size 64"), "{err}");
    let err = fails(&[
        "train",
        "--data",
        &c,
        "--out",
        &out,
        "--resume",
        "--tokenizer",
        "bpe:300",
    ])?;
    assert!(err.contains("tokenizer"), "{err}");
    assert!(
        snapshot(Path::new(&out))? == before,
        "a failed run changed the checkpoint"
    );

    // A saved checkpoint altered afterwards is an error naming it, not passed over silently.
    let state_path = Path::new(&out).join("latest/trainer_state.json");
    let saved = std::fs::read_to_string(&state_path)?;
    std::fs::write(&state_path, saved.replace("\"step\": 3", "\"step\": 2"))?;
    let err = fails(&["train", "--out", &out, "--resume", "--max-iters", "5"])?;
    assert!(
        err.contains("altered after saving") && err.contains("step-00000003"),
        "{err}"
    );
    // One cut while being written (its state has no checksums yet) is passed over (here it is
    // the only one).
    let mut state: serde_json::Value = serde_json::from_str(&saved)?;
    state["checksums"] = serde_json::json!({});
    state["step"] = serde_json::json!(2);
    std::fs::write(&state_path, serde_json::to_string_pretty(&state)?)?;
    let err = fails(&["train", "--out", &out, "--resume", "--max-iters", "5"])?;
    assert!(
        err.contains("cut while being written") && err.contains("no complete checkpoint"),
        "{err}"
    );

    let err = fails(&["eval", "--checkpoint", &d(&dir.path().join("nowhere")), "--data", &c])?;
    assert!(err.contains("nowhere"), "{err}");
    Ok(())
}

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
    let context = 64;
    let val_text = (1..text.len())
        .filter(|&n| text.is_char_boundary(n))
        .map(|n| &text[..n])
        .find(|t| tok.encode(t).map(|ids| ids.len()).unwrap_or(0) == context + 1)
        .ok_or_else(|| anyhow::anyhow!("no prefix of {} tokens", context + 1))?;
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
    let evals: Vec<(u64, f64)> = std::fs::read_to_string(out.join("metrics.jsonl"))?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "eval")
        .map(|e| {
            (
                e["step"].as_u64().unwrap_or(0),
                e["val_loss"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect();
    let eval = gpt_train(&["eval", "--checkpoint", f, "--data", v, "--block-size", "64", "--json"])?;
    assert!(eval.status.success(), "{}", stderr(&eval));
    let reference: serde_json::Value = serde_json::from_slice(&eval.stdout)?;
    let mean_nll = reference["mean_nll"].as_f64().unwrap_or(f64::NAN);
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
