//! Speculative decoding against plain decoding on the tiny-gpt2 fixture: greedy gives the same
//! tokens with every proposer (n-gram, a draft that always agrees, a draft that mostly does
//! not), and sampling draws the same distribution (token frequencies over many seeds).

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device};
use gpt::speculative::{self, Draft, Proposer, Stats};
use gpt::{Config, Gpt, Sampler, SamplingParams};

fn fixture() -> anyhow::Result<Gpt> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2");
    Ok(gpt::load_model(&dir, DType::F32, &Device::Cpu)?)
}

/// A smaller model with the fixture's vocabulary and context: it rarely agrees with it.
fn other_draft(target: &Gpt) -> anyhow::Result<Gpt> {
    let cfg = Config {
        n_layer: 1,
        n_embd: 16,
        n_head: 2,
        ..target.config().clone()
    };
    Ok(common::random_model(&cfg)?.1)
}

/// Prompts of every kind: random, repetitive (so that n-grams recur), long (up to the context).
fn prompts() -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for (i, len) in [1, 3, 8, 20, 40, 60, 64].into_iter().enumerate() {
        out.push(common::tokens(len, 320, i as u64));
        let motif = common::tokens(1 + i % 4, 320, 100 + i as u64);
        out.push(motif.iter().copied().cycle().take(len).collect());
    }
    out
}

#[test]
fn greedy_speculation_gives_the_same_tokens() -> anyhow::Result<()> {
    let model = fixture()?;
    let other = other_draft(&model)?;
    let mut totals: HashMap<&str, Stats> = HashMap::new();
    for prompt in prompts() {
        for (max_new, eos) in [(1, None), (7, None), (30, Some(0)), (80, None)] {
            let plain = gpt::generate(
                &model,
                &prompt,
                max_new,
                &mut Sampler::new(SamplingParams::default()),
                eos,
            )?;
            for k in [1, 4, 8] {
                let proposers: [(&str, Proposer); 3] = [
                    ("ngram", Proposer::NGram),
                    ("self", Proposer::Draft(Draft::new(&model))),
                    ("other", Proposer::Draft(Draft::new(&other))),
                ];
                for (name, mut proposer) in proposers {
                    let mut sampler = Sampler::new(SamplingParams::default());
                    let (tokens, stats) =
                        speculative::generate(&model, &mut proposer, k, &prompt, max_new, &mut sampler, eos)?;
                    assert_eq!(
                        tokens,
                        plain,
                        "{name}, k {k}, max_new {max_new}, prompt of {}",
                        prompt.len()
                    );
                    assert!(stats.accepted <= stats.proposed && stats.proposed <= stats.checks * k);
                    let t = totals.entry(name).or_default();
                    t.checks += stats.checks;
                    t.proposed += stats.proposed;
                    t.accepted += stats.accepted;
                }
            }
        }
    }
    // Every path was taken: drafts kept whole, cut short, refused outright.
    let rate = |s: &Stats| s.accepted as f64 / s.proposed.max(1) as f64;
    assert!(rate(&totals["self"]) > 0.95, "{:?}", totals["self"]);
    assert!(rate(&totals["other"]) < 0.5, "{:?}", totals["other"]);
    assert!(totals["ngram"].accepted > 50, "{:?}", totals["ngram"]);
    assert!(
        totals["ngram"].proposed > totals["ngram"].accepted,
        "{:?}",
        totals["ngram"]
    );
    Ok(())
}

/// Per output position, the frequency of each token over `runs` seeds.
fn frequencies(
    runs: u64,
    params: &SamplingParams,
    mut generate: impl FnMut(&mut Sampler) -> anyhow::Result<Vec<u32>>,
) -> anyhow::Result<Vec<HashMap<u32, f64>>> {
    let mut counts: Vec<HashMap<u32, f64>> = Vec::new();
    for seed in 0..runs {
        let mut sampler = Sampler::new(SamplingParams { seed, ..params.clone() });
        for (pos, token) in generate(&mut sampler)?.into_iter().enumerate() {
            if counts.len() <= pos {
                counts.push(HashMap::new());
            }
            *counts[pos].entry(token).or_default() += 1.0 / runs as f64;
        }
    }
    Ok(counts)
}

#[test]
fn sampled_speculation_draws_the_models_distribution() -> anyhow::Result<()> {
    let model = fixture()?;
    let other = other_draft(&model)?;
    // A prompt of what the model says greedily, where it repeats itself: n-grams recur.
    let start = common::tokens(4, 320, 7);
    let said = gpt::generate(&model, &start, 36, &mut Sampler::new(SamplingParams::default()), None)?;
    let prompt: Vec<u32> = [&start[..], &said].concat();
    assert!(!speculative::ngram_proposal(&prompt, 4).is_empty());
    let runs = 2500;
    // The random fixture spreads its probability widely: top-k and a temperature keep a few
    // tokens per position, so that frequencies are measured well in a few thousand runs.
    for params in [
        SamplingParams {
            temperature: 0.8,
            top_k: Some(4),
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: Some(6),
            top_p: Some(0.7),
            frequency_penalty: 0.5,
            ..Default::default()
        },
    ] {
        let plain = frequencies(runs, &params, |s| Ok(gpt::generate(&model, &prompt, 5, s, None)?))?;
        for name in ["ngram", "self", "other"] {
            let mut stats = Stats::default();
            let spec = frequencies(runs, &params, |s| {
                let mut proposer = match name {
                    "ngram" => Proposer::NGram,
                    "self" => Proposer::Draft(Draft::new(&model)),
                    _ => Proposer::Draft(Draft::new(&other)),
                };
                let (tokens, st) = speculative::generate(&model, &mut proposer, 4, &prompt, 5, s, None)?;
                stats.proposed += st.proposed;
                stats.accepted += st.accepted;
                Ok(tokens)
            })?;
            // Proposals are checked, and refused; those of the n-grams and of the draft that is
            // the model itself are accepted often too.
            assert!(
                stats.proposed > 100 && stats.accepted < stats.proposed,
                "{name}: {stats:?}"
            );
            assert!(name == "other" || stats.accepted > 200, "{name}: {stats:?}");
            for (pos, (a, b)) in plain.iter().zip(&spec).enumerate() {
                for token in a.keys().chain(b.keys()) {
                    let (p, q) = (
                        a.get(token).copied().unwrap_or(0.0),
                        b.get(token).copied().unwrap_or(0.0),
                    );
                    // Five standard deviations of the difference of two frequencies.
                    let sd = (2.0 * p.max(q).max(1.0 / runs as f64) * (1.0 - p.min(q)) / runs as f64).sqrt();
                    assert!(
                        (p - q).abs() < 5.0 * sd,
                        "{name} {params:?}: position {pos}, token {token}: {p:.4} plain vs {q:.4}"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn a_draft_must_share_the_models_vocabulary() -> anyhow::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny-gpt2");
    let model = fixture()?;
    let tok = gpt::Tokenizer::from_file(&dir.join("tokenizer.json"))?;
    assert!(speculative::check_draft((&model, &tok), (&model, &tok)).is_ok());
    // Two tokens' ids swapped: the same size, another vocabulary.
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json"))?)?;
    let vocab = &mut json["model"]["vocab"];
    let (a, b) = (vocab["a"].clone(), vocab["b"].clone());
    vocab["a"] = b;
    vocab["b"] = a;
    let tmp = tempfile::tempdir()?;
    let path = tmp.path().join("tokenizer.json");
    std::fs::write(&path, json.to_string())?;
    let swapped = gpt::Tokenizer::from_file(&path)?;
    let err = speculative::check_draft((&model, &tok), (&model, &swapped))
        .err()
        .map(|e| e.to_string());
    let err = err.unwrap_or_default();
    assert!(
        err.contains("draft") && err.contains("\"a\"") && err.contains("\"b\""),
        "{err}"
    );
    let small = other_draft(&model)?;
    assert!(speculative::check_draft((&model, &tok), (&small, &tok)).is_ok());
    Ok(())
}
