"""The install commands (README.md's "Use shoal in your own project", now in
docs/guide/install.md) are the ones `make` runs (install.sh), and shoal has a version."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from markdown_sections import section

import shoal

ROOT = Path(__file__).resolve().parents[1]
INSTALL = ("docs/guide/install.md", "Use shoal in your own project")


def test_readme_mpi_commands_are_install_sh():
    blocks = re.findall(r"```sh\n(.*?)```", section(*INSTALL), re.S)
    readme_mpi = [line for line in blocks[1].splitlines() if line.strip()]
    script = [
        line
        for line in (ROOT / "install.sh").read_text().splitlines()
        if line.startswith("python -m pip") or line.startswith("CUDA_PATH=")
    ]
    # The same build steps, in the same order; only what is installed as shoal differs.
    assert readme_mpi[:-1] == script[:-1]
    assert readme_mpi[-1] == 'python -m pip install "$SHOAL[mpi]"'
    assert script[-1] == 'python -m pip install "$@"'
    makefile = (ROOT / "Makefile").read_text()
    assert 'bash install.sh -e ".[mpi,dev]"' in makefile


def test_install_sh_pins_the_jax_of_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    jax_pin = next(d for d in deps if d.startswith("jax"))
    assert f'"{jax_pin}"' in (ROOT / "install.sh").read_text()


def test_version():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert shoal.__version__ == version


# Found by a benchmark that imported shoal.kernels first: kernels -> comms -> compressed ->
# kernels (half initialised) raised ImportError. Each package must import on its own.
@pytest.mark.parametrize(
    "module", ["shoal.kernels", "shoal.comms", "shoal.optim", "shoal.experiments.runner.cli"]
)
def test_each_package_imports_first(module):
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                         text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
