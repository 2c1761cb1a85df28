"""TorchServe's gRPC client modules, compiled from the project's protos the way TorchServe's docs
compile its own (`inference_pb2[_grpc]`, `management_pb2[_grpc]`), once per test process.

Tests use these rather than `server/grpc/_generated`: both register the same message names in
protobuf's default pool under different file names, so only one of them can be imported into a
process. (Likewise the OIP messages come from tritonclient's `service_pb2` in tests.)
"""

from __future__ import annotations

import functools
import importlib
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

PROTO_DIR = Path(__file__).resolve().parents[1] / "server" / "grpc" / "proto"


def proto_include_paths() -> list[Path]:
    """grpc_tools' well-known types and googleapis-common-protos (google/rpc/status.proto)."""
    import google.rpc
    import grpc_tools

    common = Path(next(iter(google.rpc.__path__))).parent.parent
    return [Path(grpc_tools.__file__).parent / "_proto", common]


@functools.cache
def torchserve_stubs() -> SimpleNamespace:
    """`.ts`, `.ts_grpc`, `.mgmt`, `.mgmt_grpc`: the four generated modules."""
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="torchserve_client_"))
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        *(f"-I{p}" for p in proto_include_paths()),
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "inference.proto",
        "management.proto",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("grpc_tools.protoc failed on server/grpc/proto")
    names = ["inference_pb2", "inference_pb2_grpc", "management_pb2", "management_pb2_grpc"]
    sys.path.insert(0, str(out))
    try:
        modules = {name: importlib.import_module(name) for name in names}
    finally:
        sys.path.remove(str(out))
    return SimpleNamespace(
        ts=modules["inference_pb2"],
        ts_grpc=modules["inference_pb2_grpc"],
        mgmt=modules["management_pb2"],
        mgmt_grpc=modules["management_pb2_grpc"],
    )
