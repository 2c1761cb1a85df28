"""KServe's TorchServe layout served unchanged: `config/config.properties` (KServe's v1 and v2
samples, verbatim) and `model-store/*.mar` under one folder, the models declared in
`model_snapshot`, inference and management on one address, `enable_envvars_config` with
`TS_SERVICE_ENVELOPE`, and TorchServe handlers archived with torch-model-archiver seeing KServe
requests as TorchServe's envelopes give them."""

from __future__ import annotations

import base64
import io
import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from PIL import Image
from serving import ServerProcess, free_port
from torch import nn
from torchserve.tsarchives import torch_model_archiver, write

from scriptserve.server.models.torchserve_config import (
    TorchServeConfigError,
    map_properties,
    parse_properties,
    with_environment,
)

# docs/samples/v1beta1/torchserve/v1/config.properties and .../v2/config.properties of
# kserve/kserve, byte for byte.
KSERVE_V1_CONFIG = """\
inference_address=http://0.0.0.0:8085
management_address=http://0.0.0.0:8085
metrics_address=http://0.0.0.0:8082
grpc_inference_port=7070
grpc_management_port=7071
enable_metrics_api=true
metrics_format=prometheus
number_of_netty_threads=4
job_queue_size=10
enable_envvars_config=true
install_py_dep_per_model=true
model_store=/mnt/models/model-store
model_snapshot={"name":"startup.cfg","modelCount":1,"models":{"mnist":{"1.0":{"defaultVersion":true,"marName":"mnist.mar","minWorkers":1,"maxWorkers":5,"batchSize":1,"maxBatchDelay":5000,"responseTimeout":120}}}}
"""
KSERVE_V2_CONFIG = """\
inference_address=http://0.0.0.0:8085
management_address=http://0.0.0.0:8085
metrics_address=http://0.0.0.0:8082
grpc_inference_port=7070
grpc_management_port=7071
enable_metrics_api=true
metrics_format=prometheus
number_of_netty_threads=4
job_queue_size=10
enable_envvars_config=true
install_py_dep_per_model=false
model_store=/mnt/models/model-store
model_snapshot={"name":"startup.cfg","modelCount":1,"models":{"mnist":{"1.0":{"defaultVersion":true,"marName":"mnist.mar","minWorkers":1,"maxWorkers":5,"batchSize":2,"maxBatchDelay":500,"responseTimeout":60}}}}
"""

# A TorchServe handler for KServe v2 requests, as KServe's v2 samples write them: each row is
# the request's input {"name", "shape", "datatype", "data"}.
V2_HANDLER = """
import torch
from ts.torch_handler.base_handler import BaseHandler


class V2Handler(BaseHandler):
    def initialize(self, context):  # no model to load: the handler sums its input
        self.context = context
        self.initialized = True

    def preprocess(self, data):
        self.seen = [(row["name"], row["datatype"], row["shape"]) for row in data]
        return torch.tensor([row["data"] for row in data], dtype=torch.float32)

    def inference(self, data):
        return data.sum(dim=1)

    def postprocess(self, data):
        return [[value, len(self.seen)] for value in data.tolist()]
"""
K8S_RUNTIME = Path(__file__).resolve().parents[2] / "docker" / "k8s" / "kserve-torchserve.yaml"
LABELS = ["zero", "one", "two", "three", "four", "five"]
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class PooledClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc = nn.Linear(3, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(2, 3)))


def png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buf, format="PNG")
    return buf.getvalue()


def top5(color: tuple[int, int, int]) -> dict[str, float]:
    """What the image classifier answers for a plain colour (it stays plain through resize and
    crop, so the normalized pixel is known)."""
    pixel = torch.tensor([(c / 255 - m) / s for c, m, s in zip(color, MEAN, STD, strict=True)])
    with torch.inference_mode():
        probs = torch.softmax(PooledClassifier().fc(pixel[None]), dim=1)[0]
    top = torch.topk(probs, 5)
    return {LABELS[i]: p for i, p in zip(top.indices.tolist(), top.values.tolist(), strict=True)}


def kserve_layout(root: Path, config: str, *handler_args: str) -> Path:
    """/mnt/models as KServe's storage initializer leaves it: config/ and model-store/."""
    (root / "config").mkdir(parents=True)
    (root / "config" / "config.properties").write_text(config)
    (root / "model-store").mkdir()
    torch_model_archiver(root / "src", root / "model-store", "mnist", *handler_args)
    return root


def serve(root: Path, envelope: str) -> ServerProcess:
    """The server as a KServe runtime starts it on this layout; the sample's addresses and store
    path are moved to loopback and the test's folder on the command line (which ranks above the
    file), inference and management still sharing one address."""
    shared = f"127.0.0.1:{free_port()}"
    proc = ServerProcess(
        root / "model-store",
        "--ts-config",
        str(root / "config" / "config.properties"),
        "--inference-address",
        shared,
        "--management-address",
        shared,
        env={"TS_SERVICE_ENVELOPE": envelope},
    )
    proc.url = proc.mgmt = f"http://{shared}"
    return proc.start()


@pytest.fixture(scope="module")
def v1_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("mnt-models-v1")
    src = root / "src"
    src.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(PooledClassifier().eval()).save(str(src / "img.pt"))
    (src / "index_to_name.json").write_text(
        json.dumps({str(i): ["n0000", name] for i, name in enumerate(LABELS)})
    )
    kserve_layout(
        root,
        KSERVE_V1_CONFIG,
        "--serialized-file",
        "img.pt",
        "--handler",
        "image_classifier",
        "--extra-files",
        "index_to_name.json",
    )
    proc = serve(root, "kserve")
    yield proc
    proc.stop()


def test_the_snapshot_declares_the_model_and_its_settings(v1_server: ServerProcess) -> None:
    reply = httpx.get(f"{v1_server.url}/models/mnist", headers=v1_server.mgmt_headers)
    assert reply.status_code == 200, reply.text
    (described,) = reply.json()
    assert described["modelVersion"] == "1.0"
    assert (described["batchSize"], described["maxBatchDelay"]) == (1, 5000)
    assert described["responseTimeout"] == 120
    assert (described["minWorkers"], described["maxWorkers"]) == (1, 5)


def test_management_shares_the_address_and_still_takes_its_key(v1_server: ServerProcess) -> None:
    assert httpx.get(f"{v1_server.url}/models").status_code == 401
    listed = httpx.get(f"{v1_server.url}/models", headers=v1_server.mgmt_headers)
    assert [m["modelName"] for m in listed.json()["models"]] == ["mnist"]
    assert httpx.get(f"{v1_server.url}/v1/models/mnist").json() == {
        "name": "mnist",
        "ready": True,
    }


def test_a_v1_image_reaches_the_torchserve_handler_as_bytes(v1_server: ServerProcess) -> None:
    """KServe's v1 image sample: {"instances": [{"data": "<base64>"}]}; with the kserve
    envelope the handler gets each instance as its row and decodes the image itself."""
    colors = [(200, 30, 90), (10, 250, 120)]
    body = {"instances": [{"data": base64.b64encode(png(c)).decode()} for c in colors]}
    reply = httpx.post(f"{v1_server.url}/v1/models/mnist:predict", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    predictions = reply.json()["predictions"]
    assert len(predictions) == 2
    for color, prediction in zip(colors, predictions, strict=True):
        want = top5(color)
        assert list(prediction) == list(want)
        assert prediction == pytest.approx(want, abs=1e-4)


@pytest.mark.slow
def test_v2_tensors_reach_a_torchserve_handler_as_kservev2_rows(tmp_path: Path) -> None:
    root = tmp_path / "mnt-models"
    (root / "src").mkdir(parents=True)
    write(root / "src" / "v2_handler.py", V2_HANDLER)
    torch.save(torch.nn.Linear(1, 1).state_dict(), root / "src" / "weights.pt")
    kserve_layout(
        root, KSERVE_V2_CONFIG, "--serialized-file", "weights.pt", "--handler", "v2_handler.py"
    )
    server = serve(root, "kservev2")
    try:
        (described,) = httpx.get(f"{server.url}/models/mnist", headers=server.mgmt_headers).json()
        assert (described["batchSize"], described["maxBatchDelay"]) == (2, 500)
        request = {
            "id": "v2-1",
            "inputs": [{"name": "input-0", "shape": [1, 4], "datatype": "FP32",
                        "data": [1.0, 2.0, 3.0, 4.5]}],
        }  # fmt: skip
        reply = httpx.post(f"{server.url}/v2/models/mnist/infer", json=request, timeout=60)
        assert reply.status_code == 200, reply.text
        (output,) = reply.json()["outputs"]
        assert output["name"] == "predict"
        assert output["data"][0] == pytest.approx(10.5)  # the handler summed the row's data
    finally:
        server.stop()


def test_the_snapshot_maps_to_models_their_settings_and_default_versions() -> None:
    config = map_properties(parse_properties(KSERVE_V1_CONFIG))
    assert config.settings["models"] == ["mnist=mnist.mar"]
    assert config.settings["model_defaults"] == {
        "mnist": {
            "1.0": {
                "minWorkers": 1,
                "maxWorkers": 5,
                "batchSize": 1,
                "maxBatchDelay": 5000,
                "responseTimeout": 120,
            }
        },
    }
    assert config.settings["default_versions"] == {"mnist": "1.0"}
    assert "model_snapshot" not in config.ignored and "enable_envvars_config" not in config.ignored
    # load_models gives way to the snapshot, as in TorchServe.
    both = map_properties(parse_properties(KSERVE_V1_CONFIG + "load_models=other.mar\n"))
    assert both.settings["models"] == ["mnist=mnist.mar"]


def test_ts_variables_count_only_when_the_file_enables_them() -> None:
    environ = {"TS_SERVICE_ENVELOPE": "kservev2", "TS_JOB_QUEUE_SIZE": "77"}
    enabled = map_properties(with_environment(parse_properties(KSERVE_V2_CONFIG), environ))
    assert enabled.settings["service_envelope"] == "kservev2"
    assert enabled.settings["queue_size"] == 77
    off = KSERVE_V2_CONFIG.replace("enable_envvars_config=true", "enable_envvars_config=false")
    disabled = map_properties(with_environment(parse_properties(off), environ))
    assert "service_envelope" not in disabled.settings and disabled.settings["queue_size"] == 10


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("model_snapshot={not json", "model_snapshot: not valid JSON"),
        ('model_snapshot={"models": {"m": {"1.0": {"batchSize": 2}}}}', "names no marName"),
        ('model_snapshot={"models": ["m"]}', 'expected {"models"'),
        ("service_envelope=json", "reads the envelopes body, kserve, kservev2"),
    ],
)
def test_unusable_values_name_their_key(line: str, says: str) -> None:
    with pytest.raises(TorchServeConfigError, match=re.escape(says)):
        map_properties(parse_properties(line + "\n"))


@pytest.mark.slow
def test_the_kserve_runtime_manifest_serves_the_layout(
    v1_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """docker/k8s/kserve-torchserve.yaml's container, as KServe would start it on KServe's
    v1 sample: its args (the paths under /mnt/models moved to the test's copy, the addresses
    to loopback ports) and env (the InferenceService's serviceEnvelope label, the keys)."""
    docs = list(yaml.safe_load_all(K8S_RUNTIME.read_text()))
    (runtime,) = [d for d in docs if d["kind"] == "ClusterServingRuntime"]
    (service,) = [d for d in docs if d["kind"] == "InferenceService"]
    assert service["spec"]["predictor"]["model"]["runtime"] == runtime["metadata"]["name"]
    (container,) = runtime["spec"]["containers"]
    root = v1_server.store.parent  # the v1 fixture's /mnt/models
    proc = ServerProcess(root / "model-store")
    moved = {
        "0.0.0.0:8080": proc.url.removeprefix("http://"),
        "127.0.0.1:8081": proc.mgmt.removeprefix("http://"),
        "0.0.0.0:8082": proc.metrics_url.removeprefix("http://"),
        "0.0.0.0:7070": proc.grpc, "127.0.0.1:7071": proc.grpc_mgmt, "/mnt/models": str(root),
    }  # fmt: skip
    args = []
    for given in container["args"]:
        arg = given
        for old, new in moved.items():
            arg = arg.replace(old, new)
        args.append(arg)
    inference_key = "inference-key-for-the-test"
    env = {}
    for variable in container["env"]:
        if "value" in variable:
            labels = service["metadata"]["labels"]
            env[variable["name"]] = variable["value"].replace(
                "{{.Labels.serviceEnvelope}}", labels["serviceEnvelope"]
            )
    env["SCRIPTSERVE_INFERENCE_KEY"] = inference_key
    proc.args, proc.env = args, {**proc.env, **env}
    proc.start()
    try:
        body = {"instances": [{"data": base64.b64encode(png((200, 30, 90))).decode()}]}
        reply = httpx.post(
            f"{proc.url}/v1/models/mnist:predict",
            json=body,
            headers={"Authorization": f"Bearer {inference_key}"},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["predictions"][0] == pytest.approx(top5((200, 30, 90)), abs=1e-4)
        elsewhere = httpx.get(  # management is not on the inference address
            f"{proc.url}/models", headers={"Authorization": f"Bearer {inference_key}"}
        )
        assert elsewhere.status_code == 404
        assert not (root / "model-store" / ".snapshot").exists()  # declarative: nothing written
    finally:
        proc.stop()
