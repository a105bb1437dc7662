"""Reusable CPU buffers for the chunked kernel's temporaries in calls without autograd.

One call at T = 8192 with four heads of K = V = 128 allocates about 150 MB of temporaries. glibc gives freed memory
above its trim threshold (at most 64 MB) back to the system, so such calls faulted part of those pages in again
each time, which cost 5-20% of a call on one CPU thread (docs/performance.md). Buffers kept here between calls are written, never
faulted in again.

Only temporaries that die with the call come from a lease; whatever a call returns is allocated afresh, so a
result never shares memory with a later call. The pool is per thread (concurrent calls never share a buffer) and
holds at most `scratch_limit()` bytes; `set_scratch_limit(0)` turns it off, `release_scratch()` empties it.
Autograd calls never lease: a graph keeps its saved tensors past the call.
"""
from __future__ import annotations

import contextlib
import math
import threading
from typing import Callable, Iterator

import torch

MIN_POOLED_BYTES = 1 << 18          # smaller buffers come from the allocator, which keeps them without faults
_limit = 1 << 30                    # bytes a thread's pool may keep between calls


class _Pool(threading.local):
    def __init__(self):
        self.free: list[torch.Tensor] = []      # flat buffers not in use, the most recently used first


_pool = _Pool()


def scratch_limit() -> int:
    """Bytes of temporaries each thread keeps between chunked calls."""
    return _limit


def set_scratch_limit(nbytes: int) -> None:
    """Sets how many bytes each thread keeps (0: none, every temporary from the allocator); applies from the next
    call that ends, and empties this thread's pool now if it holds more."""
    global _limit
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"the scratch limit must be a number of bytes, an int >= 0, got {nbytes!r}")
    _limit = nbytes
    _trim(_pool.free)


def release_scratch() -> None:
    """Frees every buffer this thread keeps (e.g. before a step that needs the memory)."""
    _pool.free.clear()


def pooled_bytes() -> int:
    """Bytes this thread's pool holds now."""
    return sum(_nbytes(b) for b in _pool.free)


def _nbytes(buf: torch.Tensor) -> int:
    return buf.numel() * buf.element_size()


def _trim(free: list[torch.Tensor]) -> None:
    total = sum(_nbytes(b) for b in free)
    while free and total > _limit:
        total -= _nbytes(free.pop())            # the least recently used first


@contextlib.contextmanager
def lease(device: torch.device, enabled: bool = True) -> Iterator[Callable[..., torch.Tensor]]:
    """Yields new(*shape, dtype=...) -> an uninitialised contiguous tensor on `device`. While enabled on a CPU, a
    tensor of at least MIN_POOLED_BYTES is a view of this thread's smallest free buffer that fits (or of a new one);
    every buffer taken goes back to the pool when the block ends, so nothing handed out may outlive it."""
    pooled = enabled and _limit > 0 and torch.device(device).type == "cpu"
    taken: list[torch.Tensor] = []

    def new(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        if not pooled or numel * dtype.itemsize < MIN_POOLED_BYTES:
            return torch.empty(shape, dtype=dtype, device=device)
        free = _pool.free
        fits = [i for i, b in enumerate(free) if b.dtype == dtype and b.numel() >= numel]
        if fits:
            buf = free.pop(min(fits, key=lambda i: free[i].numel()))
        else:
            # A normal tensor even under torch.inference_mode(): an inference tensor could not be written by a later
            # call outside it, and a normal one may be written inside.
            with torch.inference_mode(False):
                buf = torch.empty(numel, dtype=dtype, device=device)
        taken.append(buf)
        return buf[:numel].view(shape)

    try:
        yield new
    finally:
        if taken:
            _pool.free[:0] = taken
            _trim(_pool.free)
