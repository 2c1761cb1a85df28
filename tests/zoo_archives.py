"""The zoo's models (examples/zoo.py) at their small size, built and archived once per test
session, in two child processes that the `zoo` fixture's head start (conftest.py) begins at
collection: their ten compiles (about three minutes of CPU on a 2-core Xeon, five on a 2-core
AMD EPYC with AVX2 only; each int8 archive is
measured against the package of the fp32 archive made before it, `--fp32-archive`, not one
compiled again) then run at low priority while the other tests run, and the tests that use them
run last.

    def test_x(zoo: ZooStore) -> None:
        zoo.archive("bert")                     # .pt2 fp32
        zoo.archive("resnet50", "static-int8")  # .pt2 int8
        zoo.model("bert")                       # the files model-archiver took
        zoo_reference("bert", inputs)           # the eager model's answer
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pt2models import INDUCTOR_CACHE, run_child, workdir

from examples.zoo import Built, built_in, greedy_continuation
from scriptserve.archiver.pt2_check import call_model

MODELS = ("bert", "embedder", "gpt2", "resnet50", "vit")
ARCHIVES: dict[tuple[str, str], tuple[str, ...]] = {
    ("bert", "none"): (),
    ("embedder", "none"): (),
    ("gpt2", "none"): (),
    ("resnet50", "none"): (),
    ("vit", "none"): (),
    # The image classifiers' heads are fitted to a task (examples/zoo.py:fitted_head), so
    # their int8 archives meet the default accuracy guard.
    ("resnet50", "static-int8"): (),
    ("vit", "dynamic-int8"): (),
    ("vit", "static-int8"): (),
    # BERT's dynamic int8 is the embedder's (the same encoder, the same quantization); BERT-base
    # itself is built through the guard by `python -m benchmarks.zoo --models bert`.
    ("embedder", "dynamic-int8"): (),
    ("gpt2", "dynamic-int8"): (),
}
"""The archives made, by (model, quantization), with their extra model-archiver arguments."""
MAX_BATCH = 16
GROUPS = (("bert", "embedder", "gpt2"), ("resnet50", "vit"))
"""The models built together in one child, each group with its archives: about half the
compiles' CPU each (on a 2-core AMD EPYC with AVX2 only, alone: 157 s the text models' steps,
128 s the image models')."""


@dataclass(frozen=True)
class ZooStore:
    """The built models and their archives."""

    root: Path

    def model(self, name: str) -> Built:
        return built_in(name, self.root / name)

    def archive(self, name: str, quantize: str = "none") -> Path:
        return self.root / "store" / f"{archive_name(name, quantize)}.mar"


def archive_name(name: str, quantize: str) -> str:
    return name if quantize == "none" else f"{name}_{quantize.replace('-', '_')}"


def build_zoo() -> ZooStore:
    """Write every zoo model and archive it, in two child processes at once, each a group of
    models (`GROUPS`) with their archives: torch, transformers and Inductor are imported once
    per group (a child per archive took about 40 s more), and the two groups' compiles, one
    compiler at a time each, use both cores when the rest of the suite leaves them idle."""
    store = ZooStore(workdir() / "zoo")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE)}
    with ThreadPoolExecutor(len(GROUPS)) as pool:
        builds = [
            pool.submit(run_child, __file__, [str(store.root), *group], f"building {group}", env)
            for group in GROUPS
        ]
        for build in builds:
            build.result()
    return store


def _build_here(root: Path, models: list[str]) -> None:
    """What a child of `build_zoo` does: each of `models`' files, then their archives."""
    from examples.zoo import build
    from scriptserve.archiver.cli import model_archiver_main

    store = ZooStore(root)
    for name in models:
        build(name, root / name, size="small")
    for (name, quantize), extra in ARCHIVES.items():
        if name not in models:
            continue
        args = store.model(name).archiver_args(
            archive_name(name, quantize), root / "store", "--max-batch", str(MAX_BATCH), *extra
        )
        if quantize != "none":  # measured against the fp32 archive's package, made above
            args += ["--quantize", quantize, "--fp32-archive", str(store.archive(name))]
        if model_archiver_main(args) != 0:
            raise SystemExit(f"model-archiver failed for {name} ({quantize})")


def zoo_eager(built: Built) -> Any:
    """The zoo model as model-archiver loads it: its class from model.py, its state dict."""
    return _eager(built.model_file, built.weights, built.model.model_class)


@functools.cache
def _eager(model_file: Path, weights: Path, model_class: str) -> Any:
    from scriptserve.archiver.model_source import load_eager_model

    return load_eager_model(model_file, weights, model_class)


def zoo_reference(built: Built, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The eager model's output on named inputs."""
    with torch.no_grad():
        return call_model(zoo_eager(built), inputs).numpy()


def zoo_greedy(built: Built, prompt: str, tokens: int) -> str:
    """The eager generator's greedy continuation of `prompt`, at most `tokens` tokens, decoded
    by its tokenizer (up to its end-of-text token)."""
    return greedy_continuation(built, zoo_eager(built), prompt, tokens).text


def zoo_torchscript(built: Built) -> Path:
    """The model traced to TorchScript."""
    path = built.root / f"{built.model.name}.pt"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(
            zoo_eager(built), example_kwarg_inputs=_example(built), strict=False
        )
        traced.save(str(path))
    return path


def zoo_onnx(built: Built) -> Path:
    """The model exported to ONNX (TorchScript-based exporter), batch and sequence dynamic."""
    inputs = _example(built)
    names = list(inputs)
    text = built.model.kind == "text"
    axes = {n: {0: "batch", 1: "seq"} if text else {0: "batch"} for n in names}
    path = built.root / f"{built.model.name}.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            zoo_eager(built),
            (),
            str(path),
            kwargs=inputs,
            input_names=names,
            output_names=["output0"],
            dynamic_axes={**axes, "output0": {0: "batch"}},
            dynamo=False,
        )
    return path


def archive_as(built: Built, fmt: str, dst: Path) -> Path:
    """The zoo model traced to TorchScript (`fmt` "torchscript") or exported to ONNX ("onnx"),
    archived by model-archiver (in this process) with its handler and files, as
    `<name>_<fmt>.mar` in `dst`."""
    from scriptserve.archiver.cli import model_archiver_main

    model = zoo_torchscript(built) if fmt == "torchscript" else zoo_onnx(built)
    name = f"{built.model.name}_{fmt}"
    argv = [
        "--model-name", name, "--version", "1.0", "--serialized-file", str(model),
        "--handler", built.model.handler, "--export-path", str(dst),
        "--extra-files", ",".join(str(p) for p in built.extra_files),
    ]  # fmt: skip
    if built.sample is not None:
        argv += ["--sample-input", str(built.sample), "--max-seq-len", "64"]
    else:
        argv += ["--input-shape", f"pixel_values=3,{built.image_size},{built.image_size}"]
    with contextlib.redirect_stdout(io.StringIO()):
        if model_archiver_main(argv) != 0:
            raise RuntimeError(f"model-archiver failed for {name}")
    return dst / f"{name}.mar"


def _example(built: Built) -> dict[str, torch.Tensor]:
    """Two rows of the validation samples, as tensors by name."""
    with np.load(built.validation) as data:
        return {n: torch.from_numpy(data[n][:2]) for n in data.files}


if __name__ == "__main__":
    _build_here(Path(sys.argv[1]), sys.argv[2:])
