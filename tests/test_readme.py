"""The README's example runs and does what it says."""

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(capsys):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)
    # capacity 0.25 of 64 elements = 16 words + 1 header (int32), all-gathered among 4
    # workers: 3 * 17 * 4 = 204 bytes each way per step, 612 in the three steps.
    total = "[612, 612, 612, 612]"
    assert capsys.readouterr().out == f"WireCount(sent={total}, received={total})\n"
    assert namespace["w"].shape == (4, 8, 8)


def section_code(title: str) -> str:
    """The first python block under the README's section ``title``."""
    section = README.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def test_readme_mesh_example_runs(tmp_path):
    # As a user runs it: a fresh process (its XLA_FLAGS line must come before jax starts).
    script = tmp_path / "mesh.py"
    script.write_text(section_code("The same code on a device mesh"))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    total = "[612, 612, 612, 612]"  # the vmap example's bytes, on 4 devices
    assert proc.stdout == f"WireCount(sent={total}, received={total})\n"


def test_readme_sharded_worker_example_runs(tmp_path):
    # The second recipe of the mesh section, as written, then its result against the same
    # three steps with one device per worker (vmap over whole models).
    section = README.read_text().split("## The same code on a device mesh\n", 1)[1]
    code = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)[1]
    check = """
def one_device(w, state, x, y):
    g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    updates, state = tx.update(g, state, w)
    return optax.apply_updates(w, updates), state
w1 = jnp.zeros((W, 8, 8)); s1 = jax.vmap(tx.init)(w1)
for _ in range(3):
    w1, s1 = jax.jit(jax.vmap(one_device, axis_name="workers"))(w1, s1, x, y)
print(float(jnp.abs(w - w1).max()), float(jnp.abs(w1).max()))
"""
    script = tmp_path / "sharded.py"
    script.write_text(code + check)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown, compared = proc.stdout.splitlines()
    assert shown == "(2, 8, 8) 0.0"  # both workers hold the same model
    diff, scale = map(float, compared.split())
    assert scale > 0.01 and diff <= 1e-5 * scale
