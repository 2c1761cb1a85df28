"""The worker process of `worker_mode: process`: load the handler, then run batches on request.

It talks to its slot's thread in the server over one pipe, in small messages:

- it sends `("ready", pid, warmup)` once its handler is loaded and has run the sample input
  (`warmup.warm_up`), or `("error", message)` and exits;
- it receives `("run", requests_segment, responses_segment, responses_size, described)`, reads
  the requests from shared memory, runs the batch (`run_batch`), writes the responses into the
  responses segment and sends `("done", described_responses, (input_s, output_s), metrics)`
  (what the handler's metrics changed by, handlers/metrics.py), the seconds
  spent reading and preprocessing the batch, and postprocessing and writing its answers (Triton's
  compute_input and compute_output); when they do not fit it first
  sends `("grow", bytes_needed)` and receives `("output", segment, size)`;
- a streaming handler's parts go as `("parts", [part or None per request])` while the batch
  runs, each answered with `("listening", bool)`: False when no request still listens, and the
  handler is stopped with `StreamClosed`;
- `("profile", settings)` starts PyTorch's profiler for a capture (workers/capture.py),
  answered `("profiling", None or error)`; each batch is then a named range in it, until
  `("profile-end", path)` stops it and writes its Chrome trace to `path` (None: drops it),
  answered `("profiled", None or error)`;
- `("stop",)` or the pipe closing ends it. It also ends when the server process goes away,
  even in the middle of a handler call, so no worker outlives its server.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import reduction, shared_memory
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    InferenceRequest,
    InferenceResponse,
    StageTimes,
    StreamClosed,
    load_failure,
    run_batch,
)
from scriptserve.handlers.loader import load_handler, worker_scope
from scriptserve.server.observability.log_format import configure_logging
from scriptserve.server.workers.capture import (
    CaptureSettings,
    batch_label,
    batch_range,
    start_profiler,
    stop_profiler,
)
from scriptserve.server.workers.process import shared_memory as frames
from scriptserve.server.workers.warmup import warm_up

log = logging.getLogger("scriptserve.workers.child")


@dataclass(frozen=True)
class ChildSpec:
    """What a worker process needs to build its handler (pickled once, at spawn)."""

    context: Context
    """The handler's context, on the worker's device."""
    log_level: int = logging.INFO
    log_format: str = "plain"
    worker: int = 0
    """The slot's id, for the log."""
    warmup_runs: int = 0
    """Runs of the archive's sample input before the worker says it is ready; 0 = none."""


class ServerStreams:
    """The server's stdout and stderr as they are when a worker is started, for the worker to
    write to: a forked worker would otherwise write where the fork server's were when it started
    (the same in a server whose streams never change; not under a test's capture)."""

    def __init__(self, fds: Sequence[Any] = ()) -> None:
        self._fds = fds

    def __reduce__(self) -> tuple[type[ServerStreams], tuple[list[Any]]]:
        # Pickled while multiprocessing starts the worker: each fd goes along with it.
        return ServerStreams, ([reduction.DupFd(fd) for fd in (1, 2)],)

    def install(self) -> None:
        for target, fd in zip((1, 2), self._fds, strict=True):
            received = fd.detach()
            os.dup2(received, target)
            os.close(received)


def _watch_server() -> None:
    """Exit when the server is gone, even while a handler call never returns. The server holds
    the other end of this process's start pipe (multiprocessing's parent sentinel) until it
    exits, however it exits; the worker's parent is the fork server, not the server."""
    server = multiprocessing.parent_process()
    if server is not None:
        server.join()
        os._exit(1)


class _Segments:
    """The segments this process has mapped, by name; the server creates and unlinks them."""

    def __init__(self) -> None:
        self._open: dict[str, shared_memory.SharedMemory] = {}

    def get(self, role: str, name: str) -> memoryview:
        segment = self._open.get(role)
        if segment is None or segment.name != name:
            if segment is not None:
                frames.release_segment(segment, unlink=False)
            segment = shared_memory.SharedMemory(name=name)
            self._open[role] = segment
        return frames.segment_view(segment)


def _describe_responses(
    frame: frames.Frame,
    requests: list[InferenceRequest],
    responses: list[InferenceResponse],
    context: Context,
) -> list[dict[str, Any]]:
    try:
        return [frames.describe_response(frame, response) for response in responses]
    except Exception as exc:  # e.g. a body that cannot be pickled
        log.exception(
            "model=%s version=%s request_ids=%s the handler's responses cannot be sent",
            context.model_name,
            context.model_version,
            ",".join(r.request_id for r in requests),
        )
        failed = InferenceResponse.failed(
            f"the handler's response cannot be sent: {type(exc).__name__}", 500
        )
        frame.clear()
        return [frames.describe_response(frame, failed) for _ in responses]


class _PipeParts:
    """The batch's parts go to the server over the pipe; it says whether anyone listens."""

    def __init__(self, conn: Connection, batch_size: int) -> None:
        self._conn = conn
        self._batch_size = batch_size

    def send(self, parts: Sequence[InferenceResponse | None]) -> None:
        if len(parts) != self._batch_size:  # checked here: the server only relays the answer
            raise ValueError(
                f"{len(parts)} parts were sent for a batch of {self._batch_size} requests; "
                "send one part (or None) per request"
            )
        self._conn.send(("parts", list(parts)))
        _, listening = self._conn.recv()
        if not listening:
            raise StreamClosed()


class _Profiling:
    """This process's profiler while a capture runs (`profile` / `profile-end` messages)."""

    def __init__(self) -> None:
        self.profiler: Any = None

    def start(self, settings: CaptureSettings) -> str | None:
        if self.profiler is not None:
            return None
        try:
            self.profiler = start_profiler(settings, all_threads=False)
        except Exception as exc:
            log.exception("the profiler did not start")
            return f"the profiler did not start in the worker process: {exc}"
        return None

    def end(self, path: str | None) -> str | None:
        """Stop the profiler and write its trace to `path` (None: drop it)."""
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return "the worker process was not profiling"
        try:
            if path is None:
                profiler.stop()
            else:
                stop_profiler(profiler, Path(path))
        except Exception as exc:
            log.exception("the profiler's trace could not be written")
            return f"the worker process could not write its trace: {exc}"
        return None


def _serve(conn: Connection, handler: BaseHandler, context: Context) -> None:
    segments = _Segments()
    profiling = _Profiling()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "profile":
            conn.send(("profiling", profiling.start(message[1])))
            continue
        if message[0] == "profile-end":
            conn.send(("profiled", profiling.end(message[1])))
            continue
        if message[0] != "run":
            return
        _, requests_name, responses_name, responses_size, described = message
        started = time.perf_counter()
        buf = segments.get("requests", requests_name)
        requests = [frames.read_request(buf, d) for d in described]
        del buf
        times = StageTimes(input_s=time.perf_counter() - started)
        parts = _PipeParts(conn, len(requests))
        if profiling.profiler is not None:
            ids = [r.request_id for r in requests]
            with batch_range(batch_label(context.model_name, context.model_version, ids)):
                responses = run_batch(handler, requests, context, times, parts)
        else:
            responses = run_batch(handler, requests, context, times, parts)
        extracting = time.perf_counter()
        frame = frames.Frame()
        metas = _describe_responses(frame, requests, responses, context)
        if frame.size > responses_size:
            conn.send(("grow", frame.size))
            _, responses_name, responses_size = conn.recv()
        frame.write(segments.get("responses", responses_name))
        times.output_s += time.perf_counter() - extracting
        conn.send(("done", metas, (times.input_s, times.output_s), context.metrics.drain()))


def child_main(conn: Connection, spec: ChildSpec, streams: ServerStreams) -> None:
    """Entry point of a worker process (multiprocessing's target)."""
    streams.install()
    # Ctrl-C reaches the whole process group; the server decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(spec.log_level, spec.log_format)  # the server's format
    # A crash in native code (a compiled model, a GPU runtime) prints this worker's Python
    # stacks to the server's stderr: the server itself sees only the signal it died of.
    faulthandler.enable(all_threads=True)
    threading.Thread(target=_watch_server, daemon=True).start()
    context = spec.context
    try:
        handler = load_handler(context)
    except Exception as exc:
        conn.send(("error", load_failure(exc, context.model_name, context.model_version).message))
        return
    with worker_scope(handler):
        warmup = warm_up(handler, context, spec.warmup_runs, spec.worker)
        conn.send(("ready", os.getpid(), warmup))
        _serve(conn, handler, context)
    # Skip the interpreter's teardown of torch and friends (seconds on a busy machine): the
    # handler has no cleanup hook, and the server waits for this exit when it shuts down.
    logging.shutdown()
    os._exit(0)
