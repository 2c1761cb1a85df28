"""The benchmark models: built with fixed seeds, scripted, archived, and timed in-process.

- `mlp`: 512 -> 1024 -> 1024 -> 10; cheap enough that serving overhead dominates (scenario A).
- `linear`: 512 -> 10, the MLP's input at next to none of its compute (`benchmarks.model_cost`).
- `cnn`: a small VGG-style CNN on 3x32x32 (two 3x3 convs per stage, 32/64/128 channels, about
  39 M multiply-adds), where the model's own compute is the larger part of a request (scenario B).
- `Holder` (`build_holders`): a model holding a given number of MiB of weights that answers its
  own number, for many models on one node (`benchmarks.many_models`, tests/server/).
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from scriptserve.archiver.cli import model_archiver_main


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.layers(x)
        return y


class Linear(nn.Module):
    """Scenario A's input into one 512 -> 10 layer: about 1/300 of the MLP's multiply-adds, a
    model that costs next to nothing, to show what the request path costs without one."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(512, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.layer(x)
        return y


def _conv(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *_conv(3, 32),
            *_conv(32, 32),
            nn.MaxPool2d(2),
            *_conv(32, 64),
            *_conv(64, 64),
            nn.MaxPool2d(2),
            *_conv(64, 128),
            *_conv(128, 128),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(128 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.head(torch.flatten(self.features(x), 1))
        return y


@dataclass(frozen=True)
class BenchModel:
    """A scripted model on disk, its archive, and one request body (one row as a JSON array)."""

    name: str
    scripted: Path
    archive: Path
    body: Path
    row_shape: tuple[int, ...]


_MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (512,)),
    "linear": (Linear, (512,)),
    "cnn": (SmallCNN, (3, 32, 32)),
}


def build(name: str, workdir: Path, store: Path, version: str = "1.0") -> BenchModel:
    """Script `name` with seed 0, write a one-row JSON body, archive both into `store`."""
    cls, row_shape = _MODELS[name]
    workdir.mkdir(parents=True, exist_ok=True)
    store.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    scripted = workdir / f"{name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(cls().eval()).save(str(scripted))  # type: ignore[no-untyped-call]
    # float64 before rounding, so the JSON holds short decimals rather than float32 expansions.
    row = np.random.default_rng(0).standard_normal(row_shape)
    body = workdir / f"{name}.json"
    body.write_text(json.dumps(np.round(row, 4).tolist()))
    with contextlib.redirect_stdout(io.StringIO()):  # it prints the archive's path
        model_archiver_main(
            [
                "--model-name",
                name,
                "--version",
                version,
                "--serialized-file",
                str(scripted),
                "--handler",
                "tensor",
                "--sample-input",
                str(body),
                "--export-path",
                str(store),
                "-f",
            ]
        )
    return BenchModel(name, scripted, store / f"{name}.mar", body, row_shape)


def model_latency_ms(model: BenchModel, threads: int, runs: int = 2000) -> float:
    """Median in-process latency of the scripted model at batch 1, on `threads` intra-op threads.

    This is the floor for a one-connection request: the server runs the same module on the
    same input, so anything above it is serving overhead (HTTP, JSON, queueing, threads).
    """
    torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(model.scripted)).eval()  # type: ignore[no-untyped-call]
    x = torch.from_numpy(np.asarray(json.loads(model.body.read_text()), np.float32)[None])
    times = []
    with torch.inference_mode():
        for _ in range(max(10, runs // 10)):
            module(x)
        for _ in range(runs):
            started = time.perf_counter()
            module(x)
            times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


class Holder(nn.Module):
    """`mib` MiB of random weights (an archive of them does not compress); answers `ident` for
    every row of an (N, 8) input, so that an answer says which model gave it. With `busy`, each
    call first multiplies a 256x256 matrix that many times (about 0.1 ms each on one core)."""

    def __init__(self, ident: int, mib: float, busy: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(ident)
        weight = torch.rand(max(1, int(mib * 262144)), generator=generator)
        weight[0] = ident
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.busy = busy
        self.square = nn.Parameter(torch.eye(256), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.square
        for _ in range(self.busy):
            y = y @ self.square
        return x.sum(dim=1, keepdim=True) * 0.0 + self.weight[:1] + y[0, 1]


def build_holders(
    root: Path,
    sizes_mib: list[float],
    prefix: str = "m",
    archive_format: str = "default",
    busy: int = 0,
) -> Path:
    """Archives `<prefix>0`, `<prefix>1`, ... in `root / "store"`, model i holding
    `sizes_mib[i]` MiB (and `busy` for each call), each with an (N, 8) FP32 sample;
    `no-archive` makes directories (no extraction at registration)."""
    store = root / "store"
    work = root / "models"
    work.mkdir(parents=True, exist_ok=True)
    sample = work / "sample.json"
    sample.write_text(json.dumps([0.5] * 8))
    for i, mib in enumerate(sizes_mib):
        path = work / f"{prefix}{i}.pt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = Holder(i, mib, busy).eval()
            torch.jit.script(module).save(str(path))  # type: ignore[no-untyped-call]
        argv = ["--model-name", f"{prefix}{i}", "--version", "1.0", "--serialized-file", str(path)]
        argv += ["--handler", "tensor", "--sample-input", str(sample), "--export-path", str(store)]
        argv += ["--archive-format", archive_format]
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the archive's path
            if model_archiver_main(argv) != 0:
                raise RuntimeError(f"model-archiver failed for {path}")
        path.unlink()
    return store


HEADER_LENGTH = "Inference-Header-Content-Length"
"""The OIP binary extension's header: the length of the JSON part of a binary body."""


@dataclass(frozen=True)
class Route:
    key: str
    path: str
    body: Path
    headers: Mapping[str, str]


def routes(model: BenchModel, workdir: Path) -> list[Route]:
    """The same float32 row three ways: TorchServe JSON, OIP JSON, OIP binary."""
    row = np.asarray(json.loads(model.body.read_text()), dtype="<f4")[None]
    tensor = {"name": "x", "shape": list(row.shape), "datatype": "FP32"}
    oip_json = workdir / "oip.json"
    # The same numbers as the same text: the row's JSON array, inside OIP's envelope.
    envelope = json.dumps({"inputs": [{**tensor, "data": None}]}).encode()
    oip_json.write_bytes(envelope.replace(b"null", model.body.read_bytes().strip()))
    raw = row.tobytes()
    head = json.dumps(
        {
            "inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}],
            "parameters": {"binary_data_output": True},
        },
        separators=(",", ":"),
    ).encode()
    oip_binary = workdir / "oip.bin"
    oip_binary.write_bytes(head + raw)
    json_post = {"Content-Type": "application/json"}
    return [
        Route("torchserve", f"/predictions/{model.name}", model.body, json_post),
        Route("oip_json", f"/v2/models/{model.name}/infer", oip_json, json_post),
        Route(
            "oip_binary",
            f"/v2/models/{model.name}/infer",
            oip_binary,
            {
                "Content-Type": "application/octet-stream",
                HEADER_LENGTH: str(len(head)),
            },
        ),
    ]
