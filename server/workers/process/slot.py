"""A place of a process-worker pool: its worker process and the shared-memory segments its
batches go through."""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing import shared_memory
from threading import Lock

from scriptserve.server.workers.pool import Slot
from scriptserve.server.workers.process.child_process import Child


@dataclass(eq=False, kw_only=True)
class ProcessSlot(Slot):
    requests: shared_memory.SharedMemory
    responses: shared_memory.SharedMemory
    """The slot's segments outlive its worker processes; made before the first child, so that
    the children share this process's resource tracker."""
    child: Child | None = None
    """The worker process; None between losing one and starting the next."""
    crashes_in_row: int = 0
    lock: Lock = field(default_factory=Lock)

    @property
    def pid(self) -> int | None:
        child = self.child
        return child.process.pid if child is not None else None
