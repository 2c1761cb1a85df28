"""Profiling on demand: a `torch.profiler` trace of one model version's next N batches or S
seconds, returned as a Chrome/Perfetto trace file, while the model goes on serving.

    result = await profiler.capture(mv, ProfileOptions(batches=20))
    result.trace  # the gzip-compressed Chrome trace JSON (chrome://tracing, ui.perfetto.dev)

The capture ends after `batches` batches, or after `seconds`, whichever comes first (neither
given: 10 batches, waiting at most 60 s; only batches: waiting at most 60 s). What ran by then is
the trace: a model without traffic gives a trace without batches, not an error.

Thread workers: PyTorch's profiler is one per process, so the server runs one, recording every
thread, and keeps only the events of this model's worker threads (named as the server names
them). That makes one capture at a time across the thread-worker models of a server. Process
workers: each worker process profiles itself from its next batch and the traces are merged,
each process under its own pid; such captures may run for several models at once. At most one
capture per model at a time either way.

In the trace every batch is a range named `batch <model>:<version> x<size> [<request ids>]`;
TorchScript and eager handlers show their operators under it. A `.pt2` package or an ONNX model
shows as the ranges alone: its compiled code does not report operators to the profiler.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import gzip
import json
import logging
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scriptserve.server.errors import Conflict, InvalidInput, ModelNotReady, invalid_fields
from scriptserve.server.models.model_version import ModelVersion
from scriptserve.server.workers.capture import (
    PROFILER_TIMEOUT_S,
    Capture,
    CaptureSettings,
    start_profiler,
    stop_profiler,
)

log = logging.getLogger("scriptserve.profiling")

DEFAULT_BATCHES = 10
DEFAULT_WAIT_S = 60.0
MAX_SECONDS = 600.0


class ProfileOptions(BaseModel):
    """What to capture, as the management APIs take it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    batches: int | None = Field(None, ge=1, le=100_000, description="batches to capture")
    seconds: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="longest capture, in seconds"
    )
    record_shapes: bool = Field(False, description="record each operator's input shapes")
    with_stack: bool = Field(False, description="record each operator's Python stack")

    @classmethod
    def parse(cls, values: dict[str, Any]) -> ProfileOptions:
        """Validate values taken from a wire message; InvalidInput names each bad one."""
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise InvalidInput(invalid_fields(exc.errors())) from None

    def limits(self) -> tuple[int | None, float]:
        """(batches to capture or None, longest wait in seconds)."""
        if self.batches is None and self.seconds is None:
            return DEFAULT_BATCHES, DEFAULT_WAIT_S
        return self.batches, self.seconds if self.seconds is not None else DEFAULT_WAIT_S


@dataclass(frozen=True)
class ProfileResult:
    trace: bytes
    """The Chrome trace JSON, gzip-compressed."""
    file_name: str
    batches: int
    """Batches captured."""
    seconds: float
    """How long the capture ran."""
    problems: list[str] = field(default_factory=list)
    """Worker processes whose trace is missing, and why."""


class Profiler:
    """The captures running in this server; see the module docstring."""

    def __init__(self) -> None:
        self._models: set[str] = set()
        self._in_process: str | None = None
        """The model whose capture holds this process's profiler (thread workers)."""
        self._executor: ThreadPoolExecutor | None = None
        """One thread starts and stops this process's profiler."""

    async def capture(self, mv: ModelVersion, options: ProfileOptions) -> ProfileResult:
        if not mv.serving:
            raise ModelNotReady(f"model {mv.name!r} version {mv.version} is not serving")
        if mv.name in self._models:
            raise Conflict(
                f"a profile of model {mv.name!r} is being captured; ask again once it has ended"
            )
        in_process = mv.pool.mode == "thread"
        if in_process and self._in_process is not None:
            raise Conflict(
                f"a profile of model {self._in_process!r} is being captured, and the server "
                "process records one at a time for thread workers (PyTorch's profiler is one "
                "per process); ask again once it has ended"
            )
        self._models.add(mv.name)
        if in_process:
            self._in_process = mv.name
        try:
            return await self._capture(mv, options, in_process)
        finally:
            self._models.discard(mv.name)
            if in_process:
                self._in_process = None

    async def _capture(
        self, mv: ModelVersion, options: ProfileOptions, in_process: bool
    ) -> ProfileResult:
        batches, wait_s = options.limits()
        pool = mv.pool
        settings = CaptureSettings(
            record_shapes=options.record_shapes,
            with_stack=options.with_stack,
            cuda=any(slot.device.startswith("cuda") for slot in pool.slots()),
        )
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()

        def on_done() -> None:  # from the worker thread that ran the last batch
            loop.call_soon_threadsafe(ended.set)

        started_at = dt.datetime.now(dt.timezone.utc)
        file_name = f"{mv.name}-{mv.version}-{started_at:%Y%m%dT%H%M%SZ}.pt.trace.json"
        with tempfile.TemporaryDirectory(prefix="scriptserve-profile-") as tmp:
            capture = Capture(
                mv.name,
                mv.version,
                settings,
                batches,
                on_done=on_done,
                trace_dir=Path(tmp),
            )
            profiler = None
            if in_process:
                profiler = await self._in_own_thread(start_profiler, settings, True)
            log.info(
                "model=%s version=%s profiling %s batches, for at most %g s",
                mv.name,
                mv.version,
                batches if batches is not None else "all",
                wait_s,
            )
            started = time.monotonic()
            pool.capture = capture
            pool.look()  # process workers start their profilers now, not after a batch
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), wait_s)
            finally:
                capture.finish()
                seconds = time.monotonic() - started
                try:
                    if in_process:
                        own = capture.trace_of(0)
                        await self._in_own_thread(stop_profiler, profiler, own)
                        capture.traces.append(own)
                    else:
                        pool.look()  # each worker process ends its profiler and writes
                        await asyncio.to_thread(capture.settled.wait, PROFILER_TIMEOUT_S)
                finally:
                    pool.capture = None
            trace = await asyncio.to_thread(
                merged_trace,
                capture.traces,
                capture.threads if in_process else None,
                {
                    "model": mv.name,
                    "version": mv.version,
                    "batches": capture.counted,
                    "seconds": round(seconds, 3),
                    "started": started_at.isoformat(),
                },
            )
        problems = list(capture.problems)
        if capture.profiling:
            problems.append(f"{len(capture.profiling)} worker process(es) did not hand a trace")
        log.info(
            "model=%s version=%s profiled %d batches in %.1f s (%d bytes)%s",
            mv.name,
            mv.version,
            capture.counted,
            seconds,
            len(trace),
            f"; {'; '.join(problems)}" if problems else "",
        )
        return ProfileResult(trace, file_name, capture.counted, seconds, problems)

    async def _in_own_thread(self, function: Any, *args: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="profiler")
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)


def merged_trace(paths: list[Path], threads: dict[int, str] | None, about: dict[str, Any]) -> bytes:
    """One Chrome trace of the traces at `paths`, gzip-compressed. With `threads` (native id
    -> name), events of other threads of the process are left out and these are named."""
    events: list[dict[str, Any]] = []
    document: dict[str, Any] = {}
    for path in paths:
        if not path.exists():
            continue
        part = json.loads(path.read_text())
        document = document or part
        for event in part.get("traceEvents", []):
            tid = event.get("tid")
            if threads is not None and isinstance(tid, int) and tid and tid not in threads:
                continue
            if threads is not None and event.get("name") == "thread_name" and tid in threads:
                event["args"] = {"name": threads[tid]}
            events.append(event)
    document = {**document, "traceEvents": events, "otherData": about}
    document.pop("traceName", None)  # the server's temporary file
    return gzip.compress(json.dumps(document).encode(), compresslevel=6)
