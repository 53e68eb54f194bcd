//! Tells the test suites what this machine can run, so that a test it cannot is reported as
//! ignored, with the reason, rather than passing without having run: `cfg(gpt_test_amx)` where the
//! CPU and kernel run AMX-BF16 (the `high` matmul precision's tiles).

// `detect()`, the check the kernels themselves make.
include!("kernels/src/simd/amx_detect.rs");

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=kernels/src/simd/amx_detect.rs");
    println!("cargo::rustc-check-cfg=cfg(gpt_test_amx)");
    if detect() {
        println!("cargo::rustc-cfg=gpt_test_amx");
    }
}
