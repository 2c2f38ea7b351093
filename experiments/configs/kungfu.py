"""KungFu's flexible synchronisation on an image task: S-SGD vs partial gradient exchange
(PGX) at fractions 1, 0.3 and 0.1 vs peer model averaging (round robin and random
derangements, staleness 0 and 1) vs synchronous model averaging (SMA) vs the closed-loop
policy (full exchange until the gradient noise scale passes a threshold, then PGX 0.1).

Run with ``shoal-run experiments/configs/kungfu.py`` (about 2 minutes on 2 CPU cores);
it writes ``runs/kungfu/``: the comparison table in ``summary.md``, test accuracy vs
step (``accuracy_vs_step.png``) and loss vs MB sent per worker.

Task: 16x16 generated glyph images, 10 classes (`shoal.experiments.tasks.images`), a small CNN
(two conv stages, one hidden layer of 64 stored as 16 column blocks, so that no leaf
exceeds 10% of the gradient and PGX 0.1 is possible). 8 simulated workers x 32 examples,
SGD with momentum 0.9 and learning rate 0.05 for every algorithm. The noise-scale
threshold (150) and the first step the policy may act (100) come from an S-SGD run of
this config: the estimate swings early, falls to ~30-100 around steps 40-90, then grows
past 150 as training settles.
"""

from shoal.experiments.config import Config

ALGORITHMS = (
    "ssgd",
    "partial_exchange[fraction=1.0]",
    "partial_exchange[fraction=0.3]",
    "partial_exchange[fraction=0.1]",
    "peer_averaging[strategy=round_robin;staleness=0]",
    "peer_averaging[strategy=round_robin;staleness=1]",
    "peer_averaging[strategy=random;staleness=0]",
    "peer_averaging[strategy=random;staleness=1]",
    "sma",
    "adaptive",
)


def get_config() -> Config:
    return Config(
        name="kungfu",
        algorithms=ALGORITHMS,
        task="images",
        cnn="even",
        train_size=32768,
        test_size=2048,
        workers=8,
        steps=300,
        batch_size=32,
        eval_every=25,
        # Every algorithm's local optimizer is momentum SGD at 0.05 and 0.9 and SMA's
        # alpha 0.1 (the defaults). adaptive: every 10 steps from step 100, PGX at 0.1 once
        # the noise scale's median passes 150.
        params={"adaptive": {"threshold": 150.0, "every": 10, "after": 100, "fraction": 0.1}},
    )
