"""Reproductions (`shoal.experiments.runner.claims`): the verdict rule by hand, equal tokens
per arm and the errors that name a bad arm, a tiny reproduction through ``shoal-run``
(tuned on validation files, two seeds, the table and its files), and the bundled
``reproduce`` config's arms all resolve."""

from __future__ import annotations

import json
import textwrap

import harness
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
    assert "(n = 2)" in rows[0] and "claimed >= 3.5x" in rows[0]
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
    assert main([str(config), "--out", str(tmp_path / "o2"), "--workers", "4"]) == 2
    assert "drop --workers" in capsys.readouterr().err


def test_the_bundled_reproduction_resolves_every_arm():
    rep = load_argument("reproduce")
    assert isinstance(rep, Reproduction) and len(rep.seeds) >= 3
    tokens = {rep.arm_config(a).steps * a.workers * rep.config.batch_size * rep.config.seq_len
              for a in rep.arms()}  # fmt: skip
    assert tokens == {rep.tokens}  # equal tokens for every arm
    papers = {c.paper for c in rep.claims}
    assert len(papers) >= 8 and len(rep.claims) >= 14


def test_a_claim_row_from_summaries():
    """Bytes: the reference's over the method's (run or peak step); none where neither
    sends (one worker), and a claimed ratio that is missed never holds."""
    from shoal.experiments.runner.claims import _row

    one, other = Arm("A", "a", 1), Arm("B", "b", 1)
    runs = {one.key: [{"test_loss": 1.0, "mb_sent": 0.0, "peak_kb_sent": 0.0}] * 2,
            other.key: [{"test_loss": 2.0, "mb_sent": 0.0, "peak_kb_sent": 0.0}] * 2}  # fmt: skip
    row = _row(Claim("c", "p", "s", one, other), runs)
    assert row["bytes_ratio"] is None and row["verdict"] == "holds"
    assert _row(Claim("c", "p", "s", one, other, fewer_bytes=2), runs)["verdict"] == (
        "does not hold"
    )
    runs[one.key] = [{"test_loss": 1.0, "mb_sent": 1.0, "peak_kb_sent": 5.0}] * 2
    runs[other.key] = [{"test_loss": 2.0, "mb_sent": 8.0, "peak_kb_sent": 10.0}] * 2
    assert _row(Claim("c", "p", "s", one, other, fewer_bytes=8), runs)["bytes_ratio"] == 8
    peak = _row(Claim("c", "p", "s", one, other, fewer_bytes=3, peak=True), runs)
    assert peak["bytes_ratio"] == 2 and peak["verdict"] == "does not hold"
