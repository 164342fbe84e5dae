"""slotpool beneath PyTorch.

    import slotpool_torch
    slotpool_torch.install()          # before the first CUDA allocation
    import torch
    x = torch.randn(1024, device="cuda")   # served by slotpool

or, for a whole script: ``python -m slotpool_torch script.py args``.

Beyond PyTorch's own API (memory_stats, MemPool, CUDA graphs, torch.compile's graph trees, ...),
this module exposes what slotpool adds: named pools, checkpoint/restore of a pool, variant groups
(mutually exclusive CUDA-graph variants sharing one pool and the same addresses), slot-aliased
arenas, and pausing pools (physical memory given back, addresses and graphs kept; the
torch_memory_saver API: region / pause / resume). See docs/torch.md.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterable, NamedTuple

from . import _loader, _pause
from ._pause import (
    TorchMemorySaver,
    cuda_graph,
    disable,
    pause,
    pause_info,
    paused,
    region,
    resume,
    tag_pool,
    torch_memory_saver,
)
from ._torch import TorchMissing, torch  # torch is imported on first use

__all__ = [
    "install",
    "torch_set_checkpoint_pool_state",
    "config",
    "is_installed",
    "load",
    "named_pool",
    "release_pool",
    "pool_use_count",
    "pool_stats",
    "backend_calls",
    "empty_pool_cache",
    "use_pool",
    "checkpoint",
    "restore",
    "verify_live",
    "variant_group",
    "VariantGroup",
    "mark_reusable",
    "Arena",
    "RestoreResult",
    "routes",
    "orphan_count",
    "TorchMissing",
    "pause",
    "resume",
    "paused",
    "pause_info",
    "region",
    "tag_pool",
    "disable",
    "cuda_graph",
    "TorchMemorySaver",
    "torch_memory_saver",
]

_ext = None
_ext_lock = threading.Lock()


def load(verbose: bool = False):
    """The C++ extension (built just in time from a source checkout if not installed). Loading it
    does not initialise CUDA."""
    global _ext
    if _ext is None:
        with _ext_lock:
            if _ext is None:
                _ext = _loader.load_extension(verbose=verbose)
    return _ext


# slotpool's defaults are the core's (`Config::default()` in slotpool-core), beneath $SLOTPOOL_CONF
# and conf=: the library applies them, and nothing here repeats them; config() reads them back.


def config(key: str = "conf") -> str:
    """The value in effect of slotpool configuration key `key` ("vmm_page_mb", "growth", ...), as
    text in the conf syntax ("" for an unset key), read from the library (sp_config_get_str);
    "conf" gives the whole configuration string. Before install() it is what install() would
    start from (the defaults under $SLOTPOOL_CONF); it never initialises slotpool or CUDA. Every
    key and its default: docs/configuration.md. An unknown key raises ValueError."""
    import ctypes

    _loader.preload_lib()
    lib = _loader._lib_handle
    get = lib.sp_config_get_str
    get.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                    ctypes.POINTER(ctypes.c_size_t)]
    get.restype = ctypes.c_int
    lib.sp_last_error_message.restype = ctypes.c_char_p
    name = key.encode()
    n = ctypes.c_size_t(0)
    while True:
        buf = ctypes.create_string_buffer(n.value + 1)
        if get(name, buf, len(buf), ctypes.byref(n)) != 0:
            raise ValueError(lib.sp_last_error_message().decode())
        if n.value < len(buf):
            return buf.value.decode()


def install(backend: str | None = "cuda", conf: str | None = None, verbose: bool = False) -> None:
    """Make slotpool PyTorch's CUDA allocator. Call before anything initialises CUDA (the first CUDA
    tensor, torch.cuda.init(), torch.cuda.current_device(), ...). Idempotent.

    backend: slotpool's backend ("cuda"; None: $SLOTPOOL_BACKEND). conf: slotpool's configuration
    string ("key:value,...", over $SLOTPOOL_CONF, over the keys of PyTorch's PYTORCH_ALLOC_CONF /
    PYTORCH_CUDA_ALLOC_CONF that slotpool shares (max_split_size_mb, roundup_power2_divisions,
    garbage_collection_threshold, ...), over the core's defaults).
    """
    ext = load(verbose=verbose)
    if ext.is_installed():
        _put_set_checkpoint_pool_state(ext)
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "slotpool_torch.install() must run before CUDA is initialised, but CUDA is already "
            "initialised (a CUDA tensor was created, or torch.cuda.init()/current_device() ran). "
            "Call it at the top of the program, or run the script with "
            "`python -m slotpool_torch script.py`."
        )
    ext.install(backend, conf)
    _put_set_checkpoint_pool_state(ext)


# torch._C._cuda_setCheckpointPoolState as PyTorch ships it, once install() has put slotpool's in
# its place (None before). CUDA graph trees call it at every branch switch; PyTorch's version asks
# the allocator for an owning DataPtr per live block and builds four hash sets over them, which at
# 10,000 live blocks costs more than slotpool's restore. slotpool's takes the same arguments and
# keeps the same contract and checks (torch_plugin/csrc/graph_state.cpp).
torch_set_checkpoint_pool_state = None


def _put_set_checkpoint_pool_state(ext) -> None:
    global torch_set_checkpoint_pool_state
    if torch_set_checkpoint_pool_state is None:
        torch_set_checkpoint_pool_state = torch._C._cuda_setCheckpointPoolState
        torch._C._cuda_setCheckpointPoolState = ext.set_checkpoint_pool_state


def is_installed() -> bool:
    return _ext is not None and _ext.is_installed()


def _installed_ext():
    ext = load()
    if not ext.is_installed():
        raise RuntimeError("slotpool_torch: call slotpool_torch.install() first")
    return ext


def _device(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, torch.device):
        return device.index if device.index is not None else torch.cuda.current_device()
    if isinstance(device, str):
        return _device(torch.device(device))
    return int(device)


def _pool(pool) -> tuple[int, int]:
    """A pool id from a tuple, a torch.cuda.MemPool or anything with .pool / .id."""
    if isinstance(pool, VariantGroup):
        return pool.pool
    if isinstance(pool, torch.cuda.MemPool):
        return tuple(pool.id)
    if isinstance(pool, (tuple, list)) and len(pool) == 2:
        return (int(pool[0]), int(pool[1]))
    raise TypeError(f"slotpool_torch: not a pool id: {pool!r} (a (int, int) tuple or a MemPool)")


def _storage_ptrs(tensors: Iterable[torch.Tensor]) -> list[int]:
    ptrs = []
    seen = set()
    for t in tensors:
        p = t.untyped_storage().data_ptr()
        if p and p not in seen:
            seen.add(p)
            ptrs.append(p)
    return ptrs


# ------------------------------------------------------------------------------------------------
# Pools


def named_pool(name: str, device=None, no_split: bool = False, use_on_oom: bool = False,
               limit_bytes: int = 0, pausable: bool = False) -> tuple[int, int]:
    """The pool called `name` on `device` (created with these options if new), with one more use.
    Returns its id, usable wherever PyTorch takes a pool: ``torch.cuda.graph(g, pool=...)``,
    ``make_graphed_callables(..., pool=...)``, :func:`use_pool`. Drop the use with
    :func:`release_pool`. pausable: the pool may be paused (:func:`pause`), by id or by name."""
    ext = _installed_ext()
    dev = _device(device)
    pid = tuple(ext.pool_named(dev, name, no_split, use_on_oom, int(limit_bytes), pausable))
    if pausable:
        with _pause._lock:
            _pause._tags.setdefault((dev, name), pid)
    return pid


def release_pool(pool, device=None) -> int:
    """Drop one use of a pool; returns the uses left (at 0 its cache goes back on empty_cache)."""
    return _installed_ext().pool_release(_device(device), _pool(pool))


def pool_use_count(pool, device=None) -> int:
    return _installed_ext().pool_use_count(_device(device), _pool(pool))


def pool_stats(pool, device=None) -> dict:
    """The statistics of one pool, with torch.cuda.memory_stats()'s keys."""
    return dict(_installed_ext().pool_stats(_device(device), _pool(pool)))


def backend_calls(device=None) -> dict:
    """The driver calls slotpool made on a device so far, by kind (create_page, map, unmap, ...;
    map counts pages). Differences between two steps are that step's driver calls."""
    return dict(_installed_ext().backend_calls(_device(device)))


def empty_pool_cache(pool, device=None) -> None:
    """Return one pool's unused cached memory to the device, even while the pool is in use."""
    _installed_ext().pool_empty_cache(_device(device), _pool(pool))


@contextlib.contextmanager
def use_pool(pool, device=None):
    """Route this thread's allocations to `pool` (torch.cuda.use_mem_pool for any pool id)."""
    _installed_ext()
    dev = _device(device)
    pid = _pool(pool)
    torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pid)
    try:
        yield pid
    finally:
        torch._C._cuda_endAllocateToPool(dev, pid)
        torch._C._cuda_releasePool(dev, pid)


def routes(device=None) -> list:
    """Active routes of the shim on `device`: [((a, b), kind)], oldest first."""
    return list(_installed_ext().routes(_device(device)))


def orphan_count() -> int:
    """Pointers freed by restores whose stale owners have not been dropped yet."""
    return _installed_ext().orphan_count()


# ------------------------------------------------------------------------------------------------
# Checkpoint / restore


class RestoreResult(NamedTuple):
    freed: list  # [(ptr, size)]: live before, freed by the restore (tensors on them are stale)
    created: list  # [(ptr, size)]: re-created by the restore (freed again unless kept)


def checkpoint(pool, device=None):
    """A checkpoint of `pool`: its segments, how they are split, which blocks are live. Free it
    with ``cp.free()`` (or drop it); while it lives the pool keeps its segments."""
    return _installed_ext().checkpoint(_device(device), _pool(pool))


def restore(pool, cp, keep_tensors: Iterable[torch.Tensor] = (), device=None,
            free_created: bool = True) -> RestoreResult:
    """Return `pool` to checkpoint `cp`. Allocations made since are freed: tensors still holding
    them become stale (do not read them; dropping them is safe). `keep_tensors` must survive at
    their addresses (checked: the restore fails, changing nothing, if the checkpoint does not have
    them). A transaction: on failure nothing changes and the error lists the differences."""
    ext = _installed_ext()
    dev = _device(device) if device is not None else cp.device
    torch.cuda.synchronize(dev)
    d = ext.restore(dev, _pool(pool), cp, _storage_ptrs(keep_tensors), free_created)
    return RestoreResult(list(d["freed"]), list(d["created"]))


def verify_live(pool, tensors: Iterable[torch.Tensor], device=None) -> tuple[bool, str]:
    """Whether the live allocations of `pool` are exactly the storages of `tensors`."""
    ok, why = _installed_ext().verify_live(_device(device), _pool(pool), _storage_ptrs(tensors))
    return bool(ok), why


# ------------------------------------------------------------------------------------------------
# Variant groups


class VariantGroup:
    """N mutually exclusive variants (one CUDA graph or graph set each) captured into one pool.
    Capture of every variant starts from the pool as it was when the group was made, so all
    variants reuse the same addresses and the pool holds the largest variant, not the sum.

        with slotpool_torch.variant_group(None, 4) as grp:
            for k, x in enumerate(inputs):
                with grp.variant(k):
                    graphed[k] = torch.cuda.make_graphed_callables(layer, (x,), pool=grp.pool)
        # replay any graphed[k], in any order, one at a time

    The promise is the caller's: never replay two variants concurrently, and treat a variant's
    outputs as overwritten once another variant has been replayed."""

    def __init__(self, pool, count: int, device=None):
        ext = _installed_ext()
        self.device = _device(device)
        self._own_pool = pool is None or isinstance(pool, str)
        if pool is None:
            pool = f"slotpool_torch.variant_group.{id(self):x}"
        self.pool = named_pool(pool, self.device) if isinstance(pool, str) else _pool(pool)
        self.count = int(count)
        self._g = ext.variant_group(self.device, self.pool, self.count)
        self.last_restore: RestoreResult | None = None

    @contextlib.contextmanager
    def variant(self, k: int, route_thread: bool = True):
        """Capture variant k inside this block (pass ``pool=group.pool`` to the capture).

        With `route_thread` (the default), everything this thread allocates inside the block goes
        to the group's pool too, captured or not: the variant's static inputs, the gradient
        buffers and warm-up scratch of make_graphed_callables. It all belongs to variant k, and
        the next variant reuses its memory. So allocate inside the block only what variant k
        owns; anything that must outlive the group (an optimizer state, a cache) belongs before it.

        cuBLAS workspaces are dropped on entry and exit, as CUDA graph trees do around recording:
        cuBLAS keeps one per stream for the life of the process, and one allocated inside the
        block would sit in the group's pool, where the next variant's memory aliases it."""
        ext = _installed_ext()
        torch.cuda.synchronize(self.device)
        _clear_cublas_workspaces()
        d = self._g.begin(int(k), True)
        self.last_restore = RestoreResult(list(d["freed"]), list(d["created"]))
        if route_thread:
            ext.variant_route_begin(self.device, self.pool)
        try:
            yield self
        finally:
            if route_thread:
                ext.variant_route_end(self.device)
            torch.cuda.synchronize(self.device)
            _clear_cublas_workspaces()
            self._g.end()

    @property
    def active(self):
        return self._g.active

    def close(self) -> None:
        """End the group (the graphs captured stay valid and keep their memory)."""
        if self._g is not None:
            self._g.close()
            self._g = None
            if self._own_pool:
                release_pool(self.pool, self.device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def mark_reusable(tensor) -> int:
    """Mark `tensor`'s memory graph-retained but reusable: a captured graph still writes it (a
    static output or buffer), but later captures of the same pool may reuse it, because the
    caller promises those graphs never run at the same time (what TransformerEngine emulates with
    weak references). The tensor stays valid as an object; its contents are overwritten by the
    next graph that reuses the memory. Returns the bytes handed back to the pool."""
    ext = _installed_ext()
    if tensor.device.type != "cuda" or tensor.storage_offset() != 0:
        raise ValueError("mark_reusable needs a CUDA tensor that owns its allocation from offset 0")
    return int(ext.mark_reusable(tensor.untyped_storage().data_ptr()))


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def variant_group(pool, count: int, device=None) -> VariantGroup:
    """A :class:`VariantGroup` of `count` variants on `pool` (a pool id, a MemPool, a pool name, or
    None for a fresh named pool). Use as a context manager."""
    return VariantGroup(pool, count, device)


# ------------------------------------------------------------------------------------------------
# Arenas


class Arena:
    """A slot-aliased arena in a pool: slot s of every branch has the same address; the arena's
    size is the maximum over branches. Branches are mutually exclusive users (the caller's
    promise)."""

    def __init__(self, pool, stream=None, device=None):
        ext = _installed_ext()
        self.device = _device(device)
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        self.stream = int(stream.cuda_stream) if hasattr(stream, "cuda_stream") else int(stream)
        self.pool = _pool(pool)
        self.id = ext.arena_create(self.device, self.pool, self.stream)
        self._alive = True

    def empty(self, branch: int, slot: int, shape, dtype=None) -> torch.Tensor:
        """An uninitialised tensor at (branch, slot) of `dtype` (default torch.float32); the slot
        is freed when the tensor dies."""
        if dtype is None:
            dtype = torch.float32
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
        numel = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if numel <= 0:
            raise ValueError("slotpool_torch: an arena tensor needs at least one element")
        raw = _installed_ext().arena_tensor(self.device, self.id, int(branch), int(slot), numel * itemsize)
        return raw.view(dtype).view(shape)

    def alloc(self, branch: int, slot: int, size: int) -> int:
        """Raw allocation at (branch, slot): its address (free with :meth:`free`)."""
        return _installed_ext().arena_alloc(self.device, self.id, int(branch), int(slot), int(size))

    def free(self, branch: int, slot: int) -> None:
        _installed_ext().arena_free(self.device, self.id, int(branch), int(slot))

    def destroy(self) -> None:
        if self._alive:
            self._alive = False
            _installed_ext().arena_destroy(self.device, self.id)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
        return False


def built_for_torch() -> str:
    return load().built_for_torch()


def slotpool_version() -> tuple[int, int, int]:
    return tuple(load().slotpool_version())
