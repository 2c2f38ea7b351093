"""`shoal.experiments.runner.malloc`: with SHOAL_MALLOC=keep (the default of `shoal-run --backend
mpi|jax`) commands restart once with glibc's heap kept, with SHOAL_MALLOC=huge (the default
for simulated workers) with transparent huge pages; otherwise nothing changes."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.experiments.runner import malloc

PROBE = (
    "import os; from shoal.experiments.runner.malloc import reexec_with_tunables; "
    "print('start', os.getpid(), flush=True); reexec_with_tunables(); "
    "print('env', os.getpid(), os.environ.get('GLIBC_TUNABLES', ''))"
)
glibc = pytest.mark.skipif(not malloc.sys.platform.startswith("linux"), reason="glibc only")


def probe(**env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_MALLOC", "GLIBC"))}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**full, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


@glibc
def test_opt_in_restarts_once_with_the_tunables_same_process():
    lines = probe(SHOAL_MALLOC="keep")
    starts = [line.split()[1] for line in lines if line.startswith("start")]
    pid, tunables = next(line.split()[1:] for line in lines if line.startswith("env"))
    assert len(starts) == 2 and starts[0] == starts[1] == pid  # execve: the same PID
    assert tunables == malloc.TUNABLES


@glibc
def test_keeps_the_users_tunables():
    lines = probe(SHOAL_MALLOC="keep", GLIBC_TUNABLES="glibc.malloc.tcache_count=0")
    tunables = next(line.split()[2] for line in lines if line.startswith("env"))
    assert tunables == "glibc.malloc.tcache_count=0:" + malloc.TUNABLES


@pytest.mark.parametrize("setting", [None, "system", "other"])
def test_glibc_defaults_unless_asked(setting):
    lines = probe(**({} if setting is None else {"SHOAL_MALLOC": setting}))
    assert sum(line.startswith("start") for line in lines) == 1
    assert next(line for line in lines if line.startswith("env")).split()[2:] == []


def test_readme_exports_the_same_tunables_for_mpi_ranks_and_simulated_workers():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    exports = re.findall(r"export GLIBC_TUNABLES=(\S+)", readme)
    assert exports == [malloc.SETTINGS["keep"], malloc.SETTINGS["huge"]]


@glibc
@pytest.mark.parametrize(("setting", "restarts"), [(None, True), ("system", False)])
def test_a_keep_default_restarts_unless_the_user_says_system(setting, restarts):
    code = PROBE.replace("reexec_with_tunables()", "reexec_with_tunables(default='keep')")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_MALLOC", "GLIBC"))}
    if setting is not None:
        env["SHOAL_MALLOC"] = setting
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert sum(line.startswith("start") for line in lines) == (2 if restarts else 1)
    tunables = next(line for line in lines if line.startswith("env")).split()[2:]
    assert tunables == ([malloc.TUNABLES] if restarts else [])


def test_shoal_run_keeps_the_heap_for_one_worker_per_process_huge_pages_for_simulated():
    from shoal.experiments.runner.arguments import malloc_default

    assert malloc_default(["quickstart", "--backend", "mpi"]) == "keep"
    assert malloc_default(["quickstart", "--backend=jax", "--devices-per-worker", "2"]) == "keep"
    assert malloc_default(["quickstart"]) == "huge"
    assert malloc_default(["quickstart", "--backend", "sim", "--set", "steps=3"]) == "huge"


@glibc
@pytest.mark.parametrize("thp", [True, False])
def test_huge_pages_restart_once_where_the_kernel_can_give_them(thp):
    code = PROBE.replace("reexec_with_tunables()", "reexec_with_tunables(default='huge')")
    if not thp:  # a kernel whose THP mode is "never": restarting would change nothing
        code = code.replace(
            "import os;",
            "import os; import shoal.experiments.runner.malloc as m; "
            "m._thp_possible = lambda: False;",
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_MALLOC", "GLIBC"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    restarts = thp and malloc._thp_possible()
    assert sum(line.startswith("start") for line in lines) == (2 if restarts else 1)
    tunables = next(line for line in lines if line.startswith("env")).split()[2:]
    assert tunables == (["glibc.malloc.hugetlb=1"] if restarts else [])


@glibc
def test_set_tunables_are_not_added_twice():
    lines = probe(SHOAL_MALLOC="huge", GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert sum(line.startswith("start") for line in lines) == 1
    assert next(line for line in lines if line.startswith("env")).split()[2] == (
        "glibc.malloc.hugetlb=0"
    )


def test_describe_names_the_setting(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert malloc.describe() == "glibc defaults"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    assert malloc.describe() == "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (SHOAL_MALLOC=huge)"
