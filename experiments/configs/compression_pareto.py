"""Compressors at equal footing: final loss against total bytes (the Pareto front) on the
image task, 8 simulated workers, every entry the same steps and batches (about 6 minutes
on 2 CPU cores). ``compression_pareto_lm.py`` runs the same entries on the byte-level LM.

Run with ``shoal-run experiments/configs/compression_pareto.py``. Entries: S-SGD, GTC,
1-bit LAMB, PowerSGD (rank 1 and 4), top-k with error feedback (1% and 10% of each chunk
of 64), DeMo, and DiLoCo (H = 10) with a float32 and with a top-k exchange (SparseLoCo's:
10% of each chunk, 2-bit values). ``loss_vs_mb.png`` plots loss against MB sent on a log
axis; the summary's "projected step ms" column times each run's collectives on 64
workers of the preset cluster (`shoal.costmodel`).

1-bit LAMB stands for the 1-bit family: ``onebit_adam`` (a runner entry too) diverged on
this CNN right after its freeze step, at learning rates 1e-3 and 1e-4: elements whose
frozen variance is (nearly) zero take ``scale / eps`` steps from the +-scale compressed
momentum (see `shoal.optim.onebit_adam`'s ``momentum_mask``); LAMB's trust ratio bounds
them.
"""

from shoal.experiments.config import Config

ENTRIES = (
    "ssgd",
    "gtc",
    "onebit_lamb",
    "powersgd[rank=1]",
    "powersgd[rank=4]",
    "topk[fraction=0.01]",
    "topk[fraction=0.1]",
    "demo",
    "diloco",
    "diloco[exchange.codec=topk;exchange.topk.fraction=0.1;exchange.topk.value_bits=2]",
)
# The entries whose local optimizer is momentum SGD (``local``): the task sets its rate.
LOCAL = ("ssgd", "gtc", "powersgd", "topk")
# Shared by both tasks: the entries and the run's shape.
COMMON = dict(
    algorithms=ENTRIES,
    workers=8,
    eval_every=25,
    project_workers=64,
)


def params(learning_rate: float = 0.05) -> dict[str, dict]:
    """The compressors' own settings, shared by both tasks, and the task's local learning
    rate (momentum 0.9) for every entry in `LOCAL`. The rest are the defaults: GTC's tau
    0.1, 1-bit LAMB's freeze at 15% of the steps, DiLoCo's H = 10 and inner AdamW at 1e-3."""
    own: dict[str, dict] = {
        "gtc": {"capacity": 0.05},
        "onebit_lamb": {"learning_rate": 1e-3, "lr_decay": "cosine"},
        "demo": {"learning_rate": 0.01, "momentum": 0.9},
    }
    for name in LOCAL:
        own[name] = {**own.get(name, {}), "local": {"learning_rate": learning_rate}}
    return own


def get_config() -> Config:
    return Config(
        name="compression_pareto",
        task="images",
        cnn="even",
        train_size=32768,
        test_size=2048,
        steps=300,
        batch_size=32,
        params=params(learning_rate=0.05),
        **COMMON,
    )
