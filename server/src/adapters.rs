//! LoRA adapters served beside the base model, as vLLM serves them: each one a model name that a
//! request chooses with `model`, listed in `/v1/models` with the base as its `parent`; loaded at
//! start (`--lora-modules NAME=DIR|HUB_ID`) or while serving (`POST /v1/load_lora_adapter`,
//! `/v1/unload_lora_adapter`). An adapter is held in the model's dtype on its device and shared
//! with the sequences that use it (`Arc`): unloading one lets its running requests finish.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use candle_core::{DType, Device};

/// One loaded adapter.
#[derive(Debug)]
pub struct ServedAdapter {
    /// The model name requests use.
    pub name: String,
    /// As it was named: a directory or a Hub id (`/v1/models`' `root`).
    pub source: String,
    /// Unique for the server's lifetime (a name unloaded and loaded again gets a new one): what
    /// the prefix cache keys entries by.
    pub id: u64,
    pub adapter: gpt::Adapter,
    /// Seconds since the epoch when it was loaded.
    pub created: u64,
}

/// Why an adapter could not be loaded or unloaded.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    #[error("the LoRA adapter `{0}` is already loaded")]
    Exists(String),
    #[error("the LoRA adapter `{0}` is not loaded")]
    NotLoaded(String),
    #[error("`{0}` is the base model's name; a LoRA adapter needs a name of its own")]
    BaseName(String),
    #[error("a LoRA adapter's name must not be empty")]
    EmptyName,
    #[error("the LoRA adapter `{name}` ({source_name}): {error}")]
    Load {
        name: String,
        source_name: String,
        error: Box<gpt::Error>,
    },
}

/// The adapters a server holds, by name.
pub struct Adapters {
    base_name: String,
    cfg: gpt::Config,
    dtype: DType,
    device: Device,
    loaded: RwLock<BTreeMap<String, Arc<ServedAdapter>>>,
    next_id: AtomicU64,
}

impl Adapters {
    /// None yet, for a base model named `base_name` of `cfg`, its tensors `dtype` on `device`.
    pub fn new(base_name: &str, cfg: &gpt::Config, dtype: DType, device: &Device) -> Self {
        Self {
            base_name: base_name.to_string(),
            cfg: cfg.clone(),
            dtype,
            device: device.clone(),
            loaded: RwLock::new(BTreeMap::new()),
            next_id: AtomicU64::new(1),
        }
    }

    /// Reads the adapter `source` names ([`gpt::checkpoint::resolve_adapter`]: a directory, a gpt-train LoRA
    /// run or a Hub id) and serves it as `name`. Slow (files, maybe a download): not on the async
    /// runtime. An adapter that does not fit the base is an error naming the file and the tensor
    /// or field, and changes nothing. A name already loaded is an error unless `replace` (vLLM's
    /// `load_inplace`): then requests that arrive once it is loaded get the new adapter, and those
    /// already running keep the old one.
    pub fn load(&self, name: &str, source: &str, replace: bool) -> Result<Arc<ServedAdapter>, AdapterError> {
        if name.is_empty() {
            return Err(AdapterError::EmptyName);
        }
        if name == self.base_name {
            return Err(AdapterError::BaseName(name.to_string()));
        }
        if !replace && self.get(name).is_some() {
            return Err(AdapterError::Exists(name.to_string()));
        }
        let failed = |error| AdapterError::Load {
            name: name.to_string(),
            source_name: source.to_string(),
            error: Box::new(error),
        };
        let dir = gpt::checkpoint::resolve_adapter(source).map_err(failed)?;
        let adapter = gpt::Adapter::load(&dir, &self.cfg, self.dtype, &self.device).map_err(failed)?;
        let served = Arc::new(ServedAdapter {
            name: name.to_string(),
            source: source.to_string(),
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            adapter,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        });
        let mut loaded = self.loaded.write().unwrap_or_else(|e| e.into_inner());
        // Another load of the same name may have finished meanwhile.
        if !replace && loaded.contains_key(name) {
            return Err(AdapterError::Exists(name.to_string()));
        }
        loaded.insert(name.to_string(), served.clone());
        tracing::info!(
            adapter = name,
            source,
            r = served.adapter.config.r,
            targets = ?served.adapter.config.target_modules,
            "LoRA adapter loaded"
        );
        Ok(served)
    }

    /// Stops serving `name` (if `id` is given, only the adapter loaded with that id); requests
    /// already running with it finish.
    pub fn unload(&self, name: &str, id: Option<u64>) -> Result<(), AdapterError> {
        let mut loaded = self.loaded.write().unwrap_or_else(|e| e.into_inner());
        match loaded.get(name) {
            Some(a) if id.is_none_or(|id| id == a.id) => {
                loaded.remove(name);
                tracing::info!(adapter = name, "LoRA adapter unloaded");
                Ok(())
            }
            _ => Err(AdapterError::NotLoaded(name.to_string())),
        }
    }

    pub fn get(&self, name: &str) -> Option<Arc<ServedAdapter>> {
        self.loaded.read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
    }

    /// Every loaded adapter, by name.
    pub fn list(&self) -> Vec<Arc<ServedAdapter>> {
        self.loaded
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

/// One `--lora-modules` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraModule {
    pub name: String,
    /// A PEFT adapter directory, a gpt-train LoRA run or a Hub id.
    pub path: String,
    /// The base it is for, when the JSON form names one (it must be the served model's name).
    pub base_model_name: Option<String>,
}

/// One `--lora-modules` value: `NAME=DIR|HUB_ID` (vLLM's form), or vLLM's JSON form
/// `{"name": .., "path": .., "base_model_name": ..}`.
pub fn parse_module(spec: &str) -> Result<LoraModule, String> {
    let spec = spec.trim();
    if spec.starts_with('{') {
        let v: serde_json::Value =
            serde_json::from_str(spec).map_err(|e| format!("--lora-modules {spec}: not valid JSON: {e}"))?;
        let field = |key: &str| v.get(key).and_then(|s| s.as_str()).map(str::to_string);
        if let Some(other) = v.as_object().and_then(|o| {
            o.keys()
                .find(|k| !["name", "path", "base_model_name"].contains(&k.as_str()))
        }) {
            return Err(format!(
                "--lora-modules {spec}: unknown field `{other}` (the fields: name, path, base_model_name)"
            ));
        }
        return match (field("name"), field("path")) {
            (Some(name), Some(path)) if !name.is_empty() && !path.is_empty() => Ok(LoraModule {
                name,
                path,
                base_model_name: field("base_model_name"),
            }),
            _ => Err(format!(
                "--lora-modules {spec}: the JSON form needs non-empty string fields `name` and `path`"
            )),
        };
    }
    match spec.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok(LoraModule {
            name: name.to_string(),
            path: path.to_string(),
            base_model_name: None,
        }),
        _ => Err(format!(
            "--lora-modules {spec}: expected NAME=PATH (a PEFT adapter directory or a Hub id), or JSON with `name` and `path`"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_parse_in_vllms_two_forms() {
        let module = |name: &str, path: &str, base: Option<&str>| LoraModule {
            name: name.into(),
            path: path.into(),
            base_model_name: base.map(str::to_string),
        };
        assert_eq!(parse_module("sql=/tmp/a=b"), Ok(module("sql", "/tmp/a=b", None)));
        assert_eq!(
            parse_module(r#"{"name": "sql", "path": "org/adapter", "base_model_name": "gpt2"}"#),
            Ok(module("sql", "org/adapter", Some("gpt2")))
        );
        for bad in [
            "sql",
            "=dir",
            "sql=",
            r#"{"name": "sql"}"#,
            r#"{"name": "a", "path": "b", "rank": 8}"#,
            "{",
        ] {
            let err = parse_module(bad).err().unwrap_or_default();
            assert!(err.contains("--lora-modules"), "{bad}: {err}");
        }
    }
}
