//! Crash safety: a run killed with SIGKILL again and again, half of the kills inside a save and
//! half at random moments of training, resumes from its newest complete checkpoint every time and
//! never loses more than one save interval.
//!
//! The kills follow the run's progress on disk rather than the clock, so that a loaded machine
//! (a slow start, a slow step) changes when they land but not what they test.

mod common;

use gpt_test_support as support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{latest_step, wait_for, BIN};
const MINUTE: Duration = Duration::from_secs(60);
const SAVE_EVERY: u64 = 5;
/// How long the test hook sleeps after each of a save's three files, in the runs to be killed
/// inside one.
const SAVE_DELAY_MS: u64 = 50;

/// Whether the run with process id `pid` has a save under way (its temporary directory).
fn saving(out: &Path, pid: u32) -> bool {
    let suffix = format!("-{pid}");
    std::fs::read_dir(out.join("checkpoints"))
        .map(|d| {
            d.flatten().any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with(".tmp-") && name.ends_with(&suffix)
            })
        })
        .unwrap_or(false)
}

#[cfg(unix)]
#[test]
fn a_run_killed_at_random_moments_resumes_every_time() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let text = support::shakespeare(20_000)?;
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, text)?;
    let out = dir.path().join("run");
    let corpus = corpus.to_str().unwrap_or_default();
    let save_every = SAVE_EVERY.to_string();
    let settings = [
        "--batch-size",
        "4",
        "--eval-interval",
        &save_every,
        "--eval-iters",
        "1",
        "--threads",
        "1",
    ];
    let args = common::train_args(Path::new(corpus), &out, &settings);
    let mut x: u64 = 0x2545_F491_4F6C_DD1D; // a fixed sequence of delays
    let (mut newest, mut resumes, mut inside_saves) = (0u64, 0, 0);
    const KILLS: usize = 20;
    for kill in 1..=KILLS {
        let resume = out.join("latest").exists();
        let mut cmd = Command::new(BIN);
        let in_save = kill % 2 == 0;
        cmd.args(&args)
            .args(["--max-iters", "1000000"])
            .env("RUST_LOG", "error");
        if in_save {
            cmd.env("GPT_TRAIN_SAVE_DELAY_MS", SAVE_DELAY_MS.to_string());
        }
        if resume {
            cmd.arg("--resume");
            resumes += 1;
        }
        let mut child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let pid = child.id();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if in_save {
            // Inside a save: at most 40 ms after its temporary directory appears (a save lasts
            // at least three delays of 50 ms).
            wait_for(&mut child, "save", MINUTE, || saving(&out, pid))?;
            std::thread::sleep(Duration::from_millis(x % 40));
        } else {
            // Anywhere in training (saves without the delay are short), once the run has saved a
            // step beyond the one it resumed.
            let from = latest_step(&out);
            wait_for(&mut child, "new checkpoint", MINUTE, || latest_step(&out) > from)?;
            std::thread::sleep(Duration::from_millis(x % 100));
        }
        Command::new("kill").args(["-KILL", &pid.to_string()]).status()?;
        child.wait()?;
        inside_saves += usize::from(saving(&out, pid));
        if let Some(step) = latest_step(&out) {
            assert!(
                step >= newest,
                "kill {kill}: the newest checkpoint went back from step {newest} to {step}"
            );
            newest = step;
        }
    }
    assert_eq!(resumes, KILLS - 1, "every run after the first resumed");
    assert!(
        (KILLS / 2..KILLS).contains(&inside_saves),
        "{inside_saves} of {KILLS} kills left a save half-written: expected every other one"
    );
    // Each kill at random saw one more save: no resume lost more than it had gained. The first
    // run's first save is at step 0 (its first evaluation), so the saves seen reach at least
    // step SAVE_EVERY * (kills past a save - 1); they reach further when a kill's random delay
    // lets the run save again before it lands.
    assert!(
        newest >= SAVE_EVERY * (KILLS / 2 - 1) as u64,
        "after {} kills past a save, the newest checkpoint is at step {newest}",
        KILLS / 2
    );
    // The run then finishes 20 steps on from where it was.
    let end = (newest + 20).to_string();
    let done = Command::new(BIN)
        .args(args)
        .args(["--resume", "--max-iters", &end])
        .env("RUST_LOG", "error")
        .output()?;
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert_eq!(latest_step(&out), Some(newest + 20));
    let leftovers: Vec<_> = std::fs::read_dir(out.join("checkpoints"))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        leftovers,
        vec![format!("step-{:08}", newest + 20)],
        "one complete checkpoint kept, no temporary ones"
    );
    Ok(())
}
