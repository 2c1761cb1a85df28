"""Sharded checkpoints for FSDP runs, with `torch.distributed.checkpoint` (DCP).

Every rank writes its own shards of the model and optimizer state (no rank gathers the whole
model), and DCP reshards on load: a checkpoint written by R ranks resumes on any other number,
one process included, since each tensor's global shape and the pieces each file holds are
recorded in the checkpoint's metadata.

Layout, under `checkpoints/sharded/`:

    epoch-0003/.metadata        DCP's index of the tensors (shapes, dtypes, which file holds what)
    epoch-0003/__0_0.distcp     rank 0's tensors, __1_0.distcp rank 1's, ...
    epoch-0003/trainer.pt       epoch, history, RNG and grad-scaler state, optimizer settings
    latest                      "epoch-0003": written last, atomically, so a crash mid-save
                                leaves the previous checkpoint the one resumed

Nothing is unpickled freely. DCP stores tensors as `torch.save` files (read with
`weights_only=True`), but its `.metadata` is a plain pickle and it unpickles non-tensor values
with `weights_only=False`. So only tensors go through DCP (the optimizer's `param_groups`, plain
settings, go to `trainer.pt`, read with `weights_only=True` like `last.pt`), the metadata is read
by an unpickler that builds DCP's own metadata classes and nothing else, and a checkpoint whose
index lists any non-tensor value is refused before DCP reads it.

>>> save_sharded(folder, model, optimizer, {"epoch": 3, "history": [...]}, info)
>>> trainer_state = load_sharded(folder, model, optimizer)  # None when there is none
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from scriptserve.training.distributed import DistInfo, barrier

log = logging.getLogger("training")

SHARDED_FOLDER = "sharded"
LATEST = "latest"
TRAINER_STATE = "trainer.pt"

# What DCP's `.metadata` pickle is made of (torch 2.13), and torch dtypes besides.
_METADATA_GLOBALS = frozenset(
    [
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + [
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "PosixPath"),  # the checkpoint's own path, recorded by DCP
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
    ]
)


class CheckpointError(ValueError):
    """A sharded checkpoint that cannot be read safely; the message says why."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or dtype:
            return super().find_class(module, name)
        raise CheckpointError(
            f"the checkpoint's metadata refers to {module}.{name}, which is not part of a "
            "torch.distributed.checkpoint index; refusing to load it"
        )


class _MetadataReader(FileSystemReader):
    """DCP's file reader, with the metadata read by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with (Path(self.path) / name).open("rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError("the checkpoint's metadata is not a DCP index")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def latest_sharded(folder: Path) -> Path | None:
    """The folder of the last complete sharded checkpoint under `folder`, if any."""
    pointer = folder / LATEST
    if not pointer.is_file():
        return None
    target = folder / pointer.read_text().strip()
    return target if (target / TRAINER_STATE).is_file() else None


def save_sharded(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    info: DistInfo,
) -> Path:
    """Every rank writes its shards of `epoch-NNNN/` (a collective); the main rank then writes
    `trainer_state` (tensors and plain types) and points `latest` at it."""
    target = folder / f"epoch-{int(trainer_state['epoch']):04d}"
    if info.is_main and target.exists():  # left by an attempt that failed mid-save
        shutil.rmtree(target)
    barrier(info)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors = {"model": model_state, "optimizer": optimizer_state["state"]}
    with warnings.catch_warnings():
        if not info.distributed:  # DCP warns when no process group is up: here that is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(tensors, storage_writer=FileSystemWriter(target), no_dist=not info.distributed)
    if info.is_main:
        state = {
            **trainer_state,
            "param_groups": optimizer_state["param_groups"],
            "world_size": info.world_size,
        }
        torch.save(state, target / TRAINER_STATE)
        tmp = folder / f".{LATEST}.tmp"
        tmp.write_text(target.name + "\n")
        os.replace(tmp, folder / LATEST)
        for old in folder.glob("epoch-*"):
            if old != target:
                shutil.rmtree(old, ignore_errors=True)
    barrier(info)
    return target


def load_sharded(
    folder: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    info: DistInfo,
) -> dict[str, Any] | None:
    """Load the latest checkpoint under `folder` into `model` and `optimizer` (in place,
    resharded to this run's world size; a collective) and return the trainer state saved with
    it, or None when there is no checkpoint."""
    target = latest_sharded(folder)
    if target is None:
        return None
    trainer_state: dict[str, Any] = torch.load(
        target / TRAINER_STATE, map_location="cpu", weights_only=True
    )
    # DCP would unpickle these with weights_only=False: none are written here, none are read.
    index = _MetadataReader(target).read_metadata().state_dict_metadata
    pickled = sorted(key for key, kind in index.items() if isinstance(kind, BytesStorageMetadata))
    if pickled:
        raise CheckpointError(
            f"the checkpoint in {target} stores {', '.join(pickled)} as pickled objects; "
            "sharded checkpoints written here hold tensors only, refusing to load it"
        )
    # The current state dicts are the templates DCP fills in place: their shapes, and each
    # rank's shards of them, say what this rank reads from the checkpoint's files.
    model_state, optimizer_state = get_state_dict(model, optimizer)
    tensors = {"model": model_state, "optimizer": optimizer_state["state"]}
    with warnings.catch_warnings():
        if not info.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(tensors, storage_reader=_MetadataReader(target), no_dist=not info.distributed)
    optimizer_state["param_groups"] = trainer_state.pop("param_groups")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    saved_by = int(trainer_state.get("world_size", 1))
    log.info(
        "loaded sharded checkpoint %s (written by %d rank%s, read by %d)",
        target,
        saved_by,
        "s" if saved_by > 1 else "",
        info.world_size,
    )
    return trainer_state
