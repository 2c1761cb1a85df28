"""Users' own modules named like the project's folders (`training`, `server`, `handlers`) are
theirs: run from a directory holding them, `scriptserve` never imports them, and a handler that
imports a `server.py` shipped in its archive gets that file, not ours and not the directory's."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from serving import ServerProcess
from testmodels import reference_output, save_torchscript

from scriptserve.archiver.cli import model_archiver_main

# Slow: each test starts `scriptserve` in a process of its own.
pytestmark = pytest.mark.slow

MARKER = "USER-MODULE-IMPORTED"

# The archive's handler computes its answer with the archive's own `server` module.
HANDLER = """
import server

from scriptserve.handlers.tensor import TensorHandler


class SummaryHandler(TensorHandler):
    def postprocess(self, outputs):
        responses = super().postprocess(outputs)
        for response in responses:
            if response.error is None:
                response.body = server.summarize(response.body)
        return responses
"""

ARCHIVE_SERVER = """
def summarize(scores):
    best = max(range(len(scores)), key=scores.__getitem__)
    return {"from": "the archive's server.py", "label": best, "total": round(sum(scores), 4)}
"""

# What the working directory holds: each module says so when imported.
USER_FILES = {
    "training/__init__.py": "",
    "training/__main__.py": f"print({MARKER!r}, 'training')\nraise SystemExit(0)\n",
    "server.py": (
        f"print({MARKER!r}, 'server.py')\n"
        "def summarize(scores):\n    return {'from': \"the working directory's server.py\"}\n"
    ),
    "handlers/__init__.py": f"print({MARKER!r}, 'handlers')\n",
    "handlers/base.py": f"print({MARKER!r}, 'handlers.base')\n",
}

ROW = [0.5, -1.0, 0.25, 2.0, 0.0, 1.5, -0.5, 0.75]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the user's own `training`, `server` and `handlers`, an input file,
    and model_store/summary.mar, whose handler imports the archive's `server.py`."""
    root = tmp_path_factory.mktemp("user")
    for name, text in USER_FILES.items():
        write(root / name, text)
    (root / "input.json").write_text(json.dumps(ROW))
    parts = tmp_path_factory.mktemp("archive-parts")
    write(parts / "summary_handler.py", HANDLER)
    write(parts / "server.py", ARCHIVE_SERVER)
    model = save_torchscript(parts / "tiny.pt")
    argv = [
        "--model-name", "summary", "--version", "1.0", "--serialized-file", str(model),
        "--handler", str(parts / "summary_handler.py"), "--extra-files", str(parts / "server.py"),
        "--input-shape", "8", "--export-path", str(root / "model_store"),
    ]  # fmt: skip
    assert model_archiver_main(argv) == 0
    return root


def assert_summary(answer: dict[str, object]) -> None:
    """The answer is the archive's `server.summarize` of the model's real output."""
    scores = reference_output(np.array([ROW], dtype=np.float32))[0]
    assert answer["from"] == "the archive's server.py"
    assert answer["label"] == int(scores.argmax())
    assert answer["total"] == pytest.approx(float(scores.sum()), abs=1e-3)


def test_train_help_is_scriptserves(dev_scripts: Path, workdir: Path) -> None:
    done = subprocess.run(
        [str(dev_scripts / "scriptserve"), "train", "--help"],
        check=False,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert MARKER not in done.stdout + done.stderr
    assert "Train a digits classifier" in done.stdout
    assert "--epochs" in done.stdout


@pytest.mark.parametrize("launcher", ["console script", "python -m"])
def test_predict_imports_the_archives_server_module(
    dev_scripts: Path, workdir: Path, launcher: str
) -> None:
    """`python -m scriptserve` puts the working directory first on sys.path; the console
    script does not."""
    command = (
        [str(dev_scripts / "scriptserve")]
        if launcher == "console script"
        else [sys.executable, "-m", "scriptserve"]
    )
    done = subprocess.run(
        [*command, "predict", "model_store/summary.mar", "--input", "input.json"],
        check=False,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert MARKER not in done.stdout + done.stderr
    assert_summary(json.loads(done.stdout))


def test_serve_imports_the_archives_server_module(
    dev_scripts: Path, workdir: Path, installed_server: Callable[..., ServerProcess]
) -> None:
    server = installed_server(
        dev_scripts, workdir / "model_store", "--models", "all", "--workers", "1", cwd=workdir
    )
    reply = httpx.post(f"{server.url}/predictions/summary", content=json.dumps(ROW), timeout=30)
    assert reply.status_code == 200, reply.text
    assert_summary(reply.json())
    assert MARKER not in server.output()
