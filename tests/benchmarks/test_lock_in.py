"""benchmarks/lock_in.py: the switch a signal sets in a server's HTTP observers, and how the
windows of the two states are ordered and paired."""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.lock_in import OFF, ON, install, noise, orders, pair_ratios, set_switch
from benchmarks.switches import TARGETS, verdict
from scriptserve.server.observability.access_log import AccessLog
from scriptserve.server.observability.tracing import Tracing
from scriptserve.server.rest import observe
from scriptserve.server.rest.observe import Observers

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.fixture
def access(tmp_path: Path) -> Iterator[AccessLog]:
    log = AccessLog(str(tmp_path / "access.log"))
    yield log
    log.close()


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    traced = Tracing(True, endpoint="http://127.0.0.1:9", protocol="grpc", sampling_ratio=0.0)
    yield traced
    traced.close()


def test_each_pair_is_on_then_off_or_off_then_on_at_random() -> None:
    states = orders(200, seed=7)
    pairs = [tuple(states[k : k + 2]) for k in range(0, len(states), 2)]
    assert set(pairs) == {(True, False), (False, True)}
    first_on = sum(pair == (True, False) for pair in pairs)
    assert 70 < first_on < 130  # about half each way
    assert orders(200, seed=7) == states  # the seed decides the order
    assert orders(200, seed=8) != states


def test_each_pair_gives_its_window_on_against_its_window_off() -> None:
    assert pair_ratios([True, False, False, True], [90, 100, 100, 95]) == [0.9, 0.95]
    # A steady drift within the pairs cancels over pairs of both orders.
    states = [True, False, False, True]
    ratios = pair_ratios(states, [100, 110, 120, 130])
    assert ratios[0] * ratios[1] == pytest.approx(100 / 110 * 130 / 120)
    assert pair_ratios([True], [1.0]) == []  # a window without its pair's other


def test_the_access_log_switch_turns_the_observers_off_and_on(access: AccessLog) -> None:
    observers = Observers(access, Tracing(False))
    assert observers.enabled and observers.access.enabled
    set_switch(observers, "access-log-plain", False)
    assert not observers.enabled and not observers.access.enabled
    set_switch(observers, "access-log-plain", False)  # off stays off
    assert not observers.enabled
    set_switch(observers, "access-log-plain", True)
    assert observers.enabled and observers.access.enabled
    assert not observers.ratio_only


def test_the_tracing_switch_leaves_the_ratio_shortcut_only_while_tracing_is_on(
    tracing: Tracing,
) -> None:
    observers = Observers(AccessLog("off"), tracing)
    assert observers.enabled and observers.ratio_only
    set_switch(observers, "tracing-0", False)
    assert not observers.enabled and not observers.ratio_only and not tracing.enabled
    set_switch(observers, "tracing-0", True)
    assert observers.enabled and observers.ratio_only and tracing.enabled


def test_the_control_flips_nothing(access: AccessLog) -> None:
    observers = Observers(access, Tracing(False))
    set_switch(observers, "control", False)
    assert observers.enabled and observers.access.enabled


def test_the_signals_set_every_observers_the_server_made(
    access: AccessLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(observe.Observers, "__init__", observe.Observers.__init__)
    previous = signal.getsignal(ON), signal.getsignal(OFF)
    try:
        made = install("access-log-plain")
        observers = Observers(access, Tracing(False))
        assert made == [observers]
        os.kill(os.getpid(), OFF)  # handled before the next bytecode runs
        assert not observers.enabled
        os.kill(os.getpid(), OFF)
        assert not observers.enabled
        os.kill(os.getpid(), ON)
        assert observers.enabled
    finally:
        signal.signal(ON, previous[0])
        signal.signal(OFF, previous[1])


def test_a_busy_calibration_spins_on_the_loop_only_while_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from scriptserve.server.rest.protocol_cycle import ProtocolCycle

    calls: list[ProtocolCycle] = []
    monkeypatch.setattr(observe.Observers, "__init__", observe.Observers.__init__)

    def complete(self: ProtocolCycle) -> None:
        calls.append(self)

    monkeypatch.setattr(ProtocolCycle, "_complete", complete)
    previous = signal.getsignal(ON), signal.getsignal(OFF)
    try:
        install("busy-2000us")
        cycle = object.__new__(ProtocolCycle)

        def timed() -> float:
            started = time.perf_counter()
            ProtocolCycle._complete(cycle)
            return time.perf_counter() - started

        assert timed() >= 0.002  # on: 2 ms spun before the answer's own end
        os.kill(os.getpid(), OFF)
        assert timed() < 0.002
        os.kill(os.getpid(), ON)
        assert timed() >= 0.002
        assert calls == [cycle, cycle, cycle]  # the answer's end runs either way
    finally:
        signal.signal(ON, previous[0])
        signal.signal(OFF, previous[1])


def test_a_target_is_decided_only_beyond_the_control_and_twice_the_standard_error() -> None:
    assert noise(0.997, 0.0093) == pytest.approx(0.0186)  # the standard error's is more
    assert noise(1.03, 0.01) == pytest.approx(0.03)  # the control's is more
    assert noise(0.98, 0.001) == pytest.approx(0.02)


def _verdicts(name: str) -> dict[str, str]:
    """The verdicts of a recorded run, from its windows."""
    run = json.loads((RESULTS / name).read_text())

    def ratios(switch: str) -> list[float]:
        windows = run["windows"][switch]
        return pair_ratios(windows["states"], windows["req_s"])

    control = statistics.median(ratios("control"))
    found = {}
    for switch in run["windows"]:
        if switch in TARGETS:
            own = ratios(switch)
            error = statistics.stdev(own) / len(own) ** 0.5
            found[switch] = verdict(
                statistics.median(own), 1 + noise(control, error), TARGETS[switch]
            )
    return found


def test_the_recorded_run_says_what_the_issue_notes_say_of_it() -> None:
    # The AMD EPYC's run of 2026-12-02 (control 1.023, each switch's standard error 0.01-0.015):
    # the access log's 0.896 misses 0.95; tracing's 0.945 and 0.976 are within the noise of
    # 0.97 and 0.99.
    assert _verdicts("lock_in-2026-12-02T150831.json") == {
        "access-log-plain": "not met",
        "tracing-0.01": "not decided",
        "tracing-0": "not decided",
    }


def test_the_longer_tracing_run_decides_ratio_0() -> None:
    # 300 pairs a switch (control 0.993, standard errors 0.007): ratio 0's 0.968 misses 0.99;
    # 0.01's 0.966 is within twice its standard error of 0.97.
    assert _verdicts("lock_in-2026-12-02T155426.json") == {
        "tracing-0.01": "not decided",
        "tracing-0": "not met",
    }


def test_the_xeon_run_after_one_header_loop() -> None:
    # Intel Xeon with AMX, 300 pairs a switch, after the HTTP protocol picked the observed
    # headers in its own loop (control 1.002, standard errors 0.007-0.009): the access log's
    # 0.931 and tracing at 0.01's 0.949 miss their targets; ratio 0's 0.979 is within the
    # noise of 0.99.
    assert _verdicts("lock_in-2026-12-03T101800.json") == {
        "access-log-plain": "not met",
        "tracing-0.01": "not met",
        "tracing-0": "not decided",
    }


def test_the_epyc_run_after_the_lighter_record() -> None:
    # AMD EPYC (Zen 4), 300 pairs a switch, after the access record kept only its own fields
    # and the plain lines their escaped start (control 1.008, standard errors 0.008): the access
    # log's 0.931 misses 0.95; tracing at 0.01's 0.955 is within the noise of 0.97.
    assert _verdicts("lock_in-2026-12-04T010320.json") == {
        "access-log-plain": "not met",
        "tracing-0.01": "not decided",
    }


def test_the_epyc_run_of_ratio_0() -> None:
    # AMD EPYC (Zen 4), 300 pairs (control 1.007, standard error 0.008): ratio 0's 0.966 misses
    # 0.99, as on this CPU before (0.968).
    assert _verdicts("lock_in-2026-12-04T022337.json") == {"tracing-0": "not met"}


def test_the_epyc_run_after_left_out_roots_lost_their_traceparent() -> None:
    # AMD EPYC (Zen 4), 300 pairs a switch, once a root left out got no traceparent of its own
    # (control 0.999, standard errors 0.009-0.010): ratio 0's 0.979 and 0.01's 0.975 are both
    # within the noise of their targets, 0.99 and 0.97.
    assert _verdicts("lock_in-2026-12-04T035512.json") == {
        "tracing-0": "not decided",
        "tracing-0.01": "not decided",
    }


def test_the_epyc_run_after_four_calls_fewer() -> None:
    # AMD EPYC (Zen 4), 200 pairs a switch, after the observation made four calls fewer on the
    # loop and ratio 0 skipped requests without observed headers (control 1.008, standard
    # errors 0.009-0.010): the access log's 0.926 misses 0.95; ratio 0's 0.994 is above 0.99
    # but within the run's noise of it.
    assert _verdicts("lock_in-2026-12-04T050154.json") == {
        "access-log-plain": "not met",
        "tracing-0": "not decided",
    }


def test_the_epyc_run_at_thirteen_thousand_requests_a_second() -> None:
    # AMD EPYC (Zen 4), 200 pairs a switch, at f534379, the machine quiet enough for 11,000-13,000
    # req/s (control 1.005, standard errors 0.005-0.006): ratio 0's 1.004 clears 0.99 by more
    # than the noise (0.012); the access log's 0.904 and tracing at 0.01's 0.952 miss theirs.
    assert _verdicts("lock_in-2026-12-04T205657.json") == {
        "access-log-plain": "not met",
        "tracing-0.01": "not met",
        "tracing-0": "met",
    }


def test_the_access_log_before_its_three_calls() -> None:
    # The tree before f534379 (9289eb7), right after the run above on the same machine: 0.904
    # again (control 0.994), so the three calls f534379 took out did not show.
    assert _verdicts("lock_in-2026-12-04T212705-before-at-9289eb7.json") == {
        "access-log-plain": "not met",
    }


def test_the_epyc_run_with_the_draws_made_in_advance() -> None:
    # 610a7bc (one geometric gap between kept roots) right after the two runs above: ratio 0.01
    # at 0.943 misses 0.97 as before; ratio 0's 1.002 is within its noise (0.012) of 0.99.
    assert _verdicts("lock_in-2026-12-04T214546.json") == {
        "tracing-0.01": "not met",
        "tracing-0": "not decided",
    }
