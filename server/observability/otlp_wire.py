"""OTLP's trace export request written straight from span records, as protobuf's wire bytes.

The exporter process (`span_export.py`) turns each request's `SpanRecord` into spans. Through the
SDK, that is a `ReadableSpan` per span, then the SDK's encoder building the protobuf messages
field by field, about ten times what writing the same spans' bytes here takes (benchmarks/
README.md). The bytes are those the SDK's encoder makes of
the same spans (`tests/server/test_otlp_wire.py` holds them against it): the messages of
`opentelemetry/proto/trace/v1/trace.proto`, fields in their numbers' order.

    encoder = SpanEncoder(resource_attributes, "scriptserve", "0.1.0")
    spans = encoder.spans(record)  # one ScopeSpans.spans entry per span
    payload = encoder.request(spans)  # an ExportTraceServiceRequest's bytes

Each span is kept encoded on its own, so a batch of any size is joined from them.
"""

from __future__ import annotations

import logging
import random
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scriptserve.server.observability.span_export import SpanRecord

log = logging.getLogger("scriptserve.tracing")

_BYTE = [bytes((i,)) for i in range(0x80)]
_FIXED64 = struct.Struct("<Q").pack
_FIXED32 = struct.Struct("<I").pack
_DOUBLE = struct.Struct("<d").pack

HAS_IS_REMOTE = 0x100
"""SpanFlags: the span says whether its parent is remote (the SDK's encoder always does)."""
IS_REMOTE = 0x200
"""SpanFlags: its parent is in another process (a client's `traceparent`)."""
_SERVER, _INTERNAL = b"\x30\x02", b"\x30\x01"  # Span.kind
_NO_STATUS = b"\x7a\x00"  # Span.status, empty: UNSET, as the SDK's encoder writes it
_LOCAL_PARENT = b"\x85\x01" + _FIXED32(HAS_IS_REMOTE)  # Span.flags (field 16, fixed32)
_REMOTE_PARENT = b"\x85\x01" + _FIXED32(HAS_IS_REMOTE | IS_REMOTE)
_LINK_FLAGS = b"\x35" + _FIXED32(HAS_IS_REMOTE)  # Link.flags (field 6, fixed32)
_MAX_CACHED = 4096
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _BYTE[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field (a message, bytes or a string) after its tag."""
    size = len(data)
    return tag + (_BYTE[size] if size < 0x80 else _varint(size)) + data


def _text(tag: bytes, text: str) -> bytes:
    # A lone surrogate (no UTF-8 for it) becomes "?": a collector refuses a whole request with
    # a string that is not UTF-8.
    return _field(tag, text.encode("utf-8", "replace"))


def any_value(value: Any) -> bytes:
    """An AnyValue's fields, as the SDK's encoder makes them of an attribute's value."""
    if isinstance(value, str):
        return _text(b"\x0a", value)
    if isinstance(value, bool):  # before int: a bool is an int
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise TypeError(f"an attribute's int must fit in 64 bits, not {value}")
        return b"\x18" + _varint(value if value >= 0 else value + (1 << 64))
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if value is None:
        return b""
    if isinstance(value, Mapping):
        pairs = b"".join(_field(b"\x0a", _key_value(str(k), v)) for k, v in value.items())
        return _field(b"\x32", pairs)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", any_value(v)) for v in value))
    raise TypeError(f"an attribute's value cannot be a {type(value).__name__}")


def _key_value(key: str, value: Any) -> bytes:
    return _text(b"\x0a", key) + _field(b"\x12", any_value(value))


class SpanEncoder:
    """Span records to OTLP's wire bytes, for one resource and instrumentation scope."""

    def __init__(
        self,
        resource: Mapping[str, Any],
        scope_name: str,
        scope_version: str,
        trace_state: Callable[[str], str] = lambda header: header,
    ) -> None:
        """`trace_state` makes a span's trace_state of the W3C header the server kept (the
        exporter gives it the SDK's parsing, which drops what is not well-formed)."""
        self._trace_state = trace_state
        self._states: dict[str, bytes] = {}
        self._pairs: dict[tuple[bytes, str, Any, type], bytes] = {}
        """Encoded attributes: most repeat from request to request (routes, models)."""
        self._resource = _field(b"\x0a", self._attributes(b"\x0a", resource))
        self._scope = _field(b"\x0a", _text(b"\x0a", scope_name) + _text(b"\x12", scope_version))

    def spans(self, record: SpanRecord) -> list[bytes]:
        """The spans of one request, each a ScopeSpans.spans field; the children get their
        span ids here."""
        trace_id, span_id, _, state, parent_id, name, start, end, attributes = record[:9]
        error, children = record[9:]
        trace = b"\x0a\x10" + trace_id.to_bytes(16, "big")
        own = span_id.to_bytes(8, "big")
        state_field = self._state(state) if state else b""
        status = _NO_STATUS
        if error is not None:
            status = _field(b"\x7a", _text(b"\x12", error) + b"\x18\x02")  # ERROR
        server = (
            trace,
            b"\x12\x08",
            own,
            state_field,
            b"\x22\x08" + parent_id.to_bytes(8, "big") if parent_id else b"",
            _text(b"\x2a", name),
            _SERVER,
            b"\x39",
            _FIXED64(start),
            b"\x41",
            _FIXED64(end),
            self._attributes(b"\x4a", attributes),
            status,
            _REMOTE_PARENT if parent_id else _LOCAL_PARENT,
        )
        spans = [_field(b"\x12", b"".join(server))]
        under_server = b"\x22\x08" + own
        parents: list[bytes] = []
        for parent, child_name, child_start, child_end, child_attributes, links in children:
            child = (random.getrandbits(64) or 1).to_bytes(8, "big")
            parents.append(b"\x22\x08" + child)
            fields = (
                trace,
                b"\x12\x08",
                child,
                state_field,
                under_server if parent < 0 else parents[parent],
                _text(b"\x2a", child_name),
                _INTERNAL,
                b"\x39",
                _FIXED64(child_start),
                b"\x41",
                _FIXED64(child_end),
                self._attributes(b"\x4a", child_attributes),
                b"".join(self._link(link) for link in links),
                _NO_STATUS,
                _LOCAL_PARENT,
            )
            spans.append(_field(b"\x12", b"".join(fields)))
        return spans

    def request(self, spans: Sequence[bytes]) -> bytes:
        """An ExportTraceServiceRequest of `spans` (from `spans`): one resource, one scope."""
        scope_spans = _field(b"\x12", self._scope + b"".join(spans))
        return _field(b"\x0a", self._resource + scope_spans)

    def _link(self, link: tuple[int, int, int, Mapping[str, Any]]) -> bytes:
        trace_id, span_id, _, attributes = link
        fields = (
            b"\x0a\x10",
            trace_id.to_bytes(16, "big"),
            b"\x12\x08",
            span_id.to_bytes(8, "big"),
            self._attributes(b"\x22", attributes),
            _LINK_FLAGS,
        )
        return _field(b"\x6a", b"".join(fields))

    def _state(self, header: str) -> bytes:
        found = self._states.get(header)
        if found is None:
            if len(self._states) >= _MAX_CACHED:
                self._states.clear()
            state = self._trace_state(header)
            found = self._states[header] = _text(b"\x1a", state) if state else b""
        return found

    def _attributes(self, tag: bytes, attributes: Mapping[str, Any] | None) -> bytes:
        """Each attribute as a KeyValue field after `tag`; one whose value OTLP cannot carry is
        left out and logged, as the SDK's encoder does."""
        if not attributes:
            return b""
        pairs = self._pairs
        encoded = []
        for key, value in attributes.items():
            cached = (tag, key, value, type(value))  # typed: 1, 1.0 and True are equal keys
            try:
                found, hashable = pairs.get(cached), True
            except TypeError:  # a list: encoded each time
                found, hashable = None, False
            if found is None:
                try:
                    found = _field(tag, _key_value(key, value))
                except TypeError as exc:
                    log.error("the span attribute %s is left out: %s", key, exc)
                    continue
                if hashable:
                    if len(pairs) >= _MAX_CACHED:
                        pairs.clear()
                    pairs[cached] = found
            encoded.append(found)
        return b"".join(encoded)
