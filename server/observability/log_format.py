"""Log lines nobody can forge: every control character a message carries is escaped.

Model names, request ids, URLs, paths and exception messages reach log lines; many come from
clients or operators. A newline in one of them would start a line that reads like a record of
its own (log injection), and an escape sequence could rewrite a terminal. `EscapingFormatter`
escapes them in the formatted line (`\\n`, `\\r`, `\\t`, `\\x1b`, `\\u2028`, ...), and in the
message of each exception of an appended traceback, while the traceback keeps its real line
breaks. It is installed once, on the root handler of the server and of each worker process
(`configure_logging`); uvicorn's and grpc's loggers propagate to it.

    configure_logging("info")
    logging.getLogger("x").error("model=%s", "a\\nFORGED")  # ... x: model=a\\nFORGED
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from types import TracebackType

__all__ = [
    "LOG_FORMAT",
    "EscapingFormatter",
    "JsonFormatter",
    "configure_logging",
    "current_format",
    "escape_controls",
]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None] | tuple[None, None, None]


def _escape_table() -> dict[int, str]:
    table = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}
    table.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
    # What str.splitlines() (and some log viewers) also take for line ends.
    table.update({0x2028: "\\u2028", 0x2029: "\\u2029"})
    return table


_ESCAPES = _escape_table()


def escape_controls(text: str) -> str:
    """`text` with C0 and C1 control characters, DEL and the Unicode line and paragraph
    separators written as escapes: the result is one line. Every character it escapes is one
    Python calls unprintable, so a printable text (almost every line) is returned as it is after
    one scan in C, not translated character by character (which was most of what an access
    line cost)."""
    return text if text.isprintable() else text.translate(_ESCAPES)


def _exception_texts(root: traceback.TracebackException) -> set[str]:
    """The lines naming each exception of a chain ("ValueError: its message", its notes): the
    parts of a traceback that carry an exception's text rather than the stack."""
    texts: set[str] = set()
    pending, seen = [root], set()
    while pending:
        te = pending.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        texts.update(te.format_exception_only())
        pending.extend(t for t in (te.__cause__, te.__context__) if t is not None)
        pending.extend(getattr(te, "exceptions", None) or ())  # groups: Python 3.11+
    return texts


def _escaped_traceback(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> str:
    te = traceback.TracebackException(exc_type, exc, tb, compact=True)
    texts = _exception_texts(te)
    text = "".join(_escape_line(chunk) if chunk in texts else chunk for chunk in te.format())
    return text.removesuffix("\n")


def _escape_line(line: str) -> str:
    """Escape what `line` holds but keep the line break that ends it."""
    if line.endswith("\n"):
        return escape_controls(line[:-1]) + "\n"
    return escape_controls(line)


class EscapingFormatter(logging.Formatter):
    """A Formatter whose lines are single lines, but for the tracebacks it appends (exc_info,
    stack_info), whose stack keeps its line breaks; see the module docstring."""

    def format(self, record: logging.LogRecord) -> str:
        # A traceback another formatter cached on the record may carry raw line breaks.
        cached = record.exc_text
        if record.exc_info:
            record.exc_text = None
        try:
            return super().format(record)
        finally:
            record.exc_text = cached

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))

    def formatException(self, ei: ExcInfo) -> str:
        exc_type, exc, tb = ei
        if exc_type is None or exc is None:
            return super().formatException(ei)
        return _escaped_traceback(exc_type, exc, tb)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: `time` (UTC, ISO 8601), `level`, `logger`, `message`, and
    `exception` (the formatted traceback) when there is one. JSON escapes every control
    character, so each record is one line."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return json.dumps(fields)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        moment = time.gmtime(record.created)
        return time.strftime("%Y-%m-%dT%H:%M:%S", moment) + f".{int(record.msecs):03d}Z"


def configure_logging(level: int | str, fmt: str = "plain") -> None:
    """Log to stderr at `level`, plain (an EscapingFormatter) or `json` (a JsonFormatter), as
    logging.basicConfig does: only when the root logger has no handler yet."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else EscapingFormatter(LOG_FORMAT))
    logging.basicConfig(
        level=level.upper() if isinstance(level, str) else level, handlers=[handler]
    )
    logging.captureWarnings(True)  # Python warnings become log lines in the same format


def current_format() -> str:
    """`json` when the root logger writes JSON (configure_logging), else `plain`: what worker
    processes are started with."""
    handlers = logging.getLogger().handlers
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in handlers) else "plain"
