# gtp-recipes: `make help` lists the targets.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# python3.12 from PATH, else from pyenv's versions folder (pyenv shims refuse when 3.12 is not global).
PYTHON312 ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do \
	$$p -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1 && { echo $$p; break; }; done)
STAMP := $(VENV)/.installed
ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup train test test-fast test-kernels test-times bench golden gpu-smoke clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv with python3.12 and install the pinned dependencies (idempotent)

$(STAMP): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: python3.12 not found (on PATH or under ~/.pyenv/versions/3.12*)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $(STAMP)

train: setup ## train the tiny GPT on the embedded corpus with 2 CPU processes (ARGS='key=value ...')
	$(PY) train.py $(ARGS)

# Unit and config tests: no train.py run (e2e) and no multi-process world (multiprocess); the
# markers come from pyproject.toml and tests/conftest.py (which marks tests using train_run or
# run_distributed). Under 2 minutes on 2 cores (`make test`: under 30; docs/testing.md): two
# pytest-xdist workers, one per core (these tests start no processes of their own). The others
# run one at a time: each starts its own processes, which already keep both cores busy.
# Both halves run even when the first fails, but not after Ctrl-C or a usage error (exit 2);
# exit code 5 is pytest's "no test selected" (ARGS chose tests of the other kind only), an
# error only when neither half selected any. Each half has its own -m: select with paths or
# -k in ARGS (a -m there would replace the half's).
UNIT := -m "not multiprocess and not e2e"
WORLD := -m "multiprocess or e2e"

test: setup ## run unit, multi-process and end-to-end tests on CPU
	@trap 'exit 130' INT; unit=0; world=0; \
	$(PY) -m pytest -n 2 $(UNIT) $(ARGS) || unit=$$?; \
	[ $$unit -ne 2 ] || exit 2; \
	$(PY) -m pytest $(WORLD) $(ARGS) || world=$$?; \
	[ "$$unit$$world" != 55 ] || exit 5; \
	for rc in $$unit $$world; do [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc; done

test-fast: setup ## run the unit and config tests only (no multi-process, no end-to-end)
	$(PY) -m pytest -n 2 $(UNIT) $(ARGS)

# Every world test file that compares two runs bit for bit (resume_checks.assert_bit_for_bit),
# under two other kernel choices: a same-computation pair holds under any (docs/testing.md).
KERNEL_FILES = $(shell grep -l assert_bit_for_bit tests/test_*.py)

test-kernels: setup ## run the bit-for-bit resume tests under ATEN_CPU_CAPABILITY=default and avx2
	@for cap in default avx2; do echo "ATEN_CPU_CAPABILITY=$$cap"; \
	ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest $(WORLD) $(KERNEL_FILES) $(ARGS) || exit $$?; done

test-times: setup ## run the whole suite and rewrite the per-file time table in docs/testing.md
	$(PY) -m pytest --time-table=docs/testing.md $(ARGS)

gpu-smoke: setup ## one CUDA GPU: nccl, bf16, 20 iterations, save, resume (scripts/gpu_smoke.sh)
	PY=$(PY) scripts/gpu_smoke.sh

golden: setup ## regenerate tests/golden/loss_curve.json (the golden loss curve; say why in the commit)
	$(PY) tests/helpers/golden_curve.py

bench: setup ## run the benchmarks and print their tables
	$(PY) -m benchmarks $(ARGS)

clean: ## remove outputs and caches (keeps .venv)
	rm -rf outputs multirun .cache .pytest_cache .hypothesis
