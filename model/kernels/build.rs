//! With the `cuda` feature: compiles `src/ops.cu` (the CUDA versions of the fused ops) to PTX with
//! nvcc, for `include_str!`. PTX for compute capability 7.5 (the oldest CUDA 13 supports) is
//! compiled by the driver for the GPU at hand when first loaded, so one build serves every GPU.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=src/ops.cu");
    println!("cargo::rerun-if-env-changed=CUDA_ROOT");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let nvcc = ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|root| PathBuf::from(root).join("bin/nvcc"))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let Some(out_dir) = std::env::var_os("OUT_DIR") else {
        panic!("OUT_DIR is not set: build scripts run under cargo");
    };
    let out = PathBuf::from(out_dir).join("ops.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-arch=compute_75", "src/ops.cu", "-o"])
        .arg(&out)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("{} failed on src/ops.cu ({s})", nvcc.display()),
        Err(e) => panic!(
            "the cuda feature needs nvcc ({}: {e}); set CUDA_ROOT to a CUDA toolkit",
            nvcc.display()
        ),
    }
}
