"""``shoal-run --help`` answers from the parser alone: the usage and the bundled configs,
exit status 0, and JAX never imported."""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from shoal.experiments.runner.arguments import bundled_algorithms, bundled_configs

HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax")


def _words(text: str) -> str:
    # argparse wraps the epilog at the terminal width: compare without the line breaks.
    return " ".join(text.split())


def test_console_script_is_the_light_entry_point():
    (script,) = [e for e in metadata.entry_points(group="console_scripts") if e.name == "shoal-run"]
    assert script.value == "shoal.experiments.runner.command:main"


def test_console_script_help():
    exe = Path(sys.executable).parent / "shoal-run"
    if not exe.is_file():
        pytest.skip(f"no console script next to {sys.executable}")
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: shoal-run"), proc.stdout
    assert f"bundled configs: {', '.join(bundled_configs())}" in _words(proc.stdout)
    assert proc.stderr == ""


def test_help_lists_the_registered_algorithms():
    # Read from the algorithms' module names (no import): one module per algorithm.
    from shoal.experiments.algorithms import ALGORITHMS

    assert bundled_algorithms() == sorted(ALGORITHMS)


def test_help_imports_no_jax():
    code = (
        "import sys\n"
        "from shoal.experiments.runner.command import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code)\n"
        f"print('heavy', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("usage: shoal-run")
    assert lines[-2:] == ["exit 0", "heavy []"], proc.stdout
