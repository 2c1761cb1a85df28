"""Prometheus metrics on the metrics port: request counts by status, latency and batch-size
histograms, queue depth and workers by state, read back with prometheus_client's parser."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serving import ServerProcess

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

X = np.linspace(-1, 1, 8, dtype=np.float32)
OIP = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": X.tolist()}]}
HISTOGRAMS = (
    "scriptserve_request_latency_seconds",
    "scriptserve_queue_latency_seconds",
    "scriptserve_inference_latency_seconds",
    "scriptserve_batch_size",
)


class Scrape:
    """One scrape of /metrics; `value` sums the samples whose labels include `labels`."""

    def __init__(self, server: ServerProcess) -> None:
        r = httpx.get(f"{server.metrics_url}/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        self.families = {f.name: f for f in text_string_to_metric_families(r.text)}

    def samples(self, family: str, sample: str, **labels: str) -> list[Any]:
        return [
            s
            for s in self.families[family].samples
            if s.name == sample and labels.items() <= s.labels.items()
        ]

    def value(self, family: str, sample: str | None = None, **labels: str) -> float:
        return sum(s.value for s in self.samples(family, sample or family, **labels))


def requests(scrape: Scrape, **labels: str) -> float:
    return scrape.value("scriptserve_requests", "scriptserve_requests_total", **labels)


def test_request_counts_by_model_version_protocol_and_status(server: ServerProcess) -> None:
    before = Scrape(server)
    assert before.families["scriptserve_requests"].type == "counter"
    for _ in range(5):
        assert httpx.post(f"{server.url}/predictions/tiny", json=X.tolist()).status_code == 200
    for _ in range(3):
        r = httpx.post(f"{server.url}/v2/models/tiny_onnx/infer", json=OIP)
        assert r.status_code == 200
    for _ in range(2):
        assert httpx.post(f"{server.url}/predictions/tiny", json=[0.0] * 7).status_code == 400
    assert httpx.post(f"{server.url}/predictions/tiny/9.9", json=X.tolist()).status_code == 404
    assert httpx.post(f"{server.url}/predictions/nope", json=X.tolist()).status_code == 404
    after = Scrape(server)

    def delta(**labels: str) -> float:
        return requests(after, **labels) - requests(before, **labels)

    tiny = {"model": "tiny", "protocol": "rest"}
    assert delta(**tiny, version="1.0", status="200") == 5
    assert delta(**tiny, version="1.0", status="400") == 2
    assert delta(model="tiny_onnx", version="1.0", protocol="rest", status="200") == 3
    assert delta(model="tiny_onnx", status="400") == 0
    assert delta(status="404") == 2
    assert delta(model="tiny", status="404") == 1
    assert delta() == 12
    # A name or version no model has does not become a label: clients cannot mint time series.
    labels = [s.labels for s in after.samples("scriptserve_requests", "scriptserve_requests_total")]
    assert not [lb for lb in labels if lb["model"] == "nope" or lb["version"] == "9.9"]
    assert {"_unknown"} <= {lb["model"] for lb in labels if lb["status"] == "404"}


def test_latency_and_batch_histograms(server: ServerProcess) -> None:
    before = Scrape(server)
    for _ in range(4):
        assert httpx.post(f"{server.url}/predictions/tiny_onnx", json=X.tolist()).is_success
    after = Scrape(server)
    onnx = {"model": "tiny_onnx", "version": "1.0"}
    for name in HISTOGRAMS:
        assert after.families[name].type == "histogram"
        count = after.value(name, f"{name}_count", **onnx)
        # One request at a time: each request is one batch of one.
        assert count - before.value(name, f"{name}_count", **onnx) == 4, name
        buckets = after.samples(name, f"{name}_bucket", **onnx)
        bounds = [float(b.labels["le"]) for b in buckets]
        counts = [b.value for b in buckets]
        assert bounds == sorted(bounds) and bounds[-1] == float("inf"), name
        assert counts == sorted(counts) and counts[-1] == count, name
        assert after.value(name, f"{name}_sum", **onnx) > 0, name
    batch = "scriptserve_batch_size"
    assert (
        after.value(batch, f"{batch}_sum", **onnx) - before.value(batch, f"{batch}_sum", **onnx)
        == 4
    )
    ones = after.samples(batch, f"{batch}_bucket", **onnx, le="1.0")
    assert [s.value for s in ones] == [after.value(batch, f"{batch}_count", **onnx)]
    # The request latency is labelled with the protocol, the worker-side ones are not.
    assert after.samples(HISTOGRAMS[0], f"{HISTOGRAMS[0]}_count", **onnx, protocol="rest")


def test_queue_depth_and_workers_by_state(server: ServerProcess) -> None:
    scrape = Scrape(server)
    assert scrape.families["scriptserve_queue_depth"].type == "gauge"
    assert scrape.families["scriptserve_workers"].type == "gauge"
    for model in ("tiny", "tiny_onnx"):
        labels = {"model": model, "version": "1.0"}
        assert scrape.value("scriptserve_queue_depth", **labels) == 0
        states = {
            s.labels["state"]: s.value
            for s in scrape.samples("scriptserve_workers", "scriptserve_workers", **labels)
        }
        assert set(states) == {"READY", "BUSY"}
        assert states["READY"] + states["BUSY"] == 2  # --workers 2
        assert scrape.value("scriptserve_model_state", **labels, state="READY") == 1


def test_workers_gauge_follows_scaling(server: ServerProcess) -> None:
    url = f"{server.mgmt}/models/tiny"
    try:
        r = httpx.put(
            url,
            headers=server.mgmt_headers,
            params={"min_worker": 3, "synchronous": "true"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        scrape = Scrape(server)
        assert scrape.value("scriptserve_workers", model="tiny", version="1.0") == 3
    finally:
        httpx.put(
            url,
            headers=server.mgmt_headers,
            params={"min_worker": 2, "synchronous": "true"},
            timeout=60,
        )
    assert Scrape(server).value("scriptserve_workers", model="tiny", version="1.0") == 2
