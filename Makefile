# episerve: `make demo` and `make test` set up everything they need in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo serve test test-all stress load bench bench-core bench-daemon bench-client lint typecheck protos protos-check clean

setup: $(STAMP)

# torch first, pinned: that build is the CPU one on local disk; the range in pyproject is
# then already satisfied, so nothing large is downloaded.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[server,synth,client,video,s3,lightning,dev,bench]'
	touch $(STAMP)

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

# LeRobot in a venv of its own (Python 3.12, its own torch and PyAV), with this project's client
# installed into it the way a LeRobot user would: `pip install '.[client]'`. The daemon keeps
# running from .venv; the parity tests and the LeRobot bench section run here.
LEROBOT_PYTHON ?= $(firstword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12) $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12))
LEROBOT_VENV ?= .venv-lerobot
LEROBOT_SPEC ?= lerobot[dataset]>=0.6,<0.7
LEROBOT_STAMP := $(LEROBOT_VENV)/.installed

.PHONY: lerobot-env lerobot-parity lerobot-parity-floor lerobot-resolve

lerobot-env: $(LEROBOT_STAMP)

$(LEROBOT_STAMP): pyproject.toml
	@test -n "$(LEROBOT_PYTHON)" || { echo "no Python 3.12 found: set LEROBOT_PYTHON" >&2; exit 1; }
	$(LEROBOT_PYTHON) -m venv $(LEROBOT_VENV)
	$(LEROBOT_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LEROBOT_VENV)/bin/python -m pip install --quiet '$(LEROBOT_SPEC)' 'pytest>=8' 'pytest-timeout>=2.3'
	$(LEROBOT_VENV)/bin/python -m pip install --quiet '.[client]'
	touch $(LEROBOT_STAMP)

# The parity tests against LeRobotDataset, in LeRobot's venv, on this tree's client; the
# daemon runs from .venv (tests/integration/test_lerobot_parity.py).
lerobot-parity: $(LEROBOT_STAMP) $(STAMP)
	DAEMON_PYTHON=$(abspath $(PY)) \
	PYTHONPATH=$(CURDIR)/protos:$(CURDIR)/client:$(CURDIR)/tools:$(CURDIR) \
	$(LEROBOT_VENV)/bin/python -m pytest -p no:cacheprovider --noconftest -o filterwarnings=error \
	    tests/integration/test_lerobot_parity.py $(PYTEST_ARGS)

# The oldest grpcio and protobuf the client claims (pyproject.toml), under the same parity
# tests: a small venv holding only those two, in front of LeRobot's venv (a .pth file).
FLOOR_VENV ?= .venv-floor
CLIENT_FLOOR ?= grpcio==1.73.1 protobuf==6.31.1

lerobot-parity-floor: $(LEROBOT_STAMP) $(STAMP)
	rm -rf $(FLOOR_VENV)
	$(LEROBOT_PYTHON) -m venv --without-pip $(FLOOR_VENV)
	$(LEROBOT_VENV)/bin/python -m pip install --quiet --no-deps \
	    --target $(FLOOR_VENV)/lib/python3.12/site-packages $(CLIENT_FLOOR)
	$(LEROBOT_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])" \
	    > $(FLOOR_VENV)/lib/python3.12/site-packages/zz-lerobot.pth
	CLIENT_FLOOR_PINS='$(CLIENT_FLOOR)' DAEMON_PYTHON=$(abspath $(PY)) \
	PYTHONPATH=$(CURDIR)/protos:$(CURDIR)/client:$(CURDIR)/tools:$(CURDIR) \
	$(FLOOR_VENV)/bin/python -m pytest -p no:cacheprovider --noconftest -o filterwarnings=error \
	    tests/integration/test_lerobot_parity.py $(PYTEST_ARGS)

# Does pip's resolver take the client next to each LeRobot? Metadata only (no wheels are
# downloaded where the index serves it): LeRobot 0.4.4 on this venv's Python 3.11, LeRobot
# 0.6 with its dataset and training extras on Python 3.12.
lerobot-resolve: $(STAMP)
	@test -n "$(LEROBOT_PYTHON)" || { echo "no Python 3.12 found: set LEROBOT_PYTHON" >&2; exit 1; }
	$(PY) -m pip install --quiet --dry-run --ignore-installed 'lerobot==0.4.4' '.[client]'
	$(LEROBOT_PYTHON) -m pip install --quiet --dry-run --ignore-installed \
	    'lerobot[dataset,training]>=0.6,<0.7' '.[client]'
