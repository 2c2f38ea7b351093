"""Quickstart: S-SGD, GTC, BMUF, two-tier BMUF_GTC and 1-bit LAMB on 8 simulated workers,
well under a minute on 2 CPU cores.

Run with ``shoal-run experiments/configs/quickstart.py --workers 8`` (``make run``).
BMUF syncs every 10 steps; BMUF_GTC runs GTC inside 2 groups of 4 workers and BMUF
across them. ``steps`` is a multiple of ``block_size``, so the last step is a BMUF step.
1-bit LAMB all-reduces densely for its first 30 steps (15%), then sends its momentum as
signs: about 5.6x fewer bytes than S-SGD over the run.
"""

from shoal.experiments.config import Config


def get_config() -> Config:
    return Config(
        name="quickstart",
        algorithms=("ssgd", "gtc", "bmuf", "bmuf_gtc", "onebit_lamb", "bfb"),
        workers=8,
        steps=200,
        batch_size=32,
        eval_every=25,
        learning_rate=0.05,
        momentum=0.9,
        block_size=10,
        group_size=4,
        lamb_learning_rate=0.02,
        onebit_freeze_fraction=0.15,
    )
