"""Handler metrics: the native `context.metrics` API in-process, and on a real server's /metrics
for thread and process workers, and an unmodified TorchServe handler (packed by
torch-model-archiver) whose `context.metrics` calls and metrics.yaml declarations are exported
with their dimensions."""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess
from testmodels import save_torchscript
from torchserve.tsarchives import torch_model_archiver, write

from scriptserve.archiver.cli import model_archiver_main
from scriptserve.handlers.metrics import HandlerMetrics, metric_name
from scriptserve.server.observability.handler_metrics import read_metrics_config

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

NATIVE = """
from scriptserve.handlers.tensor import TensorHandler


class Counted(TensorHandler):
    def preprocess(self, requests):
        self.context.metrics.counter("rows_seen", len(requests), route="predict")
        self.context.metrics.gauge("last_batch", len(requests))
        return super().preprocess(requests)

    def inference(self, batch):
        with self.context.metrics.timer("model_seconds"):
            return super().inference(batch)
"""

TS_METRICS = """
from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes


def handle(data, context):
    if data is None:
        return None
    metrics = context.metrics
    metrics.add_counter("TsRequests", len(data), dimensions=[Dimension("Route", "echo")])
    metrics.add_time("TsHandlerTime", 2.5, unit="ms")
    metrics.add_metric("TsBatch", len(data), "count", metric_type=MetricTypes.HISTOGRAM)
    metrics.get_metric("DeclaredHits", MetricTypes.COUNTER).add_or_update(1, ["tiny", "gold"])
    return ["ok" for _ in data]
"""

METRICS_YAML = """
dimensions:
  - &model_name "ModelName"
  - &tier "Tier"
model_metrics:
  counter:
    - name: DeclaredHits
      unit: count
      dimensions: [*model_name, *tier]
"""


# -- the API in-process -------------------------------------------------------------------------
def test_counters_gauges_and_timers_keep_their_dimensions() -> None:
    m = HandlerMetrics()
    m.counter("hits", 2, route="a")
    m.counter("hits", 3, route="a")
    m.counter("hits", route="b")
    m.gauge("depth", 4)
    m.gauge("depth", 7)
    with m.timer("step_seconds"):
        time.sleep(0.01)
    found = {(s.name, s.dimensions): s for s in m.series()}
    assert found[("hits", (("route", "a"),))].value == 5
    assert found[("hits", (("route", "b"),))].value == 1
    assert found[("depth", ())].value == 7
    timer = found[("step_seconds", ())]
    assert timer.count == 1 and 0.01 <= timer.value < 1.0


def test_what_cannot_be_exported_is_refused_or_renamed() -> None:
    m = HandlerMetrics()
    m.counter("hits")
    with pytest.raises(ValueError, match="'hits' is a counter; it cannot be recorded as a gauge"):
        m.gauge("hits", 1)
    with pytest.raises(ValueError, match="cannot go down"):
        m.counter("hits", -1)
    assert metric_name("latency.p50 (ms)") == "latency_p50__ms_"
    assert metric_name("scriptserve_requests") == "handler_scriptserve_requests"
    m.gauge("g", 1, model="x")  # the server's own label names are taken
    assert [s.dimensions for s in m.series() if s.name == "g"] == [(("handler_model", "x"),)]


def test_a_process_worker_sends_what_changed_and_the_server_adds_it() -> None:
    server = HandlerMetrics()
    worker = pickle.loads(pickle.dumps(server))  # what a worker process starts with: empty
    assert worker.series() == []
    worker.counter("hits", 2)
    worker.gauge("depth", 3)
    server.merge(worker.drain())
    worker.counter("hits", 5)
    worker.observe("size", 10)
    server.merge(worker.drain())
    assert worker.drain() == []  # nothing new
    found = {s.name: s for s in server.series()}
    assert found["hits"].value == 7 and found["depth"].value == 3
    assert (found["size"].count, found["size"].value) == (1, 10)


def test_metrics_yaml_declarations_are_read(tmp_path: Path) -> None:
    path = write(tmp_path / "metrics.yaml", METRICS_YAML)
    assert read_metrics_config(path) == (
        ("counter", "DeclaredHits", "count", ("ModelName", "Tier")),
    )
    write(path, "model_metrics:\n  summary:\n    - name: x\n")
    with pytest.raises(ValueError, match="use counter, gauge or histogram"):
        read_metrics_config(path)


# -- on a real server ---------------------------------------------------------------------------
def _archive(work: Path, store: Path, name: str, handler: Path, config: dict[str, str]) -> None:
    (work / "sample.json").write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file",
        str(save_torchscript(work / "tiny.pt")), "--handler", str(handler),
        "--sample-input", str(work / "sample.json"), "--export-path", str(store),
        "--config-file", str(write(work / f"{name}.yaml", json.dumps(config))),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    work = tmp_path_factory.mktemp("handler-metrics")
    store = work / "store"
    handler = write(work / "counted.py", NATIVE)
    # No warm-up: the counts below are the requests' alone.
    _archive(work, store, "threads", handler, {"warmupRuns": "0"})
    _archive(work, store, "isolated", handler, {"workerMode": "process", "warmupRuns": "0"})
    write(work / "ts_metrics.py", TS_METRICS)
    torch_model_archiver(
        work, store, "tsmetrics", "--serialized-file", "tiny.pt", "--handler", "ts_metrics.py"
    )
    config = write(work / "metrics.yaml", METRICS_YAML)
    proc = ServerProcess(store, "--workers", "1", "--metrics-config", str(config)).start()
    yield proc
    proc.stop()


def scrape(server: ServerProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{server.metrics_url}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("model", ["threads", "isolated"])
def test_native_handler_metrics_are_exported(server: ServerProcess, model: str) -> None:
    for _ in range(3):
        r = httpx.post(f"{server.url}/predictions/{model}", json=[0.5] * 8)
        assert r.status_code == 200, r.text
    found = scrape(server)
    labels = {"model": model, "version": "1.0"}
    assert found[("rows_seen_total", frozenset({**labels, "route": "predict"}.items()))] == 3
    assert found[("last_batch", frozenset(labels.items()))] == 1
    assert found[("model_seconds_count", frozenset(labels.items()))] == 3
    assert 0 < found[("model_seconds_sum", frozenset(labels.items()))] < 3


def test_an_unmodified_torchserve_handler_exports_its_metrics(server: ServerProcess) -> None:
    for _ in range(2):
        r = httpx.post(f"{server.url}/predictions/tsmetrics", content=b"1")
        assert r.status_code == 200, r.text
    found = scrape(server)
    base = {"model": "tsmetrics", "version": "1.0"}
    defaults = {**base, "ModelName": "tsmetrics", "Level": "Model"}
    assert found[("TsRequests_total", frozenset({**defaults, "Route": "echo"}.items()))] == 2
    assert found[("TsHandlerTime", frozenset(defaults.items()))] == 2.5
    assert found[("TsBatch_count", frozenset(defaults.items()))] == 2
    declared = {**base, "ModelName": "tiny", "Tier": "gold"}
    assert found[("DeclaredHits_total", frozenset(declared.items()))] == 2
