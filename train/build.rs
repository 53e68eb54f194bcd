//! With the `cuda` feature: compiles the optimizer's kernels (`src/optim/adamw.cu`) to PTX, as
//! gpt-kernels compiles its own.

include!("../model/kernels/build_ptx.rs");

fn main() {
    compile_ptx(
        &[PathBuf::from("src/optim/adamw.cu")],
        Path::new("../model/kernels/src/cuda"),
    );
}
