//! Batch-1 greedy decoding with and without speculation, side by side: plain `gpt::generate`,
//! `gpt::speculative::generate` with the draft model and with n-grams, on the same prompts, each
//! prompt's runs interleaved (plain, draft, n-gram; `ROUNDS` times), the time of each summed over
//! prompts and rounds. Every speculative output is checked against the plain one (greedy: the
//! same tokens).
//!
//! Prompts: `PROMPTS` (default 8) windows of validation text (the last 10% of the corpus), and
//! as many "quoting" ones: a window, then its first quarter again (the model copies what it has
//! read, and n-grams find it).
//!
//! `cargo bench -p gpt --bench speculative` (TARGET=weights DRAFT=weights/draft K=6 MAX_NEW=192
//! ROUNDS=3 THREADS: candle's threads, default all).

mod common;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use candle_core::Device;
use gpt::speculative::{self, Draft, Proposer, Stats};
use gpt::{Gpt, Sampler, SamplingParams};

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.into())
}

fn main() -> anyhow::Result<()> {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let target_dir = PathBuf::from(env_or("TARGET", &repo.join("weights").to_string_lossy()));
    let draft_dir = PathBuf::from(env_or("DRAFT", &repo.join("weights/draft").to_string_lossy()));
    let k: usize = env_or("K", "6").parse().context("K")?;
    let max_new: usize = env_or("MAX_NEW", "192").parse().context("MAX_NEW")?;
    let rounds: usize = env_or("ROUNDS", "3").parse().context("ROUNDS")?;
    let n_prompts: usize = env_or("PROMPTS", "8").parse().context("PROMPTS")?;
    let (model, tok) = gpt::load_dir_as(&target_dir, None, &Device::Cpu)?;
    let (draft, _) = gpt::load_dir_as(&draft_dir, None, &Device::Cpu)?;
    println!(
        "target {} ({} parameters, {:?}), draft {} ({} parameters), k {k}, {max_new} new tokens, {rounds} rounds, {} threads",
        target_dir.display(),
        model.num_parameters(),
        model.weight_format(),
        draft_dir.display(),
        draft.num_parameters(),
        candle_core::utils::get_num_threads()
    );
    step_costs(&model, k)?;
    let text = std::fs::read_to_string(repo.join("data/tinyshakespeare.txt"))?;
    let chars: Vec<char> = text.chars().collect();
    let val = &chars[chars.len() * 9 / 10..];
    let context = model.config().n_positions;
    let window = (context - max_new).min(128);
    let mut plain_prompts = Vec::new();
    let mut quoting = Vec::new();
    for i in 0..n_prompts {
        let at = i * (val.len() - window) / n_prompts.max(1);
        let s: String = val[at..at + window].iter().collect();
        let head: String = val[at..at + window / 4].iter().collect();
        quoting.push(tok.encode(&format!("{}\n\n{head}", &s[..s.len() - window / 4 - 2]))?);
        plain_prompts.push(tok.encode(&s)?);
    }
    for (kind, prompts) in [("plain prompts", &plain_prompts), ("quoting prompts", &quoting)] {
        let mut secs = [0.0f64; 3];
        let mut tokens = [0usize; 3];
        let mut stats = [Stats::default(); 2];
        for prompt in prompts {
            let budget = max_new.min(context - prompt.len());
            for _ in 0..rounds {
                let start = Instant::now();
                let plain = gpt::generate(&model, prompt, budget, &mut greedy(), None)?;
                secs[0] += start.elapsed().as_secs_f64();
                tokens[0] += plain.len();
                for (i, proposer) in [Proposer::Draft(Draft::new(&draft)), Proposer::NGram]
                    .into_iter()
                    .enumerate()
                {
                    let (out, s) = run(&model, proposer, k, prompt, budget, &mut secs[i + 1])?;
                    anyhow::ensure!(out == plain, "{kind}: speculative output differs from plain");
                    tokens[i + 1] += out.len();
                    stats[i].checks += s.checks;
                    stats[i].proposed += s.proposed;
                    stats[i].accepted += s.accepted;
                }
            }
        }
        let rate = |i: usize| tokens[i] as f64 / secs[i];
        println!("{kind}: plain {:.1} tok/s", rate(0));
        for (i, name) in ["draft", "ngram"].into_iter().enumerate() {
            let s = stats[i];
            println!(
                "{kind}: {name} {:.1} tok/s = {:.2}x plain; {:.0}% of {} proposed accepted, {:.2} tokens per model step",
                rate(i + 1),
                rate(i + 1) / rate(0),
                100.0 * s.accepted as f64 / s.proposed.max(1) as f64,
                s.proposed,
                tokens[i + 1] as f64 / (tokens[i + 1] - s.accepted).max(1) as f64,
            );
        }
    }
    Ok(())
}

/// What a check costs: the model's step over 1 to k + 1 new tokens (LogitsFor::All) after 128
/// cached positions, against the one-token decode step (medians of 50).
fn step_costs(model: &Gpt, k: usize) -> anyhow::Result<()> {
    let mut cache = model.new_cache();
    let prompt: Vec<u32> = (0..128).map(|i| (i * 7 % 60) as u32).collect();
    model.forward_step(
        &mut [gpt::SeqStep {
            tokens: &prompt,
            cache: &mut cache,
        }],
        gpt::LogitsFor::Last,
    )?;
    let mut costs = Vec::new();
    for rows in 1..=k + 1 {
        let tokens: Vec<u32> = (0..rows as u32).collect();
        let secs = common::median_secs(50, || {
            model.forward_step(
                &mut [gpt::SeqStep {
                    tokens: &tokens,
                    cache: &mut cache,
                }],
                gpt::LogitsFor::All,
            )?;
            cache.truncate(128)?;
            Ok(())
        })?;
        costs.push(format!("{rows}: {:.3} ms", secs * 1e3));
    }
    println!("a step over n new tokens after 128: {}", costs.join(", "));
    Ok(())
}

fn greedy() -> Sampler {
    Sampler::new(SamplingParams::default())
}

fn run(
    model: &Gpt,
    mut proposer: Proposer<'_>,
    k: usize,
    prompt: &[u32],
    budget: usize,
    secs: &mut f64,
) -> anyhow::Result<(Vec<u32>, Stats)> {
    let start = Instant::now();
    let out = speculative::generate(model, &mut proposer, k, prompt, budget, &mut greedy(), None)?;
    *secs += start.elapsed().as_secs_f64();
    Ok(out)
}
