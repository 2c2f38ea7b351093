# The README's two commands: `make run` and `make test`. Both create .venv on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(abspath $(VENV))/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
# Put the venv's MPI (mpich wheel: mpicc, mpiexec) first on PATH for every recipe.
export PATH := $(BIN):$(PATH)
# Keep XLA on the CPU and quiet on CI machines that have CUDA tooling but no GPU.
export JAX_PLATFORMS ?= cpu
MPI_RANKS ?= 4
# pytest-xdist processes for the in-process tests and the notebooks (a file stays on one
# process, so module fixtures that start jobs are not run twice).
TEST_PROCS ?= 2
MPI_TIMEOUT ?= 900

.PHONY: run test test-sim test-nb test-mpi test-gpu-rehearse gpu-check notebooks bench \
	bench-cluster study reproduce reproduce-causes lint wheel-check clean venv docs \
	test-docs

venv: $(STAMP)

# install.sh holds the "own project" commands (docs/guide/install.md); an empty pip cache
# is enough. The dev extra includes the docs extra (make docs).
$(STAMP): pyproject.toml Makefile install.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	PIP_QUIET=1 bash install.sh -e ".[mpi,dev]"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/shoal-run experiments/configs/quickstart.py --workers 8 --overwrite

# The in-process tests, then the MPI tests, then the documentation site, whose build
# executes the notebooks (the tutorials) top to bottom.
test: test-sim test-mpi test-gpu-rehearse test-docs

# tests/test_docs.py runs in test-docs, on the site that `make docs` built, not here (it
# would build the site a second time).
NOT_HERE := --ignore=tests/test_docs.py

test-sim: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_PROCS) --dist loadfile $(NOT_HERE) tests

# The notebooks, executed top to bottom as a user runs them (one size each, chosen to run in
# about a minute or less), without building the site (`make docs` executes them too). The
# committed .ipynb only: their .py sources are not tests (tests/test_notebooks_sync.py
# checks that the two agree). Their kernels compile with the tests' XLA flags
# (tests/xla_flags.py).
NB := XLA_FLAGS="$$XLA_FLAGS $$($(PY) tests/xla_flags.py)"
test-nb: $(STAMP)
	$(NB) $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_PROCS) --nbmake notebooks/*.ipynb

# The documentation site (mkdocs.yml, docs/building_docs.md) in site/: --strict fails on
# any warning, broken link or cross-reference mkdocstrings cannot resolve, and a tutorial
# notebook's cell that raises (they run with the tests' XLA flags). The variables silence
# the banners two installed packages print about MkDocs 2.0.
DOCS_ENV := NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true
docs: $(STAMP)
	$(DOCS_ENV) $(NB) $(BIN)/mkdocs build --strict --site-dir site

# The built site holds every public name and a page for every registered algorithm.
test-docs: docs
	SHOAL_DOCS_SITE=site $(PY) -m pytest -q -p no:cacheprovider tests/test_docs.py

# Rewrite notebooks/*.ipynb (empty outputs) from their jupytext sources notebooks/NN_*.py.
notebooks: $(STAMP)
	$(PY) notebooks/build.py

# Rank-agnostic tests again, one worker per MPI rank; the timeout turns a deadlock into a failure.
# Only the files that hold such tests: every rank collects what it is given.
test-mpi: $(STAMP)
	timeout -k 10 $(MPI_TIMEOUT) $(BIN)/mpiexec -n $(MPI_RANKS) \
		$(PY) -m pytest -q -m mpi -p no:cacheprovider $$(grep -l 'mark\.mpi' tests/test_*.py)

# The GPU machine's check (benchmarks/gpu_check.py; BENCHMARKS.md's "## gpu" gives the
# device command and its time limit): that machine's own python3, no venv, no install,
# under 8 minutes; writes BENCHMARKS.md's gpu block. GPU_CHECK_ARGS: e.g. "--stages lm
# --budget lm=200" for a second try of one stage.
GPU_PYTHON ?= python3
GPU_CHECK_OUT ?= runs/gpu-check
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) --write-benchmarks $(GPU_CHECK_ARGS)

# The GPU check's CPU rehearsal as the GPU machine would run it: Python 3.12 with jax
# 0.11.2 and that machine's packages (benchmarks/gpu/machine.txt) in .venv-gpu, shoal not
# installed. (The rehearsal under this venv's Python runs in test-sim: tests/test_gpu_check.py.)
# Without a Python 3.12 it is skipped, with a line saying so, except on CI (CI=true).
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
GPU_VENV := .venv-gpu
$(GPU_VENV)/.installed: benchmarks/gpu/machine.txt
	$(PYTHON312) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q -r benchmarks/gpu/machine.txt
	touch $@

# drjax, for the check's peer stage, travels to the GPU machine as its wheel in .whl/ (the
# device tool carries it); the rehearsal imports it from there too.
DRJAX_WHEEL := drjax-0.2.1-py3-none-any.whl
.whl/$(DRJAX_WHEEL):
	$(GPU_VENV)/bin/python -m pip download -q --no-deps -d .whl drjax==0.2.1

test-gpu-rehearse:
	@if ! $(PYTHON312) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then \
		echo "test-gpu-rehearse: no Python 3.12 here (PYTHON312=$(PYTHON312)): not run"; \
		if [ "$$CI" = true ]; then exit 1; fi; \
	else \
		$(MAKE) --no-print-directory $(GPU_VENV)/.installed .whl/$(DRJAX_WHEEL) && \
		$(GPU_VENV)/bin/python benchmarks/gpu_check.py --rehearse --out runs/gpu-rehearse; \
	fi

# Every benchmarks/*.py (how each is launched: LAUNCH in run_all.py), each with a timeout;
# rewrites its generated block in BENCHMARKS.md. BENCH_ARGS: e.g. "--only gtc_pack", "--dry-run".
bench: $(STAMP)
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

# End-to-end step times on H network namespaces with shaped links (root only; not in
# `bench`): benchmarks/cluster/README.md. BENCH_ARGS: e.g. "--hosts 4 --rate-mbit 1000".
bench-cluster: $(STAMP)
	$(PY) benchmarks/cluster/run.py $(BENCH_ARGS)

# The longer experiments behind docs/experiments/studies.md (minutes each on 2 cores).
# The "Does it reproduce?" study (experiments/configs/reproduce.py): runs/reproduce/,
# about 80 minutes; `.venv/bin/shoal-run reproduce --resume` continues a stopped one.
reproduce: $(STAMP)
	$(BIN)/shoal-run experiments/configs/reproduce.py --overwrite

# The causes tested where its claims miss: each DiLoCo worker's batch 4x, 4x the steps and
# rounds, then one knob each of 1-bit Adam, DiLoCo, SparseLoCo and DeMo (about 20 minutes each).
reproduce-causes: $(STAMP)
	$(BIN)/shoal-run experiments/configs/reproduce_causes.py --overwrite
	$(BIN)/shoal-run experiments/configs/reproduce_rounds.py --overwrite
	$(BIN)/shoal-run experiments/configs/reproduce_knobs.py --overwrite

study: $(STAMP)
	$(BIN)/shoal-run experiments/configs/gtc_sweep.py --overwrite
	$(BIN)/shoal-run experiments/configs/acoustic_study.py --overwrite
	$(BIN)/shoal-run experiments/configs/onebit_lamb_lm.py --overwrite
	$(BIN)/shoal-run experiments/configs/herring_table3.py --overwrite
	$(BIN)/shoal-run experiments/configs/kungfu.py --overwrite
	$(BIN)/shoal-run experiments/configs/diloco_lm.py --overwrite
	$(BIN)/shoal-run experiments/configs/compression_pareto.py --overwrite
	$(BIN)/shoal-run experiments/configs/compression_pareto_lm.py --overwrite

# ruff; the layer contracts ([tool.importlinter] in pyproject.toml: lint-imports); and every
# shoal.* import resolving to a file for a type checker: mypy ([tool.mypy]) reads the code
# as an IDE does, and the target fails only on a shoal module or name it cannot resolve
# (the code is not otherwise type-checked: mypy's other reports are not read). A missing
# shoal module reads "Skipping analyzing" where mypy finds the editable install's shoal
# (it has no py.typed), "Cannot find ... module named" otherwise.
UNRESOLVED_SHOAL := (module named|Skipping analyzing) "shoal[."]|Module "shoal[."][^"]*" has no attribute
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	@out="$$($(BIN)/mypy 2>&1)" && rc=0 || rc=$$?; \
	if [ $$rc -gt 1 ]; then echo "$$out"; exit $$rc; fi; \
	if grep -E '$(UNRESOLVED_SHOAL)' <<< "$$out"; then \
		echo "mypy: the shoal imports above do not resolve to a module or name"; exit 1; fi; \
	echo "mypy: every shoal import resolves ($$(tail -1 <<< "$$out" | grep -o 'checked [0-9]* source files'))"

# Builds the sdist and, from it, the wheel, installs the wheel in a fresh venv and imports
# every module of shoal (a minute or more, mostly installing jax; not part of `make test`):
# tests/jobs/wheel_check.sh.
wheel-check: $(STAMP)
	PYTHON=$(PYTHON) bash tests/jobs/wheel_check.sh $(PY)

clean:
	rm -rf $(VENV) $(GPU_VENV) runs build site *.egg-info .mypy_cache .import_linter_cache
