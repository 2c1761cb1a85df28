"""The CPU image, built from docker/Dockerfile and run with buildah: it serves real archives,
requires its keys, runs as a non-root user, answers its health check, and stays small."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import yaml
from serving import free_port
from testmodels import reference_output, save_onnx, save_torchscript

from scriptserve.archiver.cli import model_archiver_main
from scriptserve.server.settings import ServerSettings, parse_address
from tests.docker.buildah import ROOT, BuiltImage, run

# The first test also builds the image (about 2.5 minutes cold on 2 cores with overlay storage,
# several times that on vfs): more than the suite's default per-test timeout.
# Slow: the image build (minutes).
pytestmark = [pytest.mark.slow, pytest.mark.container, pytest.mark.timeout(1800)]

MAX_IMAGE_BYTES = 1_200_000_000
ADDRESS_SETTINGS = (
    "inference_address",
    "management_address",
    "metrics_address",
    "grpc_inference_address",
    "grpc_management_address",
)
X = (np.arange(24, dtype=np.float32).reshape(3, 8) - 12) / 10


def image_user(config: dict[str, object]) -> tuple[int, int]:
    user, _, group = str(config["User"]).partition(":")
    return int(user), int(group or user)


def make_store(root: Path, owner: tuple[int, int]) -> Path:
    """`tiny` (TorchScript) and `tiny_onnx` (ONNX) archives, owned by the image's user (the
    server records its snapshot in the store, the image's only writable volume)."""
    store, models = root / "store", root / "models"
    models.mkdir(parents=True)
    sample = models / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    for name, path in (
        ("tiny", save_torchscript(models / "tiny.pt")),
        ("tiny_onnx", save_onnx(models / "tiny.onnx")),
    ):
        argv = [
            "--model-name", name, "--version", "1.0", "--serialized-file", str(path),
            "--handler", "tensor", "--sample-input", str(sample), "--export-path", str(store),
        ]  # fmt: skip
        assert model_archiver_main(argv) == 0
    for path in (store, *store.iterdir()):
        os.chown(path, *owner)
    store.chmod(0o755)
    return store


@dataclass
class Container:
    """One `buildah run` of the image's entrypoint, on host networking."""

    image: BuiltImage
    name: str
    env: dict[str, str]
    log: Path
    volumes: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0

    def command(self, *argv: str, env: dict[str, str] | None = None) -> list[str]:
        options = [f"--env={k}={v}" for k, v in {**self.env, **(env or {})}.items()]
        options += [f"--volume={v}" for v in self.volumes]
        return self.image.storage.buildah(
            "run", "--isolation", "chroot", *options, self.name, "--", *argv
        )

    def url(self, setting: str) -> str:
        _, port = parse_address(self.env[f"SCRIPTSERVE_{setting.upper()}"])
        return f"http://127.0.0.1:{port}"

    def server_process(self) -> psutil.Process:
        assert self.proc is not None
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if child.name() == "scriptserve" or "serve" in child.cmdline()[1:3]:
                return child
        raise AssertionError(f"no server process under buildah:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@pytest.fixture(scope="module")
def store(built_image: BuiltImage, tmp_path_factory: pytest.TempPathFactory) -> Path:
    owner = image_user(built_image.storage.image_config(built_image.tag))
    return make_store(tmp_path_factory.mktemp("container"), owner)


@pytest.fixture(scope="module")
def container(built_image: BuiltImage, store: Path) -> Iterator[Container]:
    """The image's entrypoint with both keys, its model store mounted, on free ports."""
    storage, tag = built_image.storage, built_image.tag
    name = run(storage.buildah("from", "--pull-never", tag)).stdout.strip()
    env = {
        "SCRIPTSERVE_MANAGEMENT_KEY": secrets.token_urlsafe(24),
        "SCRIPTSERVE_INFERENCE_KEY": secrets.token_urlsafe(24),
        # Every interface, as in the image's config file; only the ports change, so that the
        # test never collides with another server on this machine.
        **{f"SCRIPTSERVE_{s.upper()}": f"0.0.0.0:{free_port()}" for s in ADDRESS_SETTINGS},
        "SCRIPTSERVE_WORKERS_PER_MODEL": "1",
    }
    volume = f"{store}:/srv/model-store"
    box = Container(built_image, name, env, store.parent / "container.log", (volume,))
    entrypoint = [str(a) for a in storage.image_config(tag)["Entrypoint"]]  # type: ignore[attr-defined]
    cmd = box.command(*entrypoint)
    box.started = time.time() - 1
    with box.log.open("wb") as log:
        box.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        ready = f"{box.url('inference_address')}/v2/health/ready"
        while True:
            if box.proc.poll() is not None:
                raise AssertionError(f"container exited {box.proc.returncode}:\n{box.output()}")
            try:
                if httpx.get(ready, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"container not ready in 180 s:\n{box.output()}")
            time.sleep(0.2)
        yield box
    finally:
        if box.proc.poll() is None:
            box.proc.kill()
            box.proc.wait(30)
        run(storage.buildah("rm", name), check=False)


def test_image_metadata_matches_the_server(
    built_image: BuiltImage, capsys: pytest.CaptureFixture[str]
) -> None:
    config = built_image.storage.image_config(built_image.tag)
    defaults = ServerSettings()
    shipped = yaml.safe_load((ROOT / "docker" / "config.yaml").read_text())
    # The image's config file keeps the server's default ports and opens them on 0.0.0.0.
    for setting in ADDRESS_SETTINGS:
        assert parse_address(shipped[setting]) == (
            "0.0.0.0",
            parse_address(getattr(defaults, setting))[1],
        )
    ports = {f"{parse_address(shipped[s])[1]}/tcp" for s in ADDRESS_SETTINGS}
    assert set(config["ExposedPorts"]) == ports  # type: ignore[arg-type]
    assert list(config["Volumes"]) == [shipped["model_store"]]  # type: ignore[call-overload]
    assert image_user(config)[0] != 0
    assert config["Entrypoint"] == ["/usr/local/bin/scriptserve-entrypoint"]
    assert "SCRIPTSERVE_CONFIG_FILE=/etc/scriptserve/config.yaml" in config["Env"]  # type: ignore[operator]
    assert config["Healthcheck"]["Test"][0] == "CMD"  # type: ignore[index]

    size = built_image.storage.image_size(built_image.tag)
    built = f"built in {built_image.build_seconds:.0f} s" if built_image.build_seconds else "cached"
    with capsys.disabled():  # shown in every run, not only with -s
        print(f"\nCPU image {built_image.tag}: {size / 1e9:.2f} GB ({built})")
    assert size <= MAX_IMAGE_BYTES, f"image is {size / 1e9:.2f} GB, over {MAX_IMAGE_BYTES / 1e9} GB"


def test_image_holds_no_compiler_pip_or_cache(built_image: BuiltImage) -> None:
    storage, tag = built_image.storage, built_image.tag
    name = run(storage.buildah("from", "--pull-never", tag)).stdout.strip()
    try:
        script = (
            "for t in gcc cc g++ make pip pip3; do command -v $t && exit 1; done; "
            "python -c 'import pip' 2>/dev/null && exit 2; "
            "find / -xdev \\( -path /proc -o -path /sys \\) -prune -o -type d "
            "\\( -path '*/.cache/pip' -o -path /wheels -o -path '*/torch/include' \\) -print "
            "| grep . && exit 3; "
            "touch /opt/venv/x 2>/dev/null && exit 4; exit 0"
        )
        result = run(
            storage.buildah("run", "--isolation", "chroot", name, "--", "sh", "-c", script),
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        run(storage.buildah("rm", name), check=False)


def test_predictions_and_oip_from_the_host(container: Container) -> None:
    url = container.url("inference_address")
    auth = {"Authorization": f"Bearer {container.env['SCRIPTSERVE_INFERENCE_KEY']}"}
    x = X[0]
    for model in ("tiny", "tiny_onnx"):
        r = httpx.post(f"{url}/predictions/{model}", json=x.tolist(), headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json(), reference_output(x[None])[0], atol=1e-5)

        body = {
            "id": "c-1",
            "inputs": [{"name": "x", "shape": [3, 8], "datatype": "FP32", "data": X.tolist()}],
        }
        r = httpx.post(f"{url}/v2/models/{model}/infer", json=body, headers=auth, timeout=30)
        assert r.status_code == 200, r.text
        (out,) = r.json()["outputs"]
        np.testing.assert_allclose(np.reshape(out["data"], (3, 3)), reference_output(X), atol=1e-5)

    # The inference API listens beyond loopback, so it needs its key too.
    r = httpx.post(f"{url}/predictions/tiny", json=x.tolist(), timeout=30)
    assert r.status_code == 401, r.text


def test_management_needs_its_key(container: Container) -> None:
    mgmt = container.url("management_address")
    assert httpx.get(f"{mgmt}/models", timeout=30).status_code == 401
    inference_key = {"Authorization": f"Bearer {container.env['SCRIPTSERVE_INFERENCE_KEY']}"}
    assert httpx.get(f"{mgmt}/models", headers=inference_key, timeout=30).status_code in (401, 403)
    key = {"Authorization": f"Bearer {container.env['SCRIPTSERVE_MANAGEMENT_KEY']}"}
    r = httpx.get(f"{mgmt}/models", headers=key, timeout=30)
    assert r.status_code == 200, r.text
    assert {m["modelName"] for m in r.json()["models"]} == {"tiny", "tiny_onnx"}
    # Registration stays off in the image's production profile.
    r = httpx.post(f"{mgmt}/models", params={"url": "tiny.mar"}, headers=key, timeout=30)
    assert r.status_code in (404, 405), r.text


def test_server_process_is_not_root(container: Container, built_image: BuiltImage) -> None:
    uid, gid = image_user(built_image.storage.image_config(built_image.tag))
    server = container.server_process()
    assert server.uids().real == server.uids().effective == uid != 0
    assert server.gids().real == gid


def test_healthcheck_command_follows_liveness(
    container: Container, built_image: BuiltImage
) -> None:
    storage, tag = built_image.storage, built_image.tag
    check = list(storage.image_config(tag)["Healthcheck"]["Test"])[1:]  # type: ignore[index]
    name = run(storage.buildah("from", "--pull-never", tag)).stdout.strip()
    try:
        probe = Container(built_image, name, container.env, container.log)
        assert run(probe.command(*check), check=False).returncode == 0
        # Pointed at a port where nothing listens, the same check fails.
        elsewhere = {"SCRIPTSERVE_INFERENCE_ADDRESS": f"0.0.0.0:{free_port()}"}
        result = run(probe.command(*check, env=elsewhere), check=False)
        assert result.returncode != 0
        assert "liveness check failed" in result.stdout + result.stderr
    finally:
        run(storage.buildah("rm", name), check=False)


def test_refuses_to_start_without_keys(container: Container, built_image: BuiltImage) -> None:
    storage, tag = built_image.storage, built_image.tag
    entrypoint = [str(a) for a in storage.image_config(tag)["Entrypoint"]]  # type: ignore[attr-defined]
    name = run(storage.buildah("from", "--pull-never", tag)).stdout.strip()
    no_keys = {k: v for k, v in container.env.items() if not k.endswith("_KEY")}
    try:
        bare = Container(built_image, name, no_keys, container.log)
        result = run(bare.command(*entrypoint), check=False, timeout_s=120)
        said = result.stdout + result.stderr
        assert result.returncode != 0
        assert "SCRIPTSERVE_MANAGEMENT_KEY" in said and "refusing to start" in said, said

        missing = {
            "SCRIPTSERVE_MANAGEMENT_KEY_FILE": "/run/secrets/absent",
            "SCRIPTSERVE_INFERENCE_KEY": "k" * 32,
        }
        result = run(bare.command(*entrypoint, env=missing), check=False, timeout_s=120)
        assert result.returncode != 0
        assert "/run/secrets/absent is not a readable file" in result.stdout + result.stderr

        # The server refuses too when started without the entrypoint's check.
        result = run(bare.command("scriptserve", "serve"), check=False, timeout_s=180)
        said = result.stdout + result.stderr
        assert result.returncode != 0
        assert "refusing to listen beyond loopback without a management key" in said, said
    finally:
        run(storage.buildah("rm", name), check=False)


def test_sigterm_stops_the_container_cleanly(container: Container) -> None:
    """`docker stop` sends SIGTERM to the entrypoint's process, which `exec`s the server."""
    assert container.proc is not None
    server = container.server_process()
    assert server.cmdline()[-1] == "serve" or "serve" in server.cmdline()
    os.kill(server.pid, signal.SIGTERM)
    assert container.proc.wait(120) == 0, container.output()

    # What a read-only root (`docker run --read-only --tmpfs /tmp`) needs: the server wrote
    # nothing in the image's filesystem outside /tmp (the store is a mount, not in it).
    storage = container.image.storage
    root = Path(run(storage.buildah("mount", container.name)).stdout.strip())
    try:
        written = [
            str(p.relative_to(root))
            for p in root.rglob("*")
            if p.is_file()
            and not p.is_symlink()
            and p.stat().st_mtime > container.started
            and p.relative_to(root).parts[0] not in ("tmp", "proc", "sys", "dev", "run", "etc")
        ]
    finally:
        run(storage.buildah("umount", container.name), check=False)
    assert written == []
