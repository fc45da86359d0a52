# xdp-agg: set-up, tests, demo and benchmarks on a Debian/Ubuntu machine (run as root: sudo make ...).
#
#   sudo make demo     set up what is missing, then run the 4-worker demo all-reduce
#   sudo make test     set up what is missing, then run the test suite
#   make test-unit     the tests that need no root (tests/unit, tests/house)
#   sudo make bench    benchmarks: the XDP program per packet, and all-reduce against gloo
#   sudo make bench-training   DDP training (examples/train.py) through xdp-agg and gloo
#   sudo make soak     two jobs x 4 workers, 1% loss, SOAK_MINUTES (30): exact, flat, no leak
#   make docs          the API reference of hostlib and hostlib.pt (Sphinx, -W) in build/docs
#   make bundle        an offline install bundle in build/bundle (docs/install-offline.md)
#
# Set-up steps (each is skipped when already done): Debian packages (clang, llvm and libbpf-dev
# to build the BPF objects, bpftool, nftables, ...), bpffs mounted, a venv from the system Python
# with system site packages, the project installed editable with its test extra (pytest, and
# torch 2.13 for the PyTorch tests), the BPF objects built (make bpf). No kernel headers: the
# objects need only the UAPI headers (linux-libc-dev), and attach compiles nothing.

SHELL := /bin/bash
PY := .venv/bin/python
DEB_PKGS := clang llvm bpftool libbpf-dev \
	python3-venv python3-pip nftables iptables ethtool iproute2 iputils-ping tcpdump util-linux \
	clang-format
# Prometheus and promtool for tests/root/test_metrics_prometheus.py, without the recommended extras
# (node-exporter, ipmitool, ...). The test runs its own server (own port, temporary data); the
# package's service is enabled on a machine with systemd, left stopped in a container (its
# invoke-rc.d policy). Where it cannot be installed, the test says so and skips.
TEST_DEB_PKGS := prometheus
PYTEST_ARGS ?=
SOAK_MINUTES ?= 30

.PHONY: setup deps bpffs venv bpf ext test test-unit test-root demo bench bench-micro bench-training \
	soak codegen cli-doc docs bundle clean help

help:
	@sed -n '1,17p' Makefile

setup: deps bpffs venv bpf

deps:
	@missing=$$(for p in $(DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages: $$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi
	@missing=$$(for p in $(TEST_DEB_PKGS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages (tests only, no recommends): $$missing"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $$missing >/dev/null) || echo "could not install $$missing: its tests skip"; \
	fi

bpffs:
	@mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf

venv: .venv/.installed

.venv/.installed: pyproject.toml setup.py hostlib/_fastpath.c
	@test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages .venv
	$(PY) -m pip install -q --upgrade pip >/dev/null
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

# The XDP aggregator's BPF objects, one per build flavour, in xdp_switch/objects (clang -target
# bpf; those out of date only): what `attach` loads through libbpf (xdp_switch/objload.py).
bpf: venv
	$(PY) -m xdp_switch.bpfbuild

# The C extension hostlib._fastpath in the source tree (pip install -e builds it too).
ext: venv
	$(PY) setup.py -q build_ext --inplace

# docs/cli.md from the click tree (tests/house/test_docs.py checks it is current).
cli-doc: venv
	$(PY) tools/clidoc.py

# The API reference of hostlib and hostlib.pt from their docstrings (docs/api; Sphinx comes with
# the test extra); tests/house/test_api_docs.py builds it the same way.
docs: venv
	$(PY) -m sphinx -W --keep-going -q -b html docs/api build/docs
	@echo "build/docs/index.html"

# Every folder of tests/ (docs/testing.md, "Layout": the time each takes).
test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The tests that need neither root nor BPF: tests/unit and the checks of the code, tests/house.
test-unit: venv
	$(PY) -m pytest -q tests/unit tests/house $(PYTEST_ARGS)

# The tests that need root (BPF, namespaces): tests/root.
test-root: setup
	$(PY) -m pytest -q tests/root $(PYTEST_ARGS)

demo: setup
	$(PY) -m xdp_agg.cluster.demo

bench-micro: setup
	$(PY) -m xdp_agg.app.cli bench

bench: setup
	$(PY) -m xdp_agg.app.cli bench
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.allreduce

# DDP training through xdp-agg and through gloo (examples/train.py under torchrun), a few minutes.
bench-training: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.training

# Two concurrent jobs of 4 workers each, 1% loss both ways, mixed sizes, for SOAK_MINUTES minutes:
# every result checked, RSS/fds/map memory sampled; report in bench/results/soak/.
soak: setup
	$(PY) -m bench.soak --minutes $(SOAK_MINUTES) --report bench/results/soak

# The offline install bundle (docs/install-offline.md): Debian 12's debs (apt-get download) and the
# wheels for Python 3.11 and 3.12 (pip download), the project's sdist and its wheel for every
# target Python found here (BUNDLE_PYTHONS, default: this venv's and any python3.12 on PATH),
# the BPF objects in both (built here: the box needs no compiler), and tools/bundle/install.py, in build/bundle/xdp-agg-bundle-<version>.tar. Needs the network.
BUNDLE_PYTHONS ?=
bundle: bpf
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq; fi
	$(PY) tools/bundle/build.py $(foreach p,$(BUNDLE_PYTHONS),--python $(p))

codegen: venv
	$(PY) -m xdp_agg.codegen

clean:
	rm -rf .venv .pytest_cache *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +
