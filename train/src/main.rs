//! `gpt-train tokenizer | train | average | export | sample | eval`: the command line of the
//! trainer, one function per subcommand.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use gpt_train::config::TrainArgs;

#[derive(Parser)]
#[command(
    name = "gpt-train",
    version,
    about = "Train a GPT on your own text, and measure perplexity"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a tokenizer on text files and save OUT/tokenizer.json.
    Tokenizer(TokenizerArgs),
    /// Train (or, with --resume, continue training) a model.
    Train(Box<TrainArgs>),
    /// Copy a checkpoint's model and tokenizer to OUT with weights in another precision.
    Export(ExportArgs),
    /// Average checkpoints of one model (the element-wise mean of their parameters), as the
    /// original transformer's reported models are: the named directories, or a run's newest.
    Average(AverageArgs),
    /// Generate text from a checkpoint, for a quick look without a server: sampled, greedy
    /// (--temperature 0) or by beam search (--num-beams K).
    Sample(SampleArgs),
    /// Perplexity of a checkpoint on a text (file, JSON lines, parquet, Hub dataset) or on
    /// token files, with a strided sliding window.
    Eval(EvalArgs),
    /// Tokenise text into token files for llm.c or nanoGPT (they train here too).
    Prepare(PrepareArgs),
    /// Merge a LoRA adapter (PEFT's format: adapter_config.json, adapter_model.safetensors)
    /// into its base checkpoint's weights and write a full checkpoint.
    Merge(MergeArgs),
}

#[derive(clap::Args)]
struct MergeArgs {
    #[arg(long, help = CHECKPOINT_HELP)]
    checkpoint: PathBuf,
    /// The adapter: its directory (as PEFT's save_pretrained wrote it), a `gpt-train train
    /// --lora-r` run directory (its best/ checkpoint), or a Hub id.
    #[arg(long)]
    adapter: PathBuf,
    /// Directory for the merged checkpoint (f32).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Clone, Copy, ValueEnum)]
enum TokenizerKind {
    Char,
    Bpe,
}

#[derive(clap::Args)]
struct TokenizerArgs {
    /// Text to build the vocabulary from: any --data of `gpt-train train` but token files.
    #[arg(long, num_args = 1.., required = true)]
    data: Vec<PathBuf>,
    /// The field of JSON lines and the column of parquet files that holds the text.
    #[arg(long, default_value = "text")]
    text_field: String,
    /// Directory to write tokenizer.json into.
    #[arg(long)]
    out: PathBuf,
    /// char: one token per character (nanoGPT's shakespeare-char); bpe: GPT-2's byte-level BPE.
    #[arg(long, value_enum, default_value = "char")]
    kind: TokenizerKind,
    /// Vocabulary size of a BPE tokenizer.
    #[arg(long, default_value_t = 1024)]
    vocab_size: usize,
}

/// What names a checkpoint, the same in every subcommand (and in gpt-server).
const CHECKPOINT_HELP: &str = "A checkpoint directory (config.json, model.safetensors, tokenizer.json), \
                               a gpt-train run directory (its best/ checkpoint), or a Hugging Face Hub id \
                               (gpt2, org/name@revision; from the shared Hub cache, downloaded if missing); \
                               `eval`, `export` and `train --init-from` also take a llama.cpp GGUF file (or \
                               org/name:Q4_K_M)";

#[derive(clap::Args)]
struct ExportArgs {
    #[arg(long, help = CHECKPOINT_HELP)]
    checkpoint: PathBuf,
    /// Directory for the copy; or a file named `*.gguf`: llama.cpp's GGUF file of the model
    /// (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3), with its tokenizer and chat template, for
    /// llama.cpp, Ollama and LM Studio.
    #[arg(long)]
    out: PathBuf,
    /// Precision of the copy's weights: f32, f16 and bf16 write model.safetensors (for
    /// transformers too); q8_0 and q4_0 write the weight matrices quantized to model.gguf,
    /// which gpt-server and gpt-train eval load as they are. A `*.gguf` file takes any of them.
    #[arg(long, default_value = "f16")]
    dtype: gpt::WeightFormat,
}

#[derive(clap::Args)]
struct AverageArgs {
    /// Checkpoint directories to average.
    #[arg(long, num_args = 1.., required_unless_present = "run", conflicts_with = "run")]
    checkpoints: Vec<PathBuf>,
    /// A training run's --out directory: average its newest --last checkpoints (train with
    /// --keep-last K to keep them).
    #[arg(long, requires = "last")]
    run: Option<PathBuf>,
    /// How many of the run's newest checkpoints.
    #[arg(long)]
    last: Option<usize>,
    /// Directory for the averaged checkpoint.
    #[arg(long)]
    out: PathBuf,
}

#[derive(clap::Args)]
struct SampleArgs {
    #[arg(long, help = CHECKPOINT_HELP)]
    checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate at most (generation also ends at the context length).
    #[arg(long, default_value_t = 200)]
    max_new_tokens: usize,
    /// Beam search with this many beams (1: sampling).
    #[arg(long, default_value_t = 1)]
    num_beams: usize,
    /// With beam search: finished beams are scored by log-probability / length^α.
    #[arg(long, default_value_t = 1.0)]
    length_penalty: f32,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample from the k most likely tokens only (0: all).
    #[arg(long, default_value_t = 200)]
    top_k: usize,
    /// Seed of the sampling.
    #[arg(long, default_value_t = 1337)]
    seed: u64,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Speculative decoding with this draft model (a smaller one with the same tokenizer: a
    /// directory or a Hub id): the same text under greedy decoding, the same distribution under
    /// sampling, in fewer steps of the model.
    #[arg(long)]
    draft_checkpoint: Option<PathBuf>,
    /// Speculative decoding: `ngram` (prompt lookup), `draft` (needs --draft-checkpoint) or `off`.
    /// Default: `draft` with --draft-checkpoint, else off.
    #[arg(long)]
    speculative: Option<gpt::speculative::Mode>,
    /// With speculative decoding: tokens proposed per step at most (adapted to how many are
    /// accepted).
    #[arg(long, default_value_t = 6)]
    num_speculative_tokens: usize,
}

#[derive(clap::Args)]
struct EvalArgs {
    #[arg(long, help = CHECKPOINT_HELP)]
    checkpoint: PathBuf,
    /// What to score: a UTF-8 text file, JSON lines, parquet, a directory or Hub dataset of them,
    /// or token files (documents separated by the end-of-text token, as in training).
    #[arg(long)]
    data: PathBuf,
    /// Window length (default: the model's context length).
    #[arg(long)]
    block_size: Option<usize>,
    /// Distance between window starts (default: half the block size).
    #[arg(long)]
    stride: Option<usize>,
    /// auto, cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Weight format to evaluate in: f32, f16, bf16, q8_0 or q4_0 (default: as stored).
    /// q8_0 and q4_0 quantize the weight matrices at load, on the CPU.
    #[arg(long)]
    dtype: Option<gpt::WeightFormat>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// The field of JSON lines and the column of parquet files that holds the text.
    #[arg(long, default_value = "text")]
    text_field: String,
    /// How --data is read: auto, text, llmc or nanogpt (as `gpt-train train --data-format`).
    #[arg(long, value_enum, default_value = "auto")]
    data_format: gpt_train::data::token_files::DataFormat,
}

/// `gpt-train prepare`: token files for llm.c or nanoGPT (or for training here) from any --data.
#[derive(clap::Args)]
struct PrepareArgs {
    /// What to tokenise: any --data of `gpt-train train` (text, .jsonl, .parquet, directories,
    /// hf://datasets/...).
    #[arg(long, num_args = 1.., required = true)]
    data: Vec<PathBuf>,
    /// `char`, `bpe:N`, a tokenizer.json (or a directory holding one), or a Hub model id (e.g.
    /// `gpt2`).
    #[arg(long)]
    tokenizer: String,
    /// llmc: llm.c's shards (a 256 x int32 header, then uint16 tokens; uint32 past 65536 tokens);
    /// nanogpt: nanoGPT's train.bin / val.bin (uint16) and, for a character vocabulary, meta.pkl.
    #[arg(long, value_enum)]
    format: gpt_train::data::token_files::DataFormat,
    /// Directory to write the token files and tokenizer.json into.
    #[arg(long)]
    out: PathBuf,
    /// Validation text; by default the last --val-fraction of the tokens.
    #[arg(long, conflicts_with = "val_fraction")]
    val_data: Option<PathBuf>,
    /// Share of the tokens held out for validation, from the end.
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
    /// The field of JSON lines and the column of parquet files that holds the text.
    #[arg(long, default_value = "text")]
    text_field: String,
}

fn main() -> Result<()> {
    gpt::device::tune_cpu_allocator();
    gpt::device::fix_cpu_thread_count(); // `train` then sets candle to one thread per shard
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let matches = gpt_train::config::with_stated_defaults(Cli::command()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    match cli.command {
        Command::Tokenizer(args) => tokenizer(args),
        Command::Train(args) => train(&args),
        Command::Export(args) => export(args),
        Command::Average(args) => average(args),
        Command::Sample(args) => sample(args),
        Command::Eval(args) => eval(args),
        Command::Prepare(args) => prepare(args),
        Command::Merge(args) => merge(args),
    }
}

fn prepare(args: PrepareArgs) -> Result<()> {
    use gpt_train::data::token_files::DataFormat;
    if !matches!(args.format, DataFormat::Llmc | DataFormat::Nanogpt) {
        anyhow::bail!("--format: llmc or nanogpt");
    }
    let reading = gpt_train::data::Reading {
        text_field: args.text_field.clone(),
        format: DataFormat::Text,
    };
    let tokenizer = gpt_train::tokenizer::build_tokenizer(&args.tokenizer, &args.data, &reading, &args.out)?;
    let written = gpt_train::data::write_token_files(
        &args.data,
        args.val_data.as_deref(),
        args.val_fraction,
        &tokenizer,
        &reading,
        args.format,
        &args.out,
    )?;
    for (path, tokens) in &written {
        println!("{}: {tokens} tokens", path.display());
    }
    println!(
        "{}: the tokenizer ({} tokens)",
        args.out.join(gpt::checkpoint::TOKENIZER_FILE).display(),
        tokenizer.vocab_size()
    );
    Ok(())
}

/// `--checkpoint`'s directory (see [`CHECKPOINT_HELP`]): a checkpoint or run directory, or a
/// Hub id.
fn checkpoint_dir(named: &Path) -> Result<PathBuf> {
    Ok(gpt::checkpoint::resolve(&named.to_string_lossy())
        .context("--checkpoint")?
        .dir)
}

fn tokenizer(args: TokenizerArgs) -> Result<()> {
    let spec = match args.kind {
        TokenizerKind::Char => "char".to_string(),
        TokenizerKind::Bpe => format!("bpe:{}", args.vocab_size),
    };
    let reading = gpt_train::data::Reading {
        text_field: args.text_field.clone(),
        format: gpt_train::data::token_files::DataFormat::Text,
    };
    let tok = gpt_train::tokenizer::build_tokenizer(&spec, &args.data, &reading, &args.out)?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    let path = args.out.join(gpt::checkpoint::TOKENIZER_FILE);
    tok.save(&path)?;
    println!("saved {} ({} tokens)", path.display(), tok.vocab_size());
    Ok(())
}

fn train(args: &TrainArgs) -> Result<()> {
    gpt_train::step::use_shard_parallelism();
    let world = gpt_train::distributed::World::init()?;
    let root = world.is_root(); // only rank 0 of a job speaks
    let stop = Arc::new(AtomicBool::new(false));
    // Set by a second Ctrl-C: the run ends with 130 even when the save it waited for was the last
    // thing the run had to do (the main thread may then finish before the handler exits).
    static QUIT: AtomicBool = AtomicBool::new(false);
    let flag = stop.clone();
    ctrlc::set_handler(move || {
        if !flag.swap(true, Ordering::SeqCst) {
            if root {
                eprintln!("stopping after this step (Ctrl-C again to quit without saving)");
            }
            return;
        }
        QUIT.store(true, Ordering::SeqCst);
        // A second Ctrl-C: stop now, but not in the middle of a save (the checkpoint being
        // written would be lost): let it finish, then exit.
        if gpt_train::checkpoints::SAVING.load(Ordering::SeqCst) {
            eprintln!("a checkpoint is being written: exiting as soon as it is complete");
            while gpt_train::checkpoints::SAVING.load(Ordering::SeqCst) {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        std::process::exit(130);
    })
    .context("installing the Ctrl-C handler")?;
    let summary = match gpt_train::train::train(args, &stop, &world) {
        Ok(summary) => summary,
        Err(e) if world.size() > 1 => end_job(world, e),
        Err(e) => return Err(e),
    };
    if QUIT.load(Ordering::SeqCst) {
        std::process::exit(130);
    }
    if summary.best_val_loss.is_none() && !summary.interrupted {
        bail!("no evaluation was run");
    }
    Ok(())
}

/// Ends a job of several ranks on this rank's error `e`. An error every rank reached alike (a
/// [`JobError`](gpt_train::distributed::agree::JobError)) is printed once, by rank 0, and every
/// rank exits; any other stops the whole job at once (MPI's abort), named by its rank, since the
/// others would wait for this one forever.
fn end_job(world: gpt_train::distributed::World, e: anyhow::Error) -> ! {
    if e.downcast_ref::<gpt_train::distributed::agree::JobError>().is_some() {
        if world.is_root() {
            eprintln!("Error: {e:?}");
        }
        // The others wait until it is printed: the launcher ends the job at the first rank to exit.
        world.barrier();
        drop(world); // every rank is here: MPI finalises
        std::process::exit(1);
    }
    eprintln!("Error: rank {} of {}: {e:?}", world.rank(), world.size());
    world.abort(1)
}

fn export(args: ExportArgs) -> Result<()> {
    let dir = checkpoint_dir(&args.checkpoint)?;
    // A GGUF file's matrices dequantized to f32 (then written in --dtype).
    let f32 = Some(gpt::WeightFormat::F32);
    let (model, tokenizer) = match gpt::llamacpp::is_gguf_file(&dir) {
        true => gpt::llamacpp::load(&dir, f32, &candle_core::Device::Cpu)?,
        false => gpt::load_dir(&dir, candle_core::DType::F32, &candle_core::Device::Cpu)?,
    };
    let format = args.dtype;
    let llama_cpp = args.out.extension().is_some_and(|e| e == "gguf");
    match format.ggml() {
        _ if llama_cpp => gpt::llamacpp::save(&args.out, &model, &tokenizer, format)?,
        Some(_) => gpt::save_gguf_dir(&args.out, &model, &tokenizer, format)?,
        None => gpt::save_dir(&args.out, &model, &tokenizer, format.dtype())?,
    }
    println!(
        "saved {} ({} parameters, {format})",
        args.out.display(),
        model.num_parameters()
    );
    Ok(())
}

fn merge(args: MergeArgs) -> Result<()> {
    let base = checkpoint_dir(&args.checkpoint)?;
    let adapter = gpt::checkpoint::resolve_adapter(&args.adapter.to_string_lossy())
        .with_context(|| format!("--adapter {}", args.adapter.display()))?;
    let merged = gpt_train::lora::merge(&base, &adapter, &args.out)?;
    println!(
        "saved {}: {} with the adapter {} merged ({} parameters)",
        args.out.display(),
        base.display(),
        args.adapter.display(),
        merged.num_parameters()
    );
    Ok(())
}

fn average(args: AverageArgs) -> Result<()> {
    let dirs = match (args.run, args.last) {
        (Some(run), Some(k)) => {
            let all = gpt_train::checkpoints::list(&run)?;
            if k == 0 || all.len() < k {
                bail!(
                    "--last {k}: {} holds {} complete checkpoints (train with --keep-last {k} to keep that many)",
                    run.display(),
                    all.len()
                );
            }
            all[all.len() - k..].iter().map(|(_, dir)| dir.clone()).collect()
        }
        _ => args
            .checkpoints
            .iter()
            .map(|dir| {
                Ok(gpt::checkpoint::resolve(&dir.to_string_lossy())
                    .context("--checkpoints")?
                    .dir)
            })
            .collect::<Result<Vec<_>>>()?,
    };
    gpt_train::average::average(&dirs, &args.out)?;
    println!("saved {}: the mean of {} checkpoints", args.out.display(), dirs.len());
    Ok(())
}

fn sample(args: SampleArgs) -> Result<()> {
    let device = gpt::parse_device(&args.device)?;
    let (model, tokenizer) = gpt::load_dir(&checkpoint_dir(&args.checkpoint)?, candle_core::DType::F32, &device)?;
    let ids = tokenizer.encode_prompt(&args.prompt)?;
    if ids.is_empty() {
        bail!("--prompt encodes to no tokens");
    }
    let context = model.config().n_positions;
    if ids.len() >= context {
        bail!("--prompt has {} tokens; the model's context is {context}", ids.len());
    }
    let room = args.max_new_tokens.min(context - ids.len());
    let output = if args.num_beams > 1 {
        let params = gpt::beam::BeamParams {
            beams: args.num_beams,
            max_new_tokens: room,
            length_penalty: args.length_penalty,
            eos: tokenizer.eos_token_id(),
        };
        let best = gpt::beam::beam_search(&model, &ids, &params)?.into_iter().next();
        best.map(|h| h.tokens).unwrap_or_default()
    } else {
        let mut sampler = gpt::Sampler::new(gpt::SamplingParams {
            temperature: args.temperature,
            top_k: (args.top_k > 0).then_some(args.top_k),
            seed: args.seed,
            ..Default::default()
        });
        let eos = tokenizer.eos_token_id();
        use gpt::speculative::{self, Mode, Proposer};
        let mode = args.speculative.unwrap_or(match args.draft_checkpoint {
            Some(_) => Mode::Draft,
            None => Mode::Off,
        });
        let draft = match (&args.draft_checkpoint, mode) {
            (Some(path), Mode::Draft) => {
                let dir = gpt::checkpoint::resolve(&path.to_string_lossy())
                    .context("--draft-checkpoint")?
                    .dir;
                let draft = gpt::load_dir(&dir, candle_core::DType::F32, &device)?;
                speculative::check_draft((&model, &tokenizer), (&draft.0, &draft.1))
                    .with_context(|| format!("--draft-checkpoint {}", path.display()))?;
                Some(draft.0)
            }
            (None, Mode::Draft) => bail!("--speculative draft needs --draft-checkpoint"),
            (Some(_), _) => bail!("--draft-checkpoint is given but --speculative is not draft"),
            (None, _) => None,
        };
        let mut proposer = match (mode, &draft) {
            (Mode::Off, _) => None,
            (Mode::Ngram, _) => Some(Proposer::NGram),
            (Mode::Draft, Some(d)) => Some(Proposer::Draft(speculative::Draft::new(d))),
            (Mode::Draft, None) => None,
        };
        match &mut proposer {
            None => gpt::generate(&model, &ids, room, &mut sampler, eos)?,
            Some(proposer) => {
                let k = args.num_speculative_tokens.max(1);
                let (out, stats) = speculative::generate(&model, proposer, k, &ids, room, &mut sampler, eos)?;
                eprintln!(
                    "speculative decoding: {} of {} proposed tokens accepted ({:.0}%) in {} checks; {:.2} tokens a step",
                    stats.accepted,
                    stats.proposed,
                    100.0 * stats.accepted as f64 / stats.proposed.max(1) as f64,
                    stats.checks,
                    out.len() as f64 / (out.len() - stats.accepted).max(1) as f64,
                );
                out
            }
        }
    };
    println!("{}{}", args.prompt, tokenizer.decode_skip_special(&output)?);
    Ok(())
}

fn eval(args: EvalArgs) -> Result<()> {
    let device = gpt::parse_device(&args.device)?;
    let dir = checkpoint_dir(&args.checkpoint)?;
    let reading = gpt_train::data::Reading {
        text_field: args.text_field.clone(),
        format: args.data_format,
    };
    let p = gpt_train::eval::eval_file(
        &dir,
        &args.data,
        &reading,
        args.block_size,
        args.stride,
        args.dtype,
        &device,
    )?;
    if args.json {
        println!("{}", serde_json::to_string(&p)?);
    } else {
        println!(
            "{}: {} tokens scored (block {}, stride {}), mean NLL {:.4} nats, perplexity {:.3}, {:.4} bits/byte",
            args.data.display(),
            p.tokens_scored,
            p.block_size,
            p.stride,
            p.mean_nll,
            p.perplexity,
            p.bits_per_byte
        );
    }
    Ok(())
}
