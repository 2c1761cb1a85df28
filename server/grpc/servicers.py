"""gRPC servicers: thin adapters from wire messages to the data plane and back.

Every ServingError becomes the gRPC status its class names, with the same message REST gives.
A client deadline shortens the request's own; a cancelled call frees its queue slot.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import empty_pb2

from scriptserve.handlers.base import InferenceResponse
from scriptserve.server.dataplane import DEADLINE_SLACK_S, DataPlane, prediction_payload
from scriptserve.server.errors import DeadlineExceeded, ServingError, error_for_status
from scriptserve.server.grpc import converters
from scriptserve.server.grpc._generated import inference_pb2 as ts
from scriptserve.server.grpc._generated import inference_pb2_grpc as ts_grpc
from scriptserve.server.grpc._generated import management_pb2 as mgmt
from scriptserve.server.grpc._generated import management_pb2_grpc as mgmt_grpc
from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as oip
from scriptserve.server.grpc._generated import open_inference_grpc_pb2_grpc as oip_grpc

R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def status_code(error: ServingError) -> grpc.StatusCode:
    """The one table from the error hierarchy to gRPC: each error names its code."""
    return getattr(grpc.StatusCode, error.grpc_code, grpc.StatusCode.INTERNAL)


async def abort(context: grpc.aio.ServicerContext, error: ServingError) -> NoReturn:
    """End the call with the error's gRPC code and message.

    When the call's own deadline is (about to be) reached, gRPC core answers DEADLINE_EXCEEDED
    itself; a status sent now would race it and fail in core with a logged traceback, so the
    handler just stops.
    """
    remaining = context.time_remaining()
    if (
        isinstance(error, DeadlineExceeded)
        and remaining is not None
        and remaining <= DEADLINE_SLACK_S
    ):
        raise asyncio.CancelledError
    await context.abort(status_code(error), error.message)
    raise AssertionError("context.abort returned")  # it raises


def translated(method: Handler[R]) -> Handler[R]:
    """Abort the call with the error's gRPC code and message on any ServingError."""

    @functools.wraps(method)
    async def call(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except ServingError as exc:
            await abort(context, exc)

    return call


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return remaining if remaining is not None else None


def _version(value: str) -> str | None:
    return value or None


class InferenceServicer(oip_grpc.GRPCInferenceServiceServicer):
    """Open Inference Protocol v2: `inference.GRPCInferenceService`."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    @translated
    async def ServerLive(self, request: Any, context: Any) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=self.dataplane.live())

    @translated
    async def ServerReady(self, request: Any, context: Any) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self.dataplane.ready())

    @translated
    async def ModelReady(self, request: Any, context: Any) -> oip.ModelReadyResponse:
        ready = self.dataplane.model_ready(request.name, _version(request.version))
        return oip.ModelReadyResponse(ready=ready)

    @translated
    async def ServerMetadata(self, request: Any, context: Any) -> oip.ServerMetadataResponse:
        meta = self.dataplane.server_metadata()
        return oip.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=meta["extensions"]
        )

    @translated
    async def ModelMetadata(self, request: Any, context: Any) -> oip.ModelMetadataResponse:
        meta = self.dataplane.model_metadata(request.name, _version(request.version))
        # Triton's ModelMetadataResponse has no parameters field: int8 or not goes in metadata.
        context.set_trailing_metadata(converters.quantization_metadata(meta))
        return converters.metadata_response(meta)

    async def _infer(self, request: Any, context: Any) -> oip.ModelInferResponse:
        inference, requested = converters.infer_request(request)
        version = _version(request.model_version)
        response = await self.dataplane.infer(
            request.model_name, version, inference, "grpc", _deadline(context)
        )
        resolved = self.dataplane.resolve_version(request.model_name, version)
        return converters.infer_response(
            request.model_name, resolved, request.id, response.outputs, requested
        )

    @translated
    async def ModelInfer(self, request: Any, context: Any) -> oip.ModelInferResponse:
        return await self._infer(request, context)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        """Triton's bidirectional stream: every request is queued as soon as it arrives (so
        requests of one stream batch together), and each answer is written when it is ready,
        carrying its request's `id`. A failed request is answered with `error_message`; the
        stream goes on. Ending the call (client cancel, deadline) withdraws the requests still
        queued. No coroutine per request: answers are built in the futures' callbacks and one
        writer sends them in order of completion."""
        replies: asyncio.Queue[oip.ModelStreamInferResponse | None] = asyncio.Queue()
        pending: set[asyncio.Future[InferenceResponse]] = set()

        def failed(request: Any, error: ServingError) -> oip.ModelStreamInferResponse:
            reply = oip.ModelStreamInferResponse(error_message=error.message)
            reply.infer_response.model_name = request.model_name
            reply.infer_response.id = request.id
            return reply

        def answered(
            request: Any, requested: list[str], future: asyncio.Future[InferenceResponse]
        ) -> None:
            pending.discard(future)
            if future.cancelled():
                return
            reply = oip.ModelStreamInferResponse()
            try:
                response = future.result()
                if response.error is not None:
                    raise error_for_status(response.status, response.error)
                version = _version(request.model_version)
                resolved = self.dataplane.resolve_version(request.model_name, version)
                converters.infer_response(
                    request.model_name, resolved, request.id, response.outputs, requested,
                    into=reply.infer_response,
                )  # fmt: skip
            except ServingError as exc:
                reply = failed(request, exc)
            replies.put_nowait(reply)

        async def write_replies() -> None:
            while (reply := await replies.get()) is not None:
                await context.write(reply)

        writer = asyncio.create_task(write_replies())
        try:
            async for request in requests:
                try:
                    inference, requested = converters.infer_request(request)
                except ServingError as exc:
                    replies.put_nowait(failed(request, exc))
                    continue
                future = self.dataplane.start(
                    request.model_name, _version(request.model_version), inference, "grpc",
                    _deadline(context),
                )  # fmt: skip
                pending.add(future)
                future.add_done_callback(functools.partial(answered, request, requested))
            if pending:
                # Each future's `answered` runs before gather's own callback: every reply is
                # queued by the time gather returns.
                await asyncio.gather(*pending, return_exceptions=True)
            replies.put_nowait(None)
            await writer
        finally:
            for future in list(pending):
                future.cancel()
            writer.cancel()


class TorchServeInferenceServicer(ts_grpc.InferenceAPIsServiceServicer):
    """TorchServe's `org.pytorch.serve.grpc.inference.InferenceAPIsService`."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    @translated
    async def Ping(self, request: empty_pb2.Empty, context: Any) -> ts.TorchServeHealthResponse:
        healthy = self.dataplane.ready()
        return ts.TorchServeHealthResponse(
            health=json.dumps({"status": "Healthy" if healthy else "Unhealthy"})
        )

    async def _predict(self, request: Any, context: Any) -> ts.PredictionResponse:
        inference = converters.predictions_request(dict(request.input))
        response = await self.dataplane.infer(
            request.model_name, _version(request.model_version), inference, "grpc",
            _deadline(context),
        )  # fmt: skip
        payload, _ = prediction_payload(response)
        return ts.PredictionResponse(prediction=payload)

    @translated
    async def Predictions(self, request: Any, context: Any) -> ts.PredictionResponse:
        return await self._predict(request, context)

    async def StreamPredictions(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ts.PredictionResponse]:
        try:
            yield await self._predict(request, context)
        except ServingError as exc:
            await abort(context, exc)

    async def StreamPredictions2(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ts.PredictionResponse]:
        async for request in requests:
            try:
                response = await self._predict(request, context)
            except ServingError as exc:
                response = ts.PredictionResponse()
                response.status.code = status_code(exc).value[0]
                response.status.message = exc.message
            if request.HasField("sequence_id"):
                response.sequence_id = request.sequence_id
            yield response


def _msg(value: Any) -> mgmt.ManagementResponse:
    return mgmt.ManagementResponse(msg=json.dumps(value, indent=2))


class ManagementServicer(mgmt_grpc.ManagementAPIsServiceServicer):
    """TorchServe's `org.pytorch.serve.grpc.management.ManagementAPIsService`; each answer's
    `msg` is the JSON the REST management API gives."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    @translated
    async def DescribeModel(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        return _msg(self.dataplane.describe(request.model_name, _version(request.model_version)))

    @translated
    async def ListModels(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        return _msg(self.dataplane.list_models(request.limit or 100, request.next_page_token))

    @translated
    async def RegisterModel(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        # proto3 ints default to 0: 0 means "not given", as in TorchServe.
        overrides = {
            "batch_size": request.batch_size or None,
            "max_batch_delay_ms": request.max_batch_delay or None,
            "workers": request.initial_workers or None,
            "response_timeout_s": request.response_timeout or None,
            "quantize": converters.requested_quantize(context.invocation_metadata()),
            "worker_mode": converters.requested_worker_mode(context.invocation_metadata()),
        }
        _, message = await self.dataplane.register(
            request.url, request.model_name or None, overrides, request.synchronous
        )
        return _msg({"status": message})

    @translated
    async def ScaleWorker(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        workers = max(request.min_worker, request.max_worker)
        _, message = await self.dataplane.scale(
            request.model_name, _version(request.model_version), workers, request.synchronous
        )
        return _msg({"status": message})

    @translated
    async def SetDefault(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        return _msg(
            {"status": self.dataplane.set_default(request.model_name, request.model_version)}
        )

    @translated
    async def UnregisterModel(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        message = await self.dataplane.unregister(
            request.model_name, _version(request.model_version)
        )
        return _msg({"status": message})
