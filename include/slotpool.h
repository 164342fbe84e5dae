/*
 * slotpool.h - the C ABI of slotpool, a CUDA caching memory allocator.
 *
 * Link with -lslotpool (libslotpool.so, SONAME libslotpool.so.0) or libslotpool.a;
 * scripts/install.sh installs both with slotpool.pc and a CMake package (slotpool::slotpool).
 * See docs/c-api.md for a guide; this header documents every call.
 *
 * Conventions, for every function below unless it says otherwise:
 *
 *  - Return value: an sp_status. SP_OK (0) on success; on failure an error code, and
 *    sp_last_error_message() describes the failure. A failed call changes no allocator state
 *    (an out-pointer may have been set to NULL/0, as documented).
 *  - Thread safety: every function may be called from any thread at any time, concurrently.
 *    Calls on different streams, pools and devices do not contend. The caller's own objects
 *    are the caller's to order: a pointer freed twice at once is one success and one
 *    SP_ERR_UNKNOWN_POINTER; allocations a restore frees must not be in use elsewhere; handles
 *    may be used while freed (see the graph-memory section); sp_check_invariants and
 *    sp_snapshot_json are exact only while no other thread changes the device. docs/c-api.md
 *    lists the rules.
 *  - Out-pointers are required (NULL -> SP_ERR_INVALID_ARGUMENT) unless marked "may be NULL".
 *  - Devices are ordinals 0..count-1 (sp_device_count); any other value ->
 *    SP_ERR_INVALID_ARGUMENT. Where "-1: every device" is noted, -1 means every device in use.
 *  - Streams are opaque 64-bit handles: a cudaStream_t / CUstream cast to uint64_t; 0 is the
 *    legacy default stream.
 *  - Device pointers are never dereferenced by slotpool. A pointer it did not hand out (a host
 *    pointer, a random address, one already freed, a pointer into the middle of an allocation)
 *    -> SP_ERR_UNKNOWN_POINTER.
 *  - Initialisation: the first call other than sp_version, sp_has_feature, sp_status_name,
 *    sp_last_error_message, sp_string_free, sp_is_initialized, sp_config_get_f64,
 *    sp_config_get_str and sp_init initialises the library
 *    from the environment (SLOTPOOL_BACKEND, SLOTPOOL_CONF) if sp_init was not called; if that
 *    fails the call returns SP_ERR_NOT_INITIALIZED with the reason.
 *  - After sp_shutdown, every call that touches allocator state returns SP_ERR_SHUTDOWN.
 *  - No function ever aborts the process or lets a panic cross the boundary (SP_ERR_PANIC).
 */
#ifndef SLOTPOOL_H
#define SLOTPOOL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#define SP_VERSION_MAJOR 0
#define SP_VERSION_MINOR 1
#define SP_VERSION_PATCH 0

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------ */
/* Types                                                                                      */

/** Status of every call. */
typedef enum sp_status {
    SP_OK = 0,
    /** NULL pointer, zero or absurd (> 2^56) size, unknown device, bad enum value or option. */
    SP_ERR_INVALID_ARGUMENT = 1,
    /** No room on the device, under the memory limit or under a pool limit, even after
     *  freeing cached memory. The message says how much is reserved and splits it, each byte
     *  once, into allocated, cached in private pools, and unallocated (cache, fragmentation). */
    SP_ERR_OUT_OF_MEMORY = 2,
    /** Pointer not allocated by slotpool, not the start of an allocation, or already freed. */
    SP_ERR_UNKNOWN_POINTER = 3,
    /** No pool with this id on this device. */
    SP_ERR_UNKNOWN_POOL = 4,
    /** Not valid now: pool already released, no route to end, pool already routed to, library
     *  already initialised. */
    SP_ERR_INVALID_STATE = 5,
    /** The backend asked for cannot be used (no CUDA driver or device). */
    SP_ERR_BACKEND_UNAVAILABLE = 6,
    /** The backend failed (a CUDA driver error; the message has the code and name). */
    SP_ERR_DEVICE = 7,
    /** Initialisation from the environment failed (the message says why). */
    SP_ERR_NOT_INITIALIZED = 8,
    /** sp_shutdown was called. */
    SP_ERR_SHUTDOWN = 9,
    /** Internal error: a panic was caught at the C boundary. Please report it. */
    SP_ERR_PANIC = 10,
    /** A configuration string was rejected (unknown key, bad value); nothing was applied. */
    SP_ERR_CONFIG = 11,
    /** The pool is paused (sp_pool_pause): nothing is allocated from it until sp_pool_resume. */
    SP_ERR_POOL_PAUSED = 12
} sp_status;

/** A pool id, layout-compatible with PyTorch's MempoolId_t (std::pair<uint64_t, uint64_t>):
 *  {0,0} is the default pool, {n,0} capture-private pools, {0,n} user pools
 *  (torch.cuda.MemPool, graph_pool_handle), {0, 2^63 + n} pools created by sp_pool_named. */
typedef struct sp_pool_id {
    uint64_t a;
    uint64_t b;
} sp_pool_id;

/** Settings of a pool. Zero-initialise for the defaults. */
typedef struct sp_pool_options {
    /** Non-zero: never split cached blocks of this pool (MemPool(no_split=True)). */
    int no_split;
    /** Non-zero: this pool's free blocks may serve other pools that run out of memory
     *  (MemPool(use_on_oom=True)). */
    int use_on_oom;
    /** Most physical bytes the pool may hold; 0 = no limit. */
    uint64_t limit_bytes;
    /** Non-zero: the pool may be paused (sp_pool_pause). All its segments, small ones too, are
     *  then vmm memory, since cudaMalloc memory cannot be given back at a kept address. */
    int pausable;
} sp_pool_options;

/** Which allocations a route sends to its pool. */
typedef enum sp_route_kind {
    /** Every allocation on the device (_cuda_beginAllocateToPool). */
    SP_ROUTE_ALL = 0,
    /** Allocations made by the calling thread (torch.cuda.use_mem_pool); arg is ignored. */
    SP_ROUTE_CURRENT_THREAD = 1,
    /** Allocations on the stream arg (_cuda_beginAllocateCurrentStreamToPool). */
    SP_ROUTE_STREAM = 2,
    /** Allocations on a stream capturing into the CUDA graph capture id arg
     *  (cudaStreamGetCaptureInfo's id; torch.cuda.graph). */
    SP_ROUTE_CAPTURE = 3
} sp_route_kind;

/** One statistic, as in PyTorch's memory_stats(): current value, peak since the last
 *  sp_reset_peak_stats, totals since the last sp_reset_accumulated_stats. */
typedef struct sp_stat {
    int64_t current;
    int64_t peak;
    int64_t allocated;
    int64_t freed;
} sp_stat;

/** A statistic broken down as PyTorch does: all, small_pool (<= 1 MiB blocks), large_pool. */
typedef struct sp_stat_array {
    sp_stat all;
    sp_stat small_pool;
    sp_stat large_pool;
} sp_stat_array;

/** PyTorch's DeviceStats (keys and meanings of torch.cuda.memory_stats()): allocation and
 *  allocated_bytes count blocks handed out (rounded sizes); active additionally counts blocks
 *  freed but waiting for other streams; requested_bytes are the sizes asked for; segment and
 *  reserved_bytes are backend memory; inactive_split are free pieces of split segments;
 *  reserved_paused_bytes (no PyTorch counterpart) are bytes of paused pools, given back to the
 *  driver and mapped again by sp_pool_resume (not in reserved_bytes). 1072 bytes; layout fixed. */
typedef struct sp_memory_stats {
    sp_stat_array allocation;
    sp_stat_array segment;
    sp_stat_array active;
    sp_stat_array inactive_split;
    sp_stat_array allocated_bytes;
    sp_stat_array reserved_bytes;
    sp_stat_array active_bytes;
    sp_stat_array inactive_split_bytes;
    sp_stat_array requested_bytes;
    int64_t num_alloc_retries;
    int64_t num_ooms;
    int64_t num_sync_all_streams;
    int64_t num_device_alloc;
    int64_t num_device_free;
    sp_stat oversize_allocations;
    sp_stat oversize_segments;
    /** max_split_size in bytes; -1 when unlimited. */
    int64_t max_split_size;
    sp_stat_array reserved_paused_bytes;
} sp_memory_stats;

/** The driver calls a device's allocator made, by kind (sp_backend_calls_get). map counts
 *  pages: a run of n pages mapped at once is n. synchronize counts event and device
 *  synchronisations. 96 bytes; layout fixed. */
typedef struct sp_backend_calls {
    uint64_t alloc_segment;
    uint64_t free_segment;
    uint64_t reserve;
    uint64_t release_reservation;
    uint64_t create_page;
    uint64_t release_page;
    uint64_t map;
    uint64_t unmap;
    uint64_t create_event;
    uint64_t record_event;
    uint64_t query_event;
    uint64_t synchronize;
} sp_backend_calls;

/* ------------------------------------------------------------------------------------------ */
/* Library                                                                                    */

/** Writes the library's version (compare with SP_VERSION_MAJOR/MINOR/PATCH).
 *  Never initialises; works after sp_shutdown. */
sp_status sp_version(int* major, int* minor, int* patch);

/** Returns 1 if this build supports the feature name, else 0 (also for NULL or unknown names).
 *  Names: "cuda", "sim", "vmm", "pools", "routes", "statistics", "snapshot",
 *  "torch_pluggable", "checkpoint", "arenas", "variant_groups", "traces", "vmm_ipc"
 *  (sp_ipc_export / sp_ipc_open), "sim_bytes" (sp_sim_write and friends), "pause"
 *  (sp_pool_pause). Never initialises; works after sp_shutdown. */
int sp_has_feature(const char* name);

/** The message of the latest failed call on this thread; "" once a later call on this thread
 *  succeeded. Never NULL. Owned by slotpool: valid until the next sp_* call on this thread;
 *  copy it to keep it. Works after sp_shutdown. */
const char* sp_last_error_message(void);

/** The name of a status code, as cudaGetErrorName names a CUDA error: "SP_OK",
 *  "SP_ERR_OUT_OF_MEMORY", ...; "SP_ERR_UNRECOGNIZED" for a value that is no sp_status. Takes an
 *  int so that any value is defined. A static string: never NULL, never freed. Never
 *  initialises; works after sp_shutdown. */
const char* sp_status_name(int status);

/** Initialises the library. Optional: without it, the first call initialises from the
 *  environment. Must come before any other call that initialises.
 *  backend: "cuda", "sim" or "auto" (CUDA if device 0 can be opened, else the simulated
 *           device); NULL = $SLOTPOOL_BACKEND, else "auto".
 *  conf:    "key:value,..." applied over $SLOTPOOL_CONF (conf wins), both over the program
 *           defaults; NULL = "". Every key, its default and its meaning: docs/configuration.md
 *           (the sim_* keys configure the sim backend and are ignored by the cuda backend).
 *           sp_config_get_str / sp_config_get_f64 read the configuration in effect back.
 *  Errors: SP_ERR_CONFIG (unknown key, named in the message; bad value), SP_ERR_INVALID_ARGUMENT
 *  (unknown backend), SP_ERR_BACKEND_UNAVAILABLE ("cuda" without a driver or device),
 *  SP_ERR_DEVICE, SP_ERR_INVALID_STATE (already initialised), SP_ERR_SHUTDOWN. On error nothing
 *  is initialised and sp_init may be called again. */
sp_status sp_init(const char* backend, const char* conf);

/** Shuts the library down: returns every device's unused cached memory to the backend; live
 *  allocations stay valid device memory but can no longer be freed through slotpool. Calls
 *  running concurrently complete safely. Every later call that touches allocator state returns
 *  SP_ERR_SHUTDOWN; there is no re-initialisation. A second sp_shutdown returns
 *  SP_ERR_SHUTDOWN. */
sp_status sp_shutdown(void);

/** Writes 1 if the library is initialised, else 0. Never initialises. */
sp_status sp_is_initialized(int* out);

/** Writes the backend in use, "cuda" or "sim" (a static string; do not free). */
sp_status sp_backend_name(const char** out);

/** Writes the number of devices of the backend (CUDA devices, or sim_devices). */
sp_status sp_device_count(int* out);

/** Frees a string returned by slotpool (sp_snapshot_json). NULL is accepted (SP_OK). Strings
 *  are malloc()ed, so free() works too. Works after sp_shutdown. */
sp_status sp_string_free(char* s);

/* ------------------------------------------------------------------------------------------ */
/* Allocation                                                                                 */

/** Allocates size bytes on device for use on stream and writes the pointer to *out (NULL on
 *  failure). The pool is chosen by the active routes (the default pool when none match). The
 *  memory is reused on the same stream as soon as it is freed, and on other streams only once
 *  the work queued before the free (and on every stream passed to sp_record_stream) completed.
 *  Errors: SP_ERR_INVALID_ARGUMENT (out NULL, size 0 or > 2^56, unknown device),
 *  SP_ERR_OUT_OF_MEMORY, SP_ERR_DEVICE. */
sp_status sp_alloc(int device, size_t size, uint64_t stream, void** out);

/** Frees a pointer returned by sp_alloc, sp_pool_alloc or sp_torch_malloc. Its memory stays
 *  cached. Errors: SP_ERR_INVALID_ARGUMENT (NULL), SP_ERR_UNKNOWN_POINTER (not from slotpool,
 *  or already freed: a double free is detected and changes nothing). */
sp_status sp_free(void* ptr);

/** Marks the allocation at ptr graph-retained but reusable: a captured graph still references
 *  it, but later captures of its pool may reuse the memory (the caller promises that those
 *  graphs never run at the same time). The block returns to its pool and stays mapped at its
 *  address while the pool is in use; the caller keeps ptr but must not free it again.
 *  size_out (may be NULL) receives the block's size. Errors: SP_ERR_INVALID_ARGUMENT (NULL),
 *  SP_ERR_UNKNOWN_POINTER. */
sp_status sp_mark_reusable(void* ptr, uint64_t* size_out);

/** Notes that the allocation at ptr is used on stream too (Tensor.record_stream): after
 *  sp_free it is reused on another stream only once the work queued on stream before the free
 *  has completed. Errors: SP_ERR_INVALID_ARGUMENT (NULL), SP_ERR_UNKNOWN_POINTER. */
sp_status sp_record_stream(void* ptr, uint64_t stream);

/** Describes the live allocation that starts at ptr: *base = ptr, *size = rounded size,
 *  *requested = size asked for, *device = its device. All four out-pointers are required.
 *  Errors: SP_ERR_INVALID_ARGUMENT, SP_ERR_UNKNOWN_POINTER. */
sp_status sp_allocation_info(void* ptr, void** base, size_t* size, size_t* requested,
                             int* device);

/** Describes the segment that holds the live allocation starting at ptr: *base and *size its
 *  address range, *vmm 1 for a vmm reservation, 0 for a classic segment (one cuMemAlloc
 *  allocation, which cudaIpcGetMemHandle can share; offset = ptr - base). All three out-pointers
 *  are required. Errors: SP_ERR_INVALID_ARGUMENT, SP_ERR_UNKNOWN_POINTER. */
sp_status sp_segment_info(void* ptr, void** base, size_t* size, int* vmm);

/* ---- CUDA IPC of vmm memory --------------------------------------------------------------- */

/** Exports the physical pages under the live vmm allocation at ptr, for another process to map
 *  (what PyTorch does for its expandable segments; classic segments are shared with
 *  cudaIpcGetMemHandle instead, see sp_segment_info). *count receives the number of pages that
 *  cover the allocation, even when fds is too small; fds[0..*count] their POSIX file
 *  descriptors in address order (this process's, kept open while the pages live: receivers
 *  duplicate them with pidfd_getfd); *page_size their size; *offset where the allocation starts
 *  in the first page. fds may be NULL when capacity is 0. The allocation must stay allocated
 *  during the call. Errors: SP_ERR_INVALID_ARGUMENT (NULL, capacity below *count, a classic
 *  segment), SP_ERR_UNKNOWN_POINTER, SP_ERR_BACKEND_UNAVAILABLE (the simulated device, or a GPU
 *  without POSIX file-descriptor handles), SP_ERR_DEVICE. */
sp_status sp_ipc_export(void* ptr, int* fds, size_t capacity, size_t* count, size_t* page_size,
                        size_t* offset);

/** Maps pages that process pid exported (sp_ipc_export, or PyTorch's expandable segments): fds
 *  are its descriptors of count pages of page_size bytes, in address order. *base receives the
 *  address of the first page on device; the memory stays alive while mapped here, whatever the
 *  exporter does, until sp_ipc_close. Needs pidfd_getfd (Linux 5.6) and permission to use it on
 *  pid (the same user, or ptrace rights). Errors: SP_ERR_INVALID_ARGUMENT (NULL, count 0 or over
 *  2^20, a page size that is not a multiple of the granularity, a process or descriptor that
 *  cannot be reached), SP_ERR_BACKEND_UNAVAILABLE (the simulated device), SP_ERR_DEVICE. A
 *  failure maps nothing. */
sp_status sp_ipc_open(int device, int pid, const int* fds, size_t count, size_t page_size,
                      void** base);

/** Unmaps memory that sp_ipc_open mapped on device. Errors: SP_ERR_INVALID_ARGUMENT (NULL, not
 *  such memory), SP_ERR_BACKEND_UNAVAILABLE, SP_ERR_DEVICE. */
sp_status sp_ipc_close(int device, void* base);

/** Returns the unused cached memory of device (-1: every device) to the backend
 *  (torch.cuda.empty_cache). Pools still in use keep theirs (live graphs may reference it). */
sp_status sp_empty_cache(int device);

/** Gives device peer read and write access to device's memory: its vmm pages, mapped now and
 *  later, as cudaDeviceEnablePeerAccess does for cudaMalloc memory (which classic segments are,
 *  so that call is still needed for them). A device not used yet gets it when first used (a
 *  refusal then is logged, and the device works without it); peer == device does nothing. Errors: SP_ERR_INVALID_ARGUMENT (a bad device or peer), SP_ERR_DEVICE
 *  (peer cannot access device's memory, or the driver refused). */
sp_status sp_enable_peer_access(int device, int peer);

/** Caps the physical memory device may hold at fraction (0 < fraction <= 1) of its total
 *  memory (set_per_process_memory_fraction). Errors: SP_ERR_INVALID_ARGUMENT (bad fraction or
 *  device). */
sp_status sp_set_memory_fraction(int device, double fraction);

/** Caps the physical memory device may hold at bytes; 0 removes the cap (device total). */
sp_status sp_set_memory_limit(int device, uint64_t bytes);

/** Writes the cap in force and the device's total memory (getMemoryFraction = limit/total). */
sp_status sp_memory_limit_get(int device, uint64_t* limit_bytes, uint64_t* total_bytes);

/** Retires completed cross-stream events of device (-1: every device), so that blocks freed
 *  with other-stream uses become reusable. Allocation does this too when it needs memory. */
sp_status sp_process_events(int device);

/** Writes the size of the largest cached free block of device that needs no new physical
 *  memory (cacheInfo; vmm blocks up to their first unmapped page; 0 if none). */
sp_status sp_largest_free_block(int device, size_t* out);

/* ------------------------------------------------------------------------------------------ */
/* Pools and routes                                                                           */

/** Creates pool id on device with *opts (NULL: defaults) and use count 1, or adds one use to
 *  an existing pool (opts is then ignored) - PyTorch's createOrIncrefPool. Writes the new use
 *  count to *use_count (may be NULL). Errors: SP_ERR_INVALID_ARGUMENT (id {0,0}, device). */
sp_status sp_pool_create_or_incref(int device, sp_pool_id id, const sp_pool_options* opts,
                                   uint64_t* use_count);

/** The pool called name (a non-empty UTF-8 string) on device: created with *opts (NULL:
 *  defaults) and use count 1 if new, else given one more use. Writes its id to *out. */
sp_status sp_pool_named(int device, const char* name, const sp_pool_options* opts,
                        sp_pool_id* out);

/** Drops one use of pool id (releasePool); writes the remaining count to *remaining (may be
 *  NULL). At 0 the pool is freeable: its cached memory goes back on sp_empty_cache or under
 *  memory pressure, and it is forgotten once empty. Errors: SP_ERR_UNKNOWN_POOL,
 *  SP_ERR_INVALID_ARGUMENT (default pool), SP_ERR_INVALID_STATE (use count already 0, or the
 *  last use of a pool that a route still sends allocations to: end the route first). */
sp_status sp_pool_release(int device, sp_pool_id id, uint64_t* remaining);

/** Writes the use count of pool id (MemPool.use_count()). Errors: SP_ERR_UNKNOWN_POOL. */
sp_status sp_pool_use_count(int device, sp_pool_id id, uint64_t* out);

/** Replaces the options of pool id (setUseOnOOM, setNoSplit, limit). opts is required.
 *  Errors: SP_ERR_UNKNOWN_POOL, SP_ERR_INVALID_ARGUMENT. */
sp_status sp_pool_set_options(int device, sp_pool_id id, const sp_pool_options* opts);

/** Returns the unused cached memory of pool id to the backend, even while it is in use
 *  (emptyCache(mempool_id)). Errors: SP_ERR_UNKNOWN_POOL. */
sp_status sp_pool_empty_cache(int device, sp_pool_id id);

/** Allocates size bytes from pool id for use on stream, ignoring routes; *out as sp_alloc.
 *  Errors: as sp_alloc, plus SP_ERR_UNKNOWN_POOL. */
sp_status sp_pool_alloc(int device, sp_pool_id id, size_t size, uint64_t stream, void** out);

/** Sends allocations on device that match (kind, arg) to pool id until
 *  sp_end_allocate_to_pool (beginAllocateToPool). The pool gains one use (created if new).
 *  Routes nest; the newest matching route wins. Errors: SP_ERR_INVALID_ARGUMENT (id {0,0},
 *  unknown kind), SP_ERR_INVALID_STATE (a route to this pool is already active). */
sp_status sp_begin_allocate_to_pool(int device, sp_pool_id id, sp_route_kind kind,
                                    uint64_t arg);

/** Removes the route to pool id (endAllocateToPool); the use count is unchanged (call
 *  sp_pool_release for that). Errors: SP_ERR_INVALID_STATE (no route to id). */
sp_status sp_end_allocate_to_pool(int device, sp_pool_id id);

/* ------------------------------------------------------------------------------------------ */
/* Statistics and snapshots                                                                   */

/** Writes the statistics of device (getDeviceStats). The all-pools peaks of allocated_bytes and
 *  reserved_bytes are exact; other peaks add up per (pool, stream) and are an upper bound when
 *  several are active. */
sp_status sp_memory_stats_get(int device, sp_memory_stats* out);

/** The device-wide peaks of device since the last reset: allocated bytes and reserved (physical)
 *  bytes, both exact (the per-pool peaks of sp_pool_stats_get add up per stream and are an upper
 *  bound). A device slotpool has not used reports zeros. Either out-pointer may be NULL.
 *  Errors: SP_ERR_INVALID_ARGUMENT (no such device), SP_ERR_NOT_INITIALIZED. */
sp_status sp_memory_peaks(int device, uint64_t* allocated_peak, uint64_t* reserved_peak);

/** Writes the backend (driver) calls device's allocator made since it was created, by kind; a
 *  device slotpool has not used reports zeros. Errors: SP_ERR_INVALID_ARGUMENT (NULL out, no
 *  such device), SP_ERR_NOT_INITIALIZED. */
sp_status sp_backend_calls_get(int device, sp_backend_calls* out);

/** Writes the statistics of pool id on device. Errors: SP_ERR_UNKNOWN_POOL. */
sp_status sp_pool_stats_get(int device, sp_pool_id id, sp_memory_stats* out);

/** Sets every peak of device (-1: every device) to its current value (resetPeakStats). */
sp_status sp_reset_peak_stats(int device);

/** Zeroes the totals and event counters of device (-1: every device). */
sp_status sp_reset_accumulated_stats(int device);

/** Writes a JSON snapshot of device (-1: every device) in the shape of PyTorch's
 *  torch.cuda.memory._snapshot(): {"segments":[...], "device_traces":[[]...]}. *out_json
 *  receives a NUL-terminated string owned by the caller (free with sp_string_free; NULL on
 *  failure); *len its length without the NUL (may be NULL). device_traces holds each device's
 *  recorded history (sp_record_history), oldest first; frames are empty. */
sp_status sp_snapshot_json(int device, char** out_json, size_t* len);

/* ------------------------------------------------------------------------------------------ */
/* CUDA-graph memory: checkpoint / restore, variant groups, arenas, live sets                 */
/*                                                                                            */
/* Handles (sp_checkpoint, sp_restore_delta, sp_variant_group) are owned by the caller and     */
/* freed with their _free function. A handle is an opaque token, not an address: it carries    */
/* its kind and a generation and is looked up in its kind's own registry. A handle of another  */
/* kind, a freed handle (even after its slot holds a new object) or a made-up value gives      */
/* SP_ERR_INVALID_ARGUMENT with a message naming which, and changes nothing; the _count        */
/* functions return 0 and set the message. A handle may be used from any thread, also          */
/* concurrently with its own _free: a call that found it completes on it, later ones fail.     */

/** A pool's state at one moment (segments, split topology, live set). Opaque. */
typedef struct sp_checkpoint sp_checkpoint;
/** What a restore did: allocations freed and allocations re-created. Opaque. */
typedef struct sp_restore_delta sp_restore_delta;
/** "Capture these N variants into one pool; only one runs at a time." Opaque. */
typedef struct sp_variant_group sp_variant_group;

/** Checkpoints pool id: O(1) per (pool, stream). *out receives a handle (NULL on failure).
 *  Errors: SP_ERR_UNKNOWN_POOL, SP_ERR_INVALID_STATE (frees of the pool wait on cross-stream
 *  events: call sp_pool_drain_pending_frees first). */
sp_status sp_checkpoint_take(int device, sp_pool_id id, sp_checkpoint** out);

/** Frees a checkpoint (NULL: SP_OK). Journaling for it stops. */
sp_status sp_checkpoint_free(sp_checkpoint* cp);

/** Returns the pool cp was taken of, on the device it was taken on (both from the checkpoint,
 *  see sp_checkpoint_info), to checkpoint cp while keep_live[0..n_keep] stay live at their
 *  addresses; costs what changed since the checkpoint. Allocations made since are freed (they must not be
 *  freed again) and allocations of the checkpoint freed since are re-created (the caller owns
 *  them); *delta_out (may be NULL) lists both. A transaction: on SP_ERR_INVALID_STATE (a
 *  keep_live pointer the checkpoint lacks, a stale checkpoint, pending cross-stream frees)
 *  nothing changed and the message names the blocks added and removed with their sizes. Also
 *  SP_ERR_INVALID_ARGUMENT (cp not a live checkpoint handle; keep_live NULL with n_keep > 0, or
 *  n_keep above the device's memory / 512, the most allocations it could hold),
 *  SP_ERR_UNKNOWN_POOL (the pool is gone), SP_ERR_POOL_PAUSED, SP_ERR_OUT_OF_MEMORY. */
sp_status sp_checkpoint_restore(const sp_checkpoint* cp, void* const* keep_live, size_t n_keep,
                                sp_restore_delta** delta_out);
/** Writes the device and pool a checkpoint was taken of (either out may be NULL).
 *  Errors: SP_ERR_INVALID_ARGUMENT (cp not a live checkpoint handle; nothing written). */
sp_status sp_checkpoint_info(const sp_checkpoint* cp, int* device, sp_pool_id* pool);

/** Number of allocations a restore freed (0 for an invalid handle, with the reason in
 *  sp_last_error_message). A delta's two lists are in no particular order. */
size_t sp_delta_freed_count(const sp_restore_delta* d);
/** Number of allocations a restore re-created (0 for an invalid handle, as above). */
size_t sp_delta_created_count(const sp_restore_delta* d);
/** Entry i of the freed allocations. Errors: SP_ERR_INVALID_ARGUMENT (handle, index, NULL). */
sp_status sp_delta_freed(const sp_restore_delta* d, size_t i, void** ptr, size_t* size);
/** Entry i of the re-created allocations. Errors: as sp_delta_freed. */
sp_status sp_delta_created(const sp_restore_delta* d, size_t i, void** ptr, size_t* size);
/** Writes the first min(cap, total) entries of d's freed list (created 0) or re-created list
 *  (created non-zero): pointers to ptrs (may be NULL when cap is 0), sizes to sizes (may be
 *  NULL), the list's length to *total; SP_OK also when *total > cap. The bulk form of
 *  sp_delta_freed / sp_delta_created. Errors: SP_ERR_INVALID_ARGUMENT (handle, total NULL, ptrs
 *  NULL with cap > 0). */
sp_status sp_delta_entries(const sp_restore_delta* d, int created, void** ptrs, size_t* sizes,
                           size_t cap, size_t* total);
/** Frees a delta (NULL: SP_OK). */
sp_status sp_delta_free(sp_restore_delta* d);

/** Starts a group of count mutually exclusive variants on pool id (created if new) and
 *  checkpoints it. Errors: SP_ERR_INVALID_ARGUMENT (count 0), SP_ERR_INVALID_STATE. */
sp_status sp_variant_group_create(int device, sp_pool_id id, size_t count,
                                  sp_variant_group** out);
/** Begins variant k: the pool returns to the group's checkpoint, so k reuses the addresses of
 *  every other variant. *delta_out (may be NULL) lists what earlier variants left live (now
 *  freed). Errors: SP_ERR_INVALID_ARGUMENT (k >= count), SP_ERR_INVALID_STATE (a variant is
 *  active). */
sp_status sp_variant_begin(const sp_variant_group* g, size_t k, sp_restore_delta** delta_out);
/** Ends the active variant. Errors: SP_ERR_INVALID_STATE (none active). */
sp_status sp_variant_end(const sp_variant_group* g);
/** Frees a variant group (NULL: SP_OK); the pool and its memory stay. */
sp_status sp_variant_group_free(sp_variant_group* g);

/* ------------------------------------------------------------------------------------------ */
/* Pausing pools                                                                              */

/** sp_pool_pause flag: copy the pool's contents to pinned host memory before giving its pages
 *  back; sp_pool_resume copies them back. Without it (flags 0) the contents are discarded. */
#define SP_PAUSE_BACKUP 1u

/** Gives every physical page of pool id back to the driver, keeping every virtual address,
 *  block and statistic: pointers into the pool and CUDA graphs captured on it stay valid for
 *  after sp_pool_resume. Synchronous: synchronises the device first, so no queued work touches
 *  a page once it is released. While paused, allocating from the pool fails with
 *  SP_ERR_POOL_PAUSED; freeing into it works; sp_empty_cache leaves it alone; a restore or a
 *  variant begin on it fails with SP_ERR_POOL_PAUSED. Errors (nothing changed):
 *  SP_ERR_INVALID_ARGUMENT (unknown flag bits, the default pool), SP_ERR_UNKNOWN_POOL,
 *  SP_ERR_INVALID_STATE (already paused, a stream capture underway, the pool holds classic
 *  segments - create it with sp_pool_options.pausable - or arenas), SP_ERR_DEVICE /
 *  SP_ERR_OUT_OF_MEMORY (the backup failed). */
sp_status sp_pool_pause(int device, sp_pool_id id, uint32_t flags);

/** Maps new physical memory at every paused address of pool id and copies the backup back.
 *  The backup's pinned buffer is kept for the pool's next backup (pinning memory costs far more
 *  than copying it) while the pool is in use; once its last use is released, sp_empty_cache
 *  frees it. Errors (the pool stays paused, its backup kept): SP_ERR_UNKNOWN_POOL,
 *  SP_ERR_INVALID_STATE (not paused, a capture underway), SP_ERR_OUT_OF_MEMORY. */
sp_status sp_pool_resume(int device, sp_pool_id id);

/** Writes whether pool id is paused (1 or 0), the bytes it gave back (mapped again by the
 *  resume) and the pinned host bytes it holds (its backup, or the buffer kept for the next). Each out-pointer may be NULL.
 *  Errors: SP_ERR_UNKNOWN_POOL. */
sp_status sp_pool_pause_info(int device, sp_pool_id id, int* paused, uint64_t* paused_bytes,
                             uint64_t* host_bytes);

/* ------------------------------------------------------------------------------------------ */
/* Arenas                                                                                     */

/** Creates a slot-aliased arena in pool id (created if new) for work on stream; *out receives
 *  its id. The arena holds a use of the pool until it is destroyed. Its pages count in the
 *  device's and the pool's statistics and appear in the snapshot as a segment of the pool. */
sp_status sp_arena_create(int device, sp_pool_id id, uint64_t stream, uint64_t* out);
/** Allocates slot `slot` of branch `branch`: slot s has the same address in every branch. The
 *  allocation is the pair (branch, slot); it stays live until sp_arena_free of that pair.
 *  Errors (each changes nothing, pages mapped by the failing call included):
 *  SP_ERR_INVALID_STATE (already live; in debug mode, overlap with another branch's live slot),
 *  SP_ERR_OUT_OF_MEMORY, SP_ERR_INVALID_ARGUMENT (unknown arena, size). */
sp_status sp_arena_alloc(int device, uint64_t arena, uint32_t branch, uint32_t slot, size_t size,
                         void** out);
/** Frees slot `slot` of branch `branch`, and only that allocation. Errors: SP_ERR_INVALID_STATE
 *  (not live). */
sp_status sp_arena_free(int device, uint64_t arena, uint32_t branch, uint32_t slot);
/** Turns the overlap check of an arena on (non-zero) or off. */
sp_status sp_arena_set_debug(int device, uint64_t arena, int on);
/** Destroys an arena; its pages return and its use of the pool is given back. Errors:
 *  SP_ERR_INVALID_STATE (any (branch, slot) live, or a capture underway). */
sp_status sp_arena_destroy(int device, uint64_t arena);

/** SP_OK iff the live allocations of pool id are exactly ptrs[0..n] (checkPoolLiveAllocations);
 *  else SP_ERR_INVALID_STATE with the difference in the message. SP_ERR_INVALID_ARGUMENT: ptrs
 *  NULL with n > 0, or n above the device's memory / 512 (the most allocations it could hold,
 *  so that no length makes slotpool read or copy an unbounded list). */
sp_status sp_pool_verify_live(int device, sp_pool_id id, void* const* ptrs, size_t n);
/** Writes the number of live allocations of pool id. */
sp_status sp_pool_live_count(int device, sp_pool_id id, size_t* out);
/** Waits for the cross-stream events of pool id's pending frees (not during a capture);
 *  *left (may be NULL) receives the frees still pending. */
sp_status sp_pool_drain_pending_frees(int device, sp_pool_id id, size_t* left);
/** Records device's allocator events (alloc, free_requested, free_completed, segment_alloc,
 *  segment_free, segment_map, segment_unmap, oom; PyTorch's trace actions and meanings) into a
 *  ring of max_entries, oldest dropped first. 0 stops recording; recorded entries stay until
 *  sp_clear_history. They appear in sp_snapshot_json's device_traces. device -1: every device,
 *  including devices first used later (no device is initialised by this call). */
sp_status sp_record_history(int device, size_t max_entries);
/** What an allocator event was: PyTorch's trace actions. */
typedef enum sp_trace_action {
  SP_TRACE_ALLOC = 0,           /* a block was handed out; size: the requested size */
  SP_TRACE_FREE_REQUESTED = 1,  /* the user freed it */
  SP_TRACE_FREE_COMPLETED = 2,  /* it is free for reuse (at once, or after other streams' work) */
  SP_TRACE_SEGMENT_ALLOC = 3,   /* a classic segment was allocated (cuMemAlloc) */
  SP_TRACE_SEGMENT_FREE = 4,    /* a classic segment was freed */
  SP_TRACE_SEGMENT_MAP = 5,     /* a vmm page was mapped; size: the page size */
  SP_TRACE_SEGMENT_UNMAP = 6,   /* a vmm page was unmapped */
  SP_TRACE_OOM = 7              /* an allocation failed; addr 0, size: the rounded request */
} sp_trace_action;

/** One allocator event, as an sp_trace_callback receives it. */
typedef struct sp_trace_event {
  sp_trace_action action;
  int device;
  uint64_t addr;
  uint64_t size;
  uint64_t stream;
  uint64_t time_us; /* microseconds since the Unix epoch */
} sp_trace_event;

/** Receives one event; `event` is valid for the call only. */
typedef void (*sp_trace_callback)(const sp_trace_event* event, void* user_data);

/** Hands every allocator event of every device, present and future, to callback as it happens,
 *  with user_data (PyTorch's attachAllocatorTraceTracker; NCCL registers segments through it).
 *  NULL stops; a new callback replaces the old one. The callback runs on the thread that made
 *  the event, under an allocator lock: it must not call slotpool (nor allocate through it) and
 *  must not throw. Errors: SP_ERR_NOT_INITIALIZED, SP_ERR_SHUTDOWN. */
sp_status sp_set_trace_callback(sp_trace_callback callback, void* user_data);

/** Forgets device's recorded history (-1: every device). */
sp_status sp_clear_history(int device);

/** Checks every invariant of device's allocator: SP_ERR_INVALID_STATE names the first broken
 *  one. O(blocks); meant for tests, and only meaningful while no other thread uses the device
 *  (it visits the state piece by piece). */
sp_status sp_check_invariants(int device);

/* ------------------------------------------------------------------------------------------ */
/* Reading state: live allocations, pool options, configuration, snapshots as data            */

/** One live allocation (sp_pool_live_allocations). */
typedef struct sp_allocation {
    void* ptr;
    uint64_t size;            /* the block's (rounded) size */
    uint64_t requested_size;  /* the size asked for */
    uint64_t stream;
} sp_allocation;

/** Writes pool id's live allocations on device, lowest address first: the first
 *  min(cap, total) to out (out may be NULL when cap is 0) and the total to *total.
 *  SP_OK also when *total > cap: call again with room for *total.
 *  Errors: SP_ERR_UNKNOWN_POOL; SP_ERR_INVALID_ARGUMENT (total NULL, out NULL with cap > 0). */
sp_status sp_pool_live_allocations(int device, sp_pool_id id, sp_allocation* out, size_t cap,
                                   size_t* total);

/** Writes the options pool id has now (as sp_pool_set_options / creation set them).
 *  Errors: SP_ERR_UNKNOWN_POOL. */
sp_status sp_pool_options_get(int device, sp_pool_id id, sp_pool_options* out);

/** The value in effect of a configuration key, spelt as in sp_init's conf string
 *  ("garbage_collection_threshold", "max_split_size_mb", "growth", "vmm_page_mb", ...):
 *  sp_config_get_f64 for numeric and boolean keys (booleans 0/1, in the key's own units;
 *  an unset key with no limit reads 0); SP_ERR_CONFIG for an unknown key or one whose value
 *  is not a number. sp_config_get_str for any key, as text in the conf syntax; the key "conf"
 *  gives the whole effective configuration string ("growth:vmm,...,vmm_page_mb:4"). Writes at
 *  most cap bytes to buf, NUL included (buf may be NULL when cap is 0), and the full length
 *  without the NUL to *len (may be NULL); SP_OK also when truncated; an unset key reads "".
 *  Neither initialises the library: before initialisation they read what lazy initialisation
 *  would use (the defaults under $SLOTPOOL_CONF). Errors also: SP_ERR_INVALID_ARGUMENT (key or
 *  out NULL, buf NULL with cap > 0); nothing is written on an error. Keys and defaults:
 *  docs/configuration.md. */
sp_status sp_config_get_f64(const char* key, double* out);
sp_status sp_config_get_str(const char* key, char* buf, size_t cap, size_t* len);

/* ---- Snapshots as data (sp_snapshot_json stays, for Python and memory_viz) ---- */

/** A snapshot of segments, blocks and (optionally) recorded history. Opaque handle with the
 *  same rules as checkpoints (kind-tagged, generational; wrong/freed handle ->
 *  SP_ERR_INVALID_ARGUMENT, _count functions return 0). */
typedef struct sp_snapshot sp_snapshot;

typedef enum sp_block_state {
    SP_BLOCK_INACTIVE = 0,            /* free */
    SP_BLOCK_ACTIVE_ALLOCATED = 1,    /* live */
    SP_BLOCK_ACTIVE_PENDING_FREE = 2  /* freed, waiting for other streams' work */
} sp_block_state;

typedef struct sp_segment_view {
    int device;
    int is_large;        /* segment_type "large" (0: "small") */
    int is_expandable;   /* vmm segment */
    int reserved0;       /* 0 */
    uint64_t address;
    uint64_t total_size;
    uint64_t stream;
    sp_pool_id pool;     /* segment_pool_id */
    size_t block_count;
} sp_segment_view;

typedef struct sp_block_view {
    uint64_t address;    /* absolute; a vmm segment's blocks may leave gaps (unmapped pages) */
    uint64_t size;
    uint64_t requested_size;
    sp_block_state state;
} sp_block_view;

/** Takes a snapshot of device (-1: every device in use); with_traces non-zero also copies the
 *  recorded history (sp_record_history). Segments come in the order sp_snapshot_json lists them. */
sp_status sp_snapshot_take(int device, int with_traces, sp_snapshot** out);
sp_status sp_snapshot_free(sp_snapshot* s);  /* NULL: SP_OK */
size_t sp_snapshot_segment_count(const sp_snapshot* s);
sp_status sp_snapshot_segment(const sp_snapshot* s, size_t i, sp_segment_view* out);
sp_status sp_snapshot_block(const sp_snapshot* s, size_t segment, size_t j, sp_block_view* out);
/** Recorded events, by device ascending, oldest first within a device (sp_trace_event.device
 *  says which). */
size_t sp_snapshot_trace_count(const sp_snapshot* s);
sp_status sp_snapshot_trace(const sp_snapshot* s, size_t i, sp_trace_event* out);

/* ------------------------------------------------------------------------------------------ */
/* Bytes of simulated device memory (for tests)                                               */
/*                                                                                            */
/* The simulated device keeps bytes only with the configuration key sim_bytes:1; without it   */
/* these return SP_ERR_BACKEND_UNAVAILABLE, and so they do on a CUDA device. The device range  */
/* must lie wholly in mapped memory of device (a live segment or mapped vmm pages, whether     */
/* allocated or cached), else SP_ERR_INVALID_ARGUMENT and nothing is copied. n may be 0; n     */
/* above 2^56 is SP_ERR_INVALID_ARGUMENT. Never-written memory reads as 0x00 (classic          */
/* segments) or 0xA5 (vmm pages).                                                             */

/** Copies n bytes from host memory src to device memory dst (cudaMemcpy host-to-device). */
sp_status sp_sim_write(int device, void* dst, const void* src, size_t n);
/** Copies n bytes from device memory src to host memory dst (cudaMemcpy device-to-host). */
sp_status sp_sim_read(int device, const void* src, void* dst, size_t n);
/** Writes the test pattern of seed over n bytes of device memory at dst: a deterministic
 *  pseudo-random byte sequence, distinct for each seed and offset. */
sp_status sp_sim_fill(int device, void* dst, size_t n, uint64_t seed);
/** Checks that n bytes at src hold the pattern sp_sim_fill(device, src, n, seed) wrote;
 *  SP_ERR_INVALID_STATE names the first byte that differs. */
sp_status sp_sim_verify(int device, const void* src, size_t n, uint64_t seed);

/* ------------------------------------------------------------------------------------------ */
/* torch.cuda.memory.CUDAPluggableAllocator                                                   */

/** Alloc function for CUDAPluggableAllocator(path, "sp_torch_malloc", "sp_torch_free"):
 *  size bytes on device for stream (a cudaStream_t). Returns NULL for size 0 and on any error;
 *  the reason is in sp_last_error_message() and, with SLOTPOOL_LOG set, in the log. */
void* sp_torch_malloc(ssize_t size, int device, void* stream);

/** Free function for CUDAPluggableAllocator. size, device and stream are not needed and
 *  ignored; NULL is ignored; errors are logged and set sp_last_error_message(). */
void sp_torch_free(void* ptr, ssize_t size, int device, void* stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SLOTPOOL_H */
