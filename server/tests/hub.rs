//! Models by Hugging Face Hub id, against a stand-in Hub (`tests/support/src/fake_hub.rs`) serving the tiny
//! fixture repository: gpt-server downloads and serves it under its id; Python's
//! `huggingface_hub.snapshot_download` fills a cache that gpt-server serves with
//! `HF_HUB_OFFLINE=1`; a cache filled by gpt-rs loads in `transformers` with
//! `local_files_only=True`; and each failure (no safetensors, another architecture, no such
//! repository, a gated one, an unreachable Hub, offline without the files, a broken download) is
//! an error naming the id, with nothing half-written into the cache.
//!
//! The Python checks need `GPT_TEST_PYTHON`, a Python with `huggingface_hub`, `transformers` and
//! `torch` (CI sets it to its virtual environment): the build script probes it, and where it is
//! missing those tests are reported as ignored, with the reason.

mod common;
use gpt_test_support::fake_hub;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use fake_hub::{FakeHub, FakeRepo};

const BIN: &str = env!("CARGO_BIN_EXE_gpt-server");

fn fixture() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2")
}

/// The fixture checkpoint as a Hub repository: its config, weights and tokenizer.
fn tiny_repo(id: &str) -> FakeRepo {
    let files = ["config.json", "model.safetensors", "tokenizer.json"]
        .iter()
        .map(|f| (f.to_string(), std::fs::read(fixture().join(f)).expect("fixture file")))
        .collect();
    FakeRepo::model(id, files)
}

/// gpt-server on `checkpoint` with `env`, on an ephemeral port: the child and its base URL, or
/// (when it exits before listening) its stderr.
fn spawn(checkpoint: &str, env: &[(&str, &str)]) -> Result<(Child, String), String> {
    let mut command = Command::new(BIN);
    command
        .args(["--checkpoint", checkpoint, "--port", "0", "--device", "cpu"])
        .env("RUST_LOG", "info")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HOME")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        command.env(k, v);
    }
    let mut child = command.spawn().map_err(|e| e.to_string())?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) => {
                if let Some(rest) = line.split("address=").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or_default().to_string();
                    std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
                    return Ok((child, format!("http://{addr}")));
                }
            }
            _ => {
                let out = child.wait_with_output().map_err(|e| e.to_string())?;
                return Err(String::from_utf8_lossy(&out.stderr).into_owned());
            }
        }
    }
}

/// The model's id in `/v1/models` and a greedy completion.
async fn models_and_completion(base: &str) -> anyhow::Result<(String, String)> {
    let client = reqwest::Client::new();
    let models: serde_json::Value = client.get(format!("{base}/v1/models")).send().await?.json().await?;
    let id = models["data"][0]["id"].as_str().unwrap_or_default().to_string();
    let body = serde_json::json!({"model": id, "prompt": "Hello", "max_tokens": 5, "temperature": 0});
    let out: serde_json::Value = client
        .post(format!("{base}/v1/completions"))
        .json(&body)
        .send()
        .await?
        .json()
        .await?;
    Ok((id, out["choices"][0]["text"].as_str().unwrap_or_default().to_string()))
}

/// The Python the checks run (`GPT_TEST_PYTHON`, which CI points at a virtual environment with
/// transformers and torch; else `python3`).
/// `org/tiny-gpt2` served from the cache at `cache_dir` with `HF_HUB_OFFLINE=1`: the model's id
/// and a greedy completion, after checking that no request reached the Hub.
async fn serve_offline(hub: &fake_hub::FakeHub, cache_dir: &str) -> anyhow::Result<(String, String)> {
    let before = hub.requests();
    let offline = [
        ("HF_ENDPOINT", hub.url.as_str()),
        ("HF_HUB_CACHE", cache_dir),
        ("HF_HUB_OFFLINE", "1"),
    ];
    let (mut child, base) = spawn("org/tiny-gpt2", &offline).map_err(anyhow::Error::msg)?;
    let served = models_and_completion(&base).await;
    child.kill()?;
    child.wait()?;
    assert_eq!(hub.requests(), before, "offline, yet the Hub was asked");
    served
}

/// gpt-server started on `org/tiny-gpt2` from `hub`, downloading into the Hub cache `cache_dir`:
/// the model id it serves and its greedy text.
async fn serve_from_hub(hub: &FakeHub, cache_dir: &str) -> anyhow::Result<(String, String)> {
    let env = [("HF_ENDPOINT", hub.url.as_str()), ("HF_HUB_CACHE", cache_dir)];
    let (mut child, base) = spawn("org/tiny-gpt2", &env).map_err(anyhow::Error::msg)?;
    let served = models_and_completion(&base).await;
    child.kill()?;
    child.wait()?;
    served
}

#[tokio::test]
async fn a_hub_id_is_downloaded_served_under_its_id_and_then_found_offline() -> anyhow::Result<()> {
    let hub = FakeHub::start(vec![tiny_repo("org/tiny-gpt2")]);
    let cache = tempfile::tempdir()?;
    let cache_dir = cache.path().to_str().unwrap_or_default();
    let (id, text) = serve_from_hub(&hub, cache_dir).await?;
    assert_eq!(id, "org/tiny-gpt2");
    assert_eq!(text, fake_hub_reference()?);
    // The cache's layout is huggingface_hub's: the ref, the snapshot's links, the blobs.
    let repo = cache.path().join("models--org--tiny-gpt2");
    let commit = std::fs::read_to_string(repo.join("refs/main"))?;
    assert_eq!(commit.trim(), fake_hub::hex40(b"org/tiny-gpt2"));
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        let cached = std::fs::read(repo.join("snapshots").join(commit.trim()).join(file))?;
        assert_eq!(cached, std::fs::read(fixture().join(file))?, "{file}");
    }

    // Offline: no request reaches the Hub, and the same model is served.
    let (id, again) = serve_offline(&hub, cache_dir).await?;
    assert_eq!((id.as_str(), again.as_str()), ("org/tiny-gpt2", text.as_str()));
    Ok(())
}

/// `transformers` reads the cache gpt-rs filled, offline, and writes the same greedy text.
#[tokio::test]
#[cfg_attr(
    not(gpt_test_transformers),
    ignore = "needs GPT_TEST_PYTHON, a Python with transformers and torch"
)]
async fn a_cache_filled_by_gpt_rs_loads_in_transformers_offline() -> anyhow::Result<()> {
    let hub = FakeHub::start(vec![tiny_repo("org/tiny-gpt2")]);
    let cache = tempfile::tempdir()?;
    let cache_dir = cache.path().to_str().unwrap_or_default();
    let (_, text) = serve_from_hub(&hub, cache_dir).await?;
    let script = r#"
import sys, json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("org/tiny-gpt2", cache_dir=sys.argv[1], local_files_only=True)
tok = AutoTokenizer.from_pretrained("org/tiny-gpt2", cache_dir=sys.argv[1], local_files_only=True)
ids = tok("Hello", return_tensors="pt").input_ids
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
print(json.dumps(tok.decode(out[0][ids.shape[1]:])))
"#;
    let out = Command::new(gpt_test_support::python())
        .args(["-c", script, cache_dir])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let hf_text: String = serde_json::from_slice(&out.stdout)?;
    assert_eq!(hf_text, text, "transformers' greedy text from the same cache");
    Ok(())
}

/// The fixture's greedy continuation of "Hello" by 5 tokens, from the fixture directory itself.
fn fake_hub_reference() -> anyhow::Result<String> {
    common::reference_greedy("Hello", 5)
}

#[tokio::test]
#[cfg_attr(
    not(gpt_test_hf_hub),
    ignore = "needs GPT_TEST_PYTHON, a Python with huggingface_hub"
)]
async fn a_cache_filled_by_huggingface_hub_is_served_offline() -> anyhow::Result<()> {
    let hub = FakeHub::start(vec![tiny_repo("org/tiny-gpt2")]);
    let cache = tempfile::tempdir()?;
    let cache_dir = cache.path().to_str().unwrap_or_default();
    let out = Command::new(gpt_test_support::python())
        .args([
            "-c",
            "import sys; from huggingface_hub import snapshot_download; print(snapshot_download('org/tiny-gpt2', \
             cache_dir=sys.argv[1]))",
            cache_dir,
        ])
        .env("HF_ENDPOINT", &hub.url)
        .env_remove("HF_HUB_OFFLINE")
        .output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (id, text) = serve_offline(&hub, cache_dir).await?;
    assert_eq!(id, "org/tiny-gpt2");
    assert_eq!(text, fake_hub_reference()?);
    Ok(())
}

/// gpt-server's startup error for `checkpoint` with `env` (it must not start).
fn startup_error(checkpoint: &str, env: &[(&str, &str)]) -> String {
    match spawn(checkpoint, env) {
        Ok((mut child, _)) => {
            let _ = child.kill();
            panic!("gpt-server started on {checkpoint}")
        }
        Err(stderr) => stderr,
    }
}

/// A repository of llama.cpp GGUF files (a Q8_0 and an F16 file of one model, and a projector
/// that is no model), named as `llama-server -hf` takes it: `org/repo:Q8_0` fetches that file and
/// nothing else, and serves it; without a tag, or with one that no file has, the error lists
/// the repository's GGUF files.
#[tokio::test]
async fn a_gguf_file_of_a_hub_repository_is_chosen_by_its_quantization_tag() -> anyhow::Result<()> {
    let family = fixture().join("../families/llama-gqa");
    let tmp = tempfile::tempdir()?;
    let mut files = Vec::new();
    for (name, format) in [
        ("tiny-llama-Q8_0.gguf", candle_core::quantized::GgmlDType::Q8_0),
        ("tiny-llama-F16.gguf", candle_core::quantized::GgmlDType::F16),
    ] {
        let path = tmp.path().join(name);
        gpt_test_support::write_llama_cpp_gguf(&family, &path, format)?;
        files.push((name.to_string(), std::fs::read(&path)?));
    }
    files.push(("mmproj-tiny-llama-F16.gguf".to_string(), b"a projector".to_vec()));
    let hub = FakeHub::start(vec![FakeRepo::model("org/tiny-GGUF", files)]);
    let cache = tempfile::tempdir()?;
    let cache_dir = cache.path().to_str().unwrap_or_default();
    let env = [("HF_ENDPOINT", hub.url.as_str()), ("HF_HUB_CACHE", cache_dir)];

    let (mut child, url) = spawn("org/tiny-GGUF:q8_0", &env).map_err(|e| anyhow::anyhow!(e))?;
    let served = models_and_completion(&url).await;
    let _ = child.kill();
    let (id, text) = served?;
    assert_eq!(id, "org/tiny-GGUF");
    assert!(!text.is_empty(), "no completion");
    let snapshots = cache.path().join("models--org--tiny-GGUF/snapshots");
    let fetched: Vec<String> = std::fs::read_dir(&snapshots)?
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten())
        .map(|f| f.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(fetched, ["tiny-llama-Q8_0.gguf"], "only the chosen file is downloaded");

    for named in ["org/tiny-GGUF", "org/tiny-GGUF:Q4_K_M"] {
        let err = startup_error(named, &env);
        assert!(
            err.contains("tiny-llama-Q8_0.gguf") && err.contains("tiny-llama-F16.gguf") && !err.contains("mmproj"),
            "{named}: {err}"
        );
    }
    Ok(())
}

#[test]
fn hub_failures_are_errors_that_name_the_id_and_leave_no_half_written_file() -> anyhow::Result<()> {
    let mut bin_only = tiny_repo("org/pickled");
    bin_only.files.retain(|(f, _)| f != "model.safetensors");
    bin_only.files.push(("pytorch_model.bin".into(), b"pickle".to_vec()));
    let mut llama = tiny_repo("org/llama");
    llama.files[0].1 = br#"{"model_type": "mamba", "vocab_size": 10}"#.to_vec();
    let mut gated = tiny_repo("org/gated");
    gated.token = Some("secret".into());
    let mut broken = tiny_repo("org/broken");
    broken.broken = Some("model.safetensors".into());
    let hub = FakeHub::start(vec![bin_only, llama, gated, broken]);
    let cache = tempfile::tempdir()?;
    let cache_dir = cache.path().to_str().unwrap_or_default();
    let env = [("HF_ENDPOINT", hub.url.as_str()), ("HF_HUB_CACHE", cache_dir)];

    let err = startup_error("org/pickled", &env);
    assert!(
        err.contains("org/pickled") && err.contains("pytorch_model.bin"),
        "{err}"
    );
    let err = startup_error("org/llama", &env);
    assert!(err.contains("mamba") && err.contains("supported: gpt2, llama"), "{err}");
    assert!(
        !cache.path().join("models--org--llama/snapshots").exists()
            || std::fs::read_dir(cache.path().join("models--org--llama/snapshots"))?
                .flatten()
                .all(|d| !d.path().join("model.safetensors").exists()),
        "weights fetched for an architecture that was refused"
    );
    let err = startup_error("org/missing", &env);
    assert!(
        err.contains("org/missing") && err.contains("no such repository"),
        "{err}"
    );
    let err = startup_error("org/gated", &env);
    assert!(err.contains("org/gated") && err.contains("HF_TOKEN"), "{err}");
    let with_token = [
        ("HF_ENDPOINT", hub.url.as_str()),
        ("HF_HUB_CACHE", cache_dir),
        ("HF_TOKEN", "secret"),
    ];
    let (mut child, _) = spawn("org/gated", &with_token).map_err(anyhow::Error::msg)?;
    child.kill()?;
    child.wait()?;
    let unreachable = [("HF_ENDPOINT", "http://127.0.0.1:9"), ("HF_HUB_CACHE", cache_dir)];
    let err = startup_error("org/other", &unreachable);
    assert!(err.contains("org/other") && err.contains("cannot reach"), "{err}");
    let offline = [("HF_HUB_CACHE", cache_dir), ("HF_HUB_OFFLINE", "1")];
    let err = startup_error("org/never-downloaded", &offline);
    assert!(
        err.contains("org/never-downloaded") && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
    // A download cut short: an error, and no file in the snapshot (only the partial blob).
    let err = startup_error("org/broken", &env);
    assert!(err.contains("org/broken") && err.contains("model.safetensors"), "{err}");
    let snapshots = cache.path().join("models--org--broken/snapshots");
    if snapshots.exists() {
        for snapshot in std::fs::read_dir(&snapshots)?.flatten() {
            assert!(
                !snapshot.path().join("model.safetensors").exists(),
                "a half-written file in the cache"
            );
        }
    }
    // A path that does not exist and is no Hub id is named as a missing file.
    let err = startup_error("no/such/dir", &env);
    assert!(err.contains("no/such/dir"), "{err}");
    Ok(())
}
