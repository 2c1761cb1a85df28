"""What the access log and tracing cost scenario A: the same tree with both off, with the access
log on (JSON lines to a file, and plain lines, the default), with tracing on at a sampling
ratio of 0.01 and of 0 (and, with `--all`, every trace sampled; given `--before`, another tree
with both off and with the plain access log on, or with each switch of `--only`), each loaded
in turn by wrk round after round, as benchmarks/ab.py does. Two servers have both off: each
round's ratios are taken to the mean of the two, and the ratio of one to the other (the
control) is what the machine's noise alone makes of a ratio in that run. With `--servers N`
each configuration is N servers, a round's figure the mean of theirs: servers of one tree with
both off have differed by 9 % in CPU per request over a whole run, which one server per
configuration charges to its switch.

    python -m benchmarks.switches [--before /tmp/before-venv/bin/python] [--rounds 6] [--all]
        [--only tracing-0.01,tracing-0] [--servers 2]

Spans go over OTLP/gRPC to benchmarks/otlp_sink.py, a receiver in its own process on this
machine that decodes and counts them (a collector elsewhere would take that CPU off the
server's machine). After each load the benchmark waits for the servers and the receiver to go
quiet, so spans still being exported from one server's round are not charged to the next.
Prints each round, the medians and the per-round ratios to both off, and each server's CPU per
request (medians over its loads) on the event loop's thread and on its other threads (workers,
the access log's writer): where a switch's cost lands. Then what the run says of each switch's
target (`TARGETS`, issue #34's): a median ratio counts only as far as the control is from 1
(`verdict`), so a run on a noisy machine says "not decided" rather than a figure that only
looks met or missed. Writes them all to benchmarks/results/switches-<date>.json.
`benchmarks/lock_in.py` measures the same switches in one server, switched on and off under one
load: neither process-to-process speed nor the machine's slow drift moves its ratios.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks import models, otlp_sink, report
from benchmarks.ab import RESULTS, alternate, server
from benchmarks.loadgen import wrk_path
from benchmarks.servers import ServerProcess, free_port


def quiet(pids: list[int], idle_share: float = 0.05, timeout_s: float = 60.0) -> None:
    """Wait until the processes `pids` and their children together use less than `idle_share`
    of a core over half a second: a traced server's span exporter goes on exporting after its
    round (up to 2,048 requests' spans wait in the server), and the receiver on decoding them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = [p for pid in pids for p in _with_children(pid)]
        before = _cpu_seconds(procs)
        time.sleep(0.5)
        if _cpu_seconds(procs) - before < idle_share * 0.5:
            return


def _with_children(pid: int) -> list[psutil.Process]:
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for process in procs:
        try:
            total += sum(process.cpu_times()[:2])
        except psutil.NoSuchProcess:
            continue  # it exited between the readings
    return total


TARGETS = {"access-log": 0.95, "access-log-plain": 0.95, "tracing-0.01": 0.97, "tracing-0": 0.99}
"""The least a switch may keep of both off's requests a second."""


def verdict(ratio: float, control: float, target: float) -> str:
    """What one run says of a target, given a switch's median ratio to both off and the
    control's median (both off against both off): the control's distance from 1 is what the
    machine's noise alone made of a ratio in that run, so the ratio shows the target `met` only
    when it clears it by that much, `not met` only when it falls short by that much, and is
    `not decided` in between.

    >>> verdict(0.910, 1.025, 0.95), verdict(0.957, 1.025, 0.97), verdict(1.0, 1.0, 0.99)
    ('not met', 'not decided', 'met')
    """
    noise = abs(control - 1.0)
    if ratio - noise >= target:
        return "met"
    if ratio + noise < target:
        return "not met"
    return "not decided"


def copies(label: str, count: int) -> list[str]:
    """The names of a configuration's `count` servers: `label`, then `label#2`, ..."""
    return [label, *(f"{label}#{i}" for i in range(2, count + 1))]


def merged(
    runs: dict[str, list[float]], cpu: dict[str, list[tuple[float, float]]], count: int
) -> tuple[dict[str, list[float]], dict[str, list[tuple[float, float]]]]:
    """Each configuration's `count` servers as one: per round, the mean of their req/s; their
    loads' CPU per request together."""
    labels = [label for label in runs if "#" not in label]
    merged_runs = {
        label: [
            statistics.fmean(values)
            for values in zip(*(runs[copy] for copy in copies(label, count)), strict=True)
        ]
        for label in labels
    }
    merged_cpu = {
        label: [load for copy in copies(label, count) for load in cpu.get(copy, [])]
        for label in labels
    }
    return merged_runs, merged_cpu


def traced(endpoint: str, ratio: float) -> dict[str, str]:
    return {
        "SCRIPTSERVE_TRACING": "true",
        "SCRIPTSERVE_TRACING_ENDPOINT": endpoint,
        "SCRIPTSERVE_TRACING_PROTOCOL": "grpc",
        "SCRIPTSERVE_TRACING_SAMPLING_RATIO": str(ratio),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.switches",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--before",
        help="python of another tree, served with both off and with the plain access log (with "
        "--only: with each switch named there)",
    )
    p.add_argument("--all", action="store_true", help="also tracing with every trace sampled")
    p.add_argument(
        "--only",
        help="comma-separated switches to serve beside the two with both off (for example "
        "tracing-0.01,tracing-0): fewer servers, more rounds in the same time",
    )
    p.add_argument(
        "--servers",
        type=int,
        default=1,
        help="servers per configuration, each loaded in turn: a round's figure for a "
        "configuration is the mean of its servers' (one server's own speed, which differs from "
        "process to process, then weighs less in a ratio)",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--output", type=Path, help="JSON file (default benchmarks/results/...)")
    args = p.parse_args(argv)
    wrk_path()
    started = dt.datetime.now().astimezone()
    load_before = os.getloadavg()
    with otlp_sink.running(free_port()) as sink:
        endpoint = sink.endpoint
        with tempfile.TemporaryDirectory(prefix="scriptserve-switches-") as tmp:
            store = Path(tmp) / "store"
            model = models.build("mlp", Path(tmp) / "work", store)
            access = {
                "SCRIPTSERVE_ACCESS_LOG": str(Path(tmp) / "access.log"),
                "SCRIPTSERVE_ACCESS_LOG_FORMAT": "json",
            }
            configurations = {
                "off": {},
                "off-again": {},  # the control: both off again, a server of its own
                "access-log": access,
                # The server's default format: plain lines.
                "access-log-plain": {**access, "SCRIPTSERVE_ACCESS_LOG_FORMAT": "plain"},
                "tracing-0.01": traced(endpoint, 0.01),
                "tracing-0": traced(endpoint, 0.0),
            }
            if args.all:
                configurations["tracing-1"] = traced(endpoint, 1.0)
            compared = ["access-log-plain"]  # served by the other tree too, given --before
            if args.only:
                compared = args.only.split(",")
                unknown = set(compared) - set(configurations)
                if unknown:
                    p.error(f"--only: no switch {', '.join(sorted(unknown))}")
                kept = {"off", "off-again", *compared}
                configurations = {k: v for k, v in configurations.items() if k in kept}
            served = [(label, sys.executable, env) for label, env in configurations.items()]
            if args.before:
                served.append(("before", args.before, {}))
                served += [
                    (f"before-{label}", args.before, configurations[label]) for label in compared
                ]
            servers: dict[str, ServerProcess] = {}
            cpu: dict[str, list[tuple[float, float]]] = {}
            try:
                for label, python, env in served:
                    for copy in copies(label, args.servers):
                        own = env
                        if "SCRIPTSERVE_ACCESS_LOG" in env:  # a file each, not lines interleaved
                            log = Path(tmp) / f"access-{copy.replace('#', '-')}.log"
                            own = {**env, "SCRIPTSERVE_ACCESS_LOG": str(log)}
                        # Started as soon as its ports are chosen: chosen all first, a port
                        # let go of by one choice can be handed to the next.
                        servers[copy] = server(copy, python, store, own)
                        servers[copy].__enter__()
                pids = [sink.pid] + [s.proc.pid for s in servers.values() if s.proc is not None]
                runs = alternate(
                    servers,
                    args.rounds,
                    args.seconds,
                    model.body,
                    settle=lambda: quiet(pids),
                    cpu=cpu,
                )
            finally:
                for s in servers.values():
                    s.stop()
    received = sink.received
    if args.servers > 1:
        runs, cpu = merged(runs, cpu, args.servers)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    both_off = [(a + b) / 2 for a, b in zip(runs["off"], runs["off-again"], strict=True)]
    ratios = {
        label: [a / b for a, b in zip(values, both_off, strict=True)]
        for label, values in runs.items()
        if label not in ("off", "off-again")
    }
    control = [a / b for a, b in zip(runs["off-again"], runs["off"], strict=True)]
    against_before: dict[str, list[float]] = {}
    if "before" in runs:
        against_before = {
            label: [a / b for a, b in zip(runs[label], runs[other], strict=True)]
            for label, other in (
                ("off", "before"),
                *((label, f"before-{label}") for label in compared),
            )
        }
    print("medians: " + ", ".join(f"{k} {v:.0f} req/s" for k, v in medians.items()))
    print(
        f"control, off-again / off per round: {' '.join(f'{r:.3f}' for r in control)} "
        f"(median {statistics.median(control):.3f})"
    )
    for label, values in ratios.items():
        print(
            f"{label} / both off per round: {' '.join(f'{r:.3f}' for r in values)} "
            f"(median {statistics.median(values):.3f})"
        )
    for label, values in against_before.items():
        print(
            f"{label} / the other tree's per round: {' '.join(f'{r:.3f}' for r in values)} "
            f"(median {statistics.median(values):.3f})"
        )
    cpu_medians = {
        label: [statistics.median(run[i] for run in values) for i in (0, 1)]
        for label, values in cpu.items()
    }
    print("CPU per request, medians, us: event loop's thread + the other threads")
    for label, (loop_us, others_us) in cpu_medians.items():
        print(f"  {label:28s} {loop_us:7.1f} + {others_us:7.1f}")
    control_median = statistics.median(control)
    verdicts = {
        label: {
            "target": TARGETS[label],
            "median": statistics.median(values),
            "verdict": verdict(statistics.median(values), control_median, TARGETS[label]),
        }
        for label, values in ratios.items()
        if label in TARGETS
    }
    print(f"targets (a ratio counts as far as the control, {control_median:.3f}, is from 1):")
    for label, found in verdicts.items():
        print(f"  {label:28s} {found['median']:.3f} against {found['target']}: {found['verdict']}")
    print(f"OTLP receiver: {received}")
    host = report.host(load_before)
    print(report.host_line(host))
    out = args.output or RESULTS / f"switches-{started:%Y-%m-%dT%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "benchmark": "switches",
        "configurations": list(runs),
        "started": started.isoformat(timespec="seconds"),
        "before": args.before,
        "seconds": args.seconds,
        "servers_per_configuration": args.servers,
        "host": host,
        "runs": runs,
        "medians": medians,
        "ratios_to_both_off": ratios,
        "control_off_again_to_off": control,
        "cpu_us_per_request": cpu,
        "cpu_us_per_request_medians": cpu_medians,
        "ratios_to_before": against_before,
        "targets": verdicts,
        "otlp_receiver": received,
    }
    out.write_text(report.compact_json(document))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
