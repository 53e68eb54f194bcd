//! LoRA adapters on the trainer's side: `gpt-train merge`, which adds an adapter (PEFT's format,
//! [`gpt::lora`]) into its base checkpoint's weights and writes a full checkpoint.

use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use gpt::checkpoint::{GENERATION_CONFIG_FILE, TOKENIZER_CONFIG_FILE};
use gpt::lora::Adapter;
use gpt::Gpt;

/// Writes to `out` the checkpoint `base` with `adapter` merged into its weights (f32), with the
/// base's tokenizer and its `tokenizer_config.json` and `generation_config.json` (the chat
/// template and generation defaults the adapter was trained under). An adapter for another
/// base is an error naming the tensor whose shape differs.
pub fn merge(base: &Path, adapter: &Path, out: &Path) -> Result<Gpt> {
    let (model, tokenizer) = gpt::load_dir(base, DType::F32, &Device::Cpu)?;
    let lora = Adapter::load(adapter, model.config(), DType::F32, &Device::Cpu)
        .with_context(|| format!("--adapter {} on the base {}", adapter.display(), base.display()))?;
    let mut tensors = model.named_tensors()?;
    lora.merge_into(&mut tensors)?;
    let tensors = tensors
        .into_iter()
        .map(|(name, t)| (name.strip_prefix("transformer.").unwrap_or(&name).to_string(), t))
        .collect();
    let merged = Gpt::new(
        VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu),
        model.config(),
    )?;
    gpt::save_dir(out, &merged, &tokenizer, DType::F32)?;
    for file in [TOKENIZER_CONFIG_FILE, GENERATION_CONFIG_FILE] {
        let from = base.join(file);
        if from.is_file() {
            let bytes = std::fs::read(&from).with_context(|| format!("reading {}", from.display()))?;
            gpt::files::write_atomic(&out.join(file), &bytes)?;
        }
    }
    Ok(merged)
}
