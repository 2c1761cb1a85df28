"""Answers in parts over gRPC: Triton's bidirectional `ModelStreamInfer` and TorchServe's
`StreamPredictions`.

`ModelStreamInfer` queues every request as soon as it arrives (requests of one stream batch
together) and writes each of its replies when it is ready, in order per request, carrying the
request's `id`. A model that answers in parts (Triton's decoupled models) gives a request
several replies; each reply's `triton_final_response` parameter says whether it is the
request's last. A stream whose last part is empty ends without a reply, unless the request asked
for one with the `triton_enable_empty_final_response` parameter (tritonclient's
`enable_empty_final_response`): it then gets an empty reply marked final. A failed request gets
a reply with `error_message` (marked final); the call goes on.

A request's parts are taken from its `PartStream` only as fast as the client reads the call
(one reply waits to be written at a time per request), so a slow reader fills the stream's
bound and ends that request with RESOURCE_EXHAUSTED rather than growing the server's memory.
Ending the call (client cancel, deadline) ends every stream in it: their workers stop at their
next step.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

import grpc

from scriptserve.handlers.base import InferenceResponse
from scriptserve.server.codec import torchserve
from scriptserve.server.errors import ServingError
from scriptserve.server.grpc import converters
from scriptserve.server.grpc._generated import inference_pb2 as ts
from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as oip
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.inference.decoding import Served
from scriptserve.server.workers.streaming import PartStream

FINAL_RESPONSE = "triton_final_response"
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"


def _wants_empty_final(request: Any) -> bool:
    parameter = request.parameters.get(EMPTY_FINAL_RESPONSE)
    return parameter is not None and parameter.bool_param


def _reply(request: Any, served: Served, final: bool) -> oip.ModelStreamInferResponse:
    """A reply with a part of the answer (an empty part: the empty final reply)."""
    reply = oip.ModelStreamInferResponse()
    answer: Any = reply.infer_response
    converters.fill_infer_response(served, request.id, answer)
    answer.parameters[FINAL_RESPONSE].bool_param = final
    return reply


def _error_reply(request: Any, error: ServingError) -> oip.ModelStreamInferResponse:
    reply = oip.ModelStreamInferResponse(error_message=error.message)
    answer: Any = reply.infer_response
    answer.model_name, answer.id = request.model_name, request.id
    answer.parameters[FINAL_RESPONSE].bool_param = True
    return reply


Reply = oip.ModelStreamInferResponse


class StreamInferCall:
    """One `ModelStreamInfer` call (see the module docstring).

    A request to a model that answers once is answered from its future's callback, with no
    coroutine of its own (a stream may carry thousands); only a request whose parts come (a
    model that streams, or a TorchServe handler's intermediate responses) gets a task that reads
    them. One writer sends the replies in the order they are ready; a part waits until it is
    written before the next is taken from its stream.
    """

    def __init__(self, dataplane: DataPlane, context: grpc.aio.ServicerContext) -> None:
        self._dataplane = dataplane
        self._context = context
        self._replies: asyncio.Queue[tuple[Reply, asyncio.Future[None] | None] | None]
        self._replies = asyncio.Queue()
        self._streams: set[PartStream[Served]] = set()
        self._readers: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def serve(self, requests: AsyncIterator[Any]) -> None:
        """Read the client's requests until it half-closes, then finish every answer."""
        writer = asyncio.create_task(self._write_replies())
        try:
            async for request in requests:
                self._start(request)
            idle = asyncio.ensure_future(self._idle.wait())
            await asyncio.wait((idle, writer), return_when=asyncio.FIRST_COMPLETED)
            idle.cancel()
            if not writer.done():
                self._replies.put_nowait(None)
            await writer  # raises what ended the writing
        finally:
            for stream in list(self._streams):
                stream.close()
            for task in list(self._readers):
                task.cancel()
            writer.cancel()

    def _start(self, request: Any) -> None:
        try:
            stream = self._dataplane.stream(
                request.model_name,
                converters.version_of(request.model_version),
                functools.partial(converters.infer_request, request),
                protocol="grpc",
                timeout_s=self._context.time_remaining(),
            )
        except ServingError as exc:
            self._replies.put_nowait((_error_reply(request, exc), None))
            return
        self._streams.add(stream)
        self._idle.clear()
        if stream.streaming:
            self._read(request, stream)
            return
        stream.on_part = functools.partial(self._read, request, stream)
        stream.future.add_done_callback(functools.partial(self._answered, request, stream))

    def _answered(self, request: Any, stream: PartStream[Served], _: object) -> None:
        """A one-piece answer is ready (or the stream ended): reply unless a reader took it."""
        if stream.on_part is None:  # parts came: the reader answers
            return
        self._finished(stream)
        try:
            served = stream.result()
        except ServingError as exc:
            self._replies.put_nowait((_error_reply(request, exc), None))
            return
        except BaseException:
            return
        if served is None:
            served = Served(stream.model_name, stream.model_version, InferenceResponse())
        self._replies.put_nowait((_reply(request, served, True), None))

    def _read(self, request: Any, stream: PartStream[Served]) -> None:
        reader = asyncio.ensure_future(self._answer(request, stream))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    def _finished(self, stream: PartStream[Served]) -> None:
        self._streams.discard(stream)
        if not self._streams:
            self._idle.set()

    async def _answer(self, request: Any, stream: PartStream[Served]) -> None:
        """Write the request's parts as they come, then its empty final reply if it asked."""
        final = False
        try:
            while (served := await stream.next()) is not None:
                final = stream.ended
                await self._send(_reply(request, served, final))
            if not final and _wants_empty_final(request):
                empty = Served(stream.model_name, stream.model_version, InferenceResponse())
                await self._send(_reply(request, empty, True))
        except ServingError as exc:
            await self._send(_error_reply(request, exc))
        finally:
            stream.close()
            self._finished(stream)

    async def _send(self, reply: Reply) -> None:
        """Queue a reply and wait until it is written."""
        written = asyncio.get_running_loop().create_future()
        self._replies.put_nowait((reply, written))
        await written

    async def _write_replies(self) -> None:
        while (item := await self._replies.get()) is not None:
            reply, written = item
            await self._context.write(reply)
            if written is not None and not written.done():
                written.set_result(None)


async def prediction_parts(
    dataplane: DataPlane, request: Any, context: grpc.aio.ServicerContext
) -> AsyncIterator[ts.PredictionResponse]:
    """TorchServe's `StreamPredictions`: one PredictionResponse per part of the answer (one in
    all for a model that answers once). Raises the ServingError that ends the stream; the
    stream ends when the caller stops iterating (the call was cancelled)."""
    stream = dataplane.stream(
        request.model_name,
        converters.version_of(request.model_version),
        functools.partial(torchserve.predictions_request, request.input),
        protocol="grpc",
        timeout_s=context.time_remaining(),
    )
    try:
        while (served := await stream.next()) is not None:
            payload, _ = torchserve.prediction_payload(served.response)
            yield ts.PredictionResponse(prediction=payload)
    finally:
        stream.close()
