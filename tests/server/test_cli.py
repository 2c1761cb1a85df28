"""The `scriptserve` command: `serve` flags made from the settings, `--version`, a model store
checked at start, `archive create|inspect` and `predict` through the console script."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from serving import run_command
from testmodels import reference_output, save_onnx, save_torchscript

from scriptserve import __version__
from scriptserve.archiver.manifest import MANIFEST_PATH
from scriptserve.server.cli import add_serve_arguments, build_parser, main, settings_from_args
from scriptserve.server.settings import ServerSettings

SAMPLE = [0.1 * i for i in range(8)]
EXPECTED = reference_output(np.asarray([SAMPLE], dtype=np.float32))[0]


def scriptserve(*args: str) -> subprocess.CompletedProcess[str]:
    """The `scriptserve` command, forked (serving.run_command); the store fixture runs the
    installed script itself once."""
    return run_command("scriptserve", *args)


def assert_error(done: subprocess.CompletedProcess[str], prog: str, *needles: str) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: error: ")
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny (TorchScript) and tiny-onnx archives, built with `scriptserve archive create`."""
    root = tmp_path_factory.mktemp("cli")
    models = root / "models"
    models.mkdir()
    save_torchscript(models / "tiny.pt")
    save_onnx(models / "tiny.onnx")
    (models / "sample.json").write_text(json.dumps(SAMPLE))
    (models / "short.json").write_text(json.dumps(SAMPLE[:5]))
    (models / "broken.json").write_text("{")
    for name, model, fmt in (("tiny", "tiny.pt", "default"), ("tiny-onnx", "tiny.onnx", "tgz")):
        argv = [
            "archive", "create", "--model-name", name, "--version", "1.0",
            "--serialized-file", str(models / model), "--sample-input",
            str(models / "sample.json"), "--export-path", str(root / "store"),
            "--archive-format", fmt,
        ]  # fmt: skip
        if fmt == "default":
            done = subprocess.run(
                ["scriptserve", *argv], capture_output=True, text=True, timeout=120, check=False
            )
            assert done.returncode == 0, done.stderr
            assert done.stdout == f"{root / 'store' / 'tiny.mar'}\n"
        else:  # in-process, to keep the suite fast: one subprocess shows the exit code
            assert main(argv) == 0
    return root


def test_usage_errors_exit_2() -> None:
    for argv in ([], ["predict", "x.mar"], ["archive", "inspect"]):
        done = scriptserve(*argv)
        assert done.returncode == 2, argv
        assert "usage: scriptserve" in done.stderr


def test_inspect_text(store: Path) -> None:
    archive = store / "store" / "tiny.mar"
    done = scriptserve("archive", "inspect", str(archive))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith(f"archive: {archive} (default)\nmanifest:\n")
    assert '"modelName": "tiny"' in out
    tiny_pt = (store / "models" / "tiny.pt").read_bytes()
    file_lines = out.split("files:\n", 1)[1].splitlines()
    assert len(file_lines) == 3
    listed = {line.split()[0]: (int(line.split()[1]), line.split()[2]) for line in file_lines}
    assert listed["tiny.pt"] == (len(tiny_pt), sha256(tiny_pt))
    assert set(listed) == {MANIFEST_PATH, "tiny.pt", "sample.json"}


@pytest.mark.parametrize(("name", "fmt"), [("tiny.mar", "default"), ("tiny-onnx.tar.gz", "tgz")])
def test_inspect_json_lists_every_file_with_size_and_sha256(
    store: Path, name: str, fmt: str
) -> None:
    archive = store / "store" / name
    done = scriptserve("archive", "inspect", "--json", str(archive))
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert document["archive"] == str(archive)
    assert document["format"] == fmt
    manifest = document["manifest"]
    assert manifest["model"]["modelName"] == archive.name.split(".")[0]
    model_file = manifest["model"]["serializedFile"]

    files = {f["name"]: f for f in document["files"]}
    assert set(files) == {MANIFEST_PATH, model_file, "sample.json"}
    sources = {
        model_file: (store / "models" / model_file).read_bytes(),
        "sample.json": (store / "models" / "sample.json").read_bytes(),
    }
    for file_name, data in sources.items():
        assert files[file_name]["size"] == len(data)
        assert files[file_name]["sha256"] == sha256(data)
        assert manifest["scriptserve"]["files"][file_name] == sha256(data)
    assert files[MANIFEST_PATH]["size"] > 0
    assert len(files[MANIFEST_PATH]["sha256"]) == 64


def test_inspect_json_manifest_hash_matches_the_zip_member(store: Path) -> None:
    archive = store / "store" / "tiny.mar"
    document = json.loads(scriptserve("archive", "inspect", "--json", str(archive)).stdout)
    with zipfile.ZipFile(archive) as zf:
        raw = zf.read(MANIFEST_PATH)
    (entry,) = [f for f in document["files"] if f["name"] == MANIFEST_PATH]
    assert entry == {"name": MANIFEST_PATH, "size": len(raw), "sha256": sha256(raw)}


def test_inspect_missing_archive(tmp_path: Path) -> None:
    done = scriptserve("archive", "inspect", str(tmp_path / "nope.mar"))
    assert_error(done, "scriptserve archive", "archive not found", "nope.mar")


@pytest.mark.parametrize("name", ["tiny.mar", "tiny-onnx.tar.gz"])
def test_predict_prints_the_model_output(store: Path, name: str) -> None:
    done = scriptserve(
        "predict", str(store / "store" / name), "--input", str(store / "models" / "sample.json")
    )
    assert done.returncode == 0, done.stderr
    assert np.allclose(np.asarray(json.loads(done.stdout)), EXPECTED, atol=1e-5)


def test_predict_with_wrong_shaped_input_names_input_and_shape(store: Path) -> None:
    done = scriptserve(
        "predict",
        str(store / "store" / "tiny.mar"),
        "--input",
        str(store / "models" / "short.json"),
    )
    assert_error(
        done,
        "scriptserve predict",
        "input 'x' has shape [5] per instance; the model expects [8]",
    )
    assert done.stdout == ""


def test_predict_with_bad_json_input(store: Path) -> None:
    done = scriptserve(
        "predict",
        str(store / "store" / "tiny-onnx.tar.gz"),
        "--input",
        str(store / "models" / "broken.json"),
    )
    assert_error(done, "scriptserve predict", "not valid JSON")


def test_predict_missing_archive_and_missing_input(store: Path, tmp_path: Path) -> None:
    sample = str(store / "models" / "sample.json")
    done = scriptserve("predict", str(tmp_path / "nope.mar"), "--input", sample)
    assert_error(done, "scriptserve predict", "archive not found")
    done = scriptserve("predict", str(store / "store" / "tiny.mar"), "--input", str(tmp_path))
    assert done.returncode == 1
    assert "Traceback" not in done.stderr


def test_predict_refuses_a_tampered_archive(store: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "tiny.mar"
    with (
        zipfile.ZipFile(store / "store" / "tiny.mar") as src,
        zipfile.ZipFile(tampered, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(
                info.filename,
                b"[9, 9, 9, 9, 9, 9, 9, 9]" if info.filename == "sample.json" else data,
            )
    done = scriptserve("predict", str(tampered), "--input", str(store / "models" / "sample.json"))
    assert_error(done, "scriptserve predict", "failed verification", "changed: sample.json")


def test_predict_on_an_unknown_device(store: Path) -> None:
    done = scriptserve(
        "predict",
        str(store / "store" / "tiny-onnx.tar.gz"),
        "--input",
        str(store / "models" / "sample.json"),
        "--device",
        "tpu:0",
    )
    assert_error(done, "scriptserve predict", "unknown device 'tpu:0'")


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No SCRIPTSERVE_* variable of the machine running the tests leaks into the settings."""
    for name in list(os.environ):
        if name.startswith("SCRIPTSERVE_"):
            monkeypatch.delenv(name)


def serve_settings(*flags: str) -> ServerSettings:
    """The settings `scriptserve serve FLAGS` would run with."""
    return settings_from_args(build_parser().parse_args(["serve", *flags]))


def test_version_prints_the_package_version() -> None:
    done = scriptserve("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"scriptserve {__version__}\n"


def test_every_setting_but_the_secrets_is_a_flag_that_defaults_to_not_given() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    given = vars(parser.parse_args([]))
    secrets = {"management_key", "inference_key"}
    assert set(given) == set(ServerSettings.model_fields) - secrets
    assert set(given.values()) == {None}  # left out: the file and environment decide
    usage = parser.format_usage()
    for name in given:
        assert f"--{name.replace('_', '-')} " in usage or f"--{name.replace('_', '-')}]" in usage


# Flags that README, docs and the tests use: the same spelling, the same meaning.
FLAGS_IN_USE: list[tuple[list[str], str, object]] = [
    (["--model-store", "store"], "model_store", Path("store")),
    (["--models", "a.mar", "b=c.mar"], "models", ["a.mar", "b=c.mar"]),
    (["--inference-address", "127.0.0.1:9080"], "inference_address", "127.0.0.1:9080"),
    (["--management-address", "127.0.0.1:9081"], "management_address", "127.0.0.1:9081"),
    (["--metrics-address", "127.0.0.1:9082"], "metrics_address", "127.0.0.1:9082"),
    (["--grpc-inference-address", "[::1]:9070"], "grpc_inference_address", "[::1]:9070"),
    (["--grpc-management-address", "[::1]:9071"], "grpc_management_address", "[::1]:9071"),
    (["--device", "cpu"], "device", "cpu"),
    (["--workers", "3"], "workers_per_model", 3),
    (["--intra-op-threads", "2"], "intra_op_threads", 2),
    (["--max-batch-size", "8"], "max_batch_size", 8),
    (["--max-batch-delay", "5"], "max_batch_delay_ms", 5.0),
    (["--queue-size", "9"], "queue_size", 9),
    (["--response-timeout", "7"], "response_timeout_s", 7.0),
    (["--drain-timeout", "4"], "drain_timeout_s", 4.0),
    (["--worker-mode", "process"], "worker_mode", "process"),
    (["--enable-model-api"], "enable_model_api", True),
    (["--insecure-no-auth"], "insecure_no_auth", True),
    (["--no-snapshot"], "restore_snapshot", False),
    (["--key-file", "keys.json"], "key_file", Path("keys.json")),
    (["--log-level", "debug"], "log_level", "debug"),
    # Made from the settings as well: every field's own name, booleans both ways, JSON mappings.
    (["--workers-per-model", "5"], "workers_per_model", 5),
    (["--max-batch-delay-ms", "2.5"], "max_batch_delay_ms", 2.5),
    (["--no-docs"], "docs", False),
    (
        ["--allowed-urls", "https://a/.*", "https://b/.*"],
        "allowed_urls",
        ["https://a/.*", "https://b/.*"],
    ),
    (
        ["--model-defaults", '{"m": {"*": {"batchSize": 4}}}'],
        "model_defaults",
        {"m": {"*": {"batchSize": 4}}},
    ),
]


@pytest.mark.parametrize(("flags", "setting", "value"), FLAGS_IN_USE)
@pytest.mark.usefixtures("clean_environment")
def test_serve_flags_set_their_setting(flags: list[str], setting: str, value: object) -> None:
    assert getattr(serve_settings(*flags), setting) == value


@pytest.mark.usefixtures("clean_environment")
def test_flags_given_win_over_file_and_environment_and_flags_left_out_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("queue_size: 10\nmax_batch_size: 8\nenable_model_api: true\ndocs: false\n")
    monkeypatch.setenv("SCRIPTSERVE_MAX_BATCH_SIZE", "16")
    s = serve_settings("--config", str(config))
    assert (s.queue_size, s.max_batch_size, s.enable_model_api, s.docs) == (10, 16, True, False)
    s = serve_settings(
        "--config",
        str(config),
        "--queue-size",
        "30",
        "--max-batch-size",
        "4",
        "--no-enable-model-api",
        "--docs",
    )
    assert (s.queue_size, s.max_batch_size, s.enable_model_api, s.docs) == (30, 4, False, True)


@pytest.mark.usefixtures("clean_environment")
def test_ts_config_flag_reads_torchserve_properties_below_the_other_flags(tmp_path: Path) -> None:
    properties = tmp_path / "config.properties"
    properties.write_text("job_queue_size=5\ndefault_response_timeout=9\n")
    s = serve_settings("--ts-config", str(properties), "--response-timeout", "3")
    assert (s.ts_config, s.queue_size, s.response_timeout_s) == (properties, 5, 3.0)


@pytest.mark.parametrize(
    ("flags", "complaint"),
    [
        # Secrets are never flags (a command line is visible to every user of the machine), and
        # no abbreviation turns --management-key into --management-key-file.
        (["--management-key", "k"], "unrecognized arguments: --management-key"),
        (["--inference-key", "k"], "unrecognized arguments: --inference-key"),
        (["--max-batch", "3"], "unrecognized arguments: --max-batch"),
        (["--model-defaults", "[1]"], "--model-defaults: expected a JSON object"),
        (["--model-defaults", "{"], "--model-defaults: not valid JSON"),
        (["--worker-mode", "fork"], "--worker-mode: invalid choice: 'fork'"),
    ],
)
def test_flags_that_are_not_settings_are_usage_errors(
    flags: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *flags])
    assert info.value.code == 2
    assert complaint in capsys.readouterr().err


@pytest.mark.parametrize("store_is", ["missing", "a file"])
def test_serve_refuses_a_model_store_that_is_not_a_directory_before_binding_a_port(
    tmp_path: Path, store_is: str
) -> None:
    store = tmp_path / "nonexistent"
    if store_is == "a file":
        store.write_text("not a directory")
    with socket.socket() as taken:
        # The inference port is taken: a server that bound ports first would fail on it instead.
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        done = scriptserve("serve", "--model-store", str(store), "--inference-address", address)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    expected = "does not exist" if store_is == "missing" else "is not a directory"
    assert lines[0].startswith(f"scriptserve serve: error: model store {store} {expected}")
    assert not (tmp_path / "key_file.json").exists()  # nothing started: no keys generated
