//! The bandwidth of the gradient sum a data-parallel job runs each step, as `gpt-train` runs it
//! (`World::sum_grads`: MPI's allreduce in buckets), for a few sizes up to GPT-2 small's gradients
//! (124M f32 values, in its 148 tensors' sizes). Run under the launcher:
//!   cargo build --release -p gpt-train --features mpi --example allreduce
//!   mpirun -np 2 target/release/examples/allreduce [REPEATS] [BUCKET_MB]
//! The last line times what CPU training runs instead: the sum of GPT-2 small's gradients onto
//! the rank owning each tensor, then each owner's parameters sent to the others
//! (`World::reduce_to_owners` and `World::broadcast_from_owners`).
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
    let shapes = shapes_of(&model)?;
    let cases: Vec<(String, Vec<Vec<usize>>)> = vec![
        ("4 MB, one tensor".into(), vec![vec![1 << 20]]),
        ("64 MB, one tensor".into(), vec![vec![1 << 24]]),
        (format!("GPT-2 small's gradients ({} tensors)", shapes.len()), shapes),
    ];
    for (name, shapes) in cases.iter() {
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
    let mut grads: Vec<Tensor> = shapes_of(&model)?
        .iter()
        .map(|s| Tensor::ones(s.as_slice(), candle_core::DType::F32, &Device::Cpu))
        .collect::<candle_core::Result<_>>()?;
    let sizes: Vec<usize> = grads.iter().map(Tensor::elem_count).collect();
    let owners = gpt_train::distributed::owners(&sizes, world.size());
    let bytes: usize = sizes.iter().sum::<usize>() * 4;
    let (mut reduce, mut broadcast) = (Vec::new(), Vec::new());
    for _ in 0..repeats + 1 {
        world.barrier();
        let start = std::time::Instant::now();
        world.reduce_to_owners(&mut grads, &owners)?;
        let reduced = std::time::Instant::now();
        world.broadcast_from_owners(&grads, &owners)?;
        reduce.push((reduced - start).as_secs_f64());
        broadcast.push(reduced.elapsed().as_secs_f64());
    }
    for times in [&mut reduce, &mut broadcast] {
        times.remove(0);
        times.sort_by(f64::total_cmp);
    }
    if world.is_root() {
        println!(
            "GPT-2 small, owned update: {:.1} MB summed onto owners in {:.2} ms, sent from owners in {:.2} ms ({} ranks, medians of {repeats})",
            bytes as f64 / 1e6,
            reduce[repeats / 2] * 1e3,
            broadcast[repeats / 2] * 1e3,
            world.size()
        );
    }
    Ok(())
}

fn shapes_of(model: &gpt::Gpt) -> Result<Vec<Vec<usize>>> {
    Ok(model
        .named_tensors()?
        .into_iter()
        .map(|(_, t)| t.dims().to_vec())
        .collect())
}
