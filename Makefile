# kernelhost: `make serve` sets up and runs the service; `make test` runs the test suite.
# Both install what is missing first (distribution packages, the virtualenv, the guest image)
# and start libvirt's daemons when no init system runs them.

VENV ?= .venv
PY := $(VENV)/bin/python
IMAGE_DIR ?= $(or $(KERNELHOST_IMAGE_DIR),/var/cache/kernelhost/images)
PYTEST_ARGS ?=
# The extras of setup.cfg the virtualenv gets: the tests' by default; `make serve` installs only
# the server's and `make bench` adds the benchmarks' (target-specific values reach `deps`)
EXTRAS ?= server,jupyter,dev
export EXTRAS

JS := js

.PHONY: help deps js-deps image libvirt serve test test-unit test-vm test-js lint fmt bench clean

help:
	@echo "make serve   install (.[server]), build the guest image, start libvirt and the service"
	@echo "make test    install (.[server,jupyter,dev]), build, start libvirt, run unit + vm + clients tests"
	@echo "make image   build (or reuse) the guest images in $(IMAGE_DIR)"
	@echo "make lint    ruff check + ruff format --check + mypy;  make fmt: format"
	@echo "make bench   benchmarks under bench/"

deps:
	@VENV=$(VENV) scripts/install-deps.sh

image: deps
	@python3 guest-image/build.py --image-dir $(IMAGE_DIR)

libvirt: deps
	@scripts/start-libvirt.sh

serve: EXTRAS = server
serve: image libvirt
	@KERNELHOST_IMAGE_DIR=$(IMAGE_DIR) $(VENV)/bin/kernelhost serve

# The clients tier also runs other projects' suites (ipykernel's message-spec tests, LangChain's
# sandbox tests): their packages come from the registry at test time, LangChain's into a
# virtualenv of its own, cached in $${KERNELHOST_SUITES_CACHE:-~/.cache/kernelhost/suites}
# (tests/clients/suite_support.py)
test: image libvirt js-deps
	@KERNELHOST_IMAGE_DIR=$(IMAGE_DIR) $(PY) -m pytest -m "unit or vm or clients or cluster" $(PYTEST_ARGS)

# The npm package: dependencies from the lockfile (npm ci, only when the lockfile changed),
# then a tsc build. Its tests run in the clients tier (tests/clients/agents/test_js.py).
$(JS)/node_modules/.package-lock.json: $(JS)/package-lock.json $(JS)/package.json
	@echo "==> npm ci in $(JS)"
	@cd $(JS) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

js-deps: deps $(JS)/node_modules/.package-lock.json
	@cd $(JS) && npm run --silent build

test-js: image libvirt js-deps
	@KERNELHOST_IMAGE_DIR=$(IMAGE_DIR) $(PY) -m pytest -m clients tests/clients/agents/test_js.py $(PYTEST_ARGS)

test-unit: deps
	@$(PY) -m pytest -m unit $(PYTEST_ARGS)

test-vm: image libvirt
	@KERNELHOST_IMAGE_DIR=$(IMAGE_DIR) $(PY) -m pytest -m vm $(PYTEST_ARGS)

# ruff (lint and format) and mypy strict over the whole Python tree; CI runs it (.ci/run)
PY_TREE := kernelhost hypervisor guest-image tests bench
lint: deps
	@$(VENV)/bin/ruff check $(PY_TREE)
	@$(VENV)/bin/ruff format --check $(PY_TREE)
	@$(VENV)/bin/mypy

fmt: deps
	@$(VENV)/bin/ruff format $(PY_TREE)
	@$(VENV)/bin/ruff check --fix $(PY_TREE)

# The suite of bench/run.py (kernelhost, a local ipykernel, jupyter-kernel-gateway; ~10 min):
# writes bench/results/bench.{json,md} and rewrites README's Performance block.
# BENCH_ARGS=--quick for a smoke run.
BENCH_ARGS ?=
bench: EXTRAS = server,jupyter,dev,bench
bench: image libvirt
	@KERNELHOST_IMAGE_DIR=$(IMAGE_DIR) $(PY) bench/run.py --update-readme $(BENCH_ARGS)
	@KERNELHOST_IMAGE_DIR=$(IMAGE_DIR) $(PY) bench/bench_speed.py $(SPEED_ARGS)
	@KERNELHOST_IMAGE_DIR=$(IMAGE_DIR) $(PY) bench/bench_density.py $(DENSITY_ARGS)

clean:
	rm -rf $(VENV) results .pytest_cache .mypy_cache .ruff_cache *.egg-info $(JS)/node_modules $(JS)/dist $(JS)/build
