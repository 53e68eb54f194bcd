//! Checks that the ranks of a job train the same model the same way: at the start, that each was
//! started from the same code with the same flags, tokenizer and data as rank 0 ([`same_job`]);
//! at the start and every few steps, that every rank holds the same parameters
//! ([`same_parameters`]). A difference stops every rank with an error that names it.

use anyhow::Result;
use candle_core::Var;

use super::World;
use crate::checkpoints::Checksum;
use crate::data::Tokens;

/// An error every rank of the job reached alike (they all stop with it): printed once, by rank
/// 0, rather than by each.
#[derive(Debug)]
pub struct JobError(pub String);

impl std::fmt::Display for JobError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for JobError {}

/// What a rank says about its job, item by item (name, value), for [`same_job`].
pub type Statement = Vec<(&'static str, String)>;

/// The code this process runs: the crate's version and, where the build had git, its commit.
pub fn code_version() -> String {
    format!(
        "gpt-train {} ({}; features:{}{}{})",
        env!("CARGO_PKG_VERSION"),
        env!("GPT_TRAIN_REVISION"),
        if cfg!(feature = "mpi") { " mpi" } else { "" },
        if cfg!(feature = "cuda") { " cuda" } else { "" },
        if cfg!(feature = "nccl") { " nccl" } else { "" },
    )
}

/// The command line this process was started with, after the program's name.
pub fn flags() -> String {
    std::env::args().skip(1).collect::<Vec<_>>().join(" ")
}

/// A split's size and a hash of its tokens (all of them up to 16M, else 256 windows spread over
/// it: a fingerprint that costs little on any corpus).
pub fn data_fingerprint(tokens: &Tokens) -> String {
    const WHOLE: usize = 1 << 24;
    const WINDOWS: usize = 256;
    const WINDOW: usize = 4096;
    let mut hash = Checksum::new();
    let len = tokens.len();
    if len <= WHOLE {
        update_with(&mut hash, &tokens.window(0, len), u32::to_le_bytes);
    } else {
        for k in 0..WINDOWS {
            let window = tokens.window(k * ((len - WINDOW) / (WINDOWS - 1)), WINDOW);
            update_with(&mut hash, &window, u32::to_le_bytes);
        }
    }
    format!("{len} tokens, hash {:016x}", hash.finish())
}

/// What the ranks of a job compare to know they read the same split of `corpus` (the training
/// split, or the validation split).
pub fn corpus_fingerprint(corpus: &crate::data::Corpus, train: bool) -> String {
    use std::hash::{Hash, Hasher};
    match corpus {
        crate::data::Corpus::Text(d) => data_fingerprint(if train { &d.train } else { &d.val }),
        crate::data::Corpus::Chat(c) => {
            let examples = if train { &c.train } else { &c.val };
            // `DefaultHasher::new` has fixed keys: the same in every rank of one binary.
            let mut hash = std::hash::DefaultHasher::new();
            for e in examples {
                (&e.tokens, &e.trained).hash(&mut hash);
            }
            format!("{} conversations, hash {:016x}", examples.len(), hash.finish())
        }
    }
}

/// A hash of a text (a tokenizer's JSON).
pub fn text_hash(text: &str) -> String {
    let mut hash = Checksum::new();
    hash.update(text.as_bytes());
    format!("{:016x}", hash.finish())
}

/// Compares each rank's `statement` with rank 0's; any difference is an error on every rank
/// that names the rank, the item and both values.
pub fn same_job(world: &World, statement: &Statement) -> Result<()> {
    if world.size() == 1 {
        return Ok(());
    }
    let mut root = serde_json::to_vec(statement)?;
    world.broadcast_bytes(0, &mut root);
    let root: Vec<(String, String)> = serde_json::from_slice(&root)?;
    let mut differences: Vec<String> = statement
        .iter()
        .zip(&root)
        .filter(|((_, mine), (_, theirs))| mine != theirs)
        .map(|((name, mine), (_, theirs))| {
            format!("rank {} has {name} `{mine}` where rank 0 has `{theirs}`", world.rank())
        })
        .collect();
    if statement.len() != root.len() {
        differences.push(format!(
            "rank {} states {} items, rank 0 {}",
            world.rank(),
            statement.len(),
            root.len()
        ));
    }
    // Every rank learns every rank's differences, so that all stop with the same message.
    let mut all = Vec::new();
    for rank in 0..world.size() {
        let mut text = differences.join("; ").into_bytes();
        world.broadcast_bytes(rank, &mut text);
        if !text.is_empty() {
            all.push(String::from_utf8_lossy(&text).into_owned());
        }
    }
    if all.is_empty() {
        return Ok(());
    }
    Err(JobError(format!(
        "the ranks were not started alike, so they would not train one model: {}; start every rank from the \
         same build with the same flags, tokenizer and data",
        all.join("; ")
    ))
    .into())
}

/// Checks that every rank holds the same parameters as rank 0 at `step`, by a hash of their bits;
/// an error on every rank, naming the step and the ranks that differ, if not.
pub fn same_parameters(world: &World, vars: &[Var], step: usize) -> Result<()> {
    if world.size() == 1 {
        return Ok(());
    }
    let mut hash = Checksum::new();
    for var in vars {
        let values = var
            .as_tensor()
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1::<f32>()?;
        update_with(&mut hash, &values, f32::to_le_bytes);
    }
    let mine = hash.finish().to_le_bytes().to_vec();
    let mut root = mine.clone();
    world.broadcast_bytes(0, &mut root);
    let flags = world.all_gather_f64(&[f64::from(u8::from(root != mine))]);
    let differ: Vec<String> = (0..world.size())
        .filter(|&r| flags[r] > 0.0)
        .map(|r| r.to_string())
        .collect();
    if differ.is_empty() {
        return Ok(());
    }
    Err(JobError(format!(
        "at step {step} the parameters of rank {} differ from rank 0's: the replicas have diverged (a \
         non-deterministic kernel, or a hardware fault); stopping before a checkpoint is written from them",
        differ.join(", ")
    ))
    .into())
}

/// Mixes values into a checksum a block at a time (one call per value would cost more than the
/// mixing).
fn update_with<T: Copy, const N: usize>(sum: &mut Checksum, values: &[T], bytes: impl Fn(T) -> [u8; N]) {
    for block in values.chunks(1 << 16) {
        let block: Vec<u8> = block.iter().flat_map(|&v| bytes(v)).collect();
        sum.update(&block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(values: &[f32]) -> u64 {
        let mut sum = Checksum::new();
        update_with(&mut sum, values, f32::to_le_bytes);
        sum.finish()
    }

    #[test]
    fn the_parameter_hash_tells_one_changed_bit_and_the_order() {
        let a: Vec<f32> = (0..100_000).map(|i| i as f32 * 0.5).collect();
        let mut b = a.clone();
        b[77_777] = f32::from_bits(b[77_777].to_bits() ^ 1);
        assert_eq!(hash(&a), hash(&a.clone()));
        assert_ne!(hash(&a), hash(&b));
        let mut swapped = a.clone();
        swapped.swap(0, 4);
        assert_ne!(hash(&a), hash(&swapped));
        // Blocks do not change it: the same bytes in one update.
        let mut whole = Checksum::new();
        whole.update(&a.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        assert_eq!(whole.finish(), hash(&a));
    }
}
