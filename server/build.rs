//! Tells the test suites whether `GPT_TEST_PYTHON` names the Python they check against (CI sets
//! it to its virtual environment, with transformers, torch and huggingface_hub), so that a test
//! that needs it is reported as ignored, with the reason, rather than passing without having run:
//! `cfg(gpt_test_transformers)` and `cfg(gpt_test_hf_hub)`. The variable is not probed (a Python
//! named that lacks a package fails the test that imports it, naming the package): CI builds the
//! tests while that environment is still being installed, and a probe then would answer no.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=GPT_TEST_PYTHON");
    println!("cargo::rustc-check-cfg=cfg(gpt_test_transformers, gpt_test_hf_hub)");
    if std::env::var_os("GPT_TEST_PYTHON").is_some() {
        println!("cargo::rustc-cfg=gpt_test_transformers");
        println!("cargo::rustc-cfg=gpt_test_hf_hub");
    }
}
