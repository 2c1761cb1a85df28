"""The load's phases: wrk at 1, 8 and 32 connections after an idle start, with bad requests
from httpx before the last step."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx

from benchmarks.loadgen import LoadResult, run_wrk


@dataclass(frozen=True)
class Phase:
    name: str
    label: str
    """Its short name on the graphs."""
    seconds: int
    connections: int
    """wrk's connections on /predictions/mlp; 0 for none."""
    bad: bool = False
    """Bad requests too, from httpx."""


@dataclass
class PhaseRun:
    phase: Phase
    started: float
    ended: float = 0.0
    load: LoadResult | None = None
    bad: dict[int, int] = field(default_factory=dict)
    """Status -> bad requests answered with it."""


BAD = 4
"""wrk's connections during the bad requests."""
BAD_PAUSE_S = 0.08
"""Between rounds of the four bad requests: about 40 a second, a few % of the light load."""


def plan(seconds: float) -> list[Phase]:
    """A ramp of 1, 8 and 32 connections with bad requests before the last step, `seconds` in
    all after a short idle start (so every graph starts from the idle server)."""

    def share(fraction: float) -> int:
        return max(3, round(seconds * fraction))

    return [
        Phase("idle", "idle", 4, 0),
        Phase("1 connection", "1 conn.", share(0.2), 1),
        Phase("8 connections", "8 conn.", share(0.25), 8),
        Phase(f"bad requests + {BAD} connections", "bad requests", share(0.2), BAD, bad=True),
        Phase("32 connections", "32 conn.", share(0.35), 32),
    ]


def send_bad_requests(
    base_url: str, good_body: bytes, until: Callable[[], bool], counts: dict[int, int]
) -> None:
    """Unknown models (404) and malformed bodies (400) over both REST APIs while `until()` is
    false, paced so that they are a small share of the traffic."""
    requests = [
        ("/predictions/no-such-model", good_body),
        ("/v2/models/no-such-model/infer", b'{"inputs": []}'),
        ("/predictions/mlp", b"{not json"),
        ("/predictions/mlp", b"[1, 2, 3]"),  # the model takes rows of 512
    ]
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=10) as client:
        while not until():
            for path, body in requests:
                status = client.post(path, content=body).status_code
                counts[status] = counts.get(status, 0) + 1
            time.sleep(BAD_PAUSE_S)


def drive(base_url: str, body: Path, phases: Sequence[Phase]) -> list[PhaseRun]:
    runs = []
    url = f"{base_url}/predictions/mlp"
    for phase in phases:
        run = PhaseRun(phase, started=time.time())
        load_phase = partial(
            run_wrk, url, connections=phase.connections, seconds=phase.seconds, threads=2, body=body
        )
        if phase.bad:
            with ThreadPoolExecutor(1) as pool:
                load = pool.submit(load_phase)
                send_bad_requests(base_url, body.read_bytes(), load.done, run.bad)
                run.load = load.result()
        elif phase.connections:
            run.load = load_phase()
        else:
            time.sleep(phase.seconds)  # the idle server, as Prometheus sees it
        run.ended = time.time()
        runs.append(run)
        print(describe(run), flush=True)
    return runs


def describe(run: PhaseRun) -> str:
    line = f"phase {run.phase.name:<34} {run.ended - run.started:5.1f} s"
    if run.load is not None:
        r = run.load
        line += f": {r.rps:7.0f} req/s, p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms"
        line += f", {r.errors} wrk errors"
    if run.bad:
        line += "; bad requests " + ", ".join(f"{n} x {s}" for s, n in sorted(run.bad.items()))
    return line
