"""Checkpoints every epoch: model, optimizer, grad scaler, epoch, history and every RNG state.

Everything is stored as tensors and plain Python types so that `torch.load(...,
weights_only=True)` reads it back: no pickled objects are ever loaded. DDP and single-process
runs write one file, `last.pt`, from rank 0; FSDP runs write sharded checkpoints, every rank its
shards (sharded_checkpoint.py). `save_training` / `restore_training` pick the one the strategy
writes.

>>> save_checkpoint(path, state)
>>> state = load_checkpoint(path)
>>> save_training(folder, model, optimizer, {"epoch": 3, ...}, info, sharded=False)
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from scriptserve.training.distributed import DistInfo, barrier
from scriptserve.training.strategy import unwrap

CHECKPOINT_NAME = "last.pt"
# sharded_checkpoint imports torch.distributed.checkpoint, about a second of CPU: it is
# imported where it is used, by FSDP runs and by resumes, and not by every DDP run.


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


def save_training(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    info: DistInfo,
    *,
    sharded: bool,
) -> None:
    """One epoch's checkpoint under `folder`: `sharded/` (every rank) or `last.pt` (rank 0).

    `trainer_state` holds everything but the model and optimizer: epoch, history, RNG, scaler.
    """
    if sharded:
        from scriptserve.training.sharded_checkpoint import SHARDED_FOLDER, save_sharded

        save_sharded(folder / SHARDED_FOLDER, model, optimizer, trainer_state, info)
    elif info.is_main:
        save_checkpoint(
            folder / CHECKPOINT_NAME,
            {
                **trainer_state,
                "model": unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
            },
        )
    barrier(info)


def restore_training(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    map_location: torch.device,
    info: DistInfo,
    *,
    sharded: bool,
) -> dict[str, Any] | None:
    """Load the checkpoint under `folder` that this strategy writes into `model` and
    `optimizer`, and return the rest of its state; None when there is none to resume.

    A checkpoint of the other kind is not converted: resuming it is refused, with the way out.
    """
    from scriptserve.training.sharded_checkpoint import SHARDED_FOLDER, latest_sharded, load_sharded

    whole, shards = folder / CHECKPOINT_NAME, folder / SHARDED_FOLDER
    has_whole, has_shards = whole.is_file(), latest_sharded(shards) is not None
    mine, theirs = (has_shards, has_whole) if sharded else (has_whole, has_shards)
    if theirs and not mine:
        writer = "ddp" if sharded else "fsdp"
        raise ValueError(
            f"the checkpoint in {folder} was written by a {writer} run; resume it with "
            f"--strategy {writer}, or start afresh in another --work-dir"
        )
    if sharded:
        return load_sharded(shards, model, optimizer, info)
    if not has_whole:
        return None
    state = load_checkpoint(whole, map_location)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state
