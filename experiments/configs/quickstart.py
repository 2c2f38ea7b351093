"""Quickstart: S-SGD and GTC on 8 simulated workers, well under a minute on 2 CPU cores.

Run with ``shoal-run experiments/configs/quickstart.py --workers 8`` (``make run``).
"""

from shoal.experiments.config import Config


def get_config() -> Config:
    return Config(
        name="quickstart",
        algorithms=("ssgd", "gtc"),
        workers=8,
        steps=200,
        batch_size=32,
        eval_every=25,
        learning_rate=0.05,
        momentum=0.9,
    )
