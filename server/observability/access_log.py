"""The access log: one line per HTTP request or gRPC call, and the request id that ties it to the
server's other lines.

Each line names what was asked (method and path, or `gRPC` and the RPC), the model and the
version that answered, the status, the bytes of the answer, the latency, the request id and the
client's address, in plain text or as one JSON object per line (`access_log_format`). It goes to
`access_log`: `off` (the default), `stderr`, `stdout` or a file (appended to). Headers, keys and
bodies are never written. A finished request's record is queued; a thread of the log's formats
the queued records and writes their lines together, whole lines in one `write` each time, every
100 ms (nginx's `access_log ... flush=`): a line costs the event loop an append, not its
formatting or a system call; a process killed outright loses at most the last 100 ms of lines.

The request id is the client's `X-Request-Id` header (gRPC metadata `x-request-id`) when it
sends a usable one (1 to 128 visible ASCII characters), else the protocol's own (OIP `id`), else
one the server makes. Each inference request carries it to the workers, whose log lines name
it, and the answer returns it (`X-Request-Id`; gRPC trailing metadata). The transports open an
`AccessRecord` per request (`opened`); the data plane fills in what it decides (`note_model`,
and `name` from the worker), found through a context variable, so no route passes anything
along.

    record = AccessRecord("POST", "/predictions/mlp", "127.0.0.1:50312", "rest")
    with opened(record): ...  # the route runs; the data plane notes the model and version
    access.write(record)      # 2026-11-25T04:12:09.120Z 127.0.0.1:50312 "POST /predictions/mlp" ...
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from json.encoder import encode_basestring_ascii as _json_string
from typing import Literal, TextIO

from scriptserve.handlers.base import new_request_id
from scriptserve.server.observability.log_format import escape_controls

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


Peer = tuple[str, int]
"""A client's address and port, as the transports have it."""


class AccessRecord:
    """One request as the access log writes it; the transport and the data plane fill it in.
    It keeps the values as they come (the client's address as the transport has it, two
    readings of one clock): the log's writer makes the line of them, off the event loop.

    What a request starts with and most keep (no model yet, nothing sent) is the class's: a
    record stores only what is its own, the fewest stores for the event loop to make on each
    request."""

    model = "-"
    version = "-"
    status: int | str = 0
    """The HTTP status, or the gRPC code's name."""
    bytes_sent = 0
    finished = 0.0
    """time.perf_counter() when it finished: its latency, and the time its line shows."""
    pinned = False
    """Its model is set for good (a pipeline's): the steps' models do not replace it."""
    request_id: str | None = None

    def __init__(
        self,
        method: str,
        path: str,
        client: str | Peer | None,
        protocol: str,
        request_id: str | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.client = client
        """As text (`host:port`), or the transport's address and port, or None (unknown)."""
        self.protocol = protocol
        if request_id is not None:
            self.request_id = request_id
        self.started = time.perf_counter()

    def note_model(self, name: str, version: str | None, pin: bool = False) -> None:
        """The data plane resolved the request's model (and version, once known); `pin` sets it
        for good (a pipeline's or a workflow's request: its steps' models do not replace it)."""
        if not self.pinned:
            self.model = name
            if version is not None:
                self.version = version
            self.pinned = pin

    def name(self, own: str) -> str:
        """The request's id, given its protocol's own (OIP `id`, or one made for it) from any
        thread (a request is decoded and named by its worker): the client's header id when it
        sent one, else `own`, which then names the request in the access line."""
        if self.request_id is None:
            self.request_id = own
        return self.request_id

    def finish(self, status: int | str) -> None:
        self.status = status
        self.finished = time.perf_counter()
        if self.request_id is None:
            self.request_id = new_request_id()


CURRENT: ContextVar[AccessRecord | None] = ContextVar("scriptserve_access", default=None)
"""The record the data plane fills in for the request running in this context: set by
`opened`, or in the context an HTTP request runs in (server/rest/observe.py)."""


@contextlib.contextmanager
def opened(record: AccessRecord | None) -> Iterator[AccessRecord | None]:
    """Make `record` the one the data plane fills in while the request runs in this context
    (and the tasks it starts)."""
    if record is None:
        yield None
        return
    token = CURRENT.set(record)
    try:
        yield record
    finally:
        CURRENT.reset(token)


def current() -> AccessRecord | None:
    """The record of the request running in this context, if the access log is on."""
    return CURRENT.get()


def current_request_id() -> str | None:
    """The id of the request running in this context, once it has one."""
    record = CURRENT.get()
    return None if record is None else record.request_id


_KEPT = 4096
"""The texts each of the writer's caches keeps at most (it starts over when full)."""
_CLIENTS: dict[str | Peer | None, str] = {}
"""The text of each client seen lately (a connection's peer is on every one of its lines)."""


def _client(client: str | Peer | None) -> str:
    try:
        return _CLIENTS[client]
    except KeyError:
        if len(_CLIENTS) >= _KEPT:
            _CLIENTS.clear()
        text = _CLIENTS[client] = _client_text(client)
        return text
    except TypeError:  # a peer given as a list
        return _client_text(client)


def _client_text(client: str | Peer | None) -> str:
    if isinstance(client, str):
        return client
    return "-" if client is None else f"{client[0]}:{client[1]}"


TimeOf = Callable[[int], str]
"""A millisecond since the epoch as the lines show it."""
_PREFIXES: dict[tuple[str | Peer | None, str, str, str, str, str], str] = {}
"""The start of the plain lines of each client, request, model and version seen lately, up to
`status=`, its control characters escaped: most lines repeat one, so a line is its time, the
cached start and its own few numbers and id, none of them scanned for what to escape."""


def _plain_lines(records: Iterable[AccessRecord], offset: float, time_of: TimeOf) -> list[str]:
    """The plain lines of `records`, each one line (`escape_controls`): `offset` turns their
    clock's readings into the wall clock's, `time_of` a millisecond of that into its text."""
    prefixes = _PREFIXES
    lines = []
    shown, when = -1, ""
    for record in records:
        finished = record.finished
        millisecond = int((offset + finished) * 1000)
        if millisecond != shown:
            shown, when = millisecond, time_of(millisecond)
        key = (
            record.client,
            record.method,
            record.path,
            record.protocol,
            record.model,
            record.version,
        )
        try:
            prefix = prefixes.get(key)
        except TypeError:  # a peer given as a list
            prefix = _plain_prefix(key)
        if prefix is None:
            if len(prefixes) >= _KEPT:
                prefixes.clear()
            prefix = prefixes[key] = _plain_prefix(key)
        request_id = record.request_id or "-"
        if not request_id.isprintable():  # the protocol's own id (OIP `id`) is the client's
            request_id = escape_controls(request_id)
        latency_ms = (finished - record.started) * 1e3
        lines.append(
            "%s %s%s bytes=%d latency_ms=%.2f request_id=%s"  # noqa: UP031 (% is the quicker)
            % (when, prefix, record.status, record.bytes_sent, latency_ms, request_id)
        )
    return lines


def _plain_prefix(key: tuple[str | Peer | None, str, str, str, str, str]) -> str:
    client, method, path, protocol, model, version = key
    return escape_controls(
        f'{_client(client)} "{method} {path}" {protocol} model={model} version={version} status='
    )


_ESCAPED: dict[str, str] = {}
"""JSON strings of the texts that repeat from line to line (clients, paths, models), kept up to
`_KEPT`: most lines escape nothing new."""


def _string(text: str) -> str:
    found = _ESCAPED.get(text)
    if found is None:
        if len(_ESCAPED) >= _KEPT:
            _ESCAPED.clear()
        found = _ESCAPED[text] = _json_string(text)
    return found


def _json_lines(records: Iterable[AccessRecord], offset: float, time_of: TimeOf) -> list[str]:
    """The JSON lines of `records` (JSON strings escape their own control characters)."""
    return [_json(record, time_of(int((offset + record.finished) * 1000))) for record in records]


def _json(record: AccessRecord, when: str) -> str:
    status = record.status
    request_id = "null" if record.request_id is None else _json_string(record.request_id)
    return (
        f'{{"time": "{when}", "client": {_string(_client(record.client))}, '
        f'"method": {_string(record.method)}, "path": {_string(record.path)}, '
        f'"protocol": {_string(record.protocol)}, "model": {_string(record.model)}, '
        f'"version": {_string(record.version)}, '
        f'"status": {status if isinstance(status, int) else _string(status)}, '
        f'"bytes": {record.bytes_sent}, '
        f'"latency_ms": {(record.finished - record.started) * 1e3:.3f}, '
        f'"request_id": {request_id}}}'
    )


FLUSH_INTERVAL_S = 0.1
"""How long a line waits at most before it is written; the records queued meanwhile are what
the log holds (at 10,000 requests a second, a thousand records of a few hundred bytes)."""


class AccessLog:
    """Where the lines go and how they read; `enabled` False writes nothing.

    `write` is the queue's own append: it queues the finished record (no lock: a deque's
    appends and pops are atomic), and the event loop pays for a request's line one call into C,
    not a function of ours. A thread of its own formats the queued records and writes their
    lines together, every `FLUSH_INTERVAL_S` and at `close`: the lines are formatted in a run,
    not one at a time between requests."""

    def __init__(self, destination: str = "off", fmt: AccessFormat = "plain") -> None:
        self.enabled = destination != "off"
        self._lines = _json_lines if fmt == "json" else _plain_lines
        self._pending: deque[AccessRecord] = deque()
        self.write: Callable[[AccessRecord], None] = self._pending.append
        """Queue the line of a record, finished (`AccessRecord.finish`): from here on it is the
        log's, and nobody changes it."""
        self._write_lock = threading.Lock()
        """Keeps flushes, and so the lines, in order."""
        self._fd: int | None = None
        self._stream: TextIO | None = None
        self._owns_fd = False
        self._second = -1
        self._second_text = ""
        self._stop = False
        self._due = threading.Event()
        """Set to have the writer flush now: the log closes."""
        self._flusher: threading.Thread | None = None
        if not self.enabled:
            return
        if destination in ("stderr", "stdout"):
            stream = sys.stderr if destination == "stderr" else sys.stdout
            try:
                self._fd = stream.fileno()
            except (AttributeError, io.UnsupportedOperation):
                self._stream = stream  # not a file (a test's capture): written as text
        else:
            self._fd = os.open(destination, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._owns_fd = True
        self._flusher = threading.Thread(
            target=self._flush_when_due, name="scriptserve-access-log", daemon=True
        )
        self._flusher.start()

    def _time(self, millisecond: int) -> str:
        """`millisecond` (since the epoch) in UTC, ISO 8601 to the millisecond."""
        second = millisecond // 1000
        if second != self._second:
            self._second = second
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._second_text}.{millisecond % 1000:03d}Z"

    def flush(self) -> None:
        """Write the lines queued so far, whole, in the order they were queued."""
        with self._write_lock:
            pending = self._pending
            popleft = pending.popleft
            records = [popleft() for _ in range(len(pending))]
            if not records:
                return
            # The records' clock read as the wall clock, as it reads now: a line waits at most
            # a flush's interval, so the wall clock's own adjustments show within that.
            offset = time.time() - time.perf_counter()
            lines = self._lines(records, offset, self._time)
            lines.append("")
            data = "\n".join(lines).encode("utf-8", "backslashreplace")
            try:
                self._write(data)
            except OSError as exc:  # a full disk must not stop the server: say so, go on
                log.warning("access log lines lost: %s", exc)

    def _write(self, data: bytes) -> None:
        if self._stream is not None:
            self._stream.write(data.decode("utf-8"))
            self._stream.flush()
            return
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def _flush_when_due(self) -> None:
        while not self._stop:
            self._due.wait(FLUSH_INTERVAL_S)
            self._due.clear()
            self.flush()

    def close(self) -> None:
        if self._flusher is None:
            return
        self._stop = True
        self._due.set()
        self._flusher.join()
        self._flusher = None
        self.flush()
        if self._owns_fd and self._fd is not None:
            os.close(self._fd)
        self._fd = None
