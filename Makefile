# Every target creates or reuses .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test bench bench-full bench-real bench-fleet bench-peer lint e2e e2e-dashboard e2e-lb clean

# Two C headers the compiled modules build against, Debian packages installed with apt-get
# when missing (as root; otherwise say how). Without xxHash's (libxxhash-dev) the index makes
# its content keys through the xxhash package's Python API; without libzmq's (libzmq3-dev)
# the live drain is left out and live messages go by the Python path.
XXHASH_H := /usr/include/xxhash.h
ZMQ_H := /usr/include/zmq.h
$(XXHASH_H): PACKAGE := libxxhash-dev
$(ZMQ_H): PACKAGE := libzmq3-dev
$(XXHASH_H) $(ZMQ_H):
	@if [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(PACKAGE) \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(PACKAGE); }; \
	else echo "$(PACKAGE) is missing (apt-get install -y $(PACKAGE) as root): the build falls back to a Python path" >&2; fi

# index/_fast.pyx: the editable install compiles the index's loops; a changed source rebuilds.
$(STAMP): pyproject.toml setup.py index/_fast.pyx index/_keys.pxi index/_tables.pxi index/_batch.pxi app/api/_token_scan.pyx app/ingest/_live_drain.pyx | $(XXHASH_H) $(ZMQ_H)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvroute demo

# The replica tests run a real redis-server (Valkey speaks the same protocol): Debian's
# package, installed with apt-get when it is missing (as root; otherwise say how).
REDIS_SERVER := /usr/bin/redis-server
$(REDIS_SERVER):
	@test "$$(id -u)" = 0 || { echo "redis-server is missing: run 'apt-get install -y redis-server' as root" >&2; exit 1; }
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server; }

# The suite twice: with the compiled paths, then on their pure references alone
# (KVROUTE_PURE=1: what an install without a C compiler runs).
test: $(STAMP) $(REDIS_SERVER)
	$(BIN)/python -m pytest -q
	KVROUTE_PURE=1 $(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check app index sim tests benchmarks e2e
	$(BIN)/lint-imports
	$(BIN)/hadolint Dockerfile

bench: $(STAMP)
	$(BIN)/python -m benchmarks.index_bench --quick
	$(BIN)/python -m benchmarks.route_bench --quick
	$(BIN)/python -m benchmarks.saved_state --quick
	$(BIN)/python -m benchmarks.hitrate --quick
	$(BIN)/python -m benchmarks.hitrate --quick --clients 1,4,16 --out bench-out/clients \
		--policies round-robin,kvroute,kvroute-proxy,oracle+load \
		--workloads shared-system-prompts,multi-turn-chat
	$(BIN)/python -m benchmarks.peer_bench --quick --out bench-out/peer-quick
	$(BIN)/python -m benchmarks.ingest_bench --quick --out bench-out/ingest-quick

# kvroute beside Dynamo's standalone KV indexer on one stream (ingest, queries, memory);
# installs the peer (PyPI ai-dynamo) into bench-out/peer-venv on first use. `make bench`
# runs a quick version, without the peer unless that venv is already there.
PEER_ARGS ?=
bench-peer: $(STAMP)
	$(BIN)/python -m benchmarks.peer_bench $(PEER_ARGS)

bench-full: $(STAMP)
	$(BIN)/python -m benchmarks.index_bench
	$(BIN)/python -m benchmarks.hitrate --full

# A fleet of 32, 256 and 1,024 simulated workers behind one kvroute process (start-up,
# route and /healthz latency, idle CPU, RSS, shutdown); FLEET_ARGS=--huge adds 4,096.
FLEET_ARGS ?=
bench-fleet: $(STAMP)
	$(BIN)/python -m benchmarks.fleet_bench $(FLEET_ARGS)

# The dashboard in a real headless browser: Debian's chromium, installed with apt-get when
# it is missing (as root; otherwise say how), driven by Playwright (no browser download).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	@test "$$(id -u)" = 0 || { echo "chromium is missing: run 'apt-get install -y chromium' as root" >&2; exit 1; }
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium \
		|| { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; }

# kvroute's dashboard in headless Chromium over the simulated cluster (screenshot in
# e2e-out/), then kvroute against two real vLLM engines (CPU build, installed into .e2e/
# on first use).
e2e: e2e-dashboard
	$(BIN)/python -m e2e.run

e2e-dashboard: $(STAMP) $(CHROMIUM)
	$(BIN)/python -m e2e.dashboard

# nginx and HAProxy with deploy/'s files in front of kvroute and simulated vLLM; installs
# nginx, libnginx-mod-http-js and haproxy with apt-get when they are missing.
e2e-lb: $(STAMP)
	$(BIN)/python -m e2e.lb_run

# Hit rate per router on real vLLM engines (CPU build, installed into .e2e/ on first use).
# Long: BENCH_REAL_ARGS=--quick for the short version; output in bench-out/real/.
BENCH_REAL_ARGS ?=
bench-real: $(STAMP)
	$(BIN)/python -m benchmarks.real_hitrate $(BENCH_REAL_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info bench-out e2e-out
