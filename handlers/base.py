"""The handler API: requests in, one response per request out, or a stream of parts.

A handler turns a batch of protocol-neutral `InferenceRequest`s into one `InferenceResponse` each::

    class Doubler(BaseHandler):
        def preprocess(self, requests):
            return np.concatenate([r.inputs["x"] for r in requests])
        def inference(self, batch):
            return batch * 2
        def postprocess(self, outputs):
            return [InferenceResponse(outputs={"y": row[None]}) for row in outputs]

`handle` runs preprocess -> inference -> postprocess and checks that postprocess returned one
result per request. A handler that cannot batch sets `supports_batching = False`. A handler that
keeps no per-batch state on `self` sets `thread_safe = True`: the workers on one device then share
one instance, and one copy of the model's weights. A handler that can explain its predictions
sets `explains = True`: a request that asks for an explanation (KServe v1's `:explain`) carries
the header `explain: True`, as TorchServe's explanation requests do.

A handler that streams its answers (tokens of a generative model, say) implements `stream`
instead of the three steps: a generator that yields, at each step, one part per request of the
batch (None where a request has no part this step)::

    class Counter(BaseHandler):
        def stream(self, requests):
            for step in range(3):
                yield [InferenceResponse(outputs={"n": np.array([step])}) for _ in requests]

Requests of one batch generate together; each client receives its own parts, in order, as they
are yielded. A request's stream ends with the generator, or at its part marked `final=True`.
Parts for a request whose client went away are dropped; once no request of the batch listens,
the generator is closed at its next yield (`StreamClosed` is raised into code that sends parts
itself, such as TorchServe's `send_intermediate_predict_response`), and the worker is free.

Workers never call `handle` directly: `run_batch` does, and turns whatever goes wrong into
failed responses, so that every kind of worker reports a failure the same way. It also times
preprocess and postprocess when the handler keeps BaseHandler's `handle` (`StageTimes`).
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from scriptserve.archiver.manifest import Manifest
from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.metrics import HandlerMetrics
from scriptserve.handlers.parts import PartSink, send_parts, set_sink
from scriptserve.handlers.runtime.signature import Signature

log = logging.getLogger("scriptserve.handlers")

# Request ids: a random per-process prefix and a counter. uuid4() reads os.urandom, a system call
# that drops and retakes the GIL on every request.
_ID_PREFIX = uuid.uuid4().hex[:12]
_ids = itertools.count(1)


def new_request_id() -> str:
    return f"{_ID_PREFIX}-{next(_ids):x}"


class HandlerError(Exception):
    """A failure a handler reports for a whole batch; `status` is the HTTP-style status."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class StreamClosed(HandlerError):
    """No request of the batch still listens to its stream (each client went away, timed out,
    or read too slowly): raised where the next parts are sent, to stop the generation."""

    def __init__(self) -> None:
        super().__init__("no request of the batch still listens to its stream", 499)


@dataclass
class InferenceRequest:
    """One request as a handler sees it, whatever protocol it came in on.

    `inputs` holds named tensors (each with its batch dimension first) for tensor protocols;
    `body` and `content_type` hold the raw payload of TorchServe-style `/predictions` calls;
    `fields` the parts of a multipart body by name.
    """

    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    body: bytes | None = None
    content_type: str | None = None
    fields: dict[str, bytes] = field(default_factory=dict)
    parameters: dict[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    request_id: str = field(default_factory=new_request_id)
    outputs: list[str] | None = None
    """The output tensors a tensor protocol asked for, by name ([]: every output); None when the
    client takes the handler's answer as it is (TorchServe's predictions)."""
    kserve_instance: bool = False
    """`body` is one instance of a KServe v1 request, as JSON."""


@dataclass
class InferenceResponse:
    """One request's result: named output tensors and/or a JSON-able or bytes `body`.

    A response with `error` set fails only its own request, with `status` (4xx for bad input).
    """

    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    body: Any = None
    content_type: str | None = None
    error: str | None = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    """Extra response headers (TorchServe handlers set them through their context)."""
    final: bool = False
    """A streamed part that ends its request's stream (Triton's final flag)."""

    @property
    def empty(self) -> bool:
        """Carries nothing: the end of a stream whose parts said it all."""
        return not self.outputs and self.body is None and self.error is None

    @classmethod
    def failed(cls, message: str, status: int = 400) -> InferenceResponse:
        return cls(error=message, status=status)


@dataclass
class StageTimes:
    """Seconds one batch spent preparing the model's inputs and extracting its outputs (Triton's
    compute_input and compute_output); the rest of the batch's run is the model's. A handler that
    overrides `handle` has no stages to time: all of its time counts as the model's."""

    input_s: float = 0.0
    output_s: float = 0.0


@dataclass
class Context:
    """What a handler knows about the model it serves and where it runs."""

    model_name: str
    model_version: str
    model_dir: Path
    manifest: Manifest
    model_config: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    batch_size: int = 1
    intra_op_threads: int = 1
    model_file: Path | None = None
    """The model file to load instead of the archive's own: its int8 conversion made at load."""
    workers: int = 1
    """How many worker threads may call the handler at once: a backend keeps that many model
    instances (a `.pt2` container's `num_models`), sharing one copy of the weights."""
    metrics: HandlerMetrics = field(default_factory=HandlerMetrics)
    """What the handler counts, times and gauges (handlers/metrics.py): on the server's /metrics
    with the model's name and version."""
    metric_declarations: tuple[tuple[str, str, str, tuple[str, ...]], ...] = ()
    """TorchServe's metrics.yaml model metrics: (kind, name, unit, dimension names) each."""
    tensorrt_cache: Path | None = None
    """Where TensorRT keeps this model's engines (the server's `tensorrt_cache_dir`), or None:
    no TensorRT (handlers/backends/onnx.py)."""
    service_envelope: str = "body"
    """How a TorchServe handler sees KServe's protocols (TorchServe's `service_envelope`:
    `body`, `kserve` or `kservev2`; handlers/torchserve/adapter.py)."""

    @property
    def signature(self) -> Signature:
        return self.manifest.signature

    @property
    def serialized_file(self) -> Path:
        if self.model_file is not None:
            return self.model_file
        name = self.manifest.model.serialized_file
        if not name:
            raise HandlerError("the archive names no serialized model file")
        return self.model_dir / name


class BaseHandler:
    """Loads the archive's model onto the context's device and runs batches through it."""

    supports_batching: ClassVar[bool] = True
    thread_safe: ClassVar[bool] = False
    explains: ClassVar[bool] = False

    @classmethod
    def request_signature(cls, signature: Signature) -> Signature | None:
        """The inputs a tensor request (Open Inference Protocol) must carry for this handler:
        the server checks names, datatypes, ranks and fixed sizes against it before the request
        is queued. None (the default) when the handler takes other inputs and checks them
        itself, e.g. encoded images for a model whose own input is a pixel tensor."""
        return None

    def __init__(self) -> None:
        self.context: Context | None = None
        self.model: Any = None

    def initialize(self, context: Context) -> None:
        """Load the model. Called once per worker before any request."""
        from scriptserve.handlers.backends import load_backend

        self.context = context
        options = dict(context.model_config)
        if context.tensorrt_cache is not None:
            options["tensorrt_cache_dir"] = str(context.tensorrt_cache)
        self.model = load_backend(
            context.serialized_file,
            context.manifest.model_format,
            device=context.device,
            intra_op_threads=context.intra_op_threads,
            options=options,
            manifest=context.manifest,
            workers=context.workers,
        )

    def preprocess(self, requests: list[InferenceRequest]) -> Any:
        return requests

    def inference(self, batch: Any) -> Any:
        return self.model.run(batch)

    def postprocess(self, outputs: Any) -> list[InferenceResponse]:
        return list(outputs)

    def stream(self, requests: list[InferenceRequest]) -> Iterator[list[InferenceResponse | None]]:
        """A streaming handler's generation: yields one part per request at each step (see the
        module docstring). Handlers that answer once leave it alone."""
        raise NotImplementedError

    @classmethod
    def streams(cls) -> bool:
        """The handler answers in parts (it implements `stream`)."""
        return cls.stream is not BaseHandler.stream

    def handle(self, requests: list[InferenceRequest], context: Context) -> list[InferenceResponse]:
        """Run one batch; always returns exactly one response per request. `self.context` is the
        one `initialize` set: the instance may be shared by several worker threads. A streaming
        handler's parts go out as they are yielded; what it returns ends each stream."""
        if self.streams():
            return self._handle_stream(requests)
        return self._handle_stages(requests, None)

    def _handle_stream(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        """Send each step of `stream` on; each request's answer is its final part, or an empty
        response when the generator ended its stream."""
        finals: list[InferenceResponse | None] = [None] * len(requests)
        steps = self.stream(requests)
        try:
            for step in steps:
                if not isinstance(step, list) or len(step) != len(requests):
                    got = len(step) if isinstance(step, list) else type(step).__name__
                    raise HandlerError(
                        f"{type(self).__name__}.stream yielded {got} parts for a batch of "
                        f"{len(requests)} requests; yield a list with one part (or None) per "
                        "request"
                    )
                for i, part in enumerate(step):
                    if part is None:
                        continue
                    if finals[i] is not None:
                        raise HandlerError(
                            f"{type(self).__name__}.stream yielded a part for request "
                            f"{requests[i].request_id} after its final part"
                        )
                    if part.final:
                        finals[i] = part
                send_parts(step)
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                close()  # a generator's cleanup runs now, also when the stream was closed
        return [final or InferenceResponse(final=True) for final in finals]

    def _handle_stages(
        self, requests: list[InferenceRequest], times: StageTimes | None
    ) -> list[InferenceResponse]:
        if times is None:
            results = self.postprocess(self.inference(self.preprocess(requests)))
        else:
            started = time.perf_counter()
            batch = self.preprocess(requests)
            prepared = time.perf_counter()
            outputs = self.inference(batch)
            ran = time.perf_counter()
            results = self.postprocess(outputs)
            times.input_s += prepared - started
            times.output_s += time.perf_counter() - ran
        if not isinstance(results, list) or len(results) != len(requests):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise HandlerError(
                f"{type(self).__name__}.postprocess returned {got} results for a batch of "
                f"{len(requests)} requests; it must return a list with one result per request"
            )
        return results


def run_batch(
    handler: BaseHandler,
    requests: list[InferenceRequest],
    context: Context,
    times: StageTimes | None = None,
    parts: PartSink | None = None,
) -> list[InferenceResponse]:
    """Run one batch through `handler.handle`: one InferenceResponse per request, always.
    With `times`, the batch's preprocess and postprocess are timed into it; streamed parts go
    to `parts` (dropped without one).

    A HandlerError fails the batch with its own message and status (handler authors write those
    for clients), a BackendError with its message. Any other exception is a bug in the handler:
    it goes to the log with the model and the request ids, and each client learns only that the
    handler failed and how, since the exception's text can hold paths and values. A result that
    is not an InferenceResponse fails its own request. For a handler that raised ValueError::

        run_batch(handler, [InferenceRequest(request_id="abc-1")], context)[0].error
        # 'the handler failed: ValueError (request id abc-1); see the server log'
    """
    set_sink(parts)
    try:
        staged = type(handler).handle is BaseHandler.handle and not handler.streams()
        if times is not None and staged:
            results = handler._handle_stages(requests, times)
        else:
            results = handler.handle(requests, context)
    except HandlerError as exc:
        return [InferenceResponse.failed(exc.message, exc.status) for _ in requests]
    except BackendError as exc:
        return [InferenceResponse.failed(str(exc), exc.status) for _ in requests]
    except Exception as exc:
        log.exception(
            "model=%s version=%s request_ids=%s the handler raised",
            context.model_name,
            context.model_version,
            ",".join(r.request_id for r in requests),
        )
        kind = type(exc).__name__
        return [
            InferenceResponse.failed(
                f"the handler failed: {kind} (request id {r.request_id}); see the server log", 500
            )
            for r in requests
        ]
    finally:
        set_sink(None)
    if not isinstance(results, list) or len(results) != len(requests):
        got = len(results) if isinstance(results, list) else type(results).__name__
        message = (
            f"{type(handler).__name__}.handle returned {got} results for a batch of "
            f"{len(requests)} requests; it must return a list with one result per request"
        )
        return [InferenceResponse.failed(message, 500) for _ in requests]
    return [
        result
        if isinstance(result, InferenceResponse)
        else InferenceResponse.failed(
            f"the handler returned a {type(result).__name__} for request {request.request_id}, "
            "not an InferenceResponse",
            500,
        )
        for request, result in zip(requests, results, strict=True)
    ]


def load_failure(exc: Exception, model: str, version: str) -> HandlerError:
    """What a handler that cannot be built or initialized is reported as.

    HandlerError, BackendError, OSError and ValueError say what is wrong with the archive or the
    model file and are kept. Anything else is a bug in the handler: it goes to the log, and the
    reason given is its class name only, since its text can hold paths and values.
    """
    if isinstance(exc, HandlerError):
        return exc
    if isinstance(exc, (BackendError, OSError, ValueError)):
        return HandlerError(str(exc))
    log.error("model=%s version=%s the handler failed to load", model, version, exc_info=exc)
    return HandlerError(f"the handler failed to load: {type(exc).__name__}; see the server log")
