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
    "powersgd[powersgd_rank=1]",
    "powersgd[powersgd_rank=4]",
    "topk[topk_fraction=0.01]",
    "topk[topk_fraction=0.1]",
    "demo",
    "diloco",
    "diloco[diloco_exchange=topk;topk_fraction=0.1;topk_value_bits=2]",
)
# Shared by both tasks: the compressors' own settings.
COMMON = dict(
    algorithms=ENTRIES,
    workers=8,
    eval_every=25,
    project_workers=64,
    gtc_threshold=0.1,
    gtc_capacity=0.05,
    lamb_learning_rate=1e-3,
    lamb_lr_decay="cosine",
    onebit_freeze_fraction=0.15,
    diloco_sync_every=10,
    diloco_inner_lr=1e-3,
    demo_lr=0.01,
    demo_momentum=0.9,
)


def get_config() -> Config:
    return Config(
        name="compression_pareto",
        task="images",
        cnn="even",
        train_size=32768,
        test_size=2048,
        steps=300,
        batch_size=32,
        learning_rate=0.05,
        momentum=0.9,
        **COMMON,
    )
