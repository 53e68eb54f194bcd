//! The trainer under faults: a disk that fills during a save (the error names the file, the
//! previous checkpoint stays intact, and after freeing space `--resume` continues exactly), a
//! checkpoint whose weights or optimizer state were damaged afterwards (truncated, a bit flipped:
//! an error naming the file, from the checksums in `trainer_state.json`), and a second Ctrl-C in
//! the middle of a save (the save completes, then the run exits).

mod common;

use gpt_test_support as support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::BIN;

/// A tiny run's arguments ([`common::train_args`]) saving every 4 steps, for `iters` steps.
fn args(corpus: &str, out: &str, iters: &str) -> Vec<String> {
    let settings = [
        "--batch-size",
        "4",
        "--eval-interval",
        "4",
        "--eval-iters",
        "1",
        "--threads",
        "1",
    ];
    common::train_args(
        Path::new(corpus),
        Path::new(out),
        &[&settings[..], &["--max-iters", iters]].concat(),
    )
}

fn run(args: &[String]) -> anyhow::Result<Output> {
    Ok(Command::new(BIN).args(args).env("RUST_LOG", "warn").output()?)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn corpus(dir: &Path) -> anyhow::Result<String> {
    let path = dir.join("corpus.txt");
    std::fs::write(&path, support::shakespeare(20_000)?)?;
    Ok(path.to_string_lossy().into_owned())
}

/// The training losses a run logged, by step.
fn losses(out: &Path) -> anyhow::Result<Vec<(u64, f64)>> {
    let mut found = Vec::new();
    for line in std::fs::read_to_string(out.join("metrics.jsonl"))?.lines() {
        let e: serde_json::Value = serde_json::from_str(line)?;
        if e["event"] == "train" {
            found.push((
                e["step"].as_u64().unwrap_or(0),
                e["train_loss"].as_f64().unwrap_or(f64::NAN),
            ));
        }
    }
    Ok(found)
}

fn latest(out: &Path) -> std::path::PathBuf {
    out.join("latest")
}

#[test]
fn damaged_checkpoint_files_are_errors_that_name_them() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = corpus(dir.path())?;
    for (file, damage) in [
        ("model.safetensors", "flip"),
        ("optimizer.safetensors", "flip"),
        ("model.safetensors", "truncate"),
        ("optimizer.safetensors", "truncate"),
    ] {
        let out = dir.path().join(format!("{file}-{damage}"));
        let out_str = out.to_string_lossy().into_owned();
        let first = run(&args(&corpus, &out_str, "4"))?;
        assert!(first.status.success(), "{}", stderr(&first));
        let path = latest(&out).join(file);
        let mut bytes = std::fs::read(&path)?;
        match damage {
            "flip" => {
                let at = bytes.len() - 5; // in the tensors, past the header
                bytes[at] ^= 0x10;
            }
            _ => bytes.truncate(bytes.len() - 16),
        }
        std::fs::write(&path, &bytes)?;
        let mut resume = args(&corpus, &out_str, "8");
        resume.push("--resume".into());
        let result = run(&resume)?;
        assert!(
            !result.status.success(),
            "{file} {damage}: resumed from a damaged checkpoint"
        );
        let err = stderr(&result);
        assert!(err.contains(file), "{file} {damage}: {err}");
    }
    Ok(())
}

/// A filesystem of `kib` KiB at `dir`: a tmpfs where this process may mount one (root), else
/// `None`.
fn small_disk(dir: &Path, kib: usize) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let out = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
        .arg(dir)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "mounting a tmpfs of {kib} KiB at {}: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn grow_disk(dir: &Path, kib: usize) -> anyhow::Result<()> {
    let out = Command::new("mount")
        .args(["-o", &format!("remount,size={kib}k")])
        .arg(dir)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "remount: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

struct Unmount<'a>(&'a Path);

impl Drop for Unmount<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).output();
    }
}

#[test]
#[cfg_attr(not(gpt_test_root), ignore = "needs root, to mount a small tmpfs")]
fn a_disk_that_fills_during_a_save_loses_nothing_and_the_run_resumes_exactly() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = corpus(dir.path())?;
    // An uninterrupted run, for the losses a resumed one must reproduce.
    let whole = dir.path().join("whole");
    let reference = run(&args(&corpus, &whole.to_string_lossy(), "12"))?;
    assert!(reference.status.success(), "{}", stderr(&reference));
    let size_of = |d: &Path| -> u64 {
        std::fs::read_dir(d)
            .map(|e| e.flatten().filter_map(|f| f.metadata().ok()).map(|m| m.len()).sum())
            .unwrap_or(0)
    };
    let checkpoint = size_of(&latest(&whole)) as usize;
    let best = size_of(&whole.join("best")) as usize;
    // Room for the token cache, the metrics, best/ and one checkpoint, not for the second that a
    // save writes before it removes the first.
    let out = dir.path().join("small");
    let room = (checkpoint + best + 120_000) / 1024 + 64;
    small_disk(&out, room)?;
    let _unmount = Unmount(&out);
    let out_str = out.to_string_lossy().into_owned();
    let full = run(&args(&corpus, &out_str, "12"))?;
    assert!(
        !full.status.success(),
        "the run fit on the small disk: nothing was tested"
    );
    let err = stderr(&full);
    assert!(
        err.contains("No space left") && (err.contains(".safetensors") || err.contains(".json")),
        "the error names the file and the cause: {err}"
    );
    // The previous checkpoint is whole: it loads, and the run resumes from it once there is room.
    let step: u64 =
        serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(latest(&out).join("trainer_state.json"))?)?
            ["step"]
            .as_u64()
            .unwrap_or(0);
    assert!(step < 12, "the run saved its last step on a full disk");
    grow_disk(&out, room * 4)?;
    let mut resume = args(&corpus, &out_str, "12");
    resume.push("--resume".into());
    let resumed = run(&resume)?;
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    let (want, got) = (losses(&whole)?, losses(&out)?);
    let after: Vec<_> = got.iter().filter(|(s, _)| *s > step).copied().collect();
    let expected: Vec<_> = want.iter().filter(|(s, _)| *s > step).copied().collect();
    assert!(!expected.is_empty());
    assert_eq!(after[after.len() - expected.len()..], expected[..], "resumed losses");
    Ok(())
}

#[cfg(unix)]
#[test]
fn a_second_ctrl_c_during_a_save_lets_it_finish() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = corpus(dir.path())?;
    let out = dir.path().join("run");
    let out_str = out.to_string_lossy().into_owned();
    let mut child = Command::new(BIN)
        .args(args(&corpus, &out_str, "100000"))
        .env("RUST_LOG", "warn")
        .env("GPT_TRAIN_SAVE_DELAY_MS", "300")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    // Wait for the first save to be complete, so that Ctrl-C's save is the second.
    let start = Instant::now();
    while !latest(&out).join("trainer_state.json").exists() {
        anyhow::ensure!(
            start.elapsed() < Duration::from_secs(120),
            "no checkpoint within 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = child.id().to_string();
    Command::new("kill").args(["-INT", &pid]).status()?;
    // The run finishes its step and starts its final save (three delays of 300 ms): the second
    // Ctrl-C lands inside it.
    let tmp_seen = {
        let start = Instant::now();
        let mut seen = false;
        while start.elapsed() < Duration::from_secs(30) && !seen {
            seen = std::fs::read_dir(out.join("checkpoints"))?
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-"));
            std::thread::sleep(Duration::from_millis(5));
        }
        seen
    };
    assert!(tmp_seen, "no save started after Ctrl-C");
    std::thread::sleep(Duration::from_millis(100));
    Command::new("kill").args(["-INT", &pid]).status()?;
    let status = child.wait()?;
    assert_eq!(status.code(), Some(130), "the second Ctrl-C ends the run");
    // The save it interrupted is complete, and the newest.
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(latest(&out).join("trainer_state.json"))?)?;
    assert!(state["checksums"].as_object().is_some_and(|c| c.len() == 2), "{state}");
    let leftovers = std::fs::read_dir(out.join("checkpoints"))?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .count();
    assert_eq!(leftovers, 0, "a half-written checkpoint is left");
    let step = state["step"].as_u64().unwrap_or(0);
    let mut resume = args(&corpus, &out_str, "0");
    let last = resume.len() - 1;
    resume[last] = (step + 2).to_string();
    resume.push("--resume".into());
    let resumed = run(&resume)?;
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    Ok(())
}
