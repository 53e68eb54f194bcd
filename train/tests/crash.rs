//! Crash safety: a run killed with SIGKILL at arbitrary moments, saves included, resumes from
//! its newest complete checkpoint every time and never loses more than one save interval.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_gpt-train");

fn latest_step(out: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(out.join("latest/trainer_state.json")).ok()?;
    serde_json::from_str::<serde_json::Value>(&text).ok()?["step"].as_u64()
}

#[cfg(unix)]
#[test]
fn a_run_killed_at_random_moments_resumes_every_time() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/tinyshakespeare.txt");
    let text: String = std::fs::read_to_string(shared)?.chars().take(20_000).collect();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, text)?;
    let out = dir.path().join("run");
    let (corpus, out_str) = (corpus.to_str().unwrap_or_default(), out.to_str().unwrap_or_default());
    // A save every 5 steps, each file of a save followed by 10 ms: kills land inside saves too.
    let args = [
        "train",
        "--data",
        corpus,
        "--out",
        out_str,
        "--preset",
        "tiny",
        "--block-size",
        "32",
        "--batch-size",
        "4",
        "--eval-interval",
        "5",
        "--eval-iters",
        "1",
        "--device",
        "cpu",
        "--threads",
        "1",
    ];
    let mut x: u64 = 0x2545_F491_4F6C_DD1D; // a fixed sequence of kill times
    let (mut kills, mut newest, mut resumes, mut inside_saves) = (0, 0u64, 0, 0);
    while kills < 20 {
        let resume = out.join("latest").exists();
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .args(["--max-iters", "1000000"])
            .env("GPT_TRAIN_SAVE_DELAY_MS", "10")
            .env("RUST_LOG", "error");
        if resume {
            cmd.arg("--resume");
            resumes += 1;
        }
        let mut child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_millis(150 + x % 450));
        if child.try_wait()?.is_some() {
            let output = child.wait_with_output()?;
            anyhow::bail!("the run ended by itself: {}", String::from_utf8_lossy(&output.stderr));
        }
        Command::new("kill").args(["-KILL", &child.id().to_string()]).status()?;
        child.wait()?;
        kills += 1;
        // A temporary checkpoint directory left behind: the kill fell inside a save.
        let in_save = std::fs::read_dir(out.join("checkpoints"))
            .map(|d| {
                d.flatten()
                    .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            })
            .unwrap_or(false);
        inside_saves += usize::from(in_save);
        if let Some(step) = latest_step(&out) {
            assert!(
                step >= newest,
                "kill {kills}: the newest checkpoint went back from step {newest} to {step}"
            );
            newest = step;
        }
    }
    assert!(
        kills >= 12 && resumes >= 10 && (3..kills).contains(&inside_saves),
        "{kills} kills, {inside_saves} inside saves, {resumes} resumes: too few to mean anything"
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
