"""A profiling capture as the workers see it: which batches it covers, what it records, and
PyTorch's profiler started and stopped where the batches run (server/models/profiling.py
asks for one and makes the trace file).

Thread workers share the server's one profiler, which records every thread; each batch they
run is a `record_function` range named after the model, the batch's size and its request ids,
so the trace shows batches, and under them whatever operators the model's runtime records.
A process worker runs its own profiler from its next batch until the capture ends; the runner
starts and stops it (`ProcessRunner.profile`).

torch is imported only when a capture runs: a server of `.pt2` models on CPU never imports it
otherwise.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILER_TIMEOUT_S = 60.0
"""How long a worker process may take to start its profiler, or to stop it and write its trace."""


@dataclass(frozen=True)
class CaptureSettings:
    """What the profiler records (picklable: process workers get it over their pipe)."""

    record_shapes: bool = False
    """Input shapes of each operator."""
    with_stack: bool = False
    """The Python stack of each operator (slower; larger trace)."""
    cuda: bool = False
    """Record CUDA kernels too (the model runs on a GPU)."""


def start_profiler(settings: CaptureSettings, all_threads: bool) -> Any:
    """A started `torch.profiler.profile`; `all_threads` records every thread of this process
    (PyTorch's profiler otherwise records only the thread that started it)."""
    import torch.profiler
    from torch._C._profiler import _ExperimentalConfig

    activities = [torch.profiler.ProfilerActivity.CPU]
    if settings.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        record_shapes=settings.record_shapes,
        with_stack=settings.with_stack,
        experimental_config=_ExperimentalConfig(profile_all_threads=all_threads),
    )
    profiler.start()
    return profiler


def stop_profiler(profiler: Any, path: Path) -> None:
    """Stop `profiler` and write its Chrome trace to `path`."""
    profiler.stop()
    profiler.export_chrome_trace(str(path))


@contextlib.contextmanager
def batch_range(label: str) -> Iterator[None]:
    """A profiler range around one batch."""
    import torch.autograd.profiler

    with torch.autograd.profiler.record_function(label):
        yield


def batch_label(model: str, version: str, request_ids: Sequence[str]) -> str:
    shown = ",".join(request_ids[:8]) + (",..." if len(request_ids) > 8 else "")
    return f"batch {model}:{version} x{len(request_ids)} [{shown}]"


@dataclass(eq=False)
class Capture:
    """One capture of one model version's batches, shared by its pool's worker threads.

    It ends (`done`) after `batches` batches (None: no count) or when the server ends it
    (its time is up, the server stops); `on_done` is called once, from the thread that ends it.
    """

    model: str
    version: str
    settings: CaptureSettings
    batches: int | None
    on_done: Callable[[], None]
    trace_dir: Path
    """Where process workers write their traces (`trace_of`)."""
    counted: int = 0
    """Batches run since it started."""
    threads: dict[int, str] = field(default_factory=dict)
    """Native id -> name of each worker thread that ran a batch in it."""
    profiling: set[int] = field(default_factory=set)
    """Slots whose worker process runs its profiler for it and has not handed its trace yet."""
    traces: list[Path] = field(default_factory=list)
    """Traces handed over by worker processes."""
    problems: list[str] = field(default_factory=list)
    """What went wrong in a worker process (its trace is missing)."""
    done: threading.Event = field(default_factory=threading.Event)
    settled: threading.Event = field(default_factory=threading.Event)
    """Set once it is done and no worker process still profiles for it."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def range(self, request_ids: Sequence[str]) -> contextlib.AbstractContextManager[None]:
        """Around one batch in a worker thread: names it in the trace."""
        thread = threading.current_thread()
        if thread.native_id is not None and thread.native_id not in self.threads:
            self.threads[thread.native_id] = thread.name
        return batch_range(batch_label(self.model, self.version, request_ids))

    def count(self) -> None:
        """A batch in the capture ended; the capture ends with the last one asked for."""
        with self._lock:
            self.counted += 1
            last = self.batches is not None and self.counted >= self.batches
        if last:
            self.finish()

    def finish(self) -> None:
        with self._lock:
            if self.done.is_set():
                return
            self.done.set()
            if not self.profiling:
                self.settled.set()
        self.on_done()

    def trace_of(self, slot_id: int) -> Path:
        return self.trace_dir / f"worker-{slot_id}.json"

    def joined(self, slot_id: int) -> None:
        with self._lock:
            self.profiling.add(slot_id)

    def handed(self, slot_id: int, trace: Path | None, problem: str | None = None) -> None:
        """A worker process stopped its profiler: its trace, or what went wrong."""
        with self._lock:
            self.profiling.discard(slot_id)
            if trace is not None:
                self.traces.append(trace)
            if problem is not None:
                self.problems.append(problem)
            if self.done.is_set() and not self.profiling:
                self.settled.set()
