# One place for the project's commands. The README's two set-up commands are `make demo` and
# `make test`; .ci/run calls `make lint` and `make test`.
PYTHON ?= python3
DEMO_DIR ?= build/demo

.PHONY: install demo demo-archive test lint bench gen-proto

install:
	$(PYTHON) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'

# Build the demo archive into model_store/, run one prediction in-process, then serve it.
demo: install demo-archive
	scriptserve predict model_store/demo.mar --input $(DEMO_DIR)/sample.json
	scriptserve serve --model-store model_store --models demo=demo.mar

demo-archive: install
	$(PYTHON) scripts/demo_model.py $(DEMO_DIR)
	model-archiver --model-name demo --version 1.0 --serialized-file $(DEMO_DIR)/demo.pt \
		--handler tensor --sample-input $(DEMO_DIR)/sample.json --export-path model_store -f
	scriptserve archive verify model_store/demo.mar

test: install
	$(PYTHON) -m pytest -q -p no:cacheprovider

lint: install
	ruff check .
	ruff format --check .
	mypy

gen-proto: install
	$(PYTHON) scripts/gen_proto.py

# Load generators come from Debian's packages: wrk (HTTP) and h2load (gRPC, nghttp2-client).
bench: install
	command -v wrk >/dev/null && command -v h2load >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq wrk nghttp2-client)
	$(PYTHON) benchmarks/handler_threads.py
	$(PYTHON) -m benchmarks.http_load
	$(PYTHON) -m benchmarks.grpc_load
