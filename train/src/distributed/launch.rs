//! Whether a launcher started this process as one rank of several: read from the variables
//! the launchers set, so that a build without MPI can tell, and a build with it only starts MPI
//! under a launcher (a process started alone stays one, without MPI's start-up).

/// How many processes a launcher started, and which variable says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launched {
    pub size: usize,
    /// `VARIABLE=value`, for messages.
    pub source: String,
}

/// The job size as the launcher that started this process states it: Open MPI's `mpirun`
/// (`OMPI_COMM_WORLD_SIZE`), MPICH's Hydra and Slurm's PMI-2 (`PMI_SIZE`), Slurm's `srun`
/// (`SLURM_STEP_NUM_TASKS`, set in a job step's tasks and not in the batch script); `None`
/// outside a launcher.
pub fn launched_ranks() -> Option<Launched> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"]
        .into_iter()
        .find_map(|var| {
            let value = std::env::var(var).ok()?;
            let size = value.trim().parse().ok()?;
            Some(Launched {
                size,
                source: format!("{var}={value}"),
            })
        })
}
