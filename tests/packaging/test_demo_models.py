"""The demo models that `make demo-archive` and `make demo-textgen` archive: the scripts write
what the Makefile's model-archiver commands read, and the streaming demo's model continues its
text as the README shows."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

# Slow: the demo models trained and compiled as `make demo` does.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def greedy(model: torch.nn.Module, window: int, prompt: str, tokens: int) -> str:
    text = list(prompt.encode())
    with torch.inference_mode():
        for _ in range(tokens):
            ids = ([0] * window + text)[-window:]
            text.append(int(model(torch.tensor([ids])).argmax(-1)))
    return bytes(text[len(prompt.encode()) :]).decode()


def test_the_streaming_demo_model_continues_its_text(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(SCRIPTS / "textgen_model.py"), str(tmp_path)], check=True)
    textgen = load_script("textgen_model")
    model = textgen.ByteLM()
    model.load_state_dict(torch.load(tmp_path / "textgen-weights.pt", weights_only=True))
    model.eval()
    sample = json.loads((tmp_path / "textgen-sample.json").read_text())
    assert len(sample) == textgen.WINDOW and all(0 <= t < 256 for t in sample)
    assert greedy(model, textgen.WINDOW, "serving ", 14) == "a model means "
    assert greedy(model, textgen.WINDOW, "a good server ", 20) == "batches requests tog"


def test_the_demo_mlp_script_writes_its_weights_and_sample(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(SCRIPTS / "demo_model.py"), str(tmp_path)], check=True)
    demo = load_script("demo_model")
    model = demo.DemoMLP()
    model.load_state_dict(torch.load(tmp_path / "demo-weights.pt", weights_only=True))
    sample = torch.tensor([json.loads((tmp_path / "sample.json").read_text())])
    out = model(sample)
    assert out.shape == (1, 4) and abs(float(out.sum()) - 1.0) < 1e-5
