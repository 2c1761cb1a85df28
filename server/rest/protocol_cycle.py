"""One request of the inference routes the HTTP protocol answers itself (`protocol_routes.py`):
its body collected from the parser's callbacks, the guard's checks, the hand-over to the data
plane, and its answer, written from the data plane's future callback (as HTTP chunks when it
comes in parts); observed by the access log and tracing while either is on."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

from scriptserve.handlers.base import InferenceResponse
from scriptserve.server.codec import oip_json, torchserve
from scriptserve.server.codec.header_values import TIMEOUT_HEADER, request_timeout
from scriptserve.server.errors import PayloadTooLarge, ServingError
from scriptserve.server.inference.decoding import Served
from scriptserve.server.rest.errors import body_too_large, error_body, method_not_allowed
from scriptserve.server.rest.forms import form_fields
from scriptserve.server.rest.observe import CLIENT_GONE, Observation, forwarded_scope

if TYPE_CHECKING:
    from scriptserve.handlers.base import InferenceRequest
    from scriptserve.server.rest.protocol_routes import (
        InferenceHttpProtocol,
        InferenceRoute,
        ProtocolRoutes,
    )
    from scriptserve.server.workers.streaming import PartStream

log = logging.getLogger("scriptserve.rest")

_TIMEOUT = TIMEOUT_HEADER.lower().encode()
_FRAMING = frozenset(("content-length", "transfer-encoding", "connection"))
"""Answer headers the protocol writes itself; a handler's own are dropped."""
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON = b"application/json"
_BINARY = b"application/octet-stream"
_HEADER_LENGTH = oip_json.HEADER_LENGTH.lower().encode() + b": %d\r\n"


class ProtocolCycle(RequestResponseCycle):
    """One request of the inference routes, from its head to its answer (see `protocol_routes`).

    uvicorn's protocol sees a RequestResponseCycle: it appends the body, sets `more_body` and
    `disconnected`, and calls `message_event.set()`, which is this object's `set`. The parent's
    constructor is not called: it makes an asyncio.Event and needs an ASGI scope, neither of
    which is used here.
    """

    def __init__(
        self,
        protocol: InferenceHttpProtocol,
        routes: ProtocolRoutes,
        method: str,
        path: str,
        route: InferenceRoute,
        model_name: str,
        version: str | None,
    ) -> None:
        self.transport = protocol.transport
        self.flow = protocol.flow
        self.default_headers = protocol.server_state.default_headers
        self.on_response = protocol.on_response_complete
        self._loop = protocol.loop
        self._tasks = protocol.tasks
        self.routes = routes
        self.method = method
        self.path = path
        self.route = route
        self.model_name = model_name
        self.version = version
        parser = protocol.parser
        self.keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        self.waiting_for_100_continue = protocol.expect_100_continue
        self.disconnected = False
        self.body = bytearray()
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.begun = False
        self.running = False
        self._withdraw: Callable[[], Any] | None = None
        self.raw_headers = protocol.headers
        self.content_type: str | None = None
        self.declared: int | None = None
        self.authorization: str | None = None
        self.timeout: str | None = None
        self.header_length: str | None = None
        for name, value in protocol.headers:
            if name == b"content-type":
                self.content_type = value.decode("latin-1")
            elif name == b"content-length":
                self.declared = int(value) if value.isdigit() else None
            elif name == b"authorization":
                self.authorization = value.decode("latin-1")
            elif name == _TIMEOUT:
                self.timeout = value.decode("latin-1")
            elif name == b"inference-header-content-length":
                self.header_length = value.decode("latin-1")
        self.observation: Observation | None = None
        self.left_out = b""
        """The `traceparent` line of a request only tracing sees and its sampling leaves out:
        all that is kept of it (no observation)."""
        observers = routes.observers
        if observers.enabled:
            self._protocol = protocol
            self.observation, self.left_out = observers.observe(
                method, path, protocol.headers, protocol.client, self._scope
            )

    def _scope(self) -> dict[str, Any]:
        """What the access log and tracing read of the request head, as an ASGI scope has it,
        with the client and scheme a loopback proxy forwards (made only when they read it)."""
        protocol = self._protocol
        scope = {
            "type": "http",
            "method": self.method,
            "path": self.path,
            "headers": protocol.headers,
            "client": protocol.client,
            "server": protocol.server,
            "scheme": protocol.scheme,
            "http_version": protocol.parser.get_http_version(),
        }
        return forwarded_scope(scope)

    @property
    def message_event(self) -> ProtocolCycle:  # type: ignore[override]
        """What uvicorn's protocol calls `set` on: this cycle (a property, not an attribute
        holding itself, so that a finished cycle is freed at once, not by the cycle collector)."""
        return self

    # -- what the protocol calls --------------------------------------------------------------
    def begin(self) -> None:
        """The request's turn on its connection (at once, or after the pipelined ones before
        it): refuse it now if its key, method or declared size says so, else wait for its
        body."""
        self.begun = True
        routes = self.routes
        if routes.auth:
            error = routes.keys.check("inference", self.authorization)
            if error is not None:
                self._answer_error(error)
                return
        if self.method not in self.route.methods:
            self._answer_error(method_not_allowed(self.method, ", ".join(self.route.methods)))
            return
        if self.declared is not None and self.declared > routes.max_bytes:
            self._answer_error(body_too_large(routes.max_bytes))
            return
        if self.waiting_for_100_continue and self.more_body:
            self.waiting_for_100_continue = False
            self.transport.write(_CONTINUE)
        if not self.more_body:
            self._ready()

    def body_part(self, data: bytes) -> None:
        """Bytes of the body, from the parser."""
        if self.response_complete:
            return  # answered already (refused): the rest of the body is dropped
        self.body += data
        if self.declared is None and len(self.body) > self.routes.max_bytes:
            self._answer_error(body_too_large(self.routes.max_bytes))

    def set(self) -> None:
        """uvicorn's `message_event.set()`: the body ended, or the client went away."""
        if self.disconnected:
            self._gone()
        elif self.begun and not (self.more_body or self.running or self.response_complete):
            self._ready()

    def clear(self) -> None:
        """uvicorn's `message_event.clear()`: nothing to do."""

    # -- the request --------------------------------------------------------------------------
    def _ready(self) -> None:
        """The whole request is in: hand it to the data plane at the end of this turn of the
        event loop, once every connection with bytes to read has been read. Queued in one
        burst, the turn's requests are batched together, where handing each over as it is
        parsed wakes a worker for the first one alone (measured on OIP's binary route: 1.11x
        the requests per second of handing them over at once). An observed request runs with
        its observation current, where the data plane notes what the access log and tracing
        record."""
        self.running = True
        observation = self.observation
        if observation is None or not observation.noted:
            self._loop.call_soon(self._run)
        else:
            self._loop.call_soon(observation.run, self._run)

    def _run(self) -> None:
        if self.response_complete:
            return  # the client went away meanwhile
        body = bytes(self.body)
        self.body = bytearray()
        try:
            timeout_s = request_timeout(self.timeout)
            if not self.route.predicts:
                self._infer(oip_json.OipBody(body, self.header_length, self._headers()), timeout_s)
            elif (self.content_type or "").startswith("multipart/form-data"):
                self._spawn(self._predict_form(body, timeout_s))
            else:
                request = torchserve.body_request(body, self.content_type, self._headers())
                self._predict(request, timeout_s)
        except ServingError as exc:
            self._answer_error(exc)
        except Exception:
            self._unexpected()

    def _headers(self) -> Headers:
        return Headers(raw=self.raw_headers)

    def _infer(self, wire: oip_json.OipBody, timeout_s: float | None) -> None:
        answer = self.routes.dataplane.submit(
            self.model_name,
            self.version,
            wire.decode,
            protocol="rest",
            timeout_s=timeout_s,
            encode=wire.keep,
        )
        self._withdraw = answer.cancel
        answer.add_done_callback(functools.partial(self._inferred, wire))

    def _predict(self, request: InferenceRequest, timeout_s: float | None) -> None:
        # Any handler may answer in parts (TorchServe's send_intermediate_predict_response):
        # the answer is a stream, written in one piece when it came in one.
        stream = self.routes.dataplane.stream(
            self.model_name, self.version, request, protocol="rest", timeout_s=timeout_s
        )
        self._withdraw = stream.close
        stream.on_part = functools.partial(self._parts_came, stream)
        stream.future.add_done_callback(functools.partial(self._predicted, stream))

    async def _predict_form(self, body: bytes, timeout_s: float | None) -> None:
        """A multipart body: its fields by name are the inputs, as TorchServe reads them."""
        headers = self._headers()
        try:
            fields = await form_fields(body, headers, self.routes.settings)
            if not self.response_complete:  # the client may have gone while the form was read
                request = torchserve.predictions_request(fields, self.content_type or "", headers)
                self._predict(request, timeout_s)
        except ServingError as exc:
            self._answer_error(exc)
        except Exception:
            self._unexpected()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _gone(self) -> None:
        """The client went away: withdraw its request (the data plane frees its slot)."""
        if self.running:
            if self._withdraw is not None:
                self._withdraw()
        elif self.begun and self.more_body and not self.response_complete:
            self.routes.disconnected(self.method, self.route.template)
        if not self.response_complete:
            self.response_complete = True
            if self.observation is not None:
                if not self.response_started:
                    self.observation.status = CLIENT_GONE
                self._observed_end()

    def _predicted(self, stream: PartStream[Served], _: object) -> None:
        """The request's future is done: answer in one piece, unless parts came first (then
        their writer answers)."""
        if stream.on_part is None or self.response_complete:
            return
        stream.on_part = None
        try:
            served = stream.result()
        except ServingError as exc:
            self._answer_error(exc)
            return
        except asyncio.CancelledError:
            return  # withdrawn: the client is gone
        except Exception:
            self._unexpected()
            return
        if served is None:  # an empty answer in one piece
            served = Served(stream.model_name, stream.model_version, InferenceResponse())
        try:
            payload, content_type = torchserve.prediction_payload(served.response)
        except Exception:
            self._unexpected()
            return
        response = served.response
        self._answer(response.status, payload, content_type.encode("latin-1"), response.headers)

    def _inferred(self, wire: oip_json.OipBody, answer: asyncio.Future[Served]) -> None:
        """The request's answer (its bytes written by the worker, `OipBody.keep`), or the error
        that ended it; nothing when it was withdrawn."""
        if self.response_complete or answer.cancelled():
            return
        try:
            answer.result()
            if wire.answer is None:
                raise RuntimeError("the answer came back without its bytes")
            payload, header_length = wire.answer
        except ServingError as exc:
            self._answer_error(exc)
            return
        except Exception:
            self._unexpected()
            return
        if header_length is None:
            self._answer(200, payload, _JSON)
        else:
            self._answer(200, payload, _BINARY, lines=_HEADER_LENGTH % header_length)

    # -- answers in parts (TorchServe's streaming handlers) ----------------------------------
    def _parts_came(self, stream: PartStream[Served]) -> None:
        if not self.response_complete:
            self._spawn(self._write_parts(stream))

    async def _write_parts(self, stream: PartStream[Served]) -> None:
        """The answer, part by part as HTTP chunks, by the rules of `streams.py`: the status
        line waits for the first part, a later error ends the stream with an error chunk."""
        try:
            await self._write_stream(stream)
        except Exception:
            if self.response_started:
                log.exception(
                    "model=%s version=%s: unexpected failure while streaming",
                    self.model_name,
                    self.version or "default",
                )
                self.transport.close()
            else:
                self._unexpected()
        finally:
            stream.close()

    async def _write_stream(self, stream: PartStream[Served]) -> None:
        try:
            first = await stream.next()
        except ServingError as exc:
            self._answer_error(exc)
            return
        if first is None or self.response_complete:
            return
        response = first.response
        payload, content_type = torchserve.prediction_payload(response)
        if stream.ended:
            self._answer(response.status, payload, content_type.encode(), response.headers)
            return
        head = self._head(response.status, content_type.encode(), response.headers)
        self.transport.write(head + b"transfer-encoding: chunked\r\n\r\n" + self._chunk(payload))
        try:
            while (served := await stream.next()) is not None:
                if self.flow.write_paused:
                    await self.flow.drain()
                if self.disconnected:
                    return
                self.transport.write(self._chunk(torchserve.prediction_payload(served.response)[0]))
        except ServingError as exc:
            log.info(
                "model=%s version=%s stream ended after %d parts: %s",
                stream.model_name,
                stream.model_version,
                stream.parts_sent,
                exc.message,
            )
            self.transport.write(self._chunk(error_body("/predictions", exc)))
        if not self.disconnected:
            self.transport.write(b"0\r\n\r\n")
            self._complete()

    # -- writing ------------------------------------------------------------------------------
    def _head(
        self,
        status: int,
        content_type: bytes,
        headers: dict[str, str] | None = None,
        lines: bytes = b"",
    ) -> bytes:
        """The answer's head up to its framing; `headers` are a handler's own (checked here),
        `lines` header lines the protocol writes itself."""
        self.response_started = True
        self.waiting_for_100_continue = False
        head = [STATUS_LINE[status]]
        for name, value in self.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(lines)
        if self.observation is not None:
            for name, value in self.observation.answered(status):
                head += [name, b": ", value, b"\r\n"]
        elif self.left_out:
            head.append(self.left_out)
        for key, text in (headers or {}).items():
            lower = key.lower()
            name, value = lower.encode("latin-1"), text.encode("latin-1")
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                raise ValueError(f"the answer header {key!r} is not a valid HTTP header")
            if lower == "content-type":
                content_type = value  # the handler's own, as Starlette's Response takes it
            elif lower not in _FRAMING:
                head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: ", content_type, b"\r\n"]
        if not self.keep_alive:
            head.append(b"connection: close\r\n")
        return b"".join(head)

    def _answer(
        self,
        status: int,
        payload: bytes,
        content_type: bytes,
        headers: dict[str, str] | None = None,
        lines: bytes = b"",
    ) -> None:
        if self.response_complete:
            return
        try:
            head = self._head(status, content_type, headers, lines)
        except ValueError:
            self.response_started = False
            self._unexpected()
            return
        size = len(payload)
        if self.method == "HEAD":  # a 405: the head says what the body would be
            payload = b""
        elif self.observation is not None:
            self.observation.sent(size)
        self.transport.write(b"%scontent-length: %d\r\n\r\n%s" % (head, size, payload))
        self._complete()

    def _chunk(self, data: bytes) -> bytes:
        """`data` as one HTTP chunk (none when it is empty)."""
        if not data:
            return b""
        if self.observation is not None:
            self.observation.sent(len(data))
        return b"%x\r\n%s\r\n" % (len(data), data)

    def _answer_error(self, error: ServingError) -> None:
        if isinstance(error, PayloadTooLarge):
            self.keep_alive = False  # the rest of the body is never read
        self._answer(error.status, error_body(self.path, error), _JSON, error.headers)

    def _unexpected(self) -> None:
        log.exception(
            "model=%s version=%s: unexpected failure", self.model_name, self.version or "default"
        )
        self._answer_error(ServingError("internal server error; see the server log"))

    def _complete(self) -> None:
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        if self.observation is not None:
            self._observed_end()
        on_response, self.on_response = self.on_response, _nothing
        on_response()

    def _observed_end(self) -> None:
        """The access line and the span's end, once: the answer is sent or the client gone."""
        observation, self.observation = self.observation, None
        if observation is not None:
            observation.close(self.route.template)


def _nothing() -> None:
    pass
