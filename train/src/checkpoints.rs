//! A run's checkpoints, all or nothing. Each save is a directory of its own,
//! `OUT/checkpoints/step-NNNNNNNN/` (a GPT-2 checkpoint plus `optimizer.safetensors` and
//! `trainer_state.json`): written under a temporary name, every file and the directory fsynced,
//! then renamed into place in one step. Only then does `OUT/latest` (a symbolic link) move to it
//! and are checkpoints beyond `--keep-last` removed, so at every instant at least one complete
//! checkpoint exists, and a crash at any moment, a save included, loses at most the steps since
//! the previous save. `--resume` takes the newest complete checkpoint; the best one by
//! validation loss is `OUT/best/`, replaced as a whole.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use candle_nn::VarMap;
use gpt::checkpoint;
use gpt::files::write_atomic;
use gpt::{Adapter, Gpt, Tokenizer};
use serde::{Deserialize, Serialize};

use crate::config::RunConfig;
use crate::optim::Optimizer;

pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const CHECKPOINTS_DIR: &str = "checkpoints";
pub const LATEST: &str = gpt::checkpoint::RUN_LATEST;
pub const BEST: &str = gpt::checkpoint::RUN_BEST;
const TMP: &str = ".tmp-";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    /// Updates done so far.
    pub step: usize,
    pub best_val_loss: Option<f64>,
    /// Batches are drawn from `data::batch_rng(seed, step, ..)`: this pair is the RNG state.
    pub rng_seed: u64,
    pub last_eval_step: Option<usize>,
    pub elapsed_s: f64,
    pub run: RunConfig,
    /// Checksums of the checkpoint's weight and optimizer files ([`checksum`], hex), checked on
    /// load: a truncated or altered file is an error naming it. (Absent from checkpoints saved
    /// before they were recorded: not checked.)
    #[serde(default)]
    pub checksums: std::collections::BTreeMap<String, String>,
    /// The number of ranks that trained the run up to this step (1 before it was recorded).
    #[serde(default = "one_rank")]
    pub world_size: usize,
}

fn one_rank() -> usize {
    1
}

impl TrainerState {
    /// A new run's state, before its first step.
    pub fn start(run: &RunConfig) -> Self {
        Self {
            step: 0,
            best_val_loss: None,
            rng_seed: run.seed,
            last_eval_step: None,
            elapsed_s: 0.0,
            run: run.clone(),
            checksums: Default::default(),
            world_size: 1,
        }
    }
}

/// A complete checkpoint on disk.
#[derive(Debug, Clone)]
pub struct Saved {
    pub dir: PathBuf,
    pub state: TrainerState,
}

fn step_dir_name(step: usize) -> String {
    format!("step-{step:08}")
}

fn step_of(name: &str) -> Option<usize> {
    name.strip_prefix("step-")?.parse().ok()
}

/// Test hook: `GPT_TRAIN_SAVE_DELAY_MS` sleeps that long after each file of a save, so that a test
/// can kill a run in the middle of one.
fn save_delay() {
    if let Some(ms) = std::env::var("GPT_TRAIN_SAVE_DELAY_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing {}", dir.display()))
}

/// The complete checkpoints of the run in `out`, oldest first. (A run started before this layout
/// kept its one checkpoint in `out` itself: it counts too.)
pub fn list(out: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut found = Vec::new();
    if let Ok(entries) = std::fs::read_dir(out.join(CHECKPOINTS_DIR)) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(step) = step_of(&name) {
                found.push((step, entry.path()));
            }
        }
    }
    if out.join(STATE_FILE).is_file() {
        if let Ok(state) = read_state(out) {
            found.push((state.step, out.to_path_buf()));
        }
    }
    found.sort();
    Ok(found)
}

fn read_state(dir: &Path) -> Result<TrainerState> {
    let path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))
}

/// A checksum of a file's bytes ([`Checksum`]), in hex.
pub fn checksum(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut sum = Checksum::new();
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        sum.update(&buf[..n]);
    }
    Ok(format!("{:016x}", sum.finish()))
}

/// A checksum of a stream of bytes: 64 bits over its 8-byte words and its length, each word mixed
/// in by steps that are one-to-one, so that any change to one word (a flipped bit) or to the
/// length (a truncation) changes it. Not cryptographic: it finds damage, not tampering. (Also
/// what the ranks of a job compare their data and parameters by.)
pub struct Checksum {
    h: u64,
    len: u64,
    /// The bytes of an unfinished word.
    tail: Vec<u8>,
}

impl Default for Checksum {
    fn default() -> Self {
        Self::new()
    }
}

impl Checksum {
    pub fn new() -> Self {
        Self {
            h: 0x9E37_79B9_7F4A_7C15,
            len: 0,
            tail: Vec::with_capacity(8),
        }
    }

    fn mix(h: u64, w: u64) -> u64 {
        let h = (h ^ w).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        h ^ (h >> 32)
    }

    fn word(bytes: &[u8]) -> u64 {
        let mut w = [0u8; 8];
        w[..bytes.len()].copy_from_slice(bytes);
        u64::from_le_bytes(w)
    }

    /// Mixes in the next bytes of the stream.
    pub fn update(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len() as u64;
        if !self.tail.is_empty() {
            let take = (8 - self.tail.len()).min(bytes.len());
            self.tail.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.tail.len() < 8 {
                return;
            }
            self.h = Self::mix(self.h, Self::word(&self.tail));
            self.tail.clear();
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.h = Self::mix(self.h, Self::word(w));
        }
        self.tail.extend_from_slice(words.remainder());
    }

    /// The checksum of the bytes so far: the last, partial word padded with zeros, then the
    /// length.
    pub fn finish(&self) -> u64 {
        Self::mix(Self::mix(self.h, Self::word(&self.tail)), self.len)
    }
}

/// The file of a checkpoint's trained weights: the model's, or a LoRA run's adapter.
fn weights_file(lora: bool) -> &'static str {
    if lora {
        gpt::lora::ADAPTER_WEIGHTS_FILE
    } else {
        checkpoint::WEIGHTS_FILE
    }
}

/// The files whose checksums a checkpoint records.
fn checksummed(lora: bool) -> [&'static str; 2] {
    [weights_file(lora), OPTIMIZER_FILE]
}

/// Checks a checkpoint's files against the checksums its state records.
fn verify(dir: &Path, state: &TrainerState) -> Result<()> {
    for (file, want) in &state.checksums {
        let path = dir.join(file);
        let got = checksum(&path)?;
        if &got != want {
            bail!(
                "{}: checksum {got}, but {STATE_FILE} recorded {want} when it was saved: the file is damaged \
                 (truncated or altered)",
                path.display()
            );
        }
    }
    Ok(())
}

/// Reads and checks one checkpoint: its three files must be from the same step.
fn read(dir: &Path) -> Result<Saved> {
    let state = read_state(dir)?;
    for file in checksummed(state.run.lora.is_some()) {
        let path = dir.join(file);
        let step = checkpoint::read_metadata(&path)?
            .get("step")
            .and_then(|s| s.parse().ok());
        if step != Some(state.step) {
            bail!(
                "{} is from step {step:?} but {STATE_FILE} says step {}: the checkpoint was cut while being written",
                path.display(),
                state.step
            );
        }
    }
    Ok(Saved {
        dir: dir.to_path_buf(),
        state,
    })
}

/// The newest complete checkpoint of the run in `out`; `None` when it has none. Incomplete ones
/// (from a crash) are passed over with a warning.
/// (A checkpoint whose files fail their checksums is an error that names the file: it was
/// complete once, so it was damaged after the save, and resuming from an older one silently would
/// hide that.)
pub fn latest(out: &Path) -> Result<Option<Saved>> {
    for (_, dir) in list(out)?.into_iter().rev() {
        // A state with checksums was written last, after the files it checks: the save completed.
        let complete = read_state(&dir).is_ok_and(|s| !s.checksums.is_empty());
        match read(&dir).and_then(|saved| verify(&saved.dir, &saved.state).map(|()| saved)) {
            Ok(saved) => return Ok(Some(saved)),
            Err(e) if complete => {
                return Err(e.context(format!(
                    "{} was saved whole (its {STATE_FILE} records its files' checksums) but no longer \
                     reads back: it was altered after saving; restore it, or move it away to resume \
                     from the checkpoint before it",
                    dir.display()
                )));
            }
            Err(e) => tracing::warn!(error = %e, "skipping an incomplete checkpoint"),
        }
    }
    Ok(None)
}

/// Removes what crashed saves left: temporary checkpoint directories, and puts back a `best/`
/// that was being replaced.
pub fn clean_up(out: &Path) -> Result<()> {
    if let Ok(entries) = std::fs::read_dir(out.join(CHECKPOINTS_DIR)) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().starts_with(TMP) {
                std::fs::remove_dir_all(entry.path())
                    .with_context(|| format!("removing {}", entry.path().display()))?;
            }
        }
    }
    let old_best = out.join(format!("{TMP}{BEST}-old"));
    if old_best.is_dir() {
        if out.join(BEST).is_dir() {
            std::fs::remove_dir_all(&old_best)?;
        } else {
            std::fs::rename(&old_best, out.join(BEST))?;
        }
    }
    let new_best = out.join(format!("{TMP}{BEST}"));
    if new_best.is_dir() {
        std::fs::remove_dir_all(new_best)?;
    }
    Ok(())
}

fn step_metadata(step: usize) -> HashMap<String, String> {
    HashMap::from([("step".to_string(), step.to_string())])
}

/// Set while a checkpoint is being written: a second Ctrl-C then waits for the save to finish
/// (see `gpt-train`'s signal handler) instead of leaving only the previous checkpoint.
pub static SAVING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Saves the run at `state.step` (see the module docs) and returns the checkpoint's directory.
/// Keeps the newest `keep_last` checkpoints (at least one).
pub fn save(
    out: &Path,
    model: &Gpt,
    adapter: Option<&Adapter>,
    tokenizer: &Tokenizer,
    opt: &Optimizer,
    state: &TrainerState,
    keep_last: usize,
) -> Result<PathBuf> {
    use std::sync::atomic::Ordering;
    SAVING.store(true, Ordering::SeqCst);
    let saved = save_now(out, model, adapter, tokenizer, opt, state, keep_last);
    SAVING.store(false, Ordering::SeqCst);
    saved
}

fn save_now(
    out: &Path,
    model: &Gpt,
    adapter: Option<&Adapter>,
    tokenizer: &Tokenizer,
    opt: &Optimizer,
    state: &TrainerState,
    keep_last: usize,
) -> Result<PathBuf> {
    let dir = out.join(CHECKPOINTS_DIR);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let final_dir = dir.join(step_dir_name(state.step));
    if !final_dir.is_dir() {
        // (A checkpoint of this step already saved holds the same weights: a run stopped right
        // after resuming saves nothing new.)
        let tmp = dir.join(format!("{TMP}{}-{}", step_dir_name(state.step), std::process::id()));
        let meta = step_metadata(state.step);
        save_weights(&tmp, model, adapter, tokenizer, &meta)?;
        save_delay();
        let opt_bytes = safetensors::serialize(opt.state_tensors(), Some(meta))?;
        write_atomic(&tmp.join(OPTIMIZER_FILE), &opt_bytes)?;
        drop(opt_bytes);
        save_delay();
        let mut state = state.clone();
        for file in checksummed(adapter.is_some()) {
            state.checksums.insert(file.to_string(), checksum(&tmp.join(file))?);
        }
        write_atomic(&tmp.join(STATE_FILE), serde_json::to_string_pretty(&state)?.as_bytes())?;
        save_delay();
        sync_dir(&tmp)?;
        std::fs::rename(&tmp, &final_dir).with_context(|| format!("renaming {} into place", tmp.display()))?;
        sync_dir(&dir)?;
    }
    point_latest(out, &final_dir)?;
    let all = list(out)?;
    let keep = keep_last.max(1);
    for (step, old) in all.iter().take(all.len().saturating_sub(keep)) {
        if old.starts_with(&dir) && *step != state.step {
            std::fs::remove_dir_all(old).with_context(|| format!("removing {}", old.display()))?;
        }
    }
    Ok(final_dir)
}

/// `OUT/latest` → the checkpoint just saved, replaced atomically (a new link, then a rename).
fn point_latest(out: &Path, target: &Path) -> Result<()> {
    #[cfg(unix)]
    {
        let relative = target.strip_prefix(out).unwrap_or(target);
        let tmp = out.join(format!("{TMP}{LATEST}-{}", std::process::id()));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(relative, &tmp).with_context(|| format!("creating {}", tmp.display()))?;
        std::fs::rename(&tmp, out.join(LATEST)).with_context(|| format!("updating {}/{LATEST}", out.display()))?;
    }
    #[cfg(not(unix))]
    let _ = (out, target);
    Ok(())
}

/// The trained weights, with the config and tokenizer: the model's, or with `adapter` (a LoRA
/// run) the adapter in PEFT's format beside the base's config and tokenizer.
fn save_weights(
    dir: &Path,
    model: &Gpt,
    adapter: Option<&Adapter>,
    tokenizer: &Tokenizer,
    meta: &HashMap<String, String>,
) -> Result<()> {
    match adapter {
        None => checkpoint::save_dir_with_metadata(dir, model, tokenizer, DType::F32, meta)?,
        Some(adapter) => {
            adapter.save_with_metadata(dir, meta)?;
            checkpoint::write_side_files(dir, model, tokenizer, DType::F32)?;
        }
    }
    Ok(())
}

/// Replaces `OUT/best` with `model` as a whole: the new one is written beside it, then swapped in
/// with two renames ([`clean_up`] finishes a swap that a crash interrupted).
pub fn save_best(out: &Path, model: &Gpt, adapter: Option<&Adapter>, tokenizer: &Tokenizer, step: usize) -> Result<()> {
    let (best, tmp, old) = (
        out.join(BEST),
        out.join(format!("{TMP}{BEST}")),
        out.join(format!("{TMP}{BEST}-old")),
    );
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    save_weights(&tmp, model, adapter, tokenizer, &step_metadata(step))?;
    sync_dir(&tmp)?;
    if best.is_dir() {
        std::fs::rename(&best, &old)?;
    }
    std::fs::rename(&tmp, &best)?;
    sync_dir(out)?;
    if old.is_dir() {
        std::fs::remove_dir_all(&old)?;
    }
    Ok(())
}

/// Loads a checkpoint's weights into the model's variables, and the optimizer's state (a
/// checkpoint from [`latest`], its files checked against their checksums).
pub fn restore(saved: &Saved, varmap: &VarMap, opt: &mut Optimizer, device: &Device) -> Result<()> {
    let lora = saved.state.run.lora.is_some();
    let weights = saved.dir.join(weights_file(lora));
    let mut tensors = gpt::files::read_safetensors(&weights, device)?;
    if !lora {
        // A full run's variables are the model's as it trains them (GPT-2's without
        // `transformer.`, the other families' products stacked).
        tensors = gpt::arch::trainable_tensors(&saved.state.run.model, tensors)
            .with_context(|| format!("{}", weights.display()))?;
    }
    let vars = varmap.data().lock().map_err(|_| anyhow::anyhow!("varmap poisoned"))?;
    for (name, var) in vars.iter() {
        // A LoRA run's variables are its adapter's matrices, named as PEFT names them but for
        // its prefix.
        let key = if lora { Adapter::peft_name(name) } else { name.clone() };
        let t = tensors
            .get(&key)
            .with_context(|| format!("{}: tensor {key} missing", weights.display()))?;
        var.set(&t.to_dtype(DType::F32)?)?;
    }
    let optimizer = saved.dir.join(OPTIMIZER_FILE);
    let state_tensors = gpt::files::read_safetensors(&optimizer, device)?;
    opt.load_state(state_tensors, saved.state.step as u64)
        .with_context(|| format!("restoring {}", optimizer.display()))?;
    Ok(())
}
