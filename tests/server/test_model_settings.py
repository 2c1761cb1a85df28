"""Per-model settings: server < server's model_defaults < archive config < registration, under
TorchServe's model-config names, validated with one-line errors; maxWorkers bounds scaling."""

from __future__ import annotations

import json
import os

import pytest

from scriptserve.server.models.model_settings import ModelSettings, ModelSettingsError
from scriptserve.server.settings import ServerSettings, load_settings


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SCRIPTSERVE_* variable of the machine running the tests leaks into these."""
    for name in list(os.environ):
        if name.startswith("SCRIPTSERVE_"):
            monkeypatch.delenv(name)


def server_settings(**values: object) -> ServerSettings:
    base: dict[str, object] = {
        "max_batch_size": 32, "max_batch_delay_ms": 0.0, "workers_per_model": 2,
        "response_timeout_s": 120.0, "queue_size": 1000,
    }  # fmt: skip
    return load_settings(**{**base, **values})


def test_model_settings_start_from_the_server_defaults() -> None:
    m = ModelSettings.resolve(server_settings(), {})
    assert m == ModelSettings(
        batch_size=32, max_batch_delay_ms=0.0, workers=2, response_timeout_s=120.0, queue_size=1000
    )


def test_default_workers_follow_cores_and_gpus() -> None:
    s = load_settings(intra_op_threads=1)
    assert ModelSettings.resolve(s, {}).workers == max(1, os.cpu_count() or 1)
    assert ModelSettings.resolve(s, {}, gpus=3).workers == 3


@pytest.mark.parametrize(
    ("key", "value", "field", "expected"),
    [
        ("batchSize", 8, "batch_size", 8),
        ("maxBatchDelay", 50, "max_batch_delay_ms", 50.0),
        ("minWorkers", 3, "workers", 3),
        ("maxWorkers", 9, "max_workers", 9),
        ("responseTimeout", 10, "response_timeout_s", 10.0),
        ("jobQueueSize", 7, "queue_size", 7),
        ("deviceType", "GPU", "device_type", "gpu"),
        ("deviceIds", [0, 2], "device_ids", (0, 2)),
        ("deviceIds", "0, 2", "device_ids", (0, 2)),
        ("workerMode", "process", "worker_mode", "process"),
        ("worker_mode", "process", "worker_mode", "process"),
        ("batchSize", "16", "batch_size", 16),  # YAML written with quotes
        ("warmupRuns", 5, "warmup_runs", 5),
        ("warmupRuns", 0, "warmup_runs", 0),
    ],
)
def test_each_torchserve_model_config_key_sets_its_setting(
    key: str, value: object, field: str, expected: object
) -> None:
    m = ModelSettings.resolve(server_settings(), {key: value})
    assert getattr(m, field) == expected


def test_archive_config_overrides_the_server_and_registration_overrides_both() -> None:
    archive = {
        "batchSize": 8, "maxBatchDelay": 50, "minWorkers": 3, "responseTimeout": 10,
        "jobQueueSize": 7, "maxWorkers": 9, "deviceType": "cpu",
        # Not model settings, whatever they look like: the handler's own keys, ignored here.
        "startupTimeout": 5, "threshold": 0.5, "batch_size": 2, "workers": 5,
    }  # fmt: skip
    m = ModelSettings.resolve(server_settings(), archive)
    assert m == ModelSettings(
        batch_size=8,
        max_batch_delay_ms=50.0,
        workers=3,
        response_timeout_s=10.0,
        queue_size=7,
        max_workers=9,
        device_type="cpu",
    )
    m = ModelSettings.resolve(
        server_settings(), archive, {"batch_size": 4, "workers": None, "queue_size": 99}
    )
    assert (m.batch_size, m.workers, m.queue_size) == (4, 3, 99)  # None: not given


def test_the_servers_model_defaults_rank_between_server_and_archive() -> None:
    server = server_settings(
        model_defaults={
            "m": {"*": {"batchSize": 4, "jobQueueSize": 5}, "2.0": {"batchSize": 6}},
        }
    )
    assert server.model_config_defaults("m", "1.0") == {"batchSize": 4, "jobQueueSize": 5}
    defaults = server.model_config_defaults("m", "2.0")
    m = ModelSettings.resolve(server, {}, defaults=defaults)
    assert (m.batch_size, m.queue_size, m.max_batch_delay_ms) == (6, 5, 0.0)
    m = ModelSettings.resolve(server, {"jobQueueSize": 9}, defaults=defaults)
    assert (m.batch_size, m.queue_size) == (6, 9)
    m = ModelSettings.resolve(server, {"jobQueueSize": 9}, {"batch_size": 2}, defaults=defaults)
    assert (m.batch_size, m.queue_size) == (2, 9)


def test_a_handler_that_cannot_batch_gets_batch_size_one() -> None:
    m = ModelSettings.resolve(
        server_settings(), {"batchSize": 8}, {"batch_size": 16}, batching=False
    )
    assert m.batch_size == 1


@pytest.mark.parametrize(
    ("archive", "overrides", "message"),
    [
        ({"batchSize": 0}, {}, "batchSize: batch_size must be greater than or equal to 1 (got 0)"),
        ({}, {"batch_size": 0}, "batch_size must be greater than or equal to 1 (got 0)"),
        ({}, {"workers": 0}, "workers must be greater than or equal to 1 (got 0)"),
        ({"jobQueueSize": 0}, {}, "jobQueueSize: queue_size must be greater than or equal to 1"),
        ({"maxBatchDelay": -5}, {}, "maxBatchDelay: max_batch_delay_ms must be greater than or"),
        ({"responseTimeout": 0}, {}, "responseTimeout: response_timeout_s must be greater than 0"),
        ({"batchSize": "many"}, {}, "batchSize: batch_size must be a valid integer"),
        ({"deviceType": "tpu"}, {}, "deviceType: device_type must be 'cpu' or 'gpu' (got 'tpu')"),
        ({"deviceIds": "0,x"}, {}, "deviceIds: device_ids must be a valid integer"),
        ({"maxWorkers": 0}, {}, "maxWorkers: max_workers must be greater than or equal to 1"),
        ({}, {"quantise": "int8"}, "unknown model setting 'quantise'"),
    ],
)
def test_invalid_model_settings_are_one_line_value_errors_naming_the_key(
    archive: dict[str, object], overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ModelSettingsError) as info:
        ModelSettings.resolve(server_settings(), archive, overrides)
    assert isinstance(info.value, ValueError)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_every_bad_key_is_named_in_the_one_message() -> None:
    with pytest.raises(ValueError) as info:
        ModelSettings.resolve(server_settings(), {"batchSize": 0, "workerMode": "fork"})
    assert str(info.value) == (
        "invalid model setting: batchSize: batch_size must be greater than or equal to 1 (got 0); "
        "workerMode: worker_mode must be 'thread' or 'process' (got 'fork')"
    )


def test_device_type_and_ids_choose_the_workers_devices() -> None:
    available = ["cuda:0", "cuda:1", "cuda:2"]
    cpu = ModelSettings.resolve(server_settings(), {"deviceType": "cpu"}, gpus=3)
    assert cpu.devices(available) == ["cpu"]
    gpu = ModelSettings.resolve(server_settings(), {"deviceType": "gpu", "deviceIds": [0, 2]})
    assert (gpu.devices(available), gpu.workers) == (["cuda:0", "cuda:2"], 2)
    with pytest.raises(ValueError, match="no such GPU is visible"):
        gpu.devices(["cpu"])
    with pytest.raises(ValueError, match=r"maxWorkers \(1\) must be at least minWorkers \(2\)"):
        ModelSettings.resolve(server_settings(), {"minWorkers": 2, "maxWorkers": 1})


def test_default_workers_for_gpus_do_not_trip_over_max_workers() -> None:
    # Three GPUs visible, the model may use one: one worker, within maxWorkers 1.
    m = ModelSettings.resolve(
        server_settings(workers_per_model=None),
        {"deviceType": "gpu", "deviceIds": "1", "maxWorkers": 1},
        gpus=3,
    )
    assert (m.workers, m.max_workers, m.device_ids) == (1, 1, (1,))


def test_max_workers_bounds_scaling() -> None:
    bounded = ModelSettings.resolve(server_settings(), {"minWorkers": 1, "maxWorkers": 3})
    for workers in (0, 1, 3):
        assert bounded.check_scale(workers) is None
    with pytest.raises(ValueError, match="cannot scale to 4 workers: the model's maxWorkers is 3"):
        bounded.check_scale(4)
    unbounded = ModelSettings.resolve(server_settings(), {})
    assert unbounded.max_workers is None
    assert unbounded.check_scale(64) is None


def test_settings_survive_the_snapshots_json_as_registration_overrides() -> None:
    m = ModelSettings.resolve(
        server_settings(), {"batchSize": 8, "deviceType": "gpu", "deviceIds": "0,1"}
    )
    saved = json.loads(json.dumps(m.model_dump(mode="json")))
    assert saved["device_ids"] == [0, 1]
    assert ModelSettings.resolve(server_settings(), {}, saved) == m


def test_warmup_runs_come_from_the_server_unless_a_model_says_and_no_warmup_wins() -> None:
    assert ModelSettings.resolve(server_settings(), {}).warmup_runs == 2
    assert ModelSettings.resolve(server_settings(warmup_runs=4), {}).warmup_runs == 4
    configured = {"warmupRuns": 3}
    assert ModelSettings.resolve(server_settings(), configured).warmup_runs == 3
    # The server's off switch turns every model's warm-up off, whatever its config says.
    off = server_settings(warmup=False)
    assert ModelSettings.resolve(off, configured, {"warmup_runs": 5}).warmup_runs == 0
    with pytest.raises(ModelSettingsError, match=r"warmupRuns: warmup_runs must be greater"):
        ModelSettings.resolve(server_settings(), {"warmupRuns": -1})


def test_model_settings_are_immutable() -> None:
    m = ModelSettings.resolve(server_settings(), {})
    with pytest.raises(ValueError, match="frozen"):
        m.batch_size = 4


@pytest.mark.parametrize(
    ("device", "devices", "workers"),
    [
        ("cpu", ["cpu"], 2),
        ("cuda", ["cuda:0", "cuda:1", "cuda:2"], 2),  # the server's workers_per_model
        ("cuda:1", ["cuda:1"], 1),
        ("cuda:0,2", ["cuda:0", "cuda:2"], 2),
        ("CUDA:2", ["cuda:2"], 1),
    ],
)
def test_a_model_configs_device_places_its_workers(
    device: str, devices: list[str], workers: int
) -> None:
    """`device:` in a model's config is the short form of deviceType and deviceIds: workers go
    round-robin over the GPUs it names, one per named GPU unless minWorkers says otherwise."""
    available = ["cuda:0", "cuda:1", "cuda:2"]
    m = ModelSettings.resolve(server_settings(), {"device": device}, gpus=3)
    assert (m.devices(available), m.workers) == (devices, workers)


def test_a_device_that_is_not_there_or_not_a_device_is_refused_with_the_forms_to_use() -> None:
    on_gpu_one = ModelSettings.resolve(server_settings(), {"device": "cuda:1"})
    with pytest.raises(ModelSettingsError, match=r"deviceType gpu \[1\] asked for, but no such"):
        on_gpu_one.devices(["cpu"])  # a machine without GPUs
    with pytest.raises(ModelSettingsError, match="use cpu, cuda, cuda:N or cuda:N,M"):
        ModelSettings.resolve(server_settings(), {"device": "tpu:0"})
