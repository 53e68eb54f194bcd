//! NCCL's allreduce for the gradients of ranks on CUDA GPUs: one communicator per job, each rank
//! on its own GPU, NCCL's unique id made by rank 0 and handed to the others over MPI (as llm.c
//! does), every sum queued on the stream candle runs the model on.
//!
//! NCCL is loaded when the first gradients are summed (`libnccl.so.2`, with `dlopen`), not
//! through cudarc's `nccl` module: candle builds cudarc with `dynamic-linking`, under which
//! cudarc's NCCL links `-lnccl` when the binary is built, and this build must not need NCCL
//! installed (nor a CPU-only user's machine have it). The few entry points used are declared here
//! as NCCL's `nccl.h` (2.x) declares them.

use std::ffi::{c_char, c_int, c_void, CStr};

use anyhow::{bail, Result};
use candle_core::cuda_backend::cudarc::driver::DevicePtrMut;
use candle_core::{CudaStorage, Device, Layout};

use super::World;

type NcclResult = c_int;
type RawComm = *mut c_void;
/// `ncclFloat32` and `ncclSum` of `nccl.h`.
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId([c_char; 128]);

type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type CommInitRank = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult;
type AllReduce =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> NcclResult;
type Group = unsafe extern "C" fn() -> NcclResult;
type ErrorString = unsafe extern "C" fn(NcclResult) -> *const c_char;

/// NCCL's entry points, from the loaded library (which stays loaded for the process's life).
struct Library {
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    all_reduce: AllReduce,
    group_start: Group,
    group_end: Group,
    get_error_string: ErrorString,
}

impl Library {
    fn load() -> Result<Self> {
        // SAFETY: dlopen with a NUL-terminated name; a null handle is checked below.
        let handle = unsafe { libc::dlopen(c"libnccl.so.2".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            bail!(
                "NCCL could not be loaded (libnccl.so.2: {}); install it to train on GPUs across ranks (Debian and \
                 Ubuntu: `apt install libnccl2` from NVIDIA's CUDA repository; or pip's nvidia-nccl-cu12 / \
                 nvidia-nccl-cu13, its lib/ directory on LD_LIBRARY_PATH)",
                dl_error()
            );
        }
        let symbol = |name: &CStr| -> Result<*mut c_void> {
            // SAFETY: `handle` is a live library handle and `name` is NUL-terminated.
            let ptr = unsafe { libc::dlsym(handle, name.as_ptr()) };
            if ptr.is_null() {
                bail!("libnccl.so.2 has no {} (NCCL 2.x expected)", name.to_string_lossy());
            }
            Ok(ptr)
        };
        // SAFETY (each transmute): the symbol is NCCL's function of that name, whose C signature
        // in nccl.h (2.x) is the function pointer type it becomes.
        unsafe {
            Ok(Self {
                get_unique_id: std::mem::transmute::<*mut c_void, GetUniqueId>(symbol(c"ncclGetUniqueId")?),
                comm_init_rank: std::mem::transmute::<*mut c_void, CommInitRank>(symbol(c"ncclCommInitRank")?),
                all_reduce: std::mem::transmute::<*mut c_void, AllReduce>(symbol(c"ncclAllReduce")?),
                group_start: std::mem::transmute::<*mut c_void, Group>(symbol(c"ncclGroupStart")?),
                group_end: std::mem::transmute::<*mut c_void, Group>(symbol(c"ncclGroupEnd")?),
                get_error_string: std::mem::transmute::<*mut c_void, ErrorString>(symbol(c"ncclGetErrorString")?),
            })
        }
    }

    /// `Ok` for `ncclSuccess`, else an error with NCCL's own words for `code`.
    fn check(&self, code: NcclResult, what: &str) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(code)) };
        bail!("NCCL {what}: {} (code {code})", text.to_string_lossy())
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl call.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        return "not found".into();
    }
    // SAFETY: non-null, NUL-terminated (above).
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

/// The job's NCCL communicator, on this rank's GPU.
pub struct Comm {
    nccl: Library,
    comm: RawComm,
}

impl Comm {
    /// Joins every rank's GPU into one communicator; collective (every rank calls it together).
    pub fn init(world: &World, device: &Device) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            bail!("NCCL sums gradients on CUDA devices only");
        };
        let nccl = Library::load()?;
        let mut id = UniqueId([0; 128]);
        if world.is_root() {
            // SAFETY: `id` is a valid place for an ncclUniqueId.
            nccl.check(unsafe { (nccl.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
        }
        let mut bytes: Vec<u8> = id.0.iter().map(|&b| b as u8).collect();
        world.broadcast_bytes(0, &mut bytes);
        for (slot, byte) in id.0.iter_mut().zip(bytes) {
            *slot = byte as c_char;
        }
        // NCCL takes the device from the context current on this thread.
        cuda.cuda_stream().context().bind_to_thread()?;
        let mut comm: RawComm = std::ptr::null_mut();
        let (size, rank) = (world.size() as c_int, world.rank() as c_int);
        // SAFETY: `comm` is a valid out-pointer; `id` is the one rank 0 made, on every rank.
        nccl.check(
            unsafe { (nccl.comm_init_rank)(&mut comm, size, id, rank) },
            "ncclCommInitRank",
        )?;
        Ok(Self { nccl, comm })
    }

    /// Queues the sums of [`SumInPlace`]s between these as one launch.
    pub fn group<T>(&self, work: impl FnOnce() -> Result<T>) -> Result<T> {
        // SAFETY: group calls take no arguments; each start is paired with the end below.
        self.nccl
            .check(unsafe { (self.nccl.group_start)() }, "ncclGroupStart")?;
        let result = work();
        // SAFETY: as above.
        self.nccl.check(unsafe { (self.nccl.group_end)() }, "ncclGroupEnd")?;
        result
    }
}

/// Sums a CUDA tensor across the ranks in place, queued on its device's stream.
pub struct SumInPlace<'a>(pub &'a Comm);

impl candle_core::InplaceOp1 for SumInPlace<'_> {
    fn name(&self) -> &'static str {
        "nccl-sum"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("NCCL sums CUDA tensors only")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("a gradient summed by NCCL must be contiguous")
        };
        let stream = storage.device.cuda_stream();
        let slice = storage.as_cuda_slice_mut::<f32>()?;
        let (ptr, _sync) = slice.device_ptr_mut(&stream);
        let ptr = (ptr + (start * std::mem::size_of::<f32>()) as u64) as *mut c_void;
        let Comm { nccl, comm } = self.0;
        // SAFETY: `ptr` addresses `end - start` f32 of this device's memory, borrowed mutably for
        // the call (in place: NCCL allows send == receive); the stream is the one candle queues
        // this tensor's work on, so the sum runs after the work that wrote it and before any
        // that reads it.
        let code = unsafe {
            (nccl.all_reduce)(
                ptr,
                ptr,
                end - start,
                NCCL_FLOAT32,
                NCCL_SUM,
                *comm,
                stream.cu_stream() as *mut c_void,
            )
        };
        nccl.check(code, "ncclAllReduce")
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    }
}
