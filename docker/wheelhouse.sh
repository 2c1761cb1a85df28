#!/bin/sh
# Every wheel the CPU image installs, into DIR (default build/wheelhouse), so that the image
# builds with no network:   docker/wheelhouse.sh [DIR]
# Only scriptserve's own wheel, the one both images install (the GPU image takes its other
# packages from the indexes as it builds):   docker/wheelhouse.sh --project-only DIR
#
# `pip wheel -c constraints.txt` takes torch==2.13.0, the CPU wheel (no CUDA packages). The
# wheels are for the Python running this script: use the same minor version as the image's
# base (3.11 for python:3.11-slim and Debian bookworm), or set PYTHON. The dependencies are
# fetched again only when pyproject.toml or constraints.txt change; the project's own wheel is
# rebuilt every time, from a clean copy of its packages (no stale build/lib).
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
project_only=false
if [ "${1:-}" = "--project-only" ]; then
    project_only=true
    shift
fi
dir=${1:-$root/build/wheelhouse}
python=${PYTHON:-python3}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

want=$(cat "$root/pyproject.toml" "$root/constraints.txt" | sha256sum | cut -d' ' -f1)
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
cp "$root/pyproject.toml" "$root/README.md" "$root/__init__.py" "$root/__main__.py" \
    "$root/py.typed" "$src/"
for package in archiver handlers server training; do
    if [ -d "$root/$package" ]; then cp -R "$root/$package" "$src/"; fi
done
find "$src" -name __pycache__ -prune -exec rm -rf {} +

rm -f "$dir"/scriptserve-*.whl
if $project_only; then
    "$python" -m pip wheel -q --no-deps -w "$dir" "$src"
    exit 0
fi
if [ "$(cat "$dir/.inputs" 2>/dev/null || true)" = "$want" ]; then
    "$python" -m pip wheel -q --no-deps -w "$dir" "$src"
else
    rm -f "$dir"/*.whl "$dir/.inputs"
    # The onnx extra: the CPU build of ONNX Runtime.
    "$python" -m pip wheel -q -c "$root/constraints.txt" -w "$dir" "$src[onnx]"
    echo "$want" > "$dir/.inputs"
fi
if ls "$dir" | grep -Eiq '^nvidia[-_]|^triton-|[+]cu[0-9]+'; then
    echo "wheelhouse.sh: CUDA packages in $dir; torch must be the CPU wheel" >&2
    exit 1
fi
ls "$dir"/torch-*+cpu-*.whl >/dev/null
