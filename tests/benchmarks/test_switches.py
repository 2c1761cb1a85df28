"""What a run of benchmarks/switches.py says of the switches' targets: a ratio counts only as far
as the run's control (both off against both off) is from 1."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.switches import TARGETS, verdict

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_a_ratio_shows_a_target_only_by_more_than_the_runs_noise() -> None:
    assert verdict(1.0, 1.0, 0.99) == "met"  # a quiet run: the ratio is the figure
    assert verdict(0.99, 1.0, 0.99) == "met"
    assert verdict(0.98, 1.0, 0.99) == "not met"
    assert verdict(1.00, 1.02, 0.99) == "not decided"  # within the control's 0.02 of it
    assert verdict(0.975, 0.98, 0.99) == "not decided"
    assert verdict(0.96, 0.98, 0.99) == "not met"
    assert verdict(1.02, 0.98, 0.99) == "met"


def _verdicts(name: str) -> dict[str, str]:
    """The verdicts of a recorded run, from its per-round ratios and control."""
    run = json.loads((RESULTS / name).read_text())
    control = statistics.median(run["control_off_again_to_off"])
    return {
        label: verdict(statistics.median(ratios), control, TARGETS[label])
        for label, ratios in run["ratios_to_both_off"].items()
        if label in TARGETS
    }


def test_the_recorded_runs_say_what_the_issue_notes_say_of_them() -> None:
    # The Xeon's run of 2026-12-01 (control 1.025): the plain access log's 0.910 misses 0.95 by
    # more than the noise; tracing's 0.957 and 0.997 are within it of 0.97 and 0.99.
    xeon = _verdicts("switches-2026-12-01T214745.json")
    assert xeon["access-log-plain"] == "not met" and xeon["access-log"] == "not met"
    assert xeon["tracing-0.01"] == "not decided" and xeon["tracing-0"] == "not decided"
    # The AMD EPYC's of 2026-12-02 (control 0.873): the access log's 0.906 is not decided.
    assert _verdicts("switches-2026-12-02T004247.json")["access-log-plain"] == "not decided"
