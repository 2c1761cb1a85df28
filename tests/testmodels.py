"""Real models for the tests: small TorchScript and ONNX files made on the spot."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn


class TinyMLP(nn.Module):
    """8 -> 16 -> 3 with fixed seed weights; outputs depend on every input value."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class SlowMLP(nn.Module):
    """TinyMLP's exact output after `matmuls` 256x256 matmuls of busy work per call (200: about
    0.1 s on one core), so that requests queue behind a busy worker. Compare with
    `reference_output`; the work does not grow with the batch, so batching pays off."""

    def __init__(self, matmuls: int = 200) -> None:
        super().__init__()
        tiny = TinyMLP()
        self.fc1 = tiny.fc1
        self.fc2 = tiny.fc2
        self.matmuls = matmuls
        self.register_buffer("w", torch.randn(256, 256) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.w
        for _ in range(self.matmuls):
            z = torch.tanh(z @ self.w)
        # tanh keeps z finite, so adding 0 * z leaves TinyMLP's output unchanged.
        return self.fc2(torch.relu(self.fc1(x))) + 0.0 * z[0, 0]


def reference_output(x: np.ndarray) -> np.ndarray:
    """TinyMLP's output computed eagerly, to compare served results against."""
    with torch.inference_mode():
        return TinyMLP().eval()(torch.from_numpy(x)).numpy()


def save_torchscript(path: Path, module: nn.Module | None = None) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script((module or TinyMLP()).eval()).save(str(path))
    return path


def save_onnx(path: Path, module: nn.Module | None = None) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            (module or TinyMLP()).eval(),
            (torch.zeros(1, 8),),
            str(path),
            input_names=["x"],
            output_names=["y"],
            dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
            dynamo=False,
        )
    return path
