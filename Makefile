# episerve: `make demo` and `make test` set up everything they need in .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed


.PHONY: setup demo serve test test-slow test-all faults stress load bench bench-core bench-daemon bench-client lint typecheck protos protos-check clean kernel-asan

setup: $(STAMP)

# torch first, pinned: that build is the CPU one on local disk; the range in pyproject is
# then already satisfied, so nothing large is downloaded.
# Each step says what it installs; pip shows each package as it goes (no --quiet), and
# through a pipe tools/heartbeat.sh adds a line every 10 s while pip is silent. The first
# run took 2 min 5 s here with the wheels on local disk, longer when they download.
PIP := tools/heartbeat.sh $(PY) -m pip install --progress-bar on
DEMO_EXTRAS := server,synth,client
ALL_EXTRAS := server,synth,client,video,s3,lightning,dev,bench
# What the demo needs and no more: `make demo` on a fresh clone installs only this.
DEMO_STAMP := $(VENV)/.installed-demo

define venv_and_torch
	@echo "setup [1/4]: a Python venv in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "setup [2/4]: upgrading pip"
	$(PY) -m pip install --quiet --upgrade pip
	@echo "setup [3/4]: torch 2.13.0, the CPU build (a 192 MB wheel, 754 MB installed)"
	$(PIP) torch==2.13.0
endef

$(DEMO_STAMP): pyproject.toml setup.py server/episerve_server/core/_kernel.c
	@echo "setup: creating $(VENV) with what the demo needs (episerve with its $(DEMO_EXTRAS) extras); about 1-2 minutes, once; make setup adds the rest"
	$(venv_and_torch)
	@echo "setup [4/4]: episerve (editable) with its extras $(DEMO_EXTRAS)"
	$(PIP) -e '.[$(DEMO_EXTRAS)]'
	touch $(DEMO_STAMP)
	@echo "setup: done; $(VENV) has what the demo needs"

$(STAMP): pyproject.toml setup.py server/episerve_server/core/_kernel.c
	@echo "setup: creating $(VENV) with episerve and every extra; about 2-5 minutes, once"
	$(venv_and_torch)
	@echo "setup [4/4]: episerve (editable) with its extras $(ALL_EXTRAS)"
	$(PIP) -e '.[$(ALL_EXTRAS)]'
	touch $(DEMO_STAMP) $(STAMP)
	@echo "setup: done; $(VENV) is ready"

# The full setup holds the demo's, so a venv already set up is used as it is.
demo: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	$(VENV)/bin/episerve demo $(DEMO_ARGS)

serve: $(if $(wildcard $(STAMP)),$(STAMP),$(DEMO_STAMP))
	$(VENV)/bin/episerve serve

# The test tiers (docs/TESTING.md). Bytecode is cached even where PYTHONDONTWRITEBYTECODE is
# set: without the cache every run compiles and assertion-rewrites each test module again.
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest
# Every tier but the default one: the slow tests, and each Hypothesis test at its full count.
SLOW := (hypothesis or (slow and not smoke)) and not load and not bench and not stress and not faults
STRESS_ROUNDS ?= 200
# A tier that selects no test (pytest's exit 5) fails, saying so: each holds tests, so an
# empty one is a broken marker expression, not a pass.
tier = $(1) || { rc=$$?; [ $$rc != 5 ] || echo "pytest selected no test (exit 5)" >&2; exit $$rc; }

# The default tier: unit tests (Hypothesis profile dev) and the integration smoke set.
test: $(STAMP)
	$(call tier,$(PYTEST) $(PYTEST_ARGS))

test-slow: $(STAMP)
	$(call tier,EPITEST_HYPOTHESIS=ci EPITEST_BUDGET_S=0 $(PYTEST) -m '$(SLOW)' $(PYTEST_ARGS))

# Every tier, the Hypothesis tests at their full counts.
test-all: $(STAMP)
	$(call tier,EPITEST_HYPOTHESIS=ci EPITEST_BUDGET_S=0 $(PYTEST) -m '' $(PYTEST_ARGS))

faults: $(STAMP)
	$(call tier,$(PYTEST) -m faults tests/integration/test_exactness.py $(PYTEST_ARGS))

stress: $(STAMP)
	@echo "stress: $(STRESS_ROUNDS) rounds per case"
	$(call tier,EPITEST_STRESS_ROUNDS=$(STRESS_ROUNDS) $(PYTEST) -m stress tests/integration/test_teardown.py $(PYTEST_ARGS))

load: $(STAMP)
	$(call tier,$(PYTEST) -m load tests/load $(PYTEST_ARGS))

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

# The compiled loops built with AddressSanitizer and UndefinedBehaviorSanitizer (signed
# overflow included: no -fwrapv here), and their tests and the read plan's
# differential tests run on that build (EPISERVE_KERNEL points the daemon's code at it).
ASAN_KERNEL := build/asan/_kernel.so
kernel-asan: $(STAMP)
	mkdir -p build/asan
	cc -shared -fPIC -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	    -fno-omit-frame-pointer \
	    -I$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])") \
	    server/episerve_server/core/_kernel.c -o $(ASAN_KERNEL)
	EPISERVE_KERNEL=$(abspath $(ASAN_KERNEL)) ASAN_OPTIONS=detect_leaks=0 \
	    LD_PRELOAD=$$(cc -print-file-name=libasan.so) \
	    $(PYTEST) -p no:randomly -q tests/unit/test_kernel.py tests/unit/test_read_plan.py $(PYTEST_ARGS)

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
	$(LEROBOT_VENV)/bin/python -m pytest -p no:cacheprovider --noconftest -o filterwarnings=error -m slow \
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
	$(FLOOR_VENV)/bin/python -m pytest -p no:cacheprovider --noconftest -o filterwarnings=error -m slow \
	    tests/integration/test_lerobot_parity.py $(PYTEST_ARGS)

# LeRobot 0.3.3, the last release that writes and reads v2.1 datasets, in a venv of its own
# (Python 3.11; its torch<2.8 is a CUDA build of ~2.7 GB, ~8 min to download), with the
# client installed into it; the same parity tests run there on v2.1 datasets its writer
# made. Its writer leaves files unclosed (ResourceWarning) and torchvision warns that its
# video API is deprecated: those two warnings are LeRobot's, the rest are errors.
LEROBOT21_PYTHON ?= $(PYTHON)
LEROBOT21_VENV ?= .venv-lerobot21
LEROBOT21_STAMP := $(LEROBOT21_VENV)/.installed

.PHONY: lerobot21-env lerobot21-parity

lerobot21-env: $(LEROBOT21_STAMP)

$(LEROBOT21_STAMP): pyproject.toml
	$(LEROBOT21_PYTHON) -m venv $(LEROBOT21_VENV)
	$(LEROBOT21_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LEROBOT21_VENV)/bin/python -m pip install --quiet 'lerobot==0.3.3' 'pytest>=8' \
	    'pytest-timeout>=2.3'
	$(LEROBOT21_VENV)/bin/python -m pip install --quiet '.[client]'
	touch $(LEROBOT21_STAMP)

lerobot21-parity: $(LEROBOT21_STAMP) $(STAMP)
	DAEMON_PYTHON=$(abspath $(PY)) \
	PYTHONPATH=$(CURDIR)/protos:$(CURDIR)/client:$(CURDIR)/tools:$(CURDIR) \
	$(LEROBOT21_VENV)/bin/python -m pytest -p no:cacheprovider --noconftest -o filterwarnings=error \
	    -W ignore::ResourceWarning \
	    -W 'ignore:The video decoding and encoding capabilities of torchvision:UserWarning' \
	    -m slow tests/integration/test_lerobot_parity.py $(PYTEST_ARGS)

# Does pip's resolver take the client next to each LeRobot? Metadata only (no wheels are
# downloaded where the index serves it): LeRobot 0.4.4 on this venv's Python 3.11, LeRobot
# 0.6 with its dataset and training extras on Python 3.12.
lerobot-resolve: $(STAMP)
	@test -n "$(LEROBOT_PYTHON)" || { echo "no Python 3.12 found: set LEROBOT_PYTHON" >&2; exit 1; }
	$(PY) -m pip install --quiet --dry-run --ignore-installed 'lerobot==0.4.4' '.[client]'
	$(LEROBOT_PYTHON) -m pip install --quiet --dry-run --ignore-installed \
	    'lerobot[dataset,training]>=0.6,<0.7' '.[client]'

# Replay buffers written as Diffusion Policy writes them: zarr 2 (its writer), numcodecs'
# Blosc and imagecodecs' JPEG 2000 and JPEG XL, in a small venv of their own; every sample
# served through SequenceDataset is compared with the reference sampler's rule applied to
# zarr-python's own reading (tests/integration/test_replay_parity.py).
ZARR2_VENV ?= .venv-zarr2
ZARR2_STAMP := $(ZARR2_VENV)/.installed
REPLAY_PARITY_DATA ?= out/replay-parity

.PHONY: replay-env replay-parity

replay-env: $(ZARR2_STAMP)

$(ZARR2_STAMP):
	$(PYTHON) -m venv $(ZARR2_VENV)
	$(ZARR2_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ZARR2_VENV)/bin/python -m pip install --quiet 'zarr>=2.16,<3' 'numcodecs>=0.12,<0.16' \
	    'imagecodecs>=2024.6' 'numpy>=1.26'
	touch $(ZARR2_STAMP)

replay-parity: $(ZARR2_STAMP) $(STAMP)
	rm -rf $(REPLAY_PARITY_DATA)
	$(ZARR2_VENV)/bin/python -m tests.support.replay $(REPLAY_PARITY_DATA)
	REPLAY_PARITY_DATA=$(abspath $(REPLAY_PARITY_DATA)) $(PYTEST) -p no:randomly -m slow \
	    tests/integration/test_replay_parity.py $(PYTEST_ARGS)
