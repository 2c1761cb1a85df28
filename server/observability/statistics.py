"""Triton's per-model statistics (its statistics extension), kept beside the Prometheus metrics.

`server/observability/metrics.py` records every measurement into both at once, so the two never
disagree:

- success / fail: every answered request, from its arrival at the data plane to its answer, by
  outcome (`scriptserve_request_latency_seconds`, `scriptserve_requests_total{status}`);
- queue: every request a worker took, from its arrival in the model's queue until then
  (`scriptserve_queue_latency_seconds`);
- compute_input / compute_infer / compute_output: the batch's preprocess (with, for process
  workers, the hand-over of its inputs), its model run, and its postprocess (with the hand-back
  of its answers) (`scriptserve_compute_seconds{stage}`; together `..._inference_latency_...`).
  As in Triton, each request of a batch counts its batch's whole time once;
- batch_stats: the same three per model execution, keyed by the batch size the model ran with
  (the rows of all its requests together, as Triton counts them; `scriptserve_batch_size`
  counts requests);
- inference_count: rows run, execution_count: model executions, last_inference: when the last
  request was answered (milliseconds since the epoch).

Worker threads and the event loop both record: each version's numbers are kept under a lock.

    stats = VersionStatistics("mnist", "1")
    stats.answered(ok=True, seconds=0.004)
    stats.snapshot()["inference_stats"]["success"]   # {"count": 1, "ns": 4000000}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

_NS = 1_000_000_000
_INFER_STATS = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)


class Duration:
    """A count and a cumulative duration in nanoseconds (Triton's StatisticDuration)."""

    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count = 0
        self.ns = 0

    def add(self, seconds: float, times: int = 1) -> None:
        self.count += times
        self.ns += round(seconds * _NS) * times

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class VersionStatistics:
    """Cumulative statistics of one model version since the server started."""

    def __init__(self, name: str, version: str) -> None:
        self.name = name
        self.version = version
        self._lock = threading.Lock()
        self._stats = {key: Duration() for key in _INFER_STATS}
        self._batches: dict[int, tuple[Duration, Duration, Duration]] = {}
        self._inference_count = 0
        self._execution_count = 0
        self._last_inference_ms = 0

    def answered(self, ok: bool, seconds: float) -> None:
        """A request was answered, successfully or not, `seconds` after it arrived."""
        with self._lock:
            self._stats["success" if ok else "fail"].add(seconds)
            self._last_inference_ms = int(time.time() * 1000)

    def taken(self, waits: Sequence[float]) -> None:
        """A worker took a batch: how long each of its requests waited in the queue."""
        with self._lock:
            queue = self._stats["queue"]
            for seconds in waits:
                queue.add(seconds)

    def ran(
        self, requests: int, rows: int, input_s: float, infer_s: float, output_s: float
    ) -> None:
        """A worker ran a batch of `requests` requests holding `rows` rows."""
        with self._lock:
            stats = self._stats
            stats["compute_input"].add(input_s, requests)
            stats["compute_infer"].add(infer_s, requests)
            stats["compute_output"].add(output_s, requests)
            batch = self._batches.get(rows)
            if batch is None:
                batch = self._batches[rows] = (Duration(), Duration(), Duration())
            for duration, seconds in zip(batch, (input_s, infer_s, output_s), strict=True):
                duration.add(seconds)
            self._inference_count += rows
            self._execution_count += 1

    def snapshot(self) -> dict[str, Any]:
        """Triton's `$model_stat` object (the JSON shape of its ModelStatistics message)."""
        with self._lock:
            return {
                "name": self.name,
                "version": self.version,
                "last_inference": self._last_inference_ms,
                "inference_count": self._inference_count,
                "execution_count": self._execution_count,
                "inference_stats": {key: d.to_dict() for key, d in self._stats.items()},
                "batch_stats": [
                    {
                        "batch_size": rows,
                        "compute_input": batch[0].to_dict(),
                        "compute_infer": batch[1].to_dict(),
                        "compute_output": batch[2].to_dict(),
                    }
                    for rows, batch in sorted(self._batches.items())
                ],
                "memory_usage": [],
                "response_stats": {},
            }
