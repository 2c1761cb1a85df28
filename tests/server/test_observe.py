"""What the inference routes keep of a request (server/rest/observe.py `Observers.observe`): of
a request that tracing alone would see and its sampling ratio leaves out, nothing (no
observation, no `traceparent` in its answer); every other request is observed, and the ratio is
drawn once per request.

The tracer is a real one (its exporter pointed at a port nothing listens on); the spans of the
sampled requests are never ended, so nothing is exported.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator

import pytest

from scriptserve.server.observability.access_log import AccessLog
from scriptserve.server.observability.tracing import Tracing
from scriptserve.server.rest.observe import Observation, Observers, observed_headers

HEADERS = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
OBSERVED: list[tuple[bytes, bytes]] = []
"""What the HTTP protocol gives `observe` of HEADERS: none of them is one an observation reads."""
PARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PEER = ("127.0.0.1", 50000)


def scope() -> dict[str, object]:
    return {"type": "http", "method": "POST", "path": "/predictions/m", "headers": HEADERS}


def tracer(ratio: float | None) -> Tracing:
    """Roots sampled at `ratio` (None: the SDK's sampler decides)."""
    return Tracing(True, endpoint="http://127.0.0.1:9", protocol="grpc", sampling_ratio=ratio)


@pytest.fixture
def never() -> Iterator[Tracing]:
    tracing = tracer(0.0)
    yield tracing
    tracing.close(timeout_s=0.1)


def test_nothing_is_kept_of_a_left_out_request(never: Tracing) -> None:
    observers = Observers(AccessLog(), never)
    kept = [observers.observe("POST", "/predictions/m", OBSERVED, PEER, scope) for _ in range(50)]
    assert kept == [None] * 50


def test_the_ratio_is_drawn_once_per_request() -> None:
    """At 0.5, about half the roots are observed and sampled: drawing again for the ones kept
    would sample a quarter."""
    tracing = tracer(0.5)
    try:
        observers = Observers(AccessLog(), tracing)
        sampled = 0
        for _ in range(400):
            observation = observers.observe("POST", "/p", OBSERVED, PEER, scope)
            if observation is not None:
                assert observation.trace is not None and observation.trace.recording
                sampled += 1
        # 400 draws at 0.5: 200 expected, a standard deviation of 10
        assert 150 <= sampled <= 250, sampled
    finally:
        tracing.close(timeout_s=0.1)


def test_a_request_someone_records_is_observed(never: Tracing) -> None:
    def observed(observers: Observers, headers: list[tuple[bytes, bytes]] = OBSERVED) -> bool:
        return isinstance(observers.observe("POST", "/p", headers, PEER, scope), Observation)

    # the client's own trace context: followed (its parent may be sampled)
    for name in (b"traceparent", b"tracestate"):
        assert observed(Observers(AccessLog(), never), [(name, PARENT)])
    # the access log writes a line for every request, sampled or not
    access = AccessLog("stderr")
    try:
        assert observed(Observers(access, never))
    finally:
        access.close()
    # the SDK's own sampler (no ratio of the server's): every root goes to it
    sdk = tracer(None)
    try:
        assert observed(Observers(AccessLog(), sdk))
    finally:
        sdk.close(timeout_s=0.1)


def test_ratio_only_lets_the_protocol_count_left_out_requests_down(never: Tracing) -> None:
    """`ratio_only` lets the HTTP protocol count a request with none of the observed headers
    down itself (`Tracing.roots_left_out`) in place of calling `observe`: only while tracing
    alone is on at a ratio of the server's. At ratio 0 the count never ends."""
    observers = Observers(AccessLog(), never)
    assert observers.ratio_only and never.roots_left_out == sys.maxsize
    assert observers.observe("POST", "/p", OBSERVED, PEER, scope) is None
    assert never.roots_left_out == sys.maxsize - 1  # `observe` counts down the same count
    half, sdk = tracer(0.5), tracer(None)
    access = AccessLog("stderr")
    try:
        assert Observers(AccessLog(), half).ratio_only
        assert not Observers(access, never).ratio_only  # every request has its line
        assert not Observers(AccessLog(), sdk).ratio_only and sdk.roots_left_out == 0
        off = Tracing()
        assert not Observers(AccessLog(), off).ratio_only and not off.enabled
    finally:
        access.close()
        half.close(timeout_s=0.1)
        sdk.close(timeout_s=0.1)


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 0.9])
def test_the_ratio_drawn_in_advance_keeps_each_root_at_the_ratio(ratio: float) -> None:
    """The gaps between kept roots are geometric (one draw a kept root, not one a root): the
    share kept is the ratio, and a root is kept as often right after a kept one as anywhere
    (the draws of a request do not depend on the one before)."""
    tracing = tracer(ratio)
    try:
        draws = 40_000
        kept = [not tracing.leaves_out_root() for _ in range(draws)]
        # a binomial count: within 5 standard deviations of the ratio's expectation
        spread = 5 * math.sqrt(draws * ratio * (1 - ratio))
        assert abs(sum(kept) - draws * ratio) <= spread, (sum(kept), draws * ratio)
        after_kept = [b for a, b in itertools.pairwise(kept) if a]
        spread = 5 * math.sqrt(ratio * (1 - ratio) / len(after_kept))
        assert abs(sum(after_kept) / len(after_kept) - ratio) <= spread
    finally:
        tracing.close(timeout_s=0.1)


def test_ratio_1_keeps_every_root() -> None:
    always = tracer(1.0)
    try:
        assert not any(always.leaves_out_root() for _ in range(100))
        assert always.roots_left_out == 0
    finally:
        always.close(timeout_s=0.1)


def test_an_observation_reads_only_the_headers_it_names() -> None:
    """The ASGI layer's pick (the HTTP protocol picks the same names in its own loop over the
    head): the request id, the client's trace context and the forwarding headers."""
    forwarded = [(b"x-forwarded-for", b"10.0.0.7"), (b"x-forwarded-proto", b"https")]
    given = [(b"x-request-id", b"abc"), (b"traceparent", PARENT), *forwarded]
    assert observed_headers([*HEADERS, *given, (b"user-agent", b"wrk")]) == given
    assert observed_headers(HEADERS) == OBSERVED
