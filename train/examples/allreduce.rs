//! The bandwidth of the gradient sum a data-parallel job runs each step, as `gpt-train` runs it
//! (`World::sum_grads`: MPI's allreduce in buckets), for a few sizes up to GPT-2 small's gradients
//! (124M f32 values, in its 148 tensors' sizes). Run under the launcher:
//!   cargo build --release -p gpt-train --features mpi --example allreduce
//!   mpirun -np 2 target/release/examples/allreduce [REPEATS] [BUCKET_MB]
//! Prints, on rank 0, each size's median time, its algorithm bandwidth (bytes / time) and its bus
//! bandwidth (× 2(n−1)/n, the bytes each rank sends and receives in a ring allreduce, as
//! nccl-tests reports it), comparable with the link's rate.

use anyhow::Result;
use candle_core::{Device, Tensor};
use gpt_train::distributed::World;

fn main() -> Result<()> {
    let world = World::init()?;
    let mut args = std::env::args().skip(1);
    let repeats: usize = args.next().map_or(Ok(5), |a| a.parse())?;
    if let Some(mb) = args.next() {
        world.set_bucket_mb(mb.parse()?);
    }
    let gpt2 = gpt::Config::gpt2_small();
    let model = gpt::Gpt::new(
        candle_nn::VarBuilder::from_varmap(&candle_nn::VarMap::new(), candle_core::DType::F32, &Device::Cpu),
        &gpt2,
    )?;
    let shapes: Vec<Vec<usize>> = model
        .named_tensors()?
        .into_iter()
        .map(|(_, t)| t.dims().to_vec())
        .collect();
    let cases: Vec<(String, Vec<Vec<usize>>)> = vec![
        ("4 MB, one tensor".into(), vec![vec![1 << 20]]),
        ("64 MB, one tensor".into(), vec![vec![1 << 24]]),
        (format!("GPT-2 small's gradients ({} tensors)", shapes.len()), shapes),
    ];
    for (name, shapes) in cases {
        let mut grads: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::ones(s.as_slice(), candle_core::DType::F32, &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let bytes: usize = grads.iter().map(|g| g.elem_count() * 4).sum();
        let mut times = Vec::new();
        for _ in 0..repeats + 1 {
            world.barrier();
            let start = std::time::Instant::now();
            world.sum_grads(&mut grads)?;
            times.push(start.elapsed().as_secs_f64());
        }
        times.remove(0); // the first pays for first touches
        times.sort_by(f64::total_cmp);
        let (median, fastest) = (times[times.len() / 2], times[0]);
        let n = world.size() as f64;
        if world.is_root() {
            println!(
                "{name}: {:.1} MB in {:.2} ms (fastest {:.2}): algorithm {:.2} GB/s, bus {:.2} GB/s ({} ranks, median of {repeats})",
                bytes as f64 / 1e6,
                median * 1e3,
                fastest * 1e3,
                bytes as f64 / median / 1e9,
                bytes as f64 * 2.0 * (n - 1.0) / n / median / 1e9,
                world.size()
            );
        }
    }
    Ok(())
}
