"""The README's examples run and do what they say, and so do those of the docs pages its
longer sections moved to (docs/guide/*.md); the paths and links they name exist."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_sections import MOVED, README, ROOT, python_blocks, section

GUIDE = Path("docs") / "guide"


def test_readme_example_runs(capsys):
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    namespace = {}
    exec(compile(code, str(README), "exec"), namespace)
    # capacity 0.25 of 64 elements = 16 words + 1 header (int32), all-gathered among 4
    # workers: 3 * 17 * 4 = 204 bytes each way per step, 612 in the three steps.
    total = "[612, 612, 612, 612]"
    assert capsys.readouterr().out == f"WireCount(sent={total}, received={total})\n"
    assert namespace["w"].shape == (4, 8, 8)


def test_readme_example_is_the_guides():
    # docs/guide/composing.md opens with the same loop, which the test above runs.
    readme = python_blocks(README.read_text())[0]
    assert python_blocks(section(GUIDE / "composing.md", "Compose shoal with optax"))[0] == readme


def section_code(path: Path, title: str, index: int = 0) -> str:
    """The ``index``-th python block under the section ``title`` of the Markdown ``path``."""
    return python_blocks(section(path, title))[index]


MESH = (GUIDE / "mesh.md", "The same code on a device mesh")


def test_readme_mesh_example_runs(tmp_path):
    # As a user runs it: a fresh process (its XLA_FLAGS line must come before jax starts).
    script = tmp_path / "mesh.py"
    script.write_text(section_code(*MESH))
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
    code = section_code(*MESH, index=1)
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


MPI_EXAMPLE = ROOT / "examples" / "mpi_train.py"
MPI_GUIDE = (GUIDE / "mpi.md", "The same code under MPI")


def test_readme_mpi_example_is_the_example_script():
    # The MPI guide shows the whole script a user runs under mpiexec; the README the lines
    # that differ from the vmap loop, each as the script has it.
    assert section_code(*MPI_GUIDE) == MPI_EXAMPLE.read_text()
    script = MPI_EXAMPLE.read_text().splitlines()
    shown = [line for line in section_code(Path("README.md"), "MPI").splitlines() if line]
    assert len(shown) >= 8 and [line for line in shown if line not in script] == []


def test_readme_mpi_example_runs_under_mpiexec(tmp_path):
    """``mpiexec -n 2`` on the example: each rank trains on its own shard and prints its
    loss and bytes, which must be the vmap run's of the same two workers."""
    import harness

    if harness.UNDER_MPI:
        pytest.skip("starts its own mpiexec")
    exe = harness.mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc, stdout = harness.mpiexec_per_rank(2, [sys.executable, str(MPI_EXAMPLE)], tmp_path,
                                            timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = "".join(stdout).splitlines()
    got = [re.fullmatch(r"rank (\d): loss ([\d.]+), (.*)", line).groups() for line in lines]
    assert [int(r) for r, _, _ in got] == [0, 1]

    # The reference: the same two workers simulated in this process with vmap.
    import jax
    import jax.numpy as jnp
    import optax

    from shoal.comms import AxisCollective
    from shoal.optim import gtc

    n = 2
    coll = AxisCollective("workers", n)
    tx = optax.chain(gtc(0.01, collective=coll, capacity=0.25), optax.sgd(0.1))
    loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)

    def step(w, state, x, y):
        updates, state = tx.update(jax.grad(loss)(w, x, y), state, w)
        return optax.apply_updates(w, updates), state

    x, y = jax.random.normal(jax.random.key(0), (2, n, 32, 8))
    w = jnp.zeros((n, 8, 8))
    state = jax.vmap(tx.init)(w)
    for _ in range(3):
        w, state = jax.jit(jax.vmap(step, axis_name="workers"))(w, state, x, y)
    want = jax.vmap(loss)(w, x, y)
    assert abs(float(want[0]) - float(want[1])) > 1e-3  # the shards differ: a wrong pick shows
    for r, shown, wire in got:
        assert float(shown) == pytest.approx(float(want[int(r)]), rel=1e-5, abs=2e-6)
        # GTC at capacity 0.25 of 64 elements: 16 words + 1 header of 4 bytes, all-gathered
        # with the one other worker: 68 bytes each way per step, 204 in three steps.
        assert wire == "WireCount(sent=204, received=204)"


PS_EXAMPLE = ROOT / "examples" / "parameter_servers.py"


def test_readme_parameter_servers_example_is_the_example_script():
    assert section_code(*MPI_GUIDE, index=1) == PS_EXAMPLE.read_text()


def test_readme_parameter_servers_example_runs_under_mpiexec(tmp_path):
    """``mpiexec -n 4``: 2 workers reduce through 2 servers; BFB's mean is S-SGD's, so each
    worker's loss is the vmap run's of ``allreduce_gradients``; the bytes are hand-counted."""
    import harness

    if harness.UNDER_MPI:
        pytest.skip("starts its own mpiexec")
    exe = harness.mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc, stdout = harness.mpiexec_per_rank(4, [sys.executable, str(PS_EXAMPLE)], tmp_path,
                                            timeout=300, env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted("".join(stdout).splitlines())
    # Each server takes its half (32 float32) of the 64-element buffer from 2 workers, 3 steps.
    assert lines[:2] == ["server: 3 steps, 768 bytes received"] * 2  # sorted: servers first
    got = [re.fullmatch(r"worker (\d): loss ([\d.]+), (.*)", line).groups() for line in lines[2:]]

    import jax
    import jax.numpy as jnp
    import optax

    from shoal.comms import AxisCollective
    from shoal.optim import allreduce_gradients

    n = 2
    tx = optax.chain(allreduce_gradients(collective=AxisCollective("workers", n)), optax.sgd(0.1))
    loss = lambda w, x, y: jnp.mean((x @ w - y) ** 2)

    def step(w, state, x, y):
        updates, state = tx.update(jax.grad(loss)(w, x, y), state, w)
        return optax.apply_updates(w, updates), state

    x, y = jax.random.normal(jax.random.key(0), (2, n, 32, 8))
    w = jnp.zeros((n, 8, 8))
    state = jax.vmap(tx.init)(w)
    for _ in range(3):
        w, state = jax.jit(jax.vmap(step, axis_name="workers"))(w, state, x, y)
    want = jax.vmap(loss)(w, x, y)
    assert [int(r) for r, _, _ in got] == [0, 1]
    for r, shown, wire in got:
        assert float(shown) == pytest.approx(float(want[int(r)]), rel=1e-5, abs=2e-6)
        # Per step: the 256-byte buffer out to the servers and its sum back, plus the
        # 4-byte non-finite flag all-reduced between the 2 workers: 260 each way.
        assert wire == "WireCount(sent=780, received=780)"


# Files the runner writes (the README names them, a clone does not hold them), the docs
# site that `make docs` builds and the wheel's folder, and the placeholder of the runner's
# usage line.
GENERATED = ("runs/", "metrics.jsonl", "timing.jsonl", "sweep.jsonl", "summary.md", "report.md")
GENERATED += ("site/", "dist/")
PLACEHOLDERS = {"CONFIG.py"}
PATH_LIKE = re.compile(r"[\w.\-/]+")
FILE_EXT = re.compile(r"\.(py|md|sh|toml|ipynb|txt|json|jsonl|csv|cfg|ya?ml)$")


def readme_paths(path: Path = README) -> list[str]:
    """Every word of a backticked span of a Markdown file that names a file or folder: a
    path with a slash, or a name with a file extension (commands included, so the script in
    `shoal-run experiments/configs/x.py --workers 8` counts). Paths are from the repository
    root, in the README and in the docs pages its sections moved to alike."""
    words = {w for span in re.findall(r"`([^`\n]+)`", path.read_text()) for w in span.split()}
    return sorted(w for w in words if PATH_LIKE.fullmatch(w) and ("/" in w or FILE_EXT.search(w)))


@pytest.mark.parametrize("path", [README, *MOVED], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_readme_paths_exist_in_the_repository(path):
    paths = readme_paths(path)
    missing = [
        p
        for p in paths
        if not p.startswith(GENERATED) and p not in PLACEHOLDERS and not (ROOT / p).exists()
    ]
    assert missing == [], f"{path.name} names paths that are not in the repository: {missing}"


def test_moved_pages_name_the_readmes_paths():
    # The README's sections and the pages they moved to name these, among all the others.
    paths = {p for path in (README, *MOVED) for p in readme_paths(path)}
    assert {"experiments/runner/malloc.py", "examples/mpi_train.py", "install.sh"} <= paths


# A Markdown link or image: [text](target) or ![alt](target), an optional "title" after it.
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def anchors(text: str) -> set[str]:
    """The ids of a Markdown text's headings, as GitHub and MkDocs' toc make them."""
    titles = re.findall(r"^#{1,6} (.+?)\s*#*$", text, re.M)
    return {re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", t).strip().lower()) for t in titles}


def test_readme_links_resolve():
    """Every relative link of README.md names a file of the repository (or, for a link to
    a heading, a heading of the README)."""
    text = README.read_text()
    links = LINK.findall(text)
    assert "docs/guide/install.md" in links
    broken = []
    for link in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", link, re.I):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        if not target:
            if anchor not in anchors(text):
                broken.append(link)
            continue
        path = (README.parent / target).resolve()
        if not path.is_file() or not path.is_relative_to(ROOT):
            broken.append(link)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(link)
    assert broken == [], f"README.md links to what is not in the repository: {broken}"


def test_readme_quickstart_table_is_the_docs_page():
    # "At a glance": the README keeps the quickstart's table, and
    # docs/experiments/quickstart.md holds it with the rest of the section.
    readme = section("README.md", "At a glance").split("\n", 1)[1]
    table = "\n".join(line for line in readme.splitlines() if line.startswith("|"))
    assert "| ssgd |" in table and len(table.splitlines()) >= 20
    assert table in section("docs/experiments/quickstart.md", "At a glance")
