"""A request that is not a valid protobuf message is the client's error, answered
INVALID_ARGUMENT with a plain message, never UNKNOWN with a traceback.

grpc.aio decodes each request with the method handler's `request_deserializer` before the
servicer runs; when that raises, grpc logs a traceback and answers UNKNOWN with the parser's
class name in the details. `register` wraps every method's handler once, when a servicer is
added to a server: its deserializer turns a message that does not parse into a
`MalformedMessage`, and its behaviour makes sure that the servicer never sees one:

- one request (unary-unary, unary-stream): the call ends with INVALID_ARGUMENT before the
  servicer runs;
- a stream of requests: only that message fails. `ModelStreamInfer` answers it with a
  `ModelStreamInferResponse` carrying `error_message` (as it answers any failed request), and
  TorchServe's `StreamPredictions2` with a `PredictionResponse` whose status is
  INVALID_ARGUMENT; the stream goes on. Other streaming methods end with INVALID_ARGUMENT.

Replies written for the wrapper and the servicer's own go through one lock, since gRPC takes one
write at a time per call. The handlers are wrapped at registration, not by a server
interceptor: an interceptor runs a coroutine of its own in every call, and a server with any
interceptor leaves grpc.aio's lookup of registered methods (`python -m benchmarks.grpc_load`).

    register(server, oip_grpc.add_GRPCInferenceServiceServicer_to_server, servicer)
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from scriptserve.server.grpc._generated import inference_pb2 as ts
from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as oip

Deserializer = Callable[[bytes], Any]


class MalformedMessage:
    """What the wrapped deserializer returns for bytes that are not a valid message."""

    __slots__ = ("message",)

    def __init__(self, message_name: str) -> None:
        self.message = f"the request is not a valid {message_name} message"


def _stream_infer_reply(message: str) -> Any:
    return oip.ModelStreamInferResponse(error_message=message)


def _prediction_reply(message: str) -> Any:
    response = ts.PredictionResponse()
    response.status.code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    response.status.message = message
    return response


_OIP_SERVICE = oip.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
_TS_SERVICE = ts.DESCRIPTOR.services_by_name["InferenceAPIsService"].full_name
STREAM_REPLIES: dict[str, Callable[[str], Any]] = {
    f"/{_OIP_SERVICE}/ModelStreamInfer": _stream_infer_reply,
    f"/{_TS_SERVICE}/StreamPredictions2": _prediction_reply,
}
"""Streaming methods that answer a malformed message in the stream instead of ending it."""


def _checked(deserialize: Deserializer) -> Deserializer:
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    malformed = MalformedMessage(getattr(descriptor, "name", "request"))

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # DecodeError, or whatever else the parser raises: the bytes are bad
            return malformed

    return parse


class _SerialWrites:
    """The servicer's context, with `write` taking turns with the interceptor's replies."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._lock = asyncio.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        async with self._lock:
            await self._context.write(message)


async def _abort(context: Any, malformed: MalformedMessage) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed.message)
    raise AssertionError("context.abort returned")  # it raises


def _wrapped(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """`handler` with the checking deserializer and a behaviour that never hands the servicer a
    MalformedMessage."""
    deserializer = handler.request_deserializer
    if deserializer is None:
        return handler
    serializer = handler.response_serializer
    parse = _checked(deserializer)
    if not handler.request_streaming:
        if not handler.response_streaming:
            unary = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if type(request) is MalformedMessage:
                    await _abort(context, request)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=parse, response_serializer=serializer
            )
        streaming = handler.unary_stream
        if inspect.isasyncgenfunction(streaming):

            async def unary_stream_gen(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                if type(request) is MalformedMessage:
                    await _abort(context, request)
                async for response in streaming(request, context):
                    yield response

            behaviour: Any = unary_stream_gen
        else:

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> None:
                if type(request) is MalformedMessage:
                    await _abort(context, request)
                await streaming(request, context)

            behaviour = unary_stream
        return grpc.unary_stream_rpc_method_handler(
            behaviour, request_deserializer=parse, response_serializer=serializer
        )
    reply = STREAM_REPLIES.get(method) if handler.response_streaming else None

    async def valid(
        requests: AsyncIterator[Any], context: _SerialWrites | grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async for request in requests:
            if type(request) is not MalformedMessage:
                yield request
            elif reply is not None:
                await context.write(reply(request.message))
            else:
                await _abort(context, request)

    if not handler.response_streaming:
        collect = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: Any) -> Any:
            return await collect(valid(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, request_deserializer=parse, response_serializer=serializer
        )
    respond = handler.stream_stream
    generates = inspect.isasyncgenfunction(respond)

    async def stream_stream(requests: AsyncIterator[Any], context: Any) -> None:
        # A coroutine writing through the context, whichever style the servicer uses: replies
        # for malformed messages are written between the servicer's, in order.
        serial = _SerialWrites(context)
        if generates:
            async for response in respond(valid(requests, serial), serial):
                await serial.write(response)
        else:
            await respond(valid(requests, serial), serial)

    return grpc.stream_stream_rpc_method_handler(
        stream_stream, request_deserializer=parse, response_serializer=serializer
    )


class _Registrations:
    """Stands for a server while a generated `add_..._to_server` registers a servicer: keeps
    the methods' handlers, by service, to be wrapped before they reach the server."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict[str, grpc.RpcMethodHandler]]] = []
        self.generic = 0

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self.generic += len(handlers)  # the same methods, registered by name below

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services.append((service, handlers))


def register(server: grpc.aio.Server, add: Callable[[Any, Any], None], servicer: Any) -> None:
    """`add(servicer, server)`, a generated registration, with every method's requests checked
    (see the module)."""
    registrations = _Registrations()
    add(servicer, registrations)
    if registrations.generic != len(registrations.services):
        raise RuntimeError(f"{add.__name__} registers handlers that are not by method name")
    for service, handlers in registrations.services:
        checked = {
            name: _wrapped(handler, f"/{service}/{name}") for name, handler in handlers.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, checked),))
        server.add_registered_method_handlers(service, checked)
