"""The server process's heap as loads and unloads leave it: glibc's C heap (large allocations
mapped on their own, free pages given back) and the cyclic collector (long-lived objects frozen
out of its sight, collected whole only when a stopped version's handler is still alive)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scriptserve.server.workers import AnyWorkerPool

log = logging.getLogger("scriptserve.memory")


MMAP_THRESHOLD = 128 * 1024
"""Allocations of this size and more are mapped on their own under a memory budget."""


def map_large_allocations() -> None:
    """Have glibc map every allocation of `MMAP_THRESHOLD` bytes or more on its own, and unmap
    it when freed. By default the threshold rises to the size of the largest block freed (up
    to 32 MiB), after which a model's weights are carved from the heap, and an unloaded
    model's bytes stay resident between live ones. The cost: a large allocation (a big
    activation) is a fresh mapping each time, paid in page faults."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its own policy stands
        ctypes.CDLL("libc.so.6").mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def give_back_heap() -> None:
    """Return the C heap's free pages to the system (glibc), so that an unloaded model's memory
    leaves the resident size now rather than at the allocator's convenience."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def freeze_heap() -> None:
    """Collect, then move every object alive now out of the cyclic collector's sight.

    A loaded model leaves ~200k long-lived objects (torch, the handler, the model); each full
    collection walked them all, holding the GIL long enough to stall every request under load.
    Frozen objects are still freed by reference counting. The collection walks only what is not
    frozen yet, the objects made since the last freeze.
    """
    gc.collect()
    gc.freeze()


def release_heap(pool: AnyWorkerPool) -> None:
    """After a version's workers stopped: bring its cyclic garbage back to the collector, only
    when there is some to bring.

    Refcounting frees a stopped version's handlers, and so its model, when nothing else holds
    them. A handler still alive is held by a reference cycle (or a stuck thread): then the heap
    is unfrozen and collected whole. That walks every object of the process, holding the GIL
    all along (a stall for every request, from any thread), so it is
    not done when nothing needs it.
    """
    alive = pool.handlers_alive()
    if alive:
        log.info(
            "model=%s version=%s %d handler(s) outlived the model's workers; collecting the heap",
            pool.model,
            pool.version,
            alive,
        )
        gc.unfreeze()
        freeze_heap()
