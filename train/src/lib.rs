//! `gpt-train`: train a GPT on your own text and measure perplexity. The binary (`main.rs`) only
//! wires the command line to these modules; tests drive them directly.

pub mod average;
pub mod checkpoints;
pub mod config;
pub mod data;
pub mod distributed;
pub mod eval;
pub mod init;
pub mod lora;
pub mod metrics;
pub mod optim;
pub mod schedule;
pub mod setup;
pub mod step;
pub mod tokenizer;
pub mod train;
