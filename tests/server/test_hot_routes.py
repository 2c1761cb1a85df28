"""The inference routes served below FastAPI (server/rest/hot_routes.py): which requests they
take, and that what they leave to FastAPI, or answer themselves, is answered as before."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from serving import ServerProcess

from scriptserve.server.rest.hot_routes import HotRoutes
from scriptserve.server.rest.inference import create_inference_app
from scriptserve.server.settings import ServerSettings

ROW = [0.5] * 8


@pytest.fixture(scope="module")
def hot() -> HotRoutes:
    inference = create_inference_app(None, ServerSettings())  # type: ignore[arg-type]
    return HotRoutes(inference.app, inference.app.routes, inference.predict, inference.infer)


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/predictions/mnist", ("predict", "mnist", None)),
        ("PUT", "/predictions/mnist", ("predict", "mnist", None)),
        ("POST", "/predictions/mnist/2.0", ("predict", "mnist", "2.0")),
        ("POST", "/v2/models/mnist/infer", ("infer", "mnist", None)),
        ("POST", "/v2/models/mnist/versions/3/infer", ("infer", "mnist", "3")),
        # Left to FastAPI: other methods, empty segments, trailing slashes, other routes.
        ("GET", "/predictions/mnist", None),
        ("PUT", "/v2/models/mnist/infer", None),
        ("POST", "/predictions/", None),
        ("POST", "/predictions/mnist/", None),
        ("POST", "/predictions//2.0", None),
        ("POST", "/predictions/mnist/2.0/extra", None),
        ("POST", "/v2/models//infer", None),
        ("POST", "/v2/models/mnist/3/infer", None),
        ("POST", "/v2/models/mnist/versions//infer", None),
        ("POST", "/v2/models/mnist/generate", None),
        ("POST", "/v2/models/infer", None),
    ],
)
def test_which_requests_the_hot_routes_take(
    hot: HotRoutes, method: str, path: str, expected: tuple[str, str, str | None] | None
) -> None:
    found = hot.match(method, path)
    if expected is None:
        assert found is None
        return
    assert found is not None
    endpoint, route, name, version = found
    kind, want_name, want_version = expected
    assert endpoint is (hot.predict if kind == "predict" else hot.infer)
    assert (name, version) == (want_name, want_version)
    template = getattr(route, "path", "")
    assert template.startswith("/predictions/" if kind == "predict" else "/v2/models/")
    assert ("{version}" in template) is (version is not None)


def test_what_fastapi_answers_is_unchanged(server: ServerProcess) -> None:
    get = httpx.get(f"{server.url}/predictions/tiny")
    assert get.status_code == 405
    assert "method GET is not allowed" in get.json()["message"]
    slash = httpx.post(f"{server.url}/predictions/", json=ROW)
    assert slash.status_code == 404
    assert slash.json()["type"] == "RouteNotFound"
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    for path in ("/predictions/{model_name}", "/v2/models/{model_name}/versions/{version}/infer"):
        assert "post" in paths[path], path


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/predictions/nope", {"json": ROW}, 404, "nope"),
        ("/v2/models/nope/infer", {"json": {"inputs": []}}, 404, "nope"),
        ("/v2/models/tiny/infer", {"content": b"{not json"}, 400, "not valid JSON"),
        ("/predictions/tiny", {"content": b"", "headers": {}}, 400, "no body"),
        (
            "/predictions/tiny",
            {"content": b"x", "headers": {"Content-Type": "multipart/form-data"}},
            400,
            "multipart",
        ),
    ],
)
def test_errors_on_the_hot_routes_are_answered_as_before(
    server: ServerProcess, path: str, body: dict[str, Any], status: int, message: str
) -> None:
    r = httpx.post(server.url + path, **body)
    assert r.status_code == status, r.text
    answer = r.json()
    text = answer["error"] if path.startswith("/v2") else answer["message"]
    assert message in text
    assert r.headers["content-type"] == "application/json"


def test_the_hot_routes_answer_with_the_model(server: ServerProcess) -> None:
    x = np.full((1, 8), 0.5, np.float32)
    ts = httpx.post(f"{server.url}/predictions/tiny/1.0", json=ROW)
    oip = httpx.post(
        f"{server.url}/v2/models/tiny/versions/1.0/infer",
        json={"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32",
                          "data": x.ravel().tolist()}]},
    )  # fmt: skip
    assert ts.status_code == 200 and oip.status_code == 200, (ts.text, oip.text)
    assert oip.json()["model_version"] == "1.0"
    np.testing.assert_allclose(oip.json()["outputs"][0]["data"], ts.json(), rtol=1e-6)
