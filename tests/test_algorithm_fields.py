"""The `Config` fields each registered algorithm declares as its own (``register(...,
fields=...)``) cover what its builder and check read: a builder that read another
algorithm's field without declaring it would let ``--resume`` accept a change that alters
its training. Reads are recorded on a `Config` subclass while the builder runs."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from shoal.comms import AxisCollective
from shoal.experiments import algorithms
from shoal.experiments.config import Config

FIELDS = frozenset(f.name for f in dataclasses.fields(Config))


def fields_read(name: str, cfg: Config) -> set[str]:
    """The fields of ``cfg`` that algorithm ``name``'s check and builder read."""
    reads: set[str] = set()
    quiet = [False]

    class Recording(Config):
        # Validation and dataclasses.replace read every field: not the builder's reads.
        def __getattribute__(self, attr):
            if attr in FIELDS and not quiet[0]:
                if sys._getframe(1).f_globals.get("__name__") != "dataclasses":
                    reads.add(attr)
            return object.__getattribute__(self, attr)

        def __post_init__(self):
            quiet[0] = True
            try:
                super().__post_init__()
            finally:
                quiet[0] = False

    rec = Recording(**{f: getattr(cfg, f) for f in FIELDS})
    algo = algorithms.ALGORITHMS[name]
    world = AxisCollective("workers", cfg.workers)
    comms = world.split(cfg.group_size) if algo.two_tier else world
    if algo.check is not None:
        algo.check(rec)
    args = (algorithms.BuildContext(),) if algo.context else ()
    algo.build(rec, comms, *args)
    return reads


CFG = Config(workers=4, steps=20, block_size=10, group_size=2)
DECLARED = frozenset().union(*(a.fields or () for a in algorithms.ALGORITHMS.values()))


@pytest.mark.parametrize(
    "name, cfg",
    [(n, CFG) for n in sorted(algorithms.ALGORITHMS)]
    + [("adaptive", dataclasses.replace(CFG, adaptive_sync="partial"))],
)
def test_builders_read_only_their_own_or_common_fields(name, cfg):
    own = algorithms.ALGORITHMS[name].fields
    assert own is not None, f"{name} declares no fields"
    assert own <= FIELDS, sorted(own - FIELDS)
    undeclared = fields_read(name, cfg) & (DECLARED - own)
    assert not undeclared, f"{name} reads {sorted(undeclared)} without declaring them"


def test_recording_sees_the_reads():
    assert {"gtc_threshold", "gtc_capacity", "learning_rate"} <= fields_read("gtc", CFG)
    assert "pgx_fraction" not in fields_read("adaptive", CFG)  # full sync: no PGX


def test_unused_fields():
    assert "gtc_threshold" in algorithms.unused_fields("ssgd")
    assert "gtc_threshold" not in algorithms.unused_fields("gtc[gtc_capacity=0.1]")
    assert "gtc_threshold" not in algorithms.unused_fields("bmuf_gtc")
    common = {"learning_rate", "seed", "workers", "steps", "batch_size", "task", "hidden"}
    assert not common & algorithms.unused_fields("ssgd")
    assert algorithms.unused_fields("not_registered") == frozenset()
