"""ONNX Runtime is an extra (`onnx` for its CPU build, `gpu` for its CUDA build): where neither is
installed, an ONNX model is refused, by the archiver and by the server's backend, with the extras
named. A child process stands in for such an installation by making `import onnxruntime` fail
(`sys.modules["onnxruntime"] = None`, which Python reads as "not installed")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import save_onnx

WITHOUT_ONNXRUNTIME = """
import sys
sys.modules["onnxruntime"] = None
from pathlib import Path
from scriptserve.archiver.cli import model_archiver_main
from scriptserve.handlers.backends import BackendError, load_backend

model = Path(sys.argv[1])
try:
    load_backend(model, "onnx")
except BackendError as exc:
    print("backend:", exc)
print("archiver:", flush=True)
sys.exit(model_archiver_main(
    ["--model-name", "m", "--version", "1", "--serialized-file", str(model),
     "--export-path", str(model.parent)]
))
"""


def test_an_onnx_model_without_onnx_runtime_is_refused_naming_the_extras(tmp_path: Path) -> None:
    model = save_onnx(tmp_path / "tiny.onnx")
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_ONNXRUNTIME, str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0 and "archiver:" in done.stdout, done.stdout + done.stderr
    advice = "install 'scriptserve[onnx]' (the CPU build) or 'scriptserve[gpu]' (CUDA and TensorRT)"
    assert f"backend: ONNX models need ONNX Runtime, which this installation lacks: {advice}" in (
        done.stdout
    )
    assert "model-archiver: error: ONNX models need ONNX Runtime" in done.stderr
    assert advice in done.stderr  # the archiver's one-line error, no traceback
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "m.mar").exists()
