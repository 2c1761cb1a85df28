"""KServe's v1 protocol (TensorFlow Serving's REST predict API): `{"instances": [...]}` or
`{"inputs": ...}` in, `{"predictions": [...]}` out (`{"explanations": [...]}` for `:explain`).

Each instance becomes one request whose body is that instance as JSON, the body `/predictions`
takes: for the tensor handler an array is one instance of the model's single input, an object
maps input names to one instance each. The data plane queues a call's instances together, so
they batch, and each one's answer is its prediction: the handler's JSON body, else its output
tensor (an object of them when there are several).

`inputs` is TensorFlow Serving's columnar form: a list holds the instances (as `instances`
does), an object maps each input name to its instances, the same number for every name.

    requests = instance_requests(b'{"instances": [[0.5, 1.0]]}', headers)
    encode([s.response for s in served])  # b'{"predictions":[[...]]}'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from scriptserve.handlers.base import InferenceRequest, InferenceResponse
from scriptserve.server.codec.torchserve import json_default
from scriptserve.server.errors import InferenceFailed, InvalidInput

EXPLAIN_HEADER = "explain"
"""Set to "True" on each request of an `:explain` call (TorchServe's explanation header)."""
_SHAPE = 'a JSON object with an "instances" list, e.g. {"instances": [[0.5, 1.0, 2.0]]}'


def live(alive: bool) -> dict[str, str]:
    """KServe v1's liveness answer (`GET /`)."""
    return {"status": "alive" if alive else "dead"}


def _columns(inputs: Mapping[str, Any]) -> list[Any]:
    """TensorFlow Serving's columnar `inputs` ({name: [instances]}) as a list of instances."""
    if not inputs:
        raise InvalidInput('"inputs" is an empty object; give each input name its instances')
    rows: dict[str, int] = {}
    for name, column in inputs.items():
        if not isinstance(column, list) or not column:
            raise InvalidInput(f'"inputs"."{name}" must be a non-empty list of instances')
        rows[name] = len(column)
    if len(set(rows.values())) != 1:
        counts = ", ".join(f"{name!r} has {n}" for name, n in rows.items())
        raise InvalidInput(f'every input of "inputs" needs the same number of instances: {counts}')
    count = next(iter(rows.values()))
    return [{name: inputs[name][i] for name in inputs} for i in range(count)]


def decode_instances(body: bytes) -> list[Any]:
    """The instances of a predict or explain body; raises InvalidInput saying what is wrong."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidInput(f"a KServe v1 request must be {_SHAPE}")
    if "instances" in doc and "inputs" in doc:
        raise InvalidInput('send either "instances" or "inputs", not both')
    if "inputs" in doc:
        inputs = doc["inputs"]
        if isinstance(inputs, dict):
            return _columns(inputs)
        if not isinstance(inputs, list) or not inputs:
            raise InvalidInput(
                '"inputs" must be a non-empty list of instances, or an object '
                "mapping each input name to its instances"
            )
        return inputs
    instances = doc.get("instances")
    if not isinstance(instances, list) or not instances:
        raise InvalidInput(f'"instances" must be a non-empty list: a KServe v1 request is {_SHAPE}')
    return instances


def instance_requests(
    body: bytes, headers: Mapping[str, str], explain: bool = False
) -> list[InferenceRequest]:
    """One request per instance, its body the instance as JSON; an explain call's carry the
    explanation header."""
    if explain:
        headers = {**headers, EXPLAIN_HEADER: "True"}
    json = "application/json"
    return [
        InferenceRequest(
            body=orjson.dumps(instance), content_type=json, headers=headers, kserve_instance=True
        )
        for instance in decode_instances(body)
    ]


def _media_type(content_type: str | None) -> str:
    return (content_type or "").partition(";")[0].strip().lower()


def prediction(response: InferenceResponse) -> Any:
    """One instance's prediction: the handler's body as JSON (bytes of a JSON or text content
    type are read as such), else its output tensor, or an object of them."""
    body = response.body
    if isinstance(body, (bytes, bytearray)):
        media = _media_type(response.content_type)
        if media == "application/json" or media.endswith("+json"):
            try:
                return orjson.loads(body)
            except orjson.JSONDecodeError:
                raise InferenceFailed("the model answered with invalid JSON") from None
        if media.startswith("text/"):
            return bytes(body).decode("utf-8", errors="replace")
        raise InferenceFailed(
            f"the model answers with {media or 'binary'} bytes, which KServe v1's JSON cannot "
            "carry; call /predictions/MODEL for them"
        )
    if body is not None:
        return body
    outputs = response.outputs
    if len(outputs) == 1:
        return next(iter(outputs.values()))
    return dict(outputs)


def encode(responses: Sequence[InferenceResponse], explain: bool = False) -> bytes:
    """The answer to a predict call (`predictions`) or an explain call (`explanations`): one
    entry per instance, in order."""
    key = "explanations" if explain else "predictions"
    entries = [prediction(response) for response in responses]
    return orjson.dumps({key: entries}, default=json_default, option=orjson.OPT_SERIALIZE_NUMPY)
