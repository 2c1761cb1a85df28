"""What a switch costs one server, switched on and off under one load: the access log or tracing
of issue #34's targets, measured in the same process with the switch on and with it off.

`benchmarks/switches.py` compares servers started with and without a switch, loaded in turn for
seconds at a time. On a shared machine its figures move with two kinds of noise it cannot take
out: one server process runs faster than another of the same tree (9 % of CPU a request has
been seen between two servers with both off), and the machine's speed drifts between one load
and the next. Here one server, started with the switch on, serves one continuous wrk load (32
connections, scenario A's request) in pairs of windows of `--window` seconds, the switch on in
one window of a pair and off in the other, in an order drawn at random for each pair (`orders`,
`--seed`): before every window the benchmark signals the server, SIGUSR1 for on and SIGUSR2
for off, whose handlers set the switch's `enabled` flags (see `serve`). Each window's requests
a second are counted from the server's own `scriptserve_requests_total` after `--settle`
seconds (what the window before left, such as the access log's writer flushing its lines, is
not charged to it), and each pair gives one ratio, on against off: the two windows are a
second apart in one process, and whatever differs between a pair's first and second window
falls on both states alike. The control is a server whose handlers change nothing (it has the
plain access log on, as one of the switches' servers does): its median ratio's distance from
1 is what the method made of no change in that run. A switch's target is `met` or `not met`
(`switches.verdict`) only when its median ratio clears it, or falls short of it, by more than
that distance or twice the ratio's standard error, whichever is more (`noise`), else `not
decided`.

A calibration shows what a known cost on the event loop makes of the ratio: `busy-<N>us`, a
server with both off that spins N microseconds on the loop at the end of every answer while
"on" (the GIL held, no memory touched).

    python -m benchmarks.lock_in [--only access-log-plain,tracing-0.01,busy-1us] [--pairs 120]
        [--window 1.0] [--settle 0.25] [--seed 0]

Prints, per switch, the median and mean of the pairs' ratios with the mean's standard error,
and the server's CPU a request with the switch on and off (event loop's thread, other threads);
writes benchmarks/results/lock_in-<date>.json. What lags a window (spans exported by the span
exporter's process in batches of 512 or every 5 s) falls in either state and is counted at
about half its cost; the access log's lines are written within 0.1 s.

`python -m benchmarks.lock_in serve SWITCH -- serve ARGS...` is the server of one switch: the
`scriptserve` command with that signal handler.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from benchmarks import models, otlp_sink, report
from benchmarks.ab import RESULTS, server, thread_seconds
from benchmarks.loadgen import LoadResult, run_wrk, wrk_path
from benchmarks.servers import ServerProcess, free_port
from benchmarks.switches import TARGETS, quiet, traced, verdict

SWITCHES = ("control", "access-log", "access-log-plain", "tracing-0.01", "tracing-0")
BUSY = re.compile(r"busy-(\d+(?:\.\d+)?)us")
"""A calibration, not a switch of the server's: `busy-1.5us` spins 1.5 us on the event loop at
every answer's end while on, which shows what a known cost on the loop makes of the ratio."""
_COUNT = re.compile(r"^scriptserve_requests_total\{[^}]*\} (\S+)$", re.MULTILINE)


ON, OFF = signal.SIGUSR1, signal.SIGUSR2
"""The signals that set a server's switch on and off."""


def set_switch(observers: Any, switch: str, on: bool) -> None:
    """Set `switch` of a server's HTTP `Observers` on or off: the access log's or tracing's
    `enabled`, and what the observers decide from them (`Observers.settle`); the control and a
    busy-wait's calibration change nothing there."""
    if switch == "control" or BUSY.fullmatch(switch):
        return
    if switch.startswith("access-log"):
        observers.access.enabled = on
    else:
        observers.tracing.enabled = on
    observers.settle()


def install(switch: str) -> list[Any]:
    """Keep every `Observers` the server makes, and set `switch` on in each at SIGUSR1 and off
    at SIGUSR2 (the handlers run on the main thread, the event loop's, between two of its
    steps)."""
    from scriptserve.server.rest import observe

    made: list[Any] = []
    init = observe.Observers.__init__

    def kept(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    observe.Observers.__init__ = kept  # type: ignore[method-assign]
    busy = BUSY.fullmatch(switch)
    spinning = [busy is not None]
    if busy is not None:
        spin(float(busy.group(1)), spinning)

    def handler(signum: int, frame: FrameType | None) -> None:
        spinning[0] = signum == ON
        for observers in made:
            set_switch(observers, switch, signum == ON)

    signal.signal(ON, handler)
    signal.signal(OFF, handler)
    return made


def spin(us: float, on: list[bool]) -> None:
    """Spin `us` microseconds on the event loop at the end of every answer of the inference
    routes while `on[0]` (the GIL held, no memory touched)."""
    from scriptserve.server.rest.protocol_cycle import ProtocolCycle

    complete = ProtocolCycle._complete
    ns = round(us * 1000)
    clock = time.perf_counter_ns

    def spun(self: ProtocolCycle) -> None:
        if on[0]:
            end = clock() + ns
            while clock() < end:
                pass
        complete(self)

    ProtocolCycle._complete = spun  # type: ignore[method-assign]


def serve(argv: Sequence[str]) -> int:
    """`serve SWITCH -- ARGS`: the scriptserve command with ARGS, its switch flipped at SIGUSR2."""
    switch, separator, *rest = argv
    if (switch not in SWITCHES and not BUSY.fullmatch(switch)) or separator != "--":
        raise SystemExit(f"usage: serve {{{','.join(SWITCHES)},busy-<N>us}} -- ARGS")
    install(switch)
    from scriptserve.server.cli import main

    return main(rest)


def orders(pairs: int, seed: int) -> list[bool]:
    """The states of `pairs` pairs of windows, each pair on then off or off then on at random
    (`seed`): whatever differs between a pair's first window and its second (the machine's
    drift, anything that follows the windows' own rhythm) falls on each state alike.

    >>> orders(3, 1)
    [True, False, True, False, False, True]
    """
    chance = random.Random(seed)
    return [state for _ in range(pairs) for state in chance.choice(((True, False), (False, True)))]


def pair_ratios(states: Sequence[bool], rates: Sequence[float]) -> list[float]:
    """Each pair's window with the switch on against its window with the switch off.

    >>> pair_ratios([True, False, False, True], [90, 100, 100, 95])
    [0.9, 0.95]
    """
    ratios = []
    for k in range(0, len(states) - 1, 2):
        first, second = rates[k], rates[k + 1]
        ratios.append(first / second if states[k] else second / first)
    return ratios


def noise(control: float, standard_error: float) -> float:
    """How far from a target a switch's median ratio must be to decide it: the control's
    distance from 1 (what the method made of no change in this run), or twice the standard
    error of the switch's own pairs' ratios, whichever is more.

    >>> round(noise(0.997, 0.0093), 4), round(noise(1.03, 0.01), 4)
    (0.0186, 0.03)
    """
    return max(abs(control - 1.0), 2 * standard_error)


def _served(client: httpx.Client, url: str) -> float:
    return sum(float(value) for value in _COUNT.findall(client.get(url).text))


def windows(
    s: ServerProcess, metrics_url: str, pairs: int, window: float, settle: float, seed: int
) -> dict[str, Any]:
    """`pairs` pairs of windows of `window` seconds under one wrk load, the server's switch
    set for each (`orders`); each window's state, req/s and CPU a request (the loop's thread,
    the other threads)."""
    assert s.proc is not None
    pid = s.proc.pid
    route = s.url + "/predictions/mlp"
    body = Path(s.env["LOCK_IN_BODY"])
    run_wrk(route, 32, 3, 2, body)  # warm-up
    states = orders(pairs, seed)
    load: list[LoadResult] = []
    seconds = len(states) * (window + 0.05) + 4  # the readings take a little of each window
    worker = threading.Thread(target=lambda: load.append(run_wrk(route, 32, seconds, 2, body)))
    worker.start()
    rates: list[float] = []
    cpu: list[tuple[float, float]] = []
    try:
        time.sleep(1.0)
        with httpx.Client(timeout=10) as client:
            for state in states:
                if not worker.is_alive():
                    raise RuntimeError("the load ended before the windows did")
                os.kill(pid, ON if state else OFF)  # a signal before every window, either way
                time.sleep(settle)
                count, at, (loop_s, others_s) = (
                    _served(client, metrics_url),
                    time.perf_counter(),
                    thread_seconds(pid),
                )
                time.sleep(window - settle)
                count_after, at_after, (loop_after, others_after) = (
                    _served(client, metrics_url),
                    time.perf_counter(),
                    thread_seconds(pid),
                )
                requests = count_after - count
                rates.append(requests / (at_after - at))
                us = 1e6 / requests if requests else 0.0
                cpu.append(((loop_after - loop_s) * us, (others_after - others_s) * us))
    finally:
        worker.join()
    if load and load[0].errors:
        raise RuntimeError(f"wrk saw {load[0].errors} errors")
    return {"states": states, "req_s": rates, "cpu_us_per_request": cpu, "seed": seed}


def summary(run: dict[str, Any]) -> dict[str, Any]:
    """A switch's pairs' ratios (median, mean and its standard error), and its req/s and CPU a
    request with it on and off (medians of the windows)."""
    states, rates, cpu = run["states"], run["req_s"], run["cpu_us_per_request"]
    ratios = pair_ratios(states, rates)

    def median(values: Sequence[float], on: bool) -> float:
        return statistics.median(v for v, state in zip(values, states, strict=True) if state is on)

    return {
        "pairs": len(ratios),
        "median": statistics.median(ratios),
        "mean": statistics.fmean(ratios),
        "standard_error": statistics.stdev(ratios) / len(ratios) ** 0.5,
        "req_s_on": median(rates, True),
        "req_s_off": median(rates, False),
        "cpu_us_per_request_on": [median([c[i] for c in cpu], True) for i in (0, 1)],
        "cpu_us_per_request_off": [median([c[i] for c in cpu], False) for i in (0, 1)],
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.lock_in",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--only",
        help="switches, comma-separated (the control always runs); busy-<N>us spins N us on "
        "the event loop at each answer's end instead (what a known cost on the loop shows)",
    )
    p.add_argument("--pairs", type=int, default=120, help="pairs of windows per switch")
    p.add_argument("--window", type=float, default=1.0, help="seconds in each state")
    p.add_argument("--settle", type=float, default=0.25, help="seconds not counted per window")
    p.add_argument("--seed", type=int, default=0, help="of the pairs' orders")
    p.add_argument("--output", type=Path, help="JSON file (default benchmarks/results/...)")
    args = p.parse_args(argv)
    switches = [s for s in SWITCHES if s != "control"]
    if args.only:
        switches = args.only.split(",")
        unknown = {s for s in switches if s not in SWITCHES and not BUSY.fullmatch(s)}
        if unknown:
            p.error(f"--only: no switch {', '.join(sorted(unknown))}")
    switches = ["control", *(s for s in switches if s != "control")]
    if not 0 <= args.settle < args.window:
        p.error("--settle must be at least 0 and less than --window")
    wrk_path()
    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    found: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[str, Any]] = {}
    with otlp_sink.running(free_port()) as sink, tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        model = models.build("mlp", Path(tmp) / "work", store)
        access = {"SCRIPTSERVE_ACCESS_LOG": str(Path(tmp) / "access.log")}
        environments = {
            "control": {**access, "SCRIPTSERVE_ACCESS_LOG_FORMAT": "plain"},
            "access-log": {**access, "SCRIPTSERVE_ACCESS_LOG_FORMAT": "json"},
            "access-log-plain": {**access, "SCRIPTSERVE_ACCESS_LOG_FORMAT": "plain"},
            "tracing-0.01": traced(sink.endpoint, 0.01),
            "tracing-0": traced(sink.endpoint, 0.0),
        }
        for switch in switches:
            own = environments.get(switch, {})  # a busy-wait's server has both off
            env = {**own, "LOCK_IN_BODY": str(model.body)}
            s = server(switch, sys.executable, store, env)
            s.argv = [s.argv[0], "-m", "benchmarks.lock_in", "serve", switch, "--", *s.argv[3:]]
            metrics = s.argv[s.argv.index("--metrics-address") + 1]
            with s:
                assert s.proc is not None
                quiet([sink.pid, s.proc.pid])
                runs[switch] = windows(
                    s,
                    f"http://{metrics}/metrics",
                    args.pairs,
                    args.window,
                    args.settle,
                    args.seed + len(runs),
                )
            found[switch] = summary(runs[switch])
            f = found[switch]
            print(
                f"{switch:18s} on/off {f['median']:.3f} (mean {f['mean']:.3f} +- "
                f"{f['standard_error']:.3f}, {f['pairs']} pairs), req/s on "
                f"{f['req_s_on']:.0f} off {f['req_s_off']:.0f}; CPU a request on "
                f"{f['cpu_us_per_request_on'][0]:.1f} + {f['cpu_us_per_request_on'][1]:.1f} us, "
                f"off {f['cpu_us_per_request_off'][0]:.1f} + "
                f"{f['cpu_us_per_request_off'][1]:.1f} us",
                flush=True,
            )
    control = found["control"]["median"]
    verdicts = {
        switch: {
            "target": TARGETS[switch],
            "median": found[switch]["median"],
            "noise": noise(control, found[switch]["standard_error"]),
            "verdict": verdict(
                found[switch]["median"],
                1 + noise(control, found[switch]["standard_error"]),
                TARGETS[switch],
            ),
        }
        for switch in switches
        if switch in TARGETS
    }
    print(
        f"targets (a ratio counts only beyond the control's distance from 1, {control:.3f}, "
        "or twice its standard error, whichever is more):"
    )
    for switch, v in verdicts.items():
        print(
            f"  {switch:18s} {v['median']:.3f} +- {v['noise']:.3f} against {v['target']}: "
            f"{v['verdict']}"
        )
    host = report.host(load_before)
    print(report.host_line(host))
    out = args.output or RESULTS / f"lock_in-{started:%Y-%m-%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "lock_in",
        "started": started.isoformat(timespec="seconds"),
        "pairs": args.pairs,
        "window_s": args.window,
        "settle_s": args.settle,
        "host": host,
        "windows": runs,
        "summary": found,
        "targets": verdicts,
        "otlp_receiver": sink.received,
    }
    out.write_text(json.dumps(document, indent=1) + "\n")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
