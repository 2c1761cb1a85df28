"""The models a `.pt2` package is compiled from: an eager `nn.Module` (its class in a Python
file, its state dict) or an ExportedProgram saved with `torch.export.save`.

Nothing is unpickled: the state dict is read with `torch.load(..., weights_only=True)`, and an
ExportedProgram that would need pickle to load is refused before torch.export.load sees it.

    model = load_eager_model(Path("model.py"), Path("weights.pt"), class_name=None)
    program = load_exported_program(Path("model_program.pt2"))
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import io
import json
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from scriptserve.archiver.model_file import ModelFileError, error_line

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram


def load_eager_model(model_file: Path, weights: Path, class_name: str | None) -> torch.nn.Module:
    """The `nn.Module` class of `model_file` (the one it defines, or `class_name`), built
    without arguments, with the state dict in `weights` read with weights_only=True."""
    import torch

    digest = hashlib.sha256(model_file.read_bytes()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"scriptserve_eager_{digest}", model_file)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"model file {model_file.name!r} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    # Registered under its own name, as an import would: dataclasses and torch.export look
    # the class's module up there.
    sys.modules[spec.name] = module
    sys.path.insert(0, str(model_file.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[spec.name]
        raise ModelFileError(f"model file {model_file.name!r} failed: {exc!r}") from None
    finally:
        sys.path.remove(str(model_file.parent))
    classes = {
        n: c
        for n, c in inspect.getmembers(module, inspect.isclass)
        if issubclass(c, torch.nn.Module) and c.__module__ == module.__name__
    }
    if class_name is not None and class_name not in classes:
        raise ModelFileError(f"{model_file.name} defines no nn.Module named {class_name!r}")
    if class_name is None and len(classes) != 1:
        raise ModelFileError(
            f"{model_file.name} defines {len(classes)} nn.Module classes "
            f"({', '.join(classes) or 'none'}); name the one to use with --model-class"
        )
    model = classes[class_name or next(iter(classes))]()
    try:
        state = _read_state_dict(weights)
        model.load_state_dict(state)
    except Exception as exc:
        raise ModelFileError(
            f"the weights in {weights.name!r} are not a state dict of "
            f"{type(model).__name__} (read with weights_only=True): {error_line(exc)}"
        ) from None
    return model.eval()


def _read_state_dict(weights: Path) -> dict[str, torch.Tensor]:
    """A state dict from a `torch.save` file (weights_only) or a `.safetensors` file (a Hugging
    Face checkpoint, `model.safetensors`)."""
    import torch

    if weights.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ModelFileError(
                f"{weights.name} is a safetensors file: pip install safetensors to read it"
            ) from None
        return load_file(str(weights), device="cpu")
    state = torch.load(weights, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelFileError(f"{weights.name} holds a {type(state).__name__}, not a state dict")
    return state


_PAYLOAD_CONFIGS = ("data/weights/", "data/constants/")
_TORCH_SAVED = ("data/sample_inputs/", "data/constants/")


def _pickled(path: Path, rel: str, raw: bytes) -> list[str]:
    """The names a payload config says are stored with pickle (tensor subclasses, objects)."""
    try:
        config = json.loads(raw)
    except ValueError:
        raise ModelFileError(f"{path.name}: {rel} is not valid JSON") from None
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise ModelFileError(f"{path.name}: {rel} has no 'config' object")
    return [
        str(fqn)
        for fqn, meta in entries.items()
        if not isinstance(meta, dict)
        or meta.get("use_pickle")
        or str(meta.get("path_name", "")).startswith(("custom_obj_", "opaque_obj_"))
    ]


def _check_no_pickle(path: Path) -> None:
    """Refuse an ExportedProgram whose loading would unpickle: torch.export.load reads tensor
    subclasses and custom objects with pickle, and retries a failed weights_only load
    without it."""
    import torch

    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            rel = name.partition("/")[2]
            if rel.startswith(_PAYLOAD_CONFIGS) and rel.endswith("_config.json"):
                pickled = _pickled(path, rel, zf.read(name))
                if pickled:
                    raise ModelFileError(
                        f"{path.name}: {pickled[0]!r} is stored with pickle, which scriptserve "
                        "does not load; export a model of plain tensors"
                    )
            elif rel.startswith(_TORCH_SAVED) and rel.endswith(".pt"):
                try:
                    torch.load(io.BytesIO(zf.read(name)), weights_only=True)
                except Exception:
                    raise ModelFileError(
                        f"{path.name}: {rel} does not load with weights_only=True; "
                        "scriptserve does not unpickle it"
                    ) from None


def load_exported_program(path: Path) -> ExportedProgram:
    """An ExportedProgram saved with torch.export.save, once it is known to need no pickle."""
    import torch

    _check_no_pickle(path)
    try:
        return torch.export.load(str(path))
    except Exception as exc:
        raise ModelFileError(f"{path.name} does not load as an ExportedProgram: {exc}") from None
