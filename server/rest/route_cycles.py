"""The two kinds of inference route, each a `ProtocolCycle` (`protocol_cycle.py`) with its own
hand-over to the data plane and its own answer: `InferCycle` for Open Inference Protocol's infer
(JSON or binary tensors, decoded and answered in bytes on the worker's thread) and
`PredictionCycle` for TorchServe's predictions (a body or a multipart form, answered in one piece
or in parts as HTTP chunks)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from scriptserve.handlers.base import InferenceResponse
from scriptserve.server.codec import oip_json, torchserve
from scriptserve.server.errors import ServingError
from scriptserve.server.inference.decoding import Served
from scriptserve.server.rest.errors import error_body
from scriptserve.server.rest.forms import form_fields
from scriptserve.server.rest.protocol_cycle import ProtocolCycle
from scriptserve.server.rest.streams import log_stream_end

if TYPE_CHECKING:
    from scriptserve.handlers.base import InferenceRequest
    from scriptserve.server.inference.dataplane import DataPlane
    from scriptserve.server.workers.streaming import PartStream

log = logging.getLogger("scriptserve.rest")

_JSON = b"application/json"
_BINARY = b"application/octet-stream"
_HEADER_LENGTH = oip_json.HEADER_LENGTH.lower().encode() + b": %d\r\n"


class InferCycle(ProtocolCycle):
    """`/v2/models/{model}[/versions/{version}]/infer`: the body is decoded by the worker that
    takes the request (`OipBody.decode`) and the answer's bytes are written there too
    (`OipBody.keep`); this cycle hands the request over and writes those bytes."""

    def _run(self) -> None:
        if self.response_complete:
            return  # the client went away meanwhile
        wire = oip_json.OipBody(bytes(self.body), self.header_length, self._headers())
        self.body = bytearray()
        dataplane: DataPlane = self.routes.dataplane
        try:
            answer = dataplane.submit(
                self.model_name,
                self.version,
                wire.decode,
                protocol="rest",
                timeout_s=self.timeout_s,
                encode=wire.keep,
            )
        except ServingError as exc:
            self._answer_error(exc)
            return
        except Exception:
            self._unexpected()
            return
        self._withdraw = answer.cancel
        answer.add_done_callback(functools.partial(self._inferred, wire))

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


class PredictionCycle(ProtocolCycle):
    """`/predictions/{model}[/{version}]`: the body (or each field of a multipart form) is the
    input, and any handler may answer in parts (TorchServe's
    `send_intermediate_predict_response`): the answer is a stream, written in one piece when it
    came in one."""

    def _run(self) -> None:
        if self.response_complete:
            return  # the client went away meanwhile
        body = bytes(self.body)
        self.body = bytearray()
        try:
            if (self.content_type or "").startswith("multipart/form-data"):
                self._spawn(self._predict_form(body))
            else:
                self._predict(torchserve.body_request(body, self.content_type, self._headers()))
        except ServingError as exc:
            self._answer_error(exc)
        except Exception:
            self._unexpected()

    def _predict(self, request: InferenceRequest) -> None:
        dataplane: DataPlane = self.routes.dataplane
        stream = dataplane.stream(
            self.model_name, self.version, request, protocol="rest", timeout_s=self.timeout_s
        )
        self._withdraw = stream.close
        stream.on_part = functools.partial(self._parts_came, stream)
        stream.future.add_done_callback(functools.partial(self._predicted, stream))

    async def _predict_form(self, body: bytes) -> None:
        """A multipart body: its fields by name are the inputs, as TorchServe reads them."""
        headers = self._headers()
        try:
            fields = await form_fields(body, headers, self.routes.settings)
            if not self.response_complete:  # the client may have gone while the form was read
                request = torchserve.predictions_request(fields, self.content_type or "", headers)
                self._predict(request)
        except ServingError as exc:
            self._answer_error(exc)
        except Exception:
            self._unexpected()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
            log_stream_end(stream, exc)
            self.transport.write(self._chunk(error_body("/predictions", exc)))
        if not self.disconnected:
            self.transport.write(b"0\r\n\r\n")
            self._complete()

    def _chunk(self, data: bytes) -> bytes:
        """`data` as one HTTP chunk (none when it is empty)."""
        if not data:
            return b""
        if self.observation is not None:
            self.observation.bytes_sent += len(data)
        return b"%x\r\n%s\r\n" % (len(data), data)
