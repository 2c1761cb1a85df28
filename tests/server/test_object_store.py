"""Object-storage model stores and registrations against a real S3-compatible server on
loopback (moto in server mode), with archives put there by a real client (boto3): a bucket
prefix as the model store, registration from an allowed `s3://` URL, the allow-list, size and
time bounds, the archive's own checksums, and credentials that never reach the log."""

from __future__ import annotations

import shutil
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from serving import ServerProcess, free_port

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow

SECRET = "s3cr3t-never-logged-0b5e"
ROW = [0.5] * 8


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback; yields the environment that points clients at it."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [shutil.which("moto_server") or "moto_server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    env = {
        "AWS_ACCESS_KEY_ID": "AKIAscriptservetest",
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(env["AWS_ENDPOINT_URL"], timeout=1)
            break
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    yield env
    proc.terminate()
    proc.wait(10)


def client(env: dict[str, str]) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


@pytest.fixture(scope="module")
def bucket(s3: dict[str, str], model_store: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Bucket `models`: prod/ holds tiny and tiny_onnx, extra/ a copy of tiny (spare.mar) and a
    tampered one, and big/ an archive padded past 64 KiB."""
    s3c = client(s3)
    s3c.create_bucket(Bucket="models")
    tiny, onnx = model_store / "tiny.mar", model_store / "tiny_onnx.mar"
    s3c.upload_file(str(tiny), "models", "prod/tiny.mar")
    s3c.upload_file(str(onnx), "models", "prod/tiny_onnx.mar")
    s3c.put_object(Bucket="models", Key="prod/README.txt", Body=b"not an archive")
    s3c.upload_file(str(tiny), "models", "extra/spare.mar")
    tampered = tmp_path_factory.mktemp("tampered") / "tampered.mar"
    with zipfile.ZipFile(tiny) as source, zipfile.ZipFile(tampered, "w") as out:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith(".pt"):
                data = data[:-1] + bytes([data[-1] ^ 1])  # one bit of the model file
            out.writestr(info, data)
    s3c.upload_file(str(tampered), "models", "extra/tampered.mar")
    s3c.put_object(Bucket="models", Key="big/big.mar", Body=b"\0" * (96 << 10))
    return "models"


def register(server: ServerProcess, url: str, name: str) -> httpx.Response:
    return httpx.post(
        f"{server.mgmt}/models",
        params={"url": url, "model_name": name, "synchronous": "true"},
        headers=server.mgmt_headers,
        timeout=120,
    )


@pytest.fixture(scope="module")
def bucket_server(
    s3: dict[str, str], bucket: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Its model store is the bucket prefix s3://models/prod; registration from s3://models/
    extra/ and big/ is allowed; downloads are bounded to 64 KiB."""
    work = tmp_path_factory.mktemp("bucket-store")
    proc = ServerProcess(
        work / "unused",
        "--model-store",
        f"s3://{bucket}/prod/",
        "--model-store-cache",
        str(work / "cache"),
        "--enable-model-api",
        "--workers",
        "1",
        "--allowed-urls",
        f"s3://{bucket}/(extra|big)/.*",
        "--download-max-bytes",
        str(64 << 10),
        env=s3,
    )
    proc.start()
    yield proc
    proc.stop()


def test_a_bucket_prefix_is_the_model_store(bucket_server: ServerProcess) -> None:
    for model in ("tiny", "tiny_onnx"):
        reply = httpx.post(f"{bucket_server.url}/predictions/{model}", json=ROW)
        assert reply.status_code == 200, reply.text
    listed = httpx.get(f"{bucket_server.mgmt}/models", headers=bucket_server.mgmt_headers)
    assert {m["modelName"] for m in listed.json()["models"]} == {"tiny", "tiny_onnx"}


def test_registration_from_an_allowed_s3_url(bucket_server: ServerProcess) -> None:
    reply = register(bucket_server, "s3://models/extra/spare.mar", "from_s3")
    assert reply.status_code == 200, reply.text
    answer = httpx.post(f"{bucket_server.url}/predictions/from_s3", json=ROW)
    assert answer.status_code == 200


def test_an_archive_that_fails_its_checksums_is_refused(bucket_server: ServerProcess) -> None:
    reply = register(bucket_server, "s3://models/extra/tampered.mar", "tampered")
    assert reply.status_code == 400
    assert "verification" in reply.json()["message"]
    assert httpx.post(f"{bucket_server.url}/predictions/tampered", json=ROW).status_code == 404


@pytest.mark.parametrize(
    ("url", "status", "says"),
    [
        ("s3://models/prod/tiny.mar", 403, "allowed_urls"),  # not in the allow-list
        ("gs://models/extra/spare.mar", 403, "allowed_urls"),
        ("s3://models/extra/missing.mar", 400, "no such object"),
        ("s3://models/big/big.mar", 413, "larger than 65536 bytes"),
        ("s3://user@models/extra/spare.mar", 400, "user info"),
        ("s3://models/extra/../prod/tiny.mar", 400, "'..'"),
    ],
)
def test_refused_registrations_say_why(
    bucket_server: ServerProcess, url: str, status: int, says: str
) -> None:
    reply = register(bucket_server, url, "refused")
    assert reply.status_code == status, reply.text
    assert says in reply.json()["message"]


def test_credentials_never_reach_the_log(bucket_server: ServerProcess) -> None:
    register(bucket_server, "s3://models/extra/missing.mar", "missing")
    output = bucket_server.output()
    assert "s3://models/prod" in output  # the store was logged, by its URL
    assert SECRET not in output and "AKIAscriptservetest" not in output


def test_downloads_are_bounded_in_time(s3: dict[str, str], bucket: str, tmp_path: Path) -> None:
    """A store whose download cannot finish in time stops the start with what to change."""
    proc = ServerProcess(
        tmp_path / "unused",
        "--model-store",
        f"s3://{bucket}/prod",
        "--model-store-cache",
        str(tmp_path / "cache"),
        "--download-timeout-s",
        "0.001",
        env=s3,
    )
    with pytest.raises(RuntimeError, match="exited 2"):
        proc.start()
    assert "took longer than 0.001 s" in proc.output()
    assert not any((tmp_path / "cache").glob("*.part"))  # nothing half-written is left


def test_a_missing_bucket_stops_the_start(s3: dict[str, str], tmp_path: Path) -> None:
    proc = ServerProcess(tmp_path / "unused", "--model-store", "s3://no-such-bucket/x", env=s3)
    with pytest.raises(RuntimeError, match="exited 2"):
        proc.start()
    assert "model store s3://no-such-bucket/x" in proc.output()


def test_a_restart_copies_only_what_changed_in_the_bucket(
    s3: dict[str, str], bucket: str, model_store: Path, tmp_path: Path
) -> None:
    s3c = client(s3)
    tiny, onnx = model_store / "tiny.mar", model_store / "tiny_onnx.mar"
    s3c.upload_file(str(tiny), "models", "sync/kept.mar")
    s3c.upload_file(str(onnx), "models", "sync/changed.mar")
    cache = tmp_path / "cache"
    args = ("--model-store", "s3://models/sync", "--model-store-cache", str(cache))
    first = ServerProcess(tmp_path / "unused", *args, "--workers", "1", env=s3).start()
    first.stop()
    kept = (cache / "kept.mar").stat().st_mtime_ns
    # A new object under the same key: a second archive of `tiny` 1.0, which the server then
    # refuses to load twice (it logs why and serves the first).
    s3c.upload_file(str(tiny), "models", "sync/changed.mar")
    second = ServerProcess(tmp_path / "unused", *args, "--workers", "1", env=s3).start()
    try:
        assert "2 archive(s)" in second.output() and "1 copied" in second.output()
        assert (cache / "kept.mar").stat().st_mtime_ns == kept
        assert (cache / "changed.mar").read_bytes() == tiny.read_bytes()
        assert (
            "archive kept.mar is not loaded: model 'tiny' version '1.0' is already registered"
            in second.output()
        )
        assert httpx.post(f"{second.url}/predictions/tiny", json=ROW).status_code == 200
        assert httpx.post(f"{second.url}/predictions/tiny_onnx", json=ROW).status_code == 404
    finally:
        second.stop()
