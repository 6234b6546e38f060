# fastpersist developer tasks. Two commands on a fresh machine:
#   make bench   # the main job: write benchmark on a generated 2 GiB state dict
#   make test    # every test: Rust (test, clippy) and Python (pytest on the built wheel)

SHELL := /bin/bash
VENV ?= $(HOME)/.cache/fastpersist/venv
PY := $(VENV)/bin/python
DIST ?= target/wheels
BENCH_ARGS ?=

.PHONY: all venv wheel install test test-rust lint typecheck test-python bench bench-read bench-train bench-dcp bench-sweep bench-smoke clean

all: test

# One virtualenv, reused across runs (torch is several GB). It also holds the
# frameworks the adapters in fastpersist.integrations are tested against (the
# extras' ranges in pyproject.toml); DeepSpeed is built against the torch
# installed first, with its ops JIT-built on first use (ninja). torchtitan
# (fastpersist.dcp.install() is tested through its CheckpointManager) comes
# without its training-only dependencies (wandb, datasets, tensorboard, ...):
# its checkpoint and model code needs only tyro and spmd_types.
$(VENV)/.deps-ok: pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch>=2.1" numpy safetensors "hypothesis>=6" "pytest>=7" "maturin>=1.5,<2" "ruff>=0.6" "mypy>=1.10"
	$(PY) -m pip install -q "lightning>=2.5,<3" "pytorch_lightning>=2.5,<3" "transformers>=5.0,<6" "accelerate>=1.0,<2" "trl>=1.16,<2" ninja
	$(PY) -m pip install -q "s3fs>=2024.6" "moto[server]>=5" "jsonargparse[signatures]>=4.27"
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "deepspeed>=0.19,<0.20"
	$(PY) -m pip install -q --no-deps "torchtitan>=0.3,<0.4"
	$(PY) -m pip install -q "tyro>=0.9" "spmd_types>=0.2"
	touch $@

venv: $(VENV)/.deps-ok

wheel: venv
	rm -rf $(DIST)
	$(VENV)/bin/maturin build --release -q -o $(DIST)

install: wheel
	$(PY) -m pip install -q --force-reinstall --no-deps $(DIST)/fastpersist-*.whl

# Rust: rustfmt, clippy (-D warnings, pedantic with the allowlist in Cargo.toml).
# Python: ruff (lints incl. mccabe 13, and formatting; ruff.toml), the package's
# types (typecheck: mypy), and the extension's stub checked against the built
# module (stubtest).
lint: venv
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --features python --all-targets -- -D warnings
	$(VENV)/bin/ruff check python tests benches examples
	$(VENV)/bin/ruff format --check python tests benches examples

stubtest: install
	$(PY) -m mypy.stubtest fastpersist._core

# Python types: mypy on python/fastpersist ([tool.mypy] in pyproject.toml: the
# settings, and the third-party packages without type information), against the
# frameworks in the venv. Its cache lives in the venv, so a reused venv checks
# only what changed (seconds; about a minute from scratch).
MYPY_CACHE ?= $(VENV)/.mypy_cache

typecheck: venv
	@$(PY) -c "import mypy" 2>/dev/null || $(PY) -m pip install -q "mypy>=1.10"
	$(PY) -m mypy --cache-dir $(MYPY_CACHE)

test-rust:
	cargo test -q

test-python: install
	$(PY) -m pytest tests/python -q

test: lint typecheck test-rust test-python stubtest

bench: install
	$(PY) benches/write_bench.py $(BENCH_ARGS)

bench-read: install
	$(PY) benches/read_bench.py $(BENCH_ARGS)

bench-train: install
	$(PY) benches/train_bench.py $(BENCH_ARGS)

bench-dcp: install
	$(PY) benches/dcp_bench.py $(BENCH_ARGS)

bench-sweep: install
	$(PY) benches/sweep_bench.py $(BENCH_ARGS)

# Under a minute: keeps the benchmarks working, measures nothing worth quoting.
bench-smoke: install
	$(PY) benches/write_bench.py --size 64MiB --rounds 1 --small-count 200 --small-size 16MiB
	$(PY) benches/read_bench.py --size 64MiB --small-count 200 --small-size 16MiB --rounds 1 --settle 0
	$(PY) benches/train_bench.py --layers 1 --dim 64 --heads 2 --vocab 512 --ctx 32 --iters 3 --rounds 1
	$(PY) benches/dcp_bench.py --size 64MiB --small-count 200 --small-size 16MiB --ranks 1,2 --rounds 1 --settle 0 --no-fio --async
	$(PY) benches/tiers_bench.py --size 16MiB --rounds 1 --iters 4 --every 2 --dim 64
	$(PY) benches/sweep_bench.py --size 16MiB --rounds 1 --blocks 1MiB,4MiB --depths 8 --arenas 32MiB --threads 1,2 --settle 0 --no-fio
	$(PY) benches/gpu_bench.py --stand-in --sizes 32MiB --rounds 1 --variants into=slots
	$(PY) benches/gpu_bench.py --stand-in --copy-rate 25 --sizes 32MiB --rounds 1

clean:
	cargo clean
	rm -rf $(DIST)

# Release artifacts in $(RELEASE_DIR): an abi3 wheel tagged manylinux_2_28
# (glibc >= 2.28; linked by zig against glibc 2.28 symbols, so the build
# machine's newer glibc does not leak into the tag; maturin's audit must agree
# or the build fails) and an sdist (builds from source with a Rust toolchain).
RELEASE_DIR ?= dist
ZIGLANG ?= ziglang==0.17.1

.PHONY: dist examples

dist: venv
	$(PY) -m pip install -q "$(ZIGLANG)"
	rm -rf $(RELEASE_DIR)
	$(VENV)/bin/maturin sdist -o $(RELEASE_DIR)
	PATH="$(VENV)/bin:$$PATH" $(VENV)/bin/maturin build --release --zig --compatibility manylinux_2_28 --auditwheel check -o $(RELEASE_DIR)
	@ls -l $(RELEASE_DIR)

# The examples in examples/, against the installed wheel (each finishes in seconds on 2 cores).
examples: install
	$(PY) examples/save_and_load.py
	$(PY) examples/async_training_loop.py
	$(PY) examples/distributed_save.py
	$(PY) examples/lightning_checkpoint.py
	$(PY) examples/transformers_trainer.py
	$(PY) examples/accelerate_state.py
	PATH="$(VENV)/bin:$$PATH" DS_ACCELERATOR=cpu $(PY) examples/deepspeed_engine.py
