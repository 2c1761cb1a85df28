"""The memory budget in-process (server/models/memory.py): a lazy model loads on its first
request, once however many requests wait; the least recently used idle model is unloaded to
make room, never a pinned one; a budget nothing can make room in answers 503. Real
TorchScript models of 96 MiB of weights, a real registry and data plane, thread workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.models import build_holders
from scriptserve.handlers.base import InferenceRequest
from scriptserve.server.errors import ModelNotReady
from scriptserve.server.inference.dataplane import DataPlane
from scriptserve.server.models.memory import BudgetFull, Residence, parse_budget
from scriptserve.server.models.registry import ModelRegistry
from scriptserve.server.observability.metrics import ServerMetrics
from scriptserve.server.settings import load_settings

pytestmark = pytest.mark.anyio
MIB = 2**20
MODEL_MIB = 96
"""Large beside what else moves the test process's resident size (tens of MiB): the budgets
below leave half a model of room either way."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_holders(
        tmp_path_factory.mktemp("memory"), [MODEL_MIB] * 4, archive_format="no-archive"
    )


class Node:
    """A registry and data plane over the store, every model lazy, one thread worker each."""

    def __init__(self, store: Path, **settings: object) -> None:
        self.settings = load_settings(
            model_store=store, lazy_load=True, workers_per_model=1, **settings
        )
        self.metrics = ServerMetrics()
        self.registry = ModelRegistry(self.settings, self.metrics, ["cpu"])
        self.memory = self.registry.memory
        self.dataplane = DataPlane(self.registry, self.metrics, self.settings)
        self.dataplane.starting = False

    async def register(self, count: int, **overrides: object) -> None:
        for i in range(count):
            await self.registry.load(self.settings.model_store / f"m{i}", overrides=overrides)

    async def ask(self, name: str) -> int:
        request = InferenceRequest(inputs={"x": np.full((1, 8), 0.5, np.float32)}, outputs=[])
        served = await self.dataplane.submit(name, None, request, protocol="test")
        await self.settled(name)
        return int(served.outputs[0][1][0, 0])

    async def settled(self, name: str) -> None:
        """Wait for a load of `name` still being measured: its first worker may answer a
        request before the load's bookkeeping (its bytes, its count) is done."""
        loading = self.registry.get(name).residency.loading
        if loading is not None:
            await asyncio.shield(loading)

    def residence(self, name: str) -> Residence:
        return self.registry.get(name).residency.state

    def counted(self, counter: str, name: str) -> float:
        value: float = getattr(self.metrics, counter).labels(name, "1.0")._value.get()
        return value


@pytest.fixture
async def node(store: Path) -> AsyncIterator[Node]:
    node = Node(store)
    yield node
    await node.dataplane.close()


async def test_a_lazy_model_loads_once_for_the_requests_that_wait_for_it(node: Node) -> None:
    await node.register(2)
    assert node.residence("m1") is Residence.UNLOADED
    assert node.registry.get("m1").ready  # available: its next request loads it
    assert node.registry.healthy()

    answers = await asyncio.gather(*(node.ask("m1") for _ in range(12)))

    assert answers == [1] * 12
    assert node.counted("model_loads", "m1") == 1
    assert node.counted("model_load_waits", "m1") >= 1
    residency = node.registry.get("m1").residency
    assert residency.state is Residence.LOADED
    assert MODEL_MIB * MIB * 0.8 < residency.resident_bytes < MODEL_MIB * MIB * 3
    assert node.residence("m0") is Residence.UNLOADED  # nobody asked for it


async def test_the_least_recently_used_idle_model_makes_room(node: Node) -> None:
    await node.register(4)
    assert [await node.ask(m) for m in ("m0", "m1")] == [0, 1]
    used = node.memory.used_bytes()
    node.memory.budget_bytes = used + int(MODEL_MIB * MIB * 0.5)  # no room for a third
    assert await node.ask("m0") == 0  # m1 is the least recently used now

    assert await node.ask("m2") == 2

    assert node.residence("m1") is Residence.UNLOADED
    assert node.registry.get("m1").residency.resident_bytes == 0
    assert node.residence("m0") is Residence.LOADED
    assert node.counted("model_evictions", "m1") == 1
    assert node.memory.used_bytes() <= node.memory.budget_bytes
    assert await node.ask("m1") == 1  # loaded again, in m0's place (now the least recent)
    assert node.residence("m0") is Residence.UNLOADED
    assert node.registry.get("m1").residency.loads == 2


async def test_a_model_is_used_when_asked_for_not_when_its_load_ends(node: Node) -> None:
    """m1's load ends after m0 was asked for (its first worker answers before the load's
    bookkeeping is done): m1 is still the least recently used, as it was asked for first."""
    await node.register(4)
    assert await node.ask("m0") == 0
    first = asyncio.create_task(node.ask("m1"))
    await asyncio.sleep(0)  # m1 asked for: its load starts
    assert node.registry.get("m1").residency.loading is not None
    assert await node.ask("m0") == 0  # asked for while m1 loads
    assert await first == 1
    node.memory.budget_bytes = node.memory.used_bytes() + int(MODEL_MIB * MIB * 0.5)

    assert await node.ask("m2") == 2

    assert node.residence("m1") is Residence.UNLOADED
    assert node.residence("m0") is Residence.LOADED


async def test_a_pinned_model_is_never_the_one_unloaded(node: Node) -> None:
    await node.register(3)
    await node.registry.load(node.settings.model_store / "m3", overrides={"evictable": False})
    assert [await node.ask(m) for m in ("m3", "m0")] == [3, 0]  # m3 the least recently used
    node.memory.budget_bytes = node.memory.used_bytes() + int(MODEL_MIB * MIB * 0.5)

    assert await node.ask("m1") == 1

    assert node.residence("m3") is Residence.LOADED
    assert node.residence("m0") is Residence.UNLOADED
    assert node.registry.get("m3").residency.evictions == 0


async def test_a_budget_nothing_can_make_room_in_answers_503(node: Node) -> None:
    await node.register(2, evictable=False)
    assert await node.ask("m0") == 0
    node.memory.budget_bytes = node.memory.used_bytes() + int(MODEL_MIB * MIB * 0.5)

    with pytest.raises(BudgetFull, match=r"memory budget is full .* raise --memory-budget"):
        await node.ask("m1")

    assert isinstance(BudgetFull("x"), ModelNotReady)  # answered 503 / UNAVAILABLE
    assert node.residence("m1") is Residence.UNLOADED  # its next request tries again
    assert await node.ask("m0") == 0  # the loaded model serves on
    assert node.registry.healthy()


def test_budget_sizes_read_as_people_write_them() -> None:
    assert parse_budget("2GiB") == 2 * 2**30
    assert parse_budget("512MB") == 512 * 10**6
    assert parse_budget("1.5G") == 1_500_000_000
    assert parse_budget("1073741824") == 2**30
    assert parse_budget("60%", limit=lambda: 1000) == 600
    for wrong in ("two gigs", "0", "150%", "-1GiB", "5 parsecs"):
        with pytest.raises(ValueError, match="memory budget"):
            parse_budget(wrong)
