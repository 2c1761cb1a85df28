"""An RPC's method handler with its behaviour wrapped, for the interceptors that see every call
from start to end (the access log, tracing)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]
"""A servicer method: (request or request iterator, context) -> reply, or an async iterator of
replies."""


def wrapped(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[Behavior], Behavior],
    streaming: Callable[[Behavior], Behavior],
) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour passed through `streaming` when the call answers in a
    stream, else through `unary`; the same kind of handler and (de)serializers."""
    if handler.response_streaming:
        behavior = streaming(handler.stream_stream or handler.unary_stream)
    else:
        behavior = unary(handler.stream_unary or handler.unary_unary)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
