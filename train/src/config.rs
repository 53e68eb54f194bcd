//! `gpt-train train` flags and the resolved run configuration saved with each checkpoint.
//!
//! Each flag is optional: an explicit flag wins; otherwise, on `--resume`, the value the run was
//! started with; otherwise nanoGPT's `train_shakespeare_char` default. Model-shape flags that
//! disagree with the checkpoint being resumed are an error.

use std::path::PathBuf;

use anyhow::{bail, Result};
use gpt::{Config, PositionEmbedding};
use serde::{Deserialize, Serialize};

use crate::optim::muon::MuonScale;
use crate::optim::OptimizerKind;
use crate::schedule::{Schedule, ScheduleKind};

/// `--recipe`: the defaults of the training settings the flags leave open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Recipe {
    /// nanoGPT's: AdamW, linear warmup and cosine decay.
    #[default]
    Nanogpt,
    /// Muon for the hidden matrices, warmup-stable-decay (30 steps of warmup, the last half
    /// cooling down to 0) at a peak learning rate of 6e-3, and for a new model without `--arch`
    /// Llama's layout (RMSNorm, rotary positions, SwiGLU) with an untied head: what reached
    /// nanoGPT's validation loss soonest, and ended lowest, in the ablation of docs/training.md.
    Modern,
}

/// The settings a recipe chooses when their flags are not given.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecipeDefaults {
    pub optimizer: OptimizerKind,
    pub lr_schedule: ScheduleKind,
    pub learning_rate: f64,
    pub min_lr: f64,
    pub warmup_iters: usize,
    pub cooldown_fraction: f64,
    pub beta2: f64,
}

impl Recipe {
    pub fn defaults(self) -> RecipeDefaults {
        use defaults::*;
        let nanogpt = RecipeDefaults {
            optimizer: OptimizerKind::Adamw,
            lr_schedule: ScheduleKind::Cosine,
            learning_rate: LEARNING_RATE,
            min_lr: MIN_LR,
            warmup_iters: WARMUP_ITERS,
            cooldown_fraction: COOLDOWN_FRACTION,
            beta2: BETA2,
        };
        match self {
            Self::Nanogpt => nanogpt,
            Self::Modern => RecipeDefaults {
                optimizer: OptimizerKind::Muon,
                lr_schedule: ScheduleKind::Wsd,
                learning_rate: 6e-3,
                min_lr: 0.0,
                warmup_iters: 30,
                cooldown_fraction: 0.5,
                ..nanogpt
            },
        }
    }
}

#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// Training data, any number of: UTF-8 text files (a document each), JSON lines (.jsonl, a
    /// document per line), parquet files (a document per row), directories of these, Hub datasets
    /// (hf://datasets/ORG/NAME[@REV][/PATH]), or token files (llm.c's shards, nanoGPT's .bin);
    /// taken from the checkpoint when resuming.
    #[arg(long, num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// Output directory: the latest checkpoint, `best/`, metrics.jsonl, loss.svg, token cache.
    #[arg(long)]
    pub out: PathBuf,
    /// `char`, `bpe:N` (train a byte-level BPE of N tokens on --data), a tokenizer.json (or a
    /// directory holding one), or a Hub model id whose tokenizer to use (e.g. `gpt2`).
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// The field of JSON lines, and the column of parquet files, that holds the text.
    #[arg(long)]
    pub text_field: Option<String>,
    /// How --data is read: auto (by file name: text, .jsonl, .parquet, and .bin token files,
    /// llm.c's when their header says so, else nanoGPT's), text, llmc (llm.c's token shards) or
    /// nanogpt (nanoGPT's uint16 train.bin / val.bin) [default: auto].
    #[arg(long, value_enum)]
    pub data_format: Option<crate::data::token_files::DataFormat>,
    /// Validation text; by default the last --val-fraction of the training tokens.
    #[arg(long, conflicts_with = "val_fraction")]
    pub val_data: Option<PathBuf>,
    /// Share of the training tokens held out for validation, from the end.
    #[arg(long)]
    pub val_fraction: Option<f64>,
    /// auto (a CUDA GPU if this build has CUDA and one answers, else the CPU), cpu, cuda or cuda:N.
    #[arg(long)]
    pub device: Option<String>,
    /// Continue the run checkpointed in --out, from its newest complete checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Fine-tune: start from this GPT-2-layout checkpoint (a directory, a run directory, or a Hub
    /// id such as `gpt2`, found in the shared Hub cache or downloaded), with its config and
    /// tokenizer, as nanoGPT's `init_from`; model flags must agree with it (--dropout may change).
    #[arg(long, conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
    /// Train a LoRA adapter of this rank on the --init-from checkpoint, which stays frozen (no
    /// gradients, no optimizer state), instead of every weight. Checkpoints hold the adapter in
    /// PEFT's format (adapter_config.json, adapter_model.safetensors); `gpt-train merge` makes a
    /// full checkpoint of it.
    #[arg(long)]
    pub lora_r: Option<usize>,
    /// LoRA's alpha: the update is scaled by alpha / r (PEFT's default)
    #[arg(long, requires = "lora_r")]
    pub lora_alpha: Option<f64>,
    /// The layers LoRA adapts, PEFT's target_modules: GPT-2's c_attn, c_proj (both projections),
    /// attn.c_proj, mlp.c_proj, c_fc; the other families' q_proj, k_proj, v_proj, o_proj,
    /// gate_proj, up_proj, down_proj; or all-linear [default: PEFT's, c_attn for GPT-2 and
    /// q_proj,v_proj for the others]
    #[arg(long, value_delimiter = ',', requires = "lora_r")]
    pub lora_targets: Option<Vec<String>>,
    /// Dropout of the LoRA update's input while training (PEFT's lora_dropout; default 0)
    #[arg(long, requires = "lora_r")]
    pub lora_dropout: Option<f64>,
    /// Hold the frozen base in this format while the adapter trains, as QLoRA does (CPU):
    /// `stored` (a GGUF file's own block formats, as gpt-server runs them), q8_0 or q4_0
    /// (quantized at load), f16 or bf16; the products are the inference kernels', the gradient
    /// through the base f32 on its dequantized values [default: f32, the base dequantized]
    #[arg(long, requires = "lora_r", value_parser = parse_lora_base)]
    pub lora_base: Option<String>,
    /// Complete checkpoints kept in OUT/checkpoints, the newest ones.
    #[arg(long)]
    pub keep_last: Option<usize>,
    /// In a job of several ranks (`mpirun -np N`), compare every rank's parameters with rank 0's
    /// every this many steps; 0: only at the start and at each evaluation, before its
    /// checkpoint is saved.
    #[arg(long, default_value_t = 0)]
    pub check_replicas_every: usize,
    /// In a job of several ranks on CPUs, sum the gradients in buckets of this many megabytes
    /// (PyTorch DDP's `bucket_cap_mb`): larger buckets pay MPI's per-call latency less often,
    /// smaller ones need a smaller send buffer.
    #[arg(long, default_value_t = crate::distributed::DEFAULT_BUCKET_MB)]
    pub allreduce_bucket_mb: f64,
    /// In a job of several ranks on CPUs, start summing the gradients during the backward pass,
    /// each as soon as it is final (PyTorch DDP's overlap): on, off, or auto (on when the ranks
    /// span several hosts, where the sum waits on the network; on one host it is work for the
    /// same cores) [default: auto].
    #[arg(long, value_enum)]
    pub overlap_allreduce: Option<Overlap>,
    /// CPU threads (per rank in a job of several); runs are reproducible for a given value (and
    /// --parallel) [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// How the CPU threads share a step: shards (each trains its own rows of the batch, with its
    /// own copy of the gradients: best for small models), ops (every product, attention and
    /// element-wise pass of one forward and backward split over them: one copy of the gradients)
    /// or auto (ops from --n-embd 512 up) [default: auto].
    #[arg(long, value_enum)]
    pub parallel: Option<crate::step::Parallelism>,
    /// Activation checkpointing (Hugging Face's gradient_checkpointing): each block keeps only
    /// its input for the backward pass and runs again there. The activations kept shrink to one
    /// block's, for about one more forward pass of compute; the gradients are the same, bit for
    /// bit. On the CPU's training path (--device cpu, GPT-2's GELU).
    #[arg(long, alias = "gradient-checkpointing")]
    pub activation_checkpointing: bool,
    /// On a CUDA GPU, f32 matrix products in TF32 (tensor cores; PyTorch's `allow_tf32`, which
    /// nanoGPT sets).
    #[arg(long)]
    pub tf32: Option<bool>,
    /// Mixed precision, nanoGPT's `dtype`: bf16 multiplies matrices in bf16 (f32 parameters,
    /// gradients and optimizer state, as `torch.autocast`) [default: f32].
    #[arg(long, value_enum)]
    pub dtype: Option<TrainDtype>,

    /// Model shape: tiny, shakespeare-char (nanoGPT's baby GPT) or gpt2 (GPT-2 small); the flags
    /// below override it.
    #[arg(long)]
    pub preset: Option<String>,
    /// The decoder family to train from scratch at that shape: gpt2, llama, mistral, qwen2,
    /// qwen3, arcee, gemma2, gemma3 (RMSNorm, rotary positions, a gated MLP, or arcee's ungated
    /// squared ReLU, and the family's own choices; saved as that family's checkpoint for
    /// `transformers` and llama.cpp) [default:
    /// gpt2; llama with an untied head under --recipe modern].
    #[arg(long)]
    pub arch: Option<String>,
    /// Key/value heads (grouped-query attention; must divide --n-head) for the families other
    /// than gpt2 [default: --n-head's].
    #[arg(long)]
    pub n_kv_head: Option<usize>,
    /// An output head of its own rather than the token embedding's transpose, for the families
    /// other than gpt2 (a new run; saved with `tie_word_embeddings: false`).
    #[arg(long)]
    pub untied_head: bool,
    /// Start the blocks' output projections (attention's and the MLP's: `c_proj`, `o_proj`,
    /// `down_proj`) at zero, as modded-nanogpt does, so that each block starts as the identity
    /// (a new run).
    #[arg(long)]
    pub zero_init_proj: bool,
    /// Transformer blocks [default: the preset's; shakespeare-char 6].
    #[arg(long)]
    pub n_layer: Option<usize>,
    /// Attention heads per block; must divide --n-embd [default: the preset's; shakespeare-char 6].
    #[arg(long)]
    pub n_head: Option<usize>,
    /// Width of the residual stream [default: the preset's; shakespeare-char 384].
    #[arg(long)]
    pub n_embd: Option<usize>,
    /// Context length (the model's n_positions) and training window [default: the preset's;
    /// shakespeare-char 256].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Dropout probability of the embeddings, attention weights and residual branches
    /// [default: the preset's; shakespeare-char 0.2].
    #[arg(long)]
    pub dropout: Option<f32>,
    /// learned (GPT-2) or sinusoidal (the original transformer) [default: learned].
    #[arg(long)]
    pub position_embedding: Option<String>,
    /// false: no biases in linear layers and LayerNorms (nanoGPT's `bias=False`; kept as zeros)
    /// [default: true].
    #[arg(long)]
    pub bias: Option<bool>,

    /// Sequences per micro-batch.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Ramp the batch up over the first N steps: from --batch-size-start, growing linearly to
    /// --batch-size at step N (rounded down to a multiple of the ranks), as modded-nanogpt's and
    /// GPT-3's batch-size warmups do: early steps, whose gradients point the same way at any
    /// batch, cost less. 0: no ramp [default: 0].
    #[arg(long)]
    pub batch_ramp_iters: Option<usize>,
    /// The batch size the ramp starts from [default: a quarter of --batch-size, at least 1].
    #[arg(long)]
    pub batch_size_start: Option<usize>,
    /// Optimisation steps in all.
    #[arg(long)]
    pub max_iters: Option<usize>,
    /// Peak learning rate, after warm-up.
    #[arg(long)]
    pub learning_rate: Option<f64>,
    /// Learning rate at the end of the decay.
    #[arg(long)]
    pub min_lr: Option<f64>,
    /// Steps of linear warm-up.
    #[arg(long)]
    pub warmup_iters: Option<usize>,
    /// Step at which the cosine schedule reaches --min-lr [default: --max-iters].
    #[arg(long)]
    pub lr_decay_iters: Option<usize>,
    /// Learning-rate schedule (wsd under --recipe modern) [default: cosine].
    #[arg(long, value_enum)]
    pub lr_schedule: Option<ScheduleKind>,
    /// The share of --lr-decay-iters that --lr-schedule wsd spends cooling down to --min-lr.
    #[arg(long)]
    pub cooldown_fraction: Option<f64>,
    /// The update rule (muon under --recipe modern) [default: adamw].
    #[arg(long, value_enum)]
    pub optimizer: Option<OptimizerKind>,
    /// Muon's peak learning rate, for the hidden matrices (unset: --learning-rate with
    /// --muon-scale match-adamw, 0.02 with original).
    #[arg(long)]
    pub muon_lr: Option<f64>,
    /// Muon's momentum (Nesterov's).
    #[arg(long)]
    pub muon_momentum: Option<f64>,
    /// How Muon scales its orthogonalised update of an (out, in) matrix: match-adamw (Moonshot's
    /// 0.2 sqrt(max(out, in)), so that AdamW's learning rate and weight decay carry over) or
    /// original (Keller Jordan's sqrt(max(1, out / in))) [default: match-adamw].
    #[arg(long, value_enum)]
    pub muon_scale: Option<MuonScale>,
    /// The peak learning rate of the token (and learned position) embeddings (unset:
    /// --learning-rate).
    #[arg(long)]
    pub embedding_lr: Option<f64>,
    /// The peak learning rate of an untied output head (unset: --learning-rate).
    #[arg(long)]
    pub head_lr: Option<f64>,
    /// End the run at the first evaluation whose validation loss is at or below this (its
    /// checkpoint saved), so that the time to a loss is read from the run itself.
    #[arg(long)]
    pub stop_at_val_loss: Option<f64>,
    /// The defaults of the training settings: nanogpt (nanoGPT's AdamW and cosine schedule) or
    /// modern (Muon, a warmup-stable-decay schedule, a higher learning rate; docs/training.md's ablation);
    /// each flag still overrides it [default: nanogpt].
    #[arg(long, value_enum)]
    pub recipe: Option<Recipe>,
    /// AdamW's decoupled weight decay, on matrices only.
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// AdamW's first-moment decay.
    #[arg(long)]
    pub beta1: Option<f64>,
    /// AdamW's second-moment decay.
    #[arg(long)]
    pub beta2: Option<f64>,
    /// Clip gradients to this global norm; 0 disables.
    #[arg(long)]
    pub grad_clip: Option<f64>,
    /// Label smoothing ε of the training loss, as PyTorch's `cross_entropy(label_smoothing=ε)` (the
    /// original transformer used 0.1); evaluation stays plain NLL.
    #[arg(long)]
    pub label_smoothing: Option<f64>,
    /// Micro-batches whose gradients are summed into each step.
    #[arg(long)]
    pub gradient_accumulation_steps: Option<usize>,
    /// Steps between evaluations (each saves a checkpoint).
    #[arg(long)]
    pub eval_interval: Option<usize>,
    /// Batches per split in each evaluation.
    #[arg(long)]
    pub eval_iters: Option<usize>,
    /// Steps between lines in metrics.jsonl.
    #[arg(long)]
    pub log_interval: Option<usize>,
    /// Seed of the initial weights, the batches and the dropout masks.
    #[arg(long)]
    pub seed: Option<u64>,
}

/// The defaults of a new run's settings, each written once: [`TrainArgs::resolve`] and the
/// trainer apply them, and `--help` states them ([`with_stated_defaults`]). (The model's shape
/// defaults to the preset's, in `gpt::Config::preset`.)
pub mod defaults {
    pub const TEXT_FIELD: &str = "text";
    pub const VAL_FRACTION: f64 = 0.1;
    pub const TOKENIZER: &str = "char";
    pub const DEVICE: &str = "auto";
    pub const KEEP_LAST: usize = 1;
    pub const TF32: bool = true;
    pub const PRESET: &str = "shakespeare-char";
    pub const BATCH_SIZE: usize = 64;
    pub const MAX_ITERS: usize = 5000;
    pub const LEARNING_RATE: f64 = 1e-3;
    pub const MIN_LR: f64 = 1e-4;
    pub const WARMUP_ITERS: usize = 100;
    pub const COOLDOWN_FRACTION: f64 = 0.4;
    pub const MUON_MOMENTUM: f64 = 0.95;
    /// Keller Jordan's learning rate for Muon's original scale.
    pub const MUON_ORIGINAL_LR: f64 = 0.02;
    pub const WEIGHT_DECAY: f64 = 0.1;
    pub const BETA1: f64 = 0.9;
    pub const BETA2: f64 = 0.99;
    pub const GRAD_CLIP: f64 = 1.0;
    pub const LABEL_SMOOTHING: f64 = 0.0;
    pub const GRADIENT_ACCUMULATION_STEPS: usize = 1;
    pub const EVAL_INTERVAL: usize = 250;
    pub const EVAL_ITERS: usize = 200;
    pub const LOG_INTERVAL: usize = 10;
    pub const SEED: u64 = 1337;
    /// PEFT's defaults: alpha 8, and `c_attn` for GPT-2.
    pub const LORA_ALPHA: f64 = 8.0;
    pub const LORA_TARGETS: &str = "c_attn";
    pub const LORA_FAMILY_TARGETS: &str = "q_proj,v_proj";
}

/// `command` with each of [`defaults`] stated at the end of its flag's help in the `train`
/// subcommand, as clap writes a default (`[default: 0.001]`).
pub fn with_stated_defaults(command: clap::Command) -> clap::Command {
    use defaults::*;
    let stated: [(&str, String); 25] = [
        ("text_field", TEXT_FIELD.to_string()),
        ("val_fraction", VAL_FRACTION.to_string()),
        ("device", DEVICE.to_string()),
        ("keep_last", KEEP_LAST.to_string()),
        ("tf32", TF32.to_string()),
        ("preset", PRESET.to_string()),
        ("batch_size", BATCH_SIZE.to_string()),
        ("max_iters", MAX_ITERS.to_string()),
        ("learning_rate", LEARNING_RATE.to_string()),
        ("min_lr", MIN_LR.to_string()),
        ("warmup_iters", WARMUP_ITERS.to_string()),
        ("cooldown_fraction", COOLDOWN_FRACTION.to_string()),
        ("muon_momentum", MUON_MOMENTUM.to_string()),
        ("weight_decay", WEIGHT_DECAY.to_string()),
        ("beta1", BETA1.to_string()),
        ("beta2", BETA2.to_string()),
        ("grad_clip", GRAD_CLIP.to_string()),
        ("label_smoothing", LABEL_SMOOTHING.to_string()),
        ("gradient_accumulation_steps", GRADIENT_ACCUMULATION_STEPS.to_string()),
        ("eval_interval", EVAL_INTERVAL.to_string()),
        ("eval_iters", EVAL_ITERS.to_string()),
        ("log_interval", LOG_INTERVAL.to_string()),
        ("seed", SEED.to_string()),
        ("lora_alpha", LORA_ALPHA.to_string()),
        ("lora_targets", LORA_TARGETS.to_string()),
    ];
    command.mut_subcommand("train", |mut train| {
        for (id, value) in stated {
            train = train.mut_arg(id, |arg| {
                let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
                arg.help(format!("{help} [default: {value}]"))
            });
        }
        train
    })
}

/// `--overlap-allreduce`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Overlap {
    #[default]
    Auto,
    On,
    Off,
}

/// `--dtype`: the precision of training's matrix products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TrainDtype {
    /// Everything in f32.
    #[default]
    F32,
    /// Matrix products in bf16, parameters, gradients and optimizer state in f32.
    Bf16,
}

impl TrainDtype {
    pub fn autocast(self) -> gpt::Autocast {
        match self {
            TrainDtype::F32 => gpt::Autocast::Off,
            TrainDtype::Bf16 => gpt::Autocast::Bf16,
        }
    }
}

/// The model's config in trainer_state.json: its family's `config.json` object (GPT-2's fields
/// as they were; a family's own, which hold what sets it apart), with the dropout probabilities
/// beside it (a family's `config.json` has none).
mod model_config {
    use gpt::Config;
    use serde::{de, ser, Deserialize, Deserializer, Serialize, Serializer};

    const DROPOUTS: [&str; 3] = ["resid_pdrop", "embd_pdrop", "attn_pdrop"];

    pub fn serialize<S: Serializer>(cfg: &Config, s: S) -> Result<S::Ok, S::Error> {
        let mut value = cfg.to_hf_value().map_err(ser::Error::custom)?;
        if let Some(map) = value.as_object_mut() {
            for (key, p) in DROPOUTS
                .into_iter()
                .zip([cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop])
            {
                map.insert(key.into(), p.into());
            }
        }
        value.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Config, D::Error> {
        let value = serde_json::Value::deserialize(d)?;
        let mut cfg = gpt::arch::config_from_hf(value.clone()).map_err(de::Error::custom)?;
        let p = |key: &str| value.get(key).and_then(|v| v.as_f64()).map(|p| p as f32);
        if let (Some(r), Some(e), Some(a)) = (p(DROPOUTS[0]), p(DROPOUTS[1]), p(DROPOUTS[2])) {
            (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop) = (r, e, a);
        }
        Ok(cfg)
    }
}

/// Everything a run was started with: saved in trainer_state.json, read back by --resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub data: Vec<PathBuf>,
    pub val_data: Option<PathBuf>,
    /// (Absent from runs saved before it existed: `text`.)
    #[serde(default = "default_text_field")]
    pub text_field: String,
    #[serde(default)]
    pub data_format: crate::data::token_files::DataFormat,
    pub val_fraction: f64,
    pub tokenizer: String,
    pub device: String,
    #[serde(with = "model_config")]
    pub model: Config,
    pub batch_size: usize,
    /// (Absent from runs saved before it existed: none.)
    #[serde(default)]
    pub batch_ramp: Option<BatchRamp>,
    pub max_iters: usize,
    pub learning_rate: f64,
    pub min_lr: f64,
    pub warmup_iters: usize,
    pub lr_decay_iters: usize,
    pub lr_schedule: ScheduleKind,
    /// (Absent from runs saved before these existed: AdamW, nanoGPT's recipe.)
    #[serde(default = "default_cooldown_fraction")]
    pub cooldown_fraction: f64,
    #[serde(default)]
    pub recipe: Recipe,
    #[serde(default)]
    pub optimizer: OptimizerKind,
    #[serde(default)]
    pub muon_lr: Option<f64>,
    #[serde(default = "default_muon_momentum")]
    pub muon_momentum: f64,
    #[serde(default)]
    pub muon_scale: MuonScale,
    #[serde(default)]
    pub embedding_lr: Option<f64>,
    #[serde(default)]
    pub head_lr: Option<f64>,
    #[serde(default)]
    pub stop_at_val_loss: Option<f64>,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub grad_clip: f64,
    /// (Absent from runs saved before it existed: 0.)
    #[serde(default)]
    pub label_smoothing: f64,
    /// The checkpoint the run was fine-tuned from, if any.
    #[serde(default)]
    pub init_from: Option<PathBuf>,
    /// A LoRA adapter trained on `init_from`, frozen, instead of every weight.
    #[serde(default)]
    pub lora: Option<LoraRun>,
    pub gradient_accumulation_steps: usize,
    pub eval_interval: usize,
    pub eval_iters: usize,
    pub log_interval: usize,
    pub seed: u64,
}

/// `--batch-ramp-iters` and `--batch-size-start`: the batch grows from `start` sequences to the
/// run's `--batch-size` over the first `iters` steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchRamp {
    pub start: usize,
    pub iters: usize,
}

impl BatchRamp {
    /// [`RunConfig::batch_at`] for a run of `batch_size` sequences a micro-batch.
    pub fn batch_at(self, batch_size: usize, step: usize, ranks: usize) -> usize {
        if step >= self.iters {
            return batch_size;
        }
        let (start, ranks) = (self.start.min(batch_size), ranks.max(1));
        let b = start + (batch_size - start) * step / self.iters;
        (b / ranks * ranks).max(ranks).min(batch_size) // not clamp: it panics if ranks > batch_size
    }
}

/// A LoRA run's adapter settings (`--lora-r`, `--lora-alpha`, `--lora-targets`,
/// `--lora-dropout`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraRun {
    pub r: usize,
    pub alpha: f64,
    pub targets: Vec<String>,
    #[serde(default)]
    pub dropout: f64,
    /// `--lora-base`: the format the frozen base is held in (none: f32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
}

/// `--lora-base`: `stored` or a weight format.
fn parse_lora_base(s: &str) -> std::result::Result<String, String> {
    match s {
        "stored" => Ok(s.to_string()),
        _ => s
            .parse::<gpt::WeightFormat>()
            .map(|f| f.to_string())
            .map_err(|e| format!("{e} (or stored)")),
    }
}

impl LoraRun {
    /// PEFT's settings for it, on the base `base` (as named on the command line).
    pub fn peft_config(&self, base: Option<&std::path::Path>) -> gpt::lora::LoraConfig {
        gpt::lora::LoraConfig {
            r: self.r,
            lora_alpha: self.alpha,
            lora_dropout: self.dropout,
            target_modules: self.targets.clone(),
            layers_to_transform: None,
            use_rslora: false,
            base_model_name_or_path: base.map(|b| b.display().to_string()),
        }
    }
}

fn default_text_field() -> String {
    defaults::TEXT_FIELD.into()
}

fn default_cooldown_fraction() -> f64 {
    defaults::COOLDOWN_FRACTION
}

fn default_muon_momentum() -> f64 {
    defaults::MUON_MOMENTUM
}

impl RunConfig {
    /// How the run's documents are read.
    pub fn reading(&self) -> crate::data::Reading {
        crate::data::Reading {
            text_field: self.text_field.clone(),
            format: self.data_format,
        }
    }
}

fn parse_position_embedding(s: &str) -> Result<PositionEmbedding> {
    match s {
        "learned" => Ok(PositionEmbedding::Learned),
        "sinusoidal" => Ok(PositionEmbedding::Sinusoidal),
        other => bail!("--position-embedding {other:?}: expected learned or sinusoidal"),
    }
}

impl TrainArgs {
    /// The model's shape: from the preset and flags, or checked against `base`: the checkpoint
    /// being resumed, or with `init_from` the one being fine-tuned (whose dropout may change).
    fn model_config(&self, vocab_size: usize, saved: Option<&Config>, init_from: bool) -> Result<Config> {
        let what = if init_from {
            format!(
                "the --init-from checkpoint {}",
                self.init_from.as_deref().unwrap_or(std::path::Path::new("")).display()
            )
        } else {
            "the checkpoint being resumed".to_string()
        };
        let position = self
            .position_embedding
            .as_deref()
            .map(parse_position_embedding)
            .transpose()?;
        if let Some(saved) = saved {
            let dropout = if init_from {
                None
            } else {
                self.dropout.map(|v| v.to_string())
            };
            // Fine-tuning on shorter windows than the checkpoint's context: its first positions,
            // as nanoGPT's `crop_block_size` does.
            let cropped = match (init_from, self.block_size) {
                (true, Some(b)) if b <= saved.n_positions => Some(b),
                _ => None,
            };
            let checks: [(&str, Option<String>, String); 7] = [
                ("--bias", self.bias.map(|v| v.to_string()), saved.bias.to_string()),
                (
                    "--n-layer",
                    self.n_layer.map(|v| v.to_string()),
                    saved.n_layer.to_string(),
                ),
                ("--n-head", self.n_head.map(|v| v.to_string()), saved.n_head.to_string()),
                ("--n-embd", self.n_embd.map(|v| v.to_string()), saved.n_embd.to_string()),
                (
                    "--block-size",
                    self.block_size.filter(|_| cropped.is_none()).map(|v| v.to_string()),
                    saved.n_positions.to_string(),
                ),
                ("--dropout", dropout, saved.resid_pdrop.to_string()),
                (
                    "--position-embedding",
                    position.map(|p| format!("{p:?}")),
                    format!("{:?}", saved.position_embedding),
                ),
            ];
            for (flag, given, have) in checks {
                if let Some(given) = given {
                    if given != have {
                        bail!("{flag} {given} disagrees with {what} ({have})");
                    }
                }
            }
            if let Some(preset) = &self.preset {
                let p = Config::preset(preset, Some(vocab_size))?;
                if self.n_layer.is_none()
                    && (p.n_layer, p.n_head, p.n_embd) != (saved.n_layer, saved.n_head, saved.n_embd)
                {
                    bail!("--preset {preset} disagrees with {what}");
                }
            }
            if saved.vocab_size < vocab_size {
                bail!(
                    "the tokenizer has {vocab_size} tokens but the model of {what} has vocab_size {}",
                    saved.vocab_size
                );
            }
            let mut cfg = saved.clone();
            cfg.n_positions = cropped.unwrap_or(cfg.n_positions);
            if let (true, Some(p)) = (init_from, self.dropout) {
                (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop) = (p, p, p);
            }
            return Ok(cfg);
        }
        let mut cfg = Config::preset(self.preset.as_deref().unwrap_or(defaults::PRESET), Some(vocab_size))?;
        cfg.n_layer = self.n_layer.unwrap_or(cfg.n_layer);
        cfg.n_head = self.n_head.unwrap_or(cfg.n_head);
        cfg.n_embd = self.n_embd.unwrap_or(cfg.n_embd);
        cfg.n_positions = self.block_size.unwrap_or(cfg.n_positions);
        if let Some(p) = self.dropout {
            (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop) = (p, p, p);
        }
        cfg.position_embedding = position.unwrap_or(cfg.position_embedding);
        cfg.bias = self.bias.unwrap_or(cfg.bias);
        // `--recipe modern` without `--arch` (nor GPT-2's own flags): Llama's layout with an
        // untied head, what the ablation of docs/training.md measured best.
        let modern_default =
            self.recipe == Some(Recipe::Modern) && self.arch.is_none() && position.is_none() && self.bias.is_none();
        let arch = match modern_default {
            true => Some("llama"),
            false => self.arch.as_deref(),
        };
        let untied_head = self.untied_head || modern_default;
        if let Some(arch) = arch.filter(|a| *a != "gpt2") {
            if position.is_some() || self.bias.is_some() {
                bail!("--position-embedding and --bias are GPT-2's; --arch {arch} has rotary positions and no biases");
            }
            let family = gpt::arch::Family::from_model_type(arch)
                .or_else(|| (arch == "gemma3").then_some(gpt::arch::Family::Gemma3))
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "--arch {arch} is not a family (supported: {})",
                        gpt::arch::Family::supported().replace("gemma3_text", "gemma3")
                    )
                })?;
            cfg = gpt::arch::from_scratch(family, &cfg, self.n_kv_head)?;
            cfg.tie_word_embeddings = !untied_head;
        } else if untied_head {
            bail!("--untied-head: GPT-2 ties its head to the token embedding; pass --arch llama, qwen3, ...");
        } else if self.n_kv_head.is_some() {
            bail!("--n-kv-head needs an --arch with grouped-query attention (llama, qwen3, gemma3, ...)");
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Resolves every setting (see the module docs). `init_from` is the config of the checkpoint a
    /// new run fine-tunes.
    pub fn resolve(
        &self,
        vocab_size: usize,
        saved: Option<&RunConfig>,
        init_from: Option<&Config>,
    ) -> Result<RunConfig> {
        macro_rules! pick {
            ($field:ident, $default:expr) => {
                self.$field
                    .clone()
                    .or(saved.map(|s| s.$field.clone()))
                    .unwrap_or($default)
            };
        }
        let model = match (saved, init_from) {
            (Some(s), _) => self.model_config(vocab_size, Some(&s.model), false)?,
            (None, Some(base)) => self.model_config(vocab_size, Some(base), true)?,
            (None, None) => self.model_config(vocab_size, None, false)?,
        };
        let data = match (&self.data[..], saved) {
            ([], Some(s)) => s.data.clone(),
            ([], None) => bail!("no training data: pass --data FILE"),
            (files, _) => files.to_vec(),
        };
        let max_iters = pick!(max_iters, defaults::MAX_ITERS);
        let batch_size = pick!(batch_size, defaults::BATCH_SIZE);
        let recipe = pick!(recipe, Recipe::Nanogpt);
        let r = recipe.defaults();
        let optimizer = pick!(optimizer, r.optimizer);
        let muon_scale = pick!(muon_scale, MuonScale::default());
        let run = RunConfig {
            data,
            val_data: self.val_data.clone().or(saved.and_then(|s| s.val_data.clone())),
            val_fraction: pick!(val_fraction, defaults::VAL_FRACTION),
            text_field: pick!(text_field, default_text_field()),
            data_format: pick!(data_format, Default::default()),
            tokenizer: pick!(tokenizer, defaults::TOKENIZER.to_string()),
            device: pick!(device, defaults::DEVICE.to_string()),
            batch_size,
            batch_ramp: self.batch_ramp(batch_size, saved)?,
            max_iters,
            learning_rate: pick!(learning_rate, r.learning_rate),
            min_lr: pick!(min_lr, r.min_lr),
            warmup_iters: pick!(warmup_iters, r.warmup_iters),
            lr_decay_iters: pick!(lr_decay_iters, max_iters),
            lr_schedule: pick!(lr_schedule, r.lr_schedule),
            cooldown_fraction: self
                .cooldown_fraction
                .or(saved.map(|s| s.cooldown_fraction))
                .unwrap_or(r.cooldown_fraction),
            recipe,
            optimizer,
            muon_lr: self.muon_lr.or(saved.and_then(|s| s.muon_lr)),
            muon_momentum: self
                .muon_momentum
                .or(saved.map(|s| s.muon_momentum))
                .unwrap_or(defaults::MUON_MOMENTUM),
            muon_scale,
            embedding_lr: self.embedding_lr.or(saved.and_then(|s| s.embedding_lr)),
            head_lr: self.head_lr.or(saved.and_then(|s| s.head_lr)),
            stop_at_val_loss: self.stop_at_val_loss.or(saved.and_then(|s| s.stop_at_val_loss)),
            weight_decay: pick!(weight_decay, defaults::WEIGHT_DECAY),
            beta1: pick!(beta1, defaults::BETA1),
            beta2: pick!(beta2, r.beta2),
            grad_clip: pick!(grad_clip, defaults::GRAD_CLIP),
            label_smoothing: pick!(label_smoothing, defaults::LABEL_SMOOTHING),
            init_from: self.init_from.clone().or(saved.and_then(|s| s.init_from.clone())),
            lora: self.lora(saved, &model)?,
            gradient_accumulation_steps: pick!(gradient_accumulation_steps, defaults::GRADIENT_ACCUMULATION_STEPS),
            eval_interval: pick!(eval_interval, defaults::EVAL_INTERVAL),
            eval_iters: pick!(eval_iters, defaults::EVAL_ITERS),
            log_interval: pick!(log_interval, defaults::LOG_INTERVAL),
            seed: pick!(seed, defaults::SEED),
            model,
        };
        run.validate()?;
        Ok(run)
    }
}

impl TrainArgs {
    /// The batch ramp: from the flags (`--batch-size-start` alone is an error: it starts no
    /// ramp), else the resumed run's.
    fn batch_ramp(&self, batch_size: usize, saved: Option<&RunConfig>) -> Result<Option<BatchRamp>> {
        let iters = match self.batch_ramp_iters {
            Some(iters) => iters,
            None if self.batch_size_start.is_some() => {
                bail!("--batch-size-start starts a ramp: pass --batch-ramp-iters N (the steps it lasts)")
            }
            None => return Ok(saved.and_then(|s| s.batch_ramp)),
        };
        if iters == 0 {
            return Ok(None);
        }
        let start = self.batch_size_start.unwrap_or((batch_size / 4).max(1));
        if start == 0 || start > batch_size {
            bail!("--batch-size-start {start}: the ramp starts at 1 to --batch-size ({batch_size}) sequences");
        }
        Ok(Some(BatchRamp { start, iters }))
    }

    /// The LoRA settings: from the flags, or the resumed run's (which the flags may not change:
    /// its adapter has that shape).
    fn lora(&self, saved: Option<&RunConfig>, model: &Config) -> Result<Option<LoraRun>> {
        // PEFT's defaults: GPT-2's c_attn; q_proj and v_proj for the Llama layouts and Gemma.
        let default = match model.is_gpt2_shaped() {
            true => defaults::LORA_TARGETS,
            false => defaults::LORA_FAMILY_TARGETS,
        };
        let flags = self.lora_r.map(|r| LoraRun {
            r,
            alpha: self.lora_alpha.unwrap_or(defaults::LORA_ALPHA),
            targets: self
                .lora_targets
                .clone()
                .unwrap_or_else(|| default.split(',').map(str::to_string).collect()),
            dropout: self.lora_dropout.unwrap_or(0.0),
            base: self.lora_base.clone(),
        });
        let Some(saved) = saved else {
            if flags.is_some() && self.init_from.is_none() {
                bail!("--lora-r trains an adapter on a base model: pass it with --init-from CHECKPOINT");
            }
            return Ok(flags);
        };
        // A resume without `--lora-base` keeps the run's.
        let flags = flags.map(|f| LoraRun {
            base: f.base.or_else(|| saved.lora.as_ref().and_then(|l| l.base.clone())),
            ..f
        });
        match (flags, &saved.lora) {
            (None, saved) => Ok(saved.clone()),
            (Some(flags), Some(saved)) if flags == *saved => Ok(Some(flags)),
            (Some(flags), Some(saved)) => bail!(
                "the run being resumed trains a LoRA adapter of rank {}, alpha {}, dropout {} on {:?} \
                 (base {}); --lora-r {} --lora-alpha {} --lora-dropout {} --lora-targets {:?} (--lora-base {}) \
                 would change it",
                saved.r,
                saved.alpha,
                saved.dropout,
                saved.targets,
                saved.base.as_deref().unwrap_or("f32"),
                flags.r,
                flags.alpha,
                flags.dropout,
                flags.targets,
                flags.base.as_deref().unwrap_or("f32")
            ),
            (Some(_), None) => bail!("--lora-r: the run being resumed trains every weight, not an adapter"),
        }
    }
}

impl RunConfig {
    fn validate(&self) -> Result<()> {
        for (flag, v) in [
            ("--batch-size", self.batch_size),
            ("--gradient-accumulation-steps", self.gradient_accumulation_steps),
            ("--eval-interval", self.eval_interval),
            ("--eval-iters", self.eval_iters),
            ("--log-interval", self.log_interval),
        ] {
            if v == 0 {
                bail!("{flag} must be at least 1");
            }
        }
        for (flag, v) in [("--learning-rate", self.learning_rate), ("--min-lr", self.min_lr)] {
            if !(v >= 0.0 && v.is_finite()) {
                bail!("{flag} must be a non-negative number, got {v}");
            }
        }
        for (flag, v) in [("--beta1", self.beta1), ("--beta2", self.beta2)] {
            if !(0.0..1.0).contains(&v) {
                bail!("{flag} must be in [0, 1), got {v}");
            }
        }
        for (flag, v) in [
            ("--muon-lr", self.muon_lr),
            ("--embedding-lr", self.embedding_lr),
            ("--head-lr", self.head_lr),
        ] {
            if let Some(v) = v.filter(|v| !(*v >= 0.0 && v.is_finite())) {
                bail!("{flag} must be a non-negative number, got {v}");
            }
        }
        if !(0.0..=1.0).contains(&self.cooldown_fraction) {
            bail!("--cooldown-fraction must be in [0, 1], got {}", self.cooldown_fraction);
        }
        if !(0.0..1.0).contains(&self.muon_momentum) {
            bail!("--muon-momentum must be in [0, 1), got {}", self.muon_momentum);
        }
        if self.optimizer == OptimizerKind::Muon && self.lora.is_some() {
            bail!("--optimizer muon trains whole matrices; a LoRA adapter (--lora-r) trains with adamw");
        }
        if let Some(v) = self.stop_at_val_loss.filter(|v| !v.is_finite()) {
            bail!("--stop-at-val-loss must be a number, got {v}");
        }
        if self.weight_decay < 0.0 || self.grad_clip < 0.0 {
            bail!("--weight-decay and --grad-clip must not be negative");
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            bail!("--label-smoothing must be in [0, 1), got {}", self.label_smoothing);
        }
        Ok(())
    }

    pub fn schedule(&self) -> Schedule {
        Schedule {
            kind: self.lr_schedule,
            learning_rate: self.learning_rate,
            min_lr: self.min_lr,
            warmup_iters: self.warmup_iters,
            lr_decay_iters: self.lr_decay_iters,
            cooldown_fraction: self.cooldown_fraction,
            d_model: self.model.n_embd,
        }
    }

    /// Muon's peak learning rate: `--muon-lr`, else AdamW's under Moonshot's scale and Keller
    /// Jordan's 0.02 under the original one.
    pub fn muon_lr(&self) -> f64 {
        self.muon_lr.unwrap_or(match self.muon_scale {
            MuonScale::MatchAdamw => self.learning_rate,
            MuonScale::Original => defaults::MUON_ORIGINAL_LR,
        })
    }

    pub fn block_size(&self) -> usize {
        self.model.n_positions
    }

    /// Sequences per micro-batch at `step` among `ranks` (the batch ramp's, else `batch_size`):
    /// along the ramp `start + (batch_size - start) · step / iters`, rounded down to a multiple of
    /// `ranks` (at least `ranks`), so that every rank trains an equal share.
    pub fn batch_at(&self, step: usize, ranks: usize) -> usize {
        self.batch_ramp
            .map_or(self.batch_size, |ramp| ramp.batch_at(self.batch_size, step, ranks))
    }

    /// Tokens of one step at `step` (every micro-batch, every rank).
    pub fn tokens_at(&self, step: usize, ranks: usize) -> usize {
        self.batch_at(step, ranks) * self.block_size() * self.gradient_accumulation_steps
    }
}

#[cfg(test)]
mod tests {
    use super::BatchRamp;

    #[test]
    fn the_batch_ramps_linearly_to_the_full_batch_in_multiples_of_the_ranks() {
        let ramp = BatchRamp { start: 4, iters: 8 };
        let one: Vec<usize> = (0..10).map(|s| ramp.batch_at(12, s, 1)).collect();
        assert_eq!(one, [4, 5, 6, 7, 8, 9, 10, 11, 12, 12]);
        let three: Vec<usize> = (0..10).map(|s| ramp.batch_at(12, s, 3)).collect();
        assert_eq!(three, [3, 3, 6, 6, 6, 9, 9, 9, 12, 12]);
        // A start above the ranks' share still gives every rank a row.
        assert_eq!(BatchRamp { start: 1, iters: 4 }.batch_at(8, 0, 2), 2);
        assert_eq!(BatchRamp { start: 12, iters: 8 }.batch_at(12, 3, 1), 12);
    }
}
