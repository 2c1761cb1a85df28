"""`ts.torch_handler.base_handler.BaseHandler`, loading models the way scriptserve does.

`initialize` follows TorchServe's loading rules (manifest `modelFile` -> eager model from
`model.py` plus a state_dict; `.pt` -> TorchScript; `.onnx` -> an onnxruntime session), with two
differences: TorchScript and ONNX go through scriptserve's backends (thread counts set, CUDA
checked), and an eager state_dict is read with `torch.load(..., weights_only=True)`, so a file
holding pickled Python objects is refused with a message saying how to re-save it.

`preprocess` also accepts the request list itself: each request's `data` (or `body`) is one
instance, and the instances are stacked along a new first dimension. TorchServe passes the list
of request dicts to `torch.as_tensor`, which fails; the stacked form is what the built-in
`base_handler` is for.
"""

from __future__ import annotations

import abc
import importlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..handler_utils.timer import timed
from ..utils.util import PredictionException, list_classes_from_module, load_label_mapping

logger = logging.getLogger("scriptserve.torchserve")

PT2_AVAILABLE = True
ONNX_AVAILABLE = True
XLA_AVAILABLE = False
IPEX_AVAILABLE = False


def setup_ort_session(model_pt_path: str, map_location: str | None, threads: int = 1) -> Any:
    """An onnxruntime session for the model, on `cuda:0` or the CPU (scriptserve's backend)."""
    from scriptserve.handlers.backends.onnx import OnnxBackend

    device = "cuda:0" if map_location == "cuda" else "cpu"
    return OnnxBackend(Path(model_pt_path), device, threads, {}).session


def request_payload(row: Any) -> Any:
    """One request's input: its `data` or `body` entry; JSON bytes are parsed."""
    if not isinstance(row, dict):
        return row
    value = row.get("data")
    if value is None:
        value = row.get("body")
    if isinstance(value, (bytes, bytearray)):
        try:
            return json.loads(value)
        except ValueError:
            raise PredictionException(
                "the request body is not JSON; send the model's input as a JSON array", 400
            ) from None
    return value


class BaseHandler(abc.ABC):  # noqa: B024 - abstract in TorchServe too, without abstract methods
    """TorchServe's default handler: load the model, then preprocess -> inference -> postprocess."""

    def __init__(self) -> None:
        self.model: Any = None
        self.mapping: dict[str, Any] | None = None
        self.device: torch.device | None = None
        self.initialized = False
        self.context: Any = None
        self.model_pt_path: str | None = None
        self.manifest: dict[str, Any] | None = None
        self.map_location: str | None = None
        self.explain = False
        self.target = 0
        self.profiler_args: dict[str, Any] = {}
        self.model_yaml_config: dict[str, Any] = {}

    def initialize(self, context: Any) -> None:
        self.context = context
        if context is not None and hasattr(context, "model_yaml_config"):
            self.model_yaml_config = context.model_yaml_config
        properties = context.system_properties
        gpu_id = properties.get("gpu_id")
        if torch.cuda.is_available() and gpu_id is not None:
            self.map_location = "cuda"
            self.device = torch.device(f"cuda:{gpu_id}")
        else:
            self.map_location = "cpu"
            self.device = torch.device("cpu")
        self.manifest = context.manifest
        model_dir = properties.get("model_dir")
        model = self.manifest["model"] if self.manifest else {}
        self.model_pt_path = None
        if model.get("serializedFile"):
            self.model_pt_path = os.path.join(model_dir, model["serializedFile"])
        model_file = model.get("modelFile", "")
        if model_file:
            self.model = self._load_pickled_model(model_dir, model_file, self.model_pt_path)
            self.model.to(self.device)
            self.model.eval()
        elif self.model_pt_path and self.model_pt_path.endswith(".pt"):
            self.model = self._load_torchscript_model(self.model_pt_path)
            self.model.eval()
        elif self.model_pt_path and self.model_pt_path.endswith(".onnx"):
            threads = int(properties.get("intra_op_threads", 1))
            self.model = setup_ort_session(self.model_pt_path, self.map_location, threads)
        else:
            raise RuntimeError("No model weights could be loaded")
        if isinstance(self.model_yaml_config.get("pt2"), (dict, str)):
            logger.warning(
                "model=%s: the model config's pt2 (torch.compile) section is not applied; "
                "serve a TorchScript or ONNX file instead",
                context.model_name,
            )
        self.mapping = load_label_mapping(os.path.join(model_dir, "index_to_name.json"))
        self.initialized = True

    def _load_torchscript_model(self, model_pt_path: str) -> Any:
        from scriptserve.handlers.backends.torchscript import TorchScriptBackend

        device = str(self.device) if self.device is not None else "cpu"
        threads = int(self.context_property("intra_op_threads", 1))
        return TorchScriptBackend(Path(model_pt_path), device, threads, {}).module

    def context_property(self, key: str, default: Any) -> Any:
        context = self.context
        if context is None:
            return default
        return context.system_properties.get(key, default)

    def _load_pickled_model(
        self, model_dir: str, model_file: str, model_pt_path: str | None
    ) -> torch.nn.Module:
        """The one class of `model_file`, with the state_dict of the serialized file."""
        model_def_path = os.path.join(model_dir, model_file)
        if not os.path.isfile(model_def_path):
            raise RuntimeError("Missing the model.py file")
        module_name = Path(model_file).stem
        sys.path.insert(0, model_dir)
        try:
            sys.modules.pop(module_name, None)
            module = importlib.import_module(module_name)
        finally:
            sys.path.remove(model_dir)
            sys.modules.pop(module_name, None)
        classes = list_classes_from_module(module)
        if len(classes) != 1:
            raise ValueError(f"Expected only one class as model definition. {classes}")
        model: torch.nn.Module = classes[0]()
        if model_pt_path:
            try:
                state_dict = torch.load(model_pt_path, map_location=self.device, weights_only=True)
            except Exception as exc:
                raise RuntimeError(
                    f"{os.path.basename(model_pt_path)} is not a plain state_dict of tensors, "
                    "and scriptserve never unpickles Python objects (torch.load weights_only=True)"
                    ": save it with torch.save(model.state_dict(), path), or archive a "
                    f"TorchScript file instead ({type(exc).__name__})"
                ) from None
            model.load_state_dict(state_dict)
        return model

    @timed
    def preprocess(self, data: Any) -> Any:
        dtype = None
        if isinstance(data, list) and data and all(isinstance(row, dict) for row in data):
            # JSON numbers are the model's float32 input, whether written 1 or 1.0.
            data = [request_payload(row) for row in data]
            dtype = torch.float32
        try:
            return torch.as_tensor(data, dtype=dtype, device=self.device)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise PredictionException(
                "each request must be one instance of the model's input as a JSON array of "
                f"numbers, all of the same shape ({exc})",
                400,
            ) from None

    @timed
    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            marshalled_data = data.to(self.device)
            return self.model(marshalled_data, *args, **kwargs)

    @timed
    def postprocess(self, data: Any) -> Any:
        return data.tolist()

    def handle(self, data: Any, context: Any) -> Any:
        start_time = time.time()
        self.context = context
        metrics = self.context.metrics
        if self._is_describe():
            output = [self.describe_handle()]
        else:
            data_preprocess = self.preprocess(data)
            if not self._is_explain():
                output = self.inference(data_preprocess)
                output = self.postprocess(output)
            else:
                output = self.explain_handle(data_preprocess, data)
        stop_time = time.time()
        metrics.add_time("HandlerTime", round((stop_time - start_time) * 1000, 2), None, "ms")
        return output

    def explain_handle(self, data_preprocess: Any, raw_data: Any) -> Any:
        raise PredictionException(
            "explanations need Captum, which scriptserve does not provide; call /predictions", 501
        )

    def _is_explain(self) -> bool:
        if self.context and self.context.get_request_header(0, "explain") == "True":
            self.explain = True
            return True
        return False

    def _is_describe(self) -> bool:
        return bool(self.context and self.context.get_request_header(0, "describe") == "True")

    def describe_handle(self) -> Any:
        logger.info("Collect customized metadata")
        return None
