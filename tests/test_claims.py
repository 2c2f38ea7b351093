"""Reproductions (`shoal.experiments.runner.claims`): the verdict rule by hand, equal tokens
per arm and the errors that name a bad arm, a tiny reproduction through ``shoal-run``
(tuned on validation files, two seeds, the table and its files), and the bundled
``reproduce`` config's arms all resolve."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap

import harness
import numpy as np
import pytest

from shoal.experiments.config import Config, ConfigError
from shoal.experiments.reports.seeds import spread
from shoal.experiments.runner.arguments import load_argument
from shoal.experiments.runner.claims import VERDICTS, Arm, Claim, Reproduction, judge
from shoal.experiments.runner.cli import main

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="single-process tests")


@pytest.mark.parametrize(
    "method, reference, within, verdict",
    [
        ([1.0, 1.2], [2.0, 2.2], 0.0, "holds"),  # 1.1 ± 0.14 clearly below 2.1 ± 0.14
        ([2.0, 2.2], [1.0, 1.2], 0.0, "does not hold"),
        ([1.0, 1.4], [1.1, 1.3], 0.0, "inconclusive"),  # the intervals overlap
        ([1.02, 1.02], [1.0, 1.0], 0.03, "holds"),  # 2% above, claimed within 3%
        ([1.05, 1.05], [1.0, 1.0], 0.03, "does not hold"),
    ],
)
def test_the_verdict_by_hand(method, reference, within, verdict):
    assert judge(spread(method), spread(reference), within) == verdict


def test_a_diverged_method_never_holds():
    nan = float("nan")
    assert judge(spread([nan, 1.0, 1.0]), spread([2.0, 2.0]), 0.0) == "does not hold"
    assert judge(spread([1.0, 1.0]), spread([nan, 2.0]), 0.0) == "inconclusive"


def test_a_seed_that_ends_above_its_start_diverged_and_is_shown_apart():
    """1-bit Adam's seed 1 in reproduce ended at 1.2e9 (finite): by the interval alone it
    made the claim inconclusive; as a diverged seed it makes it not hold."""
    from shoal.experiments.runner.claims import _diverged, _loss, _row

    def run(seed, final, first=5.5):
        return {"summary": {"seed": seed, "test_loss": final}, "records": [{"loss": first}]}

    assert [_diverged(run(0, x)) for x in (2.0, 5.4, 5.6, 1.2e9, float("nan"))] == [
        False, False, True, True, True]  # fmt: skip
    one, other = Arm("1-bit", "a", 8), Arm("Adam", "b", 8)

    def summaries(losses):
        return [{**run(i, x)["summary"], "diverged": _diverged(run(i, x)), "mb_sent": 1.0,
                 "peak_kb_sent": 1.0} for i, x in enumerate(losses)]  # fmt: skip

    runs = {one.key: summaries([3.28, 1.2e9, 3.27]), other.key: summaries([2.3, 2.4, 2.3])}
    assert judge(spread([3.28, 1.2e9, 3.27]), spread([2.3, 2.4, 2.3]), 0.01) == "inconclusive"
    row = _row(Claim("c", "p", "s", one, other, within=0.01), runs)
    assert row["verdict"] == "does not hold" and row["diverged_method"] == {1: 1.2e9}
    assert row["loss_method"].n == 2 and abs(row["loss_method"].mean - 3.275) < 1e-12
    shown = _loss(row["loss_method"], row["diverged_method"], n=3)
    assert shown == "3.275 ± 0.007 (n = 2); diverged: seed 1 at 1.2e+09"
    flipped = _row(Claim("c", "p", "s", other, one, within=0.01), runs)
    assert flipped["verdict"] == "inconclusive"  # against a reference that diverged
    runs[one.key] = summaries([float("nan")] * 3)  # every seed diverged: no mean to show
    assert _loss(_row(Claim("c", "p", "s", one, other), runs)["loss_method"], {}) == "-"


def test_bytes_that_miss_the_claim_never_hold():
    assert judge(spread([1.0, 1.0]), spread([2.0, 2.0]), 0.0, bytes_ok=False) == "does not hold"


BASE = Config(name="tiny_repro", task="text", text_corpus="stdlib", workers=2, batch_size=2,
              seq_len=16, test_size=16, validation_size=16, lm_width=16, lm_layers=1,
              lm_heads=2, project_workers=0, algorithms=("ssgd_adamw",))  # fmt: skip
DP, LOCAL = Arm("DP", "ssgd_adamw", 2), Arm("DiLoCo H = 4", "diloco[sync_every=4]", 2)


def test_every_arm_trains_the_tokens_and_bad_arms_are_named():
    rep = Reproduction(BASE, [Claim("c", "p", "s", LOCAL, DP)], tokens=2 * 2 * 16 * 8,
                       seeds=(0,))  # fmt: skip
    assert [rep.arm_config(a).steps for a in rep.arms()] == [8, 8]
    assert rep.arm_config(Arm("one", "ssgd_adamw", 1)).steps == 16
    with pytest.raises(ConfigError, match="DP: tokens = 100 is not a multiple of"):
        Reproduction(BASE, [Claim("c", "p", "s", DP, DP)], tokens=100).arm_config(DP)
    bad = Arm("H = 3", "diloco[sync_every=3]", 2)
    with pytest.raises(ConfigError, match="multiple of sync_every = 3"):
        rep.arm_config(bad)
    with pytest.raises(ConfigError, match="seeds must be distinct"):
        Reproduction(BASE, [Claim("c", "p", "s", DP, DP)], tokens=64, seeds=(1, 1))


def test_a_tiny_reproduction_through_shoal_run(tmp_path, capsys):
    config = tmp_path / "tiny.py"
    config.write_text(
        textwrap.dedent("""
        from shoal.experiments.config import Config
        from shoal.experiments.runner.claims import Arm, Claim, Reproduction

        def get_config():
            base = Config(name="tiny", task="text", text_corpus="stdlib", workers=2,
                          batch_size=2, seq_len=16, test_size=16, validation_size=16,
                          lm_width=16, lm_layers=1, lm_heads=2, project_workers=0,
                          algorithms=("ssgd_adamw",))
            dp, local = Arm("DP", "ssgd_adamw", 2), Arm("DiLoCo", "diloco[sync_every=4]", 2)
            return Reproduction(base, [
                Claim("DiLoCo", "arXiv 2311.08105", "Close to DP.", local, dp, within=0.03,
                      fewer_bytes=3.5),
                Claim("Lower", "none", "Lower than DP.", local, dp),
            ], tokens=2 * 2 * 16 * 8, seeds=(0, 1), sweep=("x1", "x2"))
    """)
    )
    out = tmp_path / "out"
    assert main([str(config), "--out", str(out), "--no-progress"]) == 0
    text = (out / "reproduce.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| DiLoCo") or
            line.startswith("| Lower")]  # fmt: skip
    assert len(rows) == 2
    assert all(any(f"**{v}**" in r for v in VERDICTS) for r in rows)
    assert "test loss, method (n = 2)" in text and "claimed >= 3.5x" in rows[0]
    assert re.search(r"^\| DiLoCo \| arXiv 2311.08105 \| DiLoCo \| \d\.\d{3} ± \d\.\d{3} \| DP \|",
                     rows[0])  # fmt: skip
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["arm"], r["seed"]) for r in results) == [
        ("DP", 0),
        ("DP", 1),
        ("DiLoCo", 0),
        ("DiLoCo", 1),
    ]
    assert all(r["tokens_m"] == 2 * 2 * 16 * 8 / 1e6 for r in results)
    # DP all-reduces the gradient every step, DiLoCo the model every 4th: 4x the bytes,
    # less the non-finite flag's 4 bytes a step they both send.
    dp = next(r for r in results if r["arm"] == "DP")["mb_sent"]
    local = next(r for r in results if r["arm"] == "DiLoCo")["mb_sent"]
    assert 3.5 < dp / local < 4
    assert "## Tuning" in text and "validation loss x1:" in text
    # --resume through shoal-run reads every saved run back: nothing trains, same table.
    capsys.readouterr()
    assert main([str(config), "--out", str(out), "--resume", "--no-progress"]) == 0
    printed = re.findall(r"^.*, seed \d+(?: \(saved\))?: test loss .*$", capsys.readouterr().out,
                         re.M)  # fmt: skip
    assert len(printed) == 4 and all("(saved): test loss" in line for line in printed)
    again = (out / "reproduce.md").read_text()
    assert "4 of the 4 runs read back from `arms/`" in again
    assert again.split("## Tuning")[1] == text.split("## Tuning")[1]  # the same tuning
    assert [r for r in again.splitlines() if r.startswith("| DiLoCo")] == rows[:1]
    assert main([str(config), "--out", str(tmp_path / "o2"), "--workers", "4"]) == 2
    assert "drop --workers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name", ["reproduce", "reproduce_causes", "reproduce_rounds", "reproduce_knobs"]
)
def test_the_bundled_reproductions_resolve_every_arm(name):
    rep = load_argument(name)
    assert isinstance(rep, Reproduction) and len(rep.seeds) >= 3
    tokens = {rep.arm_config(a).steps * a.workers * rep.config.batch_size * rep.config.seq_len
              for a in rep.arms()}  # fmt: skip
    assert tokens == {rep.tokens}  # equal tokens for every arm
    if name == "reproduce":
        papers = {c.paper for c in rep.claims}
        assert len(papers) >= 8 and len(rep.claims) >= 14
        assert {a.tuned_as for a in rep.arms()} >= {"DiLoCo, M = 8, H = 50"}
    elif name == "reproduce_causes":  # the inner batch 4x reproduce's, the steps the same
        base = load_argument("reproduce")
        assert rep.config.batch_size == 4 * base.config.batch_size
        assert [rep.arm_config(a).steps for a in rep.arms()] == [400, 400]
    elif name == "reproduce_knobs":  # one knob per arm, against reproduce's tuned arms
        algorithms = {a.algorithm for a in rep.arms()}
        assert "onebit_adam[learning_rate=0.006;freeze_step=399]" in algorithms
        assert any("outer.momentum=0.0" in a for a in algorithms)
        assert any("topk.fraction=0.03" in a for a in algorithms)
    else:  # the batch the same, 4x the steps
        base = load_argument("reproduce")
        assert rep.config.batch_size == base.config.batch_size
        assert [rep.arm_config(a).steps for a in rep.arms()] == [1600, 1600]


def test_a_claim_row_from_summaries():
    """Bytes: the reference's over the method's (run or peak step); none where neither
    sends (one worker), and a claimed ratio that is missed never holds."""
    from shoal.experiments.runner.claims import _row

    one, other = Arm("A", "a", 1), Arm("B", "b", 1)
    none = {"mb_sent": 0.0, "peak_kb_sent": 0.0}
    runs = {one.key: [{"seed": 0, "test_loss": 1.0, **none}] * 2,
            other.key: [{"seed": 0, "test_loss": 2.0, **none}] * 2}  # fmt: skip
    row = _row(Claim("c", "p", "s", one, other), runs)
    assert row["bytes_ratio"] is None and row["verdict"] == "holds"
    assert _row(Claim("c", "p", "s", one, other, fewer_bytes=2), runs)["verdict"] == (
        "does not hold"
    )
    runs[one.key] = [{"seed": 0, "test_loss": 1.0, "mb_sent": 1.0, "peak_kb_sent": 5.0}] * 2
    runs[other.key] = [{"seed": 0, "test_loss": 2.0, "mb_sent": 8.0, "peak_kb_sent": 10.0}] * 2
    assert _row(Claim("c", "p", "s", one, other, fewer_bytes=8), runs)["bytes_ratio"] == 8
    peak = _row(Claim("c", "p", "s", one, other, fewer_bytes=3, peak=True), runs)
    assert peak["bytes_ratio"] == 2 and peak["verdict"] == "does not hold"


def test_grids_after_the_rate_shared_tunings_and_a_resumed_reproduction(tmp_path, monkeypatch):
    """``tune_also`` tunes DiLoCo's outer momentum after its rate (S-SGD has none, so
    it is skipped there); an arm ``tuned_as`` another trains with that one's values; a
    resumed reproduction reads every saved run and trains only what the config adds."""
    from shoal.experiments.runner import claims
    from shoal.experiments.runner import train as train_module

    h8 = Arm("DiLoCo H = 8", "diloco[sync_every=8]", 2, tuned_as=LOCAL.label)
    rep = Reproduction(BASE, [Claim("c", "p", "s", LOCAL, DP), Claim("d", "p", "s", h8, DP)],
                       tokens=2 * 2 * 16 * 8, seeds=(0,), sweep=("x1", "x2"),
                       tune_also=[("outer.momentum", ("0.5", "0.9"))])  # fmt: skip
    trained = []
    real_train = claims.train
    counted = lambda cfg, *a, **k: trained.append((cfg.algorithms[0], cfg.seed)) or real_train(
        cfg, *a, **k)  # fmt: skip
    monkeypatch.setattr(claims, "train", counted)
    monkeypatch.setattr(train_module, "train", counted)  # the sweep's
    out = tmp_path / "out"
    rows = claims.run_reproduction(rep, out, command="test", progress=False)
    text = (out / "reproduce.md").read_text()
    assert "then outer.momentum over 0.5, 0.9" in text
    assert "the grid's edge)" in text  # a grid of two: whichever is chosen is at its edge
    assert "diloco[sync_every=4] on 2 worker(s): outer.momentum = " in text
    assert "- DiLoCo H = 8: as DiLoCo H = 4" in text
    # 2 rates x 2 tuned arms, 2 momenta for DiLoCo, then one seed each of 3 arms.
    assert len(trained) == 2 * 2 + 2 + 3
    local = [a for a, _ in trained if a.startswith("diloco[sync_every=4")][-1]  # its run
    assert "outer.momentum=" in local and "inner.adamw.learning_rate=" in local
    h8_runs = [a for a, _ in trained if a.startswith("diloco[sync_every=8")]
    assert h8_runs == [local.replace("sync_every=4", "sync_every=8")]  # H = 4's values
    assert len(list((out / "arms").glob("*/*.json"))) == 2 + 3  # 2 tunings, 3 runs

    trained.clear()
    again = claims.run_reproduction(rep, out, command="test", progress=False, resume=True)
    assert trained == [] and [r["verdict"] for r in again] == [r["verdict"] for r in rows]
    more = Reproduction(**{**rep.__dict__, "seeds": (0, 1)})
    claims.run_reproduction(more, out, command="test", progress=False, resume=True)
    assert sorted(s for _, s in trained) == [1, 1, 1]  # seed 0 read, seed 1 trained
    # Changing DiLoCo's parameters redoes DiLoCo's tuning and runs, not data parallel's.
    trained.clear()
    params = {**BASE.params, "diloco": {"outer": {"learning_rate": 0.5}}}
    changed = Reproduction(**{**more.__dict__, "config": dataclasses.replace(BASE, params=params)})
    claims.run_reproduction(changed, out, command="test", progress=False, resume=True)
    assert trained and all(a.startswith("diloco") for a, _ in trained)
    trained.clear()
    claims.run_reproduction(more, out, command="test", progress=False)  # not resumed
    assert len(trained) == 2 * 2 + 2 + 6


def test_bad_tuning_grids_and_shared_tunings_are_named():
    with pytest.raises(ConfigError, match="tune_also grid 'learning_rate'"):
        Reproduction(BASE, [Claim("c", "p", "s", LOCAL, DP)], tokens=64,
                     tune_also=[("learning_rate", ("x1",))])  # fmt: skip
    with pytest.raises(ConfigError, match="tune_also grid 'outer.momentum'"):
        Reproduction(BASE, [Claim("c", "p", "s", LOCAL, DP)], tokens=64,
                     tune_also=[("outer.momentum", ("0.5", "0.5"))])  # fmt: skip
    lost = Arm("lost", "diloco[sync_every=8]", 2, tuned_as="nobody")
    with pytest.raises(ConfigError, match="no arm 'nobody'"):
        Reproduction(BASE, [Claim("c", "p", "s", lost, DP)], tokens=64)
    first = Arm("first", "diloco[sync_every=8]", 2, tuned_as=LOCAL.label)
    second = Arm("second", "diloco[sync_every=2]", 2, tuned_as="first")
    with pytest.raises(ConfigError, match="second: tuned_as 'first', which is itself"):
        Reproduction(BASE, [Claim("c", "p", "s", LOCAL, first),
                            Claim("d", "p", "s", second, DP)], tokens=64)  # fmt: skip


def test_diloco_with_one_replica_and_plain_outer_steps_is_adamw():
    """The outer step checked on its own: with M = 1 and ``outer = sgd(1.0)`` DiLoCo's
    global model is its one worker's, so it trains as AdamW data parallel does, record
    for record; the paper's Nesterov step (0.7, 0.9) is what makes it differ."""
    from shoal.experiments import algorithms
    from shoal.experiments.runner.backends import SimBackend
    from shoal.experiments.runner.train import train
    from shoal.experiments.tasks import make_task

    cfg = Config(**{**BASE.__dict__, "workers": 1, "steps": 12, "eval_every": 4})
    losses = {}
    for alg in ("ssgd_adamw", "diloco[sync_every=4;outer.learning_rate=1.0;outer.momentum=0]",
                "diloco[sync_every=4]"):  # fmt: skip
        result = train(cfg, make_task(cfg), SimBackend(1), algorithms.resolve(alg, cfg),
                       progress=False)  # fmt: skip
        losses[alg] = [r["test_loss"] for r in result.records if r.get("test_loss") is not None]
    dp, plain, nesterov = losses.values()
    assert len(dp) == 3
    np.testing.assert_allclose(plain, dp, rtol=1e-5)
    assert abs(nesterov[-1] - dp[-1]) > 1e-3
