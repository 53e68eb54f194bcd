//! With the `cuda` feature: compiles the optimizer's kernels (`src/optim/adamw.cu`) to PTX, as
//! gpt-kernels compiles its own. And tells the test suites what this machine can run, so that a
//! test it cannot is reported as ignored, with the reason, rather than passing without having
//! run: `cfg(gpt_test_root)` when the build runs as root (to mount a small tmpfs),
//! `cfg(gpt_test_numpy)` and `cfg(gpt_test_peft)` when `GPT_TEST_PYTHON` names the Python the
//! tests check against (CI's virtual environment, with NumPy, PEFT, transformers and torch: not
//! probed, since CI builds the tests while it is being installed; a Python that lacks one fails
//! the test that imports it), and with MPI `cfg(gpt_test_netns)` when it can make network
//! namespaces.

include!("../model/kernels/build_ptx.rs");

fn main() {
    compile_ptx(
        &[PathBuf::from("src/optim/adamw.cu")],
        Path::new("../model/kernels/src/cuda"),
    );
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=GPT_TEST_PYTHON");
    println!("cargo::rerun-if-env-changed=SLURM_CONF");
    println!(
        "cargo::rustc-check-cfg=cfg(gpt_test_root, gpt_test_numpy, gpt_test_peft, gpt_test_netns, gpt_test_slurm)"
    );
    let run = |program: &str, args: &[&str]| {
        Command::new(program)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    // The commit the binary is built from, which the ranks of a job compare (see
    // distributed::agree::code_version).
    let revision = run("git", &["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "no git revision".into());
    println!("cargo::rustc-env=GPT_TRAIN_REVISION={revision}");
    for watched in ["../.git/HEAD", "../.git/refs/heads", "../.git/packed-refs"] {
        if Path::new(watched).exists() {
            println!("cargo::rerun-if-changed={watched}");
        }
    }
    if run("id", &["-u"]).as_deref() == Some("0") {
        println!("cargo::rustc-cfg=gpt_test_root");
    }
    // Two network namespaces joined by a veth pair stand for two hosts in the MPI tests: they
    // need root and a kernel (or container) that lets this process make them.
    if std::env::var_os("CARGO_FEATURE_MPI").is_some() {
        let probe = format!("gpt-probe-{}", std::process::id());
        if run("ip", &["netns", "add", &probe]).is_some() {
            let _ = run("ip", &["netns", "del", &probe]);
            println!("cargo::rustc-cfg=gpt_test_netns");
        }
        // A node of a Slurm cluster that takes jobs: `sbatch` and `srun` can start the ranks.
        let idle = run("sinfo", &["-h", "-o", "%t"]);
        if idle.is_some_and(|states| states.lines().any(|s| s.trim() == "idle" || s.trim() == "mix")) {
            println!("cargo::rustc-cfg=gpt_test_slurm");
        }
    }
    // Not probed (see the header): CI builds the tests while that Python is being installed.
    if std::env::var_os("GPT_TEST_PYTHON").is_some() {
        println!("cargo::rustc-cfg=gpt_test_numpy");
        println!("cargo::rustc-cfg=gpt_test_peft");
    }
}
