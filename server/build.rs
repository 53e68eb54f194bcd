//! Tells the test suites which Python packages `GPT_TEST_PYTHON` has (CI sets it to its virtual
//! environment), so that a test that needs a missing one is reported as ignored, with the reason,
//! rather than passing without having run: `cfg(gpt_test_transformers)` (transformers and torch),
//! `cfg(gpt_test_hf_hub)` (huggingface_hub). Without `GPT_TEST_PYTHON` nothing is probed (a plain
//! build starts no Python).

use std::process::Command;

fn has(python: &str, modules: &str) -> bool {
    Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=GPT_TEST_PYTHON");
    println!("cargo::rustc-check-cfg=cfg(gpt_test_transformers, gpt_test_hf_hub)");
    let Ok(python) = std::env::var("GPT_TEST_PYTHON") else {
        return;
    };
    if has(&python, "transformers, torch") {
        println!("cargo::rustc-cfg=gpt_test_transformers");
    }
    if has(&python, "huggingface_hub") {
        println!("cargo::rustc-cfg=gpt_test_hf_hub");
    }
}
