"""`shoal.experiments.runner.malloc`: with SHOAL_MALLOC=keep (the default of `shoal-run`)
commands restart once with glibc's heap kept, with SHOAL_MALLOC=huge (simulated runs above
`KEEP_LIMIT` parameters x workers) with transparent huge pages; otherwise nothing changes."""

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
    # README.md's "Use shoal in your own project", now in docs/guide/install.md.
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "install.md").read_text()
    exports = re.findall(r"export GLIBC_TUNABLES=(\S+)", guide)
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


def kept_by_default(monkeypatch, tunables=malloc.TUNABLES):
    """This process as `reexec_with_tunables(default="keep")` leaves it."""
    monkeypatch.delenv("SHOAL_MALLOC", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", tunables)
    monkeypatch.setenv(malloc._MARK, "keep")


@pytest.mark.parametrize("thp", [True, False])
def test_simulated_runs_over_the_limit_take_huge_pages(monkeypatch, thp):
    kept_by_default(monkeypatch, "glibc.malloc.tcache_count=0:" + malloc.TUNABLES)
    monkeypatch.setattr(malloc, "_thp_possible", lambda: thp)
    env = malloc.simulated_env(malloc.KEEP_LIMIT + 1)
    assert env["SHOAL_MALLOC"] == "huge" and env[malloc._MARK] == "huge"
    huge = ":glibc.malloc.hugetlb=1" if thp else ""
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0" + huge
    assert os.environ["GLIBC_TUNABLES"].endswith(malloc.TUNABLES)  # a copy: this one unchanged


def test_simulated_runs_up_to_the_limit_keep_the_heap(monkeypatch):
    kept_by_default(monkeypatch)
    assert malloc.simulated_env(malloc.KEEP_LIMIT) == dict(os.environ)


@pytest.mark.parametrize("setting", ["keep", "system"])
def test_the_users_setting_stands_at_any_size(monkeypatch, setting):
    kept_by_default(monkeypatch)
    monkeypatch.setenv("SHOAL_MALLOC", setting)
    assert malloc.simulated_env(1e12) == dict(os.environ)


def test_a_heap_not_kept_by_a_restart_stays(monkeypatch):
    # The user's own GLIBC_TUNABLES (no restart): theirs to change.
    monkeypatch.delenv("SHOAL_MALLOC", raising=False)
    monkeypatch.delenv(malloc._MARK, raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", malloc.TUNABLES)
    assert malloc.simulated_env(1e12) == dict(os.environ)


@glibc
@pytest.mark.parametrize(("count", "restarts"), [(3e8, True), (1e8, False)])
def test_restart_simulated_restarts_once_more_with_huge_pages(count, restarts):
    code = PROBE.replace(
        "reexec_with_tunables()",
        "reexec_with_tunables(default='keep'); "
        f"from shoal.experiments.runner.malloc import restart_simulated; "
        f"restart_simulated({count}, 'probe')",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_MALLOC", "GLIBC"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    starts = [line.split()[1] for line in lines if line.startswith("start")]
    assert len(starts) == (3 if restarts else 2) and len(set(starts)) == 1
    tunables = next(line for line in lines if line.startswith("env")).split()[2:]
    huge = ["glibc.malloc.hugetlb=1"] if malloc._thp_possible() else []
    assert tunables == (huge if restarts else [malloc.TUNABLES])
    assert ("probe: 3e+08 parameters x workers" in out.stderr) == restarts


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


@glibc
@pytest.mark.parametrize("limit", [None, 1])
def test_shoal_run_keeps_the_heap_for_a_simulated_run_up_to_the_limit(tmp_path, limit):
    """The command itself, on a small run: it keeps the heap; with the limit lowered so
    that the run is over it, it restarts once it has built the model, says why, and trains
    to the end with huge pages."""
    quickstart = Path(__file__).resolve().parents[1] / "experiments/configs/quickstart.py"
    lower = "" if limit is None else f"m.KEEP_LIMIT = {limit}; "
    code = (
        f"import os, sys; import shoal.experiments.runner.malloc as m; {lower}"
        "from shoal.experiments.runner.cli import main; rc = main(); "
        "print('tunables', os.environ.get('GLIBC_TUNABLES')); sys.exit(rc)"
    )
    args = [str(quickstart), "--workers", "2", "--no-progress", "--out", str(tmp_path / "run")]
    args += ["--set", "steps=2", "eval_every=2", "algorithms=ssgd", "project_workers=0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_MALLOC", "GLIBC"))}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    tunables = out.stdout.split("tunables ")[-1].strip()
    said = out.stderr.count("parameters x workers (over 1e+00): restarting with huge pages")
    if limit is None:
        assert tunables == malloc.TUNABLES and said == 0
    else:
        huge = malloc.HUGE_PAGES if malloc._thp_possible() else ""
        assert tunables == huge and said == 1
    assert (tmp_path / "run" / "metrics.jsonl").exists()
