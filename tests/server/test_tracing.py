"""OpenTelemetry tracing against a real server and a real OTLP receiver on loopback: the span
tree of REST and gRPC requests under the client's `traceparent`, the batch span with its size,
request ids and links to the other requests, sampling, the standard OTEL_* variables, and no
tracing by default."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from otlp import GrpcReceiver, HttpReceiver, Span
from serving import ServerProcess
from testmodels import save_torchscript
from tritonclient.grpc import service_pb2, service_pb2_grpc

from scriptserve.archiver.cli import model_archiver_main
from scriptserve.server.observability.tracing import Tracing

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

ROW = [0.5] * 8
# server, decode, queue, batch (preprocess, inference, postprocess), encode
TREE_SPANS = 8
# Spans leave the server every 50 ms instead of every 5 s (a standard OTEL_* variable).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def archive_store(work: Path) -> Path:
    store = work / "store"
    (work / "sample.json").write_text(json.dumps([0.5] * 8))
    argv = [
        "--model-name", "tiny", "--version", "1.0", "--serialized-file",
        str(save_torchscript(work / "tiny.pt")), "--handler", "tensor",
        "--sample-input", str(work / "sample.json"), "--export-path", str(store),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return store


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return archive_store(tmp_path_factory.mktemp("tracing"))


@pytest.fixture(scope="module")
def receiver() -> Iterator[GrpcReceiver]:
    found = GrpcReceiver()
    yield found
    found.stop()


@pytest.fixture(scope="module")
def traced(store: Path, receiver: GrpcReceiver) -> Iterator[ServerProcess]:
    """Tracing every request over OTLP/gRPC; one worker that gathers batches for 100 ms."""
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--max-batch-delay",
        "100",
        "--tracing",
        "--tracing-endpoint",
        receiver.endpoint,
        "--tracing-protocol",
        "grpc",
        "--tracing-service-name",
        "scriptserve-test",
        env=FAST_EXPORT,
    ).start()
    yield proc
    proc.stop()


def new_parent(sampled: bool = True) -> tuple[str, str, str]:
    """A client's traceparent: (header, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


def sampled(traceparent: str) -> bool:
    """The sampled bit of a traceparent's flags (0x02 says the trace id is random)."""
    return bool(int(traceparent.rsplit("-", 1)[1], 16) & 1)


def by_name(spans: list[Span]) -> dict[str, list[Span]]:
    named: dict[str, list[Span]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def within(child: Span, parent: Span) -> bool:
    return parent.start_ns <= child.start_ns <= child.end_ns <= parent.end_ns


def check_request_tree(spans: list[Span], server_name: str, client_span: str) -> Span:
    """The tree one model request makes; returns its server span."""
    named = by_name(spans)
    (root,) = named[server_name]
    assert root.kind == "SERVER" and root.parent_id == client_span
    assert root.attributes["scriptserve.model.name"] == "tiny"
    assert root.attributes["scriptserve.model.version"] == "1.0"
    assert root.resource["service.name"] == "scriptserve-test"
    steps = [named[name][0] for name in ("decode", "queue", "batch", "encode")]
    for step in steps:
        assert step.parent_id == root.span_id and within(step, root), step
    decode, queue, batch, encode = steps
    # One after the other: arrival, queueing, the worker's run, the answer.
    assert decode.end_ns == queue.start_ns <= queue.end_ns <= batch.start_ns
    assert batch.end_ns <= encode.start_ns
    assert batch.attributes["scriptserve.batch.size"] >= 1
    assert batch.attributes["scriptserve.worker.id"] >= 1
    stages = [named[name][0] for name in ("preprocess", "inference", "postprocess")]
    for stage in stages:
        assert stage.parent_id == batch.span_id and within(stage, batch), stage
    assert stages[0].end_ns <= stages[1].start_ns and stages[1].end_ns <= stages[2].start_ns
    return root


def test_rest_request_is_a_span_tree_under_the_clients_traceparent(
    traced: ServerProcess, receiver: GrpcReceiver
) -> None:
    header, trace_id, client_span = new_parent()
    headers = {"traceparent": header, "tracestate": "vendor=a1"}
    reply = httpx.post(f"{traced.url}/predictions/tiny", json=ROW, headers=headers)
    assert reply.status_code == 200
    version, returned_trace, returned_span, _ = reply.headers["traceparent"].split("-")
    assert (version, returned_trace) == ("00", trace_id) and sampled(reply.headers["traceparent"])
    assert returned_span != client_span

    spans = receiver.trace(trace_id, TREE_SPANS)
    root = check_request_tree(spans, "POST /predictions/{model_name}", client_span)
    assert root.span_id == returned_span
    assert root.attributes["http.request.method"] == "POST"
    assert root.attributes["http.route"] == "/predictions/{model_name}"
    assert root.attributes["url.path"] == "/predictions/tiny"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["client.address"] == "127.0.0.1"
    assert root.status_code == 0  # not an error
    assert {s.trace_state for s in spans} == {"vendor=a1"}  # the client's, passed on


def test_grpc_call_is_a_span_tree_under_the_clients_traceparent(
    traced: ServerProcess, receiver: GrpcReceiver
) -> None:
    header, trace_id, client_span = new_parent()
    request = service_pb2.ModelInferRequest(model_name="tiny", id="g1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[1, 8])
    tensor.contents.fp32_contents.extend([0.5] * 8)
    with grpc.insecure_channel(traced.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        _, call = stub.ModelInfer.with_call(
            request, metadata=(("traceparent", header),), timeout=30
        )
    returned = dict(call.initial_metadata())["traceparent"]
    assert returned.split("-")[1] == trace_id

    spans = receiver.trace(trace_id, TREE_SPANS)
    root = check_request_tree(spans, "inference.GRPCInferenceService/ModelInfer", client_span)
    assert root.span_id == returned.split("-")[2]
    assert root.attributes["rpc.system"] == "grpc"
    assert root.attributes["rpc.service"] == "inference.GRPCInferenceService"
    assert root.attributes["rpc.method"] == "ModelInfer"
    assert root.attributes["rpc.grpc.status_code"] == 0
    (batch,) = by_name(spans)["batch"]
    assert batch.attributes["scriptserve.request.id"] == "g1"


def test_a_batch_names_its_requests_and_links_to_their_spans(
    traced: ServerProcess, receiver: GrpcReceiver
) -> None:
    """Requests sent together run as one batch (one worker gathering for 100 ms): each
    request's batch span says how big the batch was, which requests were in it, and links to
    the other requests' server spans."""
    count = 6
    parents = [new_parent() for _ in range(count)]
    start = threading.Barrier(count)
    statuses: list[int] = []

    def send(i: int) -> None:
        headers = {"traceparent": parents[i][0], "X-Request-Id": f"batched-{i}"}
        start.wait()
        reply = httpx.post(f"{traced.url}/predictions/tiny", json=ROW, headers=headers)
        statuses.append(reply.status_code)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert statuses == [200] * count

    trace_ids = {trace_id for _, trace_id, _ in parents}
    spans = receiver.wait_for(
        lambda all_: sum(s.trace_id in trace_ids and s.name == "encode" for s in all_) >= count
    )
    roots = {s.trace_id: s for s in spans if s.trace_id in trace_ids and s.kind == "SERVER"}
    batches = [s for s in spans if s.trace_id in trace_ids and s.name == "batch"]
    assert len(roots) == count and len(batches) == count
    biggest = max(b.attributes["scriptserve.batch.size"] for b in batches)
    assert biggest >= 2, "no two of six requests sent together were batched"
    for batch in batches:
        size = batch.attributes["scriptserve.batch.size"]
        ids = batch.attributes["scriptserve.batch.request_ids"]
        assert len(ids) == size and batch.attributes["scriptserve.request.id"] in ids
        assert len(batch.links) == size - 1
        for link_trace, link_span, link_attributes in batch.links:
            assert roots[link_trace].span_id == link_span  # the other request's server span
            assert link_attributes["scriptserve.request.id"] in ids
            assert (
                link_attributes["scriptserve.request.id"]
                != batch.attributes["scriptserve.request.id"]
            )


def test_client_errors_are_traced_but_not_errors(
    traced: ServerProcess, receiver: GrpcReceiver
) -> None:
    header, trace_id, _ = new_parent()
    reply = httpx.post(f"{traced.url}/predictions/nope", json=ROW, headers={"traceparent": header})
    assert reply.status_code == 404
    (root,) = [s for s in receiver.trace(trace_id, 1) if s.kind == "SERVER"]
    assert root.attributes["http.response.status_code"] == 404
    assert root.status_code == 0  # a client's mistake is not the server's error
    names = {s.name for s in receiver.trace(trace_id, 1)}
    assert not names & {"queue", "batch"}  # never queued


def test_a_parent_that_is_not_sampled_is_followed(
    traced: ServerProcess, receiver: GrpcReceiver
) -> None:
    unsampled, unsampled_id, _ = new_parent(sampled=False)
    reply = httpx.post(
        f"{traced.url}/predictions/tiny", json=ROW, headers={"traceparent": unsampled}
    )
    assert reply.status_code == 200
    assert reply.headers["traceparent"].split("-")[1] == unsampled_id
    assert not sampled(reply.headers["traceparent"])
    # A sampled request after it: once its spans are here, the first's would be too.
    later, sampled_id, _ = new_parent()
    httpx.post(f"{traced.url}/predictions/tiny", json=ROW, headers={"traceparent": later})
    receiver.trace(sampled_id, TREE_SPANS)
    assert not [s for s in receiver.spans if s.trace_id == unsampled_id]


def test_otel_variables_choose_exporter_sampler_and_service(store: Path) -> None:
    """OTLP over HTTP, the service name and a parent-based ratio sampler, all from OTEL_*: a
    request without a parent is sampled at ratio 0 (never), one whose parent was sampled is."""
    receiver = HttpReceiver()
    env = {
        **FAST_EXPORT,
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "fleet-a",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
    }
    proc = ServerProcess(store, "--workers", "1", "--tracing", env=env).start()
    try:
        orphan = httpx.post(f"{proc.url}/predictions/tiny", json=ROW)
        assert orphan.status_code == 200 and not sampled(orphan.headers["traceparent"])
        header, trace_id, _ = new_parent()
        reply = httpx.post(
            f"{proc.url}/predictions/tiny", json=ROW, headers={"traceparent": header}
        )
        assert reply.status_code == 200
        spans = receiver.trace(trace_id, TREE_SPANS)
    finally:
        proc.stop()
        receiver.stop()
    assert {s.resource["service.name"] for s in spans} == {"fleet-a"}
    orphan_id = orphan.headers["traceparent"].split("-")[1]
    assert not [s for s in receiver.spans if s.trace_id == orphan_id]


def test_the_sampling_ratio_samples_roots_and_follows_clients(store: Path) -> None:
    """`--tracing-sampling-ratio` samples requests without a traceparent at that ratio (the ones
    left out are never recorded, and their answers carry no traceparent), and a client's
    sampled parent is followed whatever the ratio. The exporter process stops with the
    server."""
    receiver = GrpcReceiver()
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--tracing",
        "--tracing-endpoint",
        receiver.endpoint,
        "--tracing-protocol",
        "grpc",
        "--tracing-sampling-ratio",
        "0.25",
        env=FAST_EXPORT,
    ).start()
    try:
        with httpx.Client() as client:
            roots = [
                client.post(f"{proc.url}/predictions/tiny", json=ROW).headers.get("traceparent")
                for _ in range(160)
            ]
            followed = []
            for _ in range(8):
                header, trace_id, _ = new_parent()
                reply = client.post(
                    f"{proc.url}/predictions/tiny", json=ROW, headers={"traceparent": header}
                )
                assert sampled(reply.headers["traceparent"])
                followed.append(trace_id)
        request = service_pb2.ModelInferRequest(model_name="tiny")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 8]).contents.fp32_contents.extend(
            ROW
        )
        with grpc.insecure_channel(proc.grpc) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for _ in range(40):
                _, call = stub.ModelInfer.with_call(request, timeout=30)
                roots.append(dict(call.initial_metadata()).get("traceparent"))
        kept_headers = [header for header in roots if header is not None]
        assert all(sampled(header) for header in kept_headers)  # a root kept is sampled
        kept = [header.split("-")[1] for header in kept_headers]
        assert len(set(kept)) == len(kept)  # each root a trace of its own
        # 200 roots at 0.25: 50 expected, a standard deviation of 6.1.
        assert 20 <= len(kept) <= 80, len(kept)
        for trace_id in [*followed, *kept]:
            receiver.trace(trace_id, TREE_SPANS)
        # the roots left out are recorded nowhere: every inference span is of a trace kept or
        # followed (the server's health checks at its start are roots of their own)
        inference = ("POST /predictions/{model_name}", "inference.GRPCInferenceService/ModelInfer")
        served = {s.trace_id for s in receiver.spans if s.kind == "SERVER" and s.name in inference}
        assert served == {*followed, *kept}
        assert proc.proc is not None
        (exporter,) = [
            child
            for child in psutil.Process(proc.proc.pid).children()
            if "scriptserve.server.observability.span_export" in child.cmdline()
        ]
    finally:
        proc.stop()
        receiver.stop()
    # The spans' exporter process ends with the server.
    assert not exporter.is_running() or exporter.status() == psutil.STATUS_ZOMBIE


def test_at_ratio_0_only_a_clients_trace_context_is_traced(store: Path) -> None:
    """At a sampling ratio of 0 a request without trace context is answered with no
    `traceparent` and recorded nowhere, whatever other observed header it carries (the HTTP
    protocol skips the observation of a request with none of them); a client's sampled parent
    is followed, and an unsampled one is answered with the server span's unsampled
    `traceparent`."""
    receiver = GrpcReceiver()
    proc = ServerProcess(
        store,
        "--workers",
        "1",
        "--tracing",
        "--tracing-endpoint",
        receiver.endpoint,
        "--tracing-protocol",
        "grpc",
        "--tracing-sampling-ratio",
        "0",
        env=FAST_EXPORT,
    ).start()
    url = f"{proc.url}/predictions/tiny"
    try:
        with httpx.Client() as client:
            for headers in ({}, {"X-Request-Id": "bare-1"}, {"X-Forwarded-For": "10.0.0.9"}):
                for _ in range(10):
                    reply = client.post(url, json=ROW, headers=headers)
                    assert reply.status_code == 200 and "traceparent" not in reply.headers
            unsampled, unsampled_id, _ = new_parent(sampled=False)
            reply = client.post(url, json=ROW, headers={"traceparent": unsampled})
            assert reply.headers["traceparent"].split("-")[1] == unsampled_id
            assert not sampled(reply.headers["traceparent"])
            parent, trace_id, span_id = new_parent()
            reply = client.post(url, json=ROW, headers={"traceparent": parent})
            assert sampled(reply.headers["traceparent"])
        spans = receiver.trace(trace_id, TREE_SPANS)
        (server_span,) = [s for s in spans if s.kind == "SERVER"]
        assert server_span.parent_id == span_id
        route = "POST /predictions/{model_name}"
        assert {s.trace_id for s in receiver.spans if s.name == route} == {trace_id}
    finally:
        proc.stop()
        receiver.stop()


def test_tracing_is_off_by_default(server: ServerProcess) -> None:
    reply = httpx.post(f"{server.url}/predictions/tiny", json=ROW)
    assert reply.status_code == 200 and "traceparent" not in reply.headers
    assert not Tracing().enabled


def test_tracing_without_the_sdk_says_what_to_install(tmp_path: Path) -> None:
    """Without the OpenTelemetry SDK the server refuses to start with what to install (the
    SDK's modules are made unimportable in that process only)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['opentelemetry.sdk'] = None\n"
        "from scriptserve.server.observability.tracing import Tracing, TracingUnavailable\n"
        "try:\n    Tracing(True)\nexcept TracingUnavailable as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'scriptserve[tracing]'" in out.stdout
