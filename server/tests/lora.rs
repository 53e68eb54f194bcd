//! LoRA adapters served beside the base model, as vLLM serves them: `--lora-modules`, each adapter
//! a model name in `/v1/models` with its parent, chosen by `model`; requests for several adapters
//! and the base in one batch each get what they get alone, and what the model crate gives with
//! the adapter set; bad adapters are refused at start or at load with the file and tensor named;
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` behind their flag and the API key.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::{config, fixture, start, Server, ServerConfig};
use gpt::lora::{LoraConfig, LoraLayer};
use serde_json::{json, Value};

const PROMPT: &str = "First Citizen:\nBefore we proceed";

/// An adapter for a model of `cfg` on `targets`, its matrices random and large enough to change
/// what the model generates, written as PEFT writes one.
fn write_adapter(dir: &Path, cfg: &gpt::Config, targets: &[&str], r: usize, seed: u64) -> anyhow::Result<gpt::Adapter> {
    let config = LoraConfig {
        r,
        lora_alpha: 2.0 * r as f64,
        lora_dropout: 0.0,
        target_modules: targets.iter().map(|t| t.to_string()).collect(),
        layers_to_transform: None,
        use_rslora: false,
        base_model_name_or_path: Some("tiny".into()),
    };
    // Seeded uniform values in [-0.8, 0.8): the same adapter every run.
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut noise = |rows: usize, cols: usize| {
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 1.6
            })
            .collect();
        Tensor::from_vec(values, (rows, cols), &Device::Cpu)
    };
    let mut layers = BTreeMap::new();
    for (name, d_in, d_out) in config.layers(cfg)? {
        let layer = LoraLayer::new(noise(r, d_in)?, noise(d_out, r)?, config.scale());
        layers.insert(name, layer);
    }
    let adapter = gpt::Adapter::new(config, layers, cfg)?;
    adapter.save(dir)?;
    Ok(adapter)
}

fn fixture_config() -> anyhow::Result<gpt::Config> {
    Ok(gpt::Config::from_file(&fixture().join("config.json"))?)
}

/// Two adapters of the fixture's shape, in temporary directories.
struct Adapters {
    dirs: [tempfile::TempDir; 2],
}

impl Adapters {
    fn new() -> anyhow::Result<Self> {
        let cfg = fixture_config()?;
        let dirs = [tempfile::tempdir()?, tempfile::tempdir()?];
        write_adapter(dirs[0].path(), &cfg, &["c_attn", "c_fc"], 4, 1)?;
        write_adapter(dirs[1].path(), &cfg, &["c_proj"], 2, 2)?;
        Ok(Self { dirs })
    }

    /// The fixture served with both adapters.
    async fn serve(&self) -> anyhow::Result<Server> {
        let cfg = ServerConfig {
            lora_modules: self.modules(),
            ..config()
        };
        start(&fixture(), cfg).await
    }

    fn modules(&self) -> Vec<gpt_server::adapters::LoraModule> {
        ["qkv", "proj"]
            .iter()
            .zip(&self.dirs)
            .map(|(name, dir)| gpt_server::adapters::LoraModule {
                name: name.to_string(),
                path: dir.path().to_string_lossy().into_owned(),
                base_model_name: None,
            })
            .collect()
    }
}

fn text(r: &Value) -> String {
    r["choices"][0]["text"].as_str().unwrap_or_default().to_string()
}

async fn ok(server: &Server, body: Value) -> anyhow::Result<Value> {
    let (status, r) = server.post(body.clone()).await?;
    anyhow::ensure!(status == 200, "{body}: {status} {r}");
    Ok(r)
}

/// The model crate's greedy text for `prompt`, with the adapter in `dir` set (or none).
fn reference_greedy(adapter: Option<&Path>, prompt: &str, max_tokens: usize) -> anyhow::Result<String> {
    let (mut model, tok) = gpt::load_dir(&fixture(), DType::F32, &Device::Cpu)?;
    if let Some(dir) = adapter {
        let adapter = gpt::Adapter::load(dir, model.config(), DType::F32, &Device::Cpu)?;
        model.set_adapter(Some(&adapter))?;
    }
    let ids = tok.encode(prompt)?;
    let mut sampler = gpt::Sampler::new(gpt::SamplingParams::default());
    let out = gpt::generate(&model, &ids, max_tokens, &mut sampler, tok.eos_token_id())?;
    Ok(tok.decode(&out)?)
}

/// The log-probability of each prompt token after the first, from the model crate with the
/// adapter in `dir` set (or none).
fn reference_logprobs(adapter: Option<&Path>, prompt: &str) -> anyhow::Result<Vec<f32>> {
    let (mut model, tok) = gpt::load_dir(&fixture(), DType::F32, &Device::Cpu)?;
    if let Some(dir) = adapter {
        let adapter = gpt::Adapter::load(dir, model.config(), DType::F32, &Device::Cpu)?;
        model.set_adapter(Some(&adapter))?;
    }
    let ids = tok.encode(prompt)?;
    let logits = model.forward(&Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?, None)?;
    let log_p = candle_nn::ops::log_softmax(&logits.squeeze(0)?, 1)?.to_vec2::<f32>()?;
    Ok((1..ids.len()).map(|t| log_p[t - 1][ids[t] as usize]).collect())
}

/// Embeddings under an adapter's name are the model crate's with the adapter set, each in one
/// request that mixes the base and both adapters' inputs in the engine's steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_under_an_adapter_are_the_adapted_models() -> anyhow::Result<()> {
    let adapters = Adapters::new()?;
    let server = adapters.serve().await?;
    let (model, tok) = gpt::load_dir(&fixture(), DType::F32, &Device::Cpu)?;
    let ids = Tensor::new(tok.encode(PROMPT)?.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let requests = ["tiny", "qkv", "proj"]
        .map(|name| server.call("/v1/embeddings", json!({"model": name, "input": [PROMPT, "All:"]})));
    let responses = futures_util::future::join_all(requests).await;
    let mut seen = Vec::new();
    for (response, adapter) in responses.into_iter().zip([None, Some(0), Some(1)]) {
        let response = response?;
        let mut model = model.clone();
        if let Some(i) = adapter {
            let adapter = gpt::Adapter::load(adapters.dirs[i].path(), model.config(), DType::F32, &Device::Cpu)?;
            model.set_adapter(Some(&adapter))?;
        }
        let want = model.embeddings(&ids)?.flatten_all()?.to_vec1::<f32>()?;
        let got: Vec<f32> = (response["data"][0]["embedding"].as_array().into_iter().flatten())
            .map(|v| v.as_f64().unwrap_or(f64::NAN) as f32)
            .collect();
        assert_eq!(got.len(), want.len());
        let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-5, "{}: {diff}", response["model"]);
        seen.push(got);
    }
    assert_ne!(seen[0], seen[1]);
    assert_ne!(seen[0], seen[2]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_models_with_their_own_outputs_batched_with_the_base() -> anyhow::Result<()> {
    let adapters = Adapters::new()?;
    let server = adapters.serve().await?;
    let models = server.get("/v1/models").await?;
    let listed: Vec<(String, Value, Value)> = models["data"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            (
                m["id"].as_str().unwrap_or_default().to_string(),
                m["parent"].clone(),
                m["root"].clone(),
            )
        })
        .collect();
    let dir = |i: usize| adapters.dirs[i].path().to_string_lossy().into_owned();
    assert_eq!(
        listed,
        vec![
            ("tiny".to_string(), Value::Null, json!("tiny")),
            ("proj".to_string(), json!("tiny"), json!(dir(1))),
            ("qkv".to_string(), json!("tiny"), json!(dir(0))),
        ]
    );

    // Each model's greedy text is the model crate's with that adapter set, and they differ.
    let mut greedy = BTreeMap::new();
    for (model, adapter) in [
        ("tiny", None),
        ("qkv", Some(adapters.dirs[0].path())),
        ("proj", Some(adapters.dirs[1].path())),
    ] {
        let r = ok(
            &server,
            json!({"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
        )
        .await?;
        assert_eq!(r["model"], model, "responses name the adapter");
        assert_eq!(text(&r), reference_greedy(adapter, PROMPT, 12)?, "{model}");
        greedy.insert(model, text(&r));
        // The prompt's logprobs, as lm-eval reads them, are the adapted model's.
        let r = ok(
            &server,
            json!({"model": model, "prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 1}),
        )
        .await?;
        let got: Vec<f64> = r["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .into_iter()
            .flatten()
            .skip(1)
            .map(|v| v.as_f64().unwrap_or(f64::NAN))
            .collect();
        let want = reference_logprobs(adapter, PROMPT)?;
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!(
                (g - *w as f64).abs() < 1e-4,
                "{model}: logprob {g} vs the model crate's {w}"
            );
        }
    }
    assert_ne!(greedy["tiny"], greedy["qkv"]);
    assert_ne!(greedy["tiny"], greedy["proj"]);
    assert_ne!(greedy["qkv"], greedy["proj"]);

    // The same requests alone, then all at once in mixed batches: the same texts.
    let prompts = [PROMPT, "All:\nSpeak, speak.", "You are all resolved rather to die"];
    let mut bodies = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        for model in ["tiny", "qkv", "proj"] {
            bodies.push(json!({"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0}));
            bodies.push(
                json!({"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0.9, "seed": i, "n": 2}),
            );
        }
    }
    let mut alone = Vec::new();
    for body in &bodies {
        alone.push(ok(&server, body.clone()).await?);
    }
    let together = futures_util::future::join_all(bodies.iter().map(|b| ok(&server, b.clone()))).await;
    for ((body, a), t) in bodies.iter().zip(&alone).zip(together) {
        let t = t?;
        for i in 0..2 {
            assert_eq!(a["choices"][i]["text"], t["choices"][i]["text"], "{body}: choice {i}");
        }
    }

    // A name that is neither the base's nor an adapter's is a 404 naming `model`.
    let (status, r) = server.post(json!({"model": "nope", "prompt": PROMPT})).await?;
    assert_eq!(status, 404, "{r}");
    assert_eq!(r["error"]["code"], "model_not_found");
    Ok(())
}

#[tokio::test]
async fn bad_adapters_are_refused_at_start_with_the_problem_named() -> anyhow::Result<()> {
    let other_base = gpt::Config {
        n_embd: 48,
        ..fixture_config()?
    };
    let wrong_shape = tempfile::tempdir()?;
    write_adapter(wrong_shape.path(), &other_base, &["c_attn"], 4, 3)?;
    let missing_weights = tempfile::tempdir()?;
    write_adapter(missing_weights.path(), &fixture_config()?, &["c_attn"], 4, 3)?;
    std::fs::remove_file(missing_weights.path().join(gpt::lora::ADAPTER_WEIGHTS_FILE))?;
    let unknown_target = tempfile::tempdir()?;
    write_adapter(unknown_target.path(), &fixture_config()?, &["c_attn"], 4, 3)?;
    let config_file = unknown_target.path().join(gpt::lora::ADAPTER_CONFIG_FILE);
    let text = std::fs::read_to_string(&config_file)?.replace("\"c_attn\"", "\"q_proj\"");
    std::fs::write(&config_file, text)?;
    let module = |path: &Path, base: Option<&str>| gpt_server::adapters::LoraModule {
        name: "bad".into(),
        path: path.to_string_lossy().into_owned(),
        base_model_name: base.map(str::to_string),
    };
    for (module, expected) in [
        (
            module(wrong_shape.path(), None),
            "transformer.h.0.attn.c_attn.lora_A.weight",
        ),
        (module(missing_weights.path(), None), gpt::lora::ADAPTER_WEIGHTS_FILE),
        (module(unknown_target.path(), None), "q_proj"),
        (module(Path::new("/no/such/adapter"), None), "/no/such/adapter"),
        (module(missing_weights.path(), Some("gpt2")), "base model `gpt2`"),
    ] {
        let cfg = ServerConfig {
            lora_modules: vec![module],
            ..config()
        };
        let err = match gpt_server::load_state(&fixture(), &Device::Cpu, None, &cfg) {
            Ok(_) => anyhow::bail!("{expected}: the server started"),
            Err(e) => format!("{e:#}"),
        };
        assert!(
            err.contains(expected) && err.contains("--lora-modules"),
            "{expected}: {err}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_load_and_unload_at_run_time_behind_the_flag_and_the_key() -> anyhow::Result<()> {
    let adapters = Adapters::new()?;
    let path = adapters.dirs[0].path().to_string_lossy().into_owned();
    let load = json!({"lora_name": "qkv", "lora_path": path});

    // Without the flag the routes are not mounted.
    let plain = start(&fixture(), config()).await?;
    let resp = plain
        .client
        .post(format!("{}/v1/load_lora_adapter", plain.url))
        .json(&load)
        .send()
        .await?;
    assert_eq!(resp.status().as_u16(), 404);

    let server = start(
        &fixture(),
        ServerConfig {
            api_key: Some("k".into()),
            runtime_lora_updating: true,
            ..config()
        },
    )
    .await?;
    let call = |path: &'static str, body: Value, key: Option<&'static str>| {
        let mut req = server.client.post(format!("{}{path}", server.url)).json(&body);
        if let Some(key) = key {
            req = req.bearer_auth(key);
        }
        async move {
            let resp = req.send().await?;
            let status = resp.status().as_u16();
            anyhow::Ok((status, resp.text().await?))
        }
    };
    let generate = json!({"model": "qkv", "prompt": PROMPT, "max_tokens": 12, "temperature": 0});
    assert_eq!(call("/v1/load_lora_adapter", load.clone(), None).await?.0, 401);
    assert_eq!(call("/v1/completions", generate.clone(), Some("k")).await?.0, 404);
    let (status, body) = call("/v1/load_lora_adapter", load.clone(), Some("k")).await?;
    assert_eq!(
        (status, body.as_str()),
        (200, "Success: LoRA adapter 'qkv' added successfully.")
    );
    let (status, body) = call("/v1/completions", generate.clone(), Some("k")).await?;
    assert_eq!(status, 200, "{body}");
    let r: Value = serde_json::from_str(&body)?;
    assert_eq!(text(&r), reference_greedy(Some(adapters.dirs[0].path()), PROMPT, 12)?);

    // Loading the name again is refused, unless in place; another base's adapter is refused with
    // the tensor named, and the server goes on serving.
    let (status, body) = call("/v1/load_lora_adapter", load.clone(), Some("k")).await?;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("already loaded") && body.contains("lora_name"), "{body}");
    let other = tempfile::tempdir()?;
    let other_base = gpt::Config {
        n_embd: 48,
        ..fixture_config()?
    };
    write_adapter(other.path(), &other_base, &["c_fc"], 4, 3)?;
    let bad = json!({"lora_name": "other", "lora_path": other.path().to_string_lossy()});
    let (status, body) = call("/v1/load_lora_adapter", bad, Some("k")).await?;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("transformer.h.0.mlp.c_fc.lora_A.weight") && body.contains("lora_path"),
        "{body}"
    );
    let (status, _) = call("/v1/completions", generate.clone(), Some("k")).await?;
    assert_eq!(status, 200);
    let inplace =
        json!({"lora_name": "qkv", "lora_path": adapters.dirs[1].path().to_string_lossy(), "load_inplace": true});
    assert_eq!(call("/v1/load_lora_adapter", inplace, Some("k")).await?.0, 200);
    let (_, body) = call("/v1/completions", generate.clone(), Some("k")).await?;
    let r: Value = serde_json::from_str(&body)?;
    assert_eq!(text(&r), reference_greedy(Some(adapters.dirs[1].path()), PROMPT, 12)?);

    // Unloaded, the name is gone; unloading it again is a 404 naming `lora_name`.
    let unload = json!({"lora_name": "qkv"});
    let (status, body) = call("/v1/unload_lora_adapter", unload.clone(), Some("k")).await?;
    assert_eq!(
        (status, body.as_str()),
        (200, "Success: LoRA adapter 'qkv' removed successfully.")
    );
    assert_eq!(call("/v1/completions", generate, Some("k")).await?.0, 404);
    let (status, body) = call("/v1/unload_lora_adapter", unload, Some("k")).await?;
    assert_eq!(status, 404);
    assert!(body.contains("lora_name"), "{body}");
    Ok(())
}
