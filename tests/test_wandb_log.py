"""``log=wandb``: the offline runs ``shoal-run`` writes hold the scalars of metrics.jsonl at
their steps and each entry's config (read back from wandb's transaction log, the
``.wandb`` file), without the network and without a wandb process left behind; seeds name
the runs; a missing package or a bad ``WANDB_MODE`` is refused before training."""

from __future__ import annotations

import doctest
import json
import os
import socket
import struct
import sys
from pathlib import Path

import harness
import pytest
from harness import QUICKSTART

from shoal.experiments.algorithms import resolve
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, load_config
from shoal.experiments.reports import wandb_log
from shoal.experiments.reports.wandb_log import write_wandb
from shoal.experiments.runner.cli import main

wandb = pytest.importorskip("wandb")  # the dev extra has it
pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="the runner starts its own workers")

ALGORITHMS = ("ssgd", "gtc[threshold=0.05]")
SETS = [
    "algorithms=" + ",".join(ALGORITHMS),
    "steps=4",
    "eval_every=2",
    "log=wandb",
    "project_workers=0",
    "train_size=256",
    "test_size=128",
    "batch_size=16",
]
# metrics.jsonl key -> the wandb key it is logged under, written out here (not imported)
# so that a changed tag fails.
KEYS = {
    "loss": "loss/train",
    "test_loss": "loss/test",
    "test_accuracy": "accuracy/test",
    "mb_sent": "wire/mb_sent",
    "mb_received": "wire/mb_received",
    "density": "wire/density",
    "noise_scale": "noise_scale",
    "skipped": "skipped",
}


def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file, a LevelDB-style log: a 7-byte header (``:W&B``,
    magic 0xBEE1, version), then 32 KiB blocks of chunks (crc32c u32, length u16, type
    u8: 1 full, 2 first, 3 middle, 4 last), a block's last < 7 bytes zero padding."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    records, parts, i = [], b"", 7
    while i + 7 <= len(data):
        if block - i % block < 7:
            i += block - i % block
            continue
        _, n, kind = struct.unpack("<IHB", data[i : i + 7])
        if kind == 0:  # zeros: the padding of a file still being written
            break
        parts += data[i + 7 : i + 7 + n]
        i += 7 + n
        if kind in (1, 4):
            records.append(pb.Record.FromString(parts))
            parts = b""
    assert not parts, "a record cut short"
    return records


def read_run(folder: Path) -> dict:
    """One offline run's name, group, config and history ({step: {key: value}})."""
    (path,) = folder.glob("run-*.wandb")
    out = {"config": {}, "history": {}}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["group"], out["project"] = (
                r.run.display_name,
                r.run.run_group,
                r.run.project,
            )
            for item in r.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in r.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in r.history.item
            }
            out["history"][r.history.step.num] = {
                k: v for k, v in row.items() if not k.startswith("_")
            }
    return out


def read_runs(out: Path) -> dict[str, dict]:
    runs = [read_run(p) for p in sorted((out / "wandb").glob("offline-run-*"))]
    by_name = {r["name"]: r for r in runs}
    assert len(by_name) == len(runs)
    return by_name


def wandb_children() -> list[str]:
    """The live wandb processes started by this one (its service, ``wandb-core``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
        state, ppid = rest.split()[:2]
        if int(ppid) == os.getpid() and "wandb" in name and state != "Z":
            found.append(name)
    return found


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """wandb as a user without an account would run it: WANDB_MODE unset, its own
    folders under tmp_path; every attempt at an internet connection recorded."""
    for name in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY", "WANDB_ERROR_REPORTING"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    attempts = []
    connect = socket.socket.connect

    def guarded(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError("no network in this test")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    return attempts


def test_runner_logs_metrics_and_config_offline(offline, tmp_path):
    out = tmp_path / "run"
    argv = [str(QUICKSTART), "--workers", "2", "--no-progress", "--out", str(out), "--set"]
    assert main([*argv, *SETS]) == 0
    assert offline == []
    assert wandb_children() == []
    assert "WANDB_ERROR_REPORTING" not in os.environ  # set only while writing
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    runs = read_runs(out)
    assert sorted(runs) == sorted(ALGORITHMS)
    for label, run in runs.items():
        assert (run["project"], run["group"]) == ("shoal", "quickstart")
        mine = [r for r in records if r["algorithm"] == label]
        assert sorted(run["history"]) == [1, 2, 3, 4]
        for r in mine:
            want = {KEYS[k]: v for k, v in r.items() if k in KEYS and v is not None}
            assert run["history"][r["step"]] == want, (label, r["step"])
        # Test metrics on the evaluation steps only, as in metrics.jsonl.
        assert [s for s, row in sorted(run["history"].items()) if "loss/test" in row] == [2, 4]
        config = run["config"]
        assert config["algorithm"] == label
        assert (config["workers"], config["steps"], config["eval_every"]) == (2, 4, 2)
        assert (config["seed"], config["task"], config["log"]) == (0, "mixture", "wandb")
        assert config["algorithms"] == list(ALGORITHMS)
        assert "params" not in config
    assert runs["gtc[threshold=0.05]"]["config"]["gtc"]["threshold"] == 0.05
    assert "gtc" not in runs["ssgd"]["config"]
    assert runs["ssgd"]["config"]["ssgd"]["local"]["learning_rate"] == 0.05  # the default
    # By hand: a ring all-reduce of 2 workers sends n float32 per worker, n = 6922 (the
    # MLP 32-64-64-10), plus the non-finite flag's int32, each step.
    assert runs["ssgd"]["history"][4]["wire/mb_sent"] == pytest.approx(4 * (6922 + 1) * 4 / 1e6)


def test_seeds_name_the_runs(offline, tmp_path):
    cfg = Config(algorithms=("ssgd",), steps=2, workers=2, batch_size=4, name="seeds")
    records = [
        {"algorithm": "ssgd", "seed": seed, "step": step, "loss": 10.0 * seed + step,
         "mb_sent": 0.5 * step, "policy": "none"}
        for seed in (0, 1)
        for step in (1, 2)
    ]  # fmt: skip
    assert write_wandb(tmp_path, cfg, records, [resolve("ssgd", cfg)]) == tmp_path / "wandb"
    runs = read_runs(tmp_path)
    assert sorted(runs) == ["ssgd/seed0", "ssgd/seed1"]
    for seed in (0, 1):
        run = runs[f"ssgd/seed{seed}"]
        assert run["config"]["seed"] == seed and run["group"] == "seeds"
        assert run["history"] == {
            step: {"loss/train": 10.0 * seed + step, "wire/mb_sent": 0.5 * step, "policy": "none"}
            for step in (1, 2)
        }
    assert offline == [] and wandb_children() == []


def test_wandb_mode_is_honoured(offline, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = Config(algorithms=("ssgd",), steps=1, workers=2, batch_size=4)
    write_wandb(tmp_path, cfg, [{"algorithm": "ssgd", "step": 1, "loss": 1.0}])
    assert not list(tmp_path.glob("wandb/offline-run-*"))
    monkeypatch.setenv("WANDB_MODE", "offlin")
    with pytest.raises(ConfigError, match="WANDB_MODE='offlin' must be one of"):
        apply_overrides(load_config(QUICKSTART), ["log=wandb"])


def test_missing_wandb_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(
        ConfigError, match=r"pip install wandb \(from shoal's clone: pip install -e '\.\[wandb\]'\)"
    ):
        apply_overrides(load_config(QUICKSTART), ["log=wandb"])
    with pytest.raises(ImportError, match=r"pip install wandb"):
        write_wandb(tmp_path, Config(), [])


def test_docstring_examples_run():
    result = doctest.testmod(wandb_log, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted >= 1
