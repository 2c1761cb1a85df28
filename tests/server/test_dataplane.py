"""The data plane in-process: a real registry loading real archives, no HTTP, no subprocess."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from testmodels import SlowMLP, TinyMLP, reference_output, save_torchscript
from torch import nn

from scriptserve.archiver.cli import model_archiver_main
from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.errors import (
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    QueueFull,
    ServingError,
)
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.inference.decoding import Served
from scriptserve.server.models.management import Management, Registration, Scaling
from scriptserve.server.models.registry import ModelRegistry
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.settings import load_settings

X = np.full((1, 8), 0.5, dtype=np.float32)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Doubled(nn.Module):
    """TinyMLP's output times two: a second version whose answers differ from the first's."""

    def __init__(self) -> None:
        super().__init__()
        self.tiny = TinyMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tiny(x) * 2


def _archive(store: Path, work: Path, name: str, version: str, module: nn.Module) -> None:
    model = save_torchscript(work / f"{name}-{version}.pt", module)
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", name, "--version", version, "--serialized-file", str(model),
        "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(store),
        "--archive-format", "no-archive",
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    (store / name).rename(store / f"{name}-{version}")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dataplane")
    store, work = root / "store", root / "work"
    store.mkdir()
    work.mkdir()
    _archive(store, work, "tiny", "1.0", SlowMLP(matmuls=100))
    _archive(store, work, "tiny", "2.0", Doubled())
    return store


class Plane:
    def __init__(self, store: Path) -> None:
        self.settings = load_settings(
            model_store=store, workers_per_model=1, enable_model_api=True, queue_size=4
        )
        self.metrics = ServerMetrics()
        self.registry = ModelRegistry(self.settings, self.metrics, ["cpu"])
        self.dataplane = DataPlane(self.registry, self.metrics, self.settings)
        self.management = Management(self.registry, self.dataplane.inflight_of, self.settings)
        self.dataplane.starting = False

    def requests(self, status: int, version: str = "1.0") -> float:
        value = self.metrics.requests.labels("tiny", version, "test", str(status))._value.get()
        return float(value)


@pytest.fixture
async def plane(store: Path) -> AsyncIterator[Plane]:
    plane = Plane(store)
    for version in ("1.0", "2.0"):
        await plane.management.register(Registration(url=f"tiny-{version}"))
    yield plane
    await plane.dataplane.close()


def _request(outputs: list[str] | None = None) -> InferenceRequest:
    return InferenceRequest(inputs={"x": X}, outputs=outputs)


async def _until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.mark.anyio
async def test_the_answer_names_the_version_that_served_it(plane: Plane) -> None:
    dp = plane.dataplane
    task = asyncio.ensure_future(dp.submit("tiny", None, _request([]), protocol="test"))
    mv = plane.registry.get("tiny", "1.0")
    await _until(lambda: dp.inflight == 1 and mv.batcher is not None and mv.batcher.depth == 0)
    # The default changes while the request runs on version 1.0: the answer still says 1.0.
    plane.management.set_default("tiny", "2.0")
    served = await task
    assert served.model_version == "1.0"
    assert np.allclose(served.outputs[0][1], reference_output(X), atol=1e-5)
    again = await dp.submit("tiny", None, _request([]), protocol="test")
    assert again.model_version == "2.0"
    assert np.allclose(again.outputs[0][1], 2 * reference_output(X), atol=1e-5)


@pytest.mark.anyio
async def test_outputs_are_selected_for_tensor_protocols_only(plane: Plane) -> None:
    dp = plane.dataplane
    tensors = await dp.submit("tiny", "2.0", _request(["output0"]), protocol="test")
    assert [name for name, _ in tensors.outputs] == ["output0"]
    as_is = await dp.submit("tiny", "2.0", _request(None), protocol="test")
    assert as_is.outputs == [] and set(as_is.response.outputs) == {"output0"}
    with pytest.raises(InvalidInput, match=r"unknown output\(s\) nope"):
        await dp.submit("tiny", "2.0", _request(["nope"]), protocol="test")
    assert plane.requests(400, "2.0") == 1
    assert plane.requests(200, "2.0") == 2


@pytest.mark.anyio
async def test_the_model_is_checked_before_the_request_is_decoded(plane: Plane) -> None:
    decoded: list[bool] = []

    def decode() -> InferenceRequest:
        decoded.append(True)
        raise InvalidInput("the body is not valid JSON")

    with pytest.raises(ModelNotFound, match="model 'nope' is not registered"):
        await plane.dataplane.submit("nope", None, decode, protocol="test")
    assert decoded == []
    with pytest.raises(InvalidInput, match="not valid JSON"):
        await plane.dataplane.submit("tiny", "2.0", decode, protocol="test")
    assert decoded == [True]


@pytest.mark.anyio
async def test_a_request_given_decoded_is_checked_by_the_worker_too(plane: Plane) -> None:
    # A pipeline's step or a KServe v1 instance comes already decoded; it meets the same check on
    # the worker's thread: submit queues it, and one that does not fit the model's signature is
    # answered 400 through its future, alone, beside the requests batched with it.
    dp = plane.dataplane
    wrong = InferenceRequest(inputs={"x": np.zeros((1, 3), np.float32)}, outputs=["output0"])
    requests = [_request(["output0"]), wrong, _request(["output0"])]
    futures = [dp.submit("tiny", "1.0", r, protocol="test") for r in requests]
    outcomes = await asyncio.gather(*futures, return_exceptions=True)
    bad = outcomes[1]
    assert isinstance(bad, InvalidInput), bad
    assert bad.message.startswith("model 'tiny': input 'x' has shape [1, 3]; the model expects")
    for served in (outcomes[0], outcomes[2]):
        assert isinstance(served, Served)
        assert np.allclose(served.outputs[0][1], reference_output(X), atol=1e-5)
    assert plane.requests(400) == 1 and plane.requests(200) == 2


@pytest.mark.anyio
async def test_a_request_sent_as_its_decoder_is_decoded_by_the_worker(plane: Plane) -> None:
    # The event loop only queues it; the worker's thread decodes it and checks its signature.
    # One that cannot be decoded is answered 400 alone, beside the requests batched with it.
    loop_thread = threading.get_ident()
    threads: list[int] = []

    def decode(good: bool) -> InferenceRequest:
        threads.append(threading.get_ident())
        if not good:
            raise ValueError("not a tensor")
        return _request(["output0"])

    dp = plane.dataplane
    calls = [
        dp.submit("tiny", "1.0", functools.partial(decode, good), protocol="test")
        for good in (True, True, False, True)
    ]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert len(threads) == 4 and loop_thread not in threads
    bad = outcomes[2]
    assert isinstance(bad, InvalidInput) and "could not be decoded (ValueError)" in bad.message
    for served in outcomes[:2] + outcomes[3:]:
        assert isinstance(served, Served)
        assert np.allclose(served.outputs[0][1], reference_output(X), atol=1e-5)
    assert plane.requests(400) == 1 and plane.requests(200) == 3


@pytest.mark.anyio
async def test_the_answer_is_encoded_by_the_worker_when_the_transport_says_how(
    plane: Plane,
) -> None:
    # OIP over REST gives the data plane its encoder: the worker that answered writes the
    # answer's bytes; an encoder that fails ends its request alone with a 500, never the loop.
    loop_thread = threading.get_ident()
    written: list[tuple[int, str, str, list[str]]] = []

    def encode(fail: bool, name: str, version: str, outputs: list[tuple[str, np.ndarray]]) -> None:
        if fail:
            raise ValueError("cannot write this")
        written.append((threading.get_ident(), name, version, [n for n, _ in outputs]))

    dp, partial = plane.dataplane, functools.partial
    calls = [
        dp.submit(
            "tiny", "2.0", _request(["output0"]), protocol="test", encode=partial(encode, fail)
        )
        for fail in (False, True, False)
    ]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert [w[1:] for w in written] == [("tiny", "2.0", ["output0"])] * 2
    assert loop_thread not in {w[0] for w in written}
    failed = outcomes[1]
    assert isinstance(failed, ServingError) and failed.status == 500, failed
    assert "answer could not be made" in failed.message
    assert isinstance(outcomes[0], Served) and isinstance(outcomes[2], Served)
    assert plane.requests(500, "2.0") == 1 and plane.requests(200, "2.0") == 2


@pytest.mark.anyio
async def test_a_stream_request_can_be_withdrawn(plane: Plane) -> None:
    dp = plane.dataplane
    mv = plane.registry.get("tiny", "1.0")
    assert mv.batcher is not None
    first = asyncio.ensure_future(dp.submit("tiny", "1.0", _request([]), protocol="test"))
    await _until(lambda: mv.batcher is not None and mv.batcher.depth == 0 and dp.inflight == 1)
    queued = asyncio.ensure_future(dp.submit("tiny", "1.0", _request([]), protocol="test"))
    await _until(lambda: mv.batcher is not None and mv.batcher.depth == 1)
    queued.cancel()
    await _until(lambda: mv.batcher is not None and mv.batcher.depth == 0, timeout_s=0.5)
    served = await first
    assert isinstance(served, Served) and served.model_version == "1.0"
    await _until(lambda: dp.inflight == 0)
    assert plane.requests(499) == 1 and plane.requests(200) == 1


@pytest.mark.anyio
async def test_the_future_submit_returns_is_the_answer_counted_before_any_reply(
    plane: Plane,
) -> None:
    # What the REST protocol answers OIP requests with: the job's own future, resolved by the
    # worker with the Served answer (outputs selected there), a reply added to it as a callback.
    dp = plane.dataplane
    mv = plane.registry.get("tiny", "1.0")
    assert mv.batcher is not None
    replies: list[tuple[asyncio.Future[Served], int]] = []

    def reply(answer: asyncio.Future[Served]) -> None:
        replies.append((answer, plane.requests(200) + plane.requests(400)))

    dp.submit("tiny", "1.0", _request([]), protocol="test").add_done_callback(reply)
    await _until(lambda: len(replies) == 1)
    answer, counted_before = replies[0]
    served = answer.result()
    assert isinstance(served, Served) and served.model_version == "1.0"
    assert counted_before == 1 and plane.requests(200) == 1  # counted when the answer came
    dp.submit("tiny", "1.0", _request(["nope"]), protocol="test").add_done_callback(reply)
    await _until(lambda: len(replies) == 2)
    error = replies[1][0].exception()
    assert isinstance(error, InvalidInput) and "unknown output(s) nope" in error.message
    assert plane.requests(400) == 1
    # Withdrawn: cancelled, and counted as its client going away.
    await _until(lambda: mv.batcher is not None and mv.batcher.depth == 0)
    dp.submit("tiny", "1.0", _request([]), protocol="test").add_done_callback(reply)
    withdrawn = dp.submit("tiny", "1.0", _request([]), protocol="test")
    withdrawn.cancel()
    await _until(lambda: dp.inflight == 0)
    assert plane.requests(499) == 1 and len(replies) == 3
    with pytest.raises(ModelNotFound):
        dp.submit("missing", None, _request([]), protocol="test")


@pytest.mark.anyio
async def test_a_full_queue_answers_at_once(plane: Plane) -> None:
    dp = plane.dataplane

    async def one() -> Served:  # a refusal is raised by submit itself, before any await
        return await dp.submit("tiny", "1.0", _request([]), protocol="test")

    results = await asyncio.gather(*(one() for _ in range(6)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, QueueFull)]
    assert refused and all(isinstance(r, (Served, QueueFull)) for r in results)
    assert "retry later" in refused[0].message


@pytest.mark.anyio
async def test_drain_waits_for_accepted_requests_and_then_refuses(plane: Plane) -> None:
    dp = plane.dataplane
    task = asyncio.ensure_future(dp.submit("tiny", "1.0", _request([]), protocol="test"))
    await _until(lambda: dp.inflight == 1)
    assert await dp.drain(timeout_s=30.0)
    assert task.done() and (await task).model_version == "1.0"
    with pytest.raises(ModelNotReady, match="shutting down"):
        await dp.submit("tiny", "1.0", _request([]), protocol="test")
    assert not dp.ready()


@pytest.mark.anyio
async def test_drain_reports_requests_still_running(store: Path) -> None:
    plane = Plane(store)
    await plane.management.register(Registration(url="tiny-1.0"))
    try:
        task = asyncio.ensure_future(
            plane.dataplane.submit("tiny", None, _request([]), protocol="t")
        )
        await _until(lambda: plane.dataplane.inflight == 1)
        assert not await plane.dataplane.drain(timeout_s=0.0)
        await task
    finally:
        await plane.dataplane.close()


def test_registration_parameters_are_checked_once_for_both_transports() -> None:
    with pytest.raises(InvalidInput) as info:
        Registration.parse({"url": "m.mar", "batch_size": 0, "worker_mode": "fork"})
    assert info.value.message.startswith("invalid request parameter(s): batch_size: ")
    assert "worker_mode: " in info.value.message
    registration = Registration.parse({"url": "m.mar", "initial_workers": 2, "max_batch_delay": 5})
    assert registration.overrides()["workers"] == 2
    assert registration.overrides()["max_batch_delay_ms"] == 5
    assert Scaling.parse({"min_worker": 2}).workers == 2
    assert Scaling.parse({"min_worker": 1, "max_worker": 3}).workers == 3
    with pytest.raises(InvalidInput, match="min_worker: "):
        Scaling.parse({"min_worker": -1})


@pytest.mark.anyio
async def test_management_describes_what_the_data_plane_serves(plane: Plane) -> None:
    described = plane.management.describe("tiny", "all")
    assert [d["modelVersion"] for d in described] == ["1.0", "2.0"]
    assert plane.management.list_models()["models"][0]["modelName"] == "tiny"
    done, message = await plane.management.scale(
        "tiny", "2.0", Scaling(min_worker=2, synchronous=True)
    )
    assert done and "Workers scaled to 2" in message
    assert plane.registry.get("tiny", "2.0").pool is not None
    with pytest.raises(ServingError):
        await plane.management.unregister("tiny", "1.0")  # the default: set another first
