// PTX from CUDA sources, for the build scripts of gpt-kernels and gpt-train (each `include!`s
// this file): every `.cu` given is compiled to `$OUT_DIR/<stem>.ptx` with nvcc, for
// `include_str!` (`gpt_kernels::ptx_module!`). PTX for compute capability 7.5 (the oldest CUDA 13
// supports) is compiled by the driver for the GPU at hand when first loaded, so one build serves
// every GPU. `include` is the folder of the shared `common.cuh`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn compile_ptx(sources: &[PathBuf], include: &Path) {
    println!("cargo::rerun-if-changed={}", include.join("common.cuh").display());
    println!("cargo::rerun-if-env-changed=CUDA_ROOT");
    for source in sources {
        println!("cargo::rerun-if-changed={}", source.display());
    }
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
    for source in sources {
        let Some(stem) = source.file_stem() else {
            panic!("{}: not a file name", source.display())
        };
        let out = PathBuf::from(&out_dir).join(stem).with_extension("ptx");
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-arch=compute_75", "-I"])
            .arg(include)
            .arg(source)
            .arg("-o")
            .arg(&out)
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{} failed on {} ({s})", nvcc.display(), source.display()),
            Err(e) => panic!(
                "the cuda feature needs nvcc ({}: {e}); set CUDA_ROOT to a CUDA toolkit",
                nvcc.display()
            ),
        }
    }
}

/// The `.cu` files under `dir`, in a fixed order.
#[allow(dead_code)] // gpt-train names its one source instead
fn cuda_sources(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        panic!("{}: cannot list the CUDA sources", dir.display())
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(cuda_sources(&path));
        } else if path.extension().is_some_and(|e| e == "cu") {
            found.push(path);
        }
    }
    found.sort();
    found
}
