//! Generation for one sequence with the KV cache: the reference the server's batched engine is
//! tested against, and the simplest way to use the model from Rust.

use crate::error::Result;
use crate::gpt::{Gpt, LogitsFor, SeqStep};
use crate::sampling::Sampler;

/// Generates up to `max_new` tokens after `prompt`, stopping early at `eos` (not included) or at
/// the context length. Returns the new tokens.
pub fn generate(
    model: &Gpt,
    prompt: &[u32],
    max_new: usize,
    sampler: &mut Sampler,
    eos: Option<u32>,
) -> Result<Vec<u32>> {
    let mut cache = model.new_cache();
    let mut output = Vec::new();
    let mut input = prompt.to_vec();
    while output.len() < max_new && cache.len() + input.len() <= model.config().n_positions {
        let logits = model.forward_step(
            &mut [SeqStep {
                tokens: &input,
                cache: &mut cache,
            }],
            LogitsFor::Last,
        )?;
        let token = sampler.sample(&logits.squeeze(0)?, prompt, &output, &[])?;
        if Some(token) == eos {
            break;
        }
        output.push(token);
        input = vec![token];
    }
    Ok(output)
}
