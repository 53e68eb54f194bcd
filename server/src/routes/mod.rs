//! The handlers, one module per route group; the router that mounts them is [`crate::app`].

pub mod attention;
pub mod chat;
pub mod completions;
pub mod info;
pub mod tokenize;

/// Seconds since the Unix epoch, for responses' `created`.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
