//! What the trainer's test suites share: the binary, the settings of a tiny run, and reading a
//! run's outputs. (Each suite uses some of it.)
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_gpt-train");

pub fn write(dir: &Path, name: &str, content: impl AsRef<[u8]>) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    std::fs::write(&path, content)?;
    Ok(path)
}

pub fn gpt_train(args: &[&str]) -> anyhow::Result<Output> {
    Ok(Command::new(BIN).args(args).env("RUST_LOG", "warn").output()?)
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Small, fast settings.
pub const TINY: &[&str] = &[
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
pub fn train(corpus: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<Output> {
    let args = train_args(corpus, out, extra);
    gpt_train(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The arguments of `gpt-train train --data corpus --out out` with the [`TINY`] settings, of
/// which `extra` overrides any flag it repeats.
pub fn train_args(corpus: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    train_args_on(&[corpus.to_str().unwrap_or_default()], out, extra)
}

/// [`train_args`] on several sources of `--data`.
pub fn train_args_on(data: &[&str], out: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["train", "--out", out.to_str().unwrap_or_default(), "--data"];
    args.extend_from_slice(data);
    for pair in TINY.chunks(2) {
        if !extra.contains(&pair[0]) {
            args.extend_from_slice(pair);
        }
    }
    args.extend_from_slice(extra);
    args.into_iter().map(String::from).collect()
}

/// `gpt-train train` with the [`TINY`] settings but its preset (for `--init-from`, whose
/// checkpoint has the shape), `extra` overriding any flag it repeats.
pub fn train_from(corpus: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<Output> {
    let mut args = train_args(corpus, out, extra);
    if let Some(at) = args.iter().position(|a| a == "--preset") {
        args.drain(at..at + 2);
    }
    gpt_train(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// The shortest prefix of `text` of exactly `n` tokens: a validation text whose evaluation
/// window (context `n - 1`) is `gpt-train eval`'s single window too.
pub fn prefix_of_tokens<'a>(text: &'a str, tok: &gpt::Tokenizer, n: usize) -> anyhow::Result<&'a str> {
    (1..text.len())
        .filter(|&i| text.is_char_boundary(i))
        .map(|i| &text[..i])
        .find(|t| tok.encode(t).map(|ids| ids.len()).unwrap_or(0) == n)
        .ok_or_else(|| anyhow::anyhow!("no prefix of {n} tokens"))
}

/// The run's evaluations: (step, validation loss), in order.
pub fn eval_losses(out: &Path) -> anyhow::Result<Vec<(u64, f64)>> {
    Ok(std::fs::read_to_string(out.join("metrics.jsonl"))?
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "eval")
        .map(|e| {
            (
                e["step"].as_u64().unwrap_or(0),
                e["val_loss"].as_f64().unwrap_or(f64::NAN),
            )
        })
        .collect())
}

/// `gpt-train eval --json`'s mean negative log-likelihood of `data` under `checkpoint`, in
/// windows of `block_size`.
pub fn eval_mean_nll(checkpoint: &str, data: &str, block_size: &str) -> anyhow::Result<f64> {
    let eval = gpt_train(&[
        "eval",
        "--checkpoint",
        checkpoint,
        "--data",
        data,
        "--block-size",
        block_size,
        "--json",
    ])?;
    anyhow::ensure!(eval.status.success(), "{}", stderr(&eval));
    let reference: serde_json::Value = serde_json::from_slice(&eval.stdout)?;
    reference["mean_nll"]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("no mean_nll in {reference}"))
}

pub fn train_losses(out: &Path) -> anyhow::Result<Vec<(u64, f64)>> {
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
pub fn state(out: &Path) -> anyhow::Result<serde_json::Value> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        out.join("latest/trainer_state.json"),
    )?)?)
}

/// Runs `gpt-train` expecting failure, and returns its stderr.
pub fn fails(args: &[&str]) -> anyhow::Result<String> {
    let out = gpt_train(args)?;
    assert!(!out.status.success(), "expected failure: {args:?}");
    Ok(stderr(&out))
}

/// The step of the run's newest checkpoint (`latest/`), if it has one.
pub fn latest_step(out: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(out.join("latest/trainer_state.json")).ok()?;
    serde_json::from_str::<serde_json::Value>(&text).ok()?["step"].as_u64()
}

/// Polls `ready` until it holds; fails (and kills the child) if the child exits or `limit` goes
/// by first.
pub fn wait_for(child: &mut Child, what: &str, limit: Duration, mut ready: impl FnMut() -> bool) -> anyhow::Result<()> {
    let start = Instant::now();
    while !ready() {
        if let Some(status) = child.try_wait()? {
            anyhow::bail!("the run ended by itself ({status}) before {what}");
        }
        if start.elapsed() > limit {
            child.kill()?;
            anyhow::bail!("no {what} within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}
