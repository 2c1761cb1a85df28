"""Under concurrent gRPC load: 64 clients, each with its own input, each get their own output,
and the requests queued behind the one busy worker are run in batches."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc.aio as triton
from serving import ServerProcess
from testmodels import reference_output

from .conftest import MAX_BATCH, metric

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

CLIENTS = 64


async def _one(server: ServerProcess, i: int, x: np.ndarray) -> tuple[str, np.ndarray]:
    async with triton.InferenceServerClient(server.grpc) as client:
        tensor = triton.InferInput("x", [1, 8], "FP32")
        tensor.set_data_from_numpy(x[None])
        result = await client.infer("slow", [tensor], request_id=f"client-{i}", client_timeout=60)
        output = result.as_numpy("output0")
        assert output is not None
        return result.get_response().id, output


async def _load(server: ServerProcess, x: np.ndarray) -> list[tuple[str, np.ndarray]]:
    return await asyncio.gather(*(_one(server, i, row) for i, row in enumerate(x)))


def test_concurrent_clients_each_get_their_own_output_in_batches(
    slow_server: ServerProcess,
) -> None:
    x = np.random.default_rng(11).standard_normal((CLIENTS, 8)).astype(np.float32)
    runs = metric(slow_server, "scriptserve_batch_size_sum", model="slow")
    batches = metric(slow_server, "scriptserve_batch_size_count", model="slow")

    results = asyncio.run(_load(slow_server, x))

    assert [request_id for request_id, _ in results] == [f"client-{i}" for i in range(CLIENTS)]
    expected = reference_output(x)
    for i, (_, output) in enumerate(results):
        assert output.shape == (1, 3)
        np.testing.assert_allclose(output[0], expected[i], atol=1e-5)
    # Every request ran exactly once, and the worker ran them in far fewer batches than requests.
    runs = metric(slow_server, "scriptserve_batch_size_sum", model="slow") - runs
    batches = metric(slow_server, "scriptserve_batch_size_count", model="slow") - batches
    assert runs == CLIENTS
    assert CLIENTS / MAX_BATCH <= batches < CLIENTS / 4, batches
    total_runs = metric(slow_server, "scriptserve_batch_size_sum", model="slow")
    total_batches = metric(slow_server, "scriptserve_batch_size_count", model="slow")
    assert total_runs > total_batches
