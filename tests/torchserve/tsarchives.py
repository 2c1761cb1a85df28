"""TorchServe-style handler sources and the helpers that pack them with torch-model-archiver."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import torch

CLASS_HANDLER = '''
import json

import torch
from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import PredictionException


class ScoresHandler(BaseHandler):
    """Scores per request, plus how many requests shared the batch."""

    def preprocess(self, data):
        rows = []
        for i, row in enumerate(data):
            value = row.get("data") or row.get("body")
            if isinstance(value, (bytes, bytearray)):
                value = json.loads(value)
            if value == "fail":
                raise PredictionException("asked to fail", 513)
            echo = self.context.get_request_header(i, "x-echo")
            if echo:
                self.context.set_response_header(i, "x-echoed", echo)
            rows.append(value)
        self.batch = len(data)
        return torch.tensor(rows, dtype=torch.float32)

    def postprocess(self, data):
        props = self.context.system_properties
        return [
            {"scores": row, "batch": self.batch, "max_batch": props["batch_size"]}
            for row in data.tolist()
        ]
'''

FUNCTION_HANDLER = """
import json

from ts.torch_handler.base_handler import BaseHandler

_service = BaseHandler()


def handle(data, context):
    if not _service.initialized:
        _service.initialize(context)
    if data is None:
        return None
    rows = [row.get("data") or row.get("body") for row in data]
    rows = [json.loads(r) if isinstance(r, (bytes, bytearray)) else r for r in rows]
    scores = _service.postprocess(_service.inference(_service.preprocess(rows)))
    return [{"label": max(range(len(s)), key=s.__getitem__), "batch": len(data)} for s in scores]
"""

ENTRY_POINT_HANDLER = """
import json
import os

import torch

_model = None


def handle(data, context):
    return ["the module-level handle must not be the entry point"] * len(data or [])


def predict(data, context):
    global _model
    if data is None:
        props = context.system_properties
        path = os.path.join(props["model_dir"], context.manifest["model"]["serializedFile"])
        _model = torch.jit.load(path)
        return None
    rows = [row.get("data") or row.get("body") for row in data]
    rows = [json.loads(r) if isinstance(r, (bytes, bytearray)) else r for r in rows]
    with torch.inference_mode():
        out = _model(torch.tensor(rows, dtype=torch.float32))
    context.set_response_content_type(0, "application/json")
    return [{"sum": float(row.sum()), "request_id": context.get_request_id(i), "batch": len(data)}
            for i, row in enumerate(out)]
"""

MISMATCH_HANDLER = """
from ts.torch_handler.base_handler import BaseHandler


class DropsOne(BaseHandler):
    def preprocess(self, data):
        return data

    def inference(self, data):
        return data

    def postprocess(self, data):
        return [{"ok": True}] * (len(data) - 1)
"""


BATCH_CONFIG = "batchSize: 8\nmaxBatchDelay: 400\nminWorkers: 1\nmaxWorkers: 2\n"


def torch_model_archiver(src: Path, out: Path, name: str, *args: str) -> Path:
    done = subprocess.run(
        [
            "torch-model-archiver",
            "--model-name",
            name,
            "--version",
            "1.0",
            "--export-path",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=src,
    )
    assert done.returncode == 0, done.stderr
    return out / f"{name}.mar"


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def instance(i: int) -> list[float]:
    """One model input (8 numbers), different per i."""
    return [round(0.1 * i + 0.05 * j, 3) for j in range(8)]


def tensor(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)
