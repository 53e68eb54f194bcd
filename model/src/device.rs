//! `--device auto|cpu|cuda[:N]`, shared by the binaries.

use candle_core::Device;

use crate::error::{Error, Result};

/// Parses a device name. `auto` is the first CUDA GPU when this build has CUDA and one answers,
/// else the CPU. Asking for CUDA from a CPU-only build is an error that says how to get one.
pub fn parse_device(spec: &str) -> Result<Device> {
    let spec = spec.trim().to_ascii_lowercase();
    let ordinal = match spec.as_str() {
        "cpu" => return Ok(Device::Cpu),
        "auto" => {
            return Ok(if candle_core::utils::cuda_is_available() {
                Device::new_cuda(0)
                    .inspect(without_event_tracking)
                    .unwrap_or(Device::Cpu)
            } else {
                Device::Cpu
            })
        }
        "cuda" | "gpu" => 0,
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => {
                return Err(Error::Device(format!(
                    "unknown device {spec:?}; expected auto, cpu, cuda or cuda:N"
                )))
            }
        },
    };
    if !candle_core::utils::cuda_is_available() {
        return Err(Error::Device(format!(
            "cuda:{ordinal} requested, but this binary was built without CUDA support; rebuild with \
             `cargo build --release --features cuda` (see docs/serving.md), or use --device cpu"
        )));
    }
    let device = Device::new_cuda(ordinal).map_err(|e| Error::Device(format!("cuda:{ordinal}: {e}")))?;
    without_event_tracking(&device);
    Ok(device)
}

/// Stops cudarc creating two CUDA events for every buffer it allocates (and destroying them when
/// it is freed): a few microseconds of driver calls per op, where a training step runs about a
/// thousand. The events order a buffer's uses across streams, and candle's device does all its
/// work on one stream, where cudarc never records or waits on them. `GPT_CUDA_EVENTS=1` keeps them.
fn without_event_tracking(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        if std::env::var("GPT_CUDA_EVENTS").map_or(true, |v| v != "1") {
            // SAFETY: nothing here creates a second stream (the events would order uses across
            // streams); on one stream, cudarc neither records nor waits on them.
            unsafe { cuda.disable_event_tracking() }
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
}

/// A short name for logs: `cpu` or `cuda:N`.
pub fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Keeps freed memory in the process. Candle allocates a new buffer for every op's output; glibc
/// hands blocks over 128 KiB back to the OS when freed, so each training step faulted its
/// activations and gradients back in page by page (a third of a CPU step in a profile). Blocks
/// of every size come from the heap (no `mmap`: glibc maps anything over its 32 MiB ceiling
/// anew at each use, and a whole batch's activations are larger: with the step's products split
/// over the threads, clearing those pages cost ~15% of a GPT-2-small step), and the heap is kept.
pub fn tune_cpu_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes glibc's allocation thresholds; called before any threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20); // the largest glibc allows
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1); // never: see above
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}

/// The allocator for a long-running server: blocks of 1 MiB or more (request-sized transients:
/// logits, attention maps, large response bodies) are mapped for each use and handed back to the
/// OS when freed (until [`keep_step_buffers`] raises the bound to the engine's step's activations),
/// everything smaller comes from the heap,
/// which is trimmed only when 64 MiB lie free at its top. [`tune_cpu_allocator`]'s
/// settings (every block under 32 MiB kept in the heap, never trimmed) suit training's steps of
/// one shape; under a server's mixed load the heap kept the peak of every burst and fragmented,
/// and its resident size crept up through a 30-minute soak (`BENCHMARKS.md`). A fixed threshold
/// also stops glibc raising it to the size of each large block freed. The per-step tensors of a
/// batched decode stay under 1 MiB for GPT-2 small (its 16-row logits, 3.2 MB, are mapped). Set
/// `MALLOC_MMAP_THRESHOLD_` to choose another threshold.
///
/// One heap (arena) for all threads: glibc gives threads arenas of their own (up to 8 per core),
/// and each kept the free blocks of its own bursts: the default model's 30-minute soak held
/// 34-48 MiB free inside the heap and grew 7.4%; with one arena 8.5-13 MiB and 3.1%, 26 MiB less
/// resident (`BENCHMARKS.md`, "Soak"). Small blocks still come from each
/// thread's cache without the arena's lock. Set `MALLOC_ARENA_MAX` to choose another count.
pub fn tune_cpu_allocator_for_serving() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            // SAFETY: mallopt only changes glibc's allocation thresholds; called before any
            // threads start.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
            }
        }
        if std::env::var_os("MALLOC_ARENA_MAX").is_none() {
            // SAFETY: as above; before any threads start, so every thread shares the main arena.
            unsafe {
                libc::mallopt(libc::M_ARENA_MAX, 1);
            }
        }
    }
}

/// Lets blocks up to `bytes` (within 1-32 MiB, glibc's ceiling) come from the heap in a server
/// tuned by [`tune_cpu_allocator_for_serving`]: the engine's step activations, at most a full
/// prefill budget's rows of the widest layer. Mapped for each use, every such block was faulted
/// in page by page and its unmapping flushed the other cores' TLBs: on SmolLM2-135M that took
/// 30% of a prefill's time and doubled a 512-token prompt's time to first token (1029 against
/// 469 ms on EPYC-Zen5, `BENCHMARKS.md`). Blocks of one step's shapes recur step after step, so
/// the heap reuses them rather than fragmenting. Does nothing where `MALLOC_MMAP_THRESHOLD_` is
/// set, or on other C libraries.
pub fn keep_step_buffers(bytes: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        let bytes = bytes.clamp(1 << 20, 32 << 20);
        // SAFETY: mallopt only changes glibc's allocation thresholds, under the arena's lock.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, bytes as libc::c_int);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = bytes;
}

/// Hands the C heap's free pages back to the OS: glibc's `malloc_trim`, which releases whole
/// free pages inside the heap as well as at its top (the automatic trim, `M_TRIM_THRESHOLD`,
/// only shrinks the top, which a live block above the free ones pins). For a server after a
/// burst: its requests' blocks, freed between longer-lived ones, stay resident otherwise. Does
/// nothing on other C libraries.
pub fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory; it takes the arenas' locks itself.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The C heap's bytes: `allocated` to live blocks (mapped ones included), `free` inside the
/// heap (freed blocks not handed back to the OS: what fragmentation holds). glibc's `mallinfo2`,
/// summed over its arenas; `None` on other C libraries. The split tells a leak (allocated grows)
/// from fragmentation (free grows) when a server's resident memory creeps up.
pub fn heap_usage() -> Option<HeapUsage> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let info = unsafe { libc::mallinfo2() };
        Some(HeapUsage {
            allocated: info.uordblks + info.hblkhd,
            free: info.fordblks,
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}

/// See [`heap_usage`].
#[derive(Debug, Clone, Copy)]
pub struct HeapUsage {
    pub allocated: usize,
    pub free: usize,
}

/// Fixes candle's CPU thread count for the process. Unless `RAYON_NUM_THREADS` is set, candle
/// asks the OS for the core count (reading /proc/cpuinfo) on every matmul: a third of a batched
/// decode step in a profile. Call at the start of `main`, before any other thread exists.
pub fn fix_cpu_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_or_explain() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        assert!(parse_device("AUTO").is_ok());
        let err = parse_device("tpu").unwrap_err().to_string();
        assert!(err.contains("tpu") && err.contains("cuda:N"), "{err}");
        assert!(parse_device("cuda:x").is_err());
        if !candle_core::utils::cuda_is_available() {
            let err = parse_device("cuda:0").unwrap_err().to_string();
            assert!(err.contains("--features cuda"), "{err}");
        }
    }
}
