//! With the `cuda` feature: compiles each op's `.cu` file under `src/` (beside its launcher) to
//! PTX of its own (`build_ptx.rs`, shared with gpt-train's optimizer).

include!("build_ptx.rs");

fn main() {
    println!("cargo::rerun-if-changed=src");
    compile_ptx(&cuda_sources(Path::new("src")), Path::new("src/cuda"));
}
