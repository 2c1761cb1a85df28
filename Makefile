# One place for the project's commands. The README's two set-up commands are `make demo` and
# `make test`; .ci/run calls `make lint` and `make test`. `make check` is the quick loop.
PYTHON ?= python3
DEMO_DIR ?= build/demo

IMAGE ?= scriptserve:cpu
GPU_IMAGE ?= scriptserve:gpu
BASE_IMAGE ?= python:3.11-slim
BUILDAH ?= buildah

.PHONY: install install-serve demo demo-archive demo-textgen digits test check lint bench gen-proto image image-gpu gpu-check gpu-wheels

PIP_INSTALL = $(PYTHON) -m pip install -q --disable-pip-version-check -c constraints.txt

# What serving and training need (the runtime dependencies, the `train` and `onnx` extras): `make demo`.
install-serve:
	$(PIP_INSTALL) -e '.[train,onnx]'

# Everything, test and lint tools included (the `dev` extra): `make test`, `make lint`. kserve
# (its REST client, for the KServe v1 test) without its dependencies: see pyproject's dev extra.
install:
	$(PIP_INSTALL) -e '.[dev]'
	$(PIP_INSTALL) --no-deps kserve

# Build the demo archive and train the digits classifier into model_store/ (the training only
# when model_store/ has no digits archive), run one prediction in-process, then serve them all.
demo: install-serve demo-archive digits
	scriptserve predict model_store/demo.mar --input $(DEMO_DIR)/sample.json
	scriptserve serve --model-store model_store --models all

demo-archive: install-serve
	$(PYTHON) scripts/demo_model.py $(DEMO_DIR)
	model-archiver --model-name demo --version 1.0 --export-pt2 --model-file scripts/demo_model.py \
		--model-class DemoMLP --serialized-file $(DEMO_DIR)/demo-weights.pt --max-batch 64 \
		--handler tensor --sample-input $(DEMO_DIR)/sample.json --export-path model_store -f
	scriptserve archive verify model_store/demo.mar

# The streaming demo (docs/streaming.md): a next-byte model compiled to .pt2 and served by the
# builtin text_generator handler, which answers a token at a time.
demo-textgen: install-serve
	$(PYTHON) scripts/textgen_model.py $(DEMO_DIR)
	model-archiver --model-name textgen --version 1.0 --export-pt2 \
		--model-file scripts/textgen_model.py --model-class ByteLM \
		--serialized-file $(DEMO_DIR)/textgen-weights.pt --max-batch 32 --handler text_generator \
		--sample-input $(DEMO_DIR)/textgen-sample.json --input-dtype INT64 \
		--export-path model_store -f
	scriptserve archive verify model_store/textgen.mar

# Train the digits classifier into model_store/ (about a minute on 2 cores: 10 epochs, then the .pt2 compiles), unless it is there.
digits: install-serve
	test -f model_store/digits.mar || \
		$(PYTHON) -m scriptserve.training --model lenet --epochs 10 --out model_store

# The tests' servers are real `scriptserve serve` processes forked from one that has imported
# torch and the server once (tests/serving.py); SCRIPTSERVE_TEST_FRESH_SERVERS=1 starts each afresh.
test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider --durations=25

# The quick loop (under 3 minutes on 2 cores): lint, then the tests not marked `slow` (image
# builds, fresh installs, training runs, fuzzing, compiles, servers started for a few tests;
# see pyproject's markers). `make test` runs them all.
check: lint
	$(PYTHON) -m pytest -q -p no:cacheprovider -m "not slow"

# On a GPU machine: every CUDA path, one command (benchmarks/gpu_check/, docs/gpu.md). Where the
# machine reaches no index, `make gpu-wheels` here first makes the wheels it installs from.
gpu-check:
	$(PYTHON) -m benchmarks.gpu_check $(if $(wildcard build/gpu-wheels),--wheels build/gpu-wheels)

gpu-wheels: install
	$(PYTHON) -m benchmarks.gpu_check --prepare build/gpu-wheels

# The CPU image (docker/Dockerfile, see docs/deployment.md) with buildah; the build itself needs
# no network: the wheels come from build/wheelhouse, made here. `docker build` works the same.
image:
	command -v $(BUILDAH) >/dev/null || (apt-get update -qq && apt-get install -y -qq buildah)
	PYTHON=$(PYTHON) docker/wheelhouse.sh build/wheelhouse
	$(BUILDAH) bud --isolation chroot --format docker --build-arg BASE_IMAGE=$(BASE_IMAGE) \
		-f docker/Dockerfile -t $(IMAGE) .

# The GPU image (docker/Dockerfile.gpu): the same scriptserve wheel, PyTorch's CUDA build and the
# gpu extra, fetched as it builds (it needs PyPI, the PyTorch index and NVIDIA's registry).
image-gpu:
	command -v $(BUILDAH) >/dev/null || (apt-get update -qq && apt-get install -y -qq buildah)
	PYTHON=$(PYTHON) docker/wheelhouse.sh --project-only build/gpu-wheel
	$(BUILDAH) bud --isolation chroot --format docker -f docker/Dockerfile.gpu -t $(GPU_IMAGE) .

# mypy checks the package as it is imported (`scriptserve.*`) through build/typecheck/, a tree of
# links to the package's folders; lint-imports checks the architecture's import rules (the
# contracts in pyproject.toml) through the same tree: from the repository root it would take
# benchmarks/ for a subpackage.
PACKAGE_PARTS = __init__.py __main__.py py.typed archiver handlers server training

lint: install
	ruff check .
	ruff format --check .
	mkdir -p build/typecheck/scriptserve
	for part in $(PACKAGE_PARTS); do ln -sfn ../../../$$part build/typecheck/scriptserve/$$part; done
	mypy
	PYTHONPATH=build/typecheck lint-imports --no-cache

gen-proto: install
	$(PYTHON) scripts/gen_proto.py

# Every figure of the README's performance table, by the command its row names, in the table's
# order (hours: the model zoo alone takes about one), then the other benchmarks, the Grafana
# dashboard and the charts (docs/images/). Load generators come from Debian's packages: wrk
# (HTTP) and h2load (gRPC, nghttp2-client); benchmarks/grpc_client (C++, closed-loop gRPC)
# builds on Debian's gRPC; the dashboard needs a real Prometheus, benchmarks/rollout Debian's
# haproxy. The zoo measures TorchServe 0.12 (Java 17) and OpenVINO beside scriptserve;
# benchmarks.quantize a TorchScript digits archive, trained here when model_store/ has none.
bench: install
	command -v wrk >/dev/null && command -v h2load >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq wrk nghttp2-client)
	command -v haproxy >/dev/null || (apt-get update -qq && apt-get install -y -qq haproxy)
	command -v java >/dev/null || (apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless)
	command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq prometheus)
	command -v protoc >/dev/null && command -v grpc_cpp_plugin >/dev/null && \
		pkg-config --exists grpc++ protobuf || \
		(apt-get update -qq && apt-get install -y -qq libgrpc++-dev protobuf-compiler-grpc \
			libprotobuf-dev protobuf-compiler pkg-config)
	$(PIP_INSTALL) openvino torchserve==0.12.0
	$(MAKE) -C benchmarks/grpc_client
	$(PYTHON) -m benchmarks.request_path --rounds 5 --seconds 6
	$(PYTHON) -m benchmarks.switches
	$(PYTHON) -m benchmarks.lock_in
	$(PYTHON) -m benchmarks.many_models
	$(PYTHON) -m benchmarks.pipelines
	$(PYTHON) -m benchmarks.http_load --scenarios B --repeats 2
	$(PYTHON) -m benchmarks.pt2
	test -f model_store/digits-torchscript.mar || $(PYTHON) -m scriptserve.training \
		--model lenet --epochs 10 --formats torchscript --out model_store
	$(PYTHON) -m benchmarks.quantize --digits-archive model_store/digits-torchscript.mar
	$(PYTHON) -m benchmarks.zoo
	$(PYTHON) -m benchmarks.streaming
	$(PYTHON) -m benchmarks.grpc_frontends
	$(PYTHON) -m benchmarks.grpc_load
	$(PYTHON) benchmarks/handler_threads.py
	$(PYTHON) -m benchmarks.http_load
	$(PYTHON) -m benchmarks.rollout
	$(PYTHON) -m benchmarks.dashboard
	$(PYTHON) -m benchmarks.charts
