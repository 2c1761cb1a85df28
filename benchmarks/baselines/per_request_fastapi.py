"""Scenario B's baseline: the scripted model run once per request, as one would write it by hand.

    BASELINE_MODEL=cnn.pt BASELINE_THREADS=1 BASELINE_MODE=async \
        python -m uvicorn --factory benchmarks.baselines.per_request_fastapi:create_app --port 9000

`BASELINE_MODE=async`: an `async def` route runs the model inline on the event loop.
`BASELINE_MODE=threadpool`: a plain `def` route, which FastAPI runs in its thread pool (40
threads), so several requests run the model at once. `BASELINE_THREADS` is torch's intra-op
thread count, set explicitly. The variables are read when uvicorn calls `create_app`.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch
from fastapi import Body, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

_INSTANCE = Body()


def _answer(module: torch.jit.ScriptModule, instance: Any) -> Response:
    x = torch.tensor(instance, dtype=torch.float32).unsqueeze(0)
    with torch.inference_mode():
        y = module(x)
    return Response(json.dumps(y[0].tolist()), media_type="application/json")


def create_app() -> FastAPI:
    path = os.environ["BASELINE_MODEL"]
    mode = os.environ.get("BASELINE_MODE", "async")
    torch.set_num_threads(int(os.environ.get("BASELINE_THREADS", "1")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(path).eval()  # type: ignore[no-untyped-call]

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/")
    async def root() -> PlainTextResponse:
        return PlainTextResponse("ok")

    if mode == "async":

        @app.post("/predictions/{model_name}")
        async def predict(request: Request, model_name: str) -> Response:
            return _answer(module, await request.json())

    elif mode == "threadpool":

        @app.post("/predictions/{model_name}")
        def predict_sync(model_name: str, instance: list[Any] = _INSTANCE) -> Response:
            return _answer(module, instance)

    else:
        raise ValueError(f"BASELINE_MODE must be async or threadpool, not {mode!r}")
    return app
