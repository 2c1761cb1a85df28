"""Checkpoints every epoch: model, optimizer, grad scaler, epoch, history and every RNG state.

Everything is stored as tensors and plain Python types so that `torch.load(...,
weights_only=True)` reads it back: no pickled objects are ever loaded.

>>> save_checkpoint(path, state)
>>> state = load_checkpoint(path)
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_NAME = "last.pt"


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) generator states as tensors and lists."""
    version, internal, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    keys = nps["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, nps["pos"], nps["has_gauss"], nps["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write atomically: a crash mid-write leaves the previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=True)
    return state
