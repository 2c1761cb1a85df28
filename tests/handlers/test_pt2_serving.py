"""`.pt2` models behind the `tensor` handler: in-process (batches over the exported bound), and
served by a real server over REST with thread workers and process workers, beside a package
the server refuses."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from pt2models import (
    TINY_MAX_BATCH,
    tiny_archive,
    tiny_package,
    two_heads_archive,
    two_heads_reference,
)
from serving import ServerProcess
from testmodels import reference_output

from scriptserve.archiver.archive import ArchiveSpec, build_archive, list_files, open_archive
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.handlers.base import Context, InferenceRequest
from scriptserve.handlers.loader import load_handler

# Slow: its server serves the two-input model, a compile of its own.
pytestmark = pytest.mark.slow

MODELS = ("tiny_pt2", "tiny_pt2_process", "two_heads", "old_torch")


def rows(n: int, width: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


# -- in-process -----------------------------------------------------------------------------
def test_the_tensor_handler_splits_batches_at_the_exported_bound() -> None:
    with open_archive(tiny_archive()) as reader:
        m = reader.manifest
        context = Context(m.model.model_name, "1.0", reader.root, m)
        handler = load_handler(context)
        xs = [rows(30, seed=i) for i in range(3)] + [rows(TINY_MAX_BATCH + 1, seed=9)]

        responses = handler.handle([InferenceRequest(inputs={"x": x}) for x in xs], context)

    for x, response in zip(xs[:3], responses[:3], strict=True):
        assert response.error is None, response.error
        np.testing.assert_allclose(response.outputs["output0"], reference_output(x), atol=1e-4)
    assert (responses[3].status, responses[3].error) == (
        400,
        f"the request has {TINY_MAX_BATCH + 1} rows; the model takes at most {TINY_MAX_BATCH} "
        "at once",
    )


# -- a real server --------------------------------------------------------------------------
def with_old_torch(archive: Path, store: Path) -> None:
    """The archive again as `old_torch`, its manifest claiming another torch release."""
    with open_archive(archive) as reader:
        manifest = reader.manifest
        assert manifest.scriptserve is not None and manifest.scriptserve.pt2 is not None
        pt2 = dataclasses.replace(manifest.scriptserve.pt2, torch_version="2.0.0+cpu")
        manifest = manifest.with_scriptserve(dataclasses.replace(manifest.scriptserve, pt2=pt2))
        model = dataclasses.replace(manifest.model, model_name="old_torch")
        spec = ArchiveSpec(dataclasses.replace(manifest, model=model), list_files(reader.root))
        build_archive(spec, store)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("pt2_serving")
    store = root / "store"
    store.mkdir()
    shutil.copy(tiny_archive(), store / "tiny_pt2.mar")
    shutil.copy(two_heads_archive(), store / "two_heads.mar")
    (root / "config.yaml").write_text("workerMode: process\n")
    (root / "sample.json").write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", "tiny_pt2_process", "--version", "1.0",
        "--serialized-file", str(tiny_package()), "--sample-input", str(root / "sample.json"),
        "--config-file", str(root / "config.yaml"), "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    with_old_torch(tiny_archive(), store)
    # A process of its own: a forked server has torch imported already (serving.py), and these
    # tests check that serving .pt2 never imports it.
    proc = ServerProcess(store, "--workers", "2", fresh=True)
    proc.start(wait_ready=False, timeout_s=180)

    def settled(client: httpx.Client) -> bool:
        for name in MODELS:
            r = client.get(f"{proc.mgmt}/models/{name}", headers=proc.mgmt_headers)
            if r.status_code != 200 or r.json()[0]["state"] not in ("READY", "FAILED"):
                return False
        return True

    proc.wait(settled, 180)
    yield proc
    proc.stop()


def infer(server: ServerProcess, model: str, **tensors: np.ndarray) -> httpx.Response:
    inputs = [
        {"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}
        for name, x in tensors.items()
    ]
    return httpx.post(f"{server.url}/v2/models/{model}/infer", json={"inputs": inputs}, timeout=60)


def output(response: httpx.Response, name: str) -> np.ndarray:
    assert response.status_code == 200, response.text
    (tensor,) = [t for t in response.json()["outputs"] if t["name"] == name]
    return np.asarray(tensor["data"], np.float32).reshape(tensor["shape"])


def test_serving_pt2_models_on_cpu_never_imports_torch(server: ServerProcess) -> None:
    """`import torch` is most of a server's start; the C ABI needs only libtorch, which the
    server maps without it (libtorch_python comes only with `import torch`)."""
    r = infer(server, "tiny_pt2", x=rows(2))
    assert r.status_code == 200, r.text
    assert server.proc is not None
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()

    assert "libtorch_cpu.so" in maps
    assert "libtorch_python.so" not in maps


def test_metadata_and_model_config_name_the_platform(server: ServerProcess) -> None:
    metadata = httpx.get(f"{server.url}/v2/models/tiny_pt2", timeout=30)
    config = httpx.get(f"{server.url}/v2/models/tiny_pt2/config", timeout=30)

    assert metadata.status_code == 200, metadata.text
    assert metadata.json()["platform"] == "pytorch_aotinductor"
    assert config.status_code == 200, config.text
    assert (config.json()["platform"], config.json()["backend"]) == (
        "pytorch_aotinductor",
        "pytorch",
    )


@pytest.mark.parametrize("model", ["tiny_pt2", "tiny_pt2_process"])
def test_thread_and_process_workers_answer_like_eager(server: ServerProcess, model: str) -> None:
    x = rows(3, seed=11)

    r = infer(server, model, x=x) if model == "tiny_pt2" else infer(server, model, input0=x)

    np.testing.assert_allclose(output(r, "output0"), reference_output(x), atol=1e-4)
    described = httpx.get(f"{server.mgmt}/models/{model}", headers=server.mgmt_headers).json()[0]
    assert described["state"] == "READY"


def test_predictions_take_one_instance_as_json(server: ServerProcess) -> None:
    x = np.linspace(-1, 1, 8, dtype=np.float32)

    r = httpx.post(f"{server.url}/predictions/tiny_pt2", json=x.tolist(), timeout=60)

    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json(), reference_output(x[None])[0], atol=1e-4)


def test_two_inputs_and_two_outputs_over_rest(server: ServerProcess) -> None:
    a, b = rows(4, 256, seed=12), rows(4, 4, seed=13)

    r = infer(server, "two_heads", a=a, b=b)

    y, z = two_heads_reference(a, b)
    np.testing.assert_allclose(output(r, "output0"), y, atol=1e-4)
    np.testing.assert_allclose(output(r, "output1"), z, atol=1e-4)


def test_a_request_over_the_exported_bound_fails_alone(server: ServerProcess) -> None:
    r = infer(server, "tiny_pt2", x=rows(TINY_MAX_BATCH + 1))

    assert r.status_code == 400, r.text
    assert f"the model takes at most {TINY_MAX_BATCH} at once" in r.json()["error"]
    small = output(infer(server, "tiny_pt2", x=rows(2)), "output0")
    np.testing.assert_allclose(small, reference_output(rows(2)), atol=1e-4)


def test_a_package_from_another_torch_is_refused_and_the_others_serve(
    server: ServerProcess,
) -> None:
    (described,) = httpx.get(f"{server.mgmt}/models/old_torch", headers=server.mgmt_headers).json()

    assert described["state"] == "FAILED"
    assert "compiled with torch 2.0.0+cpu" in described["reason"]
    assert "rebuild the archive with model-archiver" in described["reason"]
    r = infer(server, "old_torch", x=rows(1))
    assert r.status_code == 503, r.text
    assert infer(server, "tiny_pt2", x=rows(1)).status_code == 200
