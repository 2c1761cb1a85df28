"""Scenario A's baseline: parse the JSON body, answer a constant. No model, no batching.

    python -m uvicorn benchmarks.baselines.bare_fastapi:app --port 9000

The answer is ten floats, the size of the MLP's output, so both servers write similar responses.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

_ANSWER = json.dumps([0.0] * 10).encode()

app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@app.get("/")
async def root() -> PlainTextResponse:
    return PlainTextResponse("ok")


@app.post("/predictions/{model_name}")
async def predict(request: Request, model_name: str) -> Response:
    await request.json()
    return Response(_ANSWER, media_type="application/json")
