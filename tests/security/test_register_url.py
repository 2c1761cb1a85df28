"""Registration from a URL: only what `allowed_urls` allows, and a refused URL (file://, the
metadata service, other hosts or paths, user info, encoded `..`, a redirect elsewhere) makes no
connection at all: the loopback listeners count every connection they get."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from hardening import archive, assert_no_leak
from serving import ServerProcess

# Slow: servers started for a few tests.
pytestmark = pytest.mark.slow


class Listener:
    """A loopback HTTP server that serves files by path and counts its connections."""

    def __init__(self, files: dict[str, bytes], redirects: dict[str, str] | None = None) -> None:
        self.connections = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                owner.connections += 1
                super().setup()

            def do_GET(self) -> None:
                if self.path in (redirects or {}):
                    self.send_response(302)
                    self.send_header("Location", (redirects or {})[self.path])
                    self.end_headers()
                    return
                if self.path == "/allowed/slow.mar":
                    time.sleep(10)  # past the download timeout; the server has hung up
                    return
                body = files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.end_headers()  # no Content-Length: the size is learnt while reading
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def setup(
    store: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, Listener, Listener]]:
    work = tmp_path_factory.mktemp("remote")
    remote = archive(work / "out", work, "remote")
    evil = Listener({"/evil.mar": remote.read_bytes()})
    listener = Listener(
        {
            "/allowed/remote.mar": remote.read_bytes(),
            "/other/remote.mar": remote.read_bytes(),
            "/allowed/big.mar": b"0" * (3 << 20),
        },
        {
            "/allowed/redirect.mar": f"http://127.0.0.1:{evil.port}/evil.mar",
            "/allowed/hop.mar": "/allowed/remote.mar",
        },
    )
    allowed = f'["http://127\\\\.0\\\\.0\\\\.1:{listener.port}/allowed/.*"]'
    proc = ServerProcess(
        store,
        "--enable-model-api",
        "--workers",
        "1",
        env={
            "SCRIPTSERVE_ALLOWED_URLS": allowed,
            "SCRIPTSERVE_DOWNLOAD_MAX_BYTES": str(1 << 20),
            "SCRIPTSERVE_DOWNLOAD_TIMEOUT_S": "2",
        },
    ).start()
    yield proc, listener, evil
    proc.stop()
    listener.close()
    evil.close()


def register(server: ServerProcess, url: str, **params: str) -> httpx.Response:
    return httpx.post(
        f"{server.mgmt}/models",
        params={"url": url, **params},
        headers=server.mgmt_headers,
        timeout=60,
    )


def test_refused_urls_make_no_connection(setup: tuple[ServerProcess, Listener, Listener]) -> None:
    server, listener, evil = setup
    port = listener.port
    for url in (
        "file:///etc/passwd",
        "http://169.254.169.254/latest/meta-data/x.mar",
        f"http://127.0.0.1:{server.ports[1]}/models",
        f"http://127.0.0.1:{port}/other/remote.mar",
        f"http://127.0.0.1:{port}@127.0.0.1:{evil.port}/allowed/remote.mar",
        f"http://user:pw@127.0.0.1:{port}/allowed/remote.mar",
        f"http://127.0.0.1:{port}/allowed/..%2fother/remote.mar",
        f"http://127.0.0.1:{port}/allowed/%2e%2e/other/remote.mar",
        f"http://127.0.0.1:{port}/allowed/%252e%252e/other/remote.mar",
        f"http://127.0.0.1:{port}/allowed/../other/remote.mar",
        f"http://127.0.0.1:{port}/allowed\\..\\other/remote.mar",
        f"ftp://127.0.0.1:{port}/allowed/remote.mar",
    ):
        r = register(server, url)
        assert r.status_code in (400, 403), (url, r.text)
        assert_no_leak(r)
    assert listener.connections == 0
    assert evil.connections == 0


def test_redirect_to_a_disallowed_target(setup: tuple[ServerProcess, Listener, Listener]) -> None:
    server, listener, evil = setup
    r = register(server, f"http://127.0.0.1:{listener.port}/allowed/redirect.mar")
    assert r.status_code == 403, r.text
    assert "allowed_urls" in r.json()["message"]
    assert evil.connections == 0
    assert not (server.store / "redirect.mar").exists()


def test_size_and_time_limits(setup: tuple[ServerProcess, Listener, Listener]) -> None:
    server, listener, _ = setup
    r = register(server, f"http://127.0.0.1:{listener.port}/allowed/big.mar")
    assert r.status_code == 413, r.text
    started = time.monotonic()
    r = register(server, f"http://127.0.0.1:{listener.port}/allowed/slow.mar")
    assert r.status_code == 400, r.text
    assert "longer than 2 s" in r.json()["message"]
    assert time.monotonic() - started < 8
    assert not (server.store / "big.mar").exists()
    assert not [p for p in server.store.iterdir() if p.name.endswith(".part")]


def test_allowed_url_loads_like_a_store_file(
    setup: tuple[ServerProcess, Listener, Listener],
) -> None:
    server, listener, _ = setup
    r = register(server, f"http://127.0.0.1:{listener.port}/allowed/hop.mar")  # same-host hop
    assert r.status_code == 200, r.text
    assert (server.store / "hop.mar").is_file()  # named after the URL registered
    r = httpx.post(f"{server.url}/predictions/remote", json=[0.5] * 8)
    assert r.status_code == 200, r.text
    r = register(server, f"http://127.0.0.1:{listener.port}/allowed/remote.mar")
    assert r.status_code == 409, r.text
