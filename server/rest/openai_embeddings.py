"""`POST /v1/embeddings`: OpenAI's embeddings API, answered by `text_embedder` archives
(server/codec/openai_embeddings.py). The inference API's key, body limit and
`X-Request-Timeout` apply as on every other inference route; errors answer in OpenAI's form,
`{"error": {"message": ..., "type": ...}}` (server/rest/errors.py)."""

from __future__ import annotations

from functools import partial

from fastapi import FastAPI, Request
from starlette.responses import Response

from scriptserve.server.codec import openai_embeddings
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.rest.inference import DirectRoute, client_timeout

TAG = "OpenAI"


def add_openai_routes(app: FastAPI, dataplane: DataPlane) -> None:
    """Add OpenAI's embeddings route to the inference app."""

    async def embeddings(request: Request) -> Response:
        call = openai_embeddings.decode(await request.body())
        decode = partial(openai_embeddings.requests, call, request.headers)
        served = await dataplane.infer_many(
            call.model,
            None,
            decode,
            protocol="rest",
            timeout_s=client_timeout(request),
            item="input",
        )
        payload = openai_embeddings.encode(call, [s.response for s in served])
        return Response(payload, media_type="application/json")

    app.router.add_api_route(
        openai_embeddings.PATH,
        embeddings,
        methods=["POST"],
        tags=[TAG],
        route_class_override=DirectRoute,
    )
