"""`shoal-run` with a simulated clock (config ``speeds``): the same config and seed give
the same clock and metrics bit for bit; a straggler's extra compute is on every run's
critical path, by hand; the report's section, the plots, and the config's errors."""

import json

import pytest
from harness import QUICKSTART, UNDER_MPI

from shoal.experiments.runner.cli import main

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="runs the CLI in one process")

STEPS, WORKERS, STEP_MS = 20, 4, 5.0
BASE = ["--workers", str(WORKERS), "--no-progress", "--set", "algorithms=ssgd,diloco",
        f"steps={STEPS}", "eval_every=10", "project_workers=0", "project_cluster=wan-1gbps",
        f"compute_ms={STEP_MS}", "nonfinite=off", "diloco.sync_every=5"]  # fmt: skip


def run(tmp_path, name, speeds, *extra):
    out = tmp_path / name
    assert main([str(QUICKSTART), *BASE, f"speeds={speeds}", *extra, "--out", str(out)]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, records


def clock(records, algorithm):
    return [r["sim_time_s"] for r in records if r["algorithm"] == algorithm]


def test_same_config_and_seed_give_the_same_clock_bit_for_bit(tmp_path):
    spec = "2@0*lognormal:0.3*pareto:2"
    a, rec_a = run(tmp_path, "a", spec)
    b, rec_b = run(tmp_path, "b", spec)
    assert (a / "metrics.jsonl").read_bytes() == (b / "metrics.jsonl").read_bytes()
    section = lambda out: (out / "summary.md").read_text().split("## Simulated time")[1]  # noqa: E731
    assert section(a).split("## ")[0] == section(b).split("## ")[0]
    times = clock(rec_a, "diloco")
    assert len(times) == STEPS and all(x < y for x, y in zip(times, times[1:]))


@pytest.fixture(scope="module")
def straggler(tmp_path_factory):
    """Worker 0 three times as slow, every loss below the target (the first evaluation
    reaches it)."""
    return run(tmp_path_factory.mktemp("clock"), "slow", "3@0", "target_loss=100")


def test_a_stragglers_compute_is_on_the_critical_path(tmp_path, straggler):
    _, equal = run(tmp_path, "equal", "1")
    out, slow = straggler
    for algorithm in ("ssgd", "diloco"):
        # Every step (ssgd) or every round of 5 steps (diloco) waits for worker 0, whose
        # steps take 3x: 2 extra step times per step, by the end of each round.
        extra = [s - e for s, e in zip(clock(slow, algorithm), clock(equal, algorithm))]
        ends = range(4, STEPS, 5) if algorithm == "diloco" else range(STEPS)
        for k in ends:
            assert extra[k] == pytest.approx(2 * STEP_MS / 1e3 * (k + 1), rel=1e-9)
    text = (out / "summary.md").read_text().split("## Simulated time")[1].split("## ")[0]
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    # The other three wait 2 step times per step: their waiting share is 2 * STEPS * STEP_MS
    # over the run's time; worker 0 never waits.
    total = clock(slow, "ssgd")[-1]
    waiting = 2 * STEPS * STEP_MS / 1e3 / total
    assert rows["ssgd"].endswith(f"| 0.0%-{waiting:.1%} |"), rows["ssgd"]


def test_report_plots_and_time_to_target(straggler):
    out, records = straggler
    assert (out / "timeline.png").stat().st_size > 10_000
    assert (out / "loss_vs_sim_time.png").stat().st_size > 10_000
    text = (out / "summary.md").read_text()
    assert "## Simulated time" in text and "wan-1gbps" in text
    first_eval = clock(records, "ssgd")[9]  # every loss is below 100: the first evaluation's
    section = text.split("## Simulated time")[1]
    row = next(line for line in section.splitlines() if line.startswith("| ssgd |"))
    assert row.split(" | ")[2] == f"{first_eval:.4g}"


@pytest.mark.parametrize(
    "sets, message",
    [
        (["speeds=2@9"], "config field speeds = '2@9': workers '9' must lie in 0-3"),
        (["speeds=fast"], "speeds = 'fast': a factor must be a finite number > 0"),
        (["speeds=1", "project_cluster=v100-nvlink-25gbps"],
         "config field 'workers' must be a multiple of the 8 workers per node"),
        (["compute_ms=-1"], "config field 'compute_ms' must be a number of ms >= 0"),
        (["target_loss=-1"], "config field 'target_loss' must be a number >= 0"),
    ],
)  # fmt: skip
def test_bad_clock_settings_name_the_field(tmp_path, capsys, sets, message):
    args = [str(QUICKSTART), *BASE, *sets, "--out", str(tmp_path / "x")]
    assert main(args) == 2
    assert message in capsys.readouterr().err
