//! The kernel crate's one error of its own: a format or precision name it does not know.

/// A weight format or matmul precision named by a string that is none of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);
