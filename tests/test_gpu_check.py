"""benchmarks/gpu_check.py: its CPU rehearsal runs every stage at tiny sizes and each
stage's file holds the values it should; a stage past its budget is stopped and recorded,
and the run stops after an env stage that is not ok; bad arguments name themselves; the
BENCHMARKS.md block is rewritten in place."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu import report  # noqa: E402
from gpu.record import STAGES, stage_file  # noqa: E402


def gpu_check(*args, timeout=900):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    before = (ROOT / "BENCHMARKS.md").read_text()
    done = gpu_check("--rehearse", "--out", out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (ROOT / "BENCHMARKS.md").read_text() == before  # the rehearsal writes only --out
    return out, {s: json.loads(stage_file(out, s).read_text()) for s in STAGES}


def test_every_stage_ran_ok_within_its_budget(rehearsal):
    out, stages = rehearsal
    for name, data in stages.items():
        assert data["status"] == "ok", (name, data["notes"])
        assert data["rehearse"] is True and data["rows"]
        assert 0 < data["seconds"] <= data["budget_s"]
    # Eight files, the device tool's limit, none further down than one folder.
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [stage_file(out, s).name for s in STAGES] + ["log.txt", "report.md"]
    )


def test_env_names_the_machine_and_packages(rehearsal):
    rows = {r["item"]: r["value"] for r in rehearsal[1]["env"]["rows"]}
    assert rows["backend"] == "cpu"
    for package in ("jax ", "jaxlib ", "flax ", "optax ", "numpy "):
        assert package in rows["packages"]


def test_kernels_are_bit_exact_in_the_sweep_and_the_tests_pass(rehearsal):
    rows = rehearsal[1]["kernels"]["rows"]
    tests = [r for r in rows if r["check"].startswith("pytest ")]
    sweep = [r for r in rows if not r["check"].startswith("pytest ")]
    assert len(tests) == 3 and all(r["result"] == "ok" for r in tests)
    assert all(" passed, 0 failed" in r["detail"] for r in tests)
    checks = {r["check"].split(":")[0] for r in sweep}
    assert checks == {
        "sign_pack / sign_unpack",
        "gtc_pack / gtc_unpack",
        "gtc_pack_parts",
        "quantize / dequantize int8, block 128",
        "quantize / dequantize fp8, block 128",
        "quantize / dequantize fp4, block 128",
    }
    for r in sweep:
        assert r["result"] == "ok" and r["detail"].startswith("bit-exact: "), r


def test_kernel_speed_rows_hold_consistent_ratios(rehearsal):
    rows = rehearsal[1]["kernel_speed"]["rows"]
    kernels = {r["kernel"] for r in rows}
    assert {"sign_pack", "gtc_unpack (1%)", "quantize fp4", "dequantize int8"} <= kernels
    assert len(kernels) == 10
    for r in rows:
        n = r["n"]
        # of_copy = (bytes / kernel time) / (8 n / copy time), to the rounding kept.
        want = (r["bytes"] / r["pallas_ms"]) / (8 * n / r["copy_ms"])
        assert r["of_copy"] == pytest.approx(want, rel=0.1, abs=0.02)
        assert r["meets"] == ("yes" if r["of_copy"] >= 0.6 else "no")


def test_simulator_has_every_quickstart_algorithm(rehearsal):
    from shoal.experiments import algorithms
    from shoal.experiments.overrides import load_config

    cfg = load_config(ROOT / "experiments" / "configs" / "quickstart.py")
    rows = rehearsal[1]["simulator"]["rows"]
    labels = " ".join(r["row"] for r in rows)
    for entry in cfg.algorithms:
        assert algorithms.parse_entry(entry)[0] in labels
    assert rows[0]["row"] == "local SGD (baseline)" and rows[0]["ratio"] == 1.0
    assert all(r.get("error") is None and r["ratio"] > 0 for r in rows)


def test_lm_entries_train_and_count_their_bytes(rehearsal):
    rows = {r["entry"]: r for r in rehearsal[1]["lm"]["rows"]}
    assert list(rows) == ["ssgd_adamw", "diloco", "streaming_diloco"]
    for r in rows.values():
        assert r["steps"] == 20 and math.isfinite(r["loss"]) and r["loss"] < math.log(256)
        assert r["bpb"] == pytest.approx(r["loss"] / math.log(2), abs=1e-3)
    # S-SGD sends every step, DiLoCo every 10th, Streaming DiLoCo a quarter of that in fp4.
    assert rows["ssgd_adamw"]["mb_sent"] > 9 * rows["diloco"]["mb_sent"]
    assert rows["diloco"]["mb_sent"] > 4 * rows["streaming_diloco"]["mb_sent"]


def test_peer_compares_every_system_and_they_agree(rehearsal):
    """drjax came from its carried wheel (the rehearsal's .whl/) or the venv; every system
    ran in every cell, and each global model is shoal's to rounding (AdamW-amplified)."""
    rows = rehearsal[1]["peer"]["rows"]
    systems = ["shoal", "shoal, held once", "shoal, held once, scanned",
               "shoal, held once, in turn", "drjax", "JAX floor"]  # fmt: skip
    cells = sorted({r["cell"] for r in rows})
    assert len(cells) == 2 and [c.split()[0] for c in cells] == ["GPT-style", "MLP"]
    for cell in cells:
        mine = {r["system"]: r for r in rows if r["cell"] == cell}
        assert list(mine) == systems
        assert mine["shoal, held once, scanned"]["vs_held_scanned"] == 1.0
        # AdamW's m / sqrt(v) can turn an ulp of a near-zero gradient into up to its step,
        # 1e-3 (1.2e-4 seen on the tiny LM under the tests' XLA flags); a wrong round moves
        # the global model by the outer step, about 0.7 x 10 x 1e-3.
        for system in systems[1:5]:
            assert float(mine[system]["diff"]) < 1e-3, (cell, system)
        # Held once, the state per worker is drjax's, not the stacked one's.
        assert mine["shoal, held once"]["state_mb"] <= mine["shoal"]["state_mb"]


def test_report_has_a_section_per_stage(rehearsal):
    text = (rehearsal[0] / "report.md").read_text()
    for i in range(1, len(STAGES) + 1):
        assert f"**{i}. " in text
    assert "(CPU rehearsal): ok" in text and "GPU check (CPU rehearsal)" in text


def test_a_second_try_replaces_the_stages_it_reran(rehearsal, tmp_path):
    first, stages = rehearsal
    lm = dict(stages["lm"], started="2030-01-01 00:00 UTC", command="second try")
    lm["rows"] = [dict(lm["rows"][0], entry="from the second try")]
    stage_file(tmp_path, "lm").write_text(json.dumps(lm))
    text = report.render([first, tmp_path])
    assert "from the second try" in text and "| ssgd_adamw |" not in text
    assert "| sign_pack |" in text  # the stages not rerun stay the first run's
    assert "to 2030-01-01 00:00 UTC" in text and "then `second try`" in text


def test_a_stage_past_its_budget_is_stopped_and_the_run_ends_after_env(tmp_path):
    """The env stage, given 1 s, cannot import JAX in time: it is stopped and recorded
    as a timeout, the other stages are not started, and the exit status says so."""
    done = gpu_check("--rehearse", "--out", tmp_path, "--budget", "env=1", timeout=120)
    assert done.returncode == 1
    data = json.loads(stage_file(tmp_path, "env").read_text())
    assert data["status"] == "timeout" and "stopped after" in data["notes"][-1]
    assert not stage_file(tmp_path, "kernels").exists()
    assert "not started" in done.stdout and "**2. kernels**: not run" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rehearse"], "--out DIR is required"),
        (["--out", "x", "--stages", "env,gpu"], "--stages: unknown stage(s) gpu"),
        (["--out", "x", "--budget", "lm"], "--budget 'lm'"),
        (["--out", "x", "--budget", "lm=-3"], "--budget 'lm=-3'"),
        (["--out", "x", "--budget", "kernel=10"], "--budget 'kernel=10'"),
        (["--out", "x", "--cells", "125M:16,125M"], "--cells: '125M' is not SIZE:N"),
        (["--out", "x", "--cells", "big:8"], "--cells: 'big:8' is not SIZE:N"),
    ],
)
def test_bad_arguments_name_themselves(args, message):
    done = gpu_check(*args, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_the_benchmarks_block_is_rewritten_in_place(tmp_path):
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nintro\n")
    report.write_block(doc, "first")
    assert doc.read_text().endswith(f"## gpu\n\n{report.START}\n\nfirst\n{report.END}\n")
    doc.write_text(doc.read_text() + "\n## later\n\nkept\n")
    report.write_block(doc, "second")
    text = doc.read_text()
    assert "first" not in text and "second" in text and text.count("## gpu") == 1
    assert text.startswith("# Benchmarks\n\nintro\n") and text.endswith("## later\n\nkept\n")
