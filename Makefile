# fastpersist developer tasks. Two commands on a fresh machine:
#   make bench   # the main job: write benchmark on a generated 2 GiB state dict
#   make test    # every test: Rust (test, clippy) and Python (pytest on the built wheel)

SHELL := /bin/bash
VENV ?= $(HOME)/.cache/fastpersist/venv
PY := $(VENV)/bin/python
DIST ?= target/wheels
BENCH_ARGS ?=

.PHONY: all venv wheel install test test-rust lint test-python bench bench-read bench-train bench-smoke clean

all: test

# One virtualenv, reused across runs (torch is several GB).
$(VENV)/.deps-ok: pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch>=2.1" numpy safetensors "hypothesis>=6" "pytest>=7" "maturin>=1.5,<2"
	touch $@

venv: $(VENV)/.deps-ok

wheel: venv
	rm -rf $(DIST)
	$(VENV)/bin/maturin build --release -q -o $(DIST)

install: wheel
	$(PY) -m pip install -q --force-reinstall --no-deps $(DIST)/fastpersist-*.whl

lint:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --features python --all-targets -- -D warnings

test-rust:
	cargo test -q

test-python: install
	$(PY) -m pytest tests/python -q

test: lint test-rust test-python

bench: install
	$(PY) benches/write_bench.py $(BENCH_ARGS)

bench-read: install
	$(PY) benches/read_bench.py $(BENCH_ARGS)

bench-train: install
	$(PY) benches/train_bench.py $(BENCH_ARGS)

# Under a minute: keeps the benchmarks working, measures nothing worth quoting.
bench-smoke: install
	$(PY) benches/write_bench.py --size 64MiB --rounds 1 --small-count 200 --small-size 16MiB
	$(PY) benches/read_bench.py --size 64MiB --rounds 1 --settle 0
	$(PY) benches/train_bench.py --layers 1 --dim 64 --heads 2 --vocab 512 --ctx 32 --iters 3 --rounds 1

clean:
	cargo clean
	rm -rf $(DIST)
