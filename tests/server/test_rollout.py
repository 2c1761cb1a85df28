"""A rolling restart behind haproxy loses no request: two replicas under steady load, each in
turn sent SIGTERM and started again (benchmarks/rollout/ with short phases)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import ArchiveFactory

# `benchmarks` is found from the repository root, which `python -m pytest` (`make test`, .ci/run)
# puts on sys.path.
from benchmarks.rollout.haproxy import NO_HAPROXY, haproxy_path
from benchmarks.rollout.scenario import rollout

# Slow: a rolling restart of two replicas under load.
pytestmark = pytest.mark.slow


def test_rolling_restart_answers_every_request(
    torchscript_file: Path, make_archive: ArchiveFactory, sample_file: Path, tmp_path: Path
) -> None:
    if haproxy_path() is None:
        # CI installs haproxy (.ci/run): there the test must run, not skip.
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(NO_HAPROXY)
    make_archive(torchscript_file)
    result = rollout(
        tmp_path / "store",
        "tiny",
        sample_file.read_bytes(),
        replicas=2,
        warm_s=0.5,
        phase_s=1.5,
        connections=8,
        server_args=("--no-warmup",),
    )

    problems = [o for o in result.outcomes if o.kind != "succeeded"][:10]
    assert result.counts["failed"] == 0, problems
    assert result.counts["unanswered"] == 0, problems
    assert result.counts["succeeded"] == result.counts["total"] > 0
    assert [e.replica for e in result.restarts] == ["r1", "r2"]
    for event in result.restarts:
        assert event.exit_code == 0
        # haproxy marked it DOWN after the signal, and UP again once the new process was ready.
        assert event.sigterm_s < event.marked_down_s < event.up_s
        assert event.answered_before > 0, f"{event.replica} served nothing before its restart"
        assert event.answered_after > 0, f"{event.replica} served nothing after its restart"
    # Every second of the run answered requests: the other replica carried each restart.
    assert min(result.series) > 0, result.series
