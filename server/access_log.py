"""The access log: one line per HTTP request or gRPC call, and the request id that ties it to the
server's other lines.

Each line names what was asked (method and path, or `gRPC` and the RPC), the model and the
version that answered, the status, the bytes of the answer, the latency, the request id and the
client's address, in plain text or as one JSON object per line (`access_log_format`). It goes to
`access_log`: `off` (the default), `stderr`, `stdout` or a file (appended to). Headers, keys and
bodies are never written.

The request id is the client's `X-Request-Id` header (gRPC metadata `x-request-id`) when it
sends a usable one (1 to 128 visible ASCII characters), else the protocol's own (OIP `id`), else
one the server makes. Each inference request carries it to the workers, whose log lines name
it, and the answer returns it (`X-Request-Id`; gRPC trailing metadata). The transports open an
`AccessRecord` per request (`opened`); the data plane fills in what it decides (`note_model`,
`request_id_for`) through a context variable, so no route passes anything along.

    record = AccessRecord("POST", "/predictions/mlp", "127.0.0.1:50312", "rest")
    with opened(record): ...  # the route runs; the data plane notes the model and version
    access.write(record)      # 2026-11-25T04:12:09.120Z 127.0.0.1:50312 "POST /predictions/mlp" ...
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from scriptserve.handlers.base import new_request_id
from scriptserve.server.log_format import escape_controls

AccessFormat = Literal["plain", "json"]
HEADER = "x-request-id"
MAX_ID_LENGTH = 128

log = logging.getLogger("scriptserve.access")


def usable_request_id(value: str | None) -> str | None:
    """A client's request id when it is 1 to 128 visible ASCII characters, else None (the
    server then makes one: an id is never a channel for arbitrary bytes into the logs)."""
    if not value or len(value) > MAX_ID_LENGTH:
        return None
    if not all("!" <= c <= "~" for c in value):
        return None
    return value


@dataclass
class AccessRecord:
    """One request as the access log writes it; the transport and the data plane fill it in."""

    method: str
    path: str
    client: str
    protocol: str
    request_id: str | None = None
    model: str = "-"
    version: str = "-"
    status: int | str = 0
    """The HTTP status, or the gRPC code's name."""
    bytes_sent: int = 0
    started: float = field(default_factory=time.perf_counter)
    latency_ms: float = 0.0

    def finish(self, status: int | str) -> None:
        self.status = status
        self.latency_ms = (time.perf_counter() - self.started) * 1e3
        if self.request_id is None:
            self.request_id = new_request_id()


_current: ContextVar[AccessRecord | None] = ContextVar("scriptserve_access", default=None)


@contextlib.contextmanager
def opened(record: AccessRecord | None) -> Iterator[AccessRecord | None]:
    """Make `record` the one the data plane fills in while the request runs in this context
    (and the tasks it starts)."""
    if record is None:
        yield None
        return
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)


def enter(record: AccessRecord) -> None:
    """Make `record` the one the data plane fills in, for the rest of this context: a context
    made for the one request."""
    _current.set(record)


def note_model(name: str, version: str | None) -> None:
    """The data plane resolved the request's model (and version, once known)."""
    record = _current.get()
    if record is not None:
        record.model = name
        if version is not None:
            record.version = version


def request_id_for(own: str) -> str:
    """The id an inference request runs under: the client's header id when it sent one, else
    `own` (the protocol's id or a new one), which then names the request in the access log."""
    record = _current.get()
    if record is None:
        return own
    if record.request_id is None:
        record.request_id = own
    return record.request_id


def request_namer() -> Callable[[str], str]:
    """`request_id_for` as it stands in this context, to be applied later and from any thread:
    what names a request that is decoded off the event loop (its own id is known only then)."""
    record = _current.get()
    if record is None:
        return _own_id

    def name(own: str) -> str:
        if record.request_id is None:
            record.request_id = own
        return record.request_id

    return name


def _own_id(own: str) -> str:
    return own


def current_request_id() -> str | None:
    """The id of the request running in this context, once it has one."""
    record = _current.get()
    return None if record is None else record.request_id


def _plain(record: AccessRecord, when: str) -> str:
    return escape_controls(
        f'{when} {record.client} "{record.method} {record.path}" {record.protocol} '
        f"model={record.model} version={record.version} status={record.status} "
        f"bytes={record.bytes_sent} latency_ms={record.latency_ms:.2f} "
        f"request_id={record.request_id}"
    )


def _json(record: AccessRecord, when: str) -> str:
    fields = {
        "time": when, "client": record.client, "method": record.method, "path": record.path,
        "protocol": record.protocol, "model": record.model, "version": record.version,
        "status": record.status, "bytes": record.bytes_sent,
        "latency_ms": round(record.latency_ms, 3), "request_id": record.request_id,
    }  # fmt: skip
    return json.dumps(fields)


class AccessLog:
    """Where the lines go and how they read; `enabled` False writes nothing."""

    def __init__(self, destination: str = "off", fmt: AccessFormat = "plain") -> None:
        self.enabled = destination != "off"
        self._format = _json if fmt == "json" else _plain
        self._handler: logging.Handler | None = None
        if not self.enabled:
            return
        if destination in ("stderr", "stdout"):
            stream = sys.stderr if destination == "stderr" else sys.stdout
            self._handler = logging.StreamHandler(stream)
        else:
            self._handler = logging.FileHandler(Path(destination), encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(self._handler)
        log.setLevel(logging.INFO)
        log.propagate = False  # access lines are not server log lines

    def write(self, record: AccessRecord) -> None:
        now = time.time()
        when = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e3):03d}Z"
        log.info(self._format(record, when))

    def close(self) -> None:
        if self._handler is not None:
            log.removeHandler(self._handler)
            self._handler.close()
            self._handler = None
