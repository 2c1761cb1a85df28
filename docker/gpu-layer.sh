#!/bin/sh
# The GPU image's Python layer: a virtual environment at VENV holding PyTorch's CUDA build and
# scriptserve's wheel from WHEELS (the one the CPU image installs, made by
# `docker/wheelhouse.sh --project-only`) with the `gpu` extra, ONNX Runtime's CUDA build.
# docker/Dockerfile.gpu runs it; tests/docker/test_gpu_layer.py runs it the same way on the host.
#
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 TORCH_VERSION=2.13.0 \
#       docker/gpu-layer.sh /opt/venv /wheels
#
# TORCH_INDEX_URL empty: torch from pip's own index (on a machine without GPUs, its CPU build).
# Then the layer must import every part of scriptserve, and ONNX Runtime must offer the CUDA
# provider (it lists it whether or not a GPU is present).
set -eu
venv=$1
wheels=$2
torch_version=${TORCH_VERSION:-2.13.0}
python3 -m venv "$venv"
pip="$venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check"
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    $pip --index-url "$TORCH_INDEX_URL" "torch==$torch_version"
else
    $pip "torch==$torch_version"
fi
set -- "$wheels"/scriptserve-*.whl
if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then
    echo "gpu-layer.sh: want exactly one scriptserve wheel in $wheels" >&2
    exit 1
fi
# torch held at the build just installed; the rest from PyPI.
$pip "torch==$torch_version" "$1[gpu]"
"$venv/bin/scriptserve" --help >/dev/null
"$venv/bin/python" - <<'EOF'
import importlib

import onnxruntime

for part in ("archiver", "handlers", "server", "server.cli", "training", "training.cli"):
    importlib.import_module(f"scriptserve.{part}")
providers = onnxruntime.get_available_providers()
if "CUDAExecutionProvider" not in providers:
    raise SystemExit(f"gpu-layer.sh: onnxruntime offers {providers}, not CUDAExecutionProvider")
print("scriptserve GPU layer:", ", ".join(providers))
EOF
