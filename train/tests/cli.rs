//! `gpt-train` as a user runs it: exact resume, learning, perplexity against the Python
//! reference, signals, and a clear error for each bad input.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use safetensors::SafeTensors;

mod common;

use common::{fails, gpt_train, state, stderr, train, train_losses, write, BIN, TINY};
use gpt_test_support as support;
use support::shakespeare;

#[test]
fn resumed_run_matches_an_uninterrupted_one_bit_for_bit() -> anyhow::Result<()> {
    // With dropout too: its masks come from (seed, step, micro-batch, layer), not a generator's
    // state that a restart would lose.
    for dropout in ["0", "0.2"] {
        resumed_run_matches(dropout, &[])?;
    }
    // Muon's momentum buffers beside AdamW's moments, the WSD schedule; on GPT-2 and a family
    // (the recipe's own: Llama's layout, its head untied).
    resumed_run_matches("0", &["--recipe", "modern", "--arch", "gpt2"])?;
    resumed_run_matches("0", &["--recipe", "modern"])?;
    // Stopped half way along a batch ramp.
    resumed_run_matches(
        "0",
        &[
            "--recipe",
            "modern",
            "--batch-ramp-iters",
            "24",
            "--batch-size-start",
            "2",
        ],
    )?;
    Ok(())
}

/// `--batch-ramp-iters N` trains its first steps on fewer rows (their losses differ from the run
/// without it), and a ramp that starts at the full batch is the run without one, bit for bit.
#[test]
fn a_batch_ramp_starts_small_and_a_full_start_changes_nothing() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(40_000)?)?;
    let run = |name: &str, extra: &[&str]| -> anyhow::Result<Vec<(u64, f64)>> {
        let out_dir = dir.path().join(name);
        let flags = [&["--max-iters", "6", "--batch-size", "4"][..], extra].concat();
        let out = train(&corpus, &out_dir, &flags)?;
        assert!(out.status.success(), "{}", stderr(&out));
        train_losses(&out_dir)
    };
    let plain = run("plain", &[])?;
    let full = run("full", &["--batch-ramp-iters", "4", "--batch-size-start", "4"])?;
    let ramped = run("ramped", &["--batch-ramp-iters", "4", "--batch-size-start", "1"])?;
    assert_eq!(plain, full);
    assert_eq!(plain.len(), 6);
    assert_ne!(plain[0], ramped[0], "step 1 trains on 1 row, not 4");
    for (flags, says) in [
        (&["--batch-size-start", "2"][..], "--batch-ramp-iters"),
        (
            &["--batch-ramp-iters", "4", "--batch-size-start", "9"][..],
            "--batch-size-start 9",
        ),
    ] {
        let args = common::train_args(
            &corpus,
            &dir.path().join("bad"),
            &[&["--batch-size", "4"][..], flags].concat(),
        );
        let err = fails(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        assert!(err.contains(says), "{err}");
    }
    Ok(())
}

fn resumed_run_matches(dropout: &str, recipe: &[&str]) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(40_000)?)?;
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let schedule = [&["--lr-decay-iters", "30", "--dropout", dropout][..], recipe].concat();

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
        let muon = names.iter().filter(|n| n.ends_with(".momentum_buffer")).count();
        assert_eq!(
            muon > 0,
            !recipe.is_empty() && file == "optimizer.safetensors",
            "{recipe:?} {file}"
        );
        for name in names {
            assert!(
                ta.tensor(name)?.data() == tb.tensor(name)?.data(),
                "dropout {dropout} {recipe:?}, {file}: {name} differs"
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

/// `--stop-at-val-loss X` ends the run at its first evaluation at or below X, checkpoint saved,
/// and every evaluation in metrics.jsonl carries the seconds since the run began.
#[test]
fn a_run_stops_at_the_first_evaluation_at_the_loss_asked_for() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(40_000)?)?;
    let (whole, stopped) = (dir.path().join("whole"), dir.path().join("stopped"));
    let flags = ["--max-iters", "40", "--eval-interval", "5", "--recipe", "modern"];
    let out = train(&corpus, &whole, &flags)?;
    assert!(out.status.success(), "{}", stderr(&out));
    let evals = common::eval_losses(&whole)?;
    assert_eq!(evals.len(), 9);
    // A target that the run reaches part way: the loss of its fourth evaluation.
    let target = evals[3].1;
    let first = evals.iter().position(|&(_, l)| l <= target).unwrap_or(usize::MAX);
    assert!(first <= 3 && evals[first].0 < 40);
    let out = train(
        &corpus,
        &stopped,
        &[&flags[..], &["--stop-at-val-loss", &target.to_string()]].concat(),
    )?;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("--stop-at-val-loss"), "{}", stderr(&out));
    let stopped_evals = common::eval_losses(&stopped)?;
    assert_eq!(
        stopped_evals,
        evals[..=first].to_vec(),
        "the same run, up to the first at or below {target}"
    );
    assert_eq!(state(&stopped)?["step"], evals[first].0);
    let metrics = std::fs::read_to_string(stopped.join("metrics.jsonl"))?;
    let seconds: Vec<f64> = metrics
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "eval")
        .map(|e| e["elapsed_s"].as_f64().unwrap_or(-1.0))
        .collect();
    assert_eq!(seconds.len(), first + 1);
    assert!(
        seconds.windows(2).all(|w| w[1] > w[0]) && seconds[0] >= 0.0,
        "{seconds:?}"
    );
    // The recipe's model without --arch: Llama's layout, its head untied.
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(stopped.join("best/config.json"))?)?;
    assert_eq!(config["model_type"], "llama", "{config}");
    assert_eq!(config["tie_word_embeddings"], false, "{config}");
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

/// Started as one of several ranks (the variables `mpirun` and `srun` set), a build without MPI
/// refuses instead of training alone into the same `--out` as the others.
#[cfg(not(feature = "mpi"))]
#[test]
fn a_build_without_mpi_started_as_one_of_several_ranks_refuses() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    for (var, value) in [
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("PMI_SIZE", "4"),
        ("SLURM_STEP_NUM_TASKS", "8"),
    ] {
        let out = dir.path().join(var);
        let run = Command::new(BIN)
            .args(common::train_args(&corpus, &out, &["--max-iters", "2"]))
            .env(var, value)
            .output()?;
        assert!(!run.status.success(), "{var}={value}: trained anyway");
        let log = stderr(&run);
        assert!(
            log.contains(&format!("one of {value} processes ({var}={value})")),
            "{log}"
        );
        assert!(log.contains("--features mpi"), "{log}");
        assert!(!out.join("checkpoints").exists());
    }
    // One rank of one is a process alone.
    let out = dir.path().join("alone");
    let run = Command::new(BIN)
        .args(common::train_args(&corpus, &out, &["--max-iters", "2"]))
        .env("OMPI_COMM_WORLD_SIZE", "1")
        .output()?;
    assert!(run.status.success(), "{}", stderr(&run));
    Ok(())
}

#[test]
fn a_bucket_size_that_is_not_positive_is_an_error_naming_the_flag() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = write(dir.path(), "corpus.txt", shakespeare(20_000)?)?;
    for bad in ["0", "-1", "NaN"] {
        let out = dir.path().join(format!("run{bad}"));
        let flag = format!("--allreduce-bucket-mb={bad}");
        let args = common::train_args(&corpus, &out, &["--max-iters", "2", &flag]);
        let err = fails(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        assert!(err.contains("--allreduce-bucket-mb"), "{bad}: {err}");
    }
    Ok(())
}
