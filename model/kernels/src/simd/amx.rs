//! Intel's AMX tiles: whether this CPU and kernel run AMX-BF16, with the kernel's permission to
//! use the tile state asked for once per process. The tile instructions themselves are written
//! with `asm!` where they are used (`ops/packed/amx.rs`: Rust's AMX intrinsics are nightly-only).

use std::sync::OnceLock;

/// Whether this CPU and kernel run AMX-BF16 for this process (checked, and the kernel's
/// permission asked, once).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

// The check itself, shared with the test suites' build script (model/build.rs `include!`s it, so
// that tests of the AMX kernel are reported as ignored where it cannot run).
include!("amx_detect.rs");
