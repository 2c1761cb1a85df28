"""TorchServe workflows: `.war` archives made by `torch-workflow-archiver`, registered and run as
TorchServe runs them.

A `.war` holds `WAR-INF/MANIFEST.json` (`workflow`: `workflowName`, `specFile`, `handler`), the
specification YAML and the handler file. The specification's `models` section gives settings
for every model (`min-workers`, `max-workers`, `batch-size`, `max-batch-delay`,
`retry-attempts`, `timeout-ms`) and, under a model's name, its archive (`url`) and its own
settings; `dag` maps each node to the nodes its output goes to. A node named in `models` is a
model; any other node is a function of the handler file, called as TorchServe calls a handler
entry point, `function(data, context)` (with `data` None once, at load).

Every node is served as a model of its own, named `<workflow>__<node>` as TorchServe names them:
model nodes from their archives in the model store, function nodes from a handler-only archive
made here. So each step has its own batcher and workers, and its requests batch with the other
workflow requests' at that step. The run itself is `inference/workflow_run.py`.

    workflows = Workflows(registry, management, settings)
    await workflows.register("dogs.war")  # the store's .war, its models, its functions
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from scriptserve.archiver.extract import safe_extract
from scriptserve.archiver.manifest import ManifestError, check_model_name
from scriptserve.server.errors import Conflict, InvalidInput, ModelNotFound, ServingError
from scriptserve.server.models.management import Management
from scriptserve.server.models.registry import ModelRegistry
from scriptserve.server.settings import ServerSettings

log = logging.getLogger("scriptserve.workflows")

SEPARATOR = "__"
"""Between a workflow's name and a node's in the node's model name (TorchServe's)."""
_SETTINGS = {
    "min-workers": int,
    "max-workers": int,
    "batch-size": int,
    "max-batch-delay": int,
    "retry-attempts": int,
    "timeout-ms": int,
}
_DEFAULTS = {
    "min-workers": 1,
    "max-workers": 1,
    "batch-size": 1,
    "max-batch-delay": 50,
    "retry-attempts": 1,
    "timeout-ms": 10000,
}
"""TorchServe's defaults for a workflow's models."""


_UNREADABLE = (OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile, yaml.YAMLError)
"""What reading a `.war` that is not one raises."""


def _reason(exc: BaseException) -> str:
    """What was wrong with a `.war`, in words that name no server path."""
    if isinstance(exc, KeyError):
        return f"its WAR-INF/MANIFEST.json has no {exc.args[0]!r}"
    if isinstance(exc, OSError):
        name = Path(exc.filename).name if exc.filename else "a file"
        return f"{name} is missing or cannot be read"
    if isinstance(exc, yaml.YAMLError):
        return "its specification is not YAML"
    if isinstance(exc, zipfile.BadZipFile):
        return "it is not a zip file"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class WorkflowError(InvalidInput):
    """A `.war` or specification that cannot be served; the message says what to fix."""


@dataclass(frozen=True)
class Node:
    """One step of a workflow: a model from the model store, or a function of the handler."""

    name: str
    model: str
    """The name it is served under: `<workflow>__<node>`."""
    url: str | None
    """Its archive in the model store; None for a function node."""
    settings: dict[str, int]
    children: tuple[str, ...]
    parents: tuple[str, ...]

    @property
    def function(self) -> bool:
        return self.url is None

    @property
    def retries(self) -> int:
        return self.settings["retry-attempts"]

    @property
    def timeout_s(self) -> float:
        return self.settings["timeout-ms"] / 1000.0


@dataclass
class Workflow:
    """A registered workflow: its nodes in an order where each comes after its parents."""

    name: str
    url: str
    nodes: dict[str, Node]
    start: str
    spec: dict[str, Any]
    directory: Path
    """Where its `.war` was extracted (the handler file, the function nodes' archives)."""
    registered: list[str] = field(default_factory=list)
    """The models registered for it, to unregister with it."""

    @property
    def leaves(self) -> list[str]:
        return [n.name for n in self.nodes.values() if not n.children]

    def describe(self) -> dict[str, Any]:
        """TorchServe's describe record, with each node's served model and settings."""
        globals_ = _globals(self.spec.get("models") or {})
        dag = ", ".join(f"{n}={list(node.children)}" for n, node in self.nodes.items())
        return {
            "workflowName": self.name,
            "workflowUrl": self.url,
            "minWorkers": globals_["min-workers"],
            "maxWorkers": globals_["max-workers"],
            "batchSize": globals_["batch-size"],
            "maxBatchDelay": globals_["max-batch-delay"],
            "workflowDag": "{" + dag + "}",
            "nodes": {
                n: {"model": node.model, "function": node.function, **node.settings}
                for n, node in self.nodes.items()
            },
        }


def _globals(models: dict[str, Any]) -> dict[str, int]:
    values = dict(_DEFAULTS)
    for key, kind in _SETTINGS.items():
        if key in models:
            values[key] = _setting(key, models[key], kind)
    return values


def _setting(key: str, value: Any, kind: type) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise WorkflowError(f"workflow setting {key!r} must be a whole number >= 0 (got {value!r})")
    return int(kind(value))


def parse_spec(name: str, spec: Any) -> tuple[dict[str, Node], str]:
    """The nodes of a specification, in an order where each comes after its parents, and its
    start node; raises WorkflowError saying what is wrong."""
    if not isinstance(spec, dict) or not isinstance(spec.get("dag"), dict) or not spec["dag"]:
        raise WorkflowError("the workflow specification needs a `dag` mapping each node to a list")
    models = spec.get("models") or {}
    if not isinstance(models, dict):
        raise WorkflowError("the workflow specification's `models` must be a mapping")
    defaults = _globals(models)
    model_entries = {k: v for k, v in models.items() if k not in _SETTINGS}
    children: dict[str, list[str]] = {}
    for source, targets in spec["dag"].items():
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise WorkflowError(f"dag entry {source!r} must be a list of node names")
        children.setdefault(str(source), []).extend(targets)
        for target in targets:
            children.setdefault(target, [])
    parents: dict[str, list[str]] = {n: [] for n in children}
    for source, targets in children.items():
        for target in targets:
            parents[target].append(source)
    starts = [n for n, p in parents.items() if not p]
    if len(starts) != 1:
        raise WorkflowError(
            f"a workflow's dag needs exactly one start node (one no edge leads to); found "
            f"{len(starts)}: {', '.join(sorted(starts)) or 'none (the dag has a cycle)'}"
        )
    order: list[str] = []
    waiting = {n: len(p) for n, p in parents.items()}
    ready = list(starts)
    while ready:
        node = ready.pop(0)
        order.append(node)
        for child in children[node]:
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    if len(order) != len(children):
        cyclic = sorted(set(children) - set(order))
        raise WorkflowError(f"the workflow's dag has a cycle through {', '.join(cyclic)}")
    nodes = {}
    for node in order:
        entry = model_entries.get(node)
        settings = dict(defaults)
        url = None
        if entry is not None:
            if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
                raise WorkflowError(f"model {node!r} of the workflow needs a `url` (its archive)")
            url = entry["url"]
            for key, kind in _SETTINGS.items():
                if key in entry:
                    settings[key] = _setting(key, entry[key], kind)
        try:
            model = check_model_name(f"{name}{SEPARATOR}{node}")
        except ManifestError as exc:
            raise WorkflowError(f"workflow node {node!r}: {exc}") from None
        nodes[node] = Node(node, model, url, settings, tuple(children[node]), tuple(parents[node]))
    for unused in set(model_entries) - set(nodes):
        log.warning("workflow=%s model %s is in `models` but not in the dag", name, unused)
    return nodes, starts[0]


class Workflows:
    """The registered workflows, and their models in the model registry."""

    def __init__(
        self, registry: ModelRegistry, management: Management, settings: ServerSettings
    ) -> None:
        self.registry = registry
        self.management = management
        self.settings = settings
        self.store = settings.workflow_store or settings.model_store
        self._workflows: dict[str, Workflow] = {}
        self._work: Path | None = None
        """Where registered workflows are unpacked: made at the first registration, removed
        at `close` (the server's stop)."""

    def get(self, name: str) -> Workflow:
        found = self._workflows.get(name)
        if found is None:
            raise ModelNotFound(f"workflow {name!r} is not registered")
        return found

    def list(self, limit: int, start: int) -> dict[str, Any]:
        names = sorted(self._workflows)
        page = names[start : start + limit]
        answer: dict[str, Any] = {
            "workflows": [{"workflowName": n, "workflowUrl": self._workflows[n].url} for n in page]
        }
        if start + limit < len(names):
            answer["nextPageToken"] = str(start + limit)
        return answer

    async def register(self, url: str, name: str | None = None) -> Workflow:
        """Register the store's `.war` named `url` and every model of its dag; on any failure
        the ones registered are unregistered again."""
        self.management._require_model_api("registering")
        source = self.store / url
        if Path(url).name != url or not source.is_file():
            raise ModelNotFound(f"workflow archive {url!r} is not in the workflow store")
        if self._work is None:
            self._work = Path(tempfile.mkdtemp(prefix="scriptserve-workflows-"))
        directory = self._work / f"{source.stem}-{len(self._workflows)}"
        if directory.exists():
            shutil.rmtree(directory)
        try:
            directory.mkdir(parents=True)
            safe_extract(source, directory)
            manifest = json.loads((directory / "WAR-INF" / "MANIFEST.json").read_text())
            about = manifest["workflow"]
            workflow_name = name or about["workflowName"]
            spec = yaml.safe_load((directory / about["specFile"]).read_text())
            handler = directory / about["handler"]
        except _UNREADABLE as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise WorkflowError(
                f"{url} is not a workflow archive torch-workflow-archiver makes: {_reason(exc)}"
            ) from None
        if workflow_name in self._workflows:
            raise Conflict(f"workflow {workflow_name!r} is already registered")
        nodes, start = parse_spec(workflow_name, spec)
        workflow = Workflow(workflow_name, url, nodes, start, spec, directory)
        try:
            for node in nodes.values():
                await self._register_node(workflow, node, handler)
        except BaseException:
            await self._unregister_models(workflow)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self._workflows[workflow_name] = workflow
        log.info(
            "workflow=%s registered: %d nodes (%s)",
            workflow_name,
            len(nodes),
            ", ".join(f"{n}{'()' if node.function else ''}" for n, node in nodes.items()),
        )
        return workflow

    async def _register_node(self, workflow: Workflow, node: Node, handler: Path) -> None:
        s = node.settings
        overrides = {
            "batch_size": max(1, s["batch-size"]),
            "max_batch_delay_ms": s["max-batch-delay"],
            "workers": max(1, s["min-workers"]),
            "max_workers": max(1, s["min-workers"], s["max-workers"]),
            "response_timeout_s": max(0.001, node.timeout_s),
        }
        if node.url is not None:
            await self.registry.load(self.registry.resolve_source(node.url), node.model, overrides)
        else:
            source = self._function_archive(workflow, node, handler)
            await self.registry.load(source, node.model, overrides)
        workflow.registered.append(node.model)

    def _function_archive(self, workflow: Workflow, node: Node, handler: Path) -> Path:
        """A handler-only archive whose entry point is the handler file's function `node`."""
        if not handler.is_file():
            raise WorkflowError(f"the workflow's handler file {handler.name!r} is missing")
        root = workflow.directory / "functions" / node.name
        (root / "MAR-INF").mkdir(parents=True, exist_ok=True)
        shutil.copy(handler, root / handler.name)
        manifest = {
            "runtime": "python",
            "model": {
                "modelName": node.model,
                "modelVersion": "1.0",
                "handler": f"{handler.name}:{node.name}",
            },
            "archiverVersion": "workflow",
        }
        (root / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(manifest))
        return root

    async def unregister(self, name: str) -> None:
        self.management._require_model_api("unregistering")
        workflow = self.get(name)
        del self._workflows[name]
        await self._unregister_models(workflow)
        shutil.rmtree(workflow.directory, ignore_errors=True)

    async def _unregister_models(self, workflow: Workflow) -> None:
        for model in reversed(workflow.registered):
            try:
                await self.registry.unload(model, None, self.settings.drain_timeout_s, force=True)
            except ServingError as exc:
                log.warning("workflow=%s could not unregister %s: %s", workflow.name, model, exc)
        workflow.registered.clear()

    def close(self) -> None:
        """Remove the unpacked workflows (the server stops)."""
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None
