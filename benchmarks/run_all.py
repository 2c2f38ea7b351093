"""Run every benchmark in `benchmarks/` and rewrite its generated block in BENCHMARKS.md.

Usage: ``.venv/bin/python benchmarks/run_all.py [--only NAME[,NAME]] [--dry-run]
[--timeout S]`` (``make bench`` runs it with no options).

Every ``benchmarks/*.py`` except this file and ``gpu_check.py`` (the GPU machine's check,
``make gpu-check``, which writes its own block) is a benchmark; its NAME is the file's stem.
`LAUNCH` below says how to start one (plain ``python``, or ``mpiexec -n K`` and extra
arguments); a script not listed there runs as plain ``python NAME.py``. Each runs in turn
from the repository root, with a timeout, its stdout captured.

In BENCHMARKS.md a benchmark's block lies between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->``; only that block is rewritten, the hand-written text around it
stays as it is. The block holds a "Latest run" line (date, machine: CPU model, cores,
memory, jax version, load average; the command; how long it took) and the script's output:
as markdown where the script prints a markdown table (its headings turned into bold lines,
so they do not open new sections of the document), otherwise verbatim in a ``text`` code
block. Where the markers are missing, the block goes right after the first paragraph
under the heading whose first word is NAME (``## NAME ...``); without such a heading, a
new section ``## NAME`` is appended at the end. BENCHMARKS.md is written after every
benchmark, so an interrupted run keeps the blocks already done.

A benchmark that exits non-zero or runs out of time gets "FAILED (...)" and the last lines
of its output in its block; the others still run, and this script exits 1 at the end.
``--dry-run`` runs nothing and writes nothing: it prints, for each benchmark, the command,
where its block would go, and the block with the output left out.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOC = ROOT / "BENCHMARKS.md"
DEFAULT_TIMEOUT = 900  # seconds, as the Makefile's MPI_TIMEOUT
TAIL_LINES = 20  # lines of output kept in the block of a failed benchmark


@dataclass(frozen=True)
class Launch:
    """How to start one benchmark: ``ranks`` MPI ranks under mpiexec (0: plain python)."""

    ranks: int = 0
    args: tuple[str, ...] = ()
    timeout: int = DEFAULT_TIMEOUT


# Benchmarks that need more than ``python NAME.py``.
LAUNCH: dict[str, Launch] = {
    "mpi_allreduce": Launch(ranks=4),
    "bfb_allreduce": Launch(ranks=6, args=("--fused",)),
    # Every quickstart algorithm at 0.1M-4M parameters and 8-64 workers: ~27 min on 2 cores.
    "sim_scale": Launch(timeout=2700),
    # DiLoCo against drjax and the JAX floor, 1M MLP and 4M LM x 4, 8, 16: ~15 min on 2 cores.
    "sim_vs_jax_peer": Launch(timeout=2400),
    # 54 shoal-run jobs, 36 of them under mpiexec -n 4: ~25 min on 2 cores.
    "scan_steps": Launch(timeout=2700),
    # 18 fresh processes, 12 of them importing JAX: under a minute on 2 cores.
    "help_speed": Launch(timeout=300),
}


@dataclass
class Result:
    ok: bool
    status: str  # "" when ok, else what went wrong
    stdout: str
    stderr: str
    seconds: float
    load: tuple[float, float] = field(default=(0.0, 0.0))


NOT_BENCHMARKS = {Path(__file__).stem, "gpu_check"}


def discover() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.py") if p.stem not in NOT_BENCHMARKS)


def _mpiexec() -> str | None:
    """The venv's mpiexec (next to this python) if there is one, else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    from shutil import which

    return which("mpiexec")


def command(name: str) -> list[str]:
    launch = LAUNCH.get(name, Launch())
    cmd = [sys.executable, str(HERE / f"{name}.py"), *launch.args]
    if launch.ranks:
        mpiexec = _mpiexec()
        if mpiexec is None:
            raise FileNotFoundError("mpiexec not found (next to python or on PATH)")
        cmd = [mpiexec, "-n", str(launch.ranks), *cmd]
    return cmd


def _show(cmd: list[str]) -> str:
    """The command as typed from the repository root, with JAX_PLATFORMS if it is set."""
    prefix = f"{ROOT}{os.sep}"
    words = [w[len(prefix) :] if w.startswith(prefix) else w for w in cmd]
    env = os.environ.get("JAX_PLATFORMS")
    return (f"JAX_PLATFORMS={env} " if env else "") + shlex.join(words)


def cpu_model() -> str:
    """The CPU's model name (Linux), else what `platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f", {int(line.split()[1]) / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return ""


def _versions() -> str:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    jax, jaxlib = version("jax"), version("jaxlib")
    if jax is None:
        return "jax not installed"
    if jaxlib is None or jaxlib == jax:
        return f"jax{'/jaxlib' if jaxlib else ''} {jax}"
    return f"jax {jax}, jaxlib {jaxlib}"


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores{_memory_gib()}, {_versions()}"


def run(name: str, timeout: int) -> Result:
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        cmd = command(name)
    except FileNotFoundError as err:
        return Result(False, f"FAILED ({err})", "", "", 0.0, (load_start, load_start))
    # A session of its own, so that a timeout ends mpiexec and all of its ranks together.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        status = "" if proc.returncode == 0 else f"FAILED (exit code {proc.returncode})"
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                stdout, stderr = proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            stdout, stderr = proc.communicate()
        status = f"FAILED (timed out after {timeout} s)"
    seconds = time.perf_counter() - start
    return Result(not status, status, stdout, stderr, seconds, (load_start, os.getloadavg()[0]))


def to_markdown(stdout: str) -> str:
    """The script's output for the document: markdown when it prints a table, else a
    ``text`` code block. In markdown, headings become bold lines (the block sits inside a
    section) and consecutive prose lines become separate paragraphs, as printed."""
    lines = [line.rstrip() for line in stdout.strip("\n").splitlines()]
    if not lines:
        return "(no output)"
    if not any(line.startswith("|") for line in lines):
        fence = "````" if any(line.startswith("```") for line in lines) else "```"
        return "\n".join([f"{fence}text", *lines, fence])
    out: list[str] = []
    for line in lines:
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            line = f"**{heading.group(1).strip()}**"
        is_row = line.startswith("|")
        # A blank line between two prose lines, and between prose and a table.
        if out and out[-1] and line and not (is_row and out[-1].startswith("|")):
            out.append("")
        out.append(line)
    return "\n".join(out)


def _tail(text: str, label: str) -> list[str]:
    lines = text.rstrip().splitlines()[-TAIL_LINES:]
    return [f"--- last lines of {label} ---", *lines] if lines else []


def block(name: str, cmd: str, result: Result | None, date: str) -> str:
    """The generated block, markers included (``result`` None: the output left out)."""
    when = f"Latest run: {date}, machine: {machine()}"
    if result is None:
        body = "(the benchmark's output)"
        took = ""
    else:
        took = f" ({result.seconds:.0f} s)"
        when += f", load {result.load[0]:.2f} - {result.load[1]:.2f} (1-min average, start - end)"
        if result.ok:
            body = to_markdown(result.stdout)
        else:
            tail = _tail(result.stdout, "stdout") + _tail(result.stderr, "stderr")
            body = f"**{result.status}**\n\n" + (to_markdown("\n".join(tail)) if tail else "")
    header = f"{when}; command: `{cmd}`{took}."
    return "\n".join(
        [
            f"<!-- bench:{name}:start -->",
            "",
            header,
            "",
            body.rstrip(),
            "",
            f"<!-- bench:{name}:end -->",
        ]
    )


def _markers(name: str) -> re.Pattern:
    n = re.escape(name)
    return re.compile(rf"^<!-- bench:{n}:start -->$.*?^<!-- bench:{n}:end -->$", re.M | re.S)


def place(doc: str, name: str) -> tuple[str, int, int]:
    """Where ``name``'s block goes in ``doc``: (how, start, end) of the text it replaces."""
    found = _markers(name).search(doc)
    if found:
        return "replaces its block", found.start(), found.end()
    heading = re.search(rf"^#+[ \t]+{re.escape(name)}(?![\w-]).*$", doc, re.M)
    if heading:
        # After the heading, skip blank lines, then the paragraph that follows.
        lines = doc[heading.end() :].split("\n")
        offset, i = heading.end(), 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        while i < len(lines) and lines[i].strip():
            i += 1
        pos = offset + len("\n".join(lines[:i]))
        return f"goes after the first paragraph under '{heading.group(0)}'", pos, pos
    return "goes in a new section at the end", len(doc), len(doc)


def rewrite(doc: str, name: str, text: str) -> str:
    how, start, end = place(doc, name)
    if how.startswith("replaces"):
        return doc[:start] + text + doc[end:]
    if how.startswith("goes after"):
        return doc[:start] + "\n\n" + text + doc[end:]
    return doc.rstrip("\n") + f"\n\n## {name}\n\n{text}\n"


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only NAME (repeatable, or comma-separated)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan; run and write nothing"
    )
    parser.add_argument(
        "--timeout", type=int, help="seconds per benchmark (default: its LAUNCH entry)"
    )
    args = parser.parse_args()

    names = discover()
    if args.only:
        wanted = [n.strip() for arg in args.only for n in arg.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown benchmark(s) {', '.join(unknown)}; have {', '.join(names)}")
        names = [n for n in names if n in wanted]

    failed = []
    for i, name in enumerate(names, 1):
        timeout = args.timeout or LAUNCH.get(name, Launch()).timeout
        try:
            cmd = _show(command(name))
        except FileNotFoundError as err:
            cmd = f"{name}: {err}"
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
        if args.dry_run:
            how = place(doc, name)[0]
            print(
                f"[{i}/{len(names)}] {name}: would run `{cmd}` (timeout {timeout} s); block {how}:"
            )
            print(block(name, cmd, None, date))
            print()
            continue
        print(f"[{i}/{len(names)}] {name}: `{cmd}` (timeout {timeout} s)", flush=True)
        result = run(name, timeout)
        print(result.stdout.rstrip() or "(no output)")
        if not result.ok:
            failed.append(name)
            print(f"{name}: {result.status}", file=sys.stderr)
            print("\n".join(_tail(result.stderr, "stderr")), file=sys.stderr)
        print(f"{name}: {'ok' if result.ok else 'FAILED'} in {result.seconds:.1f} s\n", flush=True)
        # Read again: the document may have been edited while the benchmark ran.
        doc = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
        write(DOC, rewrite(doc, name, block(name, cmd, result, date)))

    if not args.dry_run:
        done = len(names) - len(failed)
        print(f"{done} of {len(names)} benchmark(s) ok; {DOC.name} updated", end="")
        print(f"; FAILED: {', '.join(failed)}" if failed else "")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
