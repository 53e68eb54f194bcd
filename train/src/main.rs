//! `gpt-train tokenizer | train | eval`: the command line of the trainer.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use gpt::Tokenizer;
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

#[derive(Clone, Copy, ValueEnum)]
enum TokenizerKind {
    Char,
    Bpe,
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportDtype {
    F32,
    F16,
    Bf16,
}

#[derive(Subcommand)]
enum Command {
    /// Train a tokenizer on text files and save OUT/tokenizer.json.
    Tokenizer {
        #[arg(long, num_args = 1.., required = true)]
        data: Vec<PathBuf>,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value = "char")]
        kind: TokenizerKind,
        /// Vocabulary size of a BPE tokenizer.
        #[arg(long, default_value_t = 1024)]
        vocab_size: usize,
    },
    /// Train (or, with --resume, continue training) a model.
    Train(Box<TrainArgs>),
    /// Copy a checkpoint's model and tokenizer to OUT with weights in another precision.
    Export {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, value_enum, default_value = "f16")]
        dtype: ExportDtype,
    },
    /// Perplexity of a checkpoint on a text file, with a strided sliding window.
    Eval {
        /// A GPT-2-layout checkpoint directory (config.json, model.safetensors, tokenizer.json).
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        data: PathBuf,
        /// Window length (default: the model's context length).
        #[arg(long)]
        block_size: Option<usize>,
        /// Distance between window starts (default: half the block size).
        #[arg(long)]
        stride: Option<usize>,
        #[arg(long, default_value = "auto")]
        device: String,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> Result<()> {
    gpt::device::tune_cpu_allocator();
    gpt::device::fix_cpu_thread_count(); // `train` then sets candle to one thread per shard
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Cli::parse().command {
        Command::Tokenizer {
            data,
            out,
            kind,
            vocab_size,
        } => {
            let tok = match kind {
                TokenizerKind::Char => Tokenizer::train_char(&data)?,
                TokenizerKind::Bpe => Tokenizer::train_bpe(&data, vocab_size)?,
            };
            std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
            let path = out.join(gpt::checkpoint::TOKENIZER_FILE);
            tok.save(&path)?;
            println!("saved {} ({} tokens)", path.display(), tok.vocab_size());
        }
        Command::Train(args) => {
            gpt_train::train::use_shard_parallelism();
            let stop = Arc::new(AtomicBool::new(false));
            let flag = stop.clone();
            ctrlc::set_handler(move || {
                if flag.swap(true, Ordering::SeqCst) {
                    std::process::exit(130); // a second Ctrl-C: stop now
                }
                eprintln!("stopping after this step (Ctrl-C again to quit without saving)");
            })
            .context("installing the Ctrl-C handler")?;
            let summary = gpt_train::train::train(&args, &stop)?;
            if summary.best_val_loss.is_none() && !summary.interrupted {
                bail!("no evaluation was run");
            }
        }
        Command::Export { checkpoint, out, dtype } => {
            let dtype = match dtype {
                ExportDtype::F32 => candle_core::DType::F32,
                ExportDtype::F16 => candle_core::DType::F16,
                ExportDtype::Bf16 => candle_core::DType::BF16,
            };
            let (model, tokenizer) = gpt::load_dir(&checkpoint, candle_core::DType::F32, &candle_core::Device::Cpu)?;
            gpt::save_dir(&out, &model, &tokenizer, dtype)?;
            println!(
                "saved {} ({} parameters, {dtype:?})",
                out.display(),
                model.num_parameters()
            );
        }
        Command::Eval {
            checkpoint,
            data,
            block_size,
            stride,
            device,
            json,
        } => {
            let device = gpt::parse_device(&device)?;
            let p = gpt_train::eval::eval_file(&checkpoint, &data, block_size, stride, &device)?;
            if json {
                println!("{}", serde_json::to_string(&p)?);
            } else {
                println!(
                    "{}: {} tokens scored (block {}, stride {}), mean NLL {:.4} nats, perplexity {:.3}, {:.4} bits/byte",
                    data.display(),
                    p.tokens_scored,
                    p.block_size,
                    p.stride,
                    p.mean_nll,
                    p.perplexity,
                    p.bits_per_byte
                );
            }
        }
    }
    Ok(())
}
