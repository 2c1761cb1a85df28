"""gRPC inference servicers: thin adapters from wire messages to the data plane and back.

Every ServingError ends the call with the code `server/grpc/status.py` gives its class and the
same message REST gives. A client deadline shortens the request's own; a cancelled call frees
its queue slot.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import empty_pb2

from scriptserve.server.codec import torchserve
from scriptserve.server.errors import ServingError
from scriptserve.server.grpc import converters
from scriptserve.server.grpc._generated import inference_pb2 as ts
from scriptserve.server.grpc._generated import inference_pb2_grpc as ts_grpc
from scriptserve.server.grpc._generated import open_inference_grpc_pb2 as oip
from scriptserve.server.grpc._generated import open_inference_grpc_pb2_grpc as oip_grpc
from scriptserve.server.grpc.auth import authorization_of
from scriptserve.server.grpc.status import abort, status_code
from scriptserve.server.grpc.streams import StreamInferCall, prediction_parts
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.models.repository import ModelRepository
from scriptserve.server.security import AccessKeys

R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def translated(method: Handler[R]) -> Handler[R]:
    """Abort the call with the error's gRPC code and message on any ServingError."""

    @functools.wraps(method)
    async def call(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await method(self, request, context)
        except ServingError as exc:
            await abort(context, exc)

    return call


class InferenceServicer(oip_grpc.GRPCInferenceServiceServicer):
    """Open Inference Protocol v2: `inference.GRPCInferenceService`, with Triton's model
    configuration, statistics and model repository extensions."""

    def __init__(self, dataplane: DataPlane, repository: ModelRepository, keys: AccessKeys) -> None:
        self.dataplane = dataplane
        self.repository = repository
        self.keys = keys

    @translated
    async def ServerLive(self, request: Any, context: Any) -> oip.ServerLiveResponse:
        return oip.ServerLiveResponse(live=self.dataplane.live())

    @translated
    async def ServerReady(self, request: Any, context: Any) -> oip.ServerReadyResponse:
        return oip.ServerReadyResponse(ready=self.dataplane.ready())

    @translated
    async def ModelReady(self, request: Any, context: Any) -> oip.ModelReadyResponse:
        ready = self.dataplane.model_ready(request.name, converters.version_of(request.version))
        return oip.ModelReadyResponse(ready=ready)

    @translated
    async def ServerMetadata(self, request: Any, context: Any) -> oip.ServerMetadataResponse:
        return oip.ServerMetadataResponse(**self.dataplane.descriptions.server_metadata())

    @translated
    async def ModelMetadata(self, request: Any, context: Any) -> oip.ModelMetadataResponse:
        meta = self.dataplane.descriptions.model_metadata(
            request.name, converters.version_of(request.version)
        )
        # Triton's ModelMetadataResponse has no parameters field: int8 or not goes in metadata.
        context.set_trailing_metadata(converters.quantization_metadata(meta))
        return converters.fill_metadata(meta, oip.ModelMetadataResponse())

    @translated
    async def ModelInfer(self, request: Any, context: Any) -> oip.ModelInferResponse:
        response = oip.ModelInferResponse()  # written by the worker that answers (`encode`)
        await self.dataplane.submit(
            request.model_name,
            converters.version_of(request.model_version),
            functools.partial(converters.infer_request, request),
            protocol="grpc",
            timeout_s=context.time_remaining(),
            encode=functools.partial(converters.write_infer_response, response, request.id),
        )
        return response

    @translated
    async def ModelConfig(self, request: Any, context: Any) -> oip.ModelConfigResponse:
        config = self.dataplane.descriptions.model_config(
            request.name, converters.version_of(request.version)
        )
        return converters.from_json({"config": config}, oip.ModelConfigResponse())

    @translated
    async def ModelStatistics(self, request: Any, context: Any) -> oip.ModelStatisticsResponse:
        name = request.name or None  # no name: every model (a version alone means nothing)
        stats = self.dataplane.descriptions.statistics(
            name, converters.version_of(request.version) if name else None
        )
        return converters.from_json({"model_stats": stats}, oip.ModelStatisticsResponse())

    def _authorize_management(self, context: Any) -> None:
        """The repository methods take the management key (also checked by the port's key
        interceptor, where it has one)."""
        error = self.keys.check("management", authorization_of(context.invocation_metadata()))
        if error is not None:
            raise error

    @translated
    async def RepositoryIndex(self, request: Any, context: Any) -> oip.RepositoryIndexResponse:
        self._authorize_management(context)
        index = self.repository.index(request.ready)
        return converters.from_json({"models": index}, oip.RepositoryIndexResponse())

    @translated
    async def RepositoryModelLoad(
        self, request: Any, context: Any
    ) -> oip.RepositoryModelLoadResponse:
        self._authorize_management(context)
        parameters = converters.repository_parameters(request.parameters)
        await self.repository.load(request.model_name, parameters)
        return oip.RepositoryModelLoadResponse()

    @translated
    async def RepositoryModelUnload(
        self, request: Any, context: Any
    ) -> oip.RepositoryModelUnloadResponse:
        self._authorize_management(context)
        parameters = converters.repository_parameters(request.parameters)
        await self.repository.unload(request.model_name, parameters)
        return oip.RepositoryModelUnloadResponse()

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> None:
        """Triton's bidirectional stream: several replies per request for models that answer
        in parts (server/grpc/streams.py)."""
        await StreamInferCall(self.dataplane, context).serve(requests)


class TorchServeInferenceServicer(ts_grpc.InferenceAPIsServiceServicer):
    """TorchServe's `org.pytorch.serve.grpc.inference.InferenceAPIsService`."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    @translated
    async def Ping(self, request: empty_pb2.Empty, context: Any) -> ts.TorchServeHealthResponse:
        health = torchserve.health(self.dataplane.ready())
        return ts.TorchServeHealthResponse(health=json.dumps(health))

    async def _predict(self, request: Any, context: Any) -> ts.PredictionResponse:
        served = await self.dataplane.submit(
            request.model_name,
            converters.version_of(request.model_version),
            functools.partial(torchserve.predictions_request, request.input),
            protocol="grpc",
            timeout_s=context.time_remaining(),
        )
        payload, _ = torchserve.prediction_payload(served.response)
        return ts.PredictionResponse(prediction=payload)

    @translated
    async def Predictions(self, request: Any, context: Any) -> ts.PredictionResponse:
        return await self._predict(request, context)

    async def StreamPredictions(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ts.PredictionResponse]:
        """One message per part of the answer; an error ends the call with its status."""
        try:
            async for part in prediction_parts(self.dataplane, request, context):
                yield part
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
