"""Checkpoint / resume on orbax.checkpoint: for every quickstart algorithm, 4 steps +
resume + 4 steps equal 8 uninterrupted steps bitwise (parameters, optimizer state, wire
bytes, metrics); the latest 2 steps are kept; corrupt checkpoints (flipped or truncated
orbax files, an edited JSON part, overwritten arrays) fall back or fail naming the file;
a half-written step is never read; incompatible resumes are refused naming the field; and
MPI ranks and ``jax.distributed`` processes each save and resume their own state."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from harness import QUICKSTART, UNDER_MPI, mpiexec

from shoal.experiments.config import Config
from shoal.experiments.runner import checkpoint, checkpoint_files
from shoal.experiments.runner.backends import SimBackend
from shoal.experiments.runner.checkpoint import Checkpointer, CheckpointError
from shoal.experiments.runner.cli import main
from shoal.experiments.runner.train import train
from shoal.experiments.tasks import make_task

# The runner tests start their own MPI jobs; the `mpi` test runs under mpiexec too.
solo = pytest.mark.skipif(UNDER_MPI, reason="the runner tests start their own MPI")

ALGORITHMS = ("ssgd", "gtc", "bmuf", "bmuf_gtc", "onebit_lamb", "bfb_allreduce",
              "partial_exchange", "peer_averaging", "sma", "adaptive", "diloco", "muloco",
              "streaming_diloco", "topk", "powersgd", "demo")  # fmt: skip
STEPS, HALF = 8, 4
SETS = [f"steps={STEPS}", "eval_every=4", "bmuf.block_size=4", "bmuf_gtc.block_size=4",
        "bmuf_gtc.group_size=2", "adaptive.every=2", "adaptive.after=0", "adaptive.threshold=0",
        "project_workers=0", "diloco.sync_every=4", "muloco.sync_every=4",
        "streaming_diloco.sync_every=4", "diloco.exchange.codec=fp4",
        "streaming_diloco.exchange.codec=fp4", "streaming_diloco.fragments=2",
        "streaming_diloco.overlap=1"]  # fmt: skip
WALL = ("time_s", "wall_s")


def run(out: Path, *extra: str, algorithms=ALGORITHMS, workers: int = 4) -> int:
    sets = [*SETS, "algorithms=" + ",".join(algorithms)]
    args = [str(QUICKSTART), "--workers", str(workers), "--no-progress", "--out", str(out)]
    return main([*args, *extra, "--set", *sets])


def records(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL} for r in rows]


def meta_of(step: Path) -> dict:
    """A checkpoint's JSON part: the run's identity and config, the non-array state."""
    return json.loads((step / "meta" / "meta.json").read_text())


def load(step: Path) -> dict:
    """A checkpoint's state as `checkpoint.pack` made it, read with plain orbax and json
    (zero-size leaves, kept in the JSON part, left out)."""
    return {**meta_of(step)["state"], **ocp.PyTreeCheckpointer().restore(step / "arrays")}


def edit_meta(step: Path, edit) -> None:
    """Apply ``edit`` to a checkpoint's JSON part and seal it again (a valid checkpoint)."""
    meta = meta_of(step)
    edit(meta)
    (step / "meta" / "meta.json").write_text(json.dumps(checkpoint_files.seal(meta)))


def data_file(step: Path) -> Path:
    """The largest file of a step's arrays: tensorstore's data."""
    files = [p for p in (step / "arrays").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


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


@solo
def test_resume_is_exact_for_every_algorithm(whole, tmp_path):
    # The uninterrupted run's folder without its outputs and its step-8 checkpoints: as if
    # every algorithm had been stopped right after its step-4 checkpoint. (Stopping with
    # --stop-after and continuing with the next algorithm: `test_multi_process_resume_per_process`
    # and `_stopped_at_6`.)
    out = tmp_path / "split"
    shutil.copytree(whole / "checkpoints", out / "checkpoints")
    for algo in ALGORITHMS:
        shutil.rmtree(out / "checkpoints" / algo / "rank_0" / f"step_{STEPS}")
    assert run(out, "--resume") == 0
    split = records(out / "metrics.jsonl")
    assert split == records(whole / "metrics.jsonl")
    assert len(split) == STEPS * len(ALGORITHMS)
    # The adaptive run switched to partial exchange before its checkpoint at step 4.
    assert any(r.get("policy") for r in split if r["algorithm"] == "adaptive" and r["step"] <= 4)
    for algo in ALGORITHMS:
        a = load(whole / "checkpoints" / algo / "rank_0" / f"step_{STEPS}")
        b = load(out / "checkpoints" / algo / "rank_0" / f"step_{STEPS}")
        assert_same_state(a, b)
        assert json.loads(b["records"])[-1]["mb_sent"] == json.loads(a["records"])[-1]["mb_sent"]
    # Resuming a finished run trains nothing and writes the same outputs again.
    (out / "metrics.jsonl").unlink()
    assert run(out, "--resume") == 0
    assert records(out / "metrics.jsonl") == records(whole / "metrics.jsonl")


def _stopped_at_6(out: Path) -> Path:
    """ssgd stopped after 6 steps, checkpoints every 2: steps 4 and 6 are kept (KEEP)."""
    assert run(out, "--stop-after", "6", "--set", "checkpoint_every=2", algorithms=("ssgd",)) == 0
    folder = out / "checkpoints" / "ssgd" / "rank_0"
    assert sorted(p.name for p in folder.iterdir()) == ["step_4", "step_6"]
    return folder


@solo
def test_corrupt_checkpoint_falls_back_to_the_previous(whole, tmp_path, capsys):
    folder = _stopped_at_6(tmp_path)
    flip(data_file(folder / "step_6"))
    capsys.readouterr()
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 0
    err = capsys.readouterr().err
    assert f"corrupt checkpoint {folder / 'step_6' / 'arrays'}: " in err
    assert "from the previous good checkpoint, step 4" in err
    want = [r for r in records(whole / "metrics.jsonl") if r["algorithm"] == "ssgd"]
    assert records(tmp_path / "metrics.jsonl") == want
    assert_same_state(
        load(folder / f"step_{STEPS}"),
        load(whole / "checkpoints" / "ssgd" / "rank_0" / f"step_{STEPS}"),
    )


@solo
def test_all_checkpoints_corrupt_is_an_error_naming_them(tmp_path, capsys):
    folder = _stopped_at_6(tmp_path)
    data = data_file(folder / "step_6")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # orbax cannot read it
    # An edited record, not sealed again: the JSON part's checksum catches it.
    meta = folder / "step_4" / "meta" / "meta.json"
    meta.write_text(meta.read_text().replace('"step\\": 1,', '"step\\": 7,', 1))
    measured = (tmp_path / "metrics.jsonl").read_text()  # the stopped run's 6 steps
    capsys.readouterr()
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal-run: error: no good checkpoint to resume from")
    assert f"corrupt checkpoint {folder / 'step_6' / 'arrays'}: orbax: " in err
    assert f"corrupt checkpoint {meta}: its checksum does not match" in err
    assert err.count("\n") == 1, err
    assert (tmp_path / "metrics.jsonl").read_text() == measured  # the refusal wrote nothing


def small_tree(step: int) -> tuple[dict, tuple]:
    """Params and optimizer state of 2 workers: a PRNG key, bfloat16, a zero-size leaf."""
    params = {"b": np.zeros((2, 0), np.float32), "w": np.arange(12.0, dtype=np.float32) + step}
    counts = {"count": np.full(2, step, np.int32), "m": jnp.full((2, 3), 0.1, jnp.bfloat16)}
    return params, (jax.random.split(jax.random.key(step), 2), counts)


def small_state(step: int) -> dict:
    """`pack` of `small_tree`, int64 wire totals beyond 2**32 and a NaN in the records."""
    params, opt_state = small_tree(step)
    return checkpoint.pack(
        step=step, params=params, opt_state=opt_state, sent_total=np.array([2**40 + step, 1]),
        received_total=np.array([3, 2**41]), records=[{"loss": 0.1 + 0.2, "x": float("nan")}],
        policy_changes=[(1, {"alpha": 0.5})], elapsed=1 / 3, seed=7, finished=False,
    )  # fmt: skip


def test_saved_state_round_trips_exactly_and_damage_is_named(tmp_path):
    cfg = Config(workers=2)
    ckpt = Checkpointer(tmp_path / "good", "ssgd", cfg, SimBackend(2))
    assert ckpt.steps() == [] and not (tmp_path / "good").exists()  # looking creates nothing
    for step in (1, 2, 3):
        assert ckpt.save(step, small_state(step)) == ckpt.folder / "rank_0" / f"step_{step}"
    assert ckpt.steps() == [3, 2]  # KEEP = 2
    saved, want = ckpt.load(), small_state(3)
    assert saved.keys() == want.keys()
    for part in ("params", "opt_state", "sent_total", "received_total"):
        leaves = want[part] if part in ("params", "opt_state") else {"": want[part]}
        got = saved[part] if part in ("params", "opt_state") else {"": saved[part]}
        assert got.keys() == leaves.keys()
        for k, a in leaves.items():
            assert got[k].dtype == a.dtype and got[k].shape == a.shape, (part, k)
            np.testing.assert_array_equal(got[k], a)
    for k in ("records", "policy_changes", "summary", "treedefs", "data", "elapsed", "step"):
        assert saved[k] == want[k], k
    back = checkpoint.unpack(saved, *small_tree(0))
    key = jax.random.key_data(back["opt_state"][0])
    np.testing.assert_array_equal(key, jax.random.key_data(small_tree(3)[1][0]))
    assert back["policy_changes"] == [(1, {"alpha": 0.5})] and back["elapsed"] == 1 / 3

    def overwrite(step: Path) -> None:  # other values written by orbax itself
        arrays = ocp.PyTreeCheckpointer().restore(step / "arrays")
        arrays["params"]["1"] = arrays["params"]["1"] + 1
        ocp.PyTreeCheckpointer().save(step / "arrays", arrays, force=True)

    damage = {
        "flipped data": (lambda s: flip(data_file(s)), "arrays: "),
        "truncated data": (lambda s: data_file(s).write_bytes(b"x"), "arrays: orbax: "),
        "flipped tree metadata": (lambda s: flip(s / "arrays" / "_METADATA"), "arrays: orbax: "),
        "overwritten arrays": (overwrite, "arrays: params/1 do not match their checksums"),
        "edited JSON": (
            lambda s: edit_meta(s, lambda m: None) or flip(s / "meta" / "meta.json"),
            "meta/meta.json: ",
        ),
        "JSON of another step": (
            lambda s: edit_meta(s, lambda m: m.update(step=2)),
            "meta/meta.json: it says step 2",
        ),
    }
    for i, (what, (harm, said)) in enumerate(damage.items()):
        root = tmp_path / f"bad{i}"
        shutil.copytree(tmp_path / "good", root)
        bad = Checkpointer(root, "ssgd", cfg, SimBackend(2))
        harm(root / "ssgd" / "rank_0" / "step_3")
        with pytest.raises(CheckpointError) as e:
            checkpoint_files.read(bad.path(3))
        assert f"checkpoint {root / 'ssgd' / 'rank_0' / 'step_3'}/{said}" in str(e.value), what
        assert bad.load()["step"] == 2, what  # the previous one is used


@solo
def test_resume_with_another_grad_chunk(tmp_path, capsys):
    """grad_chunk only changes how many workers' gradients are computed at once: a run
    resumes under another one, also from a checkpoint whose config still lists it."""
    folder = _stopped_at_6(tmp_path)
    # As written before grad_chunk was ignored.
    edit_meta(folder / "step_6", lambda m: m["config"].update(grad_chunk="None"))
    capsys.readouterr()
    assert run(tmp_path, "--resume", "--set", "grad_chunk=2", algorithms=("ssgd",)) == 0
    assert records(tmp_path / "metrics.jsonl")[-1]["step"] == STEPS


@solo
def test_incompatible_resume_is_refused(tmp_path, capsys):
    # (Another worker count resumes elastically: tests/test_elastic.py.)
    _stopped_at_6(tmp_path)
    capsys.readouterr()
    argv = ["--resume", "--set", "ssgd.local.learning_rate=0.1"]
    assert run(tmp_path, *argv, algorithms=("ssgd",)) == 2
    err = capsys.readouterr().err.strip()
    assert "config field 'ssgd.local.learning_rate' is 0.1 now but 0.05" in err
    assert "\n" not in err


@solo
def test_half_written_step_is_never_read(tmp_path):
    """A crash while orbax writes step 3 leaves its temporary folder: never a step, and
    removed by the next process's checkpointer."""
    cfg = Config(workers=2, steps=3, batch_size=8, eval_every=3, checkpoint_every=1)
    backend, task = SimBackend(2), make_task(cfg)
    ckpt = Checkpointer(tmp_path, "ssgd", cfg, backend)
    first = train(cfg, task, backend, "ssgd", progress=False, checkpoints=ckpt, max_steps=2)
    assert not first.finished and ckpt.steps() == [2, 1]
    folder = tmp_path / "ssgd" / "rank_0"
    half = folder / "step_3.orbax-checkpoint-tmp"
    shutil.copytree(folder / "step_2", half)
    data_file(half).write_bytes(b"half a checkpoint")
    ckpt = Checkpointer(tmp_path, "ssgd", cfg, backend)  # after the crash: a new process
    assert ckpt.steps() == [2, 1] and ckpt.load()["step"] == 2
    rest = train(cfg, task, backend, "ssgd", progress=False, checkpoints=ckpt, resume=True)
    assert rest.finished and rest.trained == 1 and ckpt.steps() == [3, 2]
    whole = train(cfg, task, backend, "ssgd", progress=False)
    for a, b in zip(jax.tree.leaves(rest.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["loss"] for r in rest.records] == [r["loss"] for r in whole.records]
    assert sorted(p.name for p in folder.iterdir()) == ["step_2", "step_3"]


def _job(out: Path, backend: str, n: int, algos: tuple[str, ...], *extra: str) -> str:
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec not found")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [str(exe), "-n", str(n), sys.executable, "-m", "shoal.experiments.runner.cli",
           str(QUICKSTART), "--backend", backend, "--no-progress", "--out", str(out), *extra,
           "--set", *SETS, "algorithms=" + ",".join(algos)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "orbax" not in proc.stderr, proc.stderr[-4000:]  # no orbax logging reaches users
    return proc.stdout


@solo
@pytest.mark.parametrize("backend, n, algos", [("mpi", 4, ("gtc", "bmuf_gtc")),
                                               ("jax", 2, ("gtc",))])  # fmt: skip
def test_multi_process_resume_per_process(tmp_path, backend, n, algos):
    """mpiexec: every MPI rank, or every jax.distributed process (orbax's default writes
    host arrays on process 0 only), saves and resumes its own workers' state. The
    uninterrupted job's checkpoints without the last algorithm's final one: the first
    algorithm finished, the last stopped at step 4; --resume skips the finished one and
    continues; outputs and every process's final checkpoint equal the uninterrupted job's."""
    _job(tmp_path / "whole", backend, n, algos, "--set", "checkpoint_every=4")
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "whole" / "checkpoints", split / "checkpoints")
    for rank in range(n):
        shutil.rmtree(split / f"checkpoints/{algos[-1]}/rank_{rank}/step_{STEPS}")
    _job(split, backend, n, algos, "--resume")
    assert records(split / "metrics.jsonl") == records(tmp_path / "whole" / "metrics.jsonl")
    for algo in algos:
        states = []
        for rank in range(n):
            name = f"checkpoints/{algo}/rank_{rank}/step_{STEPS}"
            states.append(load(split / name))
            assert_same_state(states[-1], load(tmp_path / "whole" / name))
        # Each holds its own worker: one row, and the workers' residuals differ.
        assert all(a.shape[0] == 1 for s in states for a in s["params"].values())
        first, second = (s["opt_state"].values() for s in states[:2])
        assert any(not np.array_equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.mpi
def test_every_process_resumes_from_the_newest_step_all_hold(tmp_path, capsys):
    """Simulated in one process, or one worker per rank under mpiexec -n 4: the last
    process's newest checkpoint is corrupt, so every process resumes from the previous
    one, and the run ends as an uninterrupted one."""
    from shoal.experiments.runner.backends import MPIBackend

    backend = MPIBackend() if UNDER_MPI else SimBackend(4)
    root = Path(backend.share(str(tmp_path)))  # one folder for every rank
    cfg = Config(workers=4, steps=6, batch_size=8, eval_every=6, checkpoint_every=2,
                 algorithms=("gtc",))  # fmt: skip
    task = make_task(cfg)
    ckpt = Checkpointer(root, "gtc", cfg, backend)
    first = train(cfg, task, backend, "gtc", progress=False, checkpoints=ckpt, max_steps=4)
    assert not first.finished and ckpt.steps() == [4, 2]
    rank, victim = getattr(backend, "rank", 0), 3 if UNDER_MPI else 0
    newest = root / "gtc" / f"rank_{victim}" / "step_4"
    if rank == victim:
        flip(data_file(newest))
    backend.gather_all(None)  # the damage is done before anyone loads
    capsys.readouterr()
    ckpt = Checkpointer(root, "gtc", cfg, backend)
    rest = train(cfg, task, backend, "gtc", progress=False, checkpoints=ckpt, resume=True)
    assert rest.finished and rest.trained == 4  # from step 2, on every process
    err = capsys.readouterr().err
    if rank == 0:
        assert f"corrupt checkpoint {newest / 'arrays'}: " in err
        assert "from the previous good checkpoint, step 2" in err
    whole = train(cfg, task, backend, "gtc", progress=False)
    for a, b in zip(jax.tree.leaves(rest.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@solo
def test_other_algorithms_fields_do_not_block_resume(tmp_path, capsys):
    """Only the fields an algorithm depends on must match: gtc.threshold is gtc's own, so
    ssgd resumes under another one, and gtc does not."""
    argv = ["--stop-after", "6", "--set", "checkpoint_every=2", "gtc.threshold=0.1"]
    assert run(tmp_path, *argv, algorithms=("ssgd", "gtc")) == 0  # ssgd stopped at 6
    capsys.readouterr()
    other = ["--resume", "--stop-after", "4", "--set", "gtc.threshold=0.2"]
    assert run(tmp_path, *other, algorithms=("ssgd", "gtc")) == 0
    assert f"stopped gtc at step 2 of {STEPS}" in capsys.readouterr().out
    folder = tmp_path / "checkpoints"
    config = lambda algo, step: meta_of(folder / algo / "rank_0" / f"step_{step}")["config"]
    ssgd_config = config("ssgd", STEPS)
    assert not any(k.startswith("gtc.") for k in ssgd_config)
    assert "ssgd.local.learning_rate" in ssgd_config
    assert config("gtc", 2)["gtc.threshold"] == "0.2"
    # gtc stopped at step 2 under gtc.threshold=0.2: 0.1 now is refused, naming the field.
    assert run(tmp_path, "--resume", "--set", "gtc.threshold=0.1",
               algorithms=("ssgd", "gtc")) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert err.startswith("shoal-run: error: cannot resume gtc: config field 'gtc.threshold'")
    assert "is 0.1 now but 0.2" in err and "\n" not in err


@solo
def test_old_checkpoint_listing_every_field_resumes(tmp_path, capsys):
    """A checkpoint written when every field was recorded still resumes ssgd after a
    change to another algorithm's field."""
    folder = _stopped_at_6(tmp_path)
    edit_meta(folder / "step_6", lambda m: m["config"].update({"gtc.capacity": "0.5"}))
    capsys.readouterr()
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 0
    assert records(tmp_path / "metrics.jsonl")[-1]["step"] == STEPS


@solo
def test_checkpoint_with_flat_algorithm_fields_is_refused_by_name(tmp_path, capsys):
    """A checkpoint of the flat-field era (``learning_rate`` for every algorithm) is
    refused in one line that says why, not as a field that changed from 0.05 to None."""
    folder = _stopped_at_6(tmp_path)
    edit_meta(folder / "step_6", lambda m: m["config"].update({"learning_rate": "0.05"}))
    capsys.readouterr()
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 2
    err = capsys.readouterr().err.strip()
    assert "written by an older shoal, with flat algorithm fields (learning_rate" in err
    assert "--overwrite" in err and "\n" not in err


@solo
def test_overwrite_drops_the_replaced_runs_checkpoints(tmp_path, capsys):
    """--overwrite replaces a run, checkpoints included: a later --resume cannot pick up
    the replaced run's state."""
    folder = _stopped_at_6(tmp_path)
    assert run(tmp_path, algorithms=("ssgd",)) == 2  # not empty: refused, nothing touched
    assert len(list(folder.iterdir())) == 2
    capsys.readouterr()
    assert run(tmp_path, "--overwrite", algorithms=("ssgd",)) == 0
    assert list(folder.iterdir()) == []
    assert run(tmp_path, "--resume", algorithms=("ssgd",)) == 2
    assert f"no checkpoint of ssgd in {tmp_path / 'checkpoints'}" in capsys.readouterr().err


def test_orbax_info_logging_is_muted(tmp_path, caplog):
    """Orbax logs several INFO lines per save and restore; users see none of them."""
    ckpt = Checkpointer(tmp_path, "ssgd", Config(workers=2), SimBackend(2))
    caplog.set_level(logging.DEBUG)
    absl = logging.getLogger("absl")
    absl.removeFilter(checkpoint_files._orbax_info)
    try:
        ckpt.save(1, small_state(1))
    finally:
        absl.addFilter(checkpoint_files._orbax_info)
    assert any("/orbax/" in r.pathname for r in caplog.records)  # without the filter
    caplog.clear()
    ckpt.save(2, small_state(2))
    ckpt.load()
    assert not [r.getMessage() for r in caplog.records if "/orbax/" in r.pathname]
