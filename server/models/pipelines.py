"""Ensembles over the Open Inference Protocol: a pipeline of models served as one model, with
Triton's ensemble semantics.

A pipeline is a YAML file (`<name>.pipeline.yaml` in the model store, registered like an
archive: at startup, or `POST /models?url=<name>.pipeline.yaml`):

    steps:
      - model: detector            # a model the server holds
        inputs: {images: image}    # the step's input: a pipeline tensor
        outputs: {boxes: boxes}    # the step's output: the pipeline tensor it becomes
      - model: classifier
        inputs: {x: boxes}
        outputs: {output0: label}
    outputs: [label]               # what the pipeline answers with (default: every tensor no
                                   # step takes)

The pipeline's inputs are the tensors no step makes; their types and shapes, and those of its
outputs, are read from the steps' models' signatures. The pipeline is `/v2/models/{name}/infer`
(REST, JSON or binary) and gRPC `ModelInfer`, has metadata and is ready only when every step's
model is. The run is `inference/pipeline_run.py`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from scriptserve.archiver.manifest import ManifestError, check_model_name
from scriptserve.handlers.runtime.signature import TensorSpec
from scriptserve.server.errors import Conflict, InvalidInput, ModelNotFound, ModelNotReady

log = logging.getLogger("scriptserve.pipelines")

SUFFIX = ".pipeline.yaml"
VERSION = "1"
"""A pipeline's one version, as its metadata lists it."""


class PipelineError(InvalidInput):
    """A pipeline file that cannot be served; the message says what to fix."""


@dataclass(frozen=True)
class Step:
    """One model of a pipeline, and how its tensors map to the pipeline's."""

    model: str
    version: str | None
    inputs: dict[str, str]
    """The step's input name -> the pipeline tensor it takes."""
    outputs: dict[str, str]
    """The step's output name -> the pipeline tensor it makes."""


@dataclass(frozen=True)
class Pipeline:
    name: str
    steps: tuple[Step, ...]
    inputs: tuple[str, ...]
    """Pipeline tensors no step makes: what a request must carry."""
    outputs: tuple[str, ...]
    source: Path

    def describe(self) -> dict[str, Any]:
        return {
            "steps": [
                {"model": s.model, "version": s.version, "inputs": s.inputs, "outputs": s.outputs}
                for s in self.steps
            ],
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }


def parse_pipeline(name: str, spec: Any, source: Path) -> Pipeline:
    """Read a pipeline file's document; raises PipelineError saying what is wrong."""
    try:
        check_model_name(name)
    except ManifestError as exc:
        raise PipelineError(str(exc)) from None
    if not isinstance(spec, dict) or not isinstance(spec.get("steps"), list) or not spec["steps"]:
        raise PipelineError(f"pipeline {name!r} needs `steps`: a list of models")
    steps = []
    made: dict[str, str] = {}
    for i, entry in enumerate(spec["steps"]):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise PipelineError(f"pipeline {name!r} step {i} needs a `model`")
        maps = {}
        for key in ("inputs", "outputs"):
            value = entry.get(key)
            if (
                not isinstance(value, dict)
                or not value
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
            ):
                raise PipelineError(
                    f"pipeline {name!r} step {i} ({entry['model']}) needs `{key}`: a mapping of "
                    "the model's tensor names to the pipeline's"
                )
            maps[key] = dict(value)
        for tensor in maps["outputs"].values():
            if tensor in made:
                raise PipelineError(
                    f"pipeline {name!r}: tensor {tensor!r} is made by two steps "
                    f"({made[tensor]} and {entry['model']})"
                )
            made[tensor] = entry["model"]
        version = entry.get("version")
        steps.append(
            Step(entry["model"], str(version) if version else None, maps["inputs"], maps["outputs"])
        )
    taken = {t for s in steps for t in s.inputs.values()}
    inputs = tuple(sorted(taken - set(made)))
    if not inputs:
        raise PipelineError(f"pipeline {name!r} has no input: every tensor a step takes is made")
    outputs = spec.get("outputs") or sorted(set(made) - taken)
    if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        raise PipelineError(f"pipeline {name!r}: `outputs` must be a list of tensor names")
    for tensor in outputs:
        if tensor not in made:
            raise PipelineError(f"pipeline {name!r}: output {tensor!r} is made by no step")
    _check_order(name, steps, set(inputs))
    return Pipeline(name, tuple(steps), inputs, tuple(outputs), source)


def _check_order(name: str, steps: list[Step], given: set[str]) -> None:
    """Every step can run once the tensors before it exist: no cycle."""
    have, left = set(given), list(steps)
    while left:
        ready = [s for s in left if set(s.inputs.values()) <= have]
        if not ready:
            stuck = ", ".join(s.model for s in left)
            raise PipelineError(f"pipeline {name!r}: steps {stuck} wait on each other (a cycle)")
        for step in ready:
            have |= set(step.outputs.values())
            left.remove(step)


class Pipelines:
    """The pipelines a server holds, by name; `versions` looks up a step's model version's
    signature (the registry's)."""

    def __init__(self) -> None:
        self._pipelines: dict[str, Pipeline] = {}

    def get(self, name: str) -> Pipeline | None:
        return self._pipelines.get(name)

    def names(self) -> list[str]:
        return sorted(self._pipelines)

    def all(self) -> list[Pipeline]:
        return [self._pipelines[n] for n in self.names()]

    def load(
        self, source: Path, name: str | None = None, taken: set[str] | None = None
    ) -> Pipeline:
        """Read and hold the pipeline file `source` (its name: `name`, else the file's)."""
        label = name or source.name.removesuffix(SUFFIX)
        try:
            spec = yaml.safe_load(source.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise PipelineError(f"pipeline file {source.name} does not read: {exc}") from None
        pipeline = parse_pipeline(label, spec, source)
        if label in self._pipelines or (taken is not None and label in taken):
            raise Conflict(f"model {label!r} is already registered")
        self._pipelines[label] = pipeline
        log.info(
            "pipeline=%s registered: %s",
            label,
            " -> ".join(step.model for step in pipeline.steps),
        )
        return pipeline

    def remove(self, name: str) -> Pipeline:
        pipeline = self._pipelines.pop(name, None)
        if pipeline is None:
            raise ModelNotFound(f"model {name!r} is not registered")
        return pipeline


def tensor_specs(
    pipeline: Pipeline, signature_of: Any
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The pipeline's inputs and outputs as its steps' models declare those tensors;
    `signature_of(model, version)` is a step model's signature. Raises ModelNotReady when a
    step's model is not there."""
    found_in: dict[str, TensorSpec] = {}
    found_out: dict[str, TensorSpec] = {}
    for step in pipeline.steps:
        signature = signature_of(step.model, step.version)
        by_name_in = {t.name: t for t in signature.inputs}
        by_name_out = {t.name: t for t in signature.outputs}
        for own, tensor in step.inputs.items():
            if own in by_name_in and tensor in pipeline.inputs:
                spec = by_name_in[own]
                found_in.setdefault(tensor, TensorSpec(tensor, spec.datatype, spec.shape))
        for own, tensor in step.outputs.items():
            if own in by_name_out:
                spec = by_name_out[own]
                found_out[tensor] = TensorSpec(tensor, spec.datatype, spec.shape)
    missing = [t for t in pipeline.inputs if t not in found_in]
    if missing:
        raise ModelNotReady(
            f"pipeline {pipeline.name!r}: no step's model declares input {missing[0]!r}"
        )
    inputs = tuple(found_in[t] for t in pipeline.inputs)
    outputs = tuple(found_out[t] for t in pipeline.outputs if t in found_out)
    return inputs, outputs
