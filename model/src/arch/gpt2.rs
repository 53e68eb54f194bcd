//! GPT-2 (`model_type` `gpt2`, `GPT2LMHeadModel`): [`Config`]'s own fields are GPT-2's
//! `config.json`, read and written as they are. Its tensors are named `transformer.wte.weight`,
//! `transformer.h.N.attn.c_attn.weight` (`(in, out)`, q, k and v side by side), ... (see
//! `crate::gpt::weights`).

use crate::config::Config;

pub fn config_from_hf(value: serde_json::Value) -> Result<Config, String> {
    serde_json::from_value(value).map_err(|e| e.to_string())
}

pub fn config_to_hf(cfg: &Config) -> Result<serde_json::Value, String> {
    let mut value = serde_json::to_value(cfg).map_err(|e| e.to_string())?;
    if let Some(map) = value.as_object_mut() {
        map.insert("model_type".into(), "gpt2".into());
        map.insert("architectures".into(), serde_json::json!(["GPT2LMHeadModel"]));
        map.insert("n_ctx".into(), cfg.n_positions.into());
    }
    Ok(value)
}
