# One command runs the main job (`make run`), one command passes the tests (`make test`).
# The environment (.venv) is (re)built only when pyproject.toml or the lock file changed.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pettingflow-installed
PYTEST_ARGS ?=

export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export RAY_USAGE_STATS_ENABLED := 0
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: venv test test-fast lint format run learn learn-plan-path learn-plan-path-control learn-code-tree stop clean-venv

venv: $(STAMP)

$(STAMP): pyproject.toml $(wildcard requirements/*.lock) scripts/bootstrap.sh
	scripts/bootstrap.sh
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Everything, real servers included (this is what CI runs). pytest's exit code 5 means no test ran:
# that is a failure here, never a silent pass.
test: venv lint
	@command -v bwrap >/dev/null || scripts/bootstrap.sh
	@scripts/test_deps.sh
	@# the MLflow server's own environment (about 2 minutes of pip) builds while the first tests run
	@(scripts/mlflow_server.sh --build > .venv-mlflow.log 2>&1 &)
	$(BIN)/python -m pytest --durations=80 $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The quick local loop: no end-to-end tests with real servers.
test-fast: venv
	@scripts/test_deps.sh
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

run: venv
	scripts/run.sh

# The learning run of docs/results.md: the code agent alone vs the two-agent team, each scored on the
# held-out split before and after training (about 70 min on 2 CPU cores). LEARN_ARGS="--overrides run.iterations=2"
learn: venv
	.venv/bin/pettingflow models prepare
	$(BIN)/python flows/learn.py $(LEARN_ARGS)

# The plan-path study of docs/results.md: tree + lookahead team credit vs tree vs independent GRPO vs one agent,
# the lookahead arm with the mean filter instead of DAPO, and its LoRA pair scored with the roles swapped (the
# positive control); three seeds each, every run stopped at 8k generated
# tokens (lookahead included), held-out success before and after (the base model scored once per seed for the
# arms that share it). Eighteen runs take several hours on 2 CPU cores: run it a seed at a time
# (LEARN_ARGS="--seeds 0", then 1, then 2) and combine the reports with `pettingflow runs learning-report --from-json`.
learn-plan-path: venv
	.venv/bin/pettingflow models prepare
	$(BIN)/python flows/learn.py \
		--configs plan-path-learn-lookahead plan-path-learn-tree plan-path-learn plan-path-learn-solo \
		plan-path-learn-lookahead-mean plan-path-learn-lookahead-lora --seeds 0 1 2 \
		--overrides run.iterations=24 run.max_generated_tokens=8000 training.save_optimizer_every=0 \
		--prune-checkpoints $(LEARN_ARGS)

# The plan-path study's positive control redone so it can fire (docs/results.md, "The positive control with a
# full-weight pair"): the lookahead arm with one full model per agent, three seeds, scored as trained and with the
# roles swapped. Each run starts its own two vLLM servers (about 25 min per seed on 2 CPU cores, nothing else running).
learn-plan-path-control: venv
	.venv/bin/pettingflow models prepare
	$(BIN)/python flows/learn.py --configs plan-path-learn-lookahead-full --seeds 0 1 2 \
		--overrides run.iterations=24 run.max_generated_tokens=8000 training.save_optimizer_every=0 \
		--prune-checkpoints $(LEARN_ARGS)

# The AT-GRPO evidence of docs/results.md on basic-python: tree vs independent GRPO vs the code agent alone,
# each stopped at 24k generated tokens, two seeds each (about 80 min on 2 CPU cores).
learn-code-tree: venv
	.venv/bin/pettingflow models prepare
	$(BIN)/python flows/learn.py --configs code-env-learn-tree code-env-learn code-env-learn-solo --seeds 0 1 \
		--overrides run.iterations=40 run.max_generated_tokens=24000 training.save_optimizer_every=0 \
		--prune-checkpoints $(LEARN_ARGS)

stop:
	scripts/stop.sh

clean-venv:
	rm -rf $(VENV)
