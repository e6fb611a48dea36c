# episerve: `make demo` and `make test` set up everything they need in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo serve test test-all stress load bench bench-core bench-daemon bench-client lint typecheck protos protos-check clean

setup: $(STAMP)

# torch first, pinned: that build is the CPU one on local disk; the range in pyproject is
# then already satisfied, so nothing large is downloaded.
# Each step says what it installs; pip shows each package as it goes (no --quiet): the
# first run took 2 min 5 s here with the wheels on local disk, longer when they download.
$(STAMP): pyproject.toml
	@echo "setup: creating $(VENV) with episerve and every extra; about 2-5 minutes, once"
	@echo "setup [1/4]: a Python venv in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "setup [2/4]: upgrading pip"
	$(PY) -m pip install --quiet --upgrade pip
	@echo "setup [3/4]: torch 2.13.0, the CPU build (a 192 MB wheel, 754 MB installed)"
	$(PY) -m pip install --progress-bar on torch==2.13.0
	@echo "setup [4/4]: episerve (editable) with its extras server, synth, client, video, s3, lightning, dev, bench"
	$(PY) -m pip install --progress-bar on -e '.[server,synth,client,video,s3,lightning,dev,bench]'
	touch $(STAMP)
	@echo "setup: done; $(VENV) is ready"

demo: $(STAMP)
	$(VENV)/bin/episerve demo $(DEMO_ARGS)

serve: $(STAMP)
	$(VENV)/bin/episerve serve

test: $(STAMP)
	$(PY) -m pytest

test-all: $(STAMP)
	$(PY) -m pytest -m ''

stress: $(STAMP)
	$(PY) -m pytest -m stress tests/integration/test_teardown.py

load: $(STAMP)
	$(PY) -m pytest -m load tests/load

# Every benchmark on this commit, one after another: benchmarks/results/*.json, the charts and
# docs/PERFORMANCE.md (BENCH_ARGS="--only node,local" for some).
bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

bench-core: $(STAMP)
	$(PY) benchmarks/bench_core.py

bench-daemon: $(STAMP)
	$(PY) benchmarks/bench_daemon.py

bench-client: $(STAMP)
	$(PY) benchmarks/bench_client.py

lint: $(STAMP)
	$(VENV)/bin/ruff check protos server client tools tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy protos/episerve_proto server/episerve_server client/episerve_client tools/episerve_tools

protos: $(STAMP)
	$(PY) protos/generate.py

protos-check: $(STAMP)
	$(PY) protos/generate.py --check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis out
