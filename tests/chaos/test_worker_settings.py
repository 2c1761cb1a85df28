"""Where a model's worker mode comes from: server default < archive config < registration."""

from __future__ import annotations

import pytest

from scriptserve.server.settings import ModelSettings, load_settings


def test_worker_mode_defaults_to_thread_and_follows_the_server_setting() -> None:
    assert ModelSettings.resolve(load_settings(), {}).worker_mode == "thread"
    server = load_settings(worker_mode="process")
    assert ModelSettings.resolve(server, {}).worker_mode == "process"


@pytest.mark.parametrize("key", ["workerMode", "worker_mode"])
def test_archive_config_and_registration_choose_the_worker_mode(key: str) -> None:
    server = load_settings()
    assert ModelSettings.resolve(server, {key: "process"}).worker_mode == "process"
    overrides = {"worker_mode": "thread"}
    assert ModelSettings.resolve(server, {key: "process"}, overrides).worker_mode == "thread"


def test_an_unknown_worker_mode_is_refused_with_what_to_use() -> None:
    with pytest.raises(
        ValueError, match="worker_mode must be 'thread' or 'process' \\(got 'fork'\\)"
    ):
        ModelSettings.resolve(load_settings(), {"workerMode": "fork"})
    with pytest.raises(ValueError, match="worker_mode"):
        load_settings(worker_mode="fork")
