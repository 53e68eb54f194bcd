//! LoRA adapters in PEFT's format: a directory with `adapter_config.json` and
//! `adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them for a GPT-2 model and
//! `PeftModel.from_pretrained` reads them.
//!
//! An adapted layer `W` (GPT-2's `Conv1D`, `(in, out)` in checkpoints, hence PEFT's
//! `fan_in_fan_out: true`) computes `x W + b + s · (x Aᵀ) Bᵀ`, with `A` `(r, in)` (PEFT's
//! `lora_A.weight`), `B` `(out, r)` (`lora_B.weight`) and `s = lora_alpha / r` (or
//! `lora_alpha / √r` with `use_rslora`). Merging adds `s · (B A)ᵀ` to `W`.
//!
//! The layers are named as PEFT names them in a `GPT2LMHeadModel`:
//! `transformer.h.{i}.attn.c_attn`, `attn.c_proj`, `mlp.c_fc` and `mlp.c_proj`; a target module
//! matches a layer whose name is it or ends with `.` and it (PEFT's rule), so `c_proj` adapts
//! both projections. The tensors are stored as `base_model.model.{layer}.lora_A.weight`.
//!
//! The other families' layers are `nn.Linear`s, `(out, in)`: `model.layers.{i}.self_attn.q_proj`,
//! `k_proj`, `v_proj`, `o_proj`, `mlp.gate_proj`, `up_proj`, `down_proj`. The decoder runs q, k and
//! v (and gate and up) as one product, so their updates are run as one too
//! ([`Adapter::compute`]): the `A`s stacked, each `B` in its own rows and columns of one
//! block-diagonal `B`, which gives each projection exactly its own update.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::files::write_atomic;

pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// The linear layers of a block that an adapter can target, by their names within the block.
pub const LAYERS: [&str; 4] = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"];

/// The same of the Llama-layout and Gemma families (`model.layers.{i}.`).
pub const FAMILY_LAYERS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// The names of block `i`'s four products as the decoder runs them (q, k, v fused; the output
/// projection; the MLP's first product, gate and up fused where gated; its second): the keys of
/// [`Adapter::compute`].
pub fn block_products(cfg: &Config, i: usize) -> [String; 4] {
    match cfg.is_gpt2_shaped() {
        true => LAYERS.map(|l| format!("transformer.h.{i}.{l}")),
        false => [
            crate::arch::names::QKV,
            "self_attn.o_proj",
            crate::arch::names::GATE_UP,
            "mlp.down_proj",
        ]
        .map(|l| format!("model.layers.{i}.{l}")),
    }
}

/// PEFT's `target_modules` for every linear layer of the blocks (not the LM head).
pub const ALL_LINEAR: &str = "all-linear";

/// The prefix of PEFT's tensor names for a causal LM (`PeftModelForCausalLM` → `LoraModel` →
/// the base model).
const PEFT_PREFIX: &str = "base_model.model.";

/// An adapter's settings: what `adapter_config.json` holds, of what this crate implements.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub r: usize,
    pub lora_alpha: f64,
    pub lora_dropout: f64,
    /// PEFT's `target_modules`: names matched against the end of each layer's name.
    pub target_modules: Vec<String>,
    /// Only these blocks (`layers_to_transform`); all when `None`.
    pub layers_to_transform: Option<Vec<usize>>,
    pub use_rslora: bool,
    /// The base checkpoint it was trained on, as PEFT records it (a Hub id or a path).
    pub base_model_name_or_path: Option<String>,
}

impl LoraConfig {
    /// The scale `s` of the low-rank update.
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }
    }

    /// Checks the settings themselves (not against a model); `what` names their source.
    pub fn validate(&self, what: &str) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::Adapter {
                path: PathBuf::from(what),
                reason,
            })
        };
        if self.r == 0 {
            return bad("`r` must be at least 1".into());
        }
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            return bad(format!(
                "`lora_alpha` must be a positive number, not {}",
                self.lora_alpha
            ));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return bad(format!("`lora_dropout` must be in [0, 1), not {}", self.lora_dropout));
        }
        if self.target_modules.is_empty() {
            return bad("`target_modules` is empty".into());
        }
        Ok(())
    }

    /// The settings in `adapter_config.json`; an error names the field PEFT wrote that this
    /// crate does not implement (DoRA, a trained bias, per-layer ranks, saved whole modules...).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::files::read_utf8(path)?;
        let bad = |reason: String| Error::Adapter {
            path: path.to_path_buf(),
            reason,
        };
        let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let Value::Object(map) = &v else {
            return Err(bad("not a JSON object".into()));
        };
        let peft_type = map.get("peft_type").and_then(Value::as_str).unwrap_or("LORA");
        if peft_type != "LORA" {
            return Err(bad(format!(
                "`peft_type` is {peft_type:?}; only LoRA adapters are supported"
            )));
        }
        let number = |key: &str| -> Result<Option<f64>> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| bad(format!("`{key}` must be a number, not {v}"))),
            }
        };
        let r = number("r")?.ok_or_else(|| bad("`r` is missing".into()))?;
        if r.fract() != 0.0 || r < 1.0 {
            return Err(bad(format!("`r` must be a positive whole number, not {r}")));
        }
        let r = r as usize;
        // PEFT's defaults for the fields it may leave out.
        let lora_alpha = number("lora_alpha")?.unwrap_or(8.0);
        let lora_dropout = number("lora_dropout")?.unwrap_or(0.0);
        let target_modules = match map.get("target_modules") {
            Some(Value::Array(names)) => names
                .iter()
                .map(|n| {
                    n.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| bad(format!("`target_modules` holds {n}, not a name")))
                })
                .collect::<Result<Vec<_>>>()?,
            // Every linear layer of the blocks, whichever the family's (resolved in `layers`).
            Some(Value::String(s)) if s == ALL_LINEAR => vec![ALL_LINEAR.to_string()],
            Some(Value::String(s)) => {
                return Err(bad(format!(
                    "`target_modules` is the regular expression {s:?}; give a list of module names ({})",
                    LAYERS.join(", ")
                )))
            }
            None | Some(Value::Null) => {
                return Err(bad(
                    "`target_modules` is missing (GPT-2's default in PEFT is [\"c_attn\"])".into(),
                ))
            }
            Some(other) => return Err(bad(format!("`target_modules` must be a list of names, not {other}"))),
        };
        let layers_to_transform = match map.get("layers_to_transform") {
            None | Some(Value::Null) => None,
            Some(Value::Number(n)) => Some(vec![
                n.as_u64().ok_or_else(|| bad(format!("`layers_to_transform` {n}")))? as usize,
            ]),
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|i| {
                        i.as_u64()
                            .map(|i| i as usize)
                            .ok_or_else(|| bad(format!("`layers_to_transform` holds {i}, not a layer index")))
                    })
                    .collect::<Result<_>>()?,
            ),
            Some(other) => return Err(bad(format!("`layers_to_transform` must be layer indices, not {other}"))),
        };
        // What PEFT can write that would change the adapter's output here: refused by name.
        let set = |key: &str| match map.get(key) {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Object(m)) => !m.is_empty(),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::String(s)) => !(key == "bias" && s == "none"),
            Some(_) => true,
        };
        for (key, what) in [
            ("use_dora", "DoRA"),
            ("bias", "trained biases"),
            ("modules_to_save", "whole modules saved beside the adapter"),
            ("rank_pattern", "per-layer ranks"),
            ("alpha_pattern", "per-layer alphas"),
            ("layers_pattern", "a layers pattern"),
            ("layer_replication", "layer replication"),
            ("megatron_config", "Megatron layers"),
            ("lora_bias", "LoRA biases"),
            ("exclude_modules", "excluded modules"),
            ("trainable_token_indices", "trained token embeddings"),
            ("target_parameters", "adapted parameters"),
            ("use_qalora", "QA-LoRA"),
            ("use_bdlora", "block-diagonal LoRA"),
            ("alora_invocation_tokens", "activated LoRA"),
        ] {
            if set(key) {
                return Err(bad(format!("`{key}` is set: {what} are not supported")));
            }
        }
        if map.get("fan_in_fan_out") == Some(&Value::Bool(false)) {
            tracing::debug!(path = %path.display(), "fan_in_fan_out is false; GPT-2's Conv1D layers are (in, out) regardless");
        }
        let config = Self {
            r,
            lora_alpha,
            lora_dropout,
            target_modules,
            layers_to_transform,
            use_rslora: map.get("use_rslora").and_then(Value::as_bool).unwrap_or(false),
            base_model_name_or_path: map
                .get("base_model_name_or_path")
                .and_then(Value::as_str)
                .map(str::to_string),
        };
        config.validate(&path.display().to_string())?;
        Ok(config)
    }

    /// `adapter_config.json` as PEFT writes it for a GPT-2 causal LM.
    pub fn to_json(&self) -> Value {
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout,
            "target_modules": match &self.target_modules[..] {
                [all] if all == ALL_LINEAR => json!(ALL_LINEAR),
                targets => json!(targets),
            },
            "layers_to_transform": self.layers_to_transform,
            "fan_in_fan_out": true,
            "bias": "none",
            "use_rslora": self.use_rslora,
            "use_dora": false,
            "modules_to_save": null,
            "init_lora_weights": true,
            "inference_mode": true,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        })
    }

    /// The layers of a model of `cfg` that these settings adapt: name, `in` and `out`. An
    /// error names a target that matches no layer, or a block index the model lacks.
    pub fn layers(&self, cfg: &Config) -> Result<Vec<(String, usize, usize)>> {
        let bad = |reason: String| Error::Adapter {
            path: PathBuf::from(ADAPTER_CONFIG_FILE),
            reason,
        };
        if let Some(blocks) = &self.layers_to_transform {
            if let Some(i) = blocks.iter().find(|&&i| i >= cfg.n_layer) {
                return Err(bad(format!(
                    "`layers_to_transform` names block {i}, but the model has {} blocks",
                    cfg.n_layer
                )));
            }
        }
        let (c, mlp, q, kv) = (cfg.n_embd, cfg.mlp_width(), cfg.q_width(), cfg.kv_width());
        let shape = |layer: &str| match layer {
            "attn.c_attn" => (c, 3 * c),
            "attn.c_proj" => (c, c),
            "mlp.c_fc" => (c, mlp),
            "self_attn.q_proj" => (c, q),
            "self_attn.k_proj" | "self_attn.v_proj" => (c, kv),
            "self_attn.o_proj" => (q, c),
            "mlp.gate_proj" | "mlp.up_proj" => (c, mlp),
            "mlp.down_proj" => (mlp, c),
            _ => (mlp, c),
        };
        let (prefix, block_layers): (&str, Vec<&str>) = match cfg.is_gpt2_shaped() {
            true => ("transformer.h", LAYERS.to_vec()),
            // An ungated MLP (Arcee's) has no gate.
            false => (
                "model.layers",
                (FAMILY_LAYERS.into_iter())
                    .filter(|l| cfg.variant.gated_mlp || *l != "mlp.gate_proj")
                    .collect(),
            ),
        };
        let matches =
            |name: &str, target: &str| target == ALL_LINEAR || name == target || name.ends_with(&format!(".{target}"));
        let mut out = Vec::new();
        let mut used = vec![false; self.target_modules.len()];
        for i in 0..cfg.n_layer {
            if self.layers_to_transform.as_ref().is_some_and(|l| !l.contains(&i)) {
                continue;
            }
            for &layer in &block_layers {
                let name = format!("{prefix}.{i}.{layer}");
                let mut hit = false;
                for (t, target) in self.target_modules.iter().enumerate() {
                    if matches(&name, target) {
                        used[t] = true;
                        hit = true;
                    }
                }
                if hit {
                    let (d_in, d_out) = shape(layer);
                    out.push((name, d_in, d_out));
                }
            }
        }
        if let Some(t) = used.iter().position(|u| !u) {
            return Err(bad(format!(
                "target module {:?} matches no layer of this {} model (its linear layers: {})",
                self.target_modules[t],
                cfg.variant.family.model_type(),
                block_layers.join(", ")
            )));
        }
        Ok(out)
    }
}

/// One adapted layer's low-rank update.
#[derive(Debug, Clone)]
pub struct LoraLayer {
    /// `(r, in)`.
    pub a: Tensor,
    /// `(out, r)`.
    pub b: Tensor,
    pub scale: f64,
    /// Dropout of the update's input while training (PEFT's `lora_dropout`).
    pub dropout: f32,
    /// `A` and `Bᵀ` `(r, out)` as f32 on the host, for the CPU's update of a batched step's rows
    /// ([`LoraLayer::host_matrices`]); made once, for an adapter that is not being trained.
    host: std::sync::OnceLock<(Vec<f32>, Vec<f32>)>,
}

impl LoraLayer {
    /// The same update with its matrices detached from gradient tracking (see
    /// [`crate::Gpt::detached`]).
    pub(crate) fn detached(&self) -> Self {
        Self {
            a: self.a.detach(),
            b: self.b.detach(),
            scale: self.scale,
            dropout: self.dropout,
            host: std::sync::OnceLock::new(),
        }
    }

    /// An update without dropout.
    pub fn new(a: Tensor, b: Tensor, scale: f64) -> Self {
        Self {
            a,
            b,
            scale,
            dropout: 0.0,
            host: std::sync::OnceLock::new(),
        }
    }

    /// The update with dropout `p` of its input while training.
    pub fn with_dropout(self, p: f32) -> Self {
        Self { dropout: p, ..self }
    }

    /// `A` `(r, in)` and `Bᵀ` `(r, out)`, row-major f32 on the host, for
    /// [`gpt_kernels::infer::lora_rows`]; `None` while the matrices are variables (being
    /// trained, they change, and a copy would go stale).
    pub(crate) fn host_matrices(&self) -> candle_core::Result<Option<&(Vec<f32>, Vec<f32>)>> {
        if self.a.is_variable() || self.b.is_variable() {
            return Ok(None);
        }
        if let Some(m) = self.host.get() {
            return Ok(Some(m));
        }
        let to_host = |t: &Tensor| -> candle_core::Result<Vec<f32>> {
            t.to_dtype(DType::F32)?
                .to_device(&Device::Cpu)?
                .flatten_all()?
                .to_vec1()
        };
        let made = (to_host(&self.a)?, to_host(&self.b.t()?.contiguous()?)?);
        Ok(Some(self.host.get_or_init(|| made)))
    }

    /// `s · (x Aᵀ) Bᵀ` for `x` `(.., in)`, the output columns `cols` of it (all when `None`).
    pub fn delta(&self, x: &Tensor, cols: Option<(usize, usize)>) -> candle_core::Result<Tensor> {
        let mut dims = x.dims().to_vec();
        let d_in = dims.pop().unwrap_or(0);
        let rows: usize = dims.iter().product();
        let b = match cols {
            Some((start, len)) => self.b.narrow(0, start, len)?,
            None => self.b.clone(),
        };
        let x2 = x.reshape((rows, d_in))?;
        let low = x2.matmul(&self.a.to_dtype(x.dtype())?.t()?)?; // (rows, r)
        let y = (low.matmul(&b.to_dtype(x.dtype())?.t()?)? * self.scale)?; // (rows, out)
        dims.push(b.dim(0)?);
        y.reshape(dims)
    }

    /// The update as a change of GPT-2's `(in, out)` weight: `s · Aᵀ Bᵀ`.
    pub fn delta_weight(&self) -> candle_core::Result<Tensor> {
        self.a.t()?.matmul(&self.b.t()?)? * self.scale
    }
}

/// A LoRA adapter: its settings and each adapted layer's update, by layer name
/// (`transformer.h.0.attn.c_attn`).
#[derive(Debug, Clone)]
pub struct Adapter {
    pub config: LoraConfig,
    /// Each adapted layer's update, by PEFT's layer name.
    pub layers: BTreeMap<String, LoraLayer>,
    /// The updates of the products the decoder runs, by [`block_products`]' names: GPT-2's are
    /// its layers'; the other families' q, k, v and gate, up updates run as one each.
    pub compute: BTreeMap<String, LoraLayer>,
}

impl Adapter {
    /// A fresh adapter for training on a model of `cfg`, its matrices asked of `vb` (variables,
    /// when training) under their names without PEFT's prefix
    /// (`transformer.h.0.attn.c_attn.lora_A.weight`): `A` as PEFT draws it (`nn.Linear`'s
    /// Kaiming-uniform, bound `1/√in`), `B` zero, so that training starts from the base's output.
    pub fn init(config: LoraConfig, cfg: &Config, vb: &candle_nn::VarBuilder) -> Result<Self> {
        config.validate("the LoRA flags")?;
        let mut layers = BTreeMap::new();
        for (layer, d_in, d_out) in config.layers(cfg)? {
            let bound = 1.0 / (d_in as f64).sqrt();
            let a = vb.get_with_hints(
                (config.r, d_in),
                &format!("{layer}.lora_A.weight"),
                candle_nn::Init::Uniform { lo: -bound, up: bound },
            )?;
            let b = vb.get_with_hints(
                (d_out, config.r),
                &format!("{layer}.lora_B.weight"),
                candle_nn::Init::Const(0.0),
            )?;
            layers.insert(
                layer,
                LoraLayer::new(a, b, config.scale()).with_dropout(config.lora_dropout as f32),
            );
        }
        Self::new(config, layers, cfg)
    }

    /// The adapter of these layers' updates (by PEFT's layer names) for a model of `cfg`, with
    /// its products' updates made.
    pub fn new(config: LoraConfig, layers: BTreeMap<String, LoraLayer>, cfg: &Config) -> Result<Self> {
        let compute = match cfg.is_gpt2_shaped() {
            true => layers.clone(),
            false => fused(&layers, cfg, config.scale(), config.lora_dropout as f32)?,
        };
        Ok(Self {
            config,
            layers,
            compute,
        })
    }

    /// [`Adapter::compute`] made again from the layers' updates: while an adapter of a family
    /// other than GPT-2 trains, its stacked updates are copies, which the optimizer's steps on
    /// the layers' matrices leave behind; made again before each pass (a few small copies), the
    /// gradients reach the layers' matrices through them.
    pub fn restack(&mut self, cfg: &Config) -> Result<()> {
        if !cfg.is_gpt2_shaped() {
            self.compute = fused(&self.layers, cfg, self.config.scale(), self.config.lora_dropout as f32)?;
        }
        Ok(())
    }

    /// PEFT's name of a matrix named as [`Adapter::init`] names it.
    pub fn peft_name(name: &str) -> String {
        format!("{PEFT_PREFIX}{name}")
    }

    /// Reads a PEFT adapter directory for a model of `cfg`, its tensors in `dtype` on `device`.
    /// An error names the file, and the tensor or field that does not fit: a layer the
    /// settings adapt without its tensors, a tensor they do not name, a shape that is not the
    /// rank's or the layer's (an adapter for another base).
    pub fn load(dir: &Path, cfg: &Config, dtype: DType, device: &Device) -> Result<Self> {
        if !dir.is_dir() {
            return Err(Error::MissingFile {
                path: dir.to_path_buf(),
            });
        }
        let config_path = dir.join(ADAPTER_CONFIG_FILE);
        if !config_path.is_file() {
            return Err(Error::MissingFile { path: config_path });
        }
        let config = LoraConfig::from_file(&config_path)?;
        let path = dir.join(ADAPTER_WEIGHTS_FILE);
        if !path.is_file() {
            return Err(Error::MissingFile { path });
        }
        let bad = |reason: String| Error::Adapter {
            path: path.clone(),
            reason,
        };
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| Error::CorruptCheckpoint {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        // PEFT's names, and the same without its prefix or with an adapter name (`.default.`).
        let mut by_name: BTreeMap<String, Tensor> = BTreeMap::new();
        for (name, t) in tensors {
            let short = name.strip_prefix(PEFT_PREFIX).unwrap_or(&name);
            let short = if short.starts_with("h.") {
                format!("transformer.{short}")
            } else {
                short.to_string()
            };
            let short = short
                .replace(".lora_A.default.", ".lora_A.")
                .replace(".lora_B.default.", ".lora_B.");
            by_name.insert(short, t);
        }
        let config_for_errors = |reason: String| Error::Adapter {
            path: config_path.clone(),
            reason,
        };
        let wanted = config.layers(cfg).map_err(|e| match e {
            Error::Adapter { reason, .. } => config_for_errors(reason),
            other => other,
        })?;
        let mut layers = BTreeMap::new();
        for (layer, d_in, d_out) in wanted {
            let mut take = |part: &str, expected: [usize; 2]| -> Result<Tensor> {
                let name = format!("{layer}.{part}.weight");
                let t = by_name.remove(&name).ok_or_else(|| Error::MissingTensor {
                    path: path.clone(),
                    name: format!("{PEFT_PREFIX}{name}"),
                })?;
                if t.dims() != expected {
                    return Err(Error::ShapeMismatch {
                        name: format!("{PEFT_PREFIX}{name} in {}", path.display()),
                        expected: expected.to_vec(),
                        actual: t.dims().to_vec(),
                    });
                }
                Ok(t.to_dtype(dtype)?.to_device(device)?)
            };
            let a = take("lora_A", [config.r, d_in])?;
            let b = take("lora_B", [d_out, config.r])?;
            layers.insert(
                layer,
                LoraLayer::new(a, b, config.scale()).with_dropout(config.lora_dropout as f32),
            );
        }
        if let Some(name) = by_name.keys().next() {
            return Err(bad(format!(
                "tensor `{name}` is not a LoRA matrix of the layers `target_modules` {:?} adapts",
                config.target_modules
            )));
        }
        Self::new(config, layers, cfg)
    }

    /// Writes the adapter as PEFT does (each file to a temporary name, then renamed), the
    /// tensors in f32.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_with_metadata(dir, &std::collections::HashMap::new())
    }

    /// [`Adapter::save`], with `metadata` added to the safetensors header (the trainer records
    /// its step).
    pub fn save_with_metadata(&self, dir: &Path, metadata: &std::collections::HashMap<String, String>) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut tensors = Vec::new();
        for (layer, l) in &self.layers {
            tensors.push((format!("{PEFT_PREFIX}{layer}.lora_A.weight"), l.a.to_dtype(DType::F32)?));
            tensors.push((format!("{PEFT_PREFIX}{layer}.lora_B.weight"), l.b.to_dtype(DType::F32)?));
        }
        let mut metadata = metadata.clone();
        metadata.insert("format".to_string(), "pt".to_string());
        let metadata = Some(metadata);
        let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), metadata)
            .map_err(|e| Error::InvalidConfig(format!("serializing the adapter: {e}")))?;
        write_atomic(&dir.join(ADAPTER_WEIGHTS_FILE), &bytes)?;
        let config =
            serde_json::to_string_pretty(&self.config.to_json()).map_err(|e| Error::InvalidConfig(e.to_string()))?;
        write_atomic(&dir.join(ADAPTER_CONFIG_FILE), config.as_bytes())
    }

    /// Adds each adapted layer's update to its weight among a model's `named_tensors`
    /// ([`crate::Gpt::named_tensors`]'s names: GPT-2's `(in, out)`, the other families' `(out,
    /// in)`).
    pub fn merge_into(&self, tensors: &mut [(String, Tensor)]) -> Result<()> {
        for (layer, l) in &self.layers {
            let name = format!("{layer}.weight");
            let (_, w) = tensors
                .iter_mut()
                .find(|(n, _)| *n == name)
                .ok_or_else(|| Error::InvalidConfig(format!("the model has no tensor `{name}` to merge into")))?;
            let delta = l.delta_weight()?.to_dtype(DType::F32)?;
            // An `nn.Linear`'s weight is the transpose of GPT-2's `Conv1D`'s.
            let delta = match name.starts_with("transformer.") {
                true => delta,
                false => delta.t()?,
            };
            *w = (w.to_dtype(DType::F32)? + delta)?.to_dtype(w.dtype())?;
        }
        Ok(())
    }
}

/// The updates of a family's products from its layers' (see the module's header): for each
/// block, q, k and v's stacked into one of `q + 2 kv` outputs (a layer not adapted adds zero
/// rows), gate and up's likewise, the output projection's and down's as they are.
fn fused(
    layers: &BTreeMap<String, LoraLayer>,
    cfg: &Config,
    scale: f64,
    dropout: f32,
) -> Result<BTreeMap<String, LoraLayer>> {
    let (q, kv, mlp) = (cfg.q_width(), cfg.kv_width(), cfg.mlp_width());
    let mut out = BTreeMap::new();
    for i in 0..cfg.n_layer {
        let [qkv, o, gate_up, down] = block_products(cfg, i);
        let groups: [(String, Vec<(&str, usize)>); 4] = [
            (
                qkv,
                vec![
                    ("self_attn.q_proj", q),
                    ("self_attn.k_proj", kv),
                    ("self_attn.v_proj", kv),
                ],
            ),
            (o, vec![("self_attn.o_proj", cfg.n_embd)]),
            (
                gate_up,
                match cfg.variant.gated_mlp {
                    true => vec![("mlp.gate_proj", mlp), ("mlp.up_proj", mlp)],
                    false => vec![("mlp.up_proj", mlp)],
                },
            ),
            (down, vec![("mlp.down_proj", cfg.n_embd)]),
        ];
        for (product, parts) in groups {
            let total: usize = parts.iter().map(|(_, n)| n).sum();
            let mut row = 0;
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for (part, rows) in &parts {
                if let Some(l) = layers.get(&format!("model.layers.{i}.{part}")) {
                    let r = l.a.dim(0)?;
                    a.push(l.a.clone());
                    let (dtype, device) = (l.b.dtype(), l.b.device());
                    // This part's B in its own rows of the product's outputs, zero elsewhere.
                    let column = Tensor::cat(
                        &[
                            Tensor::zeros((row, r), dtype, device)?,
                            l.b.clone(),
                            Tensor::zeros((total - row - rows, r), dtype, device)?,
                        ],
                        0,
                    )?;
                    b.push(column);
                }
                row += rows;
            }
            if a.is_empty() {
                continue;
            }
            let layer = LoraLayer::new(Tensor::cat(&a, 0)?, Tensor::cat(&b, 1)?, scale).with_dropout(dropout);
            out.insert(product, layer);
        }
    }
    Ok(out)
}
