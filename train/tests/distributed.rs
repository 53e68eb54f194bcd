//! Data-parallel training under `mpirun` (Open MPI): N ranks end with the weights of one process;
//! checkpoints resume on another number of ranks; a killed rank, a SIGTERM, ranks started
//! differently and a batch that does not divide are handled as a user expects. Built with
//! `--features mpi` (`.ci/run` installs Open MPI); the default build has no MPI to test.
#![cfg(feature = "mpi")]

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{stderr, train_args, BIN};
use gpt_test_support as support;

/// `mpirun` with what a test run needs: as root where the tests run as root, more ranks than
/// cores allowed, and each rank's log level.
fn mpirun() -> Command {
    with_mpirun_settings(Command::new("mpirun"))
}

/// `cmd` (which runs mpirun) with the settings of [`mpirun`].
fn with_mpirun_settings(mut cmd: Command) -> Command {
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("RUST_LOG", "warn")
        .args(["-x", "RUST_LOG"]);
    cmd
}

/// `gpt-train train` on `ranks` ranks with the tiny settings and `extra`.
fn train_ranks(ranks: usize, corpus: &Path, out: &Path, extra: &[&str]) -> anyhow::Result<Output> {
    Ok(mpirun()
        .args(["-np", &ranks.to_string(), BIN])
        .args(train_args(corpus, out, extra))
        .output()?)
}

fn ok(out: Output) -> anyhow::Result<Output> {
    anyhow::ensure!(out.status.success(), "the run failed: {}", stderr(&out));
    Ok(out)
}

/// Every tensor of a checkpoint's weights and optimizer state, by file and name, as raw bytes.
fn tensors(checkpoint: &Path) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let mut all = BTreeMap::new();
    for file in ["model.safetensors", "optimizer.safetensors"] {
        let bytes = std::fs::read(checkpoint.join(file))?;
        for (name, view) in safetensors::SafeTensors::deserialize(&bytes)?.tensors() {
            all.insert(format!("{file}:{name}"), view.data().to_vec());
        }
    }
    Ok(all)
}

fn floats(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

/// The largest difference between two checkpoints' values (both must hold the same tensors).
fn max_difference(a: &Path, b: &Path) -> anyhow::Result<f32> {
    let (a, b) = (tensors(a)?, tensors(b)?);
    anyhow::ensure!(a.keys().eq(b.keys()), "the checkpoints hold different tensors");
    let mut max = 0f32;
    for (name, x) in &a {
        max = floats(x)
            .zip(floats(&b[name]))
            .fold(max, |m, (x, y)| m.max((x - y).abs()));
    }
    Ok(max)
}

fn step_dir(out: &Path, step: usize) -> PathBuf {
    out.join(format!("checkpoints/step-{step:08}"))
}

/// What the tiny runs here share: dropout on (its masks must not depend on the ranks), two
/// micro-batches per step, a checkpoint every 10 steps.
const RUN: &[&str] = &[
    "--dropout",
    "0.1",
    "--gradient-accumulation-steps",
    "2",
    "--keep-last",
    "10",
];

fn args<'a>(more: &[&'a str]) -> Vec<&'a str> {
    RUN.iter().copied().chain(more.iter().copied()).collect()
}

/// The reference of the 2-rank runs: 20 steps of one process with `--parallel shards --threads 2`
/// in `dir/one`, and the flags (but `--threads`) the ranks share with it.
fn one_process_of_20_steps(corpus: &Path, dir: &Path) -> anyhow::Result<(PathBuf, Vec<&'static str>)> {
    let one = dir.join("one");
    let more = args(&["--max-iters", "20", "--parallel", "shards"]);
    ok(common::train(
        corpus,
        &one,
        &[more.as_slice(), &["--threads", "2"]].concat(),
    )?)?;
    Ok((one, more))
}

#[test]
fn two_ranks_end_with_the_weights_of_one_process_with_two_shards_bit_for_bit() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let (one, more) = one_process_of_20_steps(&corpus, dir.path())?;
    // With 1 MB buckets every tensor of the tiny model is packed into one; with buckets of 2621
    // values, the small ones are packed, the larger summed whole and the largest in pieces. Each
    // after the backward pass, and during it (each gradient summed as soon as it is final).
    for (bucket_mb, overlap) in [("1", "off"), ("0.01", "off"), ("1", "on"), ("0.01", "on")] {
        let two = dir.path().join(format!("two-{bucket_mb}-{overlap}"));
        let flags = [
            more.as_slice(),
            &[
                "--threads",
                "1",
                "--allreduce-bucket-mb",
                bucket_mb,
                "--overlap-allreduce",
                overlap,
            ],
        ]
        .concat();
        let out = ok(train_ranks(2, &corpus, &two, &flags)?)?;
        for step in [10, 20] {
            let (a, b) = (tensors(&step_dir(&one, step))?, tensors(&step_dir(&two, step))?);
            assert_eq!(a.len(), b.len());
            for (name, values) in &a {
                assert!(
                    values == &b[name],
                    "buckets of {bucket_mb} MB, overlap {overlap}, step {step}: {name} differs"
                );
            }
        }
        assert_eq!(common::train_losses(&one)?, common::train_losses(&two)?);
        assert_eq!(common::state(&two)?["world_size"], 2);
        // Rank 0 alone reports: one final line, and the job's figures in the metrics.
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).matches("done: 20 steps").count(),
            1
        );
        let metrics = std::fs::read_to_string(two.join("metrics.jsonl"))?;
        let logged: serde_json::Value = serde_json::from_str(metrics.lines().nth(1).unwrap_or_default())?;
        assert_eq!(logged["ranks"], 2, "{logged}");
        assert_eq!(logged["allreduce_s"].as_array().map(Vec::len), Some(2), "{logged}");
        assert_eq!(logged["wait_s"].as_array().map(Vec::len), Some(2), "{logged}");
    }
    Ok(())
}

/// Muon on two ranks (each orthogonalising the matrices it owns, then sending them) ends with
/// the weights and momentum of one process, bit for bit.
#[test]
fn muon_on_two_ranks_ends_with_the_weights_of_one_process_bit_for_bit() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let more = args(&["--max-iters", "20", "--parallel", "shards", "--recipe", "modern"]);
    let one = dir.path().join("one");
    ok(common::train(
        &corpus,
        &one,
        &[more.as_slice(), &["--threads", "2"]].concat(),
    )?)?;
    let two = dir.path().join("two");
    ok(train_ranks(
        2,
        &corpus,
        &two,
        &[more.as_slice(), &["--threads", "1"]].concat(),
    )?)?;
    let (a, b) = (tensors(&step_dir(&one, 20))?, tensors(&step_dir(&two, 20))?);
    assert_eq!(a.len(), b.len());
    assert!(a.keys().any(|name| name.ends_with(".momentum_buffer")));
    for (name, values) in &a {
        assert!(values == &b[name], "{name} differs");
    }
    assert_eq!(common::train_losses(&one)?, common::train_losses(&two)?);
    Ok(())
}

/// Every tensor of a LoRA checkpoint's adapter and optimizer state, by file and name, as raw bytes.
fn adapter_tensors(checkpoint: &Path) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
    let mut all = BTreeMap::new();
    for file in [gpt::lora::ADAPTER_WEIGHTS_FILE, "optimizer.safetensors"] {
        let bytes = std::fs::read(checkpoint.join(file))?;
        for (name, view) in safetensors::SafeTensors::deserialize(&bytes)?.tensors() {
            all.insert(format!("{file}:{name}"), view.data().to_vec());
        }
    }
    Ok(all)
}

#[test]
fn a_lora_run_on_two_ranks_ends_with_the_adapter_of_one_process_bit_for_bit() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let base = dir.path().join("base");
    ok(common::train(&corpus, &base, &["--max-iters", "10"])?)?;
    let base = base.to_string_lossy().into_owned();
    let lora = [
        "--init-from",
        base.as_str(),
        "--lora-r",
        "4",
        "--lora-targets",
        "c_attn,c_proj",
        "--lora-dropout",
        "0.1",
    ];
    let more = args(&[&lora[..], &["--max-iters", "20", "--parallel", "shards"]].concat());
    let one = dir.path().join("one");
    ok(common::train(
        &corpus,
        &one,
        &[more.as_slice(), &["--threads", "2"]].concat(),
    )?)?;
    let two = dir.path().join("two");
    ok(train_ranks(
        2,
        &corpus,
        &two,
        &[more.as_slice(), &["--threads", "1"]].concat(),
    )?)?;
    for step in [10, 20] {
        let (a, b) = (
            adapter_tensors(&step_dir(&one, step))?,
            adapter_tensors(&step_dir(&two, step))?,
        );
        assert_eq!(a.len(), b.len());
        assert!(a.len() > 2, "an adapter and its moments");
        for (name, values) in &a {
            assert!(values == &b[name], "step {step}: {name} differs");
        }
    }
    assert_eq!(common::train_losses(&one)?, common::train_losses(&two)?);
    Ok(())
}

#[test]
fn a_run_resumes_on_another_number_of_ranks() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let whole = dir.path().join("whole");
    let run = dir.path().join("run");
    let to = |n: &'static str| args(&["--max-iters", n, "--lr-decay-iters", "30", "--parallel", "shards"]);
    ok(common::train(
        &corpus,
        &whole,
        &[to("30").as_slice(), &["--threads", "2"]].concat(),
    )?)?;
    // 2 ranks to step 10, one process with two shards to 20: the same sums, bit for bit.
    ok(train_ranks(
        2,
        &corpus,
        &run,
        &[to("10").as_slice(), &["--threads", "1"]].concat(),
    )?)?;
    ok(common::train(
        &corpus,
        &run,
        &[to("20").as_slice(), &["--threads", "2", "--resume"]].concat(),
    )?)?;
    assert!(tensors(&step_dir(&whole, 20))? == tensors(&step_dir(&run, 20))?);
    assert_eq!(common::state(&run)?["world_size"], 1);
    // Then 4 ranks to 30: the gradients summed in another order, within float reassociation.
    ok(train_ranks(
        4,
        &corpus,
        &run,
        &[to("30").as_slice(), &["--threads", "1", "--resume"]].concat(),
    )?)?;
    assert_eq!(common::state(&run)?["world_size"], 4);
    let diff = max_difference(&step_dir(&whole, 30), &step_dir(&run, 30))?;
    assert!(diff < 1e-4, "4 ranks drifted by {diff} from one process in 10 steps");
    Ok(())
}

/// The process ids of the ranks of the run writing to `out`, by rank.
fn ranks_of(out: &Path) -> BTreeMap<usize, u32> {
    let mut ranks = BTreeMap::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return ranks;
    };
    let out = out.to_string_lossy().into_owned();
    for p in procs.flatten() {
        let Ok(pid) = p.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let environ = std::fs::read(p.path().join("environ")).unwrap_or_default();
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into())
            .collect();
        if args.first().map(String::as_str) != Some(BIN) || !args.contains(&out) {
            continue;
        }
        let rank = environ
            .split(|&b| b == 0)
            .find_map(|v| v.strip_prefix(b"OMPI_COMM_WORLD_RANK="))
            .and_then(|r| String::from_utf8_lossy(r).parse().ok());
        if let Some(rank) = rank {
            ranks.insert(rank, pid);
        }
    }
    ranks
}

/// Waits for the job to end (within `limit`), and returns its status and stderr.
fn ended(mut job: Child, limit: Duration) -> anyhow::Result<(std::process::ExitStatus, String, Duration)> {
    let start = Instant::now();
    loop {
        if job.try_wait()?.is_some() {
            let out = job.wait_with_output()?;
            return Ok((out.status, stderr(&out), start.elapsed()));
        }
        if start.elapsed() > limit {
            job.kill()?;
            anyhow::bail!("the job was still running {limit:?} later");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A 2-rank job of many steps, started in the background, once it has saved a checkpoint past
/// step 10.
fn long_job(corpus: &Path, out: &Path) -> anyhow::Result<Child> {
    let more = args(&["--max-iters", "100000", "--lr-decay-iters", "100000", "--threads", "1"]);
    let mut job = mpirun()
        .args(["-np", "2", BIN])
        .args(train_args(corpus, out, &more))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let past_10 = || newest_step(out).is_some_and(|s| s >= 10);
    common::wait_for(&mut job, "a checkpoint past step 10", Duration::from_secs(120), past_10)?;
    Ok(job)
}

fn newest_step(out: &Path) -> Option<usize> {
    common::latest_step(out).map(|s| s as usize)
}

/// Resumes the killed or stopped run in `out` to `steps` past its newest checkpoint, and checks
/// it against one process that trained there uninterrupted.
fn resumes_exactly(corpus: &Path, out: &Path, dir: &Path) -> anyhow::Result<()> {
    let from = newest_step(out).ok_or_else(|| anyhow::anyhow!("no checkpoint left in {}", out.display()))?;
    let to = (from + 10).to_string();
    let more = args(&["--max-iters", &to, "--lr-decay-iters", "100000"]);
    ok(train_ranks(
        2,
        corpus,
        out,
        &[more.as_slice(), &["--threads", "1", "--resume"]].concat(),
    )?)?;
    let whole = dir.join("whole");
    ok(common::train(
        corpus,
        &whole,
        &[more.as_slice(), &["--threads", "2", "--parallel", "shards"]].concat(),
    )?)?;
    assert!(
        tensors(&step_dir(&whole, from + 10))? == tensors(&step_dir(out, from + 10))?,
        "resumed from step {from}, the run left the uninterrupted one"
    );
    Ok(())
}

#[cfg(unix)]
#[test]
fn a_killed_rank_ends_the_job_naming_it_and_the_run_resumes_exactly() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let out = dir.path().join("run");
    let job = long_job(&corpus, &out)?;
    let ranks = ranks_of(&out);
    let victim = *ranks
        .get(&1)
        .ok_or_else(|| anyhow::anyhow!("rank 1 not found among {ranks:?}"))?;
    Command::new("kill").args(["-KILL", &victim.to_string()]).status()?;
    let (status, log, took) = ended(job, Duration::from_secs(30))?;
    assert!(!status.success());
    assert!(took < Duration::from_secs(10), "the job took {took:?} to end");
    assert!(log.contains("rank 1"), "the message does not name rank 1: {log}");
    assert!(ranks_of(&out).is_empty(), "ranks outlived the job");
    resumes_exactly(&corpus, &out, dir.path())
}

#[cfg(unix)]
#[test]
fn sigterm_to_mpirun_stops_every_rank_at_one_step_and_rank_0_saves_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let out = dir.path().join("run");
    let job = long_job(&corpus, &out)?;
    Command::new("kill").args(["-TERM", &job.id().to_string()]).status()?;
    // Open MPI's mpirun itself ends with 1 once signalled, whatever its ranks do: the run's own
    // report is the line below and the checkpoint.
    let (_, log, _) = ended(job, Duration::from_secs(60))?;
    let saved = log
        .lines()
        .find_map(|l| l.strip_prefix("interrupted: checkpoint saved at step "))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<usize>().ok());
    let Some(saved) = saved else {
        panic!("no checkpoint of the interruption reported: {log}");
    };
    assert_eq!(log.matches("interrupted:").count(), 1, "rank 0 alone reports: {log}");
    assert_eq!(newest_step(&out), Some(saved));
    assert!(step_dir(&out, saved).is_dir());
    resumes_exactly(&corpus, &out, dir.path())
}

#[test]
fn ranks_started_with_different_flags_are_refused_naming_the_difference() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let out = dir.path().join("run");
    let rank = |lr: &str| train_args(&corpus, &out, &["--max-iters", "5", "--learning-rate", lr]);
    let result = mpirun()
        .args(["-np", "1", BIN])
        .args(rank("1e-3"))
        .args([":", "-np", "1", BIN])
        .args(rank("2e-3"))
        .output()?;
    assert!(!result.status.success());
    let log = stderr(&result);
    assert!(log.contains("rank 1 has flags"), "{log}");
    assert!(
        log.contains("--learning-rate 2e-3") && log.contains("--learning-rate 1e-3"),
        "{log}"
    );
    assert_eq!(log.matches("were not started alike").count(), 1, "printed once: {log}");
    assert!(!out.join("checkpoints").exists(), "a refused job wrote a checkpoint");
    Ok(())
}

#[test]
fn ranks_with_different_weights_are_caught_at_the_start() -> anyhow::Result<()> {
    // The same flags, but `--init-from base` is another checkpoint in each rank's directory.
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    for (rank, seed) in [("a", "1"), ("b", "2")] {
        let base = dir.path().join(rank).join("base");
        std::fs::create_dir_all(base.parent().unwrap_or(dir.path()))?;
        ok(common::train(&corpus, &base, &["--max-iters", "1", "--seed", seed])?)?;
    }
    let out = dir.path().join("run");
    let ranked = |rank: &str| {
        let mut args = vec!["-np".to_string(), "1".into(), "--wdir".into()];
        args.push(dir.path().join(rank).to_string_lossy().into_owned());
        args.push(BIN.into());
        args.extend(train_args(&corpus, &out, &["--max-iters", "5", "--init-from", "base"]));
        args
    };
    let result = mpirun().args(ranked("a")).arg(":").args(ranked("b")).output()?;
    assert!(!result.status.success());
    let log = stderr(&result);
    assert!(
        log.contains("at step 0 the parameters of rank 1 differ from rank 0's"),
        "{log}"
    );
    Ok(())
}

#[test]
fn a_batch_that_does_not_divide_among_the_ranks_is_refused_naming_both() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let out = train_ranks(
        2,
        &support::shakespeare_path(),
        &dir.path().join("run"),
        &["--batch-size", "5"],
    )?;
    assert!(!out.status.success());
    let log = stderr(&out);
    assert_eq!(
        log.matches("--batch-size 5 does not divide among 2 ranks").count(),
        1,
        "{log}"
    );
    Ok(())
}

/// A launcher whose processes the MPI library does not join (here MPICH's `PMI_SIZE` to an Open
/// MPI build, which then starts each process as a job of its own) is refused before any training,
/// instead of N runs writing one `--out`.
#[test]
fn a_launcher_that_the_mpi_library_does_not_answer_is_refused() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let run = dir.path().join("run");
    let out = Command::new(BIN)
        .args(train_args(&support::shakespeare_path(), &run, &[]))
        .env("PMI_SIZE", "2")
        .output()?;
    assert!(!out.status.success());
    let log = stderr(&out);
    assert!(
        log.contains("the launcher started 2 processes (PMI_SIZE=2) but MPI joined 1 into this job"),
        "{log}"
    );
    assert!(!run.join("metrics.jsonl").exists(), "it trained");
    Ok(())
}

/// Two network namespaces joined by a veth pair: two "hosts" on one machine, removed on drop.
struct TwoHosts {
    names: [String; 2],
    addresses: [String; 2],
}

impl TwoHosts {
    fn new() -> anyhow::Result<Self> {
        let id = std::process::id();
        let names = [format!("gpta{id}"), format!("gptb{id}")];
        let subnet = format!("10.77.{}", id % 250);
        let addresses = [format!("{subnet}.1"), format!("{subnet}.2")];
        let hosts = Self { names, addresses };
        let [a, b] = &hosts.names;
        let (veth_a, veth_b) = (format!("va{id}"), format!("vb{id}"));
        let ip = |args: &[&str]| -> anyhow::Result<()> {
            let out = Command::new("ip").args(args).output()?;
            anyhow::ensure!(out.status.success(), "ip {}: {}", args.join(" "), stderr(&out));
            Ok(())
        };
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&["link", "add", &veth_a, "type", "veth", "peer", "name", &veth_b])?;
        for ((ns, veth), address) in hosts.names.iter().zip([&veth_a, &veth_b]).zip(&hosts.addresses) {
            ip(&["link", "set", veth, "netns", ns])?;
            ip(&["-n", ns, "addr", "add", &format!("{address}/24"), "dev", veth])?;
            ip(&["-n", ns, "link", "set", veth, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

#[cfg_attr(
    not(gpt_test_netns),
    ignore = "needs root and network namespaces (`ip netns add` failed when the tests were built)"
)]
#[test]
fn two_ranks_on_two_hosts_over_tcp_end_with_the_weights_of_one_process() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let (one, more) = one_process_of_20_steps(&corpus, dir.path())?;
    let hosts = TwoHosts::new()?;
    let two = dir.path().join("two");
    let subnet = format!("{}.0/24", &hosts.addresses[0][..hosts.addresses[0].len() - 2]);
    let agent = support::repo("tests/fixtures/netns_rsh_agent.sh");
    // mpirun runs in the first namespace; it reaches the second through the agent, as it would
    // reach another machine through ssh, and the ranks talk over TCP on the veth pair only.
    let mut mpirun = Command::new("ip");
    mpirun.args(["netns", "exec", &hosts.names[0], "mpirun"]);
    let out = with_mpirun_settings(mpirun)
        .args(["--host", &format!("{}:1,{}:1", hosts.addresses[0], hosts.addresses[1])])
        .args(["--mca", "plm_rsh_agent", &agent.to_string_lossy()])
        .args(["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", &subnet])
        .args(["--mca", "oob_tcp_if_include", &subnet, "-np", "2"])
        // Each "host" would bind its first rank to its core 0: here the same core for both.
        .args(["--bind-to", "none"])
        .args(["-x", "OMPI_ALLOW_RUN_AS_ROOT", "-x", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"])
        .env("RUST_LOG", "info")
        .arg(BIN)
        .args(train_args(
            &corpus,
            &two,
            &[more.as_slice(), &["--threads", "1"]].concat(),
        ))
        .output()?;
    let out = ok(out)?;
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), stderr(&out));
    // Two hosts: by default the gradients are summed during the backward pass.
    assert!(log.contains("hosts=2 overlap_allreduce=true"), "{log}");
    assert!(tensors(&step_dir(&one, 20))? == tensors(&step_dir(&two, 20))?);
    Ok(())
}

/// A job script as a Slurm user writes one (docs/data-parallel.md): `sbatch` allocates
/// the tasks, `srun` inside the script starts one rank each, with PMIx handing the ranks to MPI.
/// `sbatch` with a job script of 2 tasks that runs `gpt-train` with `args` under `srun`, its
/// output in `dir/job.log`, and `sbatch`'s own flags `flags`.
fn sbatch(dir: &Path, args: &[String], flags: &[&str]) -> anyhow::Result<Output> {
    let script = dir.join("job.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n#SBATCH --ntasks=2 --output={}\nexec srun --mpi=pmix {BIN} {}\n",
            dir.join("job.log").display(),
            args.join(" ")
        ),
    )?;
    Ok(Command::new("sbatch")
        .args(flags)
        .args(["--job-name", "gpt-train-test"])
        .arg(&script)
        .env("RUST_LOG", "info")
        .output()?)
}

#[cfg_attr(
    not(gpt_test_slurm),
    ignore = "needs a Slurm cluster (`sinfo` answered no idle node when the tests were built; \
              tests/fixtures/slurm_cluster.sh starts one, as .ci/mpi.sh does)"
)]
#[test]
fn two_ranks_started_by_srun_in_an_sbatch_job_end_with_the_weights_of_one_process() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let (one, more) = one_process_of_20_steps(&corpus, dir.path())?;
    let two = dir.path().join("two");
    let args = train_args(&corpus, &two, &[more.as_slice(), &["--threads", "1"]].concat());
    let out = sbatch(dir.path(), &args, &["--wait"])?;
    let job_log = std::fs::read_to_string(dir.path().join("job.log")).unwrap_or_default();
    anyhow::ensure!(out.status.success(), "the job failed: {}\n{job_log}", stderr(&out));
    assert!(
        job_log.contains("ranks=2"),
        "the job did not train on 2 ranks: {job_log}"
    );
    assert!(tensors(&step_dir(&one, 20))? == tensors(&step_dir(&two, 20))?);
    Ok(())
}

/// `scancel`, as Slurm does at a job's time limit or on preemption: SIGTERM to every rank, which
/// agree on the step; rank 0 saves it, and the run resumes exactly (here under `mpirun`).
#[cfg_attr(
    not(gpt_test_slurm),
    ignore = "needs a Slurm cluster (`sinfo` answered no idle node when the tests were built; \
              tests/fixtures/slurm_cluster.sh starts one, as .ci/mpi.sh does)"
)]
#[test]
fn scancel_stops_every_rank_at_one_step_and_rank_0_saves_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let corpus = support::shakespeare_path();
    let out = dir.path().join("run");
    let more = args(&["--max-iters", "100000", "--lr-decay-iters", "100000", "--threads", "1"]);
    let submitted = sbatch(dir.path(), &train_args(&corpus, &out, &more), &["--parsable"])?;
    let submitted = ok(submitted)?;
    let job = String::from_utf8_lossy(&submitted.stdout).trim().to_string();
    let log = dir.path().join("job.log");
    let started = Instant::now();
    while newest_step(&out).is_none_or(|s| s < 10) {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "no checkpoint past step 10 within 2 minutes: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    ok(Command::new("scancel").arg(&job).output()?)?;
    let ended = || !runs_writing(&out);
    let started = Instant::now();
    while !ended() {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(60),
            "the ranks outlived scancel by a minute"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let job_log = std::fs::read_to_string(&log)?;
    let saved = job_log
        .lines()
        .find_map(|l| l.strip_prefix("interrupted: checkpoint saved at step "))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<usize>().ok());
    let Some(saved) = saved else {
        panic!("no checkpoint of the interruption reported: {job_log}");
    };
    assert_eq!(
        job_log.matches("interrupted:").count(),
        1,
        "rank 0 alone reports: {job_log}"
    );
    assert_eq!(newest_step(&out), Some(saved));
    resumes_exactly(&corpus, &out, dir.path())
}

/// Whether a gpt-train writing to `out` still runs (under any launcher).
fn runs_writing(out: &Path) -> bool {
    let out = out.to_string_lossy().into_owned();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return false;
    };
    procs.flatten().any(|p| {
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        let args: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into())
            .collect();
        args.first().map(String::as_str) == Some(BIN) && args.contains(&out)
    })
}
