"""TorchServe's workflow routes: `POST /wfpredict/{name}` on the inference API, and register,
list, describe and unregister under `/workflows` on the management API
(`models/workflows.py`, `inference/workflow_run.py`)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Query, Request
from starlette.responses import JSONResponse, Response

from scriptserve.server.codec import torchserve
from scriptserve.server.codec.header_values import TIMEOUT_HEADER, request_timeout
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.inference.workflow_run import run_workflow
from scriptserve.server.models.workflows import Workflows
from scriptserve.server.rest.forms import form_fields
from scriptserve.server.settings import ServerSettings


def add_workflow_prediction_route(
    app: FastAPI, dataplane: DataPlane, workflows: Workflows, settings: ServerSettings
) -> None:
    @app.post("/wfpredict/{workflow_name}", tags=["TorchServe"])
    async def workflow_prediction(workflow_name: str, request: Request) -> Response:
        """TorchServe's workflow inference: the body (or each form field) is the start node's
        input; the answer is the leaf's, or every leaf's by name."""
        workflow = workflows.get(workflow_name)
        body = await request.body()
        content_type = request.headers.get("content-type")
        timeout_s = request_timeout(request.headers.get(TIMEOUT_HEADER))
        if (content_type or "").startswith("multipart/form-data"):
            fields = await form_fields(body, request.headers, settings)
            given = torchserve.predictions_request(fields, content_type, request.headers)
        else:
            given = torchserve.body_request(body, content_type, request.headers)
        payload, answer_type = await run_workflow(dataplane, workflow, given, timeout_s)
        return Response(payload, media_type=answer_type)


def add_workflow_management_routes(app: FastAPI, workflows: Workflows) -> None:
    @app.post("/workflows", tags=["workflows"])
    async def register_workflow(
        url: str = Query(description="the workflow archive (.war) in the workflow store"),
        workflow_name: str | None = Query(None, description="name to serve it under"),
    ) -> dict[str, str]:
        workflow = await workflows.register(url, workflow_name)
        return {"status": f"Workflow {workflow.name} has been registered and scaled successfully."}

    @app.get("/workflows", tags=["workflows"])
    async def list_workflows(
        limit: int = Query(100, ge=1, le=1000), next_page_token: int = Query(0, ge=0)
    ) -> dict[str, Any]:
        return workflows.list(limit, next_page_token)

    @app.get("/workflows/{workflow_name}", tags=["workflows"])
    async def describe_workflow(workflow_name: str) -> list[dict[str, Any]]:
        return [workflows.get(workflow_name).describe()]

    @app.delete("/workflows/{workflow_name}", tags=["workflows"])
    async def unregister_workflow(workflow_name: str) -> JSONResponse:
        await workflows.unregister(workflow_name)
        return JSONResponse({"status": f'Workflow "{workflow_name}" unregistered'})
