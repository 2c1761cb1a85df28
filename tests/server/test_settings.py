"""Server settings: defaults < YAML file < SCRIPTSERVE_* environment < command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from serving import run_command

from scriptserve.server.settings import load_settings


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SCRIPTSERVE_* variable of the machine running the tests leaks into these."""
    import os

    for name in list(os.environ):
        if name.startswith("SCRIPTSERVE_"):
            monkeypatch.delenv(name)


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return path


def test_defaults_match_the_documented_ones() -> None:
    s = load_settings()
    assert s.inference_address == "127.0.0.1:8080"
    assert s.management_address == "127.0.0.1:8081"
    assert s.metrics_address == "127.0.0.1:8082"
    assert s.model_store == Path("model_store")
    assert (s.max_batch_size, s.max_batch_delay_ms, s.queue_size) == (32, 0.0, 1000)
    assert s.response_timeout_s == 120.0
    assert s.enable_model_api is False


def test_yaml_then_environment_then_command_line_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_yaml(
        tmp_path,
        "queue_size: 10\nmax-batch-size: 8\nmax_batch_delay_ms: 5\nresponse_timeout_s: 7\n",
    )
    s = load_settings(config)
    assert (s.queue_size, s.max_batch_size, s.max_batch_delay_ms, s.response_timeout_s) == (
        10,
        8,
        5.0,
        7.0,
    )
    assert s.metrics_address == "127.0.0.1:8082"  # not in the file: the default

    monkeypatch.setenv("SCRIPTSERVE_QUEUE_SIZE", "20")
    monkeypatch.setenv("SCRIPTSERVE_MAX_BATCH_SIZE", "16")
    s = load_settings(config)
    assert (s.queue_size, s.max_batch_size, s.max_batch_delay_ms) == (20, 16, 5.0)

    s = load_settings(config, queue_size=30, max_batch_delay_ms=None)  # None: flag not given
    assert (s.queue_size, s.max_batch_size, s.max_batch_delay_ms) == (30, 16, 5.0)


def test_environment_alone_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SCRIPTSERVE_INFERENCE_ADDRESS", "127.0.0.1:9000")
    monkeypatch.setenv("SCRIPTSERVE_ENABLE_MODEL_API", "true")
    s = load_settings()
    assert s.inference_address == "127.0.0.1:9000"
    assert s.enable_model_api is True


@pytest.mark.parametrize("address", ["nohost", "127.0.0.1:", "127.0.0.1:99999", ":8080"])
def test_invalid_address_is_an_error_naming_it(address: str) -> None:
    with pytest.raises(ValueError, match="inference_address") as info:
        load_settings(inference_address=address)
    assert repr(address) in str(info.value)


def test_unknown_yaml_key_is_an_error(tmp_path: Path) -> None:
    config = write_yaml(tmp_path, "queue_size: 10\nqueue_sise: 20\n")
    with pytest.raises(ValueError, match="queue_sise"):
        load_settings(config)


def test_yaml_tags_that_build_objects_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    config = write_yaml(
        tmp_path,
        f"queue_size: !!python/object/apply:os.system ['touch {marker}']\n",
    )
    with pytest.raises(ValueError, match="config file"):
        load_settings(config)
    assert not marker.exists()


def test_yaml_that_is_not_a_mapping_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mapping"):
        load_settings(write_yaml(tmp_path, "- queue_size\n- 10\n"))


def test_invalid_values_are_errors() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        load_settings(max_batch_size=0)
    with pytest.raises(ValueError, match="max_batch_delay_ms"):
        load_settings(max_batch_delay_ms=-1)
    with pytest.raises(ValueError, match="device"):
        load_settings(device="tpu")


def test_log_level_is_one_of_loggings_names_in_any_case() -> None:
    assert load_settings(log_level="DEBUG").log_level == "debug"
    with pytest.raises(ValueError, match="log_level") as info:
        load_settings(log_level="loud")
    assert "'debug', 'info', 'warning' or 'error'" in str(info.value)


def test_serve_with_bad_settings_exits_1_with_one_line(tmp_path: Path) -> None:
    cases = [
        (["--max-batch-size", "0"], "max_batch_size"),
        (["--inference-address", "nohost"], "nohost"),
        (["--config", str(write_yaml(tmp_path, "queue_sise: 3\n"))], "queue_sise"),
        (["--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
    ]
    for args, named in cases:
        result = run_command(
            "scriptserve", "serve", "--model-store", str(tmp_path), *args, cwd=tmp_path
        )
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("scriptserve serve: error:")
        assert named in lines[0]


def test_config_file_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("queue_size: 17\n")
    monkeypatch.setenv("SCRIPTSERVE_CONFIG_FILE", str(config))
    assert load_settings().queue_size == 17
    # An explicit file still wins over the variable.
    other = tmp_path / "other.yaml"
    other.write_text("queue_size: 5\n")
    assert load_settings(other).queue_size == 5
