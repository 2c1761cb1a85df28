"""The time line (replicas up, load, each replica restarted in turn) and what it saw, as
figures and as the lines the command prints."""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.rollout.haproxy import RETRY_ON, Balancer
from benchmarks.rollout.load import CountingLoad, Outcome
from benchmarks.rollout.replicas import Replica, Restart, restart


@dataclass
class Rollout:
    """What a run saw: every request's outcome, the restarts, and haproxy's counters."""

    outcomes: list[Outcome]
    duration_s: float
    steady_from_s: float
    """Where the warm phase ended."""
    restarts: list[Restart]
    haproxy: dict[str, int]
    client_cpu: float
    """The load generator's CPU time over the run (1.0 = one core busy)."""
    counts: dict[str, int] = field(init=False)
    series: list[int] = field(init=False)
    """Requests answered 200 in each whole second of the run."""

    def __post_init__(self) -> None:
        self.counts = {"total": len(self.outcomes), "succeeded": 0, "failed": 0, "unanswered": 0}
        self.counts.update(Counter(o.kind for o in self.outcomes))
        self.series = [0] * int(self.duration_s)
        for o in self.outcomes:
            if o.kind == "succeeded" and int(o.done_s) < len(self.series):
                self.series[int(o.done_s)] += 1

    def mean_rate(self, start_s: float, end_s: float) -> float:
        """Mean req/s over the whole seconds that lie within [start_s, end_s]."""
        inside = self.series[math.ceil(start_s) : math.floor(end_s)]
        return sum(inside) / len(inside) if inside else math.nan

    def dip(self, event: Restart) -> int:
        """The lowest 1-s window that overlaps the restart, from SIGTERM until UP again."""
        windows = self.series[math.floor(event.sigterm_s) : math.ceil(event.up_s)]
        return min(windows, default=0)

    def steady_before(self) -> float:
        end = self.restarts[0].sigterm_s if self.restarts else self.duration_s
        return self.mean_rate(self.steady_from_s, end)

    def figures(self) -> list[dict[str, float]]:
        """Per restart: the dip (req/s, and as a fraction of the steady rate before the first
        restart) and the mean rate from UP again until the next SIGTERM or the end."""
        steady = self.steady_before()
        ends = [e.sigterm_s for e in self.restarts[1:]] + [self.duration_s]
        return [
            {
                "dip_rps": self.dip(event),
                "dip_fraction": self.dip(event) / steady,
                "steady_after_rps": self.mean_rate(event.up_s, end),
            }
            for event, end in zip(self.restarts, ends, strict=True)
        ]


def rollout(
    store: Path,
    model: str,
    body: bytes,
    *,
    replicas: int = 2,
    warm_s: float = 2.0,
    phase_s: float = 5.0,
    connections: int = 16,
    balance: str = "leastconn",
    retry_on: str = RETRY_ON,
    server_args: tuple[str, ...] = (),
) -> Rollout:
    """Run the whole time line on the archives in `store`, loading `model` with `body`."""
    fleet = [Replica(f"r{i + 1}", store, server_args) for i in range(replicas)]
    with contextlib.ExitStack() as stack:
        for replica in fleet:
            stack.callback(replica.stop)
        with ThreadPoolExecutor(len(fleet)) as pool:  # the replicas load at the same time
            list(pool.map(Replica.start, fleet))
        balancer = stack.enter_context(Balancer({r.name: r.port for r in fleet}, balance, retry_on))
        load = stack.enter_context(
            CountingLoad(f"{balancer.url}/predictions/{model}", body, connections)
        )
        time.sleep(warm_s + phase_s)  # the load runs: this is the warm and steady phase
        events: list[Restart] = []
        for replica in fleet:
            events.append(restart(replica, balancer, load))
            time.sleep(phase_s)
            events[-1].answered_after = replica.answered()
        load.stop()
        counters = balancer.counters()
    duration = load.duration_s
    return Rollout(load.outcomes, duration, warm_s, events, counters, load.cpu_s / duration)


def timeline(result: Rollout, per_line: int = 15) -> list[str]:
    """The per-second series, `per_line` seconds a line, with `|r1` before the second in which
    r1 got SIGTERM and `^r1` before the one in which haproxy had it UP again."""
    marks: dict[int, list[str]] = {}
    for event in result.restarts:
        marks.setdefault(int(event.sigterm_s), []).append(f"|{event.replica}")
        marks.setdefault(int(event.up_s), []).append(f"^{event.replica}")
    lines = []
    for start in range(0, len(result.series), per_line):
        cells = [
            " ".join([*marks.get(second, []), str(result.series[second])])
            for second in range(start, min(start + per_line, len(result.series)))
        ]
        lines.append(f"  {start:>3} s: " + " ".join(cells))
    return lines


def summary(result: Rollout) -> list[str]:
    lines = [f"steady before the first restart: {result.steady_before():.0f} req/s"]
    for event, figures in zip(result.restarts, result.figures(), strict=True):
        at = event.sigterm_s
        lines.append(
            f"{event.replica}: SIGTERM at {at:.1f} s; haproxy DOWN +{event.marked_down_s - at:.2f} "
            f"s, exited +{event.exited_s - at:.2f} s (code {event.exit_code}), ready again "
            f"+{event.ready_s - at:.2f} s, haproxy UP +{event.up_s - at:.2f} s; lowest 1-s "
            f"window {figures['dip_rps']:.0f} req/s ({figures['dip_fraction']:.2f} of steady); "
            f"then {figures['steady_after_rps']:.0f} req/s; answered 200: "
            f"{event.answered_before} before SIGTERM, {event.answered_after} after the restart"
        )
    c, h = result.counts, result.haproxy
    lines.append(
        f"requests: {c['total']} total, {c['succeeded']} succeeded, {c['failed']} failed, "
        f"{c['unanswered']} unanswered"
    )
    lines.append(
        f"haproxy: {h['wretr']} retries, {h['wredis']} redispatches, {h['econ']} connection "
        f"errors, {h['eresp']} response errors, {h['hrsp_5xx']} 5xx answers to clients; "
        f"load generator CPU {result.client_cpu:.2f}"
    )
    return lines
