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


TEXT = "the quick brown fox jumps over the lazy dog. "
"""What TinyLM learns to continue."""
WINDOW = 8


class TinyLM(nn.Module):
    """A next-byte model: the last WINDOW byte ids ([batch, WINDOW] int64) -> logits over the 256
    byte values ([batch, 256]). `trained_tiny_lm` fits it to TEXT, which it then continues;
    with `matmuls`, each call also does that many 256x256 matmuls of busy work (0.5 ms each on
    one core), without changing its output."""

    def __init__(self, window: int = WINDOW, matmuls: int = 0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(256, 16)
        self.fc1 = nn.Linear(window * 16, 64)
        self.fc2 = nn.Linear(64, 256)
        self.matmuls = matmuls
        self.register_buffer("w", torch.randn(256, 256) / 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        z = self.w
        for _ in range(self.matmuls):
            z = torch.tanh(z @ self.w)
        hidden = torch.relu(self.fc1(self.embed(tokens).flatten(1)))
        return self.fc2(hidden) + 0.0 * z[0, 0]


def trained_tiny_lm(matmuls: int = 0, steps: int = 300) -> TinyLM:
    """TinyLM fitted to TEXT (about a second on one core)."""
    model = TinyLM(matmuls=0)
    data = (TEXT * 3).encode()
    windows = torch.tensor([list(data[i : i + WINDOW]) for i in range(len(TEXT))])
    targets = torch.tensor([data[i + WINDOW] for i in range(len(TEXT))])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(windows), targets).backward()
        optimizer.step()
    model.matmuls = matmuls
    return model.eval()


def greedy_text(model: nn.Module, prompt: str, tokens: int) -> str:
    """What greedy decoding with `model` appends to `prompt` (left zero-padded windows, as the
    text_generator handler builds them), computed eagerly."""
    text = list(prompt.encode())
    with torch.inference_mode():
        for _ in range(tokens):
            window = ([0] * WINDOW + text)[-WINDOW:]
            text.append(int(model(torch.tensor([window])).argmax(-1)))
    return bytes(text[len(prompt.encode()) :]).decode()
