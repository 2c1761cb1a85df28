"""Gauges read at scrape time: the server process, each worker, and the GPUs.

- The server process, under Prometheus's standard names (`process_cpu_seconds_total`,
  `process_resident_memory_bytes`, `process_open_fds`, ...; prometheus_client's
  ProcessCollector, Linux).
- Each worker: `scriptserve_worker_busy{model,version,worker}` (1 while it runs a batch), and for
  process workers their own `scriptserve_worker_cpu_seconds_total` and
  `scriptserve_worker_resident_memory_bytes` (read from /proc; thread workers share the server
  process's figures).
- Each CUDA device, where torch is already loaded and sees one:
  `scriptserve_gpu_memory_allocated_bytes`, `scriptserve_gpu_memory_reserved_bytes` (torch's
  caching allocator) and `scriptserve_gpu_utilization_ratio` (NVML, when it answers). A server
  of `.pt2` models on CPU never imports torch, and a scrape does not either.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class WorkerGauge:
    """One worker as the scrape sees it."""

    model: str
    version: str
    worker: int
    busy: bool
    pid: int | None
    """The worker's own process (process workers), else None."""


def process_usage(pid: int) -> tuple[float, int] | None:
    """CPU seconds (user + system) and resident bytes of process `pid`, from /proc; None when
    it is gone or /proc is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat.rpartition(")")[2].split()
    try:
        utime, stime, rss = int(fields[11]), int(fields[12]), int(fields[21])
    except (IndexError, ValueError):
        return None
    return (utime + stime) / _TICKS, rss * _PAGE


class WorkerCollector(Collector):
    """Per-worker gauges (see the module docstring) from `source`, read at each scrape."""

    def __init__(self, source: Callable[[], Iterable[WorkerGauge]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version", "worker"]
        busy = GaugeMetricFamily(
            "scriptserve_worker_busy", "1 while the worker runs a batch", labels=labels
        )
        cpu = CounterMetricFamily(
            "scriptserve_worker_cpu_seconds", "CPU time of a process worker", labels=labels
        )
        rss = GaugeMetricFamily(
            "scriptserve_worker_resident_memory_bytes",
            "Resident memory of a process worker",
            labels=labels,
        )
        for w in self._source():
            key = [w.model, w.version, str(w.worker)]
            busy.add_metric(key, 1.0 if w.busy else 0.0)
            usage = process_usage(w.pid) if w.pid is not None else None
            if usage is not None:
                cpu.add_metric(key, usage[0])
                rss.add_metric(key, usage[1])
        yield from (busy, cpu, rss)


class GpuCollector(Collector):
    """CUDA memory and utilisation per device, where torch is loaded and sees a GPU."""

    def collect(self) -> Iterator[Metric]:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return
        allocated = GaugeMetricFamily(
            "scriptserve_gpu_memory_allocated_bytes", "Memory held by tensors", labels=["device"]
        )
        reserved = GaugeMetricFamily(
            "scriptserve_gpu_memory_reserved_bytes",
            "Memory held by torch's caching allocator",
            labels=["device"],
        )
        utilization = GaugeMetricFamily(
            "scriptserve_gpu_utilization_ratio",
            "Share of the last sample period the GPU was busy",
            labels=["device"],
        )
        for index in range(torch.cuda.device_count()):
            device = f"cuda:{index}"
            allocated.add_metric([device], float(torch.cuda.memory_allocated(index)))
            reserved.add_metric([device], float(torch.cuda.memory_reserved(index)))
            # NVML missing or refusing: no utilisation sample, the memory figures still count.
            with contextlib.suppress(Exception):
                utilization.add_metric([device], torch.cuda.utilization(index) / 100.0)
        yield from (allocated, reserved, utilization)
