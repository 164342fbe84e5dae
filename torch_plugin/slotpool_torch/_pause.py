"""Pausing pools: their physical memory goes back to the driver while every address, tensor and
CUDA graph on them stays valid; resuming maps new memory at the same addresses (and copies a
backup back). See docs/torch.md, "Pausing pools".

The torch_memory_saver names work as they do there, so that migrating is a change of import::

    from slotpool_torch import torch_memory_saver      # was: from torch_memory_saver import ...
    with torch_memory_saver.region("kv_cache"):
        kv = torch.empty(...)
    torch_memory_saver.pause("kv_cache")
    torch_memory_saver.resume("kv_cache")
"""

from __future__ import annotations

import contextlib
import threading

from ._torch import torch  # imported on first use

_TAG_DEFAULT = "default"

# (device, tag) -> pool id of the pausable pool a tag names; each holds one use of its pool.
_tags: dict[tuple[int, str], tuple[int, int]] = {}
# (device, tag) -> whether a pause of the tag backs its contents up (any region asked for it).
_backup: dict[tuple[int, str], bool] = {}
_lock = threading.Lock()
# This thread's open regions, innermost last: [(device, pool id)].
_local = threading.local()


def _sp():
    from . import _device, _installed_ext, _pool

    return _installed_ext(), _device, _pool


def _stack() -> list:
    if not hasattr(_local, "regions"):
        _local.regions = []
    return _local.regions


def tag_pool(tag: str, device=None) -> tuple[int, int]:
    """The pausable pool that `tag` names on `device` (created on first use; it lives as long as
    the process)."""
    ext, _device, _ = _sp()
    dev = _device(device)
    with _lock:
        pid = _tags.get((dev, tag))
        if pid is None:
            pid = tuple(ext.pool_named(dev, tag, pausable=True))
            _tags[(dev, tag)] = pid
        return pid


def _resolve(pool, device) -> tuple[int, tuple[int, int], str | None]:
    """(device, pool id, tag or None) of a tag or a pool id."""
    _, _device, _pool = _sp()
    dev = _device(device)
    if isinstance(pool, str):
        with _lock:
            pid = _tags.get((dev, pool))
        if pid is None:
            raise ValueError(
                f"slotpool_torch: no region or pausable pool is tagged {pool!r} on device {dev}"
            )
        return dev, pid, pool
    return dev, _pool(pool), None


def _targets(pool, device) -> list:
    """What pause/resume act on: one pool, or every tag of the device when pool is None."""
    if pool is not None:
        return [_resolve(pool, device)]
    _, _device, _ = _sp()
    dev = _device(device)
    with _lock:
        return [(d, pid, tag) for (d, tag), pid in _tags.items() if d == dev]


@contextlib.contextmanager
def region(tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False, device=None):
    """Route this thread's allocations to the pausable pool named `tag` (created if new) for the
    duration of the block. With enable_cpu_backup, pausing the tag copies its contents to pinned
    host memory and resuming copies them back; without, they are discarded (a KV cache)."""
    _, _device, _ = _sp()
    dev = _device(device)
    pid = tag_pool(tag, dev)
    with _lock:
        _backup[(dev, tag)] = _backup.get((dev, tag), False) or bool(enable_cpu_backup)
    stack = _stack()
    if stack and stack[-1] == (dev, pid):
        yield pid  # the same region again: already routed
        return
    torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pid)
    stack.append((dev, pid))
    try:
        yield pid
    finally:
        stack.pop()
        torch._C._cuda_endAllocateToPool(dev, pid)
        torch._C._cuda_releasePool(dev, pid)


@contextlib.contextmanager
def disable():
    """Allocations of this thread go to the default pool for the duration, even inside regions."""
    stack = _stack()
    saved = list(stack)
    for dev, pid in reversed(saved):
        torch._C._cuda_endAllocateToPool(dev, pid)
        torch._C._cuda_releasePool(dev, pid)
    stack.clear()
    try:
        yield
    finally:
        for dev, pid in saved:
            torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pid)
            stack.append((dev, pid))


def pause(pool=None, backup: bool | None = None, device=None) -> None:
    """Give the physical memory of `pool` (a tag, a pool id or a MemPool; None: every tag of the
    device) back to the driver. Addresses, tensors and graphs stay; allocating from the pool
    fails until :func:`resume`. backup: copy the contents to pinned host memory first (None: as
    the tag's regions asked, else False). Synchronises the device."""
    ext, _, _ = _sp()
    for dev, pid, tag in _targets(pool, device):
        keep = backup if backup is not None else _backup.get((dev, tag), False)
        if pool is None and ext.pool_pause_info(dev, pid)[0]:
            continue
        ext.pool_pause(dev, pid, bool(keep))


def resume(pool=None, device=None) -> None:
    """Map new memory under every address of a paused `pool` (None: every paused tag of the
    device) and copy its backup back."""
    ext, _, _ = _sp()
    for dev, pid, _tag in _targets(pool, device):
        if pool is None and not ext.pool_pause_info(dev, pid)[0]:
            continue
        ext.pool_resume(dev, pid)


def pause_info(pool, device=None) -> dict:
    """{"paused": bool, "paused_bytes": int, "host_bytes": int} of a tag or pool."""
    ext, _, _ = _sp()
    dev, pid, _ = _resolve(pool, device)
    paused, nbytes, host = ext.pool_pause_info(dev, pid)
    return {"paused": bool(paused), "paused_bytes": int(nbytes), "host_bytes": int(host)}


@contextlib.contextmanager
def paused(pool, backup: bool | None = None, device=None):
    """``with paused(pool):`` pauses `pool` for the block and resumes it after, even on error."""
    pause(pool, backup=backup, device=device)
    try:
        yield
    finally:
        resume(pool, device=device)


def cuda_graph(cuda_graph, pool=None, stream=None, capture_error_mode: str = "global",
               tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False):
    """``torch.cuda.graph`` whose memory lives in the pausable pool of `tag` (pool=None), so that
    pausing the tag releases the graph's memory too, as torch_memory_saver.cuda_graph does."""
    if pool is None:
        pool = tag_pool(tag)
        dev = torch.cuda.current_device()
        with _lock:
            _backup[(dev, tag)] = _backup.get((dev, tag), False) or bool(enable_cpu_backup)
    return torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                            capture_error_mode=capture_error_mode)


class TorchMemorySaver:
    """torch_memory_saver's object, over slotpool's pausable pools. ``hook_mode`` is accepted and
    ignored: slotpool is PyTorch's allocator already."""

    hook_mode = None

    @property
    def enabled(self) -> bool:
        from . import is_installed

        return is_installed()

    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False):
        return region(tag, enable_cpu_backup=enable_cpu_backup)

    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode: str = "global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False):
        return cuda_graph_fn(cuda_graph, pool=pool, stream=stream,
                             capture_error_mode=capture_error_mode, tag=tag,
                             enable_cpu_backup=enable_cpu_backup)

    def disable(self):
        return disable()

    def pause(self, tag: str | None = None) -> None:
        pause(tag)

    def resume(self, tag: str | None = None) -> None:
        resume(tag)


cuda_graph_fn = cuda_graph
torch_memory_saver = TorchMemorySaver()
memory_saver = torch_memory_saver
