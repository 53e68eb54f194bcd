//! The `gpt-server` binary: start-up errors, and SIGTERM letting in-flight streams end.

mod common;

use std::process::{Child, Command};
use std::time::Duration;

use serde_json::json;

const BIN: &str = env!("CARGO_BIN_EXE_gpt-server");

use common::Log;

/// Starts the binary on an ephemeral port and returns it with its base URL and its log.
fn spawn(checkpoint: &std::path::Path, extra: &[&str]) -> anyhow::Result<(Child, String, Log)> {
    common::spawn_binary(checkpoint, extra, &[])
}

fn sigterm(child: &Child) -> anyhow::Result<()> {
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status()?;
    Ok(())
}

fn wait_exit(mut child: Child) -> anyhow::Result<std::process::ExitStatus> {
    for _ in 0..300 {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill()?;
    anyhow::bail!("the server did not exit")
}

#[tokio::test]
async fn sigterm_finishes_streams_in_flight_then_exits_0() -> anyhow::Result<()> {
    let slow = common::slow_checkpoint()?;
    let (child, url, _log) = spawn(slow.path(), &["--shutdown-grace-secs", "60"])?;
    let client = reqwest::Client::new();
    let body = json!({"prompt": "x", "max_tokens": 40, "temperature": 0, "stream": true});
    let mut resp = client.post(format!("{url}/v1/completions")).json(&body).send().await?;
    let mut text = String::from_utf8_lossy(&resp.chunk().await?.unwrap_or_default()).into_owned();
    sigterm(&child)?;
    while let Some(chunk) = resp.chunk().await? {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // No new work is accepted once shutting down.
    let late = client.post(format!("{url}/v1/completions")).json(&body).send().await;
    assert!(late.is_err(), "a request after SIGTERM was served");
    assert_eq!(wait_exit(child)?.code(), Some(0));
    Ok(())
}

#[tokio::test]
async fn after_the_grace_period_generations_are_cut_with_a_final_chunk() -> anyhow::Result<()> {
    let slow = common::slow_checkpoint()?;
    // No grace: the generation in flight is cut at the next step, whatever the machine's speed.
    let (child, url, log) = spawn(slow.path(), &["--shutdown-grace-secs", "0"])?;
    let client = reqwest::Client::new();
    let body = json!({"prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let mut resp = client.post(format!("{url}/v1/completions")).json(&body).send().await?;
    let mut text = String::from_utf8_lossy(&resp.chunk().await?.unwrap_or_default()).into_owned();
    sigterm(&child)?;
    while let Some(chunk) = resp.chunk().await? {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        text.contains("\"finish_reason\":\"length\"") && text.trim_end().ends_with("data: [DONE]"),
        "{text}"
    );
    let usage: serde_json::Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|c| c["usage"].is_object())
        .map(|c| c["usage"].clone())
        .unwrap_or_default();
    let generated = usage["completion_tokens"].as_u64().unwrap_or(1000);
    let log = log.lock().map(|l| l.join("\n")).unwrap_or_default();
    assert!(
        generated < 1000,
        "not cut before max_tokens: {usage}\nserver log:\n{log}"
    );
    assert_eq!(wait_exit(child)?.code(), Some(0));
    Ok(())
}

#[test]
fn a_missing_or_broken_checkpoint_fails_at_start() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = Command::new(BIN)
        .args(["--checkpoint", dir.path().to_str().unwrap_or_default()])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("config.json"), "{err}");

    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(common::fixture().join(file), dir.path().join(file))?;
    }
    std::fs::write(dir.path().join("model.safetensors"), b"garbage")?;
    let out = Command::new(BIN)
        .args(["--checkpoint", dir.path().to_str().unwrap_or_default()])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("model.safetensors"), "{err}");
    Ok(())
}

#[tokio::test]
async fn the_default_model_is_named_default_however_its_directory_is_given() -> anyhow::Result<()> {
    let weights = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../weights");
    // As the Docker image starts it: an absolute path to the default weights.
    for (checkpoint, name) in [(weights.canonicalize()?, "default"), (common::fixture(), "tiny-gpt2")] {
        let (mut child, url, _log) = spawn(&checkpoint, &[])?;
        let models: serde_json::Value = reqwest::get(format!("{url}/v1/models")).await?.json().await?;
        child.kill()?;
        child.wait()?;
        assert_eq!(models["data"][0]["id"], name, "{}", checkpoint.display());
    }
    Ok(())
}
