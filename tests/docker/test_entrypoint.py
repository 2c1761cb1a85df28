"""docker/entrypoint.sh on this machine: it refuses to start the server without keys, says
which one is missing, and otherwise hands over to `scriptserve serve` (exec, same process)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ENTRYPOINT = Path(__file__).resolve().parents[2] / "docker" / "entrypoint.sh"
EX_CONFIG = 78


def entrypoint(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SCRIPTSERVE_")}
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *args],
        check=False,
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=120,
    )


def test_refuses_without_keys() -> None:
    result = entrypoint()
    assert result.returncode == EX_CONFIG
    assert "no management key: set SCRIPTSERVE_MANAGEMENT_KEY" in result.stderr
    assert "no inference key: set SCRIPTSERVE_INFERENCE_KEY" in result.stderr
    assert "SCRIPTSERVE_INSECURE_NO_AUTH=true" in result.stderr
    assert result.stdout == ""


def test_refuses_with_one_key_missing() -> None:
    result = entrypoint(SCRIPTSERVE_MANAGEMENT_KEY="m" * 32)
    assert result.returncode == EX_CONFIG
    assert "no inference key" in result.stderr and "no management key" not in result.stderr


def test_refuses_an_unreadable_or_empty_key_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    result = entrypoint(
        SCRIPTSERVE_MANAGEMENT_KEY_FILE=str(tmp_path / "absent"),
        SCRIPTSERVE_INFERENCE_KEY_FILE=str(empty),
    )
    assert result.returncode == EX_CONFIG
    assert (
        f"SCRIPTSERVE_MANAGEMENT_KEY_FILE={tmp_path / 'absent'} is not a readable" in result.stderr
    )
    assert f"SCRIPTSERVE_INFERENCE_KEY_FILE={empty} is empty" in result.stderr


def test_hands_over_to_scriptserve_serve_with_keys(tmp_path: Path) -> None:
    key = tmp_path / "management-key"
    key.write_text("k" * 32 + "\n")
    result = entrypoint(
        "--help", SCRIPTSERVE_MANAGEMENT_KEY_FILE=str(key), SCRIPTSERVE_INFERENCE_KEY="i" * 32
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: scriptserve serve")


def test_insecure_opt_out_is_explicit_and_loud() -> None:
    result = entrypoint("--help", SCRIPTSERVE_INSECURE_NO_AUTH="True")
    assert result.returncode == 0, result.stderr
    assert "every API is open" in result.stderr
    assert result.stdout.startswith("usage: scriptserve serve")
    assert entrypoint("--help", SCRIPTSERVE_INSECURE_NO_AUTH="no").returncode == EX_CONFIG


def test_other_commands_run_as_given() -> None:
    result = entrypoint("scriptserve", "archive", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: scriptserve archive" in result.stdout
