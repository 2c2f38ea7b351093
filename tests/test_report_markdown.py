"""``summary.md`` and ``report.md`` over several seeds: mean ± std with n against NumPy, one
seed shown as before, the guide's wording when intervals overlap, only the fields the run
uses (the rest folded), and the task fields declared for the tasks that read them."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import json

import numpy as np
import pytest

from shoal.experiments import reports as report
from shoal.experiments.config import Config
from shoal.experiments.fields import TaskFields
from shoal.experiments.reports.markdown import write_summary
from shoal.experiments.tasks import make_task

SEEDS = (0, 1, 2)
# label -> (test accuracy per seed, MB sent per seed); every seed 20 steps.
RESULTS = {
    "ssgd": ((0.80, 0.82, 0.84), (2.0, 2.0, 2.0)),
    # 0.5 points above ssgd, but within one std of it: not distinguishable
    "gtc": ((0.79, 0.83, 0.855), (0.40, 0.42, 0.44)),
    # 1.5 points below, still within one std: not claimed worse
    "bmuf": ((0.76, 0.82, 0.835), (0.20, 0.20, 0.20)),
    # 10 points below, far outside: claimed worse
    "topk": ((0.71, 0.72, 0.73), (0.10, 0.10, 0.10)),
}


def summary(label: str, seed: int) -> dict:
    accs, mbs = RESULTS[label]
    i = SEEDS.index(seed)
    return {"algorithm": label, "seed": seed, "steps": 20, "loss": 1.0 + accs[i],
            "test_loss": 2.0 - accs[i], "test_accuracy": accs[i], "test_error": 1 - accs[i],
            "mb_sent": mbs[i], "mb_received": mbs[i], "peak_kb_sent": 1.0, "density": None,
            "skipped": None, "wall_s": 1.0 + i}  # fmt: skip


SUMMARIES = [summary(label, s) for label in RESULTS for s in SEEDS]


def row_of(table: str, label: str) -> list[str]:
    (line,) = [ln for ln in table.splitlines() if ln.startswith(f"| {label} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_table_shows_mean_and_std_against_numpy():
    table = report.summary_table(SUMMARIES)
    header = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert header[:3] == ["algorithm", "seeds", "steps"]
    for label, (accs, mbs) in RESULTS.items():
        cells = dict(zip(header, row_of(table, label), strict=True))
        acc = np.array(accs)
        assert cells["seeds"] == "3"
        assert cells["steps"] == "20"  # the same for every seed: the value alone
        assert cells["test acc"] == f"{acc.mean():.2%} ± {acc.std(ddof=1):.2%}"
        assert cells["test error"] == f"{1 - acc.mean():.2%} ± {acc.std(ddof=1):.2%}"
        assert cells["train loss"] == f"{1 + acc.mean():.4f} ± {acc.std(ddof=1):.4f}"
        mb = np.array(mbs)
        # Equal seeds show the value alone (np.std of equal values can be an ulp above 0).
        want = f"{mb.mean():.3f}" + (f" ± {mb.std(ddof=1):.3f}" if len(set(mbs)) > 1 else "")
        assert cells["MB sent/worker"] == want
        assert cells["wall s"] == "2.0 ± 1.0"
    # by hand: gtc's accuracy 0.79, 0.83, 0.855 -> mean 82.50%, std 3.28%
    assert dict(zip(header, row_of(table, "gtc"), strict=True))["test acc"] == "82.50% ± 3.28%"
    note = report.seeds_note(SUMMARIES)
    assert "Mean ± sample standard deviation (ddof = 1)" in note and "seeds 0, 1, 2" in note


def test_one_seed_looks_as_before():
    one = [s for s in SUMMARIES if s["seed"] == 1]
    table = report.summary_table(one)
    assert table.splitlines()[0].startswith("| algorithm | steps | train loss | test loss |")
    assert row_of(table, "gtc")[:5] == ["gtc", "20", "1.8300", "1.1700", "83.00%"]
    assert "±" not in table
    assert report.seeds_note(one) == "1 seed (1): single values, no spread."
    # summaries without a seed (a runner that does not record one)
    bare = [{k: v for k, v in s.items() if k != "seed"} for s in one]
    assert report.summary_table(bare) == table
    assert report.seeds_note(bare) == "1 seed: single values, no spread."


def test_guide_says_when_intervals_overlap():
    text = report.guide(SUMMARIES)
    assert text.startswith("Against `ssgd` in this run, means over 3 seeds")
    lines = {ln.split("`")[1]: ln for ln in text.splitlines() if ln.startswith("- ")}
    gtc = np.array(RESULTS["gtc"][0])
    base = np.array(RESULTS["ssgd"][0])
    assert lines["gtc"].startswith(
        f"- `gtc`: {100 * (gtc.mean() - base.mean()):+.1f} points of accuracy, within one std "
        f"of `ssgd` ({gtc.mean():.2%} ± {gtc.std(ddof=1):.2%} vs {base.mean():.2%} ± "
        f"{base.std(ddof=1):.2%}): not distinguishable over 3 seeds, 4.8x fewer bytes"
    )
    # more than a point below, but within one std: among the close ones, not called worse
    assert "-1.5 points of accuracy, within one std of `ssgd`" in lines["bmuf"]
    close, _, further = text.partition("Further than one point below `ssgd`, beyond one std:")
    assert "`bmuf`" in close and "`gtc`" in close
    assert "`topk`: -10.0 points of accuracy, 20.0x fewer bytes" in further
    assert "not distinguishable" not in further


def test_guide_with_one_seed_claims_no_overlap():
    one = [s for s in SUMMARIES if s["seed"] == 0]
    text = report.guide(one)
    assert text.startswith("Against `ssgd` in this run, 1 seed")
    assert "not distinguishable" not in text and "std" not in text
    # bmuf is 4 points below ssgd in seed 0, with nothing to say it is noise
    assert "Further than one point below `ssgd`:" in text
    assert "- `bmuf`: -4.0 points of accuracy" in text.split("Further")[1]


def config_table(text: str) -> tuple[set[str], set[str]]:
    """The keys of summary.md's config table, and those folded under <details>."""
    head, _, fold = text.partition("## Config")[2].partition("<details>")
    keys = lambda part: {ln.split("`")[1] for ln in part.splitlines() if ln.startswith("| `")}  # noqa: E731
    return keys(head), keys(fold)


@pytest.mark.parametrize("task", ["mixture", "lm"])
def test_summary_lists_only_the_fields_the_run_uses(tmp_path, task):
    cfg = Config(task=task, algorithms=("ssgd", "gtc[threshold=0.05]"), workers=2,
                 params={"diloco": {"sync_every": 5}})  # fmt: skip
    path = tmp_path / "summary.md"
    write_summary(path, cfg, SUMMARIES[:3], backend="sim", command="shoal-run x")
    text = path.read_text()
    shown, folded = config_table(text)
    assert "<details><summary>other fields" in text and text.rstrip().endswith("</details>")
    assert {"workers", "steps", "seed", "task", "train_size", "ssgd.local.momentum",
            "gtc.threshold"} <= shown  # fmt: skip
    # another algorithm's params (named in params, not run) and other tasks' fields
    assert {"diloco.sync_every", "hmm_self_loop", "hmm_successors", "cnn"} <= folded
    if task == "lm":
        assert {"lm_width", "seq_len"} <= shown and {"components", "num_classes"} <= folded
    else:
        assert {"components", "num_classes", "hidden"} <= shown
        assert {"lm_width", "lm_heads", "seq_len"} <= folded
    assert not shown & folded
    # every field exactly once
    everything = {f.name for f in dataclasses.fields(cfg) if f.name != "params"}
    everything |= {k for k in shown | folded if "." in k}
    assert shown | folded == everything


# Small bundled tasks (hmm's successors must be fewer than its states).
TASKS = {
    "mixture": {},
    "hmm": {"num_classes": 6, "hmm_successors": 3},
    "lm": {"seq_len": 16},
    "images": {},
}


@pytest.mark.parametrize("task", TASKS)
def test_task_fields_are_those_the_task_reads(task):
    """`TaskFields.fields_of` (declared with the fields) against the fields each bundled
    task reads when it is built, spied on `Config`."""
    cfg = Config(task=task, train_size=256, test_size=64, batch_size=8, workers=2, **TASKS[task])
    read = set()
    original = Config.__getattribute__

    def spy(self, name):
        read.add(name)
        return original(self, name)

    Config.__getattribute__ = spy
    try:
        make_task(cfg)
    finally:
        del Config.__getattribute__
    task_fields = {f.name for f in dataclasses.fields(TaskFields)}
    assert read & task_fields == set(TaskFields.fields_of(task))


def test_write_run_over_seeds(tmp_path):
    """write_run with three seeds' records and summaries: every record kept with its seed,
    the tables and the guide over the seeds."""
    cfg = Config(algorithms=tuple(RESULTS), workers=2, steps=4, eval_every=2)
    records = []
    for s in SUMMARIES:
        for step in range(1, 5):
            r = {"algorithm": s["algorithm"], "seed": s["seed"], "step": step,
                 "loss": 2.0 / step + 0.01 * s["seed"], "bytes_sent": 100, "bytes_received": 100,
                 "mb_sent": s["mb_sent"] * step / 4, "mb_received": s["mb_sent"] * step / 4,
                 "time_s": 0.1 * step}  # fmt: skip
            if step % 2 == 0:
                r.update(test_loss=s["test_loss"] + 1 / step, test_accuracy=s["test_accuracy"])
            records.append(r)
    paths = report.write_run(tmp_path, cfg, records, SUMMARIES, backend="sim", command="x")
    assert {p.name for p in paths} >= {"summary.md", "report.md", "metrics.csv", *report.PLOTS}
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {k: v for k, v in r.items() if k != "time_s"} for r in records
    ]
    assert (tmp_path / "metrics.csv").read_text().startswith("algorithm,seed,step,loss,")
    timing = [json.loads(x) for x in (tmp_path / "timing.jsonl").read_text().splitlines()]
    assert timing[0] == {"algorithm": "ssgd", "seed": 0, "step": 1, "time_s": 0.1}
    for name in ("summary.md", "report.md"):
        text = (tmp_path / name).read_text()
        assert report.summary_table(SUMMARIES) in text and report.seeds_note(SUMMARIES) in text
    assert "not distinguishable over 3 seeds" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize(
    "module",
    [
        "shoal.experiments.reports.seeds",
        "shoal.experiments.reports.panels",
        "shoal.experiments.reports.markdown",
        "shoal.experiments.fields",
    ],
)
def test_docstring_examples_run(module):
    result = doctest.testmod(
        importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert result.failed == 0 and result.attempted >= 1
