"""The two scenarios: which model, which servers, and how the targets are judged.

A (overhead-bound): the MLP, one row per request as a JSON array. Baseline: a bare FastAPI route
that parses the same body and answers a constant (`baselines/bare_fastapi.py`); ceiling: a plain
ASGI callable that does the same on the same uvicorn/uvloop/httptools stack
(`baselines/raw_asgi.py`), the most a Python front end on that stack could serve.
B (compute-bound): the small CNN on 3x32x32. Baseline: FastAPI running the same scripted model
once per request (`baselines/per_request_fastapi.py`), both as an `async def` route and as a
plain `def` route in FastAPI's thread pool; the faster of the two in each round is the baseline.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.loadgen import LoadResult, Run
from benchmarks.models import BenchModel, build
from benchmarks.servers import ServerProcess, scriptserve, uvicorn_app

SCRIPTSERVE = ("batching_on", "batching_off")


@dataclass(frozen=True)
class Contender:
    key: str
    label: str
    start: Callable[[], ServerProcess]
    trivial_path: str
    """A GET that does no work, loaded to show wrk's headroom."""
    is_baseline: bool = False
    is_ceiling: bool = False
    """The same HTTP stack with nothing above it: what a Python front end could reach."""


def _per_variant() -> dict[str, list[float]]:
    return {key: [] for key in SCRIPTSERVE}


@dataclass
class Summary:
    """What the targets are judged on: one entry per round, ratios taken within the round."""

    baseline: list[str] = field(default_factory=list)
    """The faster baseline of each round, at 32 connections."""
    baseline_p99_ms: list[float] = field(default_factory=list)
    rps_ratio: dict[str, list[float]] = field(default_factory=_per_variant)
    """scriptserve's req/s over the baseline's, at 32 connections."""
    p99_ms: dict[str, list[float]] = field(default_factory=_per_variant)
    p50_over_model_ms: dict[str, list[float]] = field(default_factory=_per_variant)
    """scriptserve's 1-connection p50 minus the model's own batch-1 latency."""
    ceiling_ratio: dict[str, list[float]] = field(default_factory=_per_variant)
    """scriptserve's req/s over the ceiling's, at 32 connections (scenarios with a ceiling)."""


@dataclass
class Scenario:
    key: str
    title: str
    target_ratio: float
    model: BenchModel
    contenders: list[Contender]
    load_average: list[float] = field(default_factory=list)
    """The machine's 1-minute load average at the start of each round."""
    model_ms: list[float] = field(default_factory=list)
    """The model's own batch-1 latency, measured in-process in each round."""
    runs: dict[str, dict[int, list[Run]]] = field(default_factory=dict)
    """contender -> connections -> one Run per round."""
    trivial: dict[str, list[LoadResult]] = field(default_factory=dict)

    def summarise(self) -> Summary:
        baselines = [c.key for c in self.contenders if c.is_baseline]
        ceiling = next((c.key for c in self.contenders if c.is_ceiling), None)
        summary = Summary()
        for r in range(len(self.model_ms)):
            base = max(baselines, key=lambda k: self.runs[k][32][r].load.rps)
            base_run = self.runs[base][32][r].load
            summary.baseline.append(base)
            summary.baseline_p99_ms.append(base_run.p99_ms)
            for key in SCRIPTSERVE:
                summary.rps_ratio[key].append(self.runs[key][32][r].load.rps / base_run.rps)
                summary.p99_ms[key].append(self.runs[key][32][r].load.p99_ms)
                over = self.runs[key][1][r].load.p50_ms - self.model_ms[r]
                summary.p50_over_model_ms[key].append(over)
                if ceiling is not None:
                    top = self.runs[ceiling][32][r].load.rps
                    summary.ceiling_ratio[key].append(self.runs[key][32][r].load.rps / top)
        return summary


def median(values: list[float]) -> float:
    return statistics.median(values)


def build_scenarios(workdir: Path, workers: int, intra_op_threads: int) -> list[Scenario]:
    """Build both models and describe the servers of each scenario (none is started yet)."""
    mlp = build("mlp", workdir, workdir / "store-a")
    cnn = build("cnn", workdir, workdir / "store-b")

    def served(model: BenchModel, batch: int) -> Callable[[], ServerProcess]:
        store = model.archive.parent
        return lambda: scriptserve(
            f"scriptserve batch {batch}", store, model.name, workers, intra_op_threads, batch
        )

    def per_request(mode: str) -> Callable[[], ServerProcess]:
        env = {
            "BASELINE_MODEL": str(cnn.scripted),
            "BASELINE_MODE": mode,
            "BASELINE_THREADS": str(intra_op_threads),
        }
        app = "benchmarks.baselines.per_request_fastapi:create_app"
        return lambda: uvicorn_app(f"per-request {mode}", app, env, factory=True)

    def bare() -> ServerProcess:
        return uvicorn_app("bare FastAPI", "benchmarks.baselines.bare_fastapi:app", {})

    def raw() -> ServerProcess:
        return uvicorn_app("raw ASGI", "benchmarks.baselines.raw_asgi:app", {})

    live = "/v2/health/live"
    return [
        Scenario(
            "A",
            "overhead-bound: MLP 512-1024-1024-10, one JSON row per request",
            0.8,
            mlp,
            [
                Contender("raw_asgi", "raw ASGI + orjson (ceiling)", raw, "/", is_ceiling=True),
                Contender("bare_fastapi", "bare FastAPI (baseline)", bare, "/", is_baseline=True),
                Contender("batching_on", "scriptserve batching on (32)", served(mlp, 32), live),
                Contender("batching_off", "scriptserve batching off (1)", served(mlp, 1), live),
            ],
        ),
        Scenario(
            "B",
            "compute-bound: small CNN on 3x32x32, one JSON row per request",
            2.5,
            cnn,
            [
                Contender(
                    "per_request_async",
                    "per-request FastAPI, async def",
                    per_request("async"),
                    "/",
                    is_baseline=True,
                ),
                Contender(
                    "per_request_threadpool",
                    "per-request FastAPI, def (threadpool)",
                    per_request("threadpool"),
                    "/",
                    is_baseline=True,
                ),
                Contender("batching_on", "scriptserve batching on (32)", served(cnn, 32), live),
                Contender("batching_off", "scriptserve batching off (1)", served(cnn, 1), live),
            ],
        ),
    ]
