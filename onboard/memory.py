"""Giving freed memory back to the operating system between units of work.

Measured on `onboard eval` (SmolLM2, 512-token windows): resident memory grew by about 150 MB per
window, bf16 against bf16 as much as against an NVFP4 artifact, although nothing is kept but a few
floats per token; calling glibc's `malloc_trim(0)` after each window held it flat (1.1 GB over
the same windows). The freed [positions x vocab] blocks stay in glibc's heap, fragmented, instead
of returning to the system: no tensor is retained. PyTorch's CPU allocator has no cache to empty,
so the C library is asked directly; elsewhere (musl, macOS) this is a no-op.
"""

import ctypes
import ctypes.util
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache


@cache
def _libc_function(function: str):
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def map_large_blocks(threshold: int = 1 << 20) -> None:
    """Allocate blocks of `threshold` bytes and more with their own mappings, unmapped when freed.

    A streamed stage allocates and frees a layer's tensors once per layer; from glibc's heap those
    blocks come back fragmented, and resident memory grew by gigabytes during llm-compressor's
    compression of an offloaded 16 GB model (killed by a 6 GB cgroup).  With their own mappings
    every freed block returns to the system at once.  A no-op without glibc."""
    mallopt = _libc_function("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, threshold)


def release_freed_memory() -> None:
    """Return the C heap's free pages to the system (glibc); a no-op where that is unavailable."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


@contextmanager
def layer_by_layer() -> Iterator[Callable[[], None]]:
    """For a loop that builds, runs and drops one decoder layer per step: `drop()` after each step
    frees the dropped layer (a compressed-tensors layer sits in reference cycles, its shell and its
    hooks, which only the cycle collector frees, and it runs by object counts, not bytes: a 16 GB
    artifact held a dozen dropped layers when its 6 GB cgroup killed the eval) and gives the pages
    back. What exists before the loop is frozen out of those collections (`gc.freeze`): a full
    collection scans every object of the process, about 0.5 s per layer in a process that holds a
    million (a test session; transformers' imports alone are hundreds of thousands), and nothing
    made before the loop can be a dropped layer."""

    def drop() -> None:
        gc.collect()
        release_freed_memory()

    gc.freeze()
    try:
        yield drop
    finally:
        gc.unfreeze()
