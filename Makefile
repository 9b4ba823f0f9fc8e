# Everything a fresh machine needs: `make demo` and `make test` create .venv and install into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo demo-composer demo-agent test lint install clean gpu-check

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned to the version the project is tested with. Which build pip takes (CPU or CUDA)
	# depends on the index it is pointed at; the code runs on either.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[s3,hf,modal,openenv,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/composer-serverless launch deploy/configs/local-demo.toml

demo-composer: $(STAMP)
	$(VENV)/bin/composer-serverless launch deploy/configs/local-composer.toml

# Agentic RL in two runs: a warm start on example traces (the tool-call syntax), then GRPO on episodes against
# the environment (deploy/configs/local-agent-warmup.toml, local-agent.toml). Fresh run ids every time.
AGENT_RUN = agent-$(shell date +%Y%m%d-%H%M%S)
demo-agent: $(STAMP)
	$(eval RUN := $(AGENT_RUN))
	$(VENV)/bin/composer-serverless launch deploy/configs/local-agent-warmup.toml --set run_id=$(RUN)-warmup
	$(VENV)/bin/composer-serverless launch deploy/configs/local-agent.toml --set run_id=$(RUN) \
		--set model.path=runs/$(RUN)-warmup/final

# The GPU lines end to end (benchmarks/gpu_check.py): on a CUDA machine at the Qwen2.5 shapes; elsewhere at a
# tiny shape on the simulated accelerator. Writes docs/results/gpu/<device>.json and .md.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

# Style, formatting and the import layering, each held by a tool (contracts: pyproject.toml).
lint: $(STAMP)
	$(PY) -m ruff check composer_serverless tests benchmarks deploy
	$(PY) -m ruff format --check composer_serverless tests benchmarks deploy
	$(VENV)/bin/lint-imports

test: lint
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs
