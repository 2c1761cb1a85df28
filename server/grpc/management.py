"""TorchServe's gRPC management service (`org.pytorch.serve.grpc.management`): each method hands
its fields to `server/models/management.py`, and each answer's `msg` is the JSON the REST management
API gives."""

from __future__ import annotations

import json
from typing import Any

from scriptserve.server.grpc import converters
from scriptserve.server.grpc._generated import management_pb2 as mgmt
from scriptserve.server.grpc._generated import management_pb2_grpc as mgmt_grpc
from scriptserve.server.grpc.inference import translated
from scriptserve.server.models.management import Management, Registration, Scaling
from scriptserve.server.models.profiling import ProfileOptions


def _msg(value: Any) -> mgmt.ManagementResponse:
    return mgmt.ManagementResponse(msg=json.dumps(value, indent=2))


class ManagementServicer(mgmt_grpc.ManagementAPIsServiceServicer):
    def __init__(self, management: Management) -> None:
        self.management = management

    @translated
    async def DescribeModel(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        version = converters.version_of(request.model_version)
        return _msg(self.management.describe(request.model_name, version))

    @translated
    async def ListModels(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        return _msg(self.management.list_models(request.limit or 100, request.next_page_token))

    @translated
    async def RegisterModel(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        fields = converters.given_fields(request)
        fields.update(converters.registration_metadata(context.invocation_metadata()))
        _, message = await self.management.register(Registration.parse(fields))
        return _msg({"status": message})

    @translated
    async def ScaleWorker(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        scaling = Scaling.parse(converters.given_fields(request))
        version = converters.version_of(request.model_version)
        _, message = await self.management.scale(request.model_name, version, scaling)
        return _msg({"status": message})

    @translated
    async def SetDefault(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        message = self.management.set_default(request.model_name, request.model_version)
        return _msg({"status": message})

    @translated
    async def UnregisterModel(self, request: Any, context: Any) -> mgmt.ManagementResponse:
        version = converters.version_of(request.model_version)
        return _msg({"status": await self.management.unregister(request.model_name, version)})

    @translated
    async def ProfileModel(self, request: Any, context: Any) -> mgmt.ProfileModelResponse:
        options = ProfileOptions.parse(converters.given_fields(request))
        version = converters.version_of(request.model_version)
        result = await self.management.profile(request.model_name, version, options)
        return mgmt.ProfileModelResponse(
            trace=result.trace,
            file_name=result.file_name,
            batches=result.batches,
            seconds=result.seconds,
        )
