"""The default handler: named tensors in, named tensors out, batched across requests.

Each request brings named numpy tensors (OIP) or a JSON body (TorchServe-style `/predictions`:
an array is one instance of the model's single input, an object maps input names to one
instance each). Requests whose tensors have the same per-row shapes are concatenated along
dim 0 and run together (in parts of at most the model's `max_batch` rows, where it has one);
outputs are split back by each request's row count. A request that does not fit the model's
signature fails alone, with a message naming the input and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import orjson

from scriptserve.handlers.backends import BackendError
from scriptserve.handlers.base import (
    BaseHandler,
    Context,
    HandlerError,
    InferenceRequest,
    InferenceResponse,
)
from scriptserve.handlers.runtime.signature import (
    Signature,
    SignatureError,
    arrays_from_json,
    arrays_from_text,
    instances_from_texts,
)


@dataclass
class _Item:
    index: int
    arrays: dict[str, np.ndarray]
    rows: int
    from_json: bool


@dataclass
class TensorBatch:
    """Decoded requests, grouped by per-row shapes, plus the per-request failures."""

    size: int
    groups: list[list[_Item]] = field(default_factory=list)
    errors: dict[int, InferenceResponse] = field(default_factory=dict)
    outputs: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)


class TensorHandler(BaseHandler):
    thread_safe = True  # per-batch state lives in TensorBatch, never on self

    @classmethod
    def request_signature(cls, signature: Signature) -> Signature | None:
        """Tensor requests carry exactly the model's inputs (when the archive records them)."""
        return signature if signature.inputs else None

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        self.signature: Signature = context.signature

    # -- preprocess ---------------------------------------------------------------------------
    def _decode(self, request: InferenceRequest) -> tuple[dict[str, np.ndarray], bool]:
        if request.inputs:
            return self._check_tensors(request.inputs), False
        if request.body is None:
            raise SignatureError("the request has no input tensors and no body")
        arrays = arrays_from_text(request.body, self.signature)
        if arrays is not None:
            return self._bind_names(arrays), True
        try:
            data = orjson.loads(request.body)
        except orjson.JSONDecodeError as exc:
            raise SignatureError(f"the body is not valid JSON: {exc}") from None
        return self._bind_names(arrays_from_json(data, self.signature)), True

    def _check_tensors(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self.signature.inputs:
            return self._bind_names(tensors)
        self.signature.check_inputs(tensors)
        return tensors

    def _bind_names(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Without a recorded signature, generic names map to the model's inputs in order."""
        if self.signature.inputs:
            return arrays  # arrays_from_json already named them by the signature
        names = self.model.input_names
        if set(arrays) != set(names) and len(arrays) == len(names):
            return dict(zip(names, arrays.values(), strict=True))
        return arrays

    def _one_group(self, requests: list[InferenceRequest]) -> list[_Item] | None:
        """The batch as the one group the loop in `preprocess` would make of it, when every
        request is alike: tensors of one name, datatype and shape (OIP), checked once; or
        bodies holding one instance each of the model's one input (`/predictions` JSON rows),
        read in one parse. None otherwise, and each request is decoded on its own."""
        if len(requests) < 2:
            return None
        if requests[0].inputs:
            return self._alike_tensors(requests)
        texts: list[bytes] = []
        for request in requests:
            if request.inputs or request.body is None:
                return None
            texts.append(request.body)
        instances = instances_from_texts(texts, self.signature)
        if instances is None:
            return None
        return [_Item(i, self._bind_names(arrays), 1, True) for i, arrays in enumerate(instances)]

    def _alike_tensors(self, requests: list[InferenceRequest]) -> list[_Item] | None:
        first = requests[0].inputs
        if len(first) != 1:
            return None
        ((name, array),) = first.items()
        if not array.ndim or not array.shape[0]:
            return None  # no rows: the per-request path says so
        for request in requests:
            other = request.inputs.get(name) if len(request.inputs) == 1 else None
            if other is None or other.dtype != array.dtype or other.shape != array.shape:
                return None
        try:
            # The signature checks names, datatypes and shapes, all alike here: one check.
            self._check_tensors(first)
        except SignatureError:
            return None
        rows = array.shape[0]
        if self.signature.inputs:
            return [_Item(i, r.inputs, rows, False) for i, r in enumerate(requests)]
        # Without a signature, generic names are mapped as _check_tensors maps them.
        return [_Item(i, self._bind_names(r.inputs), rows, False) for i, r in enumerate(requests)]

    def preprocess(self, requests: list[InferenceRequest]) -> TensorBatch:
        batch = TensorBatch(size=len(requests))
        group = self._one_group(requests)
        if group is not None:
            batch.groups = [group]
            return batch
        groups: dict[tuple[object, ...], list[_Item]] = {}
        for i, request in enumerate(requests):
            try:
                arrays, from_json = self._decode(request)
                rows = {a.shape[0] if a.ndim else 0 for a in arrays.values()}
                if len(rows) != 1 or 0 in rows:
                    raise SignatureError("every input needs the same number of rows (dim 0) >= 1")
            except SignatureError as exc:
                batch.errors[i] = InferenceResponse.failed(str(exc), 400)
                continue
            key = tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in arrays.items()))
            groups.setdefault(key, []).append(_Item(i, arrays, rows.pop(), from_json))
        batch.groups = list(groups.values())
        return batch

    # -- inference ----------------------------------------------------------------------------
    def inference(self, batch: TensorBatch) -> TensorBatch:
        # A model with a batch bound (a .pt2 package's exported max) gets the group in parts
        # of at most that many rows; a request that alone has more fails by itself.
        limit: int | None = getattr(self.model, "max_batch", None)
        parts: list[list[_Item]] = []
        for group in batch.groups:
            for item in group:
                if limit is not None and item.rows > limit:
                    batch.errors[item.index] = InferenceResponse.failed(
                        f"the request has {item.rows} rows; the model takes at most {limit} "
                        "at once",
                        400,
                    )
            parts += _parts([i for i in group if i.index not in batch.errors], limit)
        for group in parts:
            names = group[0].arrays.keys()
            if len(group) == 1:
                feed = group[0].arrays
            else:
                feed = {n: np.concatenate([item.arrays[n] for item in group]) for n in names}
            try:
                outputs = self.model.run(feed)
            except BackendError as exc:
                # Only this group's requests fail: the others were batched apart from it.
                for item in group:
                    batch.errors[item.index] = InferenceResponse.failed(str(exc), exc.status)
                continue
            total = sum(item.rows for item in group)
            for name, out in outputs.items():
                if out.ndim == 0 or out.shape[0] != total:
                    raise HandlerError(
                        f"model output {name!r} has shape {list(out.shape)} for a batch of "
                        f"{total} rows; the tensor handler needs outputs with the batch first"
                    )
            start = 0
            for item in group:
                end = start + item.rows
                batch.outputs[item.index] = {n: o[start:end] for n, o in outputs.items()}
                start = end
        return batch

    # -- postprocess --------------------------------------------------------------------------
    def postprocess(self, outputs: TensorBatch) -> list[InferenceResponse]:
        from_json = {item.index for group in outputs.groups for item in group if item.from_json}
        results = []
        for i in range(outputs.size):
            if i in outputs.errors:
                results.append(outputs.errors[i])
                continue
            tensors = outputs.outputs[i]
            body = None
            if i in from_json:
                rows = {n: t[0].tolist() for n, t in tensors.items()}
                body = next(iter(rows.values())) if len(rows) == 1 else rows
            results.append(InferenceResponse(outputs=tensors, body=body))
        return results


def _parts(group: list[_Item], limit: int | None) -> list[list[_Item]]:
    """The group's requests in order, as consecutive parts of at most `limit` rows each."""
    if limit is None:
        return [group] if group else []
    parts: list[list[_Item]] = []
    rows = 0
    for item in group:
        if not parts or rows + item.rows > limit:
            parts.append([])
            rows = 0
        parts[-1].append(item)
        rows += item.rows
    return parts
