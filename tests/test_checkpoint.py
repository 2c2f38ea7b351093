"""Checkpoint / resume: for every quickstart algorithm, 4 steps + resume + 4 steps equal 8
uninterrupted steps bitwise (parameters, optimizer state, wire bytes, metrics); corrupt
checkpoints fall back or fail naming the file; incompatible resumes are refused; and one
MPI job resumed per rank equals the uninterrupted MPI job."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import harness
import jax
import numpy as np
import pytest
from flax import serialization
from harness import QUICKSTART, mpiexec

from shoal.experiments.checkpoint import Checkpointer
from shoal.experiments.cli import main
from shoal.experiments.config import Config
from shoal.experiments.train import train

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="the runner tests start their own MPI")

ALGORITHMS = ("ssgd", "gtc", "bmuf", "bmuf_gtc", "onebit_lamb", "bfb", "pgx", "peer", "sma",
              "adaptive", "diloco", "streaming_diloco", "topk", "powersgd", "demo")  # fmt: skip
STEPS, HALF = 8, 4
SETS = [f"steps={STEPS}", "eval_every=4", "block_size=4", "group_size=2", "policy_every=2",
        "policy_after=0", "noise_threshold=0", "project_workers=0", "diloco_sync_every=4",
        "diloco_exchange=fp4", "streaming_fragments=2", "streaming_overlap=1"]  # fmt: skip
WALL = ("time_s", "wall_s")


def run(out: Path, *extra: str, algorithms=ALGORITHMS, workers: int = 4) -> int:
    sets = [*SETS, "algorithms=" + ",".join(algorithms)]
    args = [str(QUICKSTART), "--workers", str(workers), "--no-progress", "--out", str(out)]
    return main([*args, *extra, "--set", *sets])


def records(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL} for r in rows]


def load(path: Path) -> dict:
    return serialization.msgpack_restore(path.read_bytes())


def assert_same_state(a: dict, b: dict) -> None:
    """Bitwise equal parameters, optimizer state and host byte totals."""
    for part in ("params", "opt_state"):
        assert a["treedefs"][part] == b["treedefs"][part]
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            np.testing.assert_array_equal(a[part][k], b[part][k], err_msg=f"{part} leaf {k}")
            assert a[part][k].dtype == b[part][k].dtype
    for part in ("sent_total", "received_total"):
        np.testing.assert_array_equal(a[part], b[part])
    assert a["step"] == b["step"] and a["finished"] and b["finished"]
    assert a["policy_changes"] == b["policy_changes"]
    strip = lambda s: {k: v for k, v in (json.loads(s) or {}).items() if k not in WALL}
    assert strip(a["summary"]) == strip(b["summary"])


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """8 uninterrupted steps of every algorithm, checkpointing every 4."""
    out = tmp_path_factory.mktemp("whole")
    assert run(out, "--set", "checkpoint_every=4") == 0
    return out


def test_resume_is_exact_for_every_algorithm(whole, tmp_path, capsys):
    out = tmp_path / "split"
    # Each invocation runs 4 steps: every algorithm stops at step 4 and resumes there. The
    # first starts afresh (--resume finds no checkpoint yet: an error).
    for i in range(2 * len(ALGORITHMS)):
        assert run(out, *(["--resume"] if i else []), "--stop-after", str(HALF)) == 0
        said = capsys.readouterr().out
        algo = ALGORITHMS[i // 2]
        if i % 2 == 0:
            assert f"stopped {algo} at step {HALF} of {STEPS}" in said
            assert not (out / "metrics.jsonl").exists()
    assert (out / "metrics.jsonl").exists()
    split = records(out / "metrics.jsonl")
    assert split == records(whole / "metrics.jsonl")
    assert len(split) == STEPS * len(ALGORITHMS)
    # The adaptive run switched to partial exchange before its checkpoint at step 4.
    assert any(r.get("policy") for r in split if r["algorithm"] == "adaptive" and r["step"] <= 4)
    for algo in ALGORITHMS:
        a = load(whole / "checkpoints" / algo / f"step_{STEPS}.0.msgpack")
        b = load(out / "checkpoints" / algo / f"step_{STEPS}.0.msgpack")
        assert_same_state(a, b)
        assert json.loads(b["records"])[-1]["mb_sent"] == json.loads(a["records"])[-1]["mb_sent"]
    # Resuming a finished run trains nothing and writes the same outputs again.
    assert run(out, "--resume") == 0
    assert records(out / "metrics.jsonl") == records(whole / "metrics.jsonl")


def _stopped_at_6(out: Path) -> Path:
    """ssgd stopped after 6 steps, checkpoints every 2: the files of steps 4 and 6 remain."""
    assert run(out, "--stop-after", "6", "--set", "checkpoint_every=2", algorithms=("ssgd",)) == 0
    folder = out / "checkpoints" / "ssgd"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["step_4.0.json", "step_4.0.msgpack", "step_6.0.json", "step_6.0.msgpack"]
    return folder


def test_truncated_checkpoint_falls_back_to_the_previous(whole, tmp_path, capsys):
    folder = _stopped_at_6(tmp_path)
    newest = folder / "step_6.0.msgpack"
    newest.write_bytes(newest.read_bytes()[:100])
    capsys.readouterr()
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 0
    err = capsys.readouterr().err
    assert f"corrupt checkpoint {newest}" in err
    assert "from the previous good checkpoint, step 4" in err
    want = [r for r in records(whole / "metrics.jsonl") if r["algorithm"] == "ssgd"]
    assert records(tmp_path / "metrics.jsonl") == want
    assert_same_state(
        load(folder / f"step_{STEPS}.0.msgpack"),
        load(whole / "checkpoints" / "ssgd" / f"step_{STEPS}.0.msgpack"),
    )


def test_all_checkpoints_corrupt_is_an_error_naming_them(tmp_path, capsys):
    folder = _stopped_at_6(tmp_path)
    newest, older = folder / "step_6.0.msgpack", folder / "step_4.0.msgpack"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: the checksum catches it
    newest.write_bytes(bytes(data))
    # Truncated with a matching sidecar: msgpack itself refuses it.
    cut = older.read_bytes()[:-7]
    older.write_bytes(cut)
    side = json.loads((folder / "step_4.0.json").read_text())
    side.update(sha256=hashlib.sha256(cut).hexdigest(), bytes=len(cut))
    (folder / "step_4.0.json").write_text(json.dumps(side))
    capsys.readouterr()
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal-run: error: no good checkpoint to resume from")
    assert f"corrupt checkpoint {newest}: " in err and "checksum" in err
    assert f"corrupt checkpoint {older}: msgpack" in err
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_with_another_grad_chunk(tmp_path, capsys):
    """grad_chunk only changes how many workers' gradients are computed at once: a run
    resumes under another one, also from a checkpoint whose config still lists it."""
    folder = _stopped_at_6(tmp_path)
    side = json.loads((folder / "step_6.0.json").read_text())
    side["config"]["grad_chunk"] = "None"  # as written before grad_chunk was ignored
    (folder / "step_6.0.json").write_text(json.dumps(side))
    capsys.readouterr()
    assert run(tmp_path, "--resume", "--set", "grad_chunk=2", algorithms=("ssgd",)) == 0
    assert records(tmp_path / "metrics.jsonl")[-1]["step"] == STEPS


def test_incompatible_resume_is_refused(tmp_path, capsys):
    _stopped_at_6(tmp_path)
    capsys.readouterr()
    assert run(tmp_path, "--resume", algorithms=("ssgd",), workers=2) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("shoal-run: error: cannot resume ssgd with 2 workers")
    assert "has 4" in err
    assert run(tmp_path, "--resume", "--set", "learning_rate=0.1", algorithms=("ssgd",)) == 2
    err = capsys.readouterr().err.strip()
    assert "config field 'learning_rate' is 0.1 now but 0.05" in err and "\n" not in err


def test_payload_without_sidecar_is_never_read(tmp_path):
    """A crash between writing the payload and its sidecar leaves an uncommitted step."""
    from shoal.experiments.backends import SimBackend
    from shoal.experiments.tasks import make_task

    cfg = Config(workers=2, steps=3, batch_size=8, eval_every=3, checkpoint_every=1)
    backend, task = SimBackend(2), make_task(cfg)
    ckpt = Checkpointer(tmp_path, "ssgd", cfg, backend)
    first = train(cfg, task, backend, "ssgd", progress=False, checkpoints=ckpt, max_steps=2)
    assert not first.finished and ckpt.steps() == [2, 1]
    (tmp_path / "ssgd" / "step_3.0.msgpack").write_bytes(b"half a checkpoint")
    assert ckpt.load()["step"] == 2
    rest = train(cfg, task, backend, "ssgd", progress=False, checkpoints=ckpt, resume=True)
    assert rest.finished and rest.trained == 1 and ckpt.steps() == [3, 2]
    whole = train(cfg, task, backend, "ssgd", progress=False)
    for a, b in zip(jax.tree.leaves(rest.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["loss"] for r in rest.records] == [r["loss"] for r in whole.records]
    assert not any(p.name.startswith(".") for p in (tmp_path / "ssgd").iterdir())


def test_mpi_resume_per_rank(tmp_path):
    """mpiexec -n 4: gtc finishes, bmuf_gtc stops at step 4, --resume skips gtc and
    continues bmuf_gtc; outputs and every rank's final checkpoint equal the uninterrupted
    MPI job's."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    algos = ("gtc", "bmuf_gtc")

    def job(out: Path, *extra: str) -> str:
        cmd = [str(exe), "-n", "4", sys.executable, "-m", "shoal.experiments.cli",
               str(QUICKSTART), "--backend", "mpi", "--no-progress", "--out", str(out), *extra,
               "--set", *SETS, "algorithms=" + ",".join(algos)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return proc.stdout

    job(tmp_path / "whole", "--set", "checkpoint_every=4")
    split = tmp_path / "split"
    said = job(split, "--stop-after", str(STEPS + HALF))
    assert f"stopped bmuf_gtc at step {HALF} of {STEPS}" in said
    job(split, "--resume")
    assert records(split / "metrics.jsonl") == records(tmp_path / "whole" / "metrics.jsonl")
    for algo in algos:
        for rank in range(4):
            name = f"checkpoints/{algo}/step_{STEPS}.{rank}.msgpack"
            assert_same_state(load(split / name), load(tmp_path / "whole" / name))


def test_other_algorithms_fields_do_not_block_resume(tmp_path, capsys):
    """Only the fields an algorithm depends on must match: gtc_threshold is gtc's own, so
    ssgd resumes under another one, and gtc does not."""
    argv = ["--stop-after", "6", "--set", "checkpoint_every=2", "gtc_threshold=0.1"]
    assert run(tmp_path, *argv, algorithms=("ssgd", "gtc")) == 0  # ssgd stopped at 6
    capsys.readouterr()
    other = ["--resume", "--stop-after", "4", "--set", "gtc_threshold=0.2"]
    assert run(tmp_path, *other, algorithms=("ssgd", "gtc")) == 0
    assert f"stopped gtc at step 2 of {STEPS}" in capsys.readouterr().out
    side = json.loads((tmp_path / "checkpoints" / "ssgd" / f"step_{STEPS}.0.json").read_text())
    assert "gtc_threshold" not in side["config"] and "learning_rate" in side["config"]
    side = json.loads((tmp_path / "checkpoints" / "gtc" / "step_2.0.json").read_text())
    assert side["config"]["gtc_threshold"] == "0.2"
    # gtc stopped at step 2 under gtc_threshold=0.2: 0.1 now is refused, naming the field.
    assert run(tmp_path, "--resume", "--set", "gtc_threshold=0.1",
               algorithms=("ssgd", "gtc")) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith("shoal-run: error: cannot resume gtc: config field 'gtc_threshold'")
    assert "is 0.1 now but 0.2" in err and "\n" not in err


def test_old_checkpoint_listing_every_field_resumes(tmp_path, capsys):
    """A checkpoint written when every field was recorded still resumes ssgd after a
    change to another algorithm's field."""
    folder = _stopped_at_6(tmp_path)
    side = json.loads((folder / "step_6.0.json").read_text())
    side["config"]["gtc_capacity"] = "0.5"
    (folder / "step_6.0.json").write_text(json.dumps(side))
    capsys.readouterr()
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 0
    assert records(tmp_path / "metrics.jsonl")[-1]["step"] == STEPS


def test_overwrite_drops_the_replaced_runs_checkpoints(tmp_path, capsys):
    """--overwrite replaces a run, checkpoints included: a later --resume cannot pick up
    the replaced run's state."""
    folder = _stopped_at_6(tmp_path)
    assert run(tmp_path, algorithms=("ssgd",)) == 2  # not empty: refused, nothing touched
    assert len(list(folder.iterdir())) == 4
    capsys.readouterr()
    assert run(tmp_path, "--overwrite", algorithms=("ssgd",)) == 0
    assert list(folder.iterdir()) == []
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 2
    assert f"no checkpoint of ssgd in {tmp_path / 'checkpoints'}" in capsys.readouterr().err
