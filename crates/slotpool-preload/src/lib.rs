//! slotpool-preload: `libslotpool_preload.so`, the `LD_PRELOAD` front end of slotpool.
//!
//! ```text
//! LD_PRELOAD=/path/to/libslotpool_preload.so ./my_cuda_program
//! ```
//!
//! serves `cudaMalloc`/`cudaFree`, `cudaMallocAsync`/`cudaFreeAsync` (and their `_ptsz` forms)
//! and `cuMemAlloc_v2`/`cuMemFree_v2` from slotpool's caching allocator, and extends
//! `cudaDeviceEnablePeerAccess` to slotpool's mapped pages; on the simulated backend it also
//! serves `cudaMemcpy[Async]` and `cudaMemset[Async]` of simulated memory. Every other CUDA call, and every
//! pointer slotpool did not hand out, goes to the real library. `docs/preload.md` is the user
//! guide.
//!
//! This library is a thin forwarder and holds no allocator: the allocator is the one in
//! `libslotpool.so`, opened at the first allocation call, so that a process that also loads the
//! PyTorch shim has one allocator, not two.
//!
//! * [`hooks`]: the exported allocation functions; [`copies`]: the exported copy and fill
//!   functions (these two modules define the only symbols this library exports).
//! * [`slotpool`]: finding, opening and starting `libslotpool.so`; the process-wide state.
//! * [`real`]: the real CUDA functions, found with `dlsym(RTLD_NEXT, ..)`.
//! * [`codes`]: status codes and the rules that map slotpool's answers to CUDA's.
//! * [`report`]: counters and the exit line printed when `SLOTPOOL_LOG` is set.
//!
//! Nothing here links libcudart or libcuda (no `DT_NEEDED` on either), nothing runs at load time
//! but recording this library's directory, and no panic crosses the C boundary.

pub mod codes;
pub mod copies;
pub mod hooks;
pub mod real;
pub mod report;
pub mod slotpool;
