//! The handlers, one module per route group; the router that mounts them is [`crate::app`].

pub mod attention;
pub mod chat;
pub mod completions;
pub mod embeddings;
pub mod info;
pub mod lora;
pub mod messages;
pub mod ollama;
pub mod responses;
pub mod tokenize;

/// Seconds since the Unix epoch, for responses' `created`.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A response's id: `PREFIX-<request_id>` for a request that names itself (vLLM's
/// `request_id`), else `PREFIX-` and 16 random hex digits.
fn response_id(prefix: &str, request_id: Option<&str>) -> String {
    match request_id {
        Some(id) => format!("{prefix}-{id}"),
        None => format!("{prefix}-{:016x}", rand::random::<u64>()),
    }
}
