"""The worker process of `worker_mode: process`: load the handler, then run batches on request.

It talks to its proxy thread in the server over one pipe, in small messages:

- it sends `("ready", pid)` once its handler is loaded, or `("error", message)` and exits;
- it receives `("run", requests_segment, responses_segment, responses_size, described)`, reads
  the requests from shared memory, runs `handler.handle`, writes the responses into the
  responses segment and sends `("done", described_responses)`; when they do not fit it first
  sends `("grow", bytes_needed)` and receives `("output", segment, size)`;
- `("stop",)` or the pipe closing ends it. It also ends when the server process goes away,
  even in the middle of a handler call, so no worker outlives its server.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from scriptserve.archiver.manifest import Manifest
from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import BaseHandler, Context, HandlerError, InferenceResponse
from scriptserve.handlers.loader import load_handler, worker_scope
from scriptserve.server import shmframes

log = logging.getLogger("scriptserve.procworker")

_PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class ChildSpec:
    """What a worker process needs to build its handler (pickled once, at spawn)."""

    model_name: str
    model_version: str
    model_dir: str
    manifest: Manifest
    model_config: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    batch_size: int = 1
    intra_op_threads: int = 1
    log_level: int = logging.INFO
    parent_pid: int = 0
    model_file: str | None = None
    """The model file to load instead of the archive's own (an int8 conversion made at load)."""

    @classmethod
    def for_model(
        cls, model: str, version: str, model_dir: Path, manifest: Manifest,
        config: dict[str, Any], batch_size: int, intra_op_threads: int,
    ) -> ChildSpec:  # fmt: skip
        """The spec of a model's workers, logging at this process's level."""
        return cls(
            model_name=model,
            model_version=version,
            model_dir=str(model_dir),
            manifest=manifest,
            model_config=config,
            batch_size=batch_size,
            intra_op_threads=intra_op_threads,
            log_level=logging.getLogger().getEffectiveLevel(),
            parent_pid=os.getpid(),
        )

    def on_device(self, device: str) -> ChildSpec:
        return replace(self, device=device)

    def context(self) -> Context:
        return Context(
            model_name=self.model_name,
            model_version=self.model_version,
            model_dir=Path(self.model_dir),
            manifest=self.manifest,
            model_config=self.model_config,
            device=self.device,
            batch_size=self.batch_size,
            intra_op_threads=self.intra_op_threads,
            model_file=Path(self.model_file) if self.model_file else None,
        )


def _watch_parent(parent_pid: int) -> None:
    """Exit when the server is gone (reparented), even while a handler call never returns."""
    while True:
        time.sleep(_PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os._exit(1)


class _Segments:
    """The segments this process has mapped, by name; the server creates and unlinks them."""

    def __init__(self) -> None:
        self._open: dict[str, shared_memory.SharedMemory] = {}

    def get(self, role: str, name: str) -> memoryview:
        segment = self._open.get(role)
        if segment is None or segment.name != name:
            if segment is not None:
                shmframes.release_segment(segment, unlink=False)
            segment = shared_memory.SharedMemory(name=name)
            self._open[role] = segment
        return shmframes.segment_view(segment)


def _run_batch(handler: BaseHandler, context: Context, requests: list[Any]) -> list[Any]:
    try:
        return handler.handle(requests, context)
    except HandlerError as exc:
        return [InferenceResponse.failed(exc.message, exc.status)] * len(requests)
    except BackendError as exc:
        return [InferenceResponse.failed(str(exc), 500)] * len(requests)
    except Exception as exc:
        # A handler bug fails only this batch; the worker keeps serving.
        log.exception(
            "model=%s request_ids=%s handler raised",
            context.model_name, ",".join(r.request_id for r in requests),
        )  # fmt: skip
        message = f"the handler failed: {type(exc).__name__}: {exc}"
        return [InferenceResponse.failed(message, 500)] * len(requests)


def _describe_responses(frame: shmframes.Frame, results: list[Any]) -> list[dict[str, Any]]:
    described = []
    for result in results:
        response = result
        if not isinstance(result, InferenceResponse):
            response = InferenceResponse.failed(
                f"the handler returned a {type(result).__name__}, not an InferenceResponse", 500
            )
        described.append(shmframes.describe_response(frame, response))
    return described


def _serve(conn: Connection, handler: BaseHandler, context: Context) -> None:
    segments = _Segments()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] != "run":
            return
        _, requests_name, responses_name, responses_size, described = message
        buf = segments.get("requests", requests_name)
        requests = [shmframes.read_request(buf, d) for d in described]
        del buf
        results = _run_batch(handler, context, requests)
        frame = shmframes.Frame()
        try:
            metas = _describe_responses(frame, results)
        except Exception as exc:  # e.g. a body that cannot be pickled
            frame = shmframes.Frame()
            failed = InferenceResponse.failed(f"the handler's response cannot be sent: {exc}", 500)
            metas = _describe_responses(frame, [failed] * len(requests))
        if frame.size > responses_size:
            conn.send(("grow", frame.size))
            _, responses_name, responses_size = conn.recv()
        frame.write(segments.get("responses", responses_name))
        conn.send(("done", metas))


def child_main(conn: Connection, spec: ChildSpec) -> None:
    """Entry point of a worker process (multiprocessing spawn target)."""
    # Ctrl-C reaches the whole process group; the server decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if spec.parent_pid:
        threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    context = spec.context()
    try:
        handler = load_handler(context)
    except HandlerError as exc:
        conn.send(("error", exc.message))
        return
    except (BackendError, OSError, ValueError) as exc:
        conn.send(("error", str(exc)))
        return
    except Exception as exc:
        conn.send(("error", f"the handler failed to load: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", os.getpid()))
    with worker_scope(handler):
        _serve(conn, handler, context)
    # Skip the interpreter's teardown of torch and friends (seconds on a busy machine): the
    # handler has no cleanup hook, and the server waits for this exit when it shuts down.
    logging.shutdown()
    os._exit(0)
