#!/usr/bin/env bash
# Installs shoal with its MPI extra into the Python environment first on PATH: the
# "Use shoal in your own project" commands (docs/guide/install.md). `make` runs this file,
# so the two cannot drift apart (tests/test_install_docs.py checks that page shows these
# lines).
#
#   bash install.sh [PIP_ARGS...]    what to install as shoal; default: "<this folder>[mpi]"
#
# mpi4jax has no CPU wheel. It builds from source against the `mpich` wheel's mpicc, found
# on PATH (so the environment's bin/ must come first, as `source .venv/bin/activate` does).
# It needs jax at build time without declaring it, hence jax first, then
# --no-build-isolation. On a machine with nvcc but no CUDA headers its CUDA part fails to
# compile, hence CUDA_PATH pointing at an empty folder: the CPU build.
set -euo pipefail
if [ $# -eq 0 ]; then set -- "$(cd "$(dirname "$0")" && pwd)[mpi]"; fi

python -m pip install "setuptools>=68" wheel mpich "mpi4py>=4" nanobind cython "jax>=0.10,<0.12"
CUDA_PATH="$(mktemp -d)" python -m pip install --no-build-isolation "mpi4jax>=0.9"
python -m pip install "$@"
