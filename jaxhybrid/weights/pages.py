"""Large weights in 2 MB pages on the CPU.

A decode step streams every weight once. In 4 KB pages a weight row of `small` is one page and the read
crosses a page (a TLB miss, and the end of what the hardware prefetcher follows) every row; in 2 MB pages
it crosses one every 512 rows. Linux backs a private anonymous mapping with 2 MB pages where it is told to
(`MADV_HUGEPAGE`) when transparent huge pages are on ("madvise" or "always"), which XLA's allocator does
not ask for. `move_to_huge_pages` copies a model's large CPU weights into such mappings and hands them to
XLA without a copy (`jax.device_put(..., may_alias=True)`; the array keeps its mapping alive and frees it
with itself). Same values, same dtypes: only where the bytes lie changes. What it saves was measured in
`git show 9bb8ba5:BENCHMARKS.md` ("Weights in 2 MB pages"). `JAXHYBRID_HUGE_PAGES=0` turns it off.
"""

from __future__ import annotations

import mmap
import os
import sys
import weakref
from pathlib import Path

import jax
import numpy as np
from flax import nnx

PAGE = 2 << 20  # bytes of one huge page; smaller arrays stay where they are
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_MOVED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> array already in 2 MB pages


def available() -> bool:
    """Whether this process can ask for 2 MB pages: Linux with transparent huge pages on "always" or
    "madvise", and not turned off by `JAXHYBRID_HUGE_PAGES=0`."""
    if os.environ.get("JAXHYBRID_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def qualifies(x: object) -> bool:
    """A jax array of at least one huge page on a single CPU device (a sharded array stays as it is), not
    already in 2 MB pages (a model given to a second engine)."""
    if not isinstance(x, jax.Array) or x.nbytes < PAGE or len(x.sharding.device_set) != 1:
        return False
    if _MOVED.get(id(x)) is x:
        return False
    return next(iter(x.sharding.device_set)).platform == "cpu"


def in_huge_pages(x: jax.Array) -> jax.Array:
    """`x`'s values in a new array whose memory is a private anonymous mapping advised to 2 MB pages, at a
    2 MB boundary; on `x`'s device."""
    host = np.asarray(x)
    size = -(-host.nbytes // PAGE) * PAGE
    region = mmap.mmap(-1, size + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:  # before the first touch: the pages are allocated as 2 MB ones
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KB pages, at a 2 MB boundary all the same
        pass
    start = -np.frombuffer(region, np.uint8, 1).ctypes.data % PAGE
    out = np.frombuffer(region, np.uint8, host.nbytes, start).view(host.dtype).reshape(host.shape)
    out[...] = host
    moved = jax.device_put(out, next(iter(x.sharding.device_set)), may_alias=True)
    _MOVED[id(moved)] = moved
    return moved


def move_to_huge_pages(model: nnx.Module) -> int:
    """Put every large CPU weight of `model` (`qualifies`) into 2 MB pages, in place, one at a time (the old
    copy is freed as its replacement takes its place where nothing else holds it). Returns the bytes moved;
    0 where `available()` is False."""
    if not available():
        return 0
    moved = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and qualifies(node.get_value()):
            node[...] = in_huge_pages(node[...])  # same shape, dtype and sharding: replaces the array itself
            moved += node[...].nbytes
    return moved
